"""Every trace-time error of the public API (each names the argument, what was expected and what was
given) and the runtime-data checks of ``validate=True`` (jax.experimental.checkify), which report bad
lengths / page ids while the unchecked path stays memory-safe."""

# ruff: noqa: E501  (tables of cases read best one per line)

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import tokenspeed_jax as tj
from tokenspeed_jax import backends as B
from tokenspeed_jax.problems import DecodeProblem, Target
from tokenspeed_jax.runtime import _parse

f32, bf16, i32 = np.float32, jnp.bfloat16, np.int32


def z(shape, dtype=f32):
    return np.zeros(shape, dtype) if dtype in (f32, i32, np.float16, np.int64) else jnp.zeros(shape, dtype)


# ------------------------------------------------------------------------------------------- decode
def D(**over):
    a = dict(q=z((2, 1, 4, 48)), kv_cache=z((4, 16, 48)), block_table=z((2, 2), i32), seq_lens=z((2,), i32))
    kw = dict(softmax_scale=0.1, kv_lora_rank=32)
    for k, v in over.items():
        (a if k in a else kw)[k] = v
    return lambda: tj.mla_decode(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], **kw)


DECODE = [
    ("q not array", D(q=[1.0]), TypeError, r"^q: expected an array, got list"),
    ("kv not array", D(kv_cache=3.0), TypeError, r"^kv_cache: expected an array, got float"),
    ("bt not array", D(block_table=None), TypeError, r"^block_table: expected an array, got NoneType"),
    ("sl not array", D(seq_lens=(1, 2)), TypeError, r"^seq_lens: expected an array, got tuple"),
    ("q rank", D(q=z((2, 4, 48))), ValueError, r"^q: expected rank 4 \[B, S, H, D\], got shape \(2, 4, 48\)"),
    ("kv rank", D(kv_cache=z((64, 48))), ValueError, r"^kv_cache: expected rank 3 .*got shape \(64, 48\)"),
    ("bt rank", D(block_table=z((4,), i32)), ValueError, r"^block_table: expected rank 2 .*got shape \(4,\)"),
    ("sl rank", D(seq_lens=z((2, 1), i32)), ValueError, r"^seq_lens: expected rank 1 \[B\], got shape"),
    ("causal", D(causal=1), TypeError, r"^causal: expected a Python bool, got int 1"),
    ("return_lse", D(return_lse="yes"), TypeError, r"^return_lse: expected a Python bool, got str"),
    ("rank float", D(kv_lora_rank=32.0), TypeError, r"^kv_lora_rank: expected a positive Python int, got 32.0"),
    ("rank bool", D(kv_lora_rank=True), TypeError, r"^kv_lora_rank: expected a positive Python int"),
    ("rank zero", D(kv_lora_rank=0), ValueError, r"^kv_lora_rank: expected a positive int, got 0"),
    ("q dtype", D(q=z((2, 1, 4, 48), i32)), TypeError, r"^q: expected dtype in \[.*\], got int32"),
    ("kv dtype", D(kv_cache=z((4, 16, 48), bf16)), TypeError,
     r"^kv_cache: expected the same dtype as q \(float32\), got bfloat16"),
    ("bt dtype", D(block_table=z((2, 2))), TypeError, r"^block_table: expected an int32 array, got dtype float32"),
    ("sl dtype", D(seq_lens=z((2,))), TypeError, r"^seq_lens: expected an int32 array, got dtype float32"),
    ("D <= L", D(kv_lora_rank=48), ValueError, r"^q: expected head dim D = kv_lora_rank \+ rope_dim > "
     r"kv_lora_rank = 48, got D = 48"),
    ("kv D", D(kv_cache=z((4, 16, 40))), ValueError, r"^kv_cache: expected head dim .* = 48, got 40"),
    ("S 0", D(q=z((2, 0, 4, 48))), ValueError, r"^q: expected S \(axis 1.*in 1..16, got 0"),
    ("S 17", D(q=z((2, 17, 4, 48))), ValueError, r"^q: expected S .*got 17"),
    ("H 0", D(q=z((2, 1, 0, 48))), ValueError, r"^q: expected H \(axis 2, heads\) in 1..128, got 0"),
    ("H 129", D(q=z((2, 1, 129, 48))), ValueError, r"^q: expected H .*got 129"),
    ("B 0", D(q=z((0, 1, 4, 48)), block_table=z((0, 2), i32), seq_lens=z((0,), i32)), ValueError,
     r"^q: expected batch B \(axis 0\) >= 1, got 0"),
    ("page 8", D(kv_cache=z((4, 8, 48))), ValueError, r"^kv_cache: expected page_size .*got 8"),
    ("page 24", D(kv_cache=z((4, 24, 48))), ValueError, r"^kv_cache: expected page_size .*got 24"),
    ("page 512", D(kv_cache=z((1, 512, 48))), ValueError, r"^kv_cache: expected page_size .*got 512"),
    ("no pages", D(kv_cache=z((0, 16, 48))), ValueError, r"^kv_cache: expected num_pages \(axis 0\) >= 1, got 0"),
    ("bt batch", D(block_table=z((3, 2), i32)), ValueError,
     r"^block_table: expected batch \(axis 0\) equal to q's B = 2, got 3"),
    ("sl batch", D(seq_lens=z((1,), i32)), ValueError, r"^seq_lens: expected batch .* = 2, got 1"),
    ("bt cols", D(block_table=z((2, 0), i32)), ValueError, r"^block_table: expected max_pages \(axis 1\) >= 1, got 0"),
    ("validate", D(validate=1), TypeError, r"^validate: expected a Python bool, got 1"),
    ("ss bool", D(softmax_scale=True), TypeError, r"^softmax_scale: expected a float .*got bool"),
    ("ss str", D(softmax_scale="0.1"), TypeError, r"^softmax_scale: expected a float .*got str"),
    ("ss vec", D(softmax_scale=np.ones(2, f32)), ValueError, r"^softmax_scale: expected a scalar, got shape \(2,\)"),
    ("ss int arr", D(softmax_scale=np.ones((), i32)), TypeError,
     r"^softmax_scale: expected a floating scalar, got dtype int32"),
    ("os vec", D(output_scale=np.ones((1, 2), f32)), ValueError, r"^output_scale: expected a scalar, got shape"),
    ("os none", D(output_scale=None), TypeError, r"^output_scale: expected a float .*got NoneType"),
    ("backend unknown", D(backend="cuda"), ValueError, r"^backend: unknown backend 'cuda'; known backends: \["),
    ("backend type", D(backend=None), TypeError, r"^backend: expected a backend name or 'auto', got NoneType"),
    ("backend cannot", D(backend="sm100"), ValueError,
     r"^backend: expected a backend that can run this call; backend 'sm100' cannot run this mla_decode"),
]


