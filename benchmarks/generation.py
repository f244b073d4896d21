"""End-to-end generation benchmark of the DeepSeek model engine (issue #37): continuous vs static batching,
MTP speculative decoding (k = 1..3) vs plain decode, greedy MTP vs plain greedy agreement, warm start, and
what finished requests cost.

    python -m benchmarks.generation --budget-s 230 --out $OUT/gen.json     # H200: small preset, bf16, 256 prompts
    python -m benchmarks.generation --checkpoint DIR                       # a trained checkpoint (meaningful MTP)
    python -m benchmarks.generation --smoke --out /tmp/gen.json            # CPU: tiny preset, 16 short prompts

Sections (``--sections``, run in the order given; default ``batching,warmstart,mtp,early_stop``):

* ``batching``: ``--num-prompts`` prompts with mixed prompt lengths (uniform in ``--prompt-lens``) and
  mixed output lengths (uniform in ``--output-lens``, EOS ignored so every request runs its length),
  decoded through ``--max-slots`` slots with ``batching="continuous"`` and ``"static"`` (batch after
  batch); generated tokens per second of wall time (prefill included) of a second run, after a warm-up
  run that compiles every shape the workload needs (``warmup_s``, ``warmup_compile_s``).
* ``warmstart``: ``python -m tokenspeed_jax.models.deepseek --preset P --no-plain`` twice in fresh processes
  sharing fresh cache directories (``TOKENSPEED_JAX_CACHE_DIR``: XLA's and our kernels' caches, and
  ``CUTE_DSL_CACHE_DIR``); the CLI's ``warmup_s`` (its first ``generate``, compile included: the time to
  its first decode steps) and each process's wall time.
* ``mtp``: one batch, the workload's first ``--max-slots`` requests admitted together (one prefill shape
  and one decode loop per k to compile; the whole workload's admissions would compile dozens of prefill
  shapes per k), plain decode and MTP k = ``--mtp-k``: tokens/s, acceptance rate, and (greedy) the fraction
  of requests whose tokens equal plain greedy decoding, with the positions of the first difference (bf16
  near-ties: the S = k+1 verify rounds differently from S = 1).
* ``early_stop``: one batch of ``--max-slots`` requests (nothing pending) where all run the longest output
  length, half stop after 4 tokens, or all stop after 4: decode steps and time (what finished requests
  cost while others of their batch still run, and that a batch whose requests all stopped stops).

``--token-bucket`` pads packed prefill lengths to that many tokens times a power of two (the engine's
``token_bucket``; default 16): the continuous run admits requests in many group sizes and lengths, each a
prefill shape to compile in its warm-up, and a coarser bucket compiles fewer of them (the padding costs
little: prefill is a small part of the time).  ``--budget-s`` skips what no longer fits (estimated from the compile and run times measured so far), with
the reason in the JSON.  The JSON (``--out``, rewritten after every point) records commit, command, date,
device, jax version, the model, and the attention backends that ran (decode and prefill separately; on an
H200 without FlashAttention-4 the prefill runs the xla reference and the JSON says so).  With random
weights the MTP layer drafts random tokens (acceptance ~0): MTP speed-ups need a trained checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.runinfo import Budget, Results, parse_with_smoke

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("batching", "warmstart", "mtp", "early_stop")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--preset", default="small", help="config preset with generated weights")
    p.add_argument("--checkpoint", default=None, metavar="DIR", help="load this checkpoint instead")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: bfloat16 on GPU, float32 on CPU",
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "xla", "sm90", "sm100"],
        help="attention backend (auto: the kernels where they support the call, else xla; the JSON "
        "records what ran)",
    )
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--prompt-lens", default="32,512", help="min,max prompt length (uniform)")
    p.add_argument("--output-lens", default="16,256", help="min,max new tokens (uniform)")
    p.add_argument("--max-slots", type=int, default=64)
    p.add_argument("--page-size", type=int, default=64, choices=[16, 32, 64, 128, 256])
    p.add_argument(
        "--token-bucket",
        type=int,
        default=None,
        help="Engine(token_bucket=): packed prefill lengths padded to this times a power of two (default: "
        "the engine's 16; larger means fewer prefill shapes to compile, more padding)",
    )
    p.add_argument("--mtp-k", default="1,2,3", help="speculative tokens to compare with plain decode")
    p.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"any of {', '.join(SECTIONS)}, in run order"
    )
    p.add_argument(
        "--warmstart-preset",
        default=None,
        help="preset of the warm-start CLI runs (default --preset; with --checkpoint: that checkpoint)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=None, help="skip points that no longer fit (from start)")
    p.add_argument(
        "--compile-guess-s",
        type=float,
        default=60.0,
        help="estimated warm-up of a section's first run, until one is measured",
    )
    p.add_argument("--warmstart-guess-s", type=float, default=90.0, help="estimated time of the two CLI runs")
    p.add_argument("--commit", default=None, help="commit to record when the checkout has no .git")
    p.add_argument("--out", default=None, metavar="FILE", help="JSON file, rewritten after every point")
    p.add_argument(
        "--smoke",
        "--cpu-smoke",
        dest="smoke",
        action="store_true",
        help="small settings that run on a CPU: tiny preset, 16 prompts of 4-24 tokens, 2-12 new tokens, "
        "4 slots, page 16, k = 1",
    )
    return p


def _pair(s: str) -> tuple[int, int]:
    a, b = (int(x) for x in s.split(","))
    return a, b


def _workload(args, vocab: int, context: int):
    """Random prompts and output lengths; prompts longer than half the model's context are cut to it (the
    engine stops a request at the context, so a trained checkpoint's short context caps the outputs too)."""
    rng = np.random.default_rng(args.seed)
    lo, hi = _pair(args.prompt_lens)
    hi = min(hi, context // 2)
    lo = min(lo, hi)
    olo, ohi = _pair(args.output_lens)
    lens = rng.integers(lo, hi + 1, args.num_prompts)
    outs = rng.integers(olo, ohi + 1, args.num_prompts).tolist()
    prompts = [rng.integers(0, vocab, n).tolist() for n in lens]
    return prompts, outs


def _run(res: Results, engine, prompts, outs, **kw) -> dict:
    """A warm-up run (compiles every shape of the workload), then the timed run."""
    with res.clock.span() as sp:
        t = time.perf_counter()
        engine.generate(prompts, outs, eos_token_id=[], **kw)
        warm = time.perf_counter() - t
    with res.clock.span() as sp2:
        r = engine.generate(prompts, outs, eos_token_id=[], **kw)
    if sp2["compiles"]:
        res.note(f"{sp2['compiles']} compilation(s) ({sp2['seconds']:.1f} s) inside a timed run (kw {kw})")
    gen = r.generated_tokens
    return {
        "generated_tokens": gen,
        "wall_s": r.wall_s,
        "tokens_per_s": gen / r.wall_s,
        "prefill_s": r.prefill_s,
        "decode_s": r.decode_s,
        "decode_tokens_per_s": r.decode_tokens / r.decode_s if r.decode_s else None,
        "decode_calls": r.decode_calls,
        "decode_steps": r.decode_steps,
        "acceptance_rate": r.acceptance_rate,
        "warmup_s": round(warm, 2),
        "warmup_compile_s": sp["seconds"],
        "warmup_compiles": sp["compiles"],
        "_tokens": r.tokens,
    }


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}"


