"""mla_decode against the float64 NumPy reference (tests/reference.py).

Inputs are adversarial where the contract allows: permuted block tables, NaN in every cache row a request
does not own, garbage block-table entries past the used pages, ragged lengths that are not multiples of the
page size, zero-length requests, seq_len < S under the causal mask.  ``TOKENSPEED_TEST_BACKEND`` picks the
backend under test (default ``xla``; a GPU run can point the same suite at ``sm90``).
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokenspeed_jax as tj
from tests import reference as ref

BACKEND = os.environ.get("TOKENSPEED_TEST_BACKEND", "xla")


@functools.partial(jax.jit, static_argnames=("causal", "kv_lora_rank", "backend"))
def decode(q, kv, bt, sl, ss, os_, *, causal=True, kv_lora_rank=512, backend=BACKEND):
    return tj.mla_decode(q, kv, bt, sl, softmax_scale=ss, output_scale=os_, causal=causal,
                         kv_lora_rank=kv_lora_rank, return_lse=True, backend=backend)


def check(rng, *, seq_lens, S, H, L, R, ps, dtype, causal=True, output_scale=1.0, **kw):
    q, kv, bt, sl = ref.make_decode_inputs(rng, seq_lens=seq_lens, S=S, H=H, L=L, R=R, page_size=ps,
                                           dtype=dtype, **kw)
    ss = 1.0 / math.sqrt(L + R)
    out, lse = decode(q, kv, bt, sl, ss, output_scale, causal=causal, kv_lora_rank=L)
    want_dtype = "bfloat16" if dtype == "float8_e4m3fn" else dtype
    assert out.shape == (len(seq_lens), S, H, L) and jnp.dtype(out.dtype).name == want_dtype
    assert lse.shape == (len(seq_lens), S, H) and lse.dtype == jnp.float32
    r_out, r_lse = ref.mla_decode(q, kv, bt, sl, softmax_scale=ss, output_scale=output_scale,
                                  causal=causal, kv_lora_rank=L)
    ref.assert_close(out, r_out, what="out")
    ref.assert_close(lse, r_lse, dtype="float32", atol=1e-4, what="lse")
    return q, kv, bt, sl, out, lse


SMALL = [  # seq_lens, S, H, L, R, page_size, dtype, causal
    ([1], 1, 1, 32, 16, 16, "bfloat16", True),
    ([0, 5, 17, 33], 1, 4, 32, 16, 16, "bfloat16", True),
    ([3, 40, 64], 4, 8, 32, 16, 32, "float16", True),
    ([16, 1, 0, 100], 16, 2, 32, 16, 64, "bfloat16", True),
    ([130, 7], 2, 128, 16, 16, 128, "bfloat16", True),
    ([300, 256, 1], 3, 16, 32, 16, 256, "float32", False),
    ([5, 77], 8, 3, 32, 32, 16, "float8_e4m3fn", True),
    ([2, 9, 31], 5, 5, 32, 16, 16, "float32", True),
    ([0, 0], 2, 2, 32, 16, 16, "bfloat16", False),
    ([47, 12, 64, 65, 3], 7, 6, 16, 16, 32, "float16", False),
]


@pytest.mark.parametrize("seq_lens,S,H,L,R,ps,dtype,causal", SMALL)
def test_decode_small_shapes(rng, seq_lens, S, H, L, R, ps, dtype, causal):
    check(rng, seq_lens=seq_lens, S=S, H=H, L=L, R=R, ps=ps, dtype=dtype, causal=causal)


@pytest.mark.parametrize(
    "seq_lens,S,H,ps,dtype",
    [([1, 200, 513], 2, 16, 64, "bfloat16"), ([100, 1000], 1, 128, 64, "bfloat16"),
     ([40, 3], 4, 16, 16, "float8_e4m3fn"), ([257], 16, 8, 256, "float16")],
)
def test_decode_deepseek_dims(rng, seq_lens, S, H, ps, dtype):
    """The real DeepSeek-R1 head dims: 576 = 512 latent + 64 rope."""
    check(rng, seq_lens=seq_lens, S=S, H=H, L=512, R=64, ps=ps, dtype=dtype)


def test_decode_random_ragged(rng):
    """Random lengths (some zero, some not multiples of the page size) with a fixed compiled shape."""
    for _ in range(3):
        sl = rng.integers(0, 6 * 16 + 1, size=6)
        sl[rng.integers(0, 6)] = 0
        need = -(-sl // 16)
        check(rng, seq_lens=sl, S=3, H=4, L=32, R=16, ps=16, dtype="bfloat16", extra_cols=6 - need.max(),
              extra_pages=40 - need.sum())


@pytest.mark.parametrize("causal", [True, False])
def test_decode_mask_rows(rng, causal):
    """seq_len < S under causal: rows that see no key are exactly 0 with LSE -inf (never NaN); row i
    sees exactly seq_len - S + 1 + i keys (checked by appending a huge key that only later rows see)."""
    S, H, L, R, ps = 6, 2, 16, 16, 16
    q, kv, bt, sl, out, lse = check(rng, seq_lens=[0, 1, 3, 6, 20], S=S, H=H, L=L, R=R, ps=ps,
                                    dtype="float32", causal=causal)
    out, lse = np.asarray(out), np.asarray(lse)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    for b, n in enumerate([0, 1, 3, 6, 20]):
        for i in range(S):
            seen = min(n, max(0, n - S + 1 + i)) if causal else n
            if seen == 0:
                assert (out[b, i] == 0).all() and np.isneginf(lse[b, i]).all(), (b, i)
            else:
                assert np.isfinite(lse[b, i]).all(), (b, i)


def test_decode_mask_boundary_exact(rng):
    """Key j = seq_len - S + i (the last visible key of row i) has a one-hot value: row i must see it and
    row i - 1 must not."""
    S, H, L, R, ps, n = 4, 1, 16, 16, 16, 10
    q, kv, bt, sl = ref.make_decode_inputs(rng, seq_lens=[n], S=S, H=H, L=L, R=R, page_size=ps,
                                           dtype="float32")
    q[:] = 0.0  # uniform attention: out = mean of the visible values
    kv = np.asarray(kv).copy()
    for j in range(n):
        kv[bt[0, j // ps], j % ps, :L] = 0.0
        kv[bt[0, j // ps], j % ps, j] = 1.0  # value of key j is e_j
    out, lse = decode(q, kv, bt, sl, 1.0, 1.0, causal=True, kv_lora_rank=L)
    out = np.asarray(out)
    for i in range(S):
        seen = n - S + 1 + i
        np.testing.assert_allclose(out[0, i, 0, :seen], 1.0 / seen, rtol=1e-6)
        np.testing.assert_array_equal(out[0, i, 0, seen:], 0.0)
        np.testing.assert_allclose(np.asarray(lse)[0, i, 0], np.log(seen), rtol=1e-6)


def test_decode_lse_independent_of_output_scale(rng):
    q, kv, bt, sl = ref.make_decode_inputs(rng, seq_lens=[9, 0, 33], S=2, H=4, L=32, R=16, page_size=16,
                                           dtype="float32")
    o1, l1 = decode(q, kv, bt, sl, 0.2, 1.0, kv_lora_rank=32)
    o3, l3 = decode(q, kv, bt, sl, 0.2, -3.5, kv_lora_rank=32)
    np.testing.assert_array_equal(np.asarray(l1), np.asarray(l3))
    np.testing.assert_allclose(np.asarray(o3), -3.5 * np.asarray(o1), rtol=1e-6, atol=1e-7)


def test_decode_nan_pages_and_garbage_table_do_not_change_results(rng):
    """The same logical data in a clean layout (identity table, zeros elsewhere) and in the adversarial
    layout give bit-identical results."""
    L, R, ps, S, H = 32, 16, 16, 3, 4
    q, kv, bt, sl = ref.make_decode_inputs(rng, seq_lens=[20, 0, 33, 2], S=S, H=H, L=L, R=R, page_size=ps,
                                           dtype="bfloat16")
    kvf = ref.f64(kv)
    clean = np.zeros((4 * bt.shape[1], ps, L + R))
    cbt = np.arange(4 * bt.shape[1], dtype=np.int32).reshape(4, -1)
    for b in range(4):
        for j in range(int(sl[b])):
            clean[cbt[b, j // ps], j % ps] = kvf[bt[b, j // ps], j % ps]
    clean = ref.cast(clean, "bfloat16")
    a = decode(q, kv, bt, sl, 0.1, 1.0, kv_lora_rank=L)
    b = decode(q, clean, cbt, sl, 0.1, 1.0, kv_lora_rank=L)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.isnan(np.asarray(a[0])).any()


def test_decode_fp8_scale_folding(rng):
    """FP8 in, bf16 out: a cache storing x / k_scale and q stored as q / q_scale, with
    softmax_scale = scale * q_scale * k_scale and output_scale = k_scale, equals attention over the
    dequantised values (the convention in decode.py's docstring)."""
    L, R, ps, S, H = 64, 32, 16, 2, 8
    q32, kv32, bt, sl = ref.make_decode_inputs(rng, seq_lens=[50, 7, 0], S=S, H=H, L=L, R=R, page_size=ps,
                                               dtype="float32", scale_q=3.0, scale_kv=20.0)
    q_scale, k_scale, scale = 0.05, 0.25, 1.0 / math.sqrt(L + R)
    q8 = ref.e4m3(q32, q_scale)
    kv8 = ref.e4m3(kv32, k_scale)
    out, lse = decode(q8, kv8, bt, sl, scale * q_scale * k_scale, k_scale, kv_lora_rank=L)
    assert out.dtype == jnp.bfloat16
    deq_q, deq_kv = ref.f64(q8) * q_scale, ref.f64(kv8) * k_scale
    r_out, r_lse = ref.mla_decode(deq_q, deq_kv, bt, sl, softmax_scale=scale, kv_lora_rank=L)
    ref.assert_close(out, r_out, atol=1e-4, what="out")
    ref.assert_close(lse, r_lse, dtype="float32", atol=1e-4, what="lse")


def test_decode_traced_scales_are_runtime_values(rng):
    """softmax_scale / output_scale are operands: new values reuse the compiled executable and give the
    new results (nothing is baked in or cached across calls)."""
    q, kv, bt, sl = ref.make_decode_inputs(rng, seq_lens=[17, 4], S=1, H=2, L=32, R=16, page_size=16,
                                           dtype="float32")
    f = jax.jit(lambda ss, os_: tj.mla_decode(q, kv, bt, sl, softmax_scale=ss, output_scale=os_,
                                              kv_lora_rank=32, return_lse=True, backend=BACKEND))
    for ss, os_ in ((0.1, 1.0), (0.7, 2.0), (0.01, -1.0)):
        out, lse = f(jnp.float32(ss), jnp.float32(os_))
        r_out, r_lse = ref.mla_decode(q, kv, bt, sl, softmax_scale=np.float32(ss), output_scale=os_,
                                      kv_lora_rank=32)
        ref.assert_close(out, r_out, what=f"out ss={ss}")
        ref.assert_close(lse, r_lse, dtype="float32", atol=1e-5, what=f"lse ss={ss}")
    assert f._cache_size() == 1


def test_decode_scale_as_size1_array_and_return_forms(rng):
    q, kv, bt, sl = ref.make_decode_inputs(rng, seq_lens=[5], S=1, H=1, L=16, R=16, page_size=16,
                                           dtype="float32")
    a = tj.mla_decode(q, kv, bt, sl, softmax_scale=np.array([0.3], np.float32), kv_lora_rank=16,
                      backend=BACKEND)
    b, lse = tj.mla_decode(q, kv, bt, sl, softmax_scale=0.3, kv_lora_rank=16, return_lse=True,
                           backend=BACKEND)
    assert not isinstance(a, tuple)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_decode_auto_matches_named(rng):
    q, kv, bt, sl = ref.make_decode_inputs(rng, seq_lens=[5, 30], S=2, H=2, L=16, R=16, page_size=16,
                                           dtype="bfloat16")
    a = decode(q, kv, bt, sl, 0.2, 1.0, kv_lora_rank=16, backend="auto")
    r_out, _ = ref.mla_decode(q, kv, bt, sl, softmax_scale=0.2, kv_lora_rank=16)
    ref.assert_close(a[0], r_out, what="auto")


def test_decode_runtime_data_clamped(rng):
    """The documented clamp: seq_lens beyond the table's capacity act as the capacity, negative lengths
    as 0; out-of-range page ids inside the used range are clamped (memory-safe, finite result)."""
    L, R, ps = 16, 16, 16
    q, kv, bt, sl = ref.make_decode_inputs(rng, seq_lens=[32, 32, 5], S=2, H=2, L=L, R=R, page_size=ps,
                                           dtype="float32", extra_cols=0)
    cap = bt.shape[1] * ps
    bad = np.array([cap + 1000, -5, 5], np.int32)
    out, lse = decode(q, kv, bt, bad, 0.2, 1.0, kv_lora_rank=L)
    r_out, r_lse = ref.mla_decode(q, kv, bt, np.array([cap, 0, 5]), softmax_scale=0.2, kv_lora_rank=L)
    ref.assert_close(out, r_out, what="clamped out")
    ref.assert_close(lse, r_lse, dtype="float32", what="clamped lse")
    kv_ok = np.nan_to_num(np.asarray(kv))
    bt2 = bt.copy()
    bt2[0, 0] = 1 << 30
    bt2[1, 1] = -3
    out, lse = decode(q, kv_ok, bt2, sl, 0.2, 1.0, kv_lora_rank=L)
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(lse)).all()