# ------------------------------------------------------------------------------------------ prefill
def P(**over):
    a = dict(q=z((5, 4, 24)), k=z((6, 2, 24)), v=z((6, 2, 16)), cu_seqlens_q=np.array([0, 2, 5], i32),
             cu_seqlens_k=np.array([0, 3, 6], i32))
    kw = dict(softmax_scale=0.1)
    for k, v in over.items():
        (a if k in a else kw)[k] = v
    return lambda: tj.mla_prefill(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], **kw)


PREFILL = [
    ("q not array", P(q="q"), TypeError, r"^q: expected an array, got str"),
    ("k not array", P(k=1), TypeError, r"^k: expected an array, got int"),
    ("v not array", P(v=None), TypeError, r"^v: expected an array, got NoneType"),
    ("cuq not array", P(cu_seqlens_q=[0, 5]), TypeError, r"^cu_seqlens_q: expected an array, got list"),
    ("cuk not array", P(cu_seqlens_k=[0, 6]), TypeError, r"^cu_seqlens_k: expected an array, got list"),
    ("q rank", P(q=z((5, 96))), ValueError, r"^q: expected rank 3 \[Tq, Hq, Dqk\], got shape \(5, 96\)"),
    ("k rank", P(k=z((1, 6, 2, 24))), ValueError, r"^k: expected rank 3 \[Tk, Hk, Dqk\]"),
    ("v rank", P(v=z((6, 32))), ValueError, r"^v: expected rank 3 \[Tk, Hk, Dv\]"),
    ("cuq rank", P(cu_seqlens_q=z((1, 3), i32)), ValueError, r"^cu_seqlens_q: expected rank 1 \[B \+ 1\]"),
    ("cuk rank", P(cu_seqlens_k=z((), i32)), ValueError, r"^cu_seqlens_k: expected rank 1 \[B \+ 1\], got shape \(\)"),
    ("q dtype", P(q=z((5, 4, 24), np.int64)), TypeError, r"^q: expected dtype in .*got int64"),
    ("k dtype", P(k=z((6, 2, 24), np.float16)), TypeError, r"^k: expected the same dtype as q \(float32\), got float16"),
    ("v dtype", P(v=z((6, 2, 16), bf16)), TypeError, r"^v: expected the same dtype as q \(float32\), got bfloat16"),
    ("cuq dtype", P(cu_seqlens_q=np.array([0., 2., 5.], f32)), TypeError, r"^cu_seqlens_q: expected an int32 array, got dtype float32"),
    ("cuk dtype", P(cu_seqlens_k=np.array([0., 3., 6.], f32)), TypeError, r"^cu_seqlens_k: expected an int32 array"),
    ("causal", P(causal=None), TypeError, r"^causal: expected a Python bool, got NoneType"),
    ("return_lse", P(return_lse=0), TypeError, r"^return_lse: expected a Python bool, got int 0"),
    ("msq 0", P(max_seqlen_q=0), ValueError, r"^max_seqlen_q: expected a positive int, got 0"),
    ("msk float", P(max_seqlen_k=8.0), TypeError, r"^max_seqlen_k: expected a positive Python int or None, got 8.0"),
    ("k Dqk", P(k=z((6, 2, 20))), ValueError, r"^k: expected head dim \(axis 2\) equal to q's Dqk = 24, got 20"),
    ("v Tk", P(v=z((7, 2, 16))), ValueError, r"^v: expected tokens \(axis 0\) equal to k's Tk = 6, got 7"),
    ("v Hk", P(v=z((6, 1, 16))), ValueError, r"^v: expected heads \(axis 1\) equal to k's Hk = 2, got 1"),
    ("Hq mult", P(q=z((5, 3, 24))), ValueError, r"^q: expected Hq \(axis 1\) a positive multiple of k's Hk = 2, got Hq = 3"),
    ("Hk 0", P(k=z((6, 0, 24)), v=z((6, 0, 16))), ValueError, r"^q: expected Hq .*Hk = 0"),
    ("Dqk 0", P(q=z((5, 4, 0)), k=z((6, 2, 0))), ValueError, r"^q: expected positive head dims, got Dqk = 0, Dv = 16"),
    ("Dv 0", P(v=z((6, 2, 0))), ValueError, r"^q: expected positive head dims, got Dqk = 24, Dv = 0"),
    ("cuq short", P(cu_seqlens_q=np.array([0], i32), cu_seqlens_k=np.array([0], i32)), ValueError,
     r"^cu_seqlens_q: expected shape \[B \+ 1\] with B >= 1, got \(1,\)"),
    ("cuk len", P(cu_seqlens_k=np.array([0, 6], i32)), ValueError,
     r"^cu_seqlens_k: expected length equal to cu_seqlens_q's \(B \+ 1\) = 3, got 2"),
    ("ss", P(softmax_scale=np.zeros(3, f32)), ValueError, r"^softmax_scale: expected a scalar, got shape \(3,\)"),
    ("backend", P(backend="nope"), ValueError, r"^backend: unknown backend 'nope'"),
    ("backend cannot", P(backend="sm100"), ValueError, r"^backend: expected .*; backend 'sm100' cannot run this mla_prefill"),
]


