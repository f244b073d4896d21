"""What MTP buys on the shipped checkpoint (issue #38): held-out loss, MTP acceptance rate and decode tokens/s
with MTP speculative decoding (k = 1, 2, 3 drafts per round) against plain greedy decoding, at batch 1 and 32.

    python -m benchmarks.mtp_speedup --budget-s 230 --out $OUT/mtp.json      # GPU (bf16; scripts/gpu_figures.sh mtp)
    python -m benchmarks.mtp_speedup --smoke --out /tmp/mtp_smoke.json       # CPU check of the script (fp32)
    python -m benchmarks.mtp_speedup --dtype float32 --backend xla --batch 1 32 --new-tokens 64 --repeats 1 \\
        --out benchmarks/results/mtp_speedup_cpu.json                         # the CPU figures of docs/model.md

Prompts are ``--prompt-len``-token windows of the held-out stdlib files (evenly spaced over the held-out
stream, the split of :mod:`tokenspeed_jax.models.deepseek.train`; the stream depends on the running Python's
stdlib, so the JSON records the Python version and the stream's length), as many as the largest batch;
batch B runs them as consecutive groups of B (batch 1: each prompt alone, one after another).  Points run
k-major (plain at every batch first, then k = 1 at every batch, ...), so a budget cut keeps whole k's.
Every (B, k) runs in one :class:`~tokenspeed_jax.models.deepseek.engine.Engine` (``--backend``): one
compile-and-run pass (``warmup_s``), then ``--repeats`` timed passes over the groups; decode tokens/s is
the engine's own figure (decode tokens, after each request's first, over its decode seconds, prefill
excluded), summed over the groups, the median over the repeats.  Acceptance rate = accepted drafts /
drafted tokens over all prompts; ``same_as_plain`` = fraction of requests whose tokens equal plain greedy
decoding of the same batch (1.0 in fp32; bf16 kernels may flip near-ties), ``same_tokens_fraction`` the
same over token positions.  The held-out loss is the main model's (and the MTP layer's) mean cross entropy
over ``--loss-windows`` fixed windows of the model's context length (``max_position_embeddings``),
teacher-forced (xla attention).  Last (``--agreement``), the kernel backends against the ``xla`` reference:
the largest batch's plain greedy tokens, decoded again with ``--backend xla`` on the same prompts (the fraction of
requests and of token positions that are equal, and where the first difference falls).

``--budget-s`` skips the points that no longer fit, with the reason.  The JSON (``--out``, rewritten after
every point) records commit, command, date, device, jax version and the attention backends that ran
(decode and prefill separately: on an H200 the sm90 decode kernel; the prefill's sm90 path needs
FlashAttention-4, without it the xla reference runs and the JSON says so); the table printed at the end
is the one docs/model.md quotes.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import time
import traceback

import jax.numpy as jnp
import numpy as np

from benchmarks.runinfo import Budget, Results, parse_with_smoke

# --smoke: the defaults it changes (arguments given explicitly still win)
SMOKE = {
    "dtype": "float32",
    "batch": [1, 2],
    "k": [0, 1],
    "prompt_len": 16,
    "new_tokens": 8,
    "repeats": 1,
    "loss_windows": 2,
    "compile_guess_s": 20.0,
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the shipped one)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "xla", "sm90", "sm100"],
        help="attention backend (auto: the kernels where they support the call, else xla; the JSON "
        "records what ran)",
    )
    ap.add_argument("--page-size", type=int, default=64, help="cache page size (the CLI's default)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--k", type=int, nargs="+", default=[0, 1, 2, 3], help="drafts per round (0 = plain)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--loss-windows", type=int, default=64)
    ap.add_argument(
        "--agreement",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="last: greedy tokens of the largest batch's plain run against the xla reference backend",
    )
    ap.add_argument(
        "--budget-s", type=float, default=None, help="skip points that no longer fit (from start)"
    )
    ap.add_argument(
        "--compile-guess-s",
        type=float,
        default=30.0,
        help="estimated warm-up of an unseen (batch, k), until one is measured",
    )
    ap.add_argument("--smoke", action="store_true", help="CPU check: fp32, batch 1 2, k 0 1, short prompts")
    ap.add_argument("--commit", default=None, help="commit to record when the checkout has no .git")
    ap.add_argument("--out", default=None, help="JSON file, rewritten after every point")
    return ap


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_with_smoke(_parser(), SMOKE, argv)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}"


def run(args, res: Results) -> None:
    from tokenizers import Tokenizer
    from tokenspeed_jax.models.deepseek import Engine, load_checkpoint
    from tokenspeed_jax.models.deepseek.checkpoints import default_checkpoint
    from tokenspeed_jax.models.deepseek.train import heldout_losses, heldout_windows

    ckpt = args.checkpoint or default_checkpoint()
    dtype = jnp.dtype(args.dtype)
    model = load_checkpoint(ckpt, dtype=dtype, progress=False)
    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    ctx = model.config.max_position_embeddings
    stream = _heldout(tok, res, need=ctx + 2 + args.prompt_len * max(args.batch))
    res.set("checkpoint", os.path.basename(os.path.normpath(ckpt)))
    res.set("heldout_tokens", len(stream))
    if args.prompt_len + args.new_tokens + 2 * max(args.k) + 1 > ctx:
        res.note(f"prompt + new tokens exceed the trained context {ctx}")

    # ---- held-out loss
    if args.loss_windows and res.fits("loss", "heldout", args.compile_guess_s / 2):
        try:
            with res.clock.span() as sp:
                t = time.perf_counter()
                loss, mtp_loss = heldout_losses(model, heldout_windows(stream, ctx, args.loss_windows))
            res.set("heldout_loss", loss)
            res.set("heldout_mtp_loss", mtp_loss)
            res.add(
                "loss",
                {
                    "heldout_loss": loss,
                    "heldout_mtp_loss": mtp_loss,
                    "windows": args.loss_windows,
                    "window_tokens": ctx,
                    "seconds": round(time.perf_counter() - t, 2),
                    "compile_s": sp["seconds"],
                },
            )
            print(
                f"held-out loss {loss:.4f} nats/token (MTP head {mtp_loss:.4f}) over {args.loss_windows} "
                f"windows of {ctx} tokens",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001
            res.skip("loss", "heldout", f"error: {_err(e)}")
            traceback.print_exc()

    # ---- decode speed, k-major
    nmax = max(args.batch)
    starts = np.linspace(0, len(stream) - args.prompt_len - 1, nmax).astype(np.int64)
    prompts = [stream[s : s + args.prompt_len].tolist() for s in starts]
    plain: dict[int, list] = {}
    base: dict[int, float] = {}
    warm_seen: list[float] = []
    run_seen: dict[int, float] = {}
    for k in sorted(args.k):
        for B in args.batch:
            what = f"B={B} k={k}"
            est = (max(warm_seen) if warm_seen else args.compile_guess_s) + run_seen.get(B, 1.0) * (
                args.repeats + 1
            )
            if not res.fits("decode", what, est):
                continue
            try:
                # Batch B runs the first nmax prompts in nmax // B groups of B, one after another (the same
                # shapes: one compile), so batch 1 is not the figure of a single prompt.
                groups = [prompts[i : i + B] for i in range(0, nmax - B + 1, B)]
                eng = Engine(model, backend=args.backend, page_size=args.page_size)
                with res.clock.span() as sp:
                    t = time.perf_counter()
                    eng.generate(groups[0], args.new_tokens, num_speculative_tokens=k)  # compile + run
                    warm = time.perf_counter() - t
                warm_seen.append(warm)
                times, walls = [], []
                out = None
                for _ in range(args.repeats):
                    if times and not res.budget.allows(walls[-1] + 2):
                        res.note(f"{what}: {len(times)} of {args.repeats} repeats (budget)")
                        break
                    t = time.perf_counter()
                    out = [eng.generate(g, args.new_tokens, num_speculative_tokens=k) for g in groups]
                    walls.append(time.perf_counter() - t)
                    times.append(sum(r.decode_s for r in out))
                run_seen[B] = max(walls)
                dec_s = statistics.median(times)
                tokens = [t for r in out for t in r.tokens]
                ntok = sum(r.decode_tokens for r in out)
                drafted = sum(r.draft_tokens for r in out)
                accepted = sum(r.accepted_tokens for r in out)
                if k == 0:
                    plain[B] = tokens
                    base[B] = ntok / dec_s
                ref = plain.get(B)
                row = {
                    "batch": B,
                    "k": k,
                    "groups": len(groups),
                    "decode_tokens": ntok,
                    "decode_s": dec_s,
                    "decode_s_all": times,
                    "tokens_per_s": ntok / dec_s,
                    "speedup": (ntok / dec_s) / base[B] if B in base else None,
                    "acceptance_rate": accepted / drafted if drafted else None,
                    "draft_tokens": drafted,
                    "accepted_tokens": accepted,
                    "tokens_per_round": (ntok / (drafted // k)) if k and drafted else None,
                    "same_as_plain": None
                    if ref is None
                    else sum(a == b for a, b in zip(ref, tokens)) / len(ref),
                    "same_tokens_fraction": None if ref is None else _same_positions(ref, tokens),
                    "warmup_s": round(warm, 2),
                    "warmup_compile_s": sp["seconds"],
                    "repeats": len(times),
                }
                res.add("decode", row)
                print(json.dumps({kk: v for kk, v in row.items() if kk != "decode_s_all"}), flush=True)
            except Exception as e:  # noqa: BLE001
                res.skip("decode", what, f"error: {_err(e)}")
                traceback.print_exc()

    # ---- agreement of the kernel backends with the xla reference (greedy, the largest batch's plain run)
    if args.agreement and res.fits("agreement", f"B={nmax} xla", args.compile_guess_s + run_seen.get(nmax, 1.0)):
        try:
            _agreement(args, res, model, [prompts[i : i + nmax] for i in range(0, nmax, nmax)], plain.get(nmax))
        except Exception as e:  # noqa: BLE001
            res.skip("agreement", f"B={nmax} xla", f"error: {_err(e)}")
            traceback.print_exc()


def _agreement(args, res: Results, model, groups: list, tokens: list | None) -> None:
    """Greedy tokens of ``--backend`` (the plain run's, else run here) against the ``xla`` reference backend on the
    same prompts and batch: the fraction of requests whose tokens are all equal, of equal token positions, and
    where the first difference falls (a bf16 kernel's rounding differs from the reference's, so near-ties of the
    logits can flip a token; after a flip the two continuations are different texts)."""
    from tokenspeed_jax.models.deepseek import Engine

    def greedy(backend):
        eng = Engine(model, backend=backend, page_size=args.page_size)
        return [t for g in groups for t in eng.generate(g, args.new_tokens).tokens]

    if tokens is None:
        tokens = greedy(args.backend)
    ref = greedy("xla")
    first = [next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), None) for a, b in zip(tokens, ref)]
    diverged = [i for i in first if i is not None]
    row = {
        "batch": len(groups[0]),
        "requests": len(ref),
        "new_tokens": args.new_tokens,
        "backend": args.backend,
        "same_requests": sum(a == b for a, b in zip(tokens, ref)) / len(ref),
        "same_tokens_fraction": _same_positions(ref, tokens),
        "first_difference_at": diverged,
        "first_difference_median": statistics.median(diverged) if diverged else None,
    }
    res.add("agreement", row)
    print(json.dumps(row), flush=True)


def _heldout(tok, res: Results, need: int) -> np.ndarray:
    """The held-out stdlib stream (:func:`~tokenspeed_jax.models.deepseek.train.heldout_stream`); where this
    Python ships no stdlib sources (or too few), this repository's ``.py`` files instead (also never trained
    on), with a note."""
    from tokenspeed_jax.models.deepseek.train import encode_stream, heldout_stream, read_source, stdlib_dir

    try:
        stream = heldout_stream(tok)
        res.set("heldout_source", f"held-out stdlib files of {stdlib_dir()}")
    except (OSError, ValueError) as e:  # no .py files: np.concatenate of nothing
        stream, why = None, _err(e)
    else:
        why = f"{len(stream)} tokens, {need} needed"
    if stream is None or len(stream) < need:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        files = sorted(
            os.path.relpath(f, root)
            for d in ("tokenspeed_jax", "models", "benchmarks")
            for f in glob.glob(os.path.join(root, d, "**", "*.py"), recursive=True)
        )
        stream = encode_stream(tok, [read_source(root, f) for f in files])
        res.set("heldout_source", f"this repository's {len(files)} .py files (stdlib stream unusable: {why})")
        res.note(f"held-out text: {res.doc['heldout_source']}")
    return stream


def _same_positions(a: list[list[int]], b: list[list[int]]) -> float:
    same = total = 0
    for x, y in zip(a, b):
        n = max(len(x), len(y))
        same += sum(p == q for p, q in zip(x, y))
        total += n
    return same / total if total else 1.0


def table(doc: dict) -> str:
    rows = [r for r in doc["points"] if r["section"] == "decode"]
    lines = [f"{'batch':>5} {'k':>2} {'tok/s':>10} {'speedup':>8} {'accept':>7} {'same':>6}"]
    for r in rows:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        same = "-" if r["same_as_plain"] is None else f"{r['same_as_plain']:.3f}"
        lines.append(f"{r['batch']:>5} {r['k']:>2} {r['tokens_per_s']:>10.1f} {sp:>8} {acc:>7} {same:>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    res = Results(
        args.out,
        "mtp_speedup",
        {k: v for k, v in vars(args).items() if k not in ("out", "commit")},
        Budget(args.budget_s),
        commit=args.commit,
    )
    with res.running():
        run(args, res)
    print("\n" + table(res.doc))
    if res.doc.get("heldout_loss") is not None:
        print(f"held-out loss {res.doc['heldout_loss']:.4f} (MTP {res.doc['heldout_mtp_loss']:.4f})")
    for r in (r for r in res.doc["points"] if r["section"] == "agreement"):
        print(
            f"agreement with xla, B={r['batch']} x {r['new_tokens']} greedy tokens: {r['same_requests']:.3f} of "
            f"requests identical, {r['same_tokens_fraction']:.3f} of token positions"
        )
    print(f"attention backends: {res.backends.line()}")
    for s in res.doc["skipped"]:
        print(f"skipped {s['section']} {s['what']}: {s['reason']}")
    print(f"{res.doc['status']} in {res.doc['elapsed_s']} s" + (f"; wrote {args.out}" if args.out else ""))
    return res.doc


if __name__ == "__main__":
    main()
