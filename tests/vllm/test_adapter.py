"""Contracts of the vLLM-style adapter: decode contract, runtime scales, non-uniform decodes, LSE base,
builder, pytree metadata, capability reason strings, registries."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokenspeed_jax.backends as ts_backends
import tokenspeed_jax.vllm.impl as impl_mod
from tests.vllm.utils import BLOCK, BatchSpec, L, Layer, P, R, V, make_batch, reference
from tokenspeed_jax.backends import backend_reasons, get_backend
from tokenspeed_jax.cache import quantize_e4m3
from tokenspeed_jax.problems import FP8_DTYPE
from tokenspeed_jax.vllm import (
    AttentionBackendEnum,
    CommonAttentionMetadata,
    DeviceCapability,
    MLAModelConfig,
    MLAPrefillBackendEnum,
    TokenspeedMLABackend,
    TokenspeedMLAImpl,
    TokenspeedMLAMetadataBuilder,
    TokenspeedMLAPrefillBackend,
    get_attn_backend,
    get_backend_priorities,
    get_mla_prefill_backend,
    lse_base2_to_natural,
    lse_natural_to_base2,
    mla_attention,
    register_backend,
    register_mla_prefill_backend,
    set_current_mla_config,
)
from tokenspeed_jax.vllm.backend import NO_CONFIG_REASON, decode_problem, resolve_kernel_backend, target_for

R1 = MLAModelConfig(num_attention_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                    v_head_dim=128, tensor_parallel_size=8, num_speculative_tokens=3)


def _absorbed_q(b, rows=None):
    """Absorbed decode query ``[T, N, L + R]`` (bf16) of the batch's first ``rows`` tokens."""
    q = np.asarray(b.q, np.float64)[:rows]
    w = np.asarray(b.w_kv_b, np.float64).reshape(L, b.heads, P + V)[..., :P]
    ql = np.einsum("tnp,lnp->tnl", q[..., :P], w)
    return jnp.asarray(np.concatenate([ql, q[..., P:]], -1).astype(np.float32)).astype(jnp.bfloat16)


def _with_new_tokens(b, kv_cache_dtype="auto", k_scale=1.0):
    n = sum(b.spec.query_lens)
    return jax.jit(b.impl.do_kv_cache_update, static_argnums=(4,))(
        jnp.asarray(b.new_kv_c), jnp.asarray(b.new_k_pe), b.kv_cache, b.md.mla.slot_mapping[:n], kv_cache_dtype,
        jnp.float32(k_scale))


def _impl(heads, kv_cache_dtype="auto", **kw):
    w = jnp.zeros((L, heads * (P + V)), jnp.bfloat16)
    return TokenspeedMLAImpl(heads, L + R, (P + R) ** -0.5, 1, None, None, kv_cache_dtype, None, "decoder", None,
                             kv_lora_rank=L, qk_nope_head_dim=P, qk_rope_head_dim=R, v_head_dim=V, kv_b_proj=w,
                             tokenspeed_backend="xla", **kw)


