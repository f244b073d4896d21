"""mla_prefill against the float64 NumPy reference: ragged lengths, zero-length requests, Lq > Lk and
Lq < Lk under the bottom-right causal mask, grouped heads, rows outside every request, NaN in k/v rows
no request owns, FP8 and float32 inputs, the real 192/128 head dims and the query-blocked path."""

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


@functools.partial(jax.jit, static_argnames=("causal", "max_seqlen_q", "max_seqlen_k", "backend"))
def prefill(q, k, v, cq, ck, ss, *, causal=True, max_seqlen_q=None, max_seqlen_k=None, backend=BACKEND):
    return tj.mla_prefill(q, k, v, cq, ck, softmax_scale=ss, causal=causal, return_lse=True,
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, backend=backend)


def check(rng, *, lens_q, lens_k, Hq, Hk, Dqk, Dv, dtype, causal=True, pad_q=0, pad_k=0, **kw):
    q, k, v, cq, ck = ref.make_prefill_inputs(rng, lens_q=lens_q, lens_k=lens_k, Hq=Hq, Hk=Hk, Dqk=Dqk,
                                              Dv=Dv, dtype=dtype, pad_q=pad_q, pad_k=pad_k)
    if BACKEND != "xla" and pad_k:  # kernel backends read up to 127 v rows past the last request, which the
        v = np.array(v)  # contract (tokenspeed_jax.prefill) requires finite
        v[int(ck[-1]): int(ck[-1]) + 127] = 0
    ss = 1.0 / math.sqrt(Dqk)
    out, lse = prefill(q, k, v, cq, ck, ss, causal=causal, **kw)
    want_dtype = "bfloat16" if dtype == "float8_e4m3fn" else dtype
    assert out.shape == (q.shape[0], Hq, Dv) and jnp.dtype(out.dtype).name == want_dtype
    assert lse.shape == (q.shape[0], Hq) and lse.dtype == jnp.float32
    r_out, r_lse = ref.mla_prefill(q, k, v, cq, ck, softmax_scale=ss, causal=causal)
    ref.assert_close(out, r_out, what="out")
    ref.assert_close(lse, r_lse, dtype="float32", atol=1e-4, what="lse")
    return out, lse, cq


CASES = [  # lens_q, lens_k, Hq, Hk, Dqk, Dv, dtype, causal, pad_q, pad_k
    ([1], [1], 1, 1, 16, 8, "bfloat16", True, 0, 0),
    ([5, 0, 17], [5, 0, 17], 4, 4, 32, 16, "bfloat16", True, 0, 0),  # self-attention, an empty request
    ([3, 8], [10, 8], 8, 2, 32, 16, "float16", True, 3, 5),  # Lq < Lk (chunked context), GQA 4
    ([9, 4], [4, 0], 2, 1, 16, 16, "float32", True, 2, 0),  # Lq > Lk: early rows see nothing
    ([9, 4], [4, 0], 2, 1, 16, 16, "float32", False, 0, 2),  # non-causal, a request with no keys
    ([33, 1, 20], [40, 64, 20], 6, 3, 24, 8, "bfloat16", False, 0, 0),
    ([12, 7], [12, 30], 4, 2, 32, 32, "float8_e4m3fn", True, 1, 1),
    ([0], [0], 2, 2, 16, 16, "bfloat16", True, 4, 4),  # nothing at all: all rows 0 / -inf
    ([3, 2], [0, 0], 2, 1, 16, 16, "float32", False, 0, 0),  # Tk = 0: no key rows at all
    ([0, 0], [4, 1], 2, 2, 16, 16, "bfloat16", True, 0, 0),  # Tq = 0: empty output
]


@pytest.mark.parametrize("lens_q,lens_k,Hq,Hk,Dqk,Dv,dtype,causal,pad_q,pad_k", CASES)
def test_prefill_shapes(rng, lens_q, lens_k, Hq, Hk, Dqk, Dv, dtype, causal, pad_q, pad_k):
    out, lse, cq = check(rng, lens_q=lens_q, lens_k=lens_k, Hq=Hq, Hk=Hk, Dqk=Dqk, Dv=Dv, dtype=dtype,
                         causal=causal, pad_q=pad_q, pad_k=pad_k)
    out, lse = np.asarray(out), np.asarray(lse)
    assert not np.isnan(out.astype(np.float32)).any() and not np.isnan(lse).any()
    tail = int(cq[-1])
    assert (out[tail:].astype(np.float32) == 0).all() and np.isneginf(lse[tail:]).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_prefill_deepseek_dims(rng, dtype):
    """DeepSeek-R1 prefill: Dqk 192 (128 nope + 64 rope), Dv 128, 16 heads, chunked-context shape."""
    check(rng, lens_q=[20, 1, 37], lens_k=[20, 50, 37], Hq=16, Hk=16, Dqk=192, Dv=128, dtype=dtype)


def test_prefill_max_seqlen_hints_do_not_change_results(rng):
    q, k, v, cq, ck = ref.make_prefill_inputs(rng, lens_q=[7, 3], lens_k=[9, 3], Hq=2, Hk=1, Dqk=16, Dv=8,
                                              dtype="float32")
    a = prefill(q, k, v, cq, ck, 0.3)
    b = prefill(q, k, v, cq, ck, 0.3, max_seqlen_q=7, max_seqlen_k=9)
    c = prefill(q, k, v, cq, ck, 0.3, max_seqlen_q=64, max_seqlen_k=64)
    for x, y, z in zip(a, b, c):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        np.testing.assert_array_equal(np.asarray(x), np.asarray(z))


def test_prefill_query_blocked_path(rng):
    """Enough Hq * Tk that the reference backend splits the queries into blocks (lax.map)."""
    check(rng, lens_q=[520], lens_k=[1030], Hq=128, Hk=2, Dqk=4, Dv=4, dtype="float32", pad_q=1, pad_k=1)


def test_prefill_causal_boundary_exact(rng):
    """Uniform attention over one-hot values: row i of a request sees exactly keys j <= i + Lk - Lq."""
    Lq, Lk = 5, 8
    q = np.zeros((Lq, 1, 16), np.float32)
    k = rng.standard_normal((Lk, 1, 16)).astype(np.float32)
    v = np.eye(Lk, dtype=np.float32)[:, None, :]
    out, lse = prefill(q, k, v, np.array([0, Lq], np.int32), np.array([0, Lk], np.int32), 1.0)
    out = np.asarray(out)
    for i in range(Lq):
        seen = i + Lk - Lq + 1
        np.testing.assert_allclose(out[i, 0, :seen], 1.0 / seen, rtol=1e-6)
        np.testing.assert_array_equal(out[i, 0, seen:], 0.0)
        np.testing.assert_allclose(np.asarray(lse)[i, 0], np.log(seen), rtol=1e-6)


def test_prefill_traced_scale(rng):
    q, k, v, cq, ck = ref.make_prefill_inputs(rng, lens_q=[4], lens_k=[6], Hq=2, Hk=2, Dqk=16, Dv=8,
                                              dtype="float32")
    for ss in (0.05, 1.5):
        out, lse = prefill(q, k, v, cq, ck, jnp.float32(ss))
        r_out, r_lse = ref.mla_prefill(q, k, v, cq, ck, softmax_scale=np.float32(ss))
        ref.assert_close(out, r_out, what="out")
        ref.assert_close(lse, r_lse, dtype="float32", what="lse")
