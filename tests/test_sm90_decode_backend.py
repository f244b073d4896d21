"""CPU checks of the sm90 decode backend, no compile: the config table (:func:`select_config` per dtype, S x H and
page size), explicit configs accepted or refused naming ``config``, the compile key's derivation, what reaches the
launch function, ``supports`` reasons and the planner's sm90 plans.  The kernel compiles themselves are in
``tests/test_compile_sm90_decode.py``."""

import dataclasses
import os

import pytest

from tokenspeed_jax import ffi
from tokenspeed_jax.planner import plan_mla_decode
from tokenspeed_jax.problems import DecodeProblem, Target


def _problem(**kw):
    base = {"batch": 3, "q_len": 2, "num_heads": 16, "head_dim": 576, "kv_lora_rank": 512, "page_size": 64,
            "num_pages": 100, "max_pages": 40, "dtype": "bfloat16", "causal": True, "return_lse": True,
            "target": Target("cuda", "sm_90a", 132)}
    base.update(kw)
    return DecodeProblem(**base)


# (dtype, S, H, page) -> (loop, producer): the whole policy, one row per cell of select_config's table (prefetch:
# every loop with the producer warpgroup but fp8_transposed, _prefetch)
TABLE = [
    ("bfloat16", 1, 16, 64, "transposed", True), ("float16", 2, 16, 32, "transposed", True),
    ("bfloat16", 1, 32, 256, "transposed", True), ("bfloat16", 1, 33, 64, "seesaw", True),
    ("bfloat16", 1, 128, 64, "seesaw", True), ("float16", 4, 32, 128, "seesaw", True),
    ("bfloat16", 1, 16, 16, "seesaw", False), ("bfloat16", 1, 128, 16, "seesaw", False),
    ("float8_e4m3fn", 1, 16, 64, "fp8_transposed", True), ("float8_e4m3fn", 2, 16, 32, "fp8_transposed", True),
    ("float8_e4m3fn", 1, 1, 256, "fp8_transposed", True), ("float8_e4m3fn", 1, 64, 64, "fp8_transposed_pv", True),
    ("float8_e4m3fn", 8, 128, 64, "fp8_transposed_pv", True), ("float8_e4m3fn", 1, 16, 16, "seesaw", False),
    ("float8_e4m3fn", 4, 32, 16, "seesaw", False),
]


def _prefetch(loop, producer):
    return producer and loop != "fp8_transposed"


@pytest.mark.parametrize("dtype,S,H,page,loop,producer", TABLE)
def test_select_config(dtype, S, H, page, loop, producer):
    from tokenspeed_jax.backends import sm90_decode as m

    p = _problem(dtype=dtype, q_len=S, num_heads=H, page_size=page)
    cfg = m.select_config(p)
    assert cfg == m.Sm90DecodeConfig(loop, producer, _prefetch(loop, producer))
    assert cfg in m.CONFIGS.values()
    # the batch-invariant walk runs the same loop without prefetch
    assert m.select_config(dataclasses.replace(p, batch_invariant=True)) == m.Sm90DecodeConfig(loop, producer)
    m.check_config(p, cfg)  # what the table selects is accepted
    assert m.plan_for_config(p, cfg).block_m == (32 if loop == "fp8_transposed" else 64)


