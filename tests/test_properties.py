"""Hypothesis property tests: random valid shapes agree with the float64 reference; random invalid
arguments raise TypeError / ValueError whose message starts with the offending argument's name."""

# ruff: noqa: E501  (tables of cases read best one per line)

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tokenspeed_jax as tj
from tests import reference as ref

SLOW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.data_too_large])
FAST = settings(max_examples=150, deadline=None)

DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn"]


@st.composite
def decode_case(draw):
    B = draw(st.integers(1, 3))
    S = draw(st.integers(1, 16))
    H = draw(st.sampled_from([1, 2, 3, 8, 16, 128]))
    ps = draw(st.sampled_from([16, 32, 64, 128, 256]))
    L = draw(st.sampled_from([16, 32]))
    R = draw(st.sampled_from([8, 16]))
    lens = draw(st.lists(st.integers(0, 300), min_size=B, max_size=B))
    return dict(seq_lens=lens, S=S, H=H, L=L, R=R, page_size=ps, dtype=draw(st.sampled_from(DTYPES)),
                causal=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)),
                scale=draw(st.floats(0.01, 1.0)), out_scale=draw(st.sampled_from([1.0, 0.5, -2.0])))


@SLOW
@given(decode_case())
def test_decode_random_valid_shapes(c):
    rng = np.random.default_rng(c["seed"])
    q, kv, bt, sl = ref.make_decode_inputs(rng, seq_lens=c["seq_lens"], S=c["S"], H=c["H"], L=c["L"], R=c["R"],
                                           page_size=c["page_size"], dtype=c["dtype"])
    out, lse = jax.jit(lambda *a: tj.mla_decode(*a[:4], softmax_scale=a[4], output_scale=a[5], causal=c["causal"],
                                                kv_lora_rank=c["L"], return_lse=True))(
        q, kv, bt, sl, np.float32(c["scale"]), np.float32(c["out_scale"]))
    r_out, r_lse = ref.mla_decode(q, kv, bt, sl, softmax_scale=np.float32(c["scale"]),
                                  output_scale=c["out_scale"], causal=c["causal"], kv_lora_rank=c["L"])
    ref.assert_close(out, r_out, atol=1e-4, what="out")
    ref.assert_close(lse, r_lse, dtype="float32", atol=1e-4, what="lse")


@st.composite
def prefill_case(draw):
    B = draw(st.integers(1, 4))
    Hk = draw(st.sampled_from([1, 2, 4]))
    G = draw(st.sampled_from([1, 2, 3]))
    lq = draw(st.lists(st.integers(0, 24), min_size=B, max_size=B))
    lk = draw(st.lists(st.integers(0, 40), min_size=B, max_size=B))
    return dict(lens_q=lq, lens_k=lk, Hq=Hk * G, Hk=Hk, Dqk=draw(st.sampled_from([8, 24])),
                Dv=draw(st.sampled_from([8, 16])), dtype=draw(st.sampled_from(DTYPES)),
                causal=draw(st.booleans()), pad_q=draw(st.integers(0, 3)), pad_k=draw(st.integers(0, 3)),
                seed=draw(st.integers(0, 2**31 - 1)))


@SLOW
@given(prefill_case())
def test_prefill_random_valid_shapes(c):
    rng = np.random.default_rng(c.pop("seed"))
    causal = c.pop("causal")
    q, k, v, cq, ck = ref.make_prefill_inputs(rng, **c)
    ss = 1.0 / math.sqrt(c["Dqk"])
    out, lse = jax.jit(lambda *a: tj.mla_prefill(*a, softmax_scale=ss, causal=causal, return_lse=True))(
        q, k, v, cq, ck)
    r_out, r_lse = ref.mla_prefill(q, k, v, cq, ck, softmax_scale=np.float32(ss), causal=causal)
    ref.assert_close(out, r_out, atol=1e-4, what="out")
    ref.assert_close(lse, r_lse, dtype="float32", atol=1e-4, what="lse")


_merge = jax.jit(tj.merge_attn_states)


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.sampled_from([8, 16]), st.integers(0, 2**31 - 1))
def test_merge_is_symmetric_and_matches_reference(T, H, D, seed):
    rng = np.random.default_rng(seed)
    oa, ob = (rng.standard_normal((T, H, D)).astype(np.float32) for _ in range(2))
    la, lb = ((rng.standard_normal((T, H)) * 5).astype(np.float32) for _ in range(2))
    la[rng.random((T, H)) < 0.3] = -np.inf
    lb[rng.random((T, H)) < 0.3] = -np.inf
    ab = _merge(oa, la, ob, lb)
    ba = _merge(ob, lb, oa, la)
    np.testing.assert_allclose(np.asarray(ab[0]), np.asarray(ba[0]), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(ab[1]), np.asarray(ba[1]))
    r_out, r_lse = ref.merge_attn_states(oa, la, ob, lb)
    ref.assert_close(ab[0], r_out, atol=1e-6, what="out")
    ref.assert_close(ab[1], r_lse, atol=1e-6, what="lse")