# ------------------------------------------------------------------------------------ merge / cache
def M(**over):
    a = dict(out_a=z((3, 2, 8)), lse_a=z((3, 2)), out_b=z((3, 2, 8)), lse_b=z((3, 2)))
    a.update(over)
    return lambda: tj.merge_attn_states(a["out_a"], a["lse_a"], a["out_b"], a["lse_b"])


MERGE = [
    ("oa array", M(out_a=0), TypeError, r"^out_a: expected an array, got int"),
    ("la array", M(lse_a=[0]), TypeError, r"^lse_a: expected an array, got list"),
    ("ob array", M(out_b=None), TypeError, r"^out_b: expected an array"),
    ("lb array", M(lse_b="x"), TypeError, r"^lse_b: expected an array"),
    ("oa rank", M(out_a=z((3, 16))), ValueError, r"^out_a: expected rank 3 \[T, H, D\], got shape \(3, 16\)"),
    ("la rank", M(lse_a=z((6,))), ValueError, r"^lse_a: expected rank 2 \[T, H\], got shape \(6,\)"),
    ("ob shape", M(out_b=z((3, 2, 4))), ValueError, r"^out_b: expected the shape of out_a \(3, 2, 8\), got \(3, 2, 4\)"),
    ("la shape", M(lse_a=z((2, 3))), ValueError, r"^lse_a: expected shape \[T, H\] = \(3, 2\), got \(2, 3\)"),
    ("lb shape", M(lse_b=z((3, 2, 1))), ValueError, r"^lse_b: expected shape \[T, H\] = \(3, 2\), got \(3, 2, 1\)"),
    ("la dtype", M(lse_a=z((3, 2), bf16)), TypeError, r"^lse_a: expected dtype float32, got bfloat16"),
    ("lb dtype", M(lse_b=z((3, 2), np.float16)), TypeError, r"^lse_b: expected dtype float32, got float16"),
    ("oa dtype", M(out_a=z((3, 2, 8), i32), out_b=z((3, 2, 8), i32)), TypeError, r"^out_a: expected dtype in .*got int32"),
    ("ob dtype", M(out_b=z((3, 2, 8), bf16)), TypeError, r"^out_b: expected the same dtype as out_a \(float32\), got bfloat16"),
]