# ------------------------------------------------------------------------------- decode contract
def test_decode_contract_and_both_lse_bases(rng):
    """q reshaped to (num_decodes, tokens_per_decode, H, 576); out (T, H, 512); LSE (T, H) natural log
    (vLLM's lse_base_on_e=True), and base 2 when the impl is built with lse_base_on_e=False."""
    spec = BatchSpec((40, 64, 33), (4, 4, 4))
    b = make_batch(rng, spec, heads=8, num_speculative_tokens=3)
    cache = _with_new_tokens(b)
    impl_e = _impl(8, return_lse_for_decode=True)
    impl_2 = _impl(8, return_lse_for_decode=True, lse_base_on_e=False)
    assert TokenspeedMLAImpl.lse_base_on_e and impl_e.lse_base_on_e and not impl_2.lse_base_on_e
    q = _absorbed_q(b)
    seen = {}
    real = impl_mod.mla_decode

    def spy(q4, *a, **k):
        seen["q"] = q4.shape
        return real(q4, *a, **k)

    impl_mod.mla_decode = spy
    try:
        @jax.jit
        def run(q, cache, md):
            return impl_e.forward_mqa(q, cache, md, Layer()), impl_2.forward_mqa((q[..., :L], q[..., L:]), cache, md,
                                                                                  Layer())
        (o, lse), (o2, lse2) = run(q, cache, b.md.mla)
    finally:
        impl_mod.mla_decode = real
    assert seen["q"] == (3, 4, 8, L + R)
    assert o.shape == (12, 8, L) and lse.shape == (12, 8) and lse.dtype == jnp.float32
    ref_o, ref_lse = reference(b, latent=True)
    np.testing.assert_allclose(np.asarray(o, np.float64), ref_o, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(lse, np.float64), ref_lse, rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(np.asarray(o2), np.asarray(o))
    np.testing.assert_allclose(np.asarray(lse2, np.float64), ref_lse / math.log(2), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(lse_base2_to_natural(lse2)), np.asarray(lse), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lse_natural_to_base2(lse)), np.asarray(lse2), rtol=1e-6)


def test_lse_conversions_keep_infinities():
    x = jnp.array([-jnp.inf, 0.0, 1.0, jnp.inf], jnp.float32)
    np.testing.assert_allclose(np.asarray(lse_natural_to_base2(x)), [-np.inf, 0.0, 1 / math.log(2), np.inf], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(lse_base2_to_natural(x))[[0, 1, 3]], [-np.inf, 0.0, np.inf])
    # log2(sum 2^(s log2 e)) == ln(sum e^s) / ln 2 on a concrete row
    s = np.array([0.3, -1.2, 2.0])
    assert np.isclose(float(lse_natural_to_base2(jnp.float32(np.log(np.exp(s).sum())))),
                      np.log2(np.power(2.0, s / np.log(2)).sum()), rtol=1e-6)


def _stub_decode(record):
    def stub(q4, kv_cache, block_table, seq_lens, *, softmax_scale, output_scale, return_lse, **kw):
        record.append(dict(q=q4, ss=softmax_scale, os=output_scale, bt=block_table.shape, sl=seq_lens.shape, **kw))
        B, S, H, _ = q4.shape
        o = jnp.zeros((B, S, H, L), jnp.bfloat16)
        return (o, jnp.zeros((B, S, H), jnp.float32)) if return_lse else o
    return stub


def test_scales_computed_on_every_call(rng, monkeypatch):
    """softmax_scale = scale * q_scale * k_scale and output_scale = k_scale from the layer of *this*
    call; FP8 q quantized with q_scale (a first, profiling call cannot poison later ones)."""
    b = make_batch(rng, BatchSpec((20, 30), (1, 1)), heads=8, kv_cache_dtype="fp8", k_scale=3.0)
    impl = _impl(8, "fp8")
    calls = []
    monkeypatch.setattr(impl_mod, "mla_decode", _stub_decode(calls))
    q = _absorbed_q(b)
    for qs, ks in [(1.0, 1.0), (2.0, 3.0), (0.5, 1.5)]:
        impl.forward_mqa(q, b.kv_cache, b.md.mla, Layer(qs, ks))
        c = calls[-1]
        assert float(c["ss"]) == pytest.approx(impl.scale * qs * ks, rel=1e-6)
        assert float(c["os"]) == pytest.approx(ks, rel=1e-6)
        assert jnp.dtype(c["q"].dtype).name == FP8_DTYPE
        np.testing.assert_array_equal(np.asarray(c["q"].reshape(q.shape).astype(jnp.float32)),
                                      np.asarray(quantize_e4m3(q, qs).astype(jnp.float32)))
        assert c["backend"] == "xla"
    # 16-bit cache: q/k scales do not apply.
    impl16 = _impl(8)
    b16 = make_batch(rng, BatchSpec((20, 30), (1, 1)), heads=8)
    impl16.forward_mqa(q, b16.kv_cache, b16.md.mla, Layer(7.0, 5.0))
    assert float(calls[-1]["ss"]) == pytest.approx(impl16.scale) and float(calls[-1]["os"]) == 1.0
    with pytest.raises(ValueError, match="layer: expected attribute _q_scale"):
        impl.forward_mqa(q, b.kv_cache, b.md.mla, object())


