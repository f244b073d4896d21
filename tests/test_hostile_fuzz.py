"""Hypothesis fuzz of ``mla_decode`` and ``mla_prefill`` with hostile runtime data (issue 34): lengths and
offsets anywhere in the int32 / uint32 range (clamped as documented), garbage block-table entries past the
used pages, NaN / +-Inf in q, in owned and unowned cache rows, in masked and visible keys, in the padding
rows, GQA.  Each case runs on the ``xla`` backend and is compared with the float64 visible-keys-only
reference (:mod:`tests.hostile_ref`); NaN / Inf positions must match exactly.

Shapes are fixed per (S, causal, dtype) so that the whole fuzz compiles a handful of programs: the data,
not the shapes, is what is hostile here (shape / argument fuzzing is ``tests/test_properties.py``).
Bounded: 60 examples each, no deadline."""

from __future__ import annotations

import functools

import jax
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tokenspeed_jax as tj
from tests import hostile_ref as HR
from tests import reference as ref

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.data_too_large])
# decode: B requests, H heads, latent L + rope R, pages of PS tokens, MAXP table columns, NP cache pages
B, H, L, R, PS, MAXP, NP = 3, 4, 16, 8, 16, 4, 10
CAP = MAXP * PS
I32 = (-(2**31), 2**31 - 1)
GARBAGE = [-(2**31), -7, -1, NP, 2**30, 2**31 - 1]
SPECIAL = [np.nan, np.inf, -np.inf]


@functools.cache
def _decode_fn(S, causal, dtype, len_dtype):
    return jax.jit(lambda q, kv, bt, sl, ss, os_: tj.mla_decode(
        q, kv, bt, sl, softmax_scale=ss, output_scale=os_, causal=causal, kv_lora_rank=L, return_lse=True,
        backend="xla"))


def _length(draw, len_dtype):
    hi = 2**32 - 1 if len_dtype == "uint32" else I32[1]
    lo = 0 if len_dtype == "uint32" else I32[0]
    return draw(st.one_of(st.integers(0, CAP + 2), st.integers(lo, hi),
                          st.sampled_from([lo, hi, CAP, CAP + 1, 2**31, 2**31 - 1] if len_dtype == "uint32"
                                          else [lo, hi, -1, CAP, CAP + 1])))


def _poison(draw, arr, rows_shape, n_max=3):
    """Put NaN / +-Inf at up to ``n_max`` drawn positions (whole rows or single elements) of ``arr``."""
    for _ in range(draw(st.integers(0, n_max))):
        idx = tuple(draw(st.integers(0, n - 1)) for n in rows_shape)
        if draw(st.booleans()):
            idx = idx + tuple(draw(st.integers(0, n - 1)) for n in arr.shape[len(rows_shape):])
        arr[idx] = draw(st.sampled_from(SPECIAL))


