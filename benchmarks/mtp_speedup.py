"""What MTP buys on the shipped checkpoint: held-out loss, MTP acceptance rate and decode tokens/s with MTP
speculative decoding (k = 1, 2, 3 drafts per round) against plain greedy decoding, at batch 1 and 32.

    python -m benchmarks.mtp_speedup --out benchmarks/results/mtp_speedup_h200.json          # GPU (bf16)
    python -m benchmarks.mtp_speedup --dtype float32 --batch 1 4 --new-tokens 32 --repeats 1 \\
        --out /tmp/mtp_speedup_cpu.json                                                       # CPU smoke run

Prompts are ``--prompt-len``-token windows of the held-out stdlib files (evenly spaced over the held-out
stream, the split of :mod:`tokenspeed_jax.models.deepseek.train`), as many as the largest batch; batch B
runs them as consecutive groups of B (batch 1: each prompt alone, one after another).  Every (B, k) runs
in one :class:`~tokenspeed_jax.models.deepseek.engine.Engine` (``--backend``): one compile-and-run, then
``--repeats`` timed passes over the groups; decode tokens/s is the engine's own figure
(``B * (new_tokens - 1)`` per group over its decode seconds, prefill excluded), summed over the groups,
the median over the repeats.  Acceptance rate = accepted drafts / drafted tokens over all prompts; ``same_as_plain`` = fraction of generated tokens
equal to plain greedy decoding of the same batch (1.0 in fp32; bf16 kernels may flip near-ties).
The held-out loss is the main model's (and the MTP layer's) mean cross entropy over ``--loss-windows``
fixed windows of the model's context length (``max_position_embeddings``), teacher-forced.

The JSON holds the command, commit, date, device and every row; the table printed at the end is the
one docs/model.md quotes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import provenance


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except Exception:  # noqa: BLE001 - not a git checkout
        return "unknown"


def main(argv: list[str] | None = None) -> dict:
    from tokenizers import Tokenizer
    from tokenspeed_jax.models.deepseek import Engine, load_checkpoint
    from tokenspeed_jax.models.deepseek.checkpoints import default_checkpoint
    from tokenspeed_jax.models.deepseek.train import heldout_losses, heldout_stream, heldout_windows

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the shipped one)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--page-size", type=int, default=64, help="cache page size (the CLI's default)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--k", type=int, nargs="+", default=[0, 1, 2, 3], help="drafts per round (0 = plain)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--loss-windows", type=int, default=64)
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args(argv)

    ckpt = args.checkpoint or default_checkpoint()
    dtype = jnp.dtype(args.dtype)
    model = load_checkpoint(ckpt, dtype=dtype, progress=False)
    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    stream = heldout_stream(tok)
    ctx = model.config.max_position_embeddings
    if args.prompt_len + args.new_tokens + 2 * max(args.k) + 1 > ctx:
        print(f"note: prompt + new tokens exceed the trained context {ctx}", file=sys.stderr)

    loss, mtp_loss = heldout_losses(model, heldout_windows(stream, ctx, args.loss_windows))
    print(f"held-out loss {loss:.4f} nats/token (MTP head {mtp_loss:.4f}) over {args.loss_windows} windows "
          f"of {ctx} tokens", flush=True)

    nmax = max(args.batch)
    starts = np.linspace(0, len(stream) - args.prompt_len - 1, nmax).astype(np.int64)
    prompts = [stream[s : s + args.prompt_len].tolist() for s in starts]

    rows = []
    for B in args.batch:
        # Batch B runs the first nmax prompts in nmax // B groups of B, one after another (the same shapes:
        # one compile), so batch 1 is not the figure of a single prompt.
        groups = [prompts[i : i + B] for i in range(0, nmax - B + 1, B)]
        plain = None
        for k in sorted(args.k):
            eng = Engine(model, backend=args.backend, page_size=args.page_size)
            eng.generate(groups[0], args.new_tokens, num_speculative_tokens=k)  # compile + run
            times = []
            for _ in range(args.repeats):
                res = [eng.generate(g, args.new_tokens, num_speculative_tokens=k) for g in groups]
                times.append(sum(r.decode_s for r in res))
            dec_s = statistics.median(times)
            tokens = [t for r in res for t in r.tokens]
            ntok = sum(r.decode_tokens for r in res)
            drafted = sum(r.draft_tokens for r in res)
            accepted = sum(r.accepted_tokens for r in res)
            if k == 0:
                plain = tokens
            same = None if plain is None else float((np.asarray(plain) == np.asarray(tokens)).mean())
            row = {
                "batch": B, "k": k, "groups": len(groups), "decode_tokens": ntok, "decode_s": dec_s,
                "decode_s_all": times, "tokens_per_s": ntok / dec_s,
                "acceptance_rate": accepted / drafted if drafted else None, "draft_tokens": drafted,
                "accepted_tokens": accepted,
                "tokens_per_round": (ntok / (drafted // k)) if k and drafted else None,
                "same_as_plain": same,
            }
            rows.append(row)
            print(json.dumps({kk: v for kk, v in row.items() if kk != "decode_s_all"}), flush=True)

    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["k"] == 0}
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base[r["batch"]] if r["batch"] in base else None

    print(f"\n{'batch':>5} {'k':>2} {'tok/s':>10} {'speedup':>8} {'accept':>7} {'same':>6}")
    for r in rows:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        same = "-" if r["same_as_plain"] is None else f"{r['same_as_plain']:.3f}"
        print(f"{r['batch']:>5} {r['k']:>2} {r['tokens_per_s']:>10.1f} {sp:>8} {acc:>7} {same:>6}")

    doc = {
        **provenance(),
        "commit": _commit(),
        "checkpoint": os.path.basename(os.path.normpath(ckpt)),
        "dtype": args.dtype,
        "backend": args.backend,
        "args": vars(args),
        "heldout_loss": loss,
        "heldout_mtp_loss": mtp_loss,
        "heldout_tokens": int(len(stream)),
        "python": sys.version.split()[0],
        "jax_devices": [str(d) for d in jax.devices()],
        "rows": rows,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.out}")
    return doc


if __name__ == "__main__":
    main()