def W(**over):
    a = dict(kv_c=z((3, 32)), k_pe=z((3, 16)), kv_cache=z((2, 16, 48)), slot_mapping=z((3,), i32))
    kw = {}
    for k, v in over.items():
        (a if k in a else kw)[k] = v
    return lambda: tj.concat_and_cache_mla(a["kv_c"], a["k_pe"], a["kv_cache"], a["slot_mapping"], **kw)


FP8 = jnp.float8_e4m3fn
CACHE = [
    ("kv_c array", W(kv_c=1.0), TypeError, r"^kv_c: expected an array, got float"),
    ("k_pe array", W(k_pe=[1.0]), TypeError, r"^k_pe: expected an array, got list"),
    ("cache array", W(kv_cache=None), TypeError, r"^kv_cache: expected an array, got NoneType"),
    ("slot array", W(slot_mapping=[0, 1, 2]), TypeError, r"^slot_mapping: expected an array, got list"),
    ("kv_c rank", W(kv_c=z((3, 1, 32))), ValueError, r"^kv_c: expected rank 2 \[T, kv_lora_rank\], got shape \(3, 1, 32\)"),
    ("k_pe rank", W(k_pe=z((3, 2, 16))), ValueError, r"^k_pe: expected rank 2 \[T, rope_dim\], got shape \(3, 2, 16\)"),
    ("cache rank", W(kv_cache=z((32, 48))), ValueError, r"^kv_cache: expected rank 3 \[num_pages, page_size, D\]"),
    ("slot rank", W(slot_mapping=z((3, 1), i32)), ValueError, r"^slot_mapping: expected rank 1 \[T\], got shape \(3, 1\)"),
    ("slot dtype", W(slot_mapping=z((3,))), TypeError, r"^slot_mapping: expected an int32 array, got dtype float32"),
    ("k_pe T", W(k_pe=z((4, 16))), ValueError, r"^k_pe: expected tokens \(axis 0\) equal to kv_c's T = 3, got 4"),
    ("slot T", W(slot_mapping=z((2,), i32)), ValueError, r"^slot_mapping: expected length equal to kv_c's T = 3, got 2"),
    ("cache D", W(kv_cache=z((2, 16, 40))), ValueError,
     r"^kv_cache: expected row width \(axis 2\) = kv_lora_rank \+ rope_dim = 48, got 40"),
    ("cache dtype", W(kv_cache=z((2, 16, 48), i32)), TypeError, r"^kv_cache: expected dtype in .*got int32"),
    ("fp8 no scale", W(kv_cache=z((2, 16, 48), FP8)), ValueError,
     r"^scale: expected a float32 scale for a float8_e4m3fn kv_cache, got None"),
    ("scale non-fp8", W(scale=0.5), ValueError, r"^scale: expected None for a float32 kv_cache, got 0.5"),
    ("fp8 scale vec", W(kv_cache=z((2, 16, 48), FP8), scale=np.ones(2, f32)), ValueError,
     r"^scale: expected a scalar, got shape \(2,\)"),
]


