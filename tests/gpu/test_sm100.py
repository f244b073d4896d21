"""Correctness of the ``sm100`` backend (TokenSpeed MLA kernels) against the exact ``xla`` backend.

Runs only on a Blackwell GPU (sm_100a / sm_103a) with tokenspeed-mla installed; everywhere else it is
skipped.  This project has compiled and lowered these kernels in CI but never executed them; on a B200 /
B300 / GB200 machine run::

    pip install -e '.[sm100,test]' && pytest -m gpu tests/gpu/test_sm100.py -v

The matrix mirrors the Hopper decode / prefill GPU tests: dtypes (BF16, FP16, FP8 -> BF16), head counts,
query lengths 1..16 (plain, folded and packed row layouts), page sizes 16..128, causal and not, LSE,
ragged lengths (0, below S, not page multiples), permuted block tables with garbage entries past the used
pages and NaN in every page a request does not own, runtime scales (one compile for many values) and
determinism.  Inputs respect the backend's documented precondition: rows past ``seq_len`` inside a
request's own last page, and k/v padding rows, hold finite junk (not NaN).
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import reference as R
from tokenspeed_jax import mla_decode, mla_prefill
from tokenspeed_jax.runtime import current_target


def _blackwell() -> bool:
    try:
        t = current_target()
    except Exception:  # noqa: BLE001
        return False
    return t.platform == "cuda" and t.arch in ("sm_100a", "sm_103a")


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _blackwell(), reason="needs a Blackwell (sm_100a / sm_103a) GPU"),
    pytest.mark.skipif(importlib.util.find_spec("tokenspeed_mla") is None, reason="tokenspeed-mla missing"),
]

TOL = {"bfloat16": 0.02, "float16": 0.02, "float8_e4m3fn": 0.1}
RMSE = {"bfloat16": 0.01, "float16": 0.01, "float8_e4m3fn": 0.05}
JUNK = 30.0  # finite junk in a request's own tail rows


def _finite_tails(kv, bt, seq_lens, page_size, dtype):
    kv = R.f64(kv)
    for b, n in enumerate(seq_lens):
        used = -(-int(n) // page_size)
        if used and n % page_size:
            kv[bt[b, used - 1], n % page_size:] = JUNK
    return R.cast(kv, dtype)


def _check(got, want, dtype, what):
    got = R.f64(got)
    want = R.f64(want)
    tol = TOL[dtype]
    scale = float(np.nanmax(np.abs(want[np.isfinite(want)]), initial=1.0))
    R.assert_close(got, want, atol=tol * scale, rtol=tol, what=what)
    fin = np.isfinite(want)
    if fin.any():
        rmse = np.sqrt(np.mean((got[fin] - want[fin]) ** 2)) / max(np.sqrt(np.mean(want[fin] ** 2)), 1e-8)
        assert rmse <= RMSE[dtype], f"{what}: relative RMSE {rmse:.4f}"


DECODE = [
    # dtype, S, H, page, lens
    ("bfloat16", 1, 128, 64, [1, 700, 0, 4096]),
    ("bfloat16", 4, 16, 32, [3, 130, 2049, 5]),
    ("bfloat16", 8, 128, 64, [8, 9, 1000, 7]),
    ("bfloat16", 16, 8, 16, [16, 17, 300, 0]),
    ("bfloat16", 3, 96, 128, [3, 129, 600]),  # packed rows
    ("float16", 2, 64, 64, [1, 2, 513, 1024]),
    ("float16", 4, 128, 128, [4, 3000]),
    ("float8_e4m3fn", 1, 16, 64, [1, 64, 8191]),
    ("float8_e4m3fn", 4, 16, 64, [4, 2, 777]),  # M64 on sm_100a
    ("float8_e4m3fn", 8, 96, 64, [8, 257, 2000]),  # packed rows
    ("float8_e4m3fn", 2, 128, 32, [2, 100, 0, 4000]),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype,S,H,page,lens", DECODE)
def test_decode_matches_xla(rng, dtype, S, H, page, lens, causal):
    fp8 = dtype == "float8_e4m3fn"
    q, kv, bt, sl = R.make_decode_inputs(rng, seq_lens=lens, S=S, H=H, L=512, R=64, page_size=page,
                                         dtype=dtype, scale_q=0.5 if fp8 else 1.0)
    kv = _finite_tails(kv, bt, sl, page, dtype)
    args = [jnp.asarray(x) for x in (q, kv, bt, sl)]
    ss, os_ = 576**-0.5 * (0.7 if fp8 else 1.0), 1.25

    @jax.jit
    def run(q, kv, bt, sl, ss, os_):
        a = mla_decode(q, kv, bt, sl, softmax_scale=ss, output_scale=os_, causal=causal, return_lse=True,
                       backend="sm100")
        b = mla_decode(q, kv, bt, sl, softmax_scale=ss, output_scale=os_, causal=causal, return_lse=True,
                       backend="xla")
        return a, b

    (out, lse), (ref, ref_lse) = run(*args, ss, os_)
    assert out.dtype == (jnp.bfloat16 if fp8 else jnp.dtype(dtype))
    _check(out, ref, dtype, "out")
    R.assert_close(lse, ref_lse, atol=0.05 if fp8 else 2e-3, rtol=1e-3, what="lse")
    # runtime scales: a new value reuses the compiled call and is honoured
    (out2, lse2), (ref2, ref_lse2) = run(*args, ss * 0.5, -2.0)
    _check(out2, ref2, dtype, "out (second scales)")
    R.assert_close(lse2, ref_lse2, atol=0.05 if fp8 else 2e-3, rtol=1e-3, what="lse (second scales)")
    assert run._cache_size() == 1
    # deterministic
    (out3, lse3), _ = run(*args, ss, os_)
    np.testing.assert_array_equal(np.asarray(out3, np.float32), np.asarray(out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse3), np.asarray(lse))


def test_decode_without_lse_and_empty_rows(rng):
    q, kv, bt, sl = R.make_decode_inputs(rng, seq_lens=[0, 2, 5], S=4, H=16, L=512, R=64, page_size=64)
    kv = _finite_tails(kv, bt, sl, 64, "bfloat16")
    out = mla_decode(*(jnp.asarray(x) for x in (q, kv, bt, sl)), softmax_scale=0.05, backend="sm100")
    ref = mla_decode(*(jnp.asarray(x) for x in (q, kv, bt, sl)), softmax_scale=0.05, backend="xla")
    _check(out, ref, "bfloat16", "out")
    o = np.asarray(out, np.float32)
    assert (o[0] == 0).all() and (o[1, :2] == 0).all()  # rows that see no key are exactly 0


PREFILL = [
    # dtype, lens_q, lens_k, Hq, Hk
    ("bfloat16", [17, 300, 1], [17, 300, 1], 16, 16),
    ("bfloat16", [5, 129, 0, 40], [60, 129, 8, 10], 32, 8),  # Lq > Lk rows, empty request, GQA
    ("float8_e4m3fn", [256, 33], [256, 700], 16, 16),
    ("float16", [100, 7], [120, 0], 8, 8),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype,lens_q,lens_k,Hq,Hk", PREFILL)
def test_prefill_matches_xla(rng, dtype, lens_q, lens_k, Hq, Hk, causal):
    q, k, v, cq, ck = R.make_prefill_inputs(rng, lens_q=lens_q, lens_k=lens_k, Hq=Hq, Hk=Hk, Dqk=192,
                                            Dv=128, dtype=dtype, pad_q=5, pad_k=7)
    k, v = R.f64(k), R.f64(v)
    k[ck[-1]:], v[ck[-1]:] = JUNK, JUNK  # finite padding (backend precondition)
    args = [jnp.asarray(x) for x in (q, R.cast(k, dtype), R.cast(v, dtype), cq, ck)]

    @jax.jit
    def run(q, k, v, cq, ck, ss):
        kw = {"softmax_scale": ss, "causal": causal, "return_lse": True, "max_seqlen_q": max(lens_q),
              "max_seqlen_k": max(lens_k)}
        return mla_prefill(q, k, v, cq, ck, backend="sm100", **kw), mla_prefill(q, k, v, cq, ck, backend="xla", **kw)

    (out, lse), (ref, ref_lse) = run(*args, 192**-0.5)
    assert out.dtype == (jnp.float16 if dtype == "float16" else jnp.bfloat16)
    _check(out, ref, dtype, "out")
    R.assert_close(lse, ref_lse, atol=0.05 if dtype == "float8_e4m3fn" else 2e-3, rtol=1e-3, what="lse")
    (out2, _), (ref2, _) = run(*args, 0.3 * 192**-0.5)
    _check(out2, ref2, dtype, "out (second scale)")
    assert run._cache_size() == 1
    (out3, _), _ = run(*args, 192**-0.5)
    np.testing.assert_array_equal(np.asarray(out3, np.float32), np.asarray(out, np.float32))