@pytest.mark.parametrize("causal", [True, False])
def test_decode_equals_prefill_on_the_same_keys(rng, causal):
    """Cross-op consistency: request b's decode equals a prefill of its S queries over its seq_len cache
    rows as one KV head (keys = whole rows, values = the first kv_lora_rank columns); both masks are
    bottom-right aligned."""
    L, R, ps, S, H = 32, 16, 16, 4, 3
    lens = [2, 19, 40]
    q, kv, bt, sl = ref.make_decode_inputs(rng, seq_lens=lens, S=S, H=H, L=L, R=R, page_size=ps,
                                           dtype="float32")
    out, lse = decode(q, kv, bt, sl, 0.2, 1.0, causal=causal, kv_lora_rank=L)
    kvf = np.asarray(kv)
    rows = np.concatenate([kvf[bt[b, np.arange(n) // ps], np.arange(n) % ps] for b, n in enumerate(lens)])
    cq = np.arange(len(lens) + 1, dtype=np.int32) * S
    ck = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    p_out, p_lse = tj.mla_prefill(q.reshape(-1, H, L + R), rows[:, None, :], rows[:, None, :L], cq, ck,
                                  softmax_scale=0.2, causal=causal, return_lse=True, backend=BACKEND)
    # Both are fp32 sums of p_j v_j / l in different orders: their difference is a few ulps of the largest |v|, not of
    # the (possibly cancelled, near-zero) result (seed 515181438: 1.2e-6 apart at an output of 0.0044)
    atol = 16 * np.finfo(np.float32).eps * float(np.abs(rows[:, :L]).max())
    np.testing.assert_allclose(np.asarray(out).reshape(-1, H, L), np.asarray(p_out), rtol=1e-5, atol=atol)
    np.testing.assert_allclose(np.asarray(lse).reshape(-1, H), np.asarray(p_lse), rtol=1e-5, atol=1e-6)


def test_backend_listing_on_this_machine(rng):
    """The registry's public views: xla can run every valid call; every backend gives None or a reason."""
    from tokenspeed_jax.decode import _decode_problem

    q, kv, bt, sl = ref.make_decode_inputs(rng, seq_lens=[3], S=1, H=2, L=32, R=16, page_size=16,
                                           dtype="bfloat16")
    prob = _decode_problem(q, kv, bt, sl, True, 32, False)
    reasons = tj.backend_reasons("decode", prob)
    assert reasons["xla"] is None and set(reasons) >= {"xla", "sm90", "sm100"}
    assert all(r is None or (isinstance(r, str) and r) for r in reasons.values())
    avail = tj.available_backends("decode", prob)
    assert avail[-1] == "xla" and avail == [n for n, r in reasons.items() if r is None]
    assert tj.get_backend("xla").name == "xla"
