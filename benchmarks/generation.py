"""End-to-end generation benchmark of the DeepSeek model engine: continuous vs static batching, MTP
speculative decoding (k = 1..3) vs plain decode, greedy MTP vs plain greedy agreement, and warm start.

    python -m benchmarks.generation                          # H200: small preset, bf16, 256 prompts
    python -m benchmarks.generation --checkpoint DIR         # a trained checkpoint (meaningful MTP)
    python -m benchmarks.generation --cpu-smoke              # CPU: tiny preset, 16 short prompts

Sections (``--sections``, default all):

* ``batching``: ``--num-prompts`` prompts with mixed prompt lengths (uniform in ``--prompt-lens``) and
  mixed output lengths (uniform in ``--output-lens``, EOS ignored so every request runs its length),
  decoded through ``--max-slots`` slots with ``batching="continuous"`` and ``"static"`` (batch after
  batch); generated tokens per second of wall time (prefill included), after one warm-up run each.
* ``mtp``: the same workload with continuous batching, plain decode and MTP k = 1, 2, 3: tokens/s,
  acceptance rate, and (greedy) the fraction of requests whose tokens equal plain greedy decoding with
  the position of the first difference (bf16 near-ties: the S = k+1 verify rounds differently from S = 1).
* ``early_stop``: one batch of ``--max-slots`` requests (nothing pending) where all run the longest output
  length, half stop after 4 tokens, or all stop after 4: decode steps and time (what finished requests
  cost while others of their batch still run, and that a batch whose requests all stopped stops).
* ``warmstart``: ``python -m tokenspeed_jax.models.deepseek --preset P`` twice in fresh processes sharing
  a fresh cache directory (``TOKENSPEED_JAX_CACHE_DIR``: XLA and CuTe caches); the CLI's ``warmup_s``
  (first run to its first decode, compile included) and each process's wall time.

Writes ``--out`` (default ``benchmarks/results/generation_<device>_<date>.json``) with the commit, the
command, the date and the device.  With random weights the MTP layer drafts random tokens (acceptance
~0): MTP figures need a trained checkpoint.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--preset", default="small", help="config preset with generated weights")
    p.add_argument("--checkpoint", default=None, metavar="DIR", help="load this checkpoint instead")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--backend", default="auto", choices=["auto", "xla", "sm90", "sm100"])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--prompt-lens", default="32,512", help="min,max prompt length (uniform)")
    p.add_argument("--output-lens", default="16,256", help="min,max new tokens (uniform)")
    p.add_argument("--max-slots", type=int, default=64)
    p.add_argument("--page-size", type=int, default=64, choices=[16, 32, 64, 128, 256])
    p.add_argument("--mtp-k", default="1,2,3", help="speculative tokens to compare with plain decode")
    p.add_argument("--sections", default="batching,mtp,early_stop,warmstart")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, metavar="FILE")
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="small settings that run on a CPU: tiny preset, 16 prompts of 4-24 tokens, 2-12 new tokens, "
        "4 slots, page 16, k = 1",
    )
    return p


def _pair(s: str) -> tuple[int, int]:
    a, b = (int(x) for x in s.split(","))
    return a, b


def _workload(args, vocab: int):
    rng = np.random.default_rng(args.seed)
    lo, hi = _pair(args.prompt_lens)
    olo, ohi = _pair(args.output_lens)
    lens = rng.integers(lo, hi + 1, args.num_prompts)
    outs = rng.integers(olo, ohi + 1, args.num_prompts).tolist()
    prompts = [rng.integers(0, vocab, n).tolist() for n in lens]
    return prompts, outs


def _run(engine, prompts, outs, **kw) -> dict:
    engine.generate(prompts, outs, eos_token_id=[], **kw)  # warm-up (compile)
    res = engine.generate(prompts, outs, eos_token_id=[], **kw)
    gen = res.generated_tokens
    return {
        "generated_tokens": gen,
        "wall_s": res.wall_s,
        "tokens_per_s": gen / res.wall_s,
        "prefill_s": res.prefill_s,
        "decode_s": res.decode_s,
        "decode_calls": res.decode_calls,
        "decode_steps": res.decode_steps,
        "acceptance_rate": res.acceptance_rate,
        "_tokens": res.tokens,
    }


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cpu_smoke:
        args.preset, args.num_prompts, args.prompt_lens, args.output_lens = "tiny", 16, "4,24", "2,12"
        args.max_slots, args.page_size, args.mtp_k = 4, 16, "1"
    from tokenspeed_jax.models.deepseek import DeepseekV3, DeepseekV3Config, Engine, load_checkpoint

    sections = set(args.sections.split(","))
    platform = jax.default_backend()
    dtype = {"auto": jnp.bfloat16 if platform == "gpu" else jnp.float32, "float32": jnp.float32,
             "bfloat16": jnp.bfloat16}[args.dtype]  # fmt: skip
    doc = {
        **provenance(),
        "commit": _commit(),
        "model": args.checkpoint or f"preset:{args.preset} (generated weights)",
        "dtype": jnp.dtype(dtype).name,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "results": {},
    }
    if sections & {"batching", "mtp"}:
        model = (
            load_checkpoint(args.checkpoint, dtype=dtype)
            if args.checkpoint
            else DeepseekV3.random(DeepseekV3Config.preset(args.preset), dtype=dtype, seed=args.seed)
        )
        prompts, outs = _workload(args, model.config.vocab_size)
        doc["workload"] = {"prompt_tokens": sum(map(len, prompts)), "max_new_tokens_total": sum(outs)}
        ekw = {"page_size": args.page_size, "backend": args.backend, "max_slots": args.max_slots}
        if "batching" in sections:
            r = doc["results"]["batching"] = {}
            for mode in ("continuous", "static"):
                t = _run(Engine(model, batching=mode, **ekw), prompts, outs)
                t.pop("_tokens")
                r[mode] = t
                print(
                    f"batching {mode:10s}: {t['tokens_per_s']:10.1f} tokens/s ({t['wall_s']:.2f} s)",
                    flush=True,
                )
            r["speedup"] = r["continuous"]["tokens_per_s"] / r["static"]["tokens_per_s"]
        if "mtp" in sections:
            r = doc["results"]["mtp"] = {}
            eng = Engine(model, **ekw)
            plain = _run(eng, prompts, outs)
            ref = plain.pop("_tokens")
            r["plain"] = plain
            print(f"mtp plain: {plain['tokens_per_s']:10.1f} tokens/s", flush=True)
            for k in (int(x) for x in args.mtp_k.split(",")):
                t = _run(eng, prompts, outs, num_speculative_tokens=k)
                toks = t.pop("_tokens")
                diffs = [_first_difference(a, b) for a, b in zip(toks, ref)]
                t["speedup_vs_plain"] = t["tokens_per_s"] / plain["tokens_per_s"]
                t["greedy_equal_plain_fraction"] = sum(d is None for d in diffs) / len(diffs)
                t["first_difference_positions"] = sorted(d for d in diffs if d is not None)
                r[f"k{k}"] = t
                print(
                    f"mtp k={k}: {t['tokens_per_s']:10.1f} tokens/s (x{t['speedup_vs_plain']:.2f}), acceptance "
                    f"{t['acceptance_rate']:.3f}, tokens == plain greedy for "
                    f"{100 * t['greedy_equal_plain_fraction']:.1f}% of requests",
                    flush=True,
                )
    if "early_stop" in sections:
        # What finished requests cost: one batch (slots = requests, nothing pending) where every request
        # runs L tokens, half stop after 4, or all stop after 4 (a stop by length and by EOS set the same
        # per-slot done flag).
        m = model if sections & {"batching", "mtp"} else None
        if m is None:
            m = (
                load_checkpoint(args.checkpoint, dtype=dtype)
                if args.checkpoint
                else DeepseekV3.random(DeepseekV3Config.preset(args.preset), dtype=dtype, seed=args.seed)
            )
        n_req, L = args.max_slots, _pair(args.output_lens)[1]
        rng = np.random.default_rng(args.seed + 1)
        ps = [rng.integers(0, m.config.vocab_size, 16).tolist() for _ in range(n_req)]
        eng = Engine(m, page_size=args.page_size, backend=args.backend, max_slots=n_req)
        r = doc["results"]["early_stop"] = {"requests": n_req, "max_new_tokens": L}
        for name, lim in (("all_run", [L] * n_req), ("half_stop_at_4", [4, L] * (n_req // 2) + [L] * (n_req % 2)),
                          ("all_stop_at_4", [4] * n_req)):  # fmt: skip
            t = _run(eng, ps, lim)
            t.pop("_tokens")
            r[name] = {k: t[k] for k in ("generated_tokens", "decode_s", "decode_steps", "decode_calls")}
            print(
                f"early stop {name:15s}: {t['decode_steps']} steps, decode {t['decode_s'] * 1e3:.1f} ms",
                flush=True,
            )
    if "warmstart" in sections:
        runs = []
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TOKENSPEED_JAX_CACHE_DIR=cache)
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
            for i in range(2):
                out = os.path.join(cache, f"run{i}.json")
                cmd = [sys.executable, "-m", "tokenspeed_jax.models.deepseek", "--preset", args.preset,
                       "--backend", args.backend, "--json", out]  # fmt: skip
                if args.checkpoint:
                    cmd += ["--checkpoint", args.checkpoint]
                if args.cpu_smoke:
                    cmd += [
                        "--batch",
                        "2",
                        "--prompt-len",
                        "12",
                        "--max-new-tokens",
                        "4",
                        "--page-size",
                        "16",
                    ]
                t0 = time.perf_counter()
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                wall = time.perf_counter() - t0
                if p.returncode:
                    raise RuntimeError(f"warm start run {i} failed:\n{p.stderr[-3000:]}")
                with open(out) as f:
                    cli = json.load(f)
                runs.append(
                    {"warmup_s": cli["warmup_s"], "process_wall_s": wall, "command": " ".join(cmd[1:])}
                )
                print(
                    f"warm start run {i + 1}: warm-up {cli['warmup_s']:.1f} s, process {wall:.1f} s",
                    flush=True,
                )
        doc["results"]["warmstart"] = {"runs": runs, "cache": "fresh TOKENSPEED_JAX_CACHE_DIR shared by both"}
    out = args.out
    if out is None:
        dev = doc["device"].split(":")[-1].replace(" ", "_").lower()
        day = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d")
        out = os.path.join(ROOT, "benchmarks", "results", f"generation_{dev}_{day}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