def K(**over):
    a = dict(k_nope=z((3, 2, 8)), k_pe=z((3, 4)), v=z((3, 2, 8)))
    kw = dict(k_scale=1.0, v_scale=1.0)
    for k, v in over.items():
        (a if k in a else kw)[k] = v
    return lambda: tj.mla_kv_pack_quantize_fp8(a["k_nope"], a["k_pe"], a["v"], **kw)


PACK = [
    ("k_nope array", K(k_nope=0), TypeError, r"^k_nope: expected an array, got int"),
    ("k_pe array", K(k_pe="x"), TypeError, r"^k_pe: expected an array, got str"),
    ("v array", K(v=None), TypeError, r"^v: expected an array, got NoneType"),
    ("k_nope rank", K(k_nope=z((3, 16))), ValueError, r"^k_nope: expected rank 3 \[T, H, Dn\], got shape \(3, 16\)"),
    ("k_pe rank", K(k_pe=z((3, 1, 1, 4))), ValueError, r"^k_pe: expected rank 3 \[T, 1, Dr\], got shape \(3, 1, 1, 4\)"),
    ("v rank", K(v=z((3, 16))), ValueError, r"^v: expected rank 3 \[T, H, Dv\], got shape \(3, 16\)"),
    ("k_pe T", K(k_pe=z((2, 4))), ValueError, r"^k_pe: expected tokens \(axis 0\) equal to k_nope's T = 3, got 2"),
    ("k_pe H", K(k_pe=z((3, 3, 4))), ValueError, r"^k_pe: expected 1 or H = 2 heads \(axis 1\), got 3"),
    ("v T", K(v=z((4, 2, 8))), ValueError, r"^v: expected tokens \(axis 0\) equal to k_nope's T = 3, got 4"),
    ("v H", K(v=z((3, 1, 8))), ValueError, r"^v: expected heads \(axis 1\) equal to k_nope's H = 2, got 1"),
    ("k_scale", K(k_scale=None), TypeError, r"^k_scale: expected a float or a float32 scalar array, got NoneType"),
    ("v_scale", K(v_scale=np.ones(2, f32)), ValueError, r"^v_scale: expected a scalar, got shape \(2,\)"),
]


ALL = DECODE + PREFILL + MERGE + CACHE + PACK


@pytest.mark.parametrize("name,thunk,exc,pattern", ALL, ids=[c[0] for c in ALL])
def test_error_message(name, thunk, exc, pattern):
    with pytest.raises(exc, match=pattern) as info:
        thunk()
    msg = str(info.value)
    assert ("expected" in msg and ("got" in msg or "cannot run" in msg)) or "known backends" in msg


@pytest.mark.parametrize("case", [DECODE[4], DECODE[17], PREFILL[20], CACHE[11]], ids=lambda c: c[0])
def test_errors_raise_at_trace_time_under_jit(case):
    """The same checks fire while tracing a jitted function (nothing waits for runtime)."""
    _, thunk, exc, pattern = case
    with pytest.raises(exc, match=pattern):
        jax.jit(thunk)()


def test_registry_errors(monkeypatch):
    prob = DecodeProblem(batch=1, q_len=1, num_heads=1, head_dim=48, kv_lora_rank=32, page_size=16,
                         num_pages=1, max_pages=1, dtype="float32", causal=True, return_lse=False,
                         target=Target("cpu"))
    with pytest.raises(ValueError, match=r"^op: expected 'decode' or 'prefill', got 'encode'"):
        B.backend_reasons("encode", prob)
    with pytest.raises(ValueError, match=r"^backend 'xla' is already registered"):
        B.register_backend(B.get_backend("xla"))
    with pytest.raises(ValueError, match=r"^TOKENSPEED_JAX_TARGET: expected 'cpu' or 'sm_XXa\[:num_sms\]', got 'h100'"):
        _parse("h100")
    with pytest.raises(ValueError) as info:
        B.select_backend("decode", prob, "sm90")
    msg = str(info.value)
    assert msg.startswith("backend: expected a backend that can run this call; backend 'sm90' cannot run")
    for name in ("xla", "sm90", "sm100"):  # every backend's reason is listed
        assert f"  {name}: " in msg
    monkeypatch.setattr(B.get_backend("xla"), "supports_decode", lambda p: "disabled for this test")
    with pytest.raises(ValueError, match=r"^backend: expected .*; no backend can run this mla_decode") as info:
        B.select_backend("decode", prob, "auto")
    assert "  xla: disabled for this test" in str(info.value)


