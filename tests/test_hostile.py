"""Hostile input to the ops and the vLLM adapter (issue 34), CPU, ``xla`` backend: NaN / Inf placement,
dtype and width games with lengths and offsets, non-finite scales, capability agreement between the vLLM
backend and the ops, bounded trace caches, no tracer outliving a trace.  Values are checked against the
float64 references of :mod:`tests.hostile_ref` (NaN / Inf positions must match exactly); errors must name
the argument.  Checkpoint attacks: ``tests/models/test_hostile_checkpoint.py``; the hypothesis fuzz:
``tests/test_hostile_fuzz.py``; the same NaN cases on the H200: ``tests/gpu/test_hostile_sm90.py``."""

# ruff: noqa: E501  (tables of cases read best one per line)

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import tokenspeed_jax as tj
from tests import hostile_ref as H
from tests import reference as ref

NAN, INF = np.nan, np.inf


@functools.cache
def _decode_fn(causal, L, jit):
    f = lambda q, kv, bt, sl, ss, os_: tj.mla_decode(q, kv, bt, sl, softmax_scale=ss, output_scale=os_,  # noqa: E731
                                                     causal=causal, kv_lora_rank=L, return_lse=True, backend="xla")
    return jax.jit(f) if jit else f


@functools.cache
def _prefill_fn(causal, jit):
    f = lambda q, k, v, cq, ck, ss: tj.mla_prefill(q, k, v, cq, ck, softmax_scale=ss, causal=causal,  # noqa: E731
                                                   return_lse=True, backend="xla")
    return jax.jit(f) if jit else f


def decode(q, kv, bt, sl, ss=0.2, os_=1.0, *, causal=True, L=16, jit=True):
    """One jitted function per flag set (shapes repeat across the cases: few compiles)."""
    return _decode_fn(causal, L, jit)(q, kv, bt, sl, np.float32(ss), np.float32(os_))


def prefill(q, k, v, cq, ck, ss=0.3, *, causal=True, jit=True):
    return _prefill_fn(causal, jit)(q, k, v, cq, ck, np.float32(ss))


def check(got, want, *, atol=1e-5, dtype="float32"):
    (o, l), (ro, rl) = got, want
    ref.assert_close(o, ro, dtype=dtype, atol=atol, what="out")
    ref.assert_close(l, rl, dtype="float32", atol=max(atol, 1e-5), what="lse")


# ---------------------------------------------------------------------------- 1. NaN / Inf placement
def test_prefill_issue_repro():
    """The issue's reproduction: a NaN v row of request 1 leaves request 0 and the rows outside every
    request untouched."""
    q = jnp.ones((8, 2, 8))
    k = jnp.ones((8, 1, 8))
    v = k.at[4].set(jnp.nan)
    cu = jnp.array([0, 4, 6], jnp.int32)
    out, lse = tj.mla_prefill(q, k, v, cu, cu, softmax_scale=0.1, backend="xla", return_lse=True)
    out, lse = np.asarray(out), np.asarray(lse)
    np.testing.assert_array_equal(out[:4], 1.0)
    np.testing.assert_array_equal(out[6:], 0.0)
    assert np.isnan(out[4:6]).all()  # both rows of request 1 see key 4 (causal: j <= i)
    assert np.isneginf(lse[6:]).all() and np.isfinite(lse[:6]).all()  # v does not enter the LSE
    check((out, lse), H.prefill(q, k, v, cu, cu, softmax_scale=0.1))


def _prefill_case(rng, Hq=4, Hk=2, dtype="float32"):
    lq, lk = [5, 7, 4], [9, 7, 6]  # request 0: Lq < Lk (chunked), 1: self, 2: Lq < Lk
    q, k, v, cq, ck = ref.make_prefill_inputs(rng, lens_q=lq, lens_k=lk, Hq=Hq, Hk=Hk, Dqk=24, Dv=16,
                                              dtype=dtype, pad_q=3, pad_k=5)  # k/v padding is NaN
    return np.array(q), np.array(k), np.array(v), cq, ck