@st.composite
def decode_case(draw):
    S = draw(st.sampled_from([1, 3]))
    dtype, len_dtype = draw(st.sampled_from([("float32", "int32"), ("bfloat16", "uint32")]))
    lens = [_length(draw, len_dtype) for _ in range(B)]
    eff = [min(max(n, 0), CAP) for n in lens]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    perm = rng.permutation(NP)
    kv = np.full((NP, PS, L + R), np.nan)
    bt = np.array([[draw(st.sampled_from(GARBAGE + [0, NP - 1])) for _ in range(MAXP)] for _ in range(B)], np.int64)
    at = 0
    for b, n in enumerate(eff):
        need = -(-n // PS)
        take = min(need, NP - at)  # requests past the cache's pages reuse earlier ones (clamped ids)
        pages = perm[at:at + take]
        at += take
        bt[b, :take] = pages
        bt[b, take:need] = perm[:need - take]
        for j in range(n):
            page = bt[b, j // PS]
            if np.isnan(kv[page, j % PS]).all():
                kv[page, j % PS] = rng.standard_normal(L + R)
    q = rng.standard_normal((B, S, H, L + R))
    for b, n in enumerate(eff):  # the last keys, visible to the later MTP tokens only (causal)
        if n and draw(st.booleans()):
            j = n - 1 - draw(st.integers(0, min(S, n) - 1))
            kv[bt[b, j // PS], j % PS] = draw(st.sampled_from(SPECIAL))
    _poison(draw, kv, (NP, PS))
    _poison(draw, q, (B, S, H), 2)
    return dict(S=S, dtype=dtype, len_dtype=len_dtype, q=q, kv=kv, bt=bt.astype(np.int32),
                lens=np.array(lens, np.int64).astype(len_dtype), eff=eff, causal=draw(st.booleans()),
                ss=draw(st.sampled_from([0.05, 0.3])), os_=draw(st.sampled_from([1.0, -0.5, np.nan])))


@FUZZ
@given(decode_case())
def test_fuzz_decode(c):
    q, kv = ref.cast(c["q"], c["dtype"]), ref.cast(c["kv"], c["dtype"])
    f = _decode_fn(c["S"], c["causal"], c["dtype"], c["len_dtype"])
    out, lse = f(q, kv, c["bt"], c["lens"], np.float32(c["ss"]), np.float32(c["os_"]))
    bt = np.clip(c["bt"], 0, NP - 1)  # the documented clamp of table entries
    r_out, r_lse = HR.decode(q, kv, bt, c["eff"], softmax_scale=np.float32(c["ss"]), output_scale=c["os_"],
                            causal=c["causal"], kv_lora_rank=L)
    atol = 1e-4 if c["dtype"] == "float32" else 2e-3
    ref.assert_close(out, r_out, atol=atol, what="out")
    ref.assert_close(lse, r_lse, dtype="float32", atol=1e-4, what="lse")


# prefill: Tq / Tk packed rows, NB requests, Hk KV heads, head dims
TQ, TK, NB, HK, DQK, DV = 24, 32, 3, 2, 16, 8


@functools.cache
def _prefill_fn(G, causal):
    return jax.jit(lambda q, k, v, cq, ck: tj.mla_prefill(q, k, v, cq, ck, softmax_scale=0.25, causal=causal,
                                                          return_lse=True, backend="xla"))


def _offsets(draw, T):
    """Non-decreasing offsets from 0 (the contract); entries may run past T (clamped to T)."""
    cuts = sorted(draw(st.lists(st.one_of(st.integers(0, T), st.integers(T, I32[1])), min_size=NB, max_size=NB)))
    return np.array([0] + cuts, np.int32)


@st.composite
def prefill_case(draw):
    G = draw(st.sampled_from([1, 2]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((TQ, HK * G, DQK))
    k = rng.standard_normal((TK, HK, DQK))
    v = rng.standard_normal((TK, HK, DV))
    cq, ck = _offsets(draw, TQ), _offsets(draw, TK)
    k[min(int(ck[-1]), TK):] = np.nan  # rows past the last request: never read
    v[min(int(ck[-1]), TK):] = draw(st.sampled_from(SPECIAL))
    _poison(draw, q, (TQ, HK * G), 2)
    _poison(draw, k, (TK, HK))
    _poison(draw, v, (TK, HK))
    return dict(G=G, q=q, k=k, v=v, cq=cq, ck=ck, causal=draw(st.booleans()))


@FUZZ
@given(prefill_case())
def test_fuzz_prefill(c):
    q, k, v = (x.astype(np.float32) for x in (c["q"], c["k"], c["v"]))
    out, lse = _prefill_fn(c["G"], c["causal"])(q, k, v, c["cq"], c["ck"])
    r_out, r_lse = HR.prefill(q, k, v, np.clip(c["cq"], 0, TQ), np.clip(c["ck"], 0, TK), softmax_scale=np.float32(0.25),
                             causal=c["causal"])
    ref.assert_close(out, r_out, atol=1e-4, what="out")
    ref.assert_close(lse, r_lse, dtype="float32", atol=1e-4, what="lse")