# ---------------------------------------------------------------------------- validate / checkify
def _decode_data(rng):
    L, R, ps = 16, 16, 16
    q = rng.standard_normal((3, 2, 2, L + R)).astype(f32)
    kv = rng.standard_normal((6, ps, L + R)).astype(f32)
    bt = np.array([[0, 1, 99], [2, 3, -5], [4, 5, 5]], i32)  # garbage past the used pages is allowed
    sl = np.array([20, 17, 40], i32)
    return q, kv, bt, sl


BAD_RUNTIME = [
    ("negative length", lambda bt, sl: (bt, sl * np.array([1, -1, 1], i32)), "seq_lens: expected every length >= 0"),
    ("length beyond table", lambda bt, sl: (bt, sl + np.array([0, 0, 9], i32)),
     "seq_lens: expected every length <= max_pages \\* page_size = 48"),
    ("page id too large", lambda bt, sl: (bt + np.array([[0, 6, 0], [0, 0, 0], [0, 0, 0]], i32), sl),
     r"block_table: expected page ids in \[0, 6\)"),
    ("page id negative", lambda bt, sl: (bt * np.array([[1, 1, 1], [1, 1, 1], [-1, 1, 1]], i32), sl),
     r"block_table: expected page ids in \[0, 6\)"),
]


@pytest.mark.parametrize("name,mutate,pattern", BAD_RUNTIME, ids=[c[0] for c in BAD_RUNTIME])
def test_validate_reports_bad_runtime_data(rng, name, mutate, pattern):
    q, kv, bt, sl = _decode_data(rng)
    bt2, sl2 = mutate(bt, sl)
    kw = dict(softmax_scale=0.2, kv_lora_rank=16, backend="xla")
    # eager: raises
    with pytest.raises(checkify.JaxRuntimeError, match=pattern):
        tj.mla_decode(q, kv, bt2, sl2, validate=True, **kw)
    # jitted: reported through checkify
    f = checkify.checkify(jax.jit(lambda b, s: tj.mla_decode(q, kv, b, s, validate=True, **kw)))
    err, out = f(bt2, sl2)
    assert err.get() is not None and name and __import__("re").search(pattern, err.get())
    assert np.isfinite(np.asarray(out)).all()  # the unchecked result is still memory-safe and finite
    err, out = f(bt, sl)
    assert err.get() is None
    np.testing.assert_array_equal(np.asarray(out), np.asarray(tj.mla_decode(q, kv, bt, sl, **kw)))


def test_validate_accepts_garbage_past_used_pages(rng):
    q, kv, bt, sl = _decode_data(rng)
    out = tj.mla_decode(q, kv, bt, sl, softmax_scale=0.2, kv_lora_rank=16, validate=True)
    assert out.shape == (3, 2, 2, 16)
    zero = np.zeros(3, i32)
    tj.mla_decode(q, kv, np.full_like(bt, -1), zero, softmax_scale=0.2, kv_lora_rank=16, validate=True)


def test_prefill_bad_offsets_are_memory_safe(rng):
    """cu_seqlens pointing past the arrays or decreasing: no crash, no NaN (clamped indexing)."""
    q = rng.standard_normal((5, 2, 8)).astype(f32)
    k = rng.standard_normal((6, 2, 8)).astype(f32)
    f = jax.jit(lambda cq, ck: tj.mla_prefill(q, k, k, cq, ck, softmax_scale=0.3, return_lse=True,
                                              backend="xla"))
    for cq, ck in (([0, 3, 50], [0, 2, 60]), ([0, 4, 2], [0, 5, 1]), ([-3, 2, 5], [-1, 3, 6])):
        out, lse = f(np.array(cq, i32), np.array(ck, i32))
        assert np.isfinite(np.asarray(out)).all() and not np.isnan(np.asarray(lse)).any()


def test_validate_under_jit_needs_checkify_and_works_under_vmap(rng):
    """Documented: a jitted validate=True call must be functionalised with checkify.checkify; under
    vmap + checkify the per-batch errors are reported."""
    q, kv, bt, sl = _decode_data(rng)

    def f(s):
        return tj.mla_decode(q, kv, bt, s, softmax_scale=0.2, kv_lora_rank=16, validate=True)

    with pytest.raises(ValueError, match="checkify"):
        jax.jit(f)(sl)
    err, out = checkify.checkify(jax.jit(jax.vmap(f)))(np.stack([sl, -sl]))
    assert "seq_lens: expected every length >= 0" in err.get()
    assert out.shape == (2, 3, 2, 2, 16)


