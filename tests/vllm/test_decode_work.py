"""The vLLM adapter's decode work: the metadata builder computes it once per step
(``MLACommonDecodeMetadata.work``, :func:`tokenspeed_jax.mla_decode_work`) and every layer's ``forward_mqa`` passes
it to ``mla_decode``.

* xla: the work is empty and the layer outputs are bitwise the ones without it.
* sm90 (metadata built and a two-layer forward lowered for ``sm_90a`` on this CPU, the custom call replaced by a
  plain FFI call): the work is ``sm90_decode.schedule_of`` of the decode lengths; the forward holds no schedule of
  its own, while without the work it computes one per layer (the check can fail).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokenspeed_jax as tj
from tests.hlo import schedule_sites
from tests.vllm.utils import BATCH_SPECS, BLOCK, L, Layer, P, R, V, make_batch, spec_tokens
from tokenspeed_jax.problems import DecodeProblem, Target
from tokenspeed_jax.runtime import target_override
from tokenspeed_jax.vllm import MLAModelConfig, TokenspeedMLAMetadataBuilder, build_attention_metadata, mla_attention


def _metadata(b, name, *, model_config=None, **kw):
    """The runner metadata of batch ``b`` (spec ``name``) from a builder with these arguments."""
    spec = b.spec
    pos = np.concatenate([np.arange(s - q, s) for s, q in zip(spec.seq_lens, spec.query_lens)])
    builder = TokenspeedMLAMetadataBuilder(block_size=BLOCK, num_speculative_tokens=spec_tokens(name),
                                           head_dim=L + R, model_config=model_config, **kw)
    return build_attention_metadata(pos, spec.query_lens, spec.seq_lens, b.block_table, builder=builder)


def _config(heads, name):
    return MLAModelConfig(num_attention_heads=heads, kv_lora_rank=L, qk_rope_head_dim=R, qk_nope_head_dim=P,
                          v_head_dim=V, num_speculative_tokens=spec_tokens(name))


@pytest.mark.parametrize("name", ["small_decode", "spec_decode_small", "mixed_small"])
def test_xla_work_from_the_builder_is_bitwise_neutral(rng, name):
    b = make_batch(rng, BATCH_SPECS[name], heads=4, num_speculative_tokens=spec_tokens(name))
    md = _metadata(b, name, model_config=_config(4, name), tokenspeed_backend="xla")
    assert md.mla.decode.work == tj.DecodeWork((), "xla")
    assert b.md.mla.decode.work is None  # (a builder without the model's MLA facts)
    q, kv_c, k_pe = jnp.asarray(b.q), jnp.asarray(b.new_kv_c), jnp.asarray(b.new_k_pe)
    f = jax.jit(lambda md: mla_attention(q, kv_c, k_pe, b.kv_cache, md, impl=b.impl, layer=Layer()))
    got, want = f(md), f(b.md)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_builder_reads_the_current_config_and_checks_it(rng):
    from tokenspeed_jax.vllm import set_current_mla_config

    b = make_batch(rng, BATCH_SPECS["small_decode"], heads=4)
    with set_current_mla_config(_config(4, "small_decode")):
        md = _metadata(b, "small_decode")
    assert md.mla.decode.work == tj.DecodeWork((), "xla")
    with pytest.raises(TypeError, match=r"^model_config: expected an MLAModelConfig or None, got dict"):
        TokenspeedMLAMetadataBuilder(block_size=BLOCK, model_config={})
    with pytest.raises(ValueError, match=r"^tokenspeed_backend: unknown tokenspeed backend 'nope'"):
        _metadata(b, "small_decode", model_config=_config(4, "small_decode"), tokenspeed_backend="nope")


@pytest.fixture
def lowering_kernel(monkeypatch):
    pytest.importorskip("cutlass")

    def fake_call(target, launch, *, outputs, compile_key, **kw):
        return lambda *a: jax.ffi.ffi_call("tokenspeed_" + target, list(outputs))(*a)

    monkeypatch.setattr("tokenspeed_jax.ffi.custom_call", fake_call)


@pytest.mark.parametrize("name", ["medium_decode", "spec_decode_small"])
def test_sm90_work_built_once_and_used_by_every_layer(rng, lowering_kernel, name):
    from tokenspeed_jax.backends import sm90_decode

    heads = 16
    b = make_batch(rng, BATCH_SPECS[name], heads=heads, num_speculative_tokens=spec_tokens(name),
                   tokenspeed_backend="auto")
    with target_override("sm_90a"):
        md = _metadata(b, name, model_config=_config(heads, name))
        md_plain = _metadata(b, name)
    dec = md.mla.decode
    p = DecodeProblem(batch=dec.num_decodes, q_len=dec.query_len, num_heads=heads, head_dim=L + R, kv_lora_rank=L,
                      page_size=BLOCK, num_pages=b.kv_cache.shape[0], max_pages=dec.block_table.shape[1],
                      dtype="bfloat16", causal=True, return_lse=False, target=Target("cuda", "sm_90a", 132))
    assert dec.work.backend == "sm90" and dec.work.key == sm90_decode.work_key(p)
    for got, want in zip(dec.work.arrays, sm90_decode.schedule_of(p, dec.seq_lens)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    q, kv_c, k_pe = jnp.asarray(b.q), jnp.asarray(b.new_kv_c), jnp.asarray(b.new_k_pe)

    def two_layers(md):
        kv, outs = b.kv_cache, []
        for _ in range(2):
            kv, o = mla_attention(q, kv_c, k_pe, kv, md, impl=b.impl, layer=Layer())
            outs.append(o)
        return outs

    G = dec.work.key[1].num_ctas
    with target_override("sm_90a"):
        lowered = [jax.jit(two_layers).trace(m).lower(lowering_platforms=("cuda",)) for m in (md, md_plain)]
    assert all(lo.as_text().count("custom_call @tokenspeed_mla_decode_sm90") == 2 for lo in lowered)
    assert schedule_sites(lowered[0], G) == []  # computed by the builder, outside the forward
    assert schedule_sites(lowered[1], G) == [0, 0]  # no work: each layer computes its own