# (what, mutate(q, k, v, cq, ck)): positions are absolute packed rows; ck = [0, 9, 16, 22], cq = [0, 5, 12, 16].
PREFILL_PLACEMENTS = [
    ("v NaN in another request's row", lambda q, k, v, cq, ck: v.__setitem__((10, 1), NAN)),
    ("v +inf in one column", lambda q, k, v, cq, ck: v.__setitem__((10, 0, 3), INF)),
    ("v +inf and -inf in one column", lambda q, k, v, cq, ck: (v.__setitem__((10, 0, 3), INF), v.__setitem__((12, 0, 3), -INF))),
    ("v NaN in a causally masked key (last key of request 1)", lambda q, k, v, cq, ck: v.__setitem__((15, 0), NAN)),
    ("k NaN in a causally masked key", lambda q, k, v, cq, ck: k.__setitem__((15, 1), NAN)),
    ("k NaN in the first key of request 2 (request 1's tile neighbour)", lambda q, k, v, cq, ck: k.__setitem__((16, 0), NAN)),
    ("v Inf everywhere past the last request", lambda q, k, v, cq, ck: v.__setitem__(slice(22, None), INF)),
    ("q NaN in one head of one row", lambda q, k, v, cq, ck: q.__setitem__((6, 3), NAN)),
    ("q NaN in the rows outside every request", lambda q, k, v, cq, ck: q.__setitem__(slice(16, None), NAN)),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("what,mutate", PREFILL_PLACEMENTS, ids=[c[0] for c in PREFILL_PLACEMENTS])
def test_prefill_nonfinite_placement(rng, what, mutate, causal):
    q, k, v, cq, ck = _prefill_case(rng)
    mutate(q, k, v, cq, ck)
    got = prefill(q, k, v, cq, ck, causal=causal)
    want = H.prefill(q, k, v, cq, ck, softmax_scale=np.float32(0.3), causal=causal)
    check(got, want)
    assert np.isfinite(np.asarray(got[0])[:5]).all(), "request 0 never sees the poisoned rows"


def test_prefill_bf16_gqa_nan_rows(rng):
    q, k, v, cq, ck = _prefill_case(rng, Hq=6, Hk=2, dtype="bfloat16")
    v[8, 1] = NAN  # request 0's last key: only its rows that see it (all under causal with Lq < Lk)
    v[12, 0, 2] = INF
    got = prefill(q, k, v, cq, ck)
    check(got, H.prefill(q, k, v, cq, ck, softmax_scale=np.float32(0.3)), atol=1e-3, dtype="bfloat16")


def _decode_case(rng, lens=(20, 33, 7, 0), S=3, dtype="float32"):
    q, kv, bt, sl = ref.make_decode_inputs(rng, seq_lens=list(lens), S=S, H=2, L=16, R=8, page_size=16,
                                           dtype=dtype)  # unowned rows / pages: NaN; garbage ids past the used ones
    return np.array(q), np.array(kv), bt, sl


def _row(bt, b, j, ps=16):
    return int(bt[b, j // ps]), j % ps


DECODE_PLACEMENTS = [
    ("NaN in unowned pages and past seq_len in owned pages (the default inputs)", lambda q, kv, bt, sl: None),
    ("NaN in the causally masked last key (token 0 and 1 cannot see it)", lambda q, kv, bt, sl: kv.__setitem__(_row(bt, 0, 19), NAN)),
    ("Inf in the V part of the causally masked keys", lambda q, kv, bt, sl: (kv.__setitem__(_row(bt, 1, 31), INF), kv.__setitem__(_row(bt, 1, 32), -INF))),
    ("NaN in the rope part of a masked key", lambda q, kv, bt, sl: kv.__setitem__(_row(bt, 2, 6) + (slice(16, None),), NAN)),
    ("+inf in one V column of a visible key", lambda q, kv, bt, sl: kv.__setitem__(_row(bt, 1, 3) + (5,), INF)),
    ("NaN in a visible key", lambda q, kv, bt, sl: kv.__setitem__(_row(bt, 2, 0), NAN)),
    ("NaN in one head of q", lambda q, kv, bt, sl: q.__setitem__((1, 2, 1), NAN)),
    ("NaN in q of a request with no keys", lambda q, kv, bt, sl: q.__setitem__(3, NAN)),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("what,mutate", DECODE_PLACEMENTS, ids=[c[0] for c in DECODE_PLACEMENTS])
def test_decode_nonfinite_placement(rng, what, mutate, causal):
    q, kv, bt, sl = _decode_case(rng)
    mutate(q, kv, bt, sl)
    got = decode(q, kv, bt, sl, causal=causal)
    check(got, H.decode(q, kv, bt, sl, softmax_scale=np.float32(0.2), causal=causal, kv_lora_rank=16))


def test_decode_token0_never_sees_a_masked_nan(rng):
    """The issue's decode case, stated directly: MTP S=3, NaN in the request's last key: tokens 0 and 1
    are finite, token 2 is NaN."""
    q, kv, bt, sl = _decode_case(rng, lens=(20,))
    kv[_row(bt, 0, 19)] = NAN
    out, _ = decode(q, kv, bt, sl)
    out = np.asarray(out)
    assert np.isfinite(out[0, :2]).all() and np.isnan(out[0, 2]).all()


def test_decode_fp8_and_bf16_masked_nan(rng):
    for dtype, atol in (("bfloat16", 1e-3), ("float8_e4m3fn", 1e-3)):
        q, kv, bt, sl = _decode_case(rng, dtype=dtype)
        kv[_row(bt, 0, 19)] = NAN
        kv[_row(bt, 1, 32)] = NAN
        got = decode(q, kv, bt, sl, 0.2, 0.5)
        check(got, H.decode(q, kv, bt, sl, softmax_scale=np.float32(0.2), output_scale=0.5, kv_lora_rank=16),
              atol=atol, dtype="bfloat16")


# ------------------------------------------------------------------------ 2. dtype and width games
def _cap(bt):
    return bt.shape[1] * 16


@pytest.mark.parametrize("kind", ["numpy-uint32", "numpy-int64", "jnp-uint32", "numpy-uint64", "numpy-int8", "jnp-int16"])
def test_decode_lengths_clamp_in_their_own_dtype(rng, kind):
    """Lengths past the capacity act as the capacity and negative ones as 0, whatever the width: uint32
    2^32-1 and int64 2^31+5 must not wrap to -1 / negative (which would read as length 0)."""
    q, kv, bt, sl = _decode_case(rng, lens=(20, 33, 7, 0))
    cap = _cap(bt)
    kv = np.nan_to_num(kv)  # every row in capacity finite: a long length reads them all
    raw = {"numpy-uint32": np.array([2**32 - 1, 33, 7, 0], np.uint32),
           "numpy-int64": np.array([2**31 + 5, -(2**31) - 7, 2**40, 7], np.int64),
           "jnp-uint32": jnp.array([2**32 - 1, 33, 2**31, 0], jnp.uint32),
           "numpy-uint64": np.array([2**64 - 1, 2**32 + 1, 7, 0], np.uint64),
           "numpy-int8": np.array([127, -128, 7, 0], np.int8),
           "jnp-int16": jnp.array([32767, -5, 7, 0], jnp.int16)}[kind]
    want_len = np.clip(np.asarray(raw).astype(object), 0, cap).astype(np.int64)
    bt_used = np.clip(bt, 0, kv.shape[0] - 1)  # rows past the used pages are read now: the clamped ids
    for jit in (False, True):
        if jit and kind.startswith("numpy-") and np.asarray(raw).dtype.itemsize == 8:
            continue  # a 64-bit NumPy array is narrowed at the jit boundary, before the op (documented)
        got = decode(q, kv, bt, raw, jit=jit)
        check(got, H.decode(q, kv, bt_used, want_len, softmax_scale=np.float32(0.2), kv_lora_rank=16))


def test_decode_block_table_uint32_and_int64_ids_are_clamped(rng):
    q, kv, bt, sl = _decode_case(rng, lens=(20, 33, 7, 0))
    kv = np.nan_to_num(kv)
    P = kv.shape[0]
    for raw in (bt.astype(np.uint32) | np.uint32(0), np.where(bt < 0, 2**40, bt).astype(np.int64)):
        raw = raw.copy()
        raw[0, 0] = np.array(2**32 - 1).astype(raw.dtype) if raw.dtype == np.uint32 else 2**35
        want_bt = np.clip(np.asarray(raw).astype(object), 0, P - 1).astype(np.int64)
        got = decode(q, kv, raw, sl, jit=False)
        check(got, H.decode(q, kv, want_bt, sl, softmax_scale=np.float32(0.2), kv_lora_rank=16))


@pytest.mark.parametrize("arg,bad,pattern", [
    ("seq_lens", np.array([True, False, True, True]), r"^seq_lens: expected an int32 array, got dtype bool"),
    ("seq_lens", np.array([1.0, 2.0, 3.0, 0.0], np.float32), r"^seq_lens: expected an int32 array, got dtype float32"),
    ("block_table", "float", r"^block_table: expected an int32 array, got dtype float32"),
    ("block_table", "bool", r"^block_table: expected an int32 array, got dtype bool"),
])
def test_decode_refuses_bool_and_float_indices(rng, arg, bad, pattern):
    q, kv, bt, sl = _decode_case(rng)
    if arg == "block_table":
        bt = bt.astype(np.float32) if bad == "float" else bt > 0
    else:
        sl = bad
    with pytest.raises(TypeError, match=pattern):
        decode(q, kv, bt, sl, jit=False)


@pytest.mark.parametrize("lens,pattern", [
    (np.array([2**32 - 1, 3, 7, 0], np.uint32), r"seq_lens: expected every length <= max_pages \* page_size = 64"),
    (jnp.array([2**32 - 1, 3, 7, 0], jnp.uint32), r"seq_lens: expected every length <= max_pages \* page_size = 64"),
    (np.array([2**31 + 5, 3, 7, 0], np.int64), r"seq_lens: expected every length <= max_pages \* page_size = 64"),
    (np.array([2**32, 3, 7, 0], np.int64), r"seq_lens: expected every length <= max_pages \* page_size = 64"),
    (np.array([-(2**40), 3, 7, 0], np.int64), r"seq_lens: expected every length >= 0"),
])
def test_validate_names_the_real_defect_for_wide_lengths(rng, lens, pattern):
    """validate=True compares in the input's dtype: uint32 2^32-1 is too long, not negative; int64 2^32
    is too long, not 0 (which would pass)."""
    q, kv, bt, sl = _decode_case(rng, lens=(20, 33, 7, 0))
    with pytest.raises(checkify.JaxRuntimeError, match=pattern) as e:
        tj.mla_decode(q, kv, bt, lens, softmax_scale=0.2, kv_lora_rank=16, validate=True)
    if "<=" in pattern:
        assert "negative" not in str(e.value)


def test_validate_block_table_uint32(rng):
    q, kv, bt, sl = _decode_case(rng, lens=(20, 33, 7, 0))
    bt = np.clip(bt, 0, None).astype(np.uint32)
    bt[0, 0] = 2**32 - 1
    with pytest.raises(checkify.JaxRuntimeError, match=r"block_table: expected page ids in \[0, "):
        tj.mla_decode(q, kv, bt, sl, softmax_scale=0.2, kv_lora_rank=16, validate=True)


@pytest.mark.parametrize("dtype", [np.uint32, np.int64, np.int16, "jnp-uint32"])
def test_prefill_offsets_in_any_integer_dtype(rng, dtype):
    q, k, v, cq, ck = _prefill_case(rng)
    want = prefill(q, k, v, cq, ck, jit=False)
    conv = (lambda x: jnp.asarray(x, jnp.uint32)) if dtype == "jnp-uint32" else (lambda x: x.astype(dtype))
    got = prefill(q, k, v, conv(cq), conv(ck), jit=False)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_prefill_wide_offsets_clamp_not_wrap(rng):
    """cu_seqlens past Tq / Tk clamp to Tq / Tk in their own dtype: uint32 2^32-1 or int64 2^32 as the
    last offset ends the last request at the last row (an int32 cast would make it -1 / 0)."""
    q, k, v, cq, ck = _prefill_case(rng)
    k, v = np.nan_to_num(k), np.nan_to_num(v)
    Tq, Tk = q.shape[0], k.shape[0]
    for big in (np.array(2**32 - 1, np.uint32), np.array(2**32, np.int64)):
        cq2, ck2 = cq.astype(big.dtype), ck.astype(big.dtype)
        cq2[-1], ck2[-1] = big, big
        got = prefill(q, k, v, cq2, ck2, jit=False)
        cqw, ckw = cq.copy(), ck.copy()
        cqw[-1], ckw[-1] = Tq, Tk
        check(got, H.prefill(q, k, v, cqw, ckw, softmax_scale=np.float32(0.3)))


def test_prefill_validate_wide_offsets(rng):
    q, k, v, cq, ck = _prefill_case(rng)
    ck2 = ck.astype(np.uint32)
    ck2[-1] = 2**32 - 1
    with pytest.raises(checkify.JaxRuntimeError, match=r"cu_seqlens_k: expected the last offset <= 27"):
        tj.mla_prefill(q, k, v, cq, ck2, softmax_scale=0.3, validate=True)
    with pytest.raises(TypeError, match=r"^cu_seqlens_q: expected an int32 array, got dtype bool"):
        tj.mla_prefill(q, k, v, cq > 0, ck, softmax_scale=0.3)
    with pytest.raises(TypeError, match=r"^cu_seqlens_k: expected an int32 array, got dtype float32"):
        tj.mla_prefill(q, k, v, cq, ck.astype(np.float32), softmax_scale=0.3)


# ------------------------------------------------------------------------ 3. non-finite output_scale
@pytest.mark.parametrize("os_", [NAN, INF, -INF, 0.0])
def test_nonfinite_output_scale_keeps_empty_rows_zero(rng, os_):
    q, kv, bt, sl = _decode_case(rng, lens=(20, 1, 0, 2))  # S=3: rows of requests 1-3 partly / fully empty
    out, lse = decode(q, kv, bt, sl, 0.2, os_)
    check((out, lse), H.decode(q, kv, bt, sl, softmax_scale=np.float32(0.2), output_scale=os_, kv_lora_rank=16))
    out = np.asarray(out)
    assert (out[2] == 0).all() and not np.signbit(out[2]).any() and (out[1, :2] == 0).all()


def test_nonfinite_softmax_scale_keeps_empty_rows_zero(rng):
    q, kv, bt, sl = _decode_case(rng, lens=(20, 0, 0, 2))
    out, lse = decode(q, kv, bt, sl, NAN, 1.0)
    out, lse = np.asarray(out), np.asarray(lse)
    assert (out[1:3] == 0).all() and np.isneginf(lse[1:3]).all() and np.isnan(out[0]).all()


# -------------------------------------------------------- 4. vLLM capability agrees with the ops
def _accepts_decode(cfg, ps):
    S, Hr, D = cfg.decode_query_len, cfg.num_heads, cfg.head_size
    try:
        jax.eval_shape(lambda q, kv: tj.mla_decode(q, kv, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32),
                                                   softmax_scale=0.1, kv_lora_rank=cfg.kv_lora_rank, backend="xla"),
                       jax.ShapeDtypeStruct((1, S, Hr, D), jnp.bfloat16), jax.ShapeDtypeStruct((2, ps, D), jnp.bfloat16))
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("heads", [1, 2, 16, 127, 128, 129, 256])
def test_vllm_validate_configuration_agrees_with_mla_decode(heads):
    """For a sweep of heads per rank x query lengths x page sizes, ``validate_configuration`` returns no
    reason exactly when ``mla_decode`` accepts the call, and names the limit when it does not."""
    from tokenspeed_jax.vllm import MLAModelConfig, TokenspeedMLABackend

    for spec in (0, 1, 7, 15, 16, 17, 40):
        cfg = MLAModelConfig(num_attention_heads=heads, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                             v_head_dim=128, num_speculative_tokens=spec)
        for ps in (16, 64, 256):
            reasons = TokenspeedMLABackend.validate_configuration(
                576, "bfloat16", "auto", ps, True, False, False, None, model_config=cfg, tokenspeed_backend="xla")
            ok = _accepts_decode(cfg, ps)
            assert (not reasons) == ok, (heads, spec, ps, reasons)
            if not ok:
                limit = "takes 1..16)" if spec + 1 > 16 else "takes 1..128 per call)"
                assert any(limit in r for r in reasons), reasons
            combo = TokenspeedMLABackend.supports_combination(576, "bfloat16", "auto", ps, True, False, False, None,
                                                              model_config=cfg, tokenspeed_backend="auto")
            assert (combo is None) == ok, (heads, spec, ps, combo)


def test_vllm_refuses_before_the_op_with_the_reason():
    from tokenspeed_jax.vllm import MLAModelConfig, TokenspeedMLABackend

    cfg = MLAModelConfig(num_attention_heads=129, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                         v_head_dim=128, num_speculative_tokens=16)
    (r,) = TokenspeedMLABackend.validate_configuration(576, "bfloat16", "auto", 64, True, False, False, None, model_config=cfg)
    assert "17 query tokens" in r and "1..16" in r, r


# ------------------------------------------------------------------------------ 5. bounded caches
def test_trace_caches_are_bounded_and_shape_free(rng):
    from tokenspeed_jax import decode as D
    from tokenspeed_jax import prefill as P

    assert D._vmappable_decode.cache_info().maxsize is not None
    assert P._sequential_under_vmap.cache_info().maxsize is not None
    before = D._vmappable_decode.cache_info().currsize
    for B in range(1, 9):
        for pages in (1, 3):
            jax.eval_shape(lambda q, kv, bt, sl: tj.mla_decode(q, kv, bt, sl, softmax_scale=0.1, kv_lora_rank=16),
                           jax.ShapeDtypeStruct((B, 1, 2, 24), jnp.float32), jax.ShapeDtypeStruct((B + pages, 16, 24), jnp.float32),
                           jax.ShapeDtypeStruct((B, pages), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32))
    assert D._vmappable_decode.cache_info().currsize - before <= 1  # batch / pages are not part of the key


# --------------------------------------------------------- 10 + 1. the vLLM adapter's forward_mha
def _mha_batch(rng):
    from tests.vllm.utils import BatchSpec, make_batch

    return make_batch(rng, BatchSpec((8, 8), (8, 8)), heads=2)  # two prefills, no context


def _mha(b, kv_c):
    @jax.jit
    def run(q, kv_c, k_pe, cache, md):
        return b.impl.forward_mha(q, kv_c, k_pe, cache, md, 1.0)

    return run(jnp.asarray(b.q), jnp.asarray(kv_c), jnp.asarray(b.new_k_pe), b.kv_cache, b.md.mla)


def test_forward_mha_leaves_no_tracer_behind(rng):
    b = _mha_batch(rng)
    pb = b.impl.prefill_backend
    out = _mha(b, b.new_kv_c)
    assert np.isfinite(np.asarray(out.astype(jnp.float32))).all()
    leaves = jax.tree_util.tree_leaves(vars(pb))
    assert pb._prefill_metadata is None
    assert not any(isinstance(x, jax.core.Tracer) for x in leaves)
    assert not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(vars(b.impl)))


def test_forward_mha_confines_a_nan_to_its_request(rng):
    b = _mha_batch(rng)
    kv_c = np.array(b.new_kv_c)
    kv_c[8 + 3] = NAN  # request 1, token 3: request 0 and request 1's tokens 0..2 never see it
    out = np.asarray(_mha(b, kv_c).astype(jnp.float32))
    ok = np.asarray(_mha(b, b.new_kv_c).astype(jnp.float32))
    np.testing.assert_array_equal(out[:11], ok[:11])
    assert np.isnan(out[11:]).all()


def test_errors_name_the_argument_for_sizes_the_vllm_shapes_reach():
    """17 query tokens and 129 heads: the op's own errors (what validate_configuration now quotes)."""
    kv = jnp.zeros((2, 16, 576), jnp.bfloat16)
    for shape, pat in (((1, 17, 8, 576), r"^q: expected S \(axis 1"), ((1, 1, 129, 576), r"^q: expected H \(axis 2")):
        with pytest.raises(ValueError, match=pat):
            tj.mla_decode(jnp.zeros(shape, jnp.bfloat16), kv, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32),
                          softmax_scale=0.1)


# ------------------------------------------------- 1. sm90 prefill: the tail is finite by construction
@pytest.mark.parametrize("end,T", [(50, 200), (150, 200), (73, 200), (0, 200), (200, 200), (3, 10), (0, 1)])
def test_sm90_finite_v_tail(end, T):
    """``sm90_prefill.finite_v_tail`` (pure JAX, the step before FA4): the KV_TAIL_ROWS rows from
    ``cu_seqlens_k[-1]`` are 0, rows before it keep their values (also when the window must start earlier),
    rows from ``end + 127`` on are untouched."""
    from tokenspeed_jax.backends.sm90_prefill import KV_TAIL_ROWS, finite_v_tail

    v = np.full((T, 2, 4), np.nan, np.float32)
    v[:end] = np.arange(end * 8, dtype=np.float32).reshape(end, 2, 4)
    v[end:] = np.where(np.arange(T - end)[:, None, None] % 2, np.inf, np.nan)
    out = np.asarray(jax.jit(finite_v_tail)(jnp.asarray(v).astype(jnp.bfloat16), jnp.int32(end)), np.float32)
    np.testing.assert_array_equal(out[:end], v[:end].astype(jnp.bfloat16).astype(np.float32))
    assert (out[end:end + KV_TAIL_ROWS] == 0).all()
    np.testing.assert_array_equal(out[end + KV_TAIL_ROWS:], v[end + KV_TAIL_ROWS:])


# -------------------------------------- re-run (issue 34): merges, cache writes, host metadata, vmap
def test_merge_keeps_a_nan_lse():
    """A NaN LSE (a row that saw a NaN score) merges into NaN output *and* NaN LSE; a -inf LSE there would
    mark the row as seeing no key and the next merge would drop its NaN (forward_mha merges chunk by chunk)."""
    one, nan = jnp.ones((1, 1, 2)), jnp.full((1, 1, 2), jnp.nan)
    for la, lb in ((0.5, NAN), (-INF, NAN), (NAN, -INF), (NAN, NAN), (100.0, NAN)):
        o, lse = tj.merge_attn_states(one, jnp.array([[la]], jnp.float32), nan, jnp.array([[lb]], jnp.float32))
        assert np.isnan(np.asarray(o)).all() and np.isnan(np.asarray(lse)).all(), (la, lb, o, lse)
    o, lse = tj.merge_attn_states(one, jnp.array([[0.3]], jnp.float32), nan, jnp.array([[NAN]], jnp.float32))
    o, lse = tj.merge_attn_states(2 * one, jnp.array([[0.1]], jnp.float32), o, lse)  # a later chunk
    assert np.isnan(np.asarray(o)).all() and np.isnan(np.asarray(lse)).all()
    o, lse = tj.merge_attn_states(one, jnp.array([[-INF]], jnp.float32), nan, jnp.array([[-INF]], jnp.float32))
    assert (np.asarray(o) == 0).all() and np.isneginf(np.asarray(lse)).all()  # both dead: still 0 / -inf


def test_forward_mha_chunked_context_keeps_a_nan(rng):
    """Two context chunks: a NaN key of request 0's new tokens makes all of its rows NaN (the NaN LSE of
    the new-token attention used to become -inf in the first merge and be dropped by the second, leaving
    the last chunk's finite output); a NaN context row of request 1, whose context fits in chunk 0, makes
    its rows NaN (they used to come out 0)."""
    from tests.vllm.utils import BatchSpec, make_batch

    b = make_batch(rng, BatchSpec((32, 16), (4, 4)), heads=2, workspace=32)
    assert len(b.md.mla.prefill.chunked_context) == 2
    kv_c = np.array(b.new_kv_c)
    kv_c[0] = NAN  # request 0's first new token: every new row of request 0 sees it
    cache = np.array(b.kv_cache)
    cache[int(b.block_table[1, 0]), 3] = NAN  # request 1's context token 3 (chunk 0)
    run = jax.jit(lambda kv_c, cache: b.impl.forward_mha(jnp.asarray(b.q), kv_c, jnp.asarray(b.new_k_pe), cache,
                                                         b.md.mla, 1.0).astype(jnp.float32))
    out = np.asarray(run(kv_c, cache))
    assert np.isnan(out).all(), np.isfinite(out).all(axis=1)
    assert np.isfinite(np.asarray(run(b.new_kv_c, b.kv_cache))).all()  # the same batch without the NaNs


@pytest.mark.parametrize("slots", [np.array([2**32 + 3, -1], np.int64), np.array([2**63 - 1, 2**32], np.int64),
                                   np.array([2**64 - 1, 2**32 + 1], np.uint64),
                                   jnp.array([2**32 - 1, 2**31 + 3], jnp.uint32)], ids=str)
def test_cache_write_past_the_cache_in_any_width_writes_nothing(slots):
    """concat_and_cache_mla: a slot past the cache writes nothing; an int64 2**32 + 3 used to wrap to slot 3."""
    cache = jnp.zeros((4, 16, 8), jnp.float32)
    out = np.asarray(tj.concat_and_cache_mla(jnp.ones((2, 6)), jnp.ones((2, 2)), cache, slots))
    assert (out == 0).all()
    out = np.asarray(tj.concat_and_cache_mla(jnp.ones((2, 6)), jnp.ones((2, 2)), cache, np.array([63, 2**40], np.int64)))
    assert out.reshape(64, 8)[63].all() and out.reshape(64, 8)[:63].sum() == 0


def test_vllm_host_metadata_never_wraps_or_reads_the_table_backwards():
    from tokenspeed_jax.vllm import CommonAttentionMetadata, TokenspeedMLAMetadataBuilder, build_attention_metadata

    builder = TokenspeedMLAMetadataBuilder(block_size=16)
    with pytest.raises(ValueError, match=r"^seq_lens: expected values in the int32 range, got 4294967317"):
        build_attention_metadata(np.array([20]), [1], np.array([2**32 + 21], np.int64), np.array([[0, 1]]), builder=builder)
    with pytest.raises(ValueError, match=r"^seq_lens: expected values in the int32 range"):
        CommonAttentionMetadata.from_numpy(np.array([0, 1]), np.array([2**32 - 1], np.uint32), np.zeros((1, 2)), np.zeros(1))
    with pytest.raises(ValueError, match=r"^block_table: expected values in the int32 range"):
        CommonAttentionMetadata.from_numpy(np.array([0, 1]), np.array([5]), np.array([[2**31, 0]]), np.zeros(1))
    # position -1 would take block -1, i.e. the table's last column (another request's page 7 here)
    with pytest.raises(ValueError, match=r"^input_positions: expected non-negative positions"):
        build_attention_metadata(np.array([-1]), [1], [1], np.array([[3, 7]]), builder=builder)


@pytest.mark.parametrize("arg", ["softmax_scale", "output_scale"])
def test_scale_too_large_for_a_float_names_the_argument(rng, arg):
    q, kv, bt, sl = _decode_case(rng)
    with pytest.raises(ValueError, match=rf"^{arg}: expected a float32 scalar, got a value too large for a float"):
        tj.mla_decode(q, kv, bt, sl, kv_lora_rank=16, **{"softmax_scale": 0.2, arg: 10**400})
    with pytest.raises(ValueError, match=r"^softmax_scale: expected a float32 scalar"):
        tj.mla_prefill(*_prefill_case(rng), softmax_scale=-(10**400))


@pytest.mark.parametrize("return_lse", [False, True])
def test_decode_under_an_empty_vmap(rng, return_lse):
    """vmap over an axis of size 0 returns empty results (it used to fold into a batch of 0 and raise
    "q: expected batch B >= 1, got 0" for a q of batch 4); prefill's vmap already did."""
    q, kv, bt, sl = _decode_case(rng, dtype="bfloat16")
    f = lambda q, kv, s: tj.mla_decode(q, kv, bt, s, softmax_scale=0.2, kv_lora_rank=16, return_lse=return_lse)  # noqa: E731
    for axes, args in (((0, None, None), (np.zeros((0,) + q.shape, q.dtype), kv, sl)),
                       ((None, 0, None), (q, np.zeros((0,) + kv.shape, kv.dtype), sl)),
                       ((None, None, 0), (q, kv, np.zeros((0, 4), np.uint32)))):
        res = jax.jit(jax.vmap(f, in_axes=axes))(*args)
        out, lse = res if return_lse else (res, None)
        assert out.shape == (0, 4, 3, 2, 16) and out.dtype == jnp.bfloat16
        assert lse is None or lse.shape == (0, 4, 3, 2)


@pytest.mark.parametrize("bad", ["0.5", b"1", 10**400, 1 + 2j], ids=["str", "bytes", "huge-int", "complex"])
def test_vllm_scale_of_a_wrong_type_names_it(bad):
    """A string scale was parsed by jnp.asarray ("0.5" -> 0.5); a huge int raised OverflowError."""
    from tokenspeed_jax.vllm import TokenspeedMLAImpl

    impl = TokenspeedMLAImpl(2, 24, 0.1, 1, None, None, "fp8", None, "decoder", None, kv_lora_rank=16,
                             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, kv_b_proj=jnp.zeros((16, 32)))
    cache = jnp.zeros((2, 16, 24), jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"^k_scale: expected a float or a float32 scalar array"):
        impl.do_kv_cache_update(jnp.ones((1, 16)), jnp.ones((1, 8)), cache, jnp.array([0]), "fp8", bad)


@pytest.mark.parametrize("cq,ck,arg", [([0, 6, 3], [0, 5, 10], "cu_seqlens_q"), ([0, 3, 6], [0, 5, 11], "cu_seqlens_k"),
                                       ([0, 3, 6], [-1, 5, 10], "cu_seqlens_k"), ([0, 3, 6], [0, 5], "cu_seqlens_k")])
def test_split_varlen_batch_refuses_offsets_that_are_not_rows(cq, ck, arg):
    """The host re-layout slices rows by the offsets: decreasing ones raised a NumPy broadcast error."""
    from tokenspeed_jax.sharding import split_varlen_batch

    q, k = np.zeros((10, 2, 4), np.float32), np.zeros((10, 1, 4), np.float32)
    with pytest.raises(ValueError, match=rf"^{arg}: expected"):
        split_varlen_batch(q, k, k, np.array(cq), np.array(ck), num_shards=2)