def test_config_is_frozen_and_hashable():
    from tokenspeed_jax.backends import sm90_decode as m

    cfg = m.Sm90DecodeConfig("seesaw", producer=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.loop = "transposed"
    assert {cfg: 1}[m.Sm90DecodeConfig("seesaw", True)] == 1
    assert set(m.LOOPS) == {"seesaw", "transposed", "fp8_transposed_pv", "fp8_transposed"}


@pytest.mark.parametrize("dtype,S,H,page,cfg,match", [
    ("bfloat16", 1, 16, 64, ("fast", True), "loop"),
    ("bfloat16", 1, 16, 64, ("seesaw", 1), "producer"),
    ("bfloat16", 1, 16, 16, ("seesaw", True), "page_size >= 32"),
    ("bfloat16", 1, 16, 16, ("transposed", True), "page_size >= 32"),
    ("bfloat16", 1, 64, 64, ("transposed", True), "S x H <= 32"),
    ("bfloat16", 1, 16, 64, ("transposed", False), "producer"),
    ("float8_e4m3fn", 1, 16, 64, ("transposed", True), "16-bit"),
    ("bfloat16", 1, 16, 64, ("fp8_transposed", True), "FP8"),
    ("float8_e4m3fn", 1, 64, 64, ("fp8_transposed", True), "S x H <= 32"),
    ("float8_e4m3fn", 1, 16, 64, ("fp8_transposed_pv", True), "S x H > 32"),
    ("bfloat16", 1, 64, 64, ("fp8_transposed_pv", True), "FP8"),
    ("float8_e4m3fn", 1, 64, 64, ("seesaw", False), "16-token pages"),
    ("float8_e4m3fn", 1, 64, 64, ("seesaw", True), "16-token pages"),
    ("bfloat16", 1, 16, 64, ("transposed", True, 1), "prefetch: expected a bool"),
    ("bfloat16", 1, 128, 64, ("seesaw", False, True), "prefetch"),
    ("float8_e4m3fn", 1, 16, 64, ("fp8_transposed", True, True), "prefetch"),
])
def test_check_config_refuses(dtype, S, H, page, cfg, match):
    from tokenspeed_jax.backends import sm90_decode as m

    with pytest.raises(ValueError, match="config") as e:
        m.check_config(_problem(dtype=dtype, q_len=S, num_heads=H, page_size=page), m.Sm90DecodeConfig(*cfg))
    assert match in str(e.value)
    with pytest.raises(TypeError, match="config"):
        m.check_config(_problem(), ("seesaw", True))


@pytest.mark.parametrize("dtype,S,H,page,cfg", [
    ("bfloat16", 1, 16, 64, ("seesaw", True)),  # the 16-bit seesaw on few rows (padded 64-row blocks)
    ("bfloat16", 1, 128, 64, ("seesaw", False)),  # ... without the producer warpgroup
    ("bfloat16", 1, 16, 64, ("seesaw", False)),
    ("bfloat16", 1, 16, 64, ("transposed", True, True)),  # the prefetch experiment
    ("bfloat16", 1, 128, 64, ("seesaw", True, True)),
    ("float8_e4m3fn", 1, 64, 64, ("fp8_transposed_pv", True, True)),
])
def test_check_config_accepts(dtype, S, H, page, cfg):
    from tokenspeed_jax.backends import sm90_decode as m

    m.check_config(_problem(dtype=dtype, q_len=S, num_heads=H, page_size=page), m.Sm90DecodeConfig(*cfg))


def _record_custom_calls(monkeypatch) -> dict:
    """Replace ``tokenspeed_jax.ffi.custom_call`` by a recorder: the backend's last call leaves its ``launch``
    function, ``key`` (compile key) and ``kw`` (the launch's static arguments) in the returned dict, and the call
    returns zeros of the declared outputs (no compile)."""
    import jax.numpy as jnp

    seen = {}

    def fake_call(target, launch, *, outputs, compile_key, **kw):
        seen["launch"], seen["key"], seen["kw"], seen["outputs"] = launch, compile_key, kw, outputs
        return lambda *a: [jnp.zeros(o.shape, o.dtype) for o in outputs]

    monkeypatch.setattr("tokenspeed_jax.ffi.custom_call", fake_call)
    return seen


def _run(m, cfg=None, *, dtype="bfloat16", S=1, H=16, page=64, B=2):
    import jax.numpy as jnp

    p = _problem(batch=B, q_len=S, num_heads=H, page_size=page, num_pages=16, max_pages=8, dtype=dtype)
    bt, sl = jnp.zeros((B, 8), jnp.int32), jnp.full((B,), 100, jnp.int32)
    return p, m.decode(p, jnp.zeros((B, S, H, 576), dtype), jnp.zeros((16, page, 576), dtype), bt, sl, 0.1, 1.0,
                       config=cfg)


@pytest.mark.parametrize("dtype,S,H,page,loop,producer", TABLE[::2])
def test_decode_launches_the_config(monkeypatch, dtype, S, H, page, loop, producer):
    """``decode`` launches the one entry with the selected config and a key derived from problem, plan and config."""
    pytest.importorskip("cutlass")  # (supports() refuses without it)
    from tokenspeed_jax.backends import sm90_decode as m

    seen = _record_custom_calls(monkeypatch)
    p, (out, lse) = _run(m, dtype=dtype, S=S, H=H, page=page)
    cfg = m.Sm90DecodeConfig(loop, producer, _prefetch(loop, producer))
    plan = m.plan_for_config(p, cfg)
    # named, not imported: the kernel modules load only when CuTe DSL compiles (not on a compile-cache hit)
    assert seen["launch"] == ffi.LaunchRef("tokenspeed_jax.kernels.sm90.decode", "launch_decode")
    assert seen["key"] == m.kernel_key(p, cfg, plan) and seen["key"].config == cfg
    spec = m.schedule_spec(p, plan)
    kw = dict(seen["kw"])
    assert (kw.pop("input_specs"), kw.pop("output_specs")) == m.operand_specs(p, spec)
    assert kw.pop("dynamic_shapes") is True  # one compiled object for every B, cache size and table width
    assert kw == dict(loop=loop, producer=producer, dtype=dtype, num_heads=H, q_len=S, page_size=page, causal=True,
                      num_ctas=spec.num_ctas, max_slots=spec.max_slots, chunk=0, prefetch=cfg.prefetch)
    # out, lse and the schedule's fp32 partials, whose size is the plan's workspace (not the batch's)
    assert len(seen["outputs"]) == 4
    assert [tuple(o.shape) for o in seen["outputs"][2:]] == [w.shape for w in plan.workspace]
    assert out.shape == (2, S, H, 512) and lse.shape == (2, S, H)


def test_decode_explicit_config(monkeypatch):
    """An explicit config runs (another key than the selected one's), a bad one is refused naming ``config``."""
    pytest.importorskip("cutlass")
    from tokenspeed_jax.backends import sm90_decode as m

    seen = _record_custom_calls(monkeypatch)
    _run(m, H=16)
    key_sel = seen["key"]
    _run(m, m.Sm90DecodeConfig("seesaw", True), H=16)
    assert seen["kw"]["loop"] == "seesaw" and seen["key"] != key_sel
    assert dataclasses.replace(seen["key"], config=key_sel.config) == key_sel
    with pytest.raises(ValueError, match="config"):
        _run(m, m.Sm90DecodeConfig("fp8_transposed", True), H=16)
    _run(m, m.CONFIGS["transposed"], H=16)  # the table's choice: prefetch launched
    assert seen["kw"]["prefetch"] is True and seen["key"] == key_sel
    _run(m, m.Sm90DecodeConfig("transposed", True), H=16)  # without prefetch: its own key
    assert seen["kw"]["prefetch"] is False and seen["key"] != key_sel
    p = _problem(num_heads=16, batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant"):
        m.check_config(p, m.CONFIGS["transposed"])
    assert m.select_config(p) == m.Sm90DecodeConfig("transposed", True)  # batch-invariant: no prefetch


def test_kernel_key_fields():
    """The key is the config plus the problem's static fields and the schedule's grid and workspace (neither depends on
    the batch size): no hand-kept version string."""
    from tokenspeed_jax.backends import sm90_decode as m

    names = [f.name for f in dataclasses.fields(m.DecodeKernelKey)]
    assert names == ["config", "dtype", "num_heads", "q_len", "page_size", "causal", "num_ctas", "max_slots",
                     "chunk"]
    keys = {m.kernel_key(q, m.select_config(q), m.plan_for_config(q, m.select_config(q)))
            for q in (_problem(batch=1), _problem(batch=64), _problem(batch=255))}
    assert len(keys) == 1
    p = _problem()
    cfg = m.select_config(p)
    plan = m.plan_for_config(p, cfg)
    k = m.kernel_key(p, cfg, plan)
    assert k == m.kernel_key(dataclasses.replace(p, batch=p.batch), cfg, plan)
    assert k != m.kernel_key(dataclasses.replace(p, page_size=128), cfg, plan)
    assert k != m.kernel_key(p, m.Sm90DecodeConfig("seesaw", False), plan)


@pytest.mark.parametrize("dtype,S,H,page", [("bfloat16", 1, 16, 64), ("float8_e4m3fn", 4, 128, 16)])
def test_operand_specs_are_the_keys(dtype, S, H, page):
    """The operands' TensorSpecs (``dynamic_shapes``: extents read at run time) depend on the compile key only: the
    batch size, the cache size and the table width have hint 1, every other extent is its own hint, so one compiled
    object is valid for every B, num_pages and max_pages."""
    pytest.importorskip("cutlass")
    from tokenspeed_jax.backends import sm90_decode as m

    specs = set()
    for B, num_pages, max_pages in ((1, 16, 8), (7, 100, 3), (256, 5, 2048)):
        p = _problem(batch=B, q_len=S, num_heads=H, page_size=page, num_pages=num_pages, max_pages=max_pages,
                     dtype=dtype)
        cfg = m.select_config(p)
        spec = m.schedule_spec(p, m.plan_for_config(p, cfg))
        ins, outs = m.operand_specs(p, spec)
        specs.add((m.kernel_key(p, cfg, m.plan_for_config(p, cfg)), ins, outs))
        G, slots, R = spec.num_ctas, spec.max_slots, S * H
        assert [t.divisibility for t in ins] == [(1, S, H, 576), (1, page, 576), (1, 1), (1,), (1,), (1,), (G, 8),
                                                 (1, 2)]
        assert [t.divisibility for t in outs] == [(1, S, H, 512), (1, S, H), (slots, R, 512), (slots, R)]
        assert all(t.static is None and t.layout is None and t.mode is None for t in ins + outs)
    assert len(specs) == 1


@pytest.mark.parametrize("dtype,S,H,page", [("bfloat16", 1, 16, 64), ("float8_e4m3fn", 4, 128, 16)])
def test_batch_invariant_key_and_workspace(monkeypatch, dtype, S, H, page):
    """``batch_invariant``: the key carries the chunk (one compile for every batch size, table width and cache size,
    another than the default mode's), the chunk depends on the dtype and S x H only, the fp32 workspace has
    ``B * ceil(capacity / chunk)`` slots (hint 1: a runtime extent), the schedule its chunk."""
    pytest.importorskip("cutlass")
    import jax.numpy as jnp

    from tokenspeed_jax.backends import sm90_decode as m

    seen = _record_custom_calls(monkeypatch)
    keys, chunks = set(), set()
    for B, num_pages, max_pages in ((1, 16, 8), (7, 100, 300), (256, 5, 2048)):
        p = _problem(batch=B, q_len=S, num_heads=H, page_size=page, num_pages=num_pages, max_pages=max_pages,
                     dtype=dtype, batch_invariant=True)
        cfg = m.select_config(p)
        plan = m.plan_for_config(p, cfg)
        spec = m.schedule_spec(p, plan)
        chunk = m.invariant_chunk(p)
        assert spec.chunk == chunk and chunk % 128 == 0 and chunk >= 2048
        key = m.kernel_key(p, cfg, plan)
        assert key.chunk == chunk and key.max_slots == 1
        assert key != m.kernel_key(dataclasses.replace(p, batch_invariant=False), cfg, plan)
        keys.add(key)
        chunks.add(chunk)
        _, outs = m.operand_specs(p, spec)
        assert [t.divisibility for t in outs][2:] == [(1, S * H, 512), (1, S * H)]
        cap = max_pages * page
        slots = B * -(-cap // chunk) if cap > chunk else 1
        assert spec.slots(B) == slots
        m.decode(p, jnp.zeros((B, S, H, 576), dtype), jnp.zeros((num_pages, page, 576), dtype),
                 jnp.zeros((B, max_pages), jnp.int32), jnp.full((B,), 100, jnp.int32), 0.1, 1.0)
        assert seen["key"] == key and seen["kw"]["chunk"] == chunk
        assert [tuple(o.shape) for o in seen["outputs"][2:]] == [(slots, S * H, 512), (slots, S * H)]
    assert len(keys) == 1 and len(chunks) == 1


def test_invariant_chunk_rule():
    """The chunk: a power of two >= 2048 from the dtype and S x H (never the batch, lengths or table), the larger the
    more a piece's partial costs against its KV bytes (FP8, more rows)."""
    from tokenspeed_jax.backends import sm90_decode as m

    def chunk(dtype, H, S, **kw):
        return m.invariant_chunk(_problem(dtype=dtype, num_heads=H, q_len=S, batch_invariant=True, **kw))

    assert chunk("bfloat16", 16, 1) == chunk("bfloat16", 32, 1) == chunk("float8_e4m3fn", 16, 1) == 4096
    assert chunk("bfloat16", 128, 1) == chunk("bfloat16", 32, 4) == chunk("float8_e4m3fn", 32, 1) == 8192
    assert chunk("float8_e4m3fn", 128, 4) == 8192
    assert chunk("bfloat16", 16, 1, batch=1) == chunk("bfloat16", 16, 1, batch=500, max_pages=4000, page_size=16)


def test_no_environment_switch(monkeypatch):
    """No variable of the removed decode switches' prefix is read: setting one changes neither config nor key, and
    no module of the package names the prefix."""
    pytest.importorskip("cutlass")
    from tokenspeed_jax.backends import sm90_decode as m

    seen = _record_custom_calls(monkeypatch)
    _run(m, dtype="float8_e4m3fn", H=16)
    before = (seen["key"], seen["kw"])
    prefix = "_".join(("TOKENSPEED", "SM90", "DECODE", ""))  # (the removed switches' prefix)
    for name in ("FP8_PV", "T16", "SCHEDULE", "PRODUCER16", "OT32_LOOP", "PAD_ROWS"):
        monkeypatch.setenv(prefix + name, "0")
    _run(m, dtype="float8_e4m3fn", H=16)
    assert (seen["key"], seen["kw"]) == before
    assert not getattr(m, "TRACE_ENV", ())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for dirpath, _, files in os.walk(os.path.join(root, "tokenspeed_jax")):
        for f in files:
            if f.endswith(".py"):
                assert prefix not in open(os.path.join(dirpath, f)).read(), f


def test_sm90_plan_block_m():
    """``block_m`` 32 (the O^T loop with the transposed QK): ``ceil(rows / 32)`` row tiles; other values and other
    families refused, naming the argument."""
    p = plan_mla_decode(batch=3, q_len=3, num_heads=32, max_kv_len=4096, page_size=64, block_m=32, num_sms=132)
    assert p.block_m == 32 and p.num_m_blocks == 3 and p.grid[0] == 3
    assert plan_mla_decode(batch=3, q_len=3, num_heads=32, max_kv_len=4096, page_size=64, num_sms=132).num_m_blocks == 2
    with pytest.raises(ValueError, match="block_m"):
        plan_mla_decode(batch=3, q_len=1, num_heads=16, max_kv_len=4096, page_size=64, block_m=16)
    with pytest.raises(ValueError, match="block_m"):
        plan_mla_decode(batch=3, q_len=1, num_heads=16, max_kv_len=4096, page_size=64, block_m=32, arch="sm_100a")


def test_supports_reasons():
    from tokenspeed_jax.backends import sm90_decode as m

    assert m.supports(_problem()) is None
    assert m.supports(_problem(dtype="float16")) is None
    assert "sm_90" in m.supports(_problem(target=Target("cpu")))
    assert "sm_90" in m.supports(_problem(target=Target("cuda", "sm_100a", 148)))
    assert m.supports(_problem(dtype="float8_e4m3fn")) is None
    assert "float32" in m.supports(_problem(dtype="float32"))
    assert "kv_lora_rank" in m.supports(_problem(kv_lora_rank=448, head_dim=512))
    assert "page_size >= 16" in m.supports(_problem(page_size=8))
    assert m.supports(_problem(page_size=16)) is None


@pytest.mark.parametrize("B,S,H,K", [(64, 1, 16, 81920), (64, 8, 128, 81920), (1, 1, 16, 81920), (3, 2, 16, 2560),
                                     (128, 1, 128, 4096), (1, 16, 1, 64), (7, 3, 96, 100000)])
def test_sm90_plan(B, S, H, K):
    p = plan_mla_decode(batch=B, q_len=S, num_heads=H, max_kv_len=K, page_size=64, arch="sm_90a", num_sms=132)
    R = S * H
    assert p.rows == R and p.num_m_blocks == -(-R // 64) and p.block_m == 64 and p.block_n == 64
    assert p.tokens_per_split % 64 == 0
    assert (p.num_splits - 1) * p.tokens_per_split < K <= p.num_splits * p.tokens_per_split
    G = 132 // p.num_m_blocks
    assert p.grid == (p.num_m_blocks, G, 1)
    shapes = {w.name: w.shape for w in p.workspace}
    assert shapes == {"o_accum": (2 * (G - 1), R, 512), "lse_accum": (2 * (G - 1), R)}
    ctas = B * p.num_m_blocks * p.num_splits
    if B * p.num_m_blocks < 132 and K >= 64 * 4:
        # fills (most of) a wave, unless limited by at least two 64-token blocks per split
        assert ctas >= 100 or p.num_splits == -(-K // 64) // 2
