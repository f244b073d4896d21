"""MLA decode: correctness check and benchmark of the sm90 kernel in one process (one GPU call).

    CUTE_DSL_ARCH=sm_90a python -m benchmarks.decode --prewarm 12 --check --bench \
        --out $OUT/decode.json --png $OUT/decode.png

``--prewarm N`` compiles every configuration the run needs in N CPU worker processes first (lowering for
CUDA under ``target_override``), filling the tokenspeed_jax.ffi disk cache so the timed process only loads
objects.  ``--check`` runs the correctness matrix against the exact fp32 reference (``backend="xla"`` on
fp32-cast inputs) and the bf16 xla backend: NaN in every page a request does not own, permuted block
tables, garbage past the used table entries, ragged lengths (0, 1, S-1, page-1, page+1, long), poisoned
device memory before each call, LSE, -inf rows, and bitwise run-to-run determinism.  ``--bench`` times
ours vs FlashMLA (BF16 and the FP8 fork, from the GPU kit) vs plain XLA on the issue's matrix, each shape's
contenders interleaved (``benchmarks.harness.interleaved``: 5 alternating rounds, the order rotating, the
median of each contender; since 2026-11-30, before which each contender was timed on its own in turn).
The bench matrix here is full-length (every request at capacity, as FlashMLA's own benchmark); serving-shaped
batches (all-full, uniform and long-tail lengths; B 1-256, capacity 4k-128k) are ``benchmarks.decode_varlen``, built
on this module's ``Case`` and ``prewarm`` (``python -m benchmarks.device bench`` runs both).
``--sustain SECS`` adds the steady-state timing of every contender but plain XLA (``benchmarks.harness.sustained``:
SECS seconds back to back each, twice, the second half timed, with the SM clock and power polled), a second report
``<out>_sustained.json`` / ``.png``: the interleaved rounds are 20-50 ms bursts, below the H200's 700 W power cap,
while a serving loop runs at it, where a kernel's power draw sets its clock (docs/notes/sm90_decode_journal.md, "Power").

``--config NAME`` (repeatable; a name of ``tokenspeed_jax.backends.sm90_decode.CONFIGS``, e.g. ``seesaw``,
``fp8_transposed_pv``): ``--check`` also runs the matrix on each named kernel config where it applies (recording
whether it is bitwise equal to the selected one), ``--bench`` times each as an extra column ``ours bf16 NAME`` /
``ours fp8 NAME`` next to the selected config (``select_config``) and FlashMLA, all in one process on the same
inputs:

    CUTE_DSL_ARCH=sm_90a python -m benchmarks.decode --prewarm 15 --check --bench --quick \
        --config seesaw --config fp8_transposed_pv
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    B: int
    S: int
    H: int
    page: int
    max_pages: int
    lens: tuple[int, ...] | None = None  # None: random in [0, capacity]
    causal: bool = True
    garbage: bool = False  # garbage block-table entries past the used ones + a seq_len beyond capacity

    @property
    def num_pages(self) -> int:
        return self.B * self.max_pages + 8


CHECK = [
    Case("s1h16p64", "bfloat16", 3, 1, 16, 64, 40, (0, 1, 2500)),
    Case("s2h128p64", "bfloat16", 3, 2, 128, 64, 40, (1, 65, 2555)),
    Case("s4h32p32", "bfloat16", 3, 4, 32, 32, 64, (3, 31, 2000)),
    Case("s8h8p128", "bfloat16", 3, 8, 8, 128, 20, (7, 129, 2560)),
    Case("s16h1p16", "bfloat16", 3, 16, 1, 16, 100, (15, 17, 1600)),
    Case("s3h96p64", "bfloat16", 3, 3, 96, 64, 40, (2, 63, 2559)),
    Case("s16h64p64_f16", "float16", 3, 16, 64, 64, 40, (16, 100, 2000)),
    Case("b64s4h16p64", "bfloat16", 64, 4, 16, 64, 24, None),
    Case("b1s1h128p64_81920", "bfloat16", 1, 1, 128, 64, 1280, (81920,)),
    Case("s4h16p64_noncausal", "bfloat16", 3, 4, 16, 64, 40, (0, 5, 2000), causal=False),
    Case("s2h32p64_garbage", "bfloat16", 3, 2, 32, 64, 16, (300, 10**7, 64), garbage=True),
    Case("b1s1h16p64_short", "bfloat16", 1, 1, 16, 64, 4, (70,)),
    # 16-bit with S x H <= 32 and pages >= 32 (the transposed loop): 32 rows over S = 2
    # with garbage tables and a seq_len beyond the table, 15 rows in fp16 on 128-token pages, one request split many
    # ways (the combine's partials)
    Case("s2h16p32_garbage", "bfloat16", 3, 2, 16, 32, 32, (1, 33, 10**6), garbage=True),
    Case("s3h5p128_f16", "float16", 3, 3, 5, 128, 20, (2, 129, 2500)),
    Case("b1s1h32p64_16k", "bfloat16", 1, 1, 32, 64, 256, (16384,)),
    Case("fp8_s1h16p64", "float8_e4m3fn", 3, 1, 16, 64, 40, (0, 65, 2500)),
    Case("fp8_s4h128p64", "float8_e4m3fn", 3, 4, 128, 64, 40, (3, 64, 2000)),
    Case("fp8_s2h32p32_garbage", "float8_e4m3fn", 3, 2, 32, 32, 32, (1, 33, 10**6), garbage=True),
    Case("fp8_s8h16p128", "float8_e4m3fn", 2, 8, 16, 128, 12, (129, 1500)),
    Case("fp8_s2h64p16", "float8_e4m3fn", 3, 2, 64, 16, 160, (2, 17, 2500)),  # 4 boxes per chunk: the FP8 seesaw
    # S x H <= 32 with pages >= 32 (fp8_transposed): 16 rows over S = 2 (causal), and 32 rows with garbage tables and a
    # seq_len beyond the table; one request split many ways (the combine's fp32x2 partials)
    Case("fp8_s2h8p64", "float8_e4m3fn", 3, 2, 8, 64, 40, (2, 63, 2500)),
    Case("fp8_s1h32p32_garbage", "float8_e4m3fn", 3, 1, 32, 32, 32, (1, 33, 10**6), garbage=True),
    Case("fp8_b1s1h16p64_16k", "float8_e4m3fn", 1, 1, 16, 64, 256, (16384,)),
    # FP8 with 72 rows: the second 64-row block has 8 real rows
    Case("fp8_s3h24p64", "float8_e4m3fn", 3, 3, 24, 64, 40, (2, 64, 2500)),
    # serving-shaped batches for the length-balanced schedule (tokenspeed_jax.decode_schedule): random lengths in
    # [0, capacity] (zeros included), many short requests, one long request, lengths below S under the causal mask
    Case("var_b64s1h32p64", "bfloat16", 64, 1, 32, 64, 64, None),
    Case("var_b64s2h128p64", "bfloat16", 64, 2, 128, 64, 32, None),
    Case("var_b256s1h16p64_short", "bfloat16", 256, 1, 16, 64, 6, None),
    Case("var_b16s4h8p64_below_s", "bfloat16", 16, 4, 8, 64, 2, (0, 1, 2, 3, 4, 5, 0, 3, 1, 2, 70, 3, 0, 4, 2, 1)),
    Case("var_b32s2h16p16", "bfloat16", 32, 2, 16, 16, 160, None),
    Case("var_b1s1h16p64_128k", "bfloat16", 1, 1, 16, 64, 2048, (131072,)),
    Case("fp8_var_b64s1h32p64", "float8_e4m3fn", 64, 1, 32, 64, 64, None),
    Case("fp8_var_b64s4h32p64", "float8_e4m3fn", 64, 4, 32, 64, 32, None),
    Case("fp8_var_b32s1h16p16", "float8_e4m3fn", 32, 1, 16, 16, 160, None),
    Case("fp8_var_b200s2h64p64_short", "float8_e4m3fn", 200, 2, 64, 64, 4, None),
]

BENCH = [(64, 81920, 64, H, S) for H in (16, 32, 128) for S in (1, 4, 8)] + [
    (128, 4096, 64, 16, 1), (128, 4096, 64, 128, 1), (1, 81920, 64, 16, 1), (8, 16384, 64, 128, 2)]


def bench_case(B, K, page, H, S) -> Case:
    return Case(f"B{B}_K{K}_H{H}_S{S}", "bfloat16", B, S, H, page, K // page, (K,) * B)


def shapes(c: Case):
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(c.dtype)
    return (jax.ShapeDtypeStruct((c.B, c.S, c.H, 576), dt), jax.ShapeDtypeStruct((c.num_pages, c.page, 576), dt),
            jax.ShapeDtypeStruct((c.B, c.max_pages), jnp.int32), jax.ShapeDtypeStruct((c.B,), jnp.int32))


def named_config(name: str):
    """The sm90 kernel config a benchmark names: a key of ``sm90_decode.CONFIGS``, or such a key + ``"/noprefetch"``
    (that config with :attr:`~tokenspeed_jax.backends.sm90_decode.Sm90DecodeConfig.prefetch` off: the A/B of the
    prefetch across pieces, with no ``CONFIGS`` entry for it)."""
    from tokenspeed_jax.backends import sm90_decode

    base, sep, mod = name.partition("/")
    if base not in sm90_decode.CONFIGS or (sep and mod != "noprefetch"):
        raise ValueError(f"config: expected a name of sm90_decode.CONFIGS {sorted(sm90_decode.CONFIGS)}, optionally "
                         f"with '/noprefetch', got {name!r}")
    cfg = sm90_decode.CONFIGS[base]
    return dataclasses.replace(cfg, prefetch=False) if sep else cfg


def config_applies(c: Case, config: str) -> bool:
    """Whether the sm90 kernel config named ``config`` (:func:`named_config`) runs case ``c``."""
    from tokenspeed_jax.backends import sm90_decode
    from tokenspeed_jax.decode import _decode_problem
    from tokenspeed_jax.runtime import target_override

    with target_override("sm_90a", num_sms=132):
        prob = _decode_problem(*shapes(c), c.causal, 512, True)
    try:
        sm90_decode.check_config(prob, named_config(config))
    except ValueError:
        return False
    return True


def decode_fn(c: Case, backend: str, config: str | None = None):
    """jitted ``(q, kv, bt, sl, scale) -> (out, lse)``; ``config`` (sm90 only: a name, :func:`named_config`)
    calls the sm90 wrapper directly with that kernel config instead of going through ``mla_decode``, and then takes
    an optional sixth argument: the schedule ``(cta, req)`` computed outside (``sm90_decode.schedule_of``)."""
    import jax
    import jax.numpy as jnp

    from tokenspeed_jax import mla_decode

    if config is not None:
        from tokenspeed_jax.backends import sm90_decode
        from tokenspeed_jax.decode import _decode_problem

        def g(q, kv, bt, sl, scale, work=None):
            prob = _decode_problem(q, kv, bt, sl, c.causal, 512, True)
            return sm90_decode.decode(prob, q, kv, bt, sl, jnp.asarray(scale, jnp.float32), jnp.float32(1.0),
                                      config=named_config(config), work=work)

        return jax.jit(g)

    def f(q, kv, bt, sl, scale):
        return mla_decode(q, kv, bt, sl, softmax_scale=scale, causal=c.causal, return_lse=True, backend=backend)

    return jax.jit(f)


def _prewarm_one(c: Case, configs: tuple[str, ...] = (), invariant: bool = False) -> str:
    import jax
    import jax.numpy as jnp

    from tokenspeed_jax.runtime import target_override

    t = time.time()
    with target_override("sm_90a", num_sms=132):
        scale = jax.ShapeDtypeStruct((), jnp.float32)
        decode_fn(c, "sm90").trace(*shapes(c), scale).lower(lowering_platforms=("cuda",))
        for name in configs:
            if config_applies(c, name):
                decode_fn(c, "sm90", name).trace(*shapes(c), scale).lower(lowering_platforms=("cuda",))
        if invariant:  # the batch-invariant build (its own compile key)
            from tokenspeed_jax import mla_decode

            jax.jit(lambda q, kv, bt, sl, s: mla_decode(q, kv, bt, sl, softmax_scale=s, causal=c.causal,
                                                        return_lse=True, backend="sm90", batch_invariant=True)).trace(
                *shapes(c), scale).lower(lowering_platforms=("cuda",))
    return f"{c.name}: {time.time() - t:.1f}s"


def _worker_init():
    os.environ["JAX_PLATFORMS"] = "cpu"


def prewarm(cases, workers: int, configs: tuple[str, ...] = (), invariant: bool = False) -> None:
    import functools
    import multiprocessing as mp

    t = time.time()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from benchmarks.harness import scoped_env

    ctx = mp.get_context("spawn")
    with scoped_env("JAX_PLATFORMS", "cpu"), ctx.Pool(workers, initializer=_worker_init) as pool:  # (inherited)
        for msg in pool.imap_unordered(functools.partial(_prewarm_one, configs=tuple(configs), invariant=invariant),
                                       cases):
            print("prewarm", msg, flush=True)
    print(f"prewarm: {len(cases)} configs in {time.time() - t:.0f}s", flush=True)


# ------------------------------------------------------------------------------------------- inputs
def make_inputs(c: Case, seed: int):
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    cap = c.max_pages * c.page
    lens = np.array(c.lens if c.lens is not None else rng.integers(0, cap + 1, c.B), np.int64)
    used = np.minimum((np.minimum(lens, cap) + c.page - 1) // c.page, c.max_pages)
    perm = rng.permutation(c.num_pages)
    bt = np.zeros((c.B, c.max_pages), np.int64)
    kv = rng.standard_normal((c.num_pages, c.page, 576), np.float32)
    owned = np.zeros(c.num_pages, bool)
    k = 0
    for b in range(c.B):
        bt[b, : used[b]] = perm[k: k + used[b]]
        owned[perm[k: k + used[b]]] = True
        k += used[b]
        if c.garbage:
            bt[b, used[b]:] = rng.choice([-7, c.num_pages, 2**30, -(2**30)], c.max_pages - used[b])
        else:
            bt[b, used[b]:] = perm[rng.integers(0, c.num_pages, c.max_pages - used[b])]
    kv[~owned] = np.nan
    q = rng.standard_normal((c.B, c.S, c.H, 576), np.float32)
    dt = jnp.dtype(c.dtype)
    return (jnp.asarray(q, dt), jnp.asarray(kv, dt), jnp.asarray(bt, jnp.int32), jnp.asarray(lens.clip(0, 2**31 - 1),
            jnp.int32))


def poison():
    import jax.numpy as jnp

    x = jnp.full((64 << 20,), jnp.nan, jnp.float32)  # 256 MiB of NaN, freed: the allocator reuses it
    x.block_until_ready()
    del x


# FP8 QK^T runs on FP8 tensor cores (QGMMA), whose fp32 accumulator keeps about 14 bits per addition (DeepSeek-V3
# report, sec. 3.3.2; measured here: LSE errors up to 2.2e-3 where the 16-bit QK gave 1e-6). Per score the
# error of 18 k32 steps, each truncating at 2^-14 of at most |q| |k|, is taken as random (sqrt(18)) with a 2x
# margin: 2^-13 sqrt(18) scale |q| max|k|. The LSE moves by at most the largest score error of its row.
FP8_QK_ACC_EPS = 2.0 ** -13 * math.sqrt(18)


def fp8_qk_lse_slack(c: Case, q, kv, scale):
    """Extra LSE tolerance per row (shape of the LSE) for FP8 inputs, 0.0 otherwise (see FP8_QK_ACC_EPS)."""
    if c.dtype != "float8_e4m3fn":
        return 0.0
    qn = np.linalg.norm(np.asarray(q).astype(np.float32), axis=-1)
    kn = np.linalg.norm(np.asarray(kv).astype(np.float32).reshape(-1, kv.shape[-1]), axis=-1)
    return FP8_QK_ACC_EPS * float(scale) * qn * float(np.max(kn[np.isfinite(kn)], initial=0.0))


# FP8 P V on FP8 tensor cores (every FP8 config of the sm90 backend) rounds P to e4m3: 3 mantissa
# bits, a relative error of at most 2^-4 per probability (round to nearest; P is scaled by 2^8 first, so down to
# p = 2^-14 it stays a normal number).  Taken as independent, each at most uniform, the output error of a row and
# column has a standard deviation of at most 2^-4 / sqrt(3) * sqrt(sum_i p_i^2 v_i^2) / l; the check allows
# 4 * 2^-4 times that root (6.9 sigma) on top of the 16-bit tolerance.  l is summed over the unrounded P, so the
# LSE is unaffected.
FP8_P_ROUND = 4 * 2.0 ** -4


def p_round_spread(c: Case, q, kv, bt, sl, scale):
    """``sqrt(sum_i p_i^2 v_i^2) / l`` per output element (fp32 reference; see FP8_P_ROUND)."""
    import jax
    import jax.numpy as jnp

    from tokenspeed_jax.backends.xla import decode_probs
    from tokenspeed_jax.decode import _decode_problem

    f32 = jnp.float32
    prob = _decode_problem(q.astype(f32), kv.astype(f32), bt, sl, c.causal, 512, True)

    def f(q, kv, bt, sl, scale):
        pr, l, _, v = decode_probs(prob, q, kv, bt, sl, scale)
        acc2 = jnp.einsum("bshk,bkl->bshl", pr * pr, v * v, precision=jax.lax.Precision.HIGHEST)
        return jnp.where(l[..., None] > 0, jnp.sqrt(acc2) / jnp.where(l > 0, l, 1.0)[..., None], 0.0)

    return np.asarray(jax.jit(f)(q.astype(f32), kv.astype(f32), bt, sl, scale))


def fp8_pv_active(c: Case) -> bool:
    """Whether ``check`` runs the P V on FP8 tensor cores for ``c`` (every FP8 config: P rounded to e4m3)."""
    return c.dtype == "float8_e4m3fn"


def check(cases, seed: int, configs: tuple[str, ...] = (), out: str | None = None) -> list[dict]:
    """The correctness matrix on the selected config of each case, then on each named config that applies.  With
    ``out``, the results so far are rewritten there after every case (a run cut by a timeout keeps them)."""
    results = []
    for c in cases:
        for name in (None, *configs):
            if name is None or config_applies(c, name):
                results.append(_check_one(c, seed, name))
                if out:
                    with open(out + ".tmp", "w") as f:
                        json.dump({"seed": seed, "check": results, "complete": False}, f, indent=1)
                    os.replace(out + ".tmp", out)
    return results


def _check_one(c: Case, seed: int, config: str | None) -> dict:
    import jax.numpy as jnp

    t0 = time.time()
    q, kv, bt, sl = make_inputs(c, seed)
    scale = jnp.float32(576 ** -0.5)
    poison()
    fn = decode_fn(c, "sm90", config)
    out, lse = fn(q, kv, bt, sl, scale)
    out = np.asarray(out.astype(jnp.float32))
    lse = np.asarray(lse)
    poison()
    out2, lse2 = fn(q, kv, bt, sl, scale)
    det = bool(np.array_equal(np.asarray(out2.astype(jnp.float32)), out, equal_nan=True)
               and np.array_equal(np.asarray(lse2), lse, equal_nan=True))
    ro, rl = decode_fn(c, "xla")(q.astype(jnp.float32), kv.astype(jnp.float32), bt, sl, scale)
    ro, rl = np.asarray(ro), np.asarray(rl)
    # the same computation in the output dtype = the exact result rounded once (what the xla backend
    # gives for 16-bit/FP8 inputs): its error is the yardstick of the tolerance
    from tokenspeed_jax.problems import out_dtype_name

    xo = np.asarray(jnp.asarray(ro).astype(out_dtype_name(c.dtype)).astype(jnp.float32))
    err = np.abs(out - ro)
    err_x = float(np.nanmax(np.abs(xo - ro)))
    # Tolerance (ARCHITECTURE.md): at most 2x the error of the same computation in the input dtype
    # (the xla backend on bf16/fp16 inputs, i.e. output rounding) plus 1e-3.
    tol_o = 2 * err_x + 1e-3
    pv8 = fp8_pv_active(c)
    if pv8:  # P rounded to e4m3 (FP8_P_ROUND)
        tol_o = tol_o + FP8_P_ROUND * p_round_spread(c, q, kv, bt, sl, scale)
    ok_o = bool(np.all(err <= tol_o))
    inf_ok = bool(np.array_equal(np.isneginf(lse), np.isneginf(rl)))
    fin = np.isfinite(rl)
    lerr = float(np.max(np.abs(lse[fin] - rl[fin]))) if fin.any() else 0.0
    ltol = 1e-3 + 1e-4 * float(np.max(np.abs(rl[fin]), initial=0)) + fp8_qk_lse_slack(c, q, kv, scale)
    ok_l = inf_ok and bool(np.all(np.abs(lse[fin] - rl[fin]) <= (ltol[fin] if np.ndim(ltol) else ltol)))
    zero_rows = bool(np.all(out[np.isneginf(rl)] == 0))
    finite = bool(np.all(np.isfinite(out)))
    extra = {}
    if config is not None:  # informational: whether it gives the selected config's results bitwise
        do, dl = decode_fn(c, "sm90")(q, kv, bt, sl, scale)
        extra = {"config": config, "bitwise_equal_selected": bool(
            np.array_equal(np.asarray(do.astype(jnp.float32)), out, equal_nan=True)
            and np.array_equal(np.asarray(dl), lse, equal_nan=True))}
    r = {"case": c.name, **extra, "ok": ok_o and ok_l and det and zero_rows and finite,
         "max_err": float(np.max(err)), "max_err_over_tol": float(np.max(err / tol_o)),
         "fp8_pv": pv8,
         "xla_native_err": err_x, "err_ratio": float(np.max(err)) / max(err_x, 1e-12), "lse_err": lerr,
         "lse_tol": float(np.min(ltol)), "lse_inf_match": inf_ok, "deterministic": det,
         "empty_rows_zero": zero_rows, "all_finite": finite,
         "secs": round(time.time() - t0, 1)}
    print(json.dumps(r), flush=True)
    return r


# -------------------------------------------------------------------------------------------- bench
def bench(cases, report, with_xla=True, with_flashmla=True, configs: tuple[str, ...] = (), sustain=0.0,
          report_sustained=None, calls: int = 1) -> None:
    fm = None
    if with_flashmla:
        try:
            import flash_mla as fm
        except Exception as e:  # noqa: BLE001
            print("flash_mla unavailable:", e)
    for (B, K, page, H, S) in cases:
        n = len(report.rows)
        ns = len(report_sustained.rows) if report_sustained else 0
        _bench_one(report, fm, bench_case(B, K, page, H, S), with_xla, configs,
                   sustain=sustain, report_sustained=report_sustained, calls=calls)
        print("\n".join(report.table().splitlines()[1 + n:]), flush=True)
        if report_sustained:
            print("\n".join(f"{x} (sustained)" for x in report_sustained.table().splitlines()[1 + ns:]), flush=True)


def bench_inputs(c: Case):
    """Timing inputs of a benchmark case: bf16 q and cache (random), identity block table, every request
    at full length; ``(q, kv, block_table, seq_lens, softmax_scale)``."""
    import jax
    import jax.numpy as jnp

    B, S, H = c.B, c.S, c.H
    kv = jax.random.normal(jax.random.PRNGKey(B * 1000 + H * 10 + S), (c.num_pages, c.page, 576), jnp.bfloat16)
    q = jax.random.normal(jax.random.PRNGKey(1), (B, S, H, 576), jnp.bfloat16)
    bt = jnp.arange(B * c.max_pages, dtype=jnp.int32).reshape(B, c.max_pages)
    sl = jnp.full((B,), c.max_pages * c.page, jnp.int32)
    return q, kv, bt, sl, jnp.float32(576 ** -0.5)


def est_us(c: Case) -> float:
    """Rough µs per call of a benchmark case (H200-ish rates), only to size timing rounds."""
    from benchmarks.harness import decode_cost

    nbytes, flops = decode_cost(c.B, c.S, c.H, c.max_pages * c.page)
    return max(nbytes / 4e12, flops / 6e14) * 1e6


def _jax_calls(f, args, n: int = 1):
    """A zero-argument callable running the jitted ``f`` on ``args``.  With ``n`` > 1 it makes ``n`` calls per
    dispatch: one executable whose ``n`` calls read ``n`` distinct copies of q, so none is merged or dropped and no
    kernel is added (``--calls``: a short call timed by the device, not by the host's dispatch)."""
    if n <= 1:
        return lambda: f(*args)
    import jax
    import jax.numpy as jnp

    qs = tuple(jnp.array(args[0], copy=True) for _ in range(n))
    g = jax.jit(lambda qs, *rest: tuple(f(qi, *rest) for qi in qs))
    return lambda: g(qs, *args[1:])


def _torch_calls(run, n: int, notes: dict, name: str):
    """``run`` (a FlashMLA call).  With ``n`` > 1: ``n`` calls captured in one CUDA graph and replayed (vLLM runs
    these kernels in CUDA graphs); where the capture fails, ``n`` plain calls.  ``notes[name]`` says which."""
    if n <= 1:
        return run
    import torch

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # (warm-up off the capture stream, as torch.cuda.graph asks)
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [run() for _ in range(n)]
    except Exception as e:  # noqa: BLE001
        notes[name] = f"CUDA graph capture failed ({str(e)[:60]}), {n} plain calls per dispatch"

        def plain():
            out = None
            for _ in range(n):
                out = run()
            return out

        return plain
    notes[name] = f"{n} calls per dispatch (one CUDA graph)"

    def replay():
        graph.replay()
        return outs[-1]

    return replay


def _per_call(r: dict, n: int) -> dict:
    """A timing result of ``n`` calls per dispatch, per call."""
    if n <= 1:
        return r
    r = dict(r, **{k: r[k] / n for k in ("median_us", "min_us", "max_us") if k in r})
    r["samples_us"] = [round(x / n, 2) for x in r["samples_us"]]
    return r


def _bench_one(report, fm, c: Case, with_xla: bool, configs: tuple[str, ...] = (),
               rounds: int = 5, sustain: float = 0.0, report_sustained=None, calls: int = 1) -> None:
    """Time every contender of one shape on the same inputs, interleaved (``benchmarks.harness.interleaved``:
    alternating rounds, the order rotating, each contender's median), then add their rows in a fixed order.  With
    ``sustain`` > 0, also time them (plain XLA aside) in steady state (``benchmarks.harness.sustained``: ``sustain``
    seconds back to back each, twice, the second half timed, with the SM clock and power) into ``report_sustained``.
    With ``calls`` > 1 every contender makes that many calls per dispatch (ours: one executable, :func:`_jax_calls`;
    FlashMLA: one CUDA graph, :func:`_torch_calls`) and the rows give the time per call.  ``configs``: names of
    ``sm90_decode.CONFIGS`` timed as extra contenders ``ours bf16 NAME`` / ``ours fp8 NAME`` where they apply."""
    import jax
    import jax.numpy as jnp

    from benchmarks.harness import decode_cost, interleaved, sustained

    B, K, page, H, S = c.B, c.max_pages * c.page, c.page, c.H, c.S
    q, kv, bt, sl, scale = bench_inputs(c)
    nbytes, flops = decode_cost(B, S, H, K)
    nb8, _ = decode_cost(B, S, H, K, elt_bytes=1)
    fns: dict = {}  # contender -> (zero-argument callable, bytes, fp8)
    ours = decode_fn(c, "sm90")
    args = (q, kv, bt, sl, scale)
    fns["ours bf16"] = (_jax_calls(ours, args, calls), nbytes, False)
    for name in configs:
        if config_applies(c, name):
            ours_s = decode_fn(c, "sm90", name)
            fns[f"ours bf16 {name}"] = (_jax_calls(ours_s, args, calls), nbytes, False)
            same = bool(np.array_equal(np.asarray(ours_s(q, kv, bt, sl, scale)[0].astype(jnp.float32)),
                                       np.asarray(ours(q, kv, bt, sl, scale)[0].astype(jnp.float32))))
            print(f"{c.name}: bf16 {name} bitwise equal to the selected config: {same}", flush=True)
    c8 = dataclasses.replace(c, dtype="float8_e4m3fn")
    q8j, kv8j = q.astype(jnp.float8_e4m3fn), kv.astype(jnp.float8_e4m3fn)
    ours8 = decode_fn(c8, "sm90")
    args8 = (q8j, kv8j, bt, sl, scale)
    fns["ours fp8"] = (_jax_calls(ours8, args8, calls), nb8, True)
    for name in configs:
        if config_applies(c8, name):
            ours8_s = decode_fn(c8, "sm90", name)
            fns[f"ours fp8 {name}"] = (_jax_calls(ours8_s, args8, calls), nb8, True)
    failed: dict = {}
    notes: dict = {}  # contender -> how its calls were batched (--calls)
    if fm is not None:
        import torch

        tq = torch.from_dlpack(q)
        tk = torch.from_dlpack(kv).view(c.num_pages, page, 1, 576)
        tbt = torch.from_dlpack(bt)
        tsl = torch.from_dlpack(sl)
        sched, _ = fm.get_mla_metadata()

        def run():
            return fm.flash_mla_with_kvcache(tq, tk, tbt, tsl, 512, sched, None, softmax_scale=576 ** -0.5,
                                             causal=True)

        ref_out = run()[0]
        fns["FlashMLA bf16"] = (_torch_calls(run, calls, notes, "FlashMLA bf16"), nbytes, False)
        o = np.asarray(ours(q, kv, bt, sl, scale)[0].astype(jnp.float32))
        r = np.asarray(jax.dlpack.from_dlpack(ref_out).astype(jnp.float32))
        print(f"{c.name}: max |ours - FlashMLA| = {np.max(np.abs(o - r)):.3e}", flush=True)
        q8, k8 = tq.to(torch.float8_e4m3fn), tk.to(torch.float8_e4m3fn)
        one = torch.ones(1, dtype=torch.float32, device=tq.device)

        def run8():
            return fm.flash_mla_fp8_dense(q8, k8, tbt, tsl, 576 ** -0.5, True, one, one)

        try:
            run8()
            fns["FlashMLA fp8"] = (_torch_calls(run8, calls, notes, "FlashMLA fp8"), nb8, True)
        except Exception as e:  # noqa: BLE001
            failed["FlashMLA fp8"] = (str(e)[:80], nb8)
    if with_xla and H == 32 and B == 64:
        xf = decode_fn(c, "xla")
        fns["plain XLA"] = (_jax_calls(xf, args, calls), nbytes, False)
    for n in fns:
        if calls > 1 and n not in notes:
            notes[n] = f"{calls} calls per dispatch (one executable)"
    res = interleaved({n: f for n, (f, _, _) in fns.items()}, est_us(c) * calls, rounds=rounds)
    for n, (_, nb, fp8) in fns.items():
        r = _per_call(res[n], calls)
        report.add(c.name, n, r, nbytes=nb, flops=flops, fp8=fp8,
                   note=f"interleaved median of {rounds} rounds" + (f", {notes[n]}" if n in notes else ""),
                   samples_us=r["samples_us"])
    for n, (why, nb) in failed.items():
        report.add(c.name, n, None, nbytes=nb, flops=flops, note=why)
    if sustain > 0 and report_sustained is not None:
        res = sustained({n: f for n, (f, _, _) in fns.items() if n != "plain XLA"}, sustain)
        for n, r in res.items():
            _, nb, fp8 = fns[n]
            r = _per_call(r, calls)
            report_sustained.add(c.name, n, r, nbytes=nb, flops=flops, fp8=fp8,
                                 note=f"sustained {sustain:g} s x {len(r['samples_us'])}, second half timed"
                                 + (f", {notes[n]}" if n in notes else ""),
                                 **{k: r[k] for k in ("samples_us", "sm_mhz", "power_w", "throttle_reasons")})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--prewarm", type=int, default=0, help="CPU worker processes compiling every config first")
    ap.add_argument("--no-xla", action="store_true")
    ap.add_argument("--cases", default="", help="comma-separated CHECK case names (default: all)")
    ap.add_argument("--quick", action="store_true", help="bench 4 representative shapes only")
    ap.add_argument("--shapes", nargs="+", default=None, metavar="B,K,PAGE,H,S",
                    help="bench these shapes instead of the issue's matrix (e.g. a K sweep for scripts/fixed_cost.py)")
    ap.add_argument("--calls", type=int, default=1,
                    help="calls per dispatch (ours: one executable; FlashMLA: one CUDA graph), the rows per call: "
                         "times short shapes by the device instead of the host's dispatch")
    ap.add_argument("--config", action="append", default=[], metavar="NAME",
                    help="also check and time this sm90 kernel config where it applies (a name of "
                         "tokenspeed_jax.backends.sm90_decode.CONFIGS; repeatable)")
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--out", default="/tmp/decode.json")
    ap.add_argument("--png", default=None)
    ap.add_argument("--sustain", type=float, default=0.0,
                    help="also time each contender back to back for this many seconds (twice, the second half "
                         "timed; benchmarks.harness.sustained) into <out>_sustained.json / <png>_sustained.png")
    a = ap.parse_args(argv)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from tokenspeed_jax.backends.sm90_decode import CONFIGS

    bad = [n for n in a.config if n not in CONFIGS]
    if bad:
        ap.error(f"--config: expected names of {tuple(CONFIGS)}, got {bad}")
    checks = [c for c in CHECK if not a.cases or c.name in a.cases.split(",")]
    benches = [BENCH[i] for i in (0, 4, 8, 9)] if a.quick else BENCH
    if a.calls < 1:
        ap.error(f"--calls: expected a positive number of calls per dispatch, got {a.calls}")
    if a.shapes:
        benches = [tuple(int(x) for x in s.split(",")) for s in a.shapes]
        if any(len(b) != 5 or b[1] % b[2] for b in benches):
            ap.error(f"--shapes: expected B,K,PAGE,H,S with K a multiple of PAGE, got {a.shapes}")
    if a.prewarm:
        todo = (checks if a.check else []) + ([bench_case(*x) for x in benches] if a.bench else [])
        todo += [dataclasses.replace(bench_case(*x), dtype="float8_e4m3fn") for x in benches] if a.bench else []
        prewarm(todo, a.prewarm, tuple(a.config))
    doc = {"seed": a.seed}
    if a.check:
        res = check(checks, a.seed, tuple(a.config), out=a.out.replace(".json", "_check.json"))
        doc["check"] = res
        doc["complete"] = True
        extra = f", configs {a.config}" if a.config else ""
        print(f"check: {sum(r['ok'] for r in res)}/{len(res)} cases pass (seed {a.seed}{extra})", flush=True)
        with open(a.out.replace(".json", "_check.json"), "w") as f:
            json.dump(doc, f, indent=1)
    if a.bench:
        from benchmarks.harness import Report, measure_ceilings

        rep = Report("mla_decode sm90", measure_ceilings())
        rep_s = Report(f"mla_decode sm90, sustained ({a.sustain:g} s each, second half)", rep.ceilings) \
            if a.sustain > 0 else None
        try:
            bench(benches, rep, with_xla=not a.no_xla, configs=tuple(a.config), sustain=a.sustain,
                  report_sustained=rep_s, calls=a.calls)
        finally:
            rep.write(a.out, a.png)
            print(rep.table())
            if rep_s is not None:
                rep_s.write(a.out.replace(".json", "_sustained.json"),
                            a.png.replace(".png", "_sustained.png") if a.png else None)
                print(rep_s.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