def test_scale_change_between_calls_takes_effect(rng):
    """One jitted step, scales as runtime operands: a dummy-scale call, then the real scales (must match
    the reference), then dummy again (bit-identical to the first call)."""
    spec = BatchSpec((40, 56), (2, 2))
    b = make_batch(rng, spec, heads=8, kv_cache_dtype="fp8", k_scale=3.0, num_speculative_tokens=1)
    cache = _with_new_tokens(b, "fp8", 3.0)
    impl = _impl(8, "fp8")
    step = jax.jit(lambda q, c, md, qs, ks: impl.forward_mqa(q, c, md, Layer(qs, ks))[0])
    q = _absorbed_q(b)
    dummy = np.asarray(step(q, cache, b.md.mla, jnp.float32(1), jnp.float32(1)), np.float64)
    real = np.asarray(step(q, cache, b.md.mla, jnp.float32(2), jnp.float32(3)), np.float64)
    again = np.asarray(step(q, cache, b.md.mla, jnp.float32(1), jnp.float32(1)), np.float64)
    ref, _ = reference(b, latent=True)
    np.testing.assert_allclose(real, ref, rtol=1e-2, atol=1.5e-1)
    assert np.abs(dummy - ref).max() > 0.5  # the dummy scales really give a different answer
    np.testing.assert_array_equal(again, dummy)


# ------------------------------------------------------------------------- non-uniform decodes
NONUNIFORM = BatchSpec((40, 33, 17, 64, 50, 30), (2, 4, 1, 3, 4, 6))


def test_nonuniform_decode_padded_with_mask(rng):
    b = make_batch(rng, NONUNIFORM, heads=8, num_speculative_tokens=3, pad_tokens=2)
    dec = b.md.mla.decode
    assert (dec.num_decodes, dec.query_len, dec.padded) == (5, 4, True)
    # right-aligned slots: request b's tokens fill its last query_len slots, -1 elsewhere
    np.testing.assert_array_equal(np.asarray(dec.token_index), [[-1, -1, 0, 1], [2, 3, 4, 5], [-1, -1, -1, 6],
                                                                [-1, 7, 8, 9], [10, 11, 12, 13]])
    np.testing.assert_array_equal(np.asarray(dec.query_mask), np.asarray(dec.token_index) >= 0)
    from tests.vllm.test_mla_backends import TOL

    impl_l = _impl(8, return_lse_for_decode=True)
    cache = _with_new_tokens(b)

    @jax.jit
    def run(q, kv_c, k_pe, c, qa, md):
        return mla_attention(q, kv_c, k_pe, c, md, impl=b.impl, layer=Layer())[1], \
            impl_l.forward_mqa(qa, cache, md.mla, Layer())

    pad = np.zeros((2,), np.int64)
    out, (o_lat, lse) = run(jnp.asarray(b.q), jnp.asarray(np.concatenate([b.new_kv_c, b.new_kv_c[:2] * 0])),
                            jnp.asarray(np.concatenate([b.new_k_pe, b.new_k_pe[:2] * 0])), b.kv_cache,
                            _absorbed_q(b, 14), b.md)
    del pad
    ref, ref_lse = reference(b)
    n = ref.shape[0]
    np.testing.assert_allclose(np.asarray(out, np.float64)[:n], ref, rtol=1e-2, atol=TOL["auto"])
    np.testing.assert_array_equal(np.asarray(out, np.float64)[n:], 0.0)
    ref_lat, _ = reference(b, latent=True)
    np.testing.assert_allclose(np.asarray(o_lat, np.float64), ref_lat[:14], rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(lse, np.float64), ref_lse[:14], rtol=1e-2, atol=1e-2)


