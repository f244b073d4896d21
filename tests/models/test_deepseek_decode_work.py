"""The DeepSeek model computes its decode work (the sm90 split-KV schedule, :func:`tokenspeed_jax.mla_decode_work`)
once per decode step, outside the layer scans, and every layer's ``mla_decode`` uses it: checked in the StableHLO of
the engine's jitted steps lowered for CUDA sm_90a on this CPU (``tests/hlo.py``: one schedule computation, at
while-depth 0 for a step, 1 inside the decode loop; a schedule computed per layer sits in the scan bodies).

The sm90 custom call is replaced by a plain FFI call of the same name (no CuTe DSL compile); the tiny preset with 3
layers (1 dense + 2 MoE, two scans) and its MTP layer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import tokenspeed_jax as tj
from tests.hlo import schedule_sites
from tokenspeed_jax.models.deepseek import DeepseekV3, DeepseekV3Config
from tokenspeed_jax.models.deepseek import steps as E
from tokenspeed_jax.models.deepseek.attention import AttentionBatch
from tokenspeed_jax.models.deepseek.cache import KVCache
from tokenspeed_jax.runtime import target_override

PAGE, MAX_PAGES = 64, 3


@pytest.fixture(scope="module")
def tiny():
    cfg = dataclasses.replace(DeepseekV3Config.preset("tiny"), num_hidden_layers=3)
    model = DeepseekV3.random(cfg, dtype=jnp.bfloat16)
    return cfg, model


@pytest.fixture
def lowering_kernel(monkeypatch):
    pytest.importorskip("cutlass")  # (the sm90 backend's supports() needs it)

    def fake_call(target, launch, *, outputs, compile_key, **kw):
        return lambda *a: jax.ffi.ffi_call("tokenspeed_" + target, list(outputs))(*a)

    monkeypatch.setattr("tokenspeed_jax.ffi.custom_call", fake_call)


def _num_ctas(cfg, B, S, dtype="bfloat16"):
    from tokenspeed_jax.backends import sm90_decode
    from tokenspeed_jax.problems import DecodeProblem, Target

    p = DecodeProblem(batch=B, q_len=S, num_heads=cfg.num_attention_heads, head_dim=576, kv_lora_rank=512,
                      page_size=PAGE, num_pages=1, max_pages=MAX_PAGES, dtype=dtype, causal=True, return_lse=False,
                      target=Target("cuda", "sm_90a", 132))
    return sm90_decode.work_key(p)[1].num_ctas


def _lower(fn, *args, **kw):
    with target_override("sm_90a"):
        lo = fn.trace(*args, **kw).lower(lowering_platforms=("cuda",))
    assert "custom_call @tokenspeed_mla_decode_sm90" in lo.as_text()
    return lo


def _decode_step(model, cfg, B, S, kv_dtype=jnp.bfloat16):
    graphdef, state = nnx.split(model)
    cache = KVCache.create(cfg, num_pages=8, page_size=PAGE, dtype=kv_dtype)
    z = jnp.zeros((B, S), jnp.int32)
    return _lower(E._decode_step, graphdef, state, cache, z, z, jnp.zeros((B, MAX_PAGES), jnp.int32),
                  backend="auto", page_size=PAGE)


@pytest.mark.parametrize("S,kv_dtype", [(1, jnp.bfloat16), (3, jnp.bfloat16), (1, jnp.float8_e4m3fn)])
def test_decode_step_computes_the_schedule_once_outside_the_layer_scans(tiny, lowering_kernel, S, kv_dtype):
    cfg, model = tiny
    dt = jnp.dtype(kv_dtype).name
    assert schedule_sites(_decode_step(model, cfg, 2, S, kv_dtype), _num_ctas(cfg, 2, S, dt)) == [0]


def test_per_layer_schedule_is_detected(tiny, lowering_kernel, monkeypatch):
    """The check can fail: a model whose forward does not compute the work holds one schedule per scan body."""
    import tokenspeed_jax.models.deepseek.model as M

    cfg, model = tiny
    monkeypatch.setattr(M, "decode_work", lambda config, batch, kv: batch)
    assert schedule_sites(_decode_step(model, cfg, 5, 1), _num_ctas(cfg, 5, 1)) == [1, 1]


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_decode_loop_schedules(tiny, lowering_kernel, k):
    """Inside the decode loop (one while): a plain step computes one schedule; a speculative round one for the
    verification and the MTP layer over the same k+1 positions, plus one per further chained draft (k - 1), all
    outside the layer scans."""
    cfg, model = tiny
    graphdef, state = nnx.split(model)
    B = 2
    cache = KVCache.create(cfg, num_pages=8, page_size=PAGE, dtype=jnp.bfloat16)
    st = E.init_slot_state(B, MAX_PAGES, 16, k=k, vocab=cfg.vocab_size, params=E.GREEDY)
    lo = _lower(E._decode_loop, graphdef, state, cache, st, jnp.zeros((1,), jnp.int32), jnp.int32(8), jnp.int32(1),
                backend="auto", page_size=PAGE, k=k, params=E.GREEDY)
    G = _num_ctas(cfg, B, k + 1)
    assert G == _num_ctas(cfg, B, 1)  # (one grid for both query lengths here: the marker finds both)
    assert schedule_sites(lo, G) == [1] * max(k, 1)


def test_with_decode_work(tiny):
    """``with_decode_work``: a decode batch gets the work of its layers' calls (empty on the xla backend), a
    prefill batch or one that has its work is left alone."""
    cfg, model = tiny
    cache = KVCache.create(cfg, num_pages=8, page_size=PAGE, dtype=jnp.bfloat16)
    pos = jnp.asarray([[5], [9]], jnp.int32)
    batch = E._decode_batch(jnp.zeros((2, MAX_PAGES), jnp.int32), pos, PAGE, "xla")
    b = model.with_decode_work(batch, cache)
    assert b.work == tj.DecodeWork((), "xla") and batch.work is None
    assert model.with_decode_work(b, cache).work is b.work
    pre = AttentionBatch(positions=pos.reshape(-1), mode="prefill")
    assert model.with_decode_work(pre, cache).work is None


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (virtual) devices")
@pytest.mark.parametrize("mesh_spec", ["tensor=2", "data=2,tensor=2"])
def test_decode_step_on_a_mesh(lowering_kernel, mesh_spec):
    """On a mesh the work is each shard's (``sharded_mla_decode_work``), computed once before the scans and passed
    to every layer's ``sharded_mla_decode``."""
    from tokenspeed_jax.models.deepseek.parallel import make_mesh

    cfg = dataclasses.replace(DeepseekV3Config.preset("tiny"), num_hidden_layers=3, num_attention_heads=4,
                              num_key_value_heads=4)
    mesh = make_mesh(mesh_spec)
    model = DeepseekV3.random(cfg, dtype=jnp.bfloat16, mesh=mesh)
    graphdef, state = nnx.split(model)
    cache = KVCache.create(cfg, num_pages=8, page_size=PAGE, dtype=jnp.bfloat16, mesh=mesh)
    z = jnp.zeros((4, 1), jnp.int32)
    lo = _lower(E._decode_step, graphdef, state, cache, z, z, jnp.zeros((4, MAX_PAGES), jnp.int32), backend="auto",
                page_size=PAGE)
    assert schedule_sites(lo, _num_ctas(cfg, 4, 1)) == [0]