# ------------------------------------------------------------------------------- invalid arguments
def _sd(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


DECODE_MUTATIONS = {
    # name -> (mutate(args, kw, draw) , exception, argument name the message must start with)
    "q_rank": (lambda a, kw, d: a.__setitem__("q", _sd(a["q"].shape[:d(st.integers(0, 3))], a["q"].dtype)),
               ValueError, "q"),
    "kv_rank": (lambda a, kw, d: a.__setitem__("kv_cache", _sd((4,) + a["kv_cache"].shape, "float32")),
                ValueError, "kv_cache"),
    "bt_rank": (lambda a, kw, d: a.__setitem__("block_table", _sd((a["q"].shape[0],), "int32")),
                ValueError, "block_table"),
    "sl_rank": (lambda a, kw, d: a.__setitem__("seq_lens", _sd((), "int32")), ValueError, "seq_lens"),
    "q_dtype": (lambda a, kw, d: a.__setitem__("q", _sd(a["q"].shape, d(st.sampled_from(
        ["int32", "int16", "int8", "uint8", "bool", "complex64"])))), TypeError, "q"),
    "kv_dtype": (lambda a, kw, d: a.__setitem__("kv_cache", _sd(a["kv_cache"].shape, "float16")),
                 TypeError, "kv_cache"),
    "bt_dtype": (lambda a, kw, d: a.__setitem__("block_table", _sd(a["block_table"].shape, "float32")),
                 TypeError, "block_table"),
    "sl_dtype": (lambda a, kw, d: a.__setitem__("seq_lens", _sd(a["seq_lens"].shape, "bfloat16")),
                 TypeError, "seq_lens"),
    "S": (lambda a, kw, d: a.__setitem__("q", _sd((a["q"].shape[0], d(st.sampled_from([0, 17, 32, 100])))
                                                   + a["q"].shape[2:], "float32")), ValueError, "q"),
    "H": (lambda a, kw, d: a.__setitem__("q", _sd(a["q"].shape[:2] + (d(st.sampled_from([0, 129, 256])),)
                                                   + a["q"].shape[3:], "float32")), ValueError, "q"),
    "D": (lambda a, kw, d: a.__setitem__("kv_cache", _sd(a["kv_cache"].shape[:2] + (a["q"].shape[3] + d(
        st.sampled_from([-8, -1, 1, 64])),), "float32")), ValueError, "kv_cache"),
    "page": (lambda a, kw, d: a.__setitem__("kv_cache", _sd((4, d(st.sampled_from([1, 8, 15, 17, 48, 100, 512])),
                                                              a["q"].shape[3]), "float32")), ValueError, "kv_cache"),
    "bt_batch": (lambda a, kw, d: a.__setitem__("block_table", _sd((a["q"].shape[0] + d(st.integers(1, 3)), 2),
                                                                   "int32")), ValueError, "block_table"),
    "sl_batch": (lambda a, kw, d: a.__setitem__("seq_lens", _sd((a["q"].shape[0] + d(st.integers(1, 3)),),
                                                                "int32")), ValueError, "seq_lens"),
    "rank_too_big": (lambda a, kw, d: kw.__setitem__("kv_lora_rank", a["q"].shape[3] + d(st.integers(0, 4))),
                     ValueError, "q"),
    "rank_type": (lambda a, kw, d: kw.__setitem__("kv_lora_rank", d(st.sampled_from([16.0, "16", None, True]))),
                  TypeError, "kv_lora_rank"),
    "causal": (lambda a, kw, d: kw.__setitem__("causal", d(st.sampled_from([0, 1, "yes", None]))),
               TypeError, "causal"),
    "return_lse": (lambda a, kw, d: kw.__setitem__("return_lse", d(st.sampled_from([0, "no", []]))),
                   TypeError, "return_lse"),
    "softmax_scale": (lambda a, kw, d: kw.__setitem__("softmax_scale", d(st.sampled_from(
        [None, "0.1", True, np.ones(2, np.float32), np.ones((), np.int32)]))), (TypeError, ValueError),
        "softmax_scale"),
    "output_scale": (lambda a, kw, d: kw.__setitem__("output_scale", d(st.sampled_from(
        [None, [1.0], False, np.ones((1, 2), np.float32)]))), (TypeError, ValueError), "output_scale"),
    "backend": (lambda a, kw, d: kw.__setitem__("backend", d(st.sampled_from(["gpu", "", 3, None, "sm100"]))),
                (TypeError, ValueError), "backend"),
    "validate": (lambda a, kw, d: kw.__setitem__("validate", d(st.sampled_from([1, "true"]))), TypeError,
                 "validate"),
}


@FAST
@given(st.data())
def test_decode_random_invalid_arguments(data):
    B = data.draw(st.integers(1, 4))
    S = data.draw(st.integers(1, 16))
    H = data.draw(st.integers(1, 16))
    L = data.draw(st.sampled_from([16, 32]))
    a = dict(q=_sd((B, S, H, L + 16), "float32"), kv_cache=_sd((4, 16, L + 16), "float32"),
             block_table=_sd((B, 2), "int32"), seq_lens=_sd((B,), "int32"))
    kw = dict(softmax_scale=0.1, kv_lora_rank=L)
    name = data.draw(st.sampled_from(sorted(DECODE_MUTATIONS)))
    mutate, exc, arg = DECODE_MUTATIONS[name]
    mutate(a, kw, data.draw)

    def call(q, kv, bt, sl):
        return tj.mla_decode(q, kv, bt, sl, **kw)

    with pytest.raises(exc) as info:
        jax.eval_shape(call, a["q"], a["kv_cache"], a["block_table"], a["seq_lens"])
    assert str(info.value).startswith(f"{arg}:"), (name, str(info.value))


PREFILL_MUTATIONS = {
    "q_rank": (lambda a, kw, d: a.__setitem__("q", _sd(a["q"].shape[:2], "float32")), ValueError, "q"),
    "k_rank": (lambda a, kw, d: a.__setitem__("k", _sd((1,) + a["k"].shape, "float32")), ValueError, "k"),
    "v_rank": (lambda a, kw, d: a.__setitem__("v", _sd(a["v"].shape[:1], "float32")), ValueError, "v"),
    "cu_rank": (lambda a, kw, d: a.__setitem__("cu_seqlens_q", _sd((2, 2), "int32")), ValueError, "cu_seqlens_q"),
    "k_dtype": (lambda a, kw, d: a.__setitem__("k", _sd(a["k"].shape, d(st.sampled_from(["bfloat16", "int32"])))),
                TypeError, "k"),
    "v_dtype": (lambda a, kw, d: a.__setitem__("v", _sd(a["v"].shape, "float16")), TypeError, "v"),
    "cuk_dtype": (lambda a, kw, d: a.__setitem__("cu_seqlens_k", _sd(a["cu_seqlens_k"].shape, "float32")),
                  TypeError, "cu_seqlens_k"),
    "k_dim": (lambda a, kw, d: a.__setitem__("k", _sd(a["k"].shape[:2] + (a["k"].shape[2] + d(st.integers(1, 5)),),
                                                      "float32")), ValueError, "k"),
    "v_tokens": (lambda a, kw, d: a.__setitem__("v", _sd((a["v"].shape[0] + d(st.integers(1, 5)),)
                                                         + a["v"].shape[1:], "float32")), ValueError, "v"),
    "v_heads": (lambda a, kw, d: a.__setitem__("v", _sd((a["v"].shape[0], a["v"].shape[1] + 1, a["v"].shape[2]),
                                                        "float32")), ValueError, "v"),
    "group": (lambda a, kw, d: (a.__setitem__("k", _sd((a["k"].shape[0], 3, a["k"].shape[2]), "float32")),
                                a.__setitem__("v", _sd((a["v"].shape[0], 3, a["v"].shape[2]), "float32")),
                                a.__setitem__("q", _sd((a["q"].shape[0], 4, a["q"].shape[2]), "float32"))),
              ValueError, "q"),
    "cu_len": (lambda a, kw, d: a.__setitem__("cu_seqlens_k", _sd((a["cu_seqlens_q"].shape[0] + 1,), "int32")),
               ValueError, "cu_seqlens_k"),
    "max_seqlen": (lambda a, kw, d: kw.__setitem__(d(st.sampled_from(["max_seqlen_q", "max_seqlen_k"])),
                                                   d(st.sampled_from([0, -1, 1.5, "8"]))),
                   (TypeError, ValueError), "max_seqlen_"),
    "causal": (lambda a, kw, d: kw.__setitem__("causal", None), TypeError, "causal"),
}


@FAST
@given(st.data())
def test_prefill_random_invalid_arguments(data):
    Tq, Tk = data.draw(st.integers(1, 30)), data.draw(st.integers(1, 30))
    Hk = data.draw(st.integers(1, 4))
    B = data.draw(st.integers(1, 4))
    a = dict(q=_sd((Tq, 2 * Hk, 24), "float32"), k=_sd((Tk, Hk, 24), "float32"), v=_sd((Tk, Hk, 16), "float32"),
             cu_seqlens_q=_sd((B + 1,), "int32"), cu_seqlens_k=_sd((B + 1,), "int32"))
    kw = dict(softmax_scale=0.1)
    name = data.draw(st.sampled_from(sorted(PREFILL_MUTATIONS)))
    mutate, exc, arg = PREFILL_MUTATIONS[name]
    mutate(a, kw, data.draw)
    with pytest.raises(exc) as info:
        jax.eval_shape(lambda *x: tj.mla_prefill(*x, **kw), a["q"], a["k"], a["v"], a["cu_seqlens_q"],
                       a["cu_seqlens_k"])
    assert str(info.value).startswith(arg), (name, str(info.value))