PREFILL_BAD_RUNTIME = [
    ("q starts late", [1, 3, 5], [0, 2, 6], r"^cu_seqlens_q: expected the first offset to be 0"),
    ("q decreases", [0, 4, 2], [0, 2, 6], r"^cu_seqlens_q: expected non-decreasing offsets"),
    ("q past rows", [0, 3, 6], [0, 2, 6], r"^cu_seqlens_q: expected the last offset <= 5"),
    ("k negative", [0, 3, 5], [-1, 2, 6], r"^cu_seqlens_k: expected the first offset to be 0"),
    ("k decreases", [0, 3, 5], [0, 5, 4], r"^cu_seqlens_k: expected non-decreasing offsets"),
    ("k past rows", [0, 3, 5], [0, 2, 7], r"^cu_seqlens_k: expected the last offset <= 6"),
]


@pytest.mark.parametrize("name,cq,ck,pattern", PREFILL_BAD_RUNTIME, ids=[c[0] for c in PREFILL_BAD_RUNTIME])
def test_prefill_validate_reports_bad_offsets(rng, name, cq, ck, pattern):
    q = rng.standard_normal((5, 2, 8)).astype(f32)
    k = rng.standard_normal((6, 2, 8)).astype(f32)
    cq, ck = np.array(cq, i32), np.array(ck, i32)
    with pytest.raises(checkify.JaxRuntimeError, match=pattern):
        tj.mla_prefill(q, k, k, cq, ck, softmax_scale=0.3, validate=True)
    f = checkify.checkify(jax.jit(lambda a, b: tj.mla_prefill(q, k, k, a, b, softmax_scale=0.3, validate=True)))
    err, out = f(cq, ck)
    assert err.get() is not None and __import__("re").search(pattern[1:], err.get())
    assert np.isfinite(np.asarray(out)).all()
    good_q, good_k = np.array([0, 3, 5], i32), np.array([0, 2, 6], i32)
    err, out = f(good_q, good_k)
    assert err.get() is None
    want = tj.mla_prefill(q, k, k, good_q, good_k, softmax_scale=0.3)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_prefill_validate_type():
    with pytest.raises(TypeError, match=r"^validate: expected a Python bool, got 'yes'"):
        P(validate="yes")()


def test_trace_env_switch_takes_effect_in_one_process(monkeypatch):
    """A backend's trace-time environment switches (``Backend.trace_env``) are part of mla_decode's trace
    cache key: changing one between two traces of the same problem reaches the backend (scripts/decode_ab.py
    relies on it).  jax >= 0.11 caches the trace of a custom_vmap function by its identity
    (``pe.trace_to_jaxpr`` is a weakref LRU cache), so without the switches in ``_vmappable_decode``'s key the
    second trace reused the first and an A/B compared a kernel with itself (H200, 2026-11-30); jax 0.10
    retraces every time, where this test checks only that the switch reaches the backend."""
    seen = []

    class Probe:
        name, priority, trace_env = "env_probe", -100, ("TOKENSPEED_TEST_SWITCH",)

        def supports_decode(self, problem):
            return None

        def supports_prefill(self, problem):
            return "decode only"

        def decode(self, problem, q, kv_cache, block_table, seq_lens, softmax_scale, output_scale):
            seen.append(os.environ.get("TOKENSPEED_TEST_SWITCH"))
            B, S, H, _ = q.shape
            return (jnp.zeros((B, S, H, problem.kv_lora_rank), q.dtype), jnp.zeros((B, S, H), jnp.float32))

    monkeypatch.setitem(B._REGISTRY, "env_probe", Probe())
    q = jnp.zeros((1, 1, 1, 32), jnp.float32)
    kv = jnp.zeros((2, 16, 32), jnp.float32)
    args = (q, kv, jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32))
    run = lambda: jax.jit(lambda *a: tj.mla_decode(*a, softmax_scale=1.0, kv_lora_rank=16,  # noqa: E731
                                                   backend="env_probe"))(*args)
    for v in ("a", "b", "a"):
        monkeypatch.setenv("TOKENSPEED_TEST_SWITCH", v)
        run()
    assert seen[:2] == ["a", "b"] and set(seen) == {"a", "b"}, seen