def test_nonuniform_decode_rejected_when_asked(rng):
    with pytest.raises(ValueError, match=r"one query length for every decode request, got decode query lens "
                                         r"\[2, 4, 1, 3, 4\]"):
        make_batch(rng, NONUNIFORM, heads=8, num_speculative_tokens=3, nonuniform_decode="reject")


# ------------------------------------------------------------------------------------ builder
def _common(qlens, slens, bt_width=8):
    qsl = np.concatenate([[0], np.cumsum(qlens)])
    return CommonAttentionMetadata.from_numpy(qsl, slens, np.zeros((len(qlens), bt_width)),
                                              np.full(int(qsl[-1]), -1))


def test_builder_split_order_and_errors():
    bld = TokenspeedMLAMetadataBuilder(block_size=16, num_speculative_tokens=1)
    assert bld.reorder_batch_threshold == 2
    md = bld.build(0, _common([1, 2, 5, 3], [10, 20, 30, 40]))
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (2, 3, 2)
    np.testing.assert_array_equal(np.asarray(md.prefill.query_start_loc), [0, 5, 8])
    np.testing.assert_array_equal(np.asarray(md.prefill.context_lens), [25, 37])
    with pytest.raises(ValueError, match="not in decode-first order: request 2 has query_len 1"):
        bld.build(0, _common([1, 5, 1], [10, 20, 30]))
    with pytest.raises(ValueError, match="common_prefix_len: expected 0"):
        bld.build(16, _common([1], [10]))
    with pytest.raises(ValueError, match="num_speculative_tokens: expected at most 15"):
        TokenspeedMLAMetadataBuilder(block_size=16, num_speculative_tokens=16)
    with pytest.raises(ValueError, match="nonuniform_decode"):
        TokenspeedMLAMetadataBuilder(block_size=16, nonuniform_decode="unsqueeze")
    assert bld.build(0, _common([1, 1], [3, 4])).prefill is None
    assert bld.build(0, _common([7], [7])).decode is None
    assert bld.build(0, _common([7], [7])).prefill.chunked_context is None  # no context, no chunks


