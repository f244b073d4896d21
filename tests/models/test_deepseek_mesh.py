"""The model on a device mesh (8 virtual CPU devices, tests/conftest.py): the sharded model's logits and
greedy generations (plain and MTP) equal the unsharded ones on meshes tensor x expert = 8 x 1, 2 x 4,
1 x 8, DP attention (data = 8) and data x tensor x expert = 2 x 2 x 2; with DP attention the engine's
prefill / decode logits of requests on different data ranks, continuous batching over per-rank slots and
pages, and the plan's per-rank cache; parameters and cache carry their NamedSharding; the loader places
each device's shard.

Tolerances (sharded vs unsharded, same weights): float32 logits within 1e-5 of the largest logit (the
all-reduces sum in another order; measured <= 1e-6 for model.logits, 1.2e-6 for the DP attention
engine's prefill / decode logits), bfloat16 within 3e-2 (one bf16 rounding of the partial sums per
layer); greedy tokens equal (float32)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tokenspeed_jax.models.deepseek import DeepseekV3, DeepseekV3Config, Engine
from tokenspeed_jax.models.deepseek.parallel import make_mesh, parse_mesh

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (virtual) devices")

# tiny with enough heads (8) and experts (16) to split 8 ways
CFG = DeepseekV3Config.preset("tiny").replace(
    num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, n_group=4, topk_group=2,
    num_experts_per_tok=4,
)
PROMPTS = [[1, 2, 3, 9, 10], [4, 5], [7, 8, 9, 10, 11, 12, 13]]
NEW = 4
IDS = np.random.default_rng(0).integers(0, CFG.vocab_size, 12)
TOL = {"float32": 1e-5, "bfloat16": 3e-2}


@pytest.fixture(scope="module")
def reference():
    m = unsharded_model()
    plain = Engine(m, backend="xla").generate(PROMPTS, NEW).tokens
    mtp = Engine(m, backend="xla").generate(PROMPTS, NEW, num_speculative_tokens=1).tokens
    assert plain == mtp
    return np.asarray(m.logits(IDS)), plain


def close(got, want, dtype):
    tol = TOL[jnp.dtype(dtype).name]
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=tol * np.abs(want).max())


MESHES = ["tensor=8", "tensor=2,expert=4", "expert=8", "data=8", "data=2,tensor=2,expert=2"]


@functools.lru_cache(maxsize=None)
def sharded_model(spec):
    return DeepseekV3.random(CFG, std=0.1, seed=1, mesh=make_mesh(spec))


@functools.lru_cache(maxsize=None)
def unsharded_model():
    return DeepseekV3.random(CFG, std=0.1, seed=1)


@pytest.mark.parametrize("spec", MESHES)
def test_sharded_logits_and_greedy(reference, spec):
    want, greedy = reference
    m = sharded_model(spec)
    mesh = m.mesh
    t, d = parse_mesh(spec)["tensor"], parse_mesh(spec)["data"]
    attn = m.moe_layers.self_attn
    assert attn.q_b_proj.kernel.sharding.spec == P(None, None, "tensor" if t > 1 else None)
    assert attn.o_proj.kernel.sharding.spec == P(None, "tensor" if t > 1 else None, None)
    experts = m.moe_layers.mlp.experts.gate_proj
    assert experts.sharding.spec == P(None, ("data", "tensor", "expert"), None, None)
    assert experts.addressable_shards[0].data.shape[1] == CFG.n_routed_experts // 8
    close(m.logits(IDS), want, jnp.float32)
    eng = Engine(m, backend="xla", cache_fill=float("nan"))
    assert eng.generate(PROMPTS, NEW).tokens == greedy
    assert eng.cache.kv.sharding.is_equivalent_to(
        NamedSharding(mesh, P("data" if d > 1 else None)), eng.cache.kv.ndim
    )


@pytest.mark.parametrize("spec", MESHES)
def test_sharded_mtp_greedy(reference, spec):
    _, greedy = reference
    eng = Engine(sharded_model(spec), backend="xla", cache_fill=float("nan"))
    out = eng.generate(PROMPTS, NEW, num_speculative_tokens=1)
    assert out.tokens == greedy and out.draft_tokens > 0


# DP attention: 4 requests of different lengths over 1..3 pages of 16 tokens, 2 per data rank (request b
# on rank b // 2)
SEQ = np.random.default_rng(4).integers(0, CFG.vocab_size, (4, 40))
LENS = [21, 35, 6, 17]


def teacher_forced(m, **kw):
    """Engine.reset / prefill / decode (one S = 2 step, the MTP verification shape) -> float32 logits."""
    eng = Engine(m, backend="xla", cache_fill=float("nan"), **kw)
    eng.reset([SEQ.shape[1]] * len(LENS))
    last, _, _ = eng.prefill([SEQ[b, :n].tolist() for b, n in enumerate(LENS)])
    pos = np.asarray(LENS)[:, None] + np.arange(2)
    dec = eng.decode(SEQ[np.arange(len(LENS))[:, None], pos], pos)
    return eng, np.asarray(last), np.asarray(dec)


def test_dp_attention_engine(reference):
    """data x tensor x expert = 2 x 2 x 2: prefill (per-rank slabs) and decode (page-sharded cache,
    shard-local block tables) logits of requests on both data ranks equal the unsharded engine's; each rank
    holds only its requests' pages; continuous batching over one slot per rank gives the unsharded greedy
    tokens; the plan's KV cache per device is the engine's (pages per data rank, bytes device 0 holds)."""
    _, greedy = reference
    m = sharded_model("data=2,tensor=2,expert=2")
    _, want_last, want_dec = teacher_forced(unsharded_model())
    eng, last, dec = teacher_forced(m, shuffle_pages=True, seed=7)
    close(last, want_last, jnp.float32)
    close(dec, want_dec, jnp.float32)
    al = eng.allocator
    assert [al.rank(b) for b in range(4)] == [0, 0, 1, 1]
    assert eng.cache.num_pages == 2 * al.local_pages
    bt = np.asarray(eng.block_table)
    assert bt.max() < al.local_pages  # shard-local page ids
    for d in range(2):  # rank d's requests own distinct pages of rank d's share of the cache
        used = [p for b in (2 * d, 2 * d + 1) for p in al.shards[d].pages[b]]
        assert len(set(used)) == len(used) == 2 * 3

    eng = Engine(m, backend="xla", cache_fill=float("nan"), max_slots=2, shuffle_pages=True, seed=8)
    out = eng.generate(PROMPTS, NEW)
    assert out.tokens == greedy and out.decode_calls >= 2  # the third request waited for a free slot

    from tokenspeed_jax.models.deepseek.cli import bytes_per_device
    from tokenspeed_jax.models.deepseek.plan import plan

    p = plan(CFG, dict(m.mesh.shape), batch=2, context=max(map(len, PROMPTS)) + NEW,
             num_speculative_tokens=0, dtype=jnp.float32, page_size=eng.page_size)
    assert p.num_pages == eng.allocator.local_pages
    assert p.kv_cache_bytes == bytes_per_device(m, eng.cache)["kv_cache"] > 0


def test_dp_page_allocator_and_errors():
    """ShardedPages: one allocator per data rank, shard-local ids, a request stays on its rank; the engine
    refuses slot / page counts that do not split over the data ranks, naming the argument."""
    from tokenspeed_jax.models.deepseek.parallel import ShardedPages

    al = ShardedPages(4, 16, 2)
    assert al.num_pages == 8 and al.allocate(0, 40, 1) == [0, 1, 2] and al.allocate(1, 16, 0) == [0]
    assert al.allocate(0, 48) == [0, 1, 2] and al.free_pages(1) == 1 and al.free_pages(0) == 3
    np.testing.assert_array_equal(al.slots(0, [0, 17, 40]), [0, 17, 40])
    np.testing.assert_array_equal(al.block_table([1, None, 0], 4), [[0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 2, 0]])
    with pytest.raises(ValueError, match=r"^rank: request 2 is new, expected its data rank in \[0, 2\)"):
        al.allocate(2, 8)
    with pytest.raises(ValueError, match=r"^rank: request 0 lives on data rank 1, got 0"):
        al.allocate(0, 64, 0)
    with pytest.raises(ValueError, match=r"^num_tokens: request 3 needs 2 more pages of 16 tokens, only 1"):
        al.allocate(3, 32, 1)
    al.free(0)
    assert al.free_pages(1) == 4 and sorted(al.allocate(3, 64, 1)) == [0, 1, 2, 3]
    m = sharded_model("data=2,tensor=2,expert=2")
    with pytest.raises(ValueError, match=r"^max_slots: DP attention \(mesh data = 2\).*multiple of 2, got 3"):
        Engine(m, max_slots=3)
    with pytest.raises(ValueError, match=r"^num_pages: expected a positive multiple of the mesh's data axis"):
        Engine(m, num_pages=7)
    with pytest.raises(ValueError, match=r"^num_pages: a request needs 2 pages of 16 tokens, the cache has 1 per"):
        Engine(m, num_pages=2, backend="xla").generate([[1] * 20], 2)
    with pytest.raises(ValueError, match=r"^lengths: DP attention \(mesh data = 2\).*multiple of 2.*got 3"):
        Engine(m).reset([8, 8, 8])


def test_bf16_and_fp8_weights_on_a_mesh():
    """bf16 within its tolerance; FP8 block weights (e4m3 + scales, split like their kernels) too."""
    mesh = make_mesh("tensor=2,expert=4")
    qc = DeepseekV3Config.preset("deepseek-r1").quantization_config
    for cfg in (CFG, CFG.replace(quantization_config=qc)):
        ref = DeepseekV3.random(cfg, dtype=jnp.bfloat16, std=0.1, seed=2)
        got = DeepseekV3.random(cfg, dtype=jnp.bfloat16, std=0.1, seed=2, mesh=mesh)
        close(got.logits(IDS), np.asarray(ref.logits(IDS), np.float32), jnp.bfloat16)
    assert got.moe_layers.self_attn.kv_b_proj.kernel.dtype == jnp.float8_e4m3fn
    assert got.moe_layers.self_attn.kv_b_proj.kernel_scale_inv.sharding.spec == P(None, None, "tensor")


def test_loader_places_each_shard(tmp_path):
    """load_checkpoint(mesh=) of an FP8 checkpoint: every parameter has its NamedSharding, each device holds
    only its shard, logits equal the unsharded load."""
    from tokenspeed_jax.models.deepseek import load_checkpoint, save_checkpoint

    save_checkpoint(DeepseekV3.random(CFG, std=0.1, seed=3), tmp_path, fp8=True, num_shards=2)
    ref = load_checkpoint(tmp_path, dtype=jnp.float32, progress=False)
    mesh = make_mesh("data=2,tensor=2,expert=2")
    m = load_checkpoint(tmp_path, dtype=jnp.float32, progress=False, mesh=mesh)
    assert m.mesh is mesh and m.config.quantization_config is not None
    kv_b = m.moe_layers.self_attn.kv_b_proj.kernel
    assert kv_b.dtype == jnp.float8_e4m3fn
    assert kv_b.addressable_shards[0].data.shape == (1, 512, CFG.num_attention_heads * 256 // 2)
    np.testing.assert_array_equal(
        np.asarray(kv_b, np.float32), np.asarray(ref.moe_layers.self_attn.kv_b_proj.kernel, np.float32)
    )
    close(m.logits(IDS), np.asarray(ref.logits(IDS)), jnp.float32)
    # the plan's weight bytes per device are the bytes device 0 actually holds
    from flax import nnx
    from tokenspeed_jax.models.deepseek.plan import plan

    dev = jax.devices()[0]
    held = sum(
        s.data.nbytes
        for _, v in nnx.to_flat_state(nnx.state(m, nnx.Param))
        for s in v.get_value().addressable_shards
        if s.device == dev
    )
    p = plan(m.config, dict(mesh.shape), batch=2, context=32, dtype=jnp.float32)
    assert p.weight_bytes == held


def test_mesh_spec_errors():
    assert parse_mesh("data=1,tensor=2,expert=4") == {"data": 1, "tensor": 2, "expert": 4}
    assert parse_mesh("expert=8") == {"data": 1, "tensor": 1, "expert": 8}
    with pytest.raises(ValueError, match=r"^mesh: expected axes among .*got 'model'"):
        parse_mesh("model=2")
    with pytest.raises(ValueError, match=r"^mesh: expected a positive size for 'tensor', got 0"):
        parse_mesh("tensor=0")
    with pytest.raises(ValueError, match=r"needs 16 devices, 8 are available"):
        make_mesh("data=2,expert=8")
    with pytest.raises(ValueError, match=r"^mesh: axis 'data' given twice in 'data=2,data=4'"):
        parse_mesh("data=2,data=4")


def test_mesh_the_model_cannot_run_on_is_refused(tmp_path):
    """tensor must divide the heads, data x tensor x expert the routed experts: refused when the model is
    placed (random, load_checkpoint), planned, or sharded, before anything is built or read."""
    from tokenspeed_jax.models.deepseek import load_checkpoint
    from tokenspeed_jax.models.deepseek.parallel import shard_model
    from tokenspeed_jax.models.deepseek.plan import plan

    heads = r"^mesh: tensor = 3 must divide num_attention_heads = 8"
    experts = r"^mesh: data x tensor x expert = 6 devices must divide n_routed_experts = 16"
    with pytest.raises(ValueError, match=heads):
        plan(CFG, {"tensor": 3}, batch=1, context=8)
    with pytest.raises(ValueError, match=experts):
        plan(CFG, {"data": 3, "tensor": 2}, batch=1, context=8)
    with pytest.raises(ValueError, match=heads):
        DeepseekV3.random(CFG, mesh=make_mesh("tensor=3"))
    with pytest.raises(ValueError, match=experts):
        shard_model(unsharded_model(), make_mesh("data=2,expert=3"))
    (tmp_path / "config.json").write_text(__import__("json").dumps(CFG.to_dict()))
    with pytest.raises(ValueError, match=experts):  # before the (absent) weights are looked at
        load_checkpoint(tmp_path, mesh=make_mesh("tensor=2,expert=3"))
