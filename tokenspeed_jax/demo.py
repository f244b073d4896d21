"""The main job on its embedded default: run MLA decode, MTP decode and prefill on generated data with
the best available backend, check each kernel result against the exact ``xla`` reference, and print what
ran where, why the other backends did not, and how fast; then generate text with the shipped DeepSeek-V3-
architecture checkpoint (``pystdlib-tiny``, MTP speculative decoding on the same ops; ``--no-generate``
skips it).

    python -m tokenspeed_jax.demo                  # or: tokenspeed-jax-demo
    python -m tokenspeed_jax.demo --large          # DeepSeek-R1 serving-sized shapes (use on a GPU)
    python -m tokenspeed_jax.demo --profile /tmp/t # also write an XLA profiler trace and read it back

On a CPU the ``xla`` backend runs: it *is* the reference, so there is nothing to check and the demo says so.

DeepSeek-R1 attention dims: decode D = 576 (512 latent + 64 rope), V = 512; prefill Dqk 192 / Dv 128.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tokenspeed_jax import current_target, explain, mla_decode, mla_prefill
from tokenspeed_jax.timing import bench


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    batch: int
    q_len: int
    heads: int
    kv_len: int
    page_size: int = 64
    dtype: str = "bfloat16"


@dataclasses.dataclass(frozen=True)
class PrefillCase:
    lens: tuple[int, ...]
    heads: int
    dtype: str = "bfloat16"


SMALL = (
    [DecodeCase(4, 1, 16, 1000), DecodeCase(4, 4, 16, 1000), DecodeCase(2, 2, 128, 777, dtype="float8_e4m3fn")],
    [PrefillCase((64, 128, 31), 16), PrefillCase((200,), 16, "float8_e4m3fn")],
)
LARGE = (
    [DecodeCase(64, 1, 32, 8192), DecodeCase(64, 4, 32, 8192), DecodeCase(64, 1, 128, 8192),
     DecodeCase(64, 1, 32, 8192, dtype="float8_e4m3fn")],
    [PrefillCase((8192,), 16), PrefillCase((4096,) * 4, 32)],
)


def _decode_inputs(c: DecodeCase, rng: np.random.Generator):
    pages_per = -(-c.kv_len // c.page_size)
    num_pages = c.batch * pages_per + 3
    dt = jnp.dtype(c.dtype)
    q = jnp.asarray(rng.standard_normal((c.batch, c.q_len, c.heads, 576), np.float32)).astype(dt)
    kv = jnp.asarray(rng.standard_normal((num_pages, c.page_size, 576), np.float32)).astype(dt)
    bt = jnp.asarray(rng.permutation(num_pages)[: c.batch * pages_per].reshape(c.batch, pages_per), jnp.int32)
    sl = jnp.asarray(rng.integers(c.kv_len // 2, c.kv_len + 1, c.batch), jnp.int32).at[0].set(c.kv_len)
    return q, kv, bt, sl


def _prefill_inputs(c: PrefillCase, rng: np.random.Generator):
    t = sum(c.lens)
    dt = jnp.dtype(c.dtype)
    q = jnp.asarray(rng.standard_normal((t, c.heads, 192), np.float32)).astype(dt)
    k = jnp.asarray(rng.standard_normal((t, c.heads, 192), np.float32)).astype(dt)
    v = jnp.asarray(rng.standard_normal((t, c.heads, 128), np.float32)).astype(dt)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(c.lens)]), jnp.int32)
    return q, k, v, cu


def _rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _choose(reasons: dict[str, str | None], backend: str) -> str:
    if backend == "auto":
        return next(n for n, r in reasons.items() if r is None)
    if reasons.get(backend, "unknown backend") is not None:
        raise SystemExit(f"--backend {backend}: {reasons.get(backend, 'unknown backend')}")
    return backend


def _check_note(check: bool, chosen: str) -> str:
    if chosen == "xla":
        return "reference check: skipped (the xla backend ran, and it is the reference)"
    return "reference check: skipped (--no-check)" if not check else ""


def run(large: bool = False, backend: str = "auto", seed: int = 0, check: bool | None = None) -> list[dict]:
    """Run the demo; ``check`` (default: on for the small shapes) compares every kernel result with the
    ``xla`` reference, whose compile dominates the run time on serving-sized shapes."""
    check = (not large) if check is None else check
    rng = np.random.default_rng(seed)
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", "")
    kind = f" ({kind})" if kind and kind.lower() != dev.platform else ""
    print(f"device: {dev.platform}{kind}; calls target: {current_target()}; jax {jax.__version__}")
    decode_cases, prefill_cases = LARGE if large else SMALL
    results = []
    for c in decode_cases:
        q, kv, bt, sl = _decode_inputs(c, rng)
        reasons = explain("decode", q, kv, bt, sl, softmax_scale=576**-0.5)
        chosen = _choose(reasons, backend)
        f = jax.jit(lambda q, kv, bt, sl, s, b=chosen: mla_decode(q, kv, bt, sl, softmax_scale=s, backend=b))
        ref = jax.jit(lambda q, kv, bt, sl, s: mla_decode(q, kv, bt, sl, softmax_scale=s, backend="xla"))
        scale = 576**-0.5
        err = _rel_err(f(q, kv, bt, sl, scale), ref(q, kv, bt, sl, scale)) if check and chosen != "xla" else None
        t = bench(lambda: f(q, kv, bt, sl, scale), repeats=3)["median_us"]
        elt = 1 if c.dtype == "float8_e4m3fn" else 2
        kv_tokens = int(np.sum(np.asarray(sl)))
        nbytes = kv_tokens * 576 * elt + c.batch * c.q_len * c.heads * (576 * elt + 512 * 2)
        flops = 2.0 * kv_tokens * c.q_len * c.heads * (576 + 512)
        r = dict(op="mla_decode", case=str(c), backend=chosen, us=t, gbps=nbytes / t / 1e3,
                 tflops=flops / t / 1e6, rel_err_vs_xla=err, check=_check_note(check, chosen))
        results.append(r)
        _print(r, reasons)
    for c in prefill_cases:
        q, k, v, cu = _prefill_inputs(c, rng)
        mx = max(c.lens)
        reasons = explain("prefill", q, k, v, cu, cu, softmax_scale=192**-0.5, max_seqlen_q=mx,
                          max_seqlen_k=mx)
        chosen = _choose(reasons, backend)
        f = jax.jit(lambda q, k, v, cu, s, b=chosen: mla_prefill(q, k, v, cu, cu, softmax_scale=s, backend=b,
                                                                   max_seqlen_q=mx, max_seqlen_k=mx))
        ref = jax.jit(lambda q, k, v, cu, s: mla_prefill(q, k, v, cu, cu, softmax_scale=s, backend="xla"))
        scale = 192**-0.5
        err = _rel_err(f(q, k, v, cu, scale), ref(q, k, v, cu, scale)) if check and chosen != "xla" else None
        t = bench(lambda: f(q, k, v, cu, scale), repeats=3)["median_us"]
        flops = sum(2.0 * c.heads * (n * (n + 1) / 2) * (192 + 128) for n in c.lens)
        r = dict(op="mla_prefill", case=str(c), backend=chosen, us=t, tflops=flops / t / 1e6,
                 rel_err_vs_xla=err, check=_check_note(check, chosen))
        results.append(r)
        _print(r, reasons)
    return results


def _print(r: dict, reasons: dict[str, str | None]) -> None:
    rate = f"{r['gbps']:8.1f} GB/s " if "gbps" in r else " " * 14
    print(f"{r['op']:12s} {r['case']:70s} backend={r['backend']:6s} {r['us']:10.1f} us {rate}"
          f"{r['tflops']:7.2f} TFLOP/s  " + (r["check"] if r["rel_err_vs_xla"] is None else
                                             f"rel.err vs xla {r['rel_err_vs_xla']:.1e}"))
    for n, why in reasons.items():
        if why:
            print(f"{'':14s}not {n}: {why}")


def profile(directory: str, **kwargs) -> dict[str, dict[str, int]]:
    """Run the demo under ``jax.profiler.trace(directory)`` and report which tokenspeed names the trace's
    events show (:func:`tokenspeed_jax.profiling.trace_names`: as XProf's trace viewer, not raw bytes)."""
    from tokenspeed_jax.profiling import trace_names

    with jax.profiler.trace(directory):
        results = run(**kwargs)
    found = trace_names(directory)
    ran = {r["backend"] for r in results}
    for name, planes in found.items():
        where = ", ".join(f"{p}: {n} events" for p, n in planes.items()) or "no events"
        print(f"trace: {name}: {where}")
    if ran == {"xla"}:
        print("trace: on a CPU the ops run as the fused XLA reference, whose events carry HLO names only; "
              "the tokenspeed names show on a GPU (custom calls tokenspeed_mla_*_sm90 / _sm100)")
    return found


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--large", action="store_true", help="DeepSeek-R1 serving-sized shapes (GPU)")
    ap.add_argument("--backend", default="auto", help="auto (default) or a backend name")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                    help="compare with the xla reference (default: on unless --large)")
    ap.add_argument("--profile", metavar="DIR", default=None,
                    help="write an XLA profiler trace to DIR and report the tokenspeed events in it")
    ap.add_argument("--generate", action=argparse.BooleanOptionalAction, default=True,
                    help="generate text with the shipped checkpoint after the ops")
    args = ap.parse_args(argv)
    kw = dict(large=args.large, backend=args.backend, seed=args.seed, check=args.check)
    if args.profile:
        profile(args.profile, **kw)
    else:
        run(**kw)
    if args.generate:
        generate_text(backend=args.backend)


def generate_text(backend: str = "auto", max_new_tokens: int = 24) -> list[str]:
    """Greedy MTP generation (k = 1) with the shipped checkpoint on three Python prompts; prints and returns the
    continuations.  (A 2.1M-parameter model trained for 40 CPU minutes: its Python is only Python-like.)"""
    from tokenspeed_jax.models.deepseek import Engine, load_checkpoint, load_tokenizer
    from tokenspeed_jax.models.deepseek.checkpoints import default_checkpoint
    from tokenspeed_jax.models.deepseek.cli import DEFAULT_PROMPTS

    path = default_checkpoint()
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    model = load_checkpoint(path, dtype=dtype, progress=False)
    eng = Engine(model, backend=backend, tokenizer=load_tokenizer(path))
    res = eng.generate(list(DEFAULT_PROMPTS), max_new_tokens, num_speculative_tokens=1)
    print(f"generate: checkpoint pystdlib-tiny ({path}), greedy, MTP k = 1, acceptance "
          f"{res.acceptance_rate:.2f}")
    for p, t in zip(DEFAULT_PROMPTS, res.texts):
        print(f"  {p!r} -> {t!r}")
    return list(res.texts)


if __name__ == "__main__":
    main()