def test_builder_workspace_bounded_chunks():
    ws = 96
    bld = TokenspeedMLAMetadataBuilder(block_size=16, chunked_prefill_workspace_size=ws)
    ctx = np.array([0, 130, 47, 200])
    md = bld.build(0, _common([1, 4, 5, 6, 7], list(np.array([1, 4, 5, 6, 7]) + np.r_[0, ctx])))
    chunks = md.prefill.chunked_context
    per = (ws // 3) // 16 * 16  # equal share per prefill with context, rounded down to the block size
    assert len(chunks) == -(-200 // per)
    covered = [[] for _ in ctx]
    for i, ch in enumerate(chunks):
        assert ch.chunk_index == i and ch.seq_tot <= ws and ch.num_requests == 4
        starts, lens = np.asarray(ch.starts), np.asarray(ch.seq_lens)
        assert (starts % 16 == 0).all() and ch.seq_tot == lens.sum() and ch.max_seq_len == lens.max()
        np.testing.assert_array_equal(np.asarray(ch.cu_seq_lens), np.r_[0, np.cumsum(lens)])
        seq, pos = np.asarray(ch.token_to_seq), np.asarray(ch.token_positions)
        for p in range(4):
            covered[p] += list(pos[seq == p])
            np.testing.assert_array_equal(pos[seq == p], np.arange(starts[p], starts[p] + lens[p]))
    for p, c in enumerate(ctx):
        assert sorted(covered[p]) == list(range(c))
    assert TokenspeedMLAMetadataBuilder.determine_chunked_prefill_workspace_size(
        max_model_len=4096, max_num_seqs=256, block_size=16) == 32768


def test_metadata_is_pytree_with_static_counts():
    bld = TokenspeedMLAMetadataBuilder(block_size=16)
    md = bld.build(0, _common([1, 1, 9], [5, 6, 30]))
    leaves = jax.tree_util.tree_leaves(md)
    assert all(hasattr(x, "shape") for x in leaves)
    assert not any(isinstance(x, (int, bool)) for x in leaves)
    traces = []

    @jax.jit
    def f(m):
        traces.append((m.num_decodes, m.decode.query_len, m.prefill.chunked_context[0].seq_tot))
        return m.query_start_loc.sum()

    f(md)
    f(bld.build(0, _common([1, 1, 9], [6, 7, 30])))  # same counts (new lengths): no retrace
    f(bld.build(0, _common([1, 9], [5, 30])))  # new counts: retrace
    assert traces == [(2, 1, 21), (1, 1, 21)]


# ----------------------------------------------------------------------------- capabilities
def test_backend_identity_and_layout():
    B = TokenspeedMLABackend
    assert B.get_name() == "TOKENSPEED_MLA" and B.is_mla() and not B.is_sparse()
    assert B.supported_dtypes == ["float16", "bfloat16"]
    assert B.supported_kv_cache_dtypes == ["auto", "bfloat16", "fp8", "fp8_e4m3"]
    assert B.get_supported_kernel_block_sizes() == [16, 32, 64, 128, 256]
    assert B.get_kv_cache_shape(100, 64, 1, 576) == (100, 64, 576)
    assert B.get_builder_cls() is TokenspeedMLAMetadataBuilder and B.get_impl_cls() is TokenspeedMLAImpl
    with pytest.raises(ValueError, match="num_kv_heads: expected 1"):
        B.get_kv_cache_shape(100, 64, 2, 576)
    with pytest.raises(ValueError, match="block_size: expected one of"):
        B.get_kv_cache_shape(100, 48, 1, 576)
    with pytest.raises(ValueError, match="cache_dtype_str"):
        B.get_kv_cache_shape(100, 64, 1, 576, "fp8_e5m2")


def test_every_capability_reason_string():
    B = TokenspeedMLABackend
    ok = {"head_size": 576, "dtype": jnp.bfloat16, "kv_cache_dtype": "auto", "block_size": 64, "use_mla": True,
          "has_sink": False, "use_sparse": False, "device_capability": None}

    def reasons(**kw):
        return B.validate_configuration(**{**ok, **kw}, model_config=R1)

    assert reasons() == []  # CPU: auto -> xla
    assert reasons(kv_cache_dtype="fp8") == [] and reasons(kv_cache_dtype="fp8_e4m3") == []
    assert reasons(dtype="float32") == ["dtype float32 not supported (supported: ['float16', 'bfloat16'])"]
    assert reasons(kv_cache_dtype="fp8_e5m2") == [
        "kv_cache_dtype 'fp8_e5m2' not supported (supported: ['auto', 'bfloat16', 'fp8', 'fp8_e4m3'])"]
    assert reasons(block_size=8) == ["block_size 8 not supported (supported: [16, 32, 64, 128, 256])"]
    assert reasons(use_mla=False) == ["non-MLA not supported"]
    assert reasons(has_sink=True) == ["attention sinks not supported"]
    assert reasons(use_sparse=True) == ["sparse not supported"]
    assert reasons(device_capability=DeviceCapability(8, 0))[0] == (
        "compute capability 8.0 not supported (TOKENSPEED kernels need SM90 or newer)")
    assert B.validate_configuration(**ok, attn_type="encoder", model_config=R1) == [
        "attention type encoder not supported"]
    assert reasons(head_size=512) == [
        "head_size 512 does not match the model's kv_lora_rank + qk_rope_head_dim = 512 + 64 = 576"]
    assert reasons(dtype="float16", kv_cache_dtype="bfloat16") == [
        ("kv_cache_dtype 'bfloat16' stores bfloat16 but the model dtype is float16: TOKENSPEED decode reads q "
         "and the cache in one dtype (use 'auto', or fp8)")]
    assert B.validate_configuration(**ok) == [NO_CONFIG_REASON]
    with set_current_mla_config(R1):
        assert B.validate_configuration(**ok) == []
    assert B.validate_configuration(**ok, model_config=R1, tokenspeed_backend="nope") == [
        "unknown tokenspeed backend 'nope' (registered: " + str(sorted(backend_reasons(
            "decode", decode_problem(R1, dtype="bfloat16", page_size=64, target=target_for(None))))) + ")"]


def test_named_backend_reason_is_the_backends_own():
    cap = DeviceCapability(10, 0)
    p = decode_problem(R1, dtype=FP8_DTYPE, page_size=64, target=target_for(cap))
    own = get_backend("sm100").supports_decode(p)
    got = TokenspeedMLABackend.supports_combination(576, "bfloat16", "fp8", 64, True, False, False, cap,
                                                    model_config=R1, tokenspeed_backend="sm100")
    if own is None:
        assert got is None or got.startswith("tokenspeed backend 'sm100' cannot run MLA prefill")
    else:
        assert got == (f"tokenspeed backend 'sm100' cannot run MLA decode for 16 heads x 4 query tokens, kv_lora_rank "
                       f"512, rope 64, page 64, {FP8_DTYPE} on sm_100a: {own}")


class _FakeKernel:
    """A kernel backend with a realistic shape limit (rows = heads * query tokens <= 64)."""

    name, priority = "fake_vllm_kernel", 95

    def supports_decode(self, p):
        if p.target.platform != "cuda":
            return "fake_vllm_kernel: needs CUDA"
        if p.kv_lora_rank != 256:
            return f"fake_vllm_kernel: kv_lora_rank {p.kv_lora_rank} != 256"
        rows = p.num_heads * p.q_len
        return None if rows <= 64 else f"fake_vllm_kernel: heads * q_len = {rows} > 64"

    def supports_prefill(self, p):
        return None if p.target.platform == "cuda" else "fake_vllm_kernel: needs CUDA"


def test_capability_comes_from_backend_supports_with_real_dims(monkeypatch):
    """The answer follows the model's kv_lora_rank, per-rank heads (TP) and query length (MTP)."""
    monkeypatch.setitem(ts_backends._REGISTRY, "fake_vllm_kernel", _FakeKernel())
    small = MLAModelConfig(num_attention_heads=64, kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64,
                           v_head_dim=64, tensor_parallel_size=4, num_speculative_tokens=3)  # 16 heads x 4
    args = (288, "bfloat16", "auto", 32, True, False, False, DeviceCapability(9, 0))
    B = TokenspeedMLABackend
    assert B.validate_configuration(*args, model_config=small, tokenspeed_backend="fake_vllm_kernel") == []
    wide = dataclasses.replace(small, tensor_parallel_size=2)  # 32 heads x 4 = 128 rows
    assert B.validate_configuration(*args, model_config=wide, tokenspeed_backend="fake_vllm_kernel") == [
        ("tokenspeed backend 'fake_vllm_kernel' cannot run MLA decode for 32 heads x 4 query tokens, kv_lora_rank "
         "256, rope 32, page 32, bfloat16 on sm_90a: fake_vllm_kernel: heads * q_len = 128 > 64")]
    # auto on CUDA: the fake kernel (or a real one) serves, never the xla reference.
    name, why = resolve_kernel_backend("decode", decode_problem(small, dtype="bfloat16", page_size=32,
                                                                target=target_for((9, 0))))
    assert why is None and name != "xla"
    # Nothing but xla can run -> the auto reason lists every backend, xla as "reference only".
    r1 = dataclasses.replace(R1, kv_lora_rank=300)  # no kernel takes kv_lora_rank 300
    p = decode_problem(r1, dtype="bfloat16", page_size=64, target=target_for((9, 0)))
    name, why = resolve_kernel_backend("decode", p)
    if name is None:
        assert "xla: reference only, not chosen by auto on CUDA" in why
        for n, r in backend_reasons("decode", p).items():
            if n != "xla":
                assert f"{n}: {r}" in why
    # Off CUDA, auto is the xla reference.
    assert resolve_kernel_backend("decode", decode_problem(small, dtype="bfloat16", page_size=32,
                                                           target=target_for(None)))[0] == "xla"


def test_prefill_backend_reasons():
    PB = TokenspeedMLAPrefillBackend
    assert PB.get_name() == "TOKENSPEED_MLA" and PB.is_available()
    assert PB.validate_configuration(None, "bfloat16", model_config=R1) == []
    assert PB.validate_configuration(None, "float32", model_config=R1) == [
        "dtype float32 not supported (supported: ['float16', 'bfloat16'])"]
    assert PB.validate_configuration((7, 5), "bfloat16", model_config=R1)[0] == "compute capability 7.5 not supported"
    assert PB.validate_configuration(None, "bfloat16") == [NO_CONFIG_REASON]


def test_impl_rejects_unsupported_features():
    base = (8, L + R, 0.1, 1, None, None, "auto", None, "decoder", None)
    kw = {"kv_lora_rank": L, "qk_nope_head_dim": P, "qk_rope_head_dim": R, "v_head_dim": V,
          "kv_b_proj": jnp.zeros((L, 8 * (P + V)))}
    TokenspeedMLAImpl(*base, **kw)
    for i, v in ((4, [1.0]), (5, 128), (7, 30.0)):
        with pytest.raises(NotImplementedError, match="alibi_slopes, sliding_window or logits_soft_cap"):
            TokenspeedMLAImpl(*base[:i], v, *base[i + 1:], **kw)
    with pytest.raises(NotImplementedError, match="attn_type"):
        TokenspeedMLAImpl(*base[:8], "encoder", None, **kw)
    with pytest.raises(ValueError, match="num_kv_heads: expected 1"):
        TokenspeedMLAImpl(*base[:3], 2, *base[4:], **kw)
    with pytest.raises(ValueError, match="head_size: expected kv_lora_rank \\+ qk_rope_head_dim = 576"):
        TokenspeedMLAImpl(8, 512, *base[2:], **kw)
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of"):
        TokenspeedMLAImpl(*base[:6], "int8", *base[7:], **kw)
    with pytest.raises(ValueError, match=r"kv_b_proj: expected weight shape"):
        TokenspeedMLAImpl(*base, **{**kw, "kv_b_proj": jnp.zeros((L, 7))})


def test_do_kv_cache_update_layout_and_checks():
    impl = _impl(8, "fp8")
    cache = jnp.full((3, BLOCK, L + R), jnp.nan, jnp.float8_e4m3fn)
    kv_c = jnp.linspace(-2, 2, 2 * L, dtype=jnp.float32).reshape(2, L).astype(jnp.bfloat16)
    k_pe = jnp.linspace(-1, 1, 2 * R, dtype=jnp.float32).reshape(2, 1, R).astype(jnp.bfloat16)
    out = impl.do_kv_cache_update(kv_c, k_pe, cache, jnp.array([17, -1], jnp.int32), "fp8", 2.0)
    flat = np.asarray(out.astype(jnp.float32)).reshape(-1, L + R)
    want = np.concatenate([np.asarray(kv_c[0], np.float32), np.asarray(k_pe[0, 0], np.float32)]) / 2
    np.testing.assert_allclose(flat[17], want, rtol=2**-4, atol=2**-9)
    assert np.isnan(np.delete(flat, 17, axis=0)).all()  # slot -1 wrote nothing
    with pytest.raises(TypeError, match="kv_cache: expected a cache array matching kv_cache_dtype 'auto'"):
        impl.do_kv_cache_update(kv_c, k_pe, cache, jnp.array([0, 1]), "auto", 1.0)


# ------------------------------------------------------------------------------------ registries
def test_attention_backend_enum_and_overrides():
    assert AttentionBackendEnum["TOKENSPEED_MLA"].get_class() is TokenspeedMLABackend
    with pytest.raises(ValueError, match="Unknown attention backend: 'FLASHMLA'. Valid options are: TOKENSPEED_MLA"):
        AttentionBackendEnum["FLASHMLA"]
    with pytest.raises(ValueError, match="Backend CUSTOM must be registered before use"):
        AttentionBackendEnum.CUSTOM.get_class()
    register_backend(AttentionBackendEnum.CUSTOM, "tokenspeed_jax.vllm.backend.TokenspeedMLABackend")
    try:
        assert AttentionBackendEnum.CUSTOM.is_overridden()
        assert AttentionBackendEnum.CUSTOM.get_class() is TokenspeedMLABackend

        @register_backend(AttentionBackendEnum.CUSTOM)
        class Mine(TokenspeedMLABackend):
            pass

        assert AttentionBackendEnum.CUSTOM.get_path().endswith("Mine")
    finally:
        AttentionBackendEnum.CUSTOM.clear_override()
    assert not AttentionBackendEnum.CUSTOM.is_overridden()


def test_prefill_registry_dynamic_member():
    m = register_mla_prefill_backend("VLLM_ADAPTER_TEST_PREFILL",
                                     "tokenspeed_jax.vllm.backend.TokenspeedMLAPrefillBackend")
    del m
    member = MLAPrefillBackendEnum["VLLM_ADAPTER_TEST_PREFILL"]
    assert member.get_class() is TokenspeedMLAPrefillBackend
    with pytest.raises(ValueError, match="already exists"):
        MLAPrefillBackendEnum.register("VLLM_ADAPTER_TEST_PREFILL", "x.Y")


def test_selectors_and_priorities():
    assert get_backend_priorities((9, 0)) == [AttentionBackendEnum.TOKENSPEED_MLA]
    assert get_backend_priorities(None, prefill=True) == [MLAPrefillBackendEnum.TOKENSPEED_MLA]
    assert get_attn_backend(576, "bfloat16", "auto", 64, model_config=R1) is TokenspeedMLABackend
    assert get_mla_prefill_backend("bfloat16", model_config=R1) is TokenspeedMLAPrefillBackend
    with pytest.raises(ValueError, match=r"Selected attention backend TOKENSPEED_MLA is not valid .* Reasons: "
                                         r"\['block_size 8 not supported"):
        get_attn_backend(576, "bfloat16", "auto", 8, backend="TOKENSPEED_MLA", model_config=R1)
    with pytest.raises(ValueError, match=r"No valid attention backend found. Reasons: \{'TOKENSPEED_MLA': "
                                         r"\[.dtype float32 not supported"):
        get_attn_backend(576, "float32", "auto", 64, model_config=R1)
    with pytest.raises(ValueError, match="no backend listed for this device"):
        get_attn_backend(576, "bfloat16", "auto", 64, device_capability=(8, 0), model_config=R1)


def test_forward_mha_returns_into_output_shape(rng):
    """``output`` (poisoned with NaN) only fixes shape and dtype; the prefill result is the reference."""
    b = make_batch(rng, BatchSpec((24, 40), (8, 8)), heads=8)
    cache = _with_new_tokens(b)
    poisoned = jnp.full((16, 8 * V), jnp.nan, jnp.float32)

    @jax.jit
    def run(q, kv_c, k_pe, c, md, out):
        return b.impl.forward_mha(q, kv_c, k_pe, c, md, 1.0, out)

    out = run(jnp.asarray(b.q), jnp.asarray(b.new_kv_c), jnp.asarray(b.new_k_pe), cache, b.md.mla, poisoned)
    assert out.shape == (16, 8 * V) and out.dtype == jnp.float32
    # The context chunk is gathered into exactly seq_tot rows: the requests' contexts, in order.
    (ch,) = b.md.mla.prefill.chunked_context
    rows = b.impl._gather_chunk(cache, b.md.mla.prefill.block_table, ch, None, jnp.bfloat16)
    ctx = [np.concatenate([c[: s - q], pe[: s - q]], 1) for c, pe, s, q in
           zip(b.kv_c, b.k_pe, b.spec.seq_lens, b.spec.query_lens)]
    assert rows.shape == (ch.seq_tot, L + R) == (16 + 32, L + R)
    np.testing.assert_array_equal(np.asarray(rows.astype(jnp.float32)), np.concatenate(ctx).astype(np.float32))
    ref, _ = reference(b)
    np.testing.assert_allclose(np.asarray(out, np.float64).reshape(16, 8, V), ref, rtol=1e-2, atol=1e-2)