class _Estimate:
    """Seconds the next warm-up + timed run needs: the smallest warm-up measured so far (the continuous run
    compiles the most shapes, a single batch the fewest) plus the longest timed run, else a guess."""

    def __init__(self, guess: float):
        self.guess, self.seen = guess, []

    def __call__(self, new_shapes: bool = True) -> float:
        if not self.seen:
            return self.guess
        warm, timed = min(s[0] for s in self.seen), max(s[1] for s in self.seen)
        return (warm if new_shapes else timed) + timed

    def add(self, row: dict) -> None:
        self.seen.append((row["warmup_s"], row["wall_s"]))


def run(args, res: Results) -> None:
    from tokenspeed_jax.models.deepseek import DeepseekV3, DeepseekV3Config, Engine, load_checkpoint

    sections = [s for s in args.sections.split(",") if s]
    platform = jax.default_backend()
    dtype = {"auto": jnp.bfloat16 if platform == "gpu" else jnp.float32, "float32": jnp.float32,
             "bfloat16": jnp.bfloat16}[args.dtype]  # fmt: skip
    res.set("model", args.checkpoint or f"preset:{args.preset} (generated weights)")
    res.set("dtype", jnp.dtype(dtype).name)
    model = None

    def get_model():
        nonlocal model
        if model is None:
            t = time.perf_counter()
            model = (
                load_checkpoint(args.checkpoint, dtype=dtype, progress=False)
                if args.checkpoint
                else DeepseekV3.random(DeepseekV3Config.preset(args.preset), dtype=dtype, seed=args.seed)
            )
            res.set("model_build_s", round(time.perf_counter() - t, 2))
        return model

    est = _Estimate(args.compile_guess_s)
    ekw = {"page_size": args.page_size, "backend": args.backend, "max_slots": args.max_slots}
    if args.token_bucket:
        ekw["token_bucket"] = args.token_bucket
    for section in sections:
        try:
            if section in ("batching", "mtp"):
                m = get_model()
                prompts, outs = _workload(args, m.config.vocab_size, m.config.max_position_embeddings)
                res.set(
                    "workload",
                    {
                        "prompts": len(prompts),
                        "prompt_tokens": sum(map(len, prompts)),
                        "max_new_tokens_total": sum(outs),
                        "prompt_lens": args.prompt_lens,
                        "context": m.config.max_position_embeddings,
                        "output_lens": args.output_lens,
                        "max_slots": args.max_slots,
                        "eos": "ignored (every request runs its length)",
                    },
                )
            if section == "batching":
                rows = {}
                for mode in ("continuous", "static"):
                    if not res.fits("batching", mode, est()):
                        continue
                    eng = Engine(m, batching=mode, **ekw)
                    t = _run(res, eng, prompts, outs)
                    t.pop("_tokens")
                    est.add(t)
                    refill = (eng.refill_at or max(1, args.max_slots // 8)) if mode == "continuous" else None
                    rows[mode] = res.add("batching", {"mode": mode, "refill_at": refill, **t})
                    print(
                        f"batching {mode:10s}: {t['tokens_per_s']:10.1f} tokens/s ({t['wall_s']:.2f} s; "
                        f"warm-up {t['warmup_s']:.1f} s)",
                        flush=True,
                    )
                if len(rows) == 2:
                    rows["continuous"]["speedup_vs_static"] = (
                        rows["continuous"]["tokens_per_s"] / rows["static"]["tokens_per_s"]
                    )
                    res.flush()
            elif section == "mtp":
                # One batch: the workload's first --max-slots requests, admitted together (one prefill shape and
                # one decode loop per k to compile, where the whole workload's admissions would compile dozens).
                mp, mo = prompts[: args.max_slots], outs[: args.max_slots]
                res.set(
                    "mtp_workload",
                    {
                        "requests": len(mp),
                        "prompt_tokens": sum(map(len, mp)),
                        "max_new_tokens_total": sum(mo),
                        "admitted": "all at once (one batch)",
                    },
                )
                eng = Engine(m, **ekw)
                if not res.fits("mtp", "plain", est()):
                    continue
                t = _run(res, eng, mp, mo)
                ref = t.pop("_tokens")
                est.add(t)
                plain = res.add("mtp", {"k": 0, **t})
                print(f"mtp plain: {plain['tokens_per_s']:10.1f} tokens/s", flush=True)
                for k in (int(x) for x in args.mtp_k.split(",")):
                    if not res.fits("mtp", f"k={k}", est()):
                        continue
                    t = _run(res, eng, mp, mo, num_speculative_tokens=k)
                    est.add(t)
                    toks = t.pop("_tokens")
                    diffs = [_first_difference(a, b) for a, b in zip(toks, ref)]
                    t["speedup_vs_plain"] = t["tokens_per_s"] / plain["tokens_per_s"]
                    t["greedy_equal_plain_fraction"] = sum(d is None for d in diffs) / len(diffs)
                    t["first_difference_positions"] = sorted(d for d in diffs if d is not None)
                    res.add("mtp", {"k": k, **t})
                    print(
                        f"mtp k={k}: {t['tokens_per_s']:10.1f} tokens/s (x{t['speedup_vs_plain']:.2f}), acceptance "
                        f"{t['acceptance_rate']:.3f}, tokens == plain greedy for "
                        f"{100 * t['greedy_equal_plain_fraction']:.1f}% of requests",
                        flush=True,
                    )
            elif section == "early_stop":
                # What finished requests cost: one batch (slots = requests, nothing pending) where every request
                # runs L tokens, half stop after 4, or all stop after 4 (a stop by length and by EOS set the same
                # per-slot done flag).
                if not res.fits("early_stop", "all", est(new_shapes=True)):
                    continue
                m = get_model()
                n_req, L = args.max_slots, _pair(args.output_lens)[1]
                rng = np.random.default_rng(args.seed + 1)
                ps = [rng.integers(0, m.config.vocab_size, 16).tolist() for _ in range(n_req)]
                eng = Engine(m, page_size=args.page_size, backend=args.backend, max_slots=n_req)
                for name, lim in (("all_run", [L] * n_req),
                                  ("half_stop_at_4", [4, L] * (n_req // 2) + [L] * (n_req % 2)),
                                  ("all_stop_at_4", [4] * n_req)):  # fmt: skip
                    if not res.fits("early_stop", name, est(new_shapes=False)):
                        continue
                    t = _run(res, eng, ps, lim)
                    t.pop("_tokens")
                    res.add(
                        "early_stop",
                        {
                            "case": name,
                            "requests": n_req,
                            "max_new_tokens": L,
                            **{
                                k: t[k]
                                for k in (
                                    "generated_tokens",
                                    "decode_s",
                                    "decode_steps",
                                    "decode_calls",
                                    "warmup_s",
                                )
                            },
                        },
                    )
                    print(
                        f"early stop {name:15s}: {t['decode_steps']} steps, decode {t['decode_s'] * 1e3:.1f} ms",
                        flush=True,
                    )
            elif section == "warmstart":
                _warmstart(args, res)
            else:
                res.skip(section, "all", f"unknown section (expected {', '.join(SECTIONS)})")
        except Exception as e:  # noqa: BLE001  (record, go on with the next section)
            res.skip(section, "rest of the section", f"error: {_err(e)}")
            traceback.print_exc()


def warmstart_command(args, out: str) -> list[str]:
    """The CLI command line of one warm-start run (``python -m tokenspeed_jax.models.deepseek ...``)."""
    cmd = [sys.executable, "-m", "tokenspeed_jax.models.deepseek", "--backend", args.backend, "--no-plain",
           "--json", out]  # fmt: skip
    if args.checkpoint and not args.warmstart_preset:
        cmd += ["--checkpoint", args.checkpoint]
    else:
        cmd += ["--preset", args.warmstart_preset or args.preset]
    if args.smoke:
        cmd += ["--batch", "2", "--prompt-len", "12", "--max-new-tokens", "4", "--page-size", "16"]
    return cmd


def _warmstart(args, res: Results) -> None:
    if not res.fits("warmstart", "two CLI runs", args.warmstart_guess_s):
        return
    with tempfile.TemporaryDirectory() as cache:
        # fresh caches shared by the two runs: XLA's and our kernels' (TOKENSPEED_JAX_CACHE_DIR) and the CuTe
        # DSL's own (CUTE_DSL_CACHE_DIR, which this process may have filled with the same kernels)
        cute = os.path.join(cache, "cute_dsl")
        env = dict(os.environ, TOKENSPEED_JAX_CACHE_DIR=cache, CUTE_DSL_CACHE_DIR=cute, PYTHONUNBUFFERED="1")
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        for i in range(2):
            out = os.path.join(cache, f"run{i}.json")
            cmd = warmstart_command(args, out)
            left = res.budget.left()
            if i == 1 and not res.budget.allows(10):
                res.skip("warmstart", f"run {i + 1}", f"budget: {left:.0f} s left")
                break
            t0 = time.perf_counter()
            try:
                p = subprocess.run(
                    cmd,
                    env=env,
                    capture_output=True,
                    text=True,
                    check=False,
                    cwd=ROOT,
                    timeout=None if left == float("inf") else max(10.0, left - 5),
                )
            except subprocess.TimeoutExpired:
                res.skip(
                    "warmstart", f"run {i + 1}", f"timed out after {time.perf_counter() - t0:.0f} s (budget)"
                )
                break
            wall = time.perf_counter() - t0
            if p.returncode:
                res.skip("warmstart", f"run {i + 1}", f"CLI exit {p.returncode}: {p.stderr.strip()[-1500:]}")
                break
            with open(out) as f:
                cli = json.load(f)
            res.add(
                "warmstart",
                {
                    "run": i + 1,
                    "warmup_s": cli["warmup_s"],
                    "warmup_compile": cli.get("warmup_compile"),
                    "process_wall_s": wall,
                    "decode_tokens_per_s": cli.get("decode_tokens_per_s"),
                    "attention_backend": cli.get("attention_backend"),
                    "command": " ".join(cmd[1:]),
                    "cache": "fresh TOKENSPEED_JAX_CACHE_DIR and CUTE_DSL_CACHE_DIR shared by both runs",
                },
            )
            print(
                f"warm start run {i + 1}: warm-up {cli['warmup_s']:.1f} s, process {wall:.1f} s; "
                f"in the warm-up: {json.dumps((cli.get('warmup_compile') or {}).get('seconds'))}, "
                f"{(cli.get('warmup_compile') or {}).get('persistent_cache_hits')} cache hits",
                flush=True,
            )


# --smoke: the defaults it changes (arguments given explicitly still win)
SMOKE = {
    "preset": "tiny",
    "num_prompts": 16,
    "prompt_lens": "4,24",
    "output_lens": "2,12",
    "max_slots": 4,
    "page_size": 16,
    "mtp_k": "1",
    "compile_guess_s": 20.0,
    "warmstart_guess_s": 30.0,
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_with_smoke(_parser(), SMOKE, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = args.out
    if out is None:
        d = jax.devices()[0]
        dev = f"{d.platform}_{getattr(d, 'device_kind', '')}".replace(" ", "_").lower()
        out = os.path.join(ROOT, "benchmarks", "results", f"generation_{dev}_{time.strftime('%Y%m%d')}.json")
    res = Results(
        out,
        "generation",
        {k: v for k, v in vars(args).items() if k not in ("out", "commit")},
        Budget(args.budget_s),
        commit=args.commit,
    )
    with res.running():
        run(args, res)
    print()
    from benchmarks.runinfo import summary

    print(summary(res.doc))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
