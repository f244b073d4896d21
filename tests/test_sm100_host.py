"""CPU tests of everything host-side in the ``sm100`` backend (no CuTe DSL compile, no GPU).

* plan tables (fold / packing / split count / workspace bytes) for the shapes of TokenSpeed's own tests
  (tokenspeed-mla ``tests/test_mla_decode.py``), and, when tokenspeed_mla is installed, against its own
  planning functions over a grid of shapes;
* argument mapping: the kernel configuration built from a problem and the TokenSpeed kernel object it
  constructs;
* XLA-side pre/post-processing: block-table clamping / widening / remapping, base-2 -> natural LSE,
  empty-row fix-up, prefill rows with keys;
* every capability reason, and ``backend="auto"`` preferring sm100 on Blackwell only.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenspeed_jax import plan_mla_decode
from tokenspeed_jax.backends import available_backends, backend_reasons, get_backend
from tokenspeed_jax.backends import sm100 as B
from tokenspeed_jax.kernels.sm100 import plan as P
from tokenspeed_jax.problems import DecodeProblem, PrefillProblem, Target

HAS_TS = importlib.util.find_spec("tokenspeed_mla") is not None
SM100 = Target("cuda", "sm_100a", 148)
SM103 = Target("cuda", "sm_103a", 148)


def decode_problem(**kw) -> DecodeProblem:
    base = {"batch": 2, "q_len": 1, "num_heads": 128, "head_dim": 576, "kv_lora_rank": 512, "page_size": 64,
            "num_pages": 64, "max_pages": 16, "dtype": "bfloat16", "causal": True, "return_lse": False,
            "target": SM100}
    base.update(kw)
    return DecodeProblem(**base)


def prefill_problem(**kw) -> PrefillProblem:
    base = {"batch": 2, "num_q_tokens": 64, "num_k_tokens": 96, "num_q_heads": 16, "num_kv_heads": 16,
            "head_dim_qk": 192, "head_dim_v": 128, "dtype": "bfloat16", "causal": True, "return_lse": True,
            "max_seqlen_q": None, "max_seqlen_k": None, "target": SM100}
    base.update(kw)
    return PrefillProblem(**base)


def plan(B_, S, H, K, dtype="bfloat16", arch="sm_100a", sms=148):
    return plan_mla_decode(batch=B_, q_len=S, num_heads=H, max_kv_len=K, page_size=64, dtype=dtype,
                           arch=arch, num_sms=sms)


# ------------------------------------------------------------------------------------ plan tables
# (B, S, H, K, dtype, arch) -> (m_tile, packing, fold, S_eff, splits) from TokenSpeed's tests.
TOKENSPEED_TABLE = [
    # test_fp8_workspace_counts_only_nonempty_partitions (B1, S1, H48, M128 -> SM103, M64 -> SM100)
    ((1, 1, 48, 128, "float8_e4m3fn", "sm_103a"), (128, "none", 1, 1, 1)),
    ((1, 1, 48, 384, "float8_e4m3fn", "sm_103a"), (128, "none", 1, 1, 3)),
    ((1, 1, 48, 1024, "float8_e4m3fn", "sm_103a"), (128, "none", 1, 1, 8)),
    ((1, 1, 48, 4096, "float8_e4m3fn", "sm_103a"), (128, "none", 1, 1, 32)),
    ((1, 1, 48, 16512, "float8_e4m3fn", "sm_100a"), (64, "none", 1, 1, 43)),
    # test_bf16_split_selection_is_unchanged
    ((1, 1, 96, 128, "bfloat16", "sm_100a"), (128, "none", 1, 1, 32)),
    # test_packed_workspace_matches_launch_geometry (H96 S4 -> 3 packed tiles)
    ((1, 4, 96, 65536, "float8_e4m3fn", "sm_100a"), (128, "pack", 1, 3, 24)),
    ((4, 4, 96, 65536, "float8_e4m3fn", "sm_100a"), (128, "pack", 1, 3, 6)),
    # shapes of their compile matrix (H16 S4 folds 4 tokens; FP8 M64 on SM100 only) and a no-split case;
    # values worked out from their formulas (cross-checked below when tokenspeed-mla is installed)
    ((8, 4, 16, 4096, "float8_e4m3fn", "sm_100a"), (64, "fold", 4, 1, 16)),
    ((8, 4, 16, 4096, "float8_e4m3fn", "sm_103a"), (128, "fold", 4, 1, 8)),
    ((8, 4, 16, 4096, "bfloat16", "sm_100a"), (128, "fold", 4, 1, 9)),
    ((64, 8, 128, 8192, "bfloat16", "sm_100a"), (128, "none", 1, 8, 1)),
]


@pytest.mark.parametrize("shape,want", TOKENSPEED_TABLE, ids=lambda x: "-".join(map(str, x)))
def test_plan_table(shape, want):
    B_, S, H, K, dtype, arch = shape
    p = plan(B_, S, H, K, dtype, arch)
    extra = dict(p.extra)
    m_tile, packing, fold, s_eff, splits = want
    assert (p.block_m, extra["packing"], p.fold, p.num_m_blocks, p.num_splits) == want
    h_eff = 128 if packing == "pack" else H * fold
    assert extra["heads_eff"] == h_eff
    assert p.grid == (2 if m_tile == 128 else 1, B_ * s_eff, splits)
    nbytes = B_ * h_eff * s_eff * splits * 513 * 4 if splits > 1 else 0
    assert p.workspace_bytes == nbytes
    assert [w.name for w in p.workspace] == (["o_lse_accum"] if splits > 1 else [])
    assert p.rows == S * H and p.block_n == 128


@pytest.mark.parametrize(
    "heads,q_len,tiles",
    [(96, 4, 3), (96, 8, 6), (96, 3, None), (48, 3, 2), (12, 11, 2), (128, 3, None)],
)
def test_packed_tile_geometry(heads, q_len, tiles):
    """TokenSpeed's test_packed_tile_geometry shapes: packing iff it needs fewer tiles than folding."""
    lay = P.query_layout(num_heads=heads, q_len=q_len, fp8=False, arch="sm_100a")
    assert lay.pack_q == (tiles is not None)
    if tiles is not None:
        assert (lay.q_len_eff, lay.heads_eff, lay.fold) == (tiles, 128, 1)


@pytest.mark.parametrize(
    "batch,q_len,heads,splits,expected",
    [(1, 1, 6, 32, 2), (1, 1, 48, 32, 2), (1, 1, 96, 32, 1), (1, 8, 96, 8, 1), (4, 1, 48, 32, 1),
     (1, 1, 6, 2, 2), (1, 1, 6, 1, 1)],
)
def test_reducer_d_tiles(batch, q_len, heads, splits, expected):
    assert P.reducer_d_tiles(batch=batch, q_len=q_len, num_heads=heads, num_sms=148, splits=splits) == expected


def test_reducer_max_splits():
    assert [P.reducer_max_splits(s) for s in (1, 3, 4, 5, 32, 33)] == [4, 4, 4, 8, 32, 64]


def test_fold_factor():
    assert P.fold_factor(16, 4, 128) == 4 and P.fold_factor(16, 6, 128) == 6
    assert P.fold_factor(32, 6, 128) == 3 and P.fold_factor(64, 5, 128) == 1
    assert P.fold_factor(128, 8, 128) == 1 and P.fold_factor(16, 16, 64) == 4


def test_plan_rejects_unsupported():
    with pytest.raises(ValueError, match="kv_lora_rank"):
        plan_mla_decode(batch=1, q_len=1, num_heads=16, max_kv_len=64, page_size=64, kv_lora_rank=256,
                        arch="sm_100a")


def test_plan_default_sms_and_capacity_splits():
    p = plan_mla_decode(batch=1, q_len=1, num_heads=128, max_kv_len=64, page_size=64, arch="sm_100a")
    assert p.num_sms == 148 and p.num_splits == 32  # BF16 splits do not depend on the length
    assert p.tokens_per_split == 128


def _ts_reference(B_, S, H, K, dtype, arch, sms):
    """TokenSpeed's own decisions for a call (mirrors the sequence in tokenspeed_mla_decode)."""
    import tokenspeed_mla.mla_decode as D
    import torch
    from tokenspeed_mla import mla_helpers as Hl

    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float8_e4m3fn": torch.float8_e4m3fn}[dtype]
    cc = P.compute_capability(arch)
    fp8 = dtype == "float8_e4m3fn"
    qk, _ = Hl.select_mla_decode_tilers(H, S, is_fp8=fp8, compute_capability=cc)
    m = qk[0]
    fold = Hl.get_mla_decode_fold_sq_factor(H, S, m)
    h_eff, s_eff = H * fold, S // fold
    pack = m == 128 and Hl.ceil_div(H * S, m) < s_eff
    if pack:
        _, s_eff, _ = Hl.compute_q_tile_layout(H, S, m)
        h_eff, fold = m, 1
    splits, ws = D._get_split_kv_and_workspace_size(B_, s_eff, h_eff, 512, sms, K, tdt, qk)
    d_tiles = D._get_reducer_d_tiles(B_, S, H, sms, splits) if fp8 else 1
    return m, fold, pack, s_eff, h_eff, splits, ws, d_tiles


@pytest.mark.skipif(not HAS_TS, reason="tokenspeed-mla not installed")
@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3fn"])
def test_plan_matches_tokenspeed_functions(arch, dtype):
    rng = np.random.default_rng(0)
    shapes = [(1, 1, 128, 128), (1, 1, 16, 64), (3, 2, 128, 4096), (128, 1, 128, 32768), (2, 16, 8, 1000)]
    shapes += [(int(rng.integers(1, 200)), int(rng.integers(1, 17)), int(rng.choice([1, 8, 16, 32, 48, 64, 96, 128])),
                int(rng.integers(1, 70000))) for _ in range(40)]
    for sms in (148, 132, 160):
        for B_, S, H, K in shapes:
            m, fold, pack, s_eff, h_eff, splits, ws, d_tiles = _ts_reference(B_, S, H, K, dtype, arch, sms)
            p = plan(B_, S, H, K, dtype, arch, sms)
            extra = dict(p.extra)
            got = (p.block_m, p.fold, extra["pack_q"], p.num_m_blocks, extra["heads_eff"], p.num_splits,
                   p.workspace_bytes, extra["reducer_d_tiles"])
            assert got == (m, fold, pack, s_eff, h_eff, splits, ws, d_tiles), (B_, S, H, K, sms)


# --------------------------------------------------------------------------------- argument mapping
def test_decode_config_mapping():
    pytest.importorskip("cutlass")
    prob = decode_problem(batch=4, q_len=4, num_heads=16, dtype="float8_e4m3fn", return_lse=True)
    cfg = B.decode_config(prob)
    p = plan_mla_decode(batch=4, q_len=4, num_heads=16, max_kv_len=16 * 64, page_size=64,
                        dtype="float8_e4m3fn", arch="sm_100a", num_sms=148)
    assert (cfg.arch, cfg.dtype, cfg.page_size, cfg.num_heads, cfg.q_len) == ("sm_100a", "float8_e4m3fn", 64, 16, 4)
    assert cfg.causal and cfg.return_lse and cfg.visible_lens
    assert (cfg.m_tile, cfg.fold, cfg.pack_q, cfg.splits) == (p.block_m, p.fold, False, p.num_splits)
    assert cfg.m_tile == 64 and cfg.max_active_clusters == 148
    assert cfg.reducer_max_splits == P.reducer_max_splits(p.num_splits)
    assert hash(cfg) == hash(dataclasses.replace(cfg))  # a usable compile key
    # FP16 never uses local_visible_lens; non-causal and S == 1 need no visibility input.
    assert not B.decode_config(decode_problem(q_len=4, num_heads=16, dtype="float16")).visible_lens
    assert not B.decode_config(decode_problem(q_len=4, num_heads=16, causal=False)).visible_lens
    assert not B.decode_config(decode_problem(q_len=1)).visible_lens


@pytest.mark.skipif(not HAS_TS, reason="tokenspeed-mla not installed")
@pytest.mark.parametrize("dtype,arch", [("bfloat16", "sm_100a"), ("float8_e4m3fn", "sm_103a")])
def test_kernel_object_arguments(dtype, arch):
    from tokenspeed_jax.kernels.sm100 import decode as KD

    prob = decode_problem(batch=2, q_len=8, num_heads=96, dtype=dtype, target=Target("cuda", arch, 148))
    cfg = B.decode_config(prob)
    k = KD.make_kernel(cfg)
    assert type(k).__name__.endswith("DeviceScalars")
    assert k.pack_q and k.fold_sq_factor == 1 and k.num_heads == 96 and k.seq_len_q == 8
    assert k.is_causal and not k.is_persistent and k.is_var_seq and k.page_size == 64
    assert k.mma_qk_tiler_mn == (128, 128) and k.mma_pv_tiler_mn == (128, 256)
    assert k.cluster_shape_mnk == (2, 1, 1) and k.window_left == -1
    assert k.skip_correction_threshold == (8.0 if dtype == "float8_e4m3fn" else 0.0)
    if dtype == "float8_e4m3fn":
        assert k.reducer_max_splits == cfg.reducer_max_splits and k.partial_dtype.__name__ == "Float32"


def test_prefill_config_mapping():
    pytest.importorskip("cutlass")
    cfg = B.prefill_config(prefill_problem(max_seqlen_q=40))
    assert (cfg.max_seqlen_q, cfg.max_seqlen_k) == (40, 96)  # hint, else the total token count
    assert (cfg.head_dim_qk, cfg.head_dim_v, cfg.num_q_heads, cfg.num_kv_heads) == (192, 128, 16, 16)
    assert cfg.causal and cfg.return_lse and cfg.batch == 2


# --------------------------------------------------------------------- XLA-side pre/post-processing
def test_decode_tables_clamp_widen_remap():
    prob = decode_problem(batch=3, page_size=32, num_pages=10, max_pages=5)  # 4 pages per 128-token tile
    bt = jnp.array([[3, 7, -5, 99, 2], [4, 1000, 0, 0, 0], [9, 8, 7, 6, 5]], jnp.int32)
    sl = jnp.array([70, -3, 10_000], jnp.int32)
    sl2, bt2 = B.decode_tables(prob, bt, sl)
    assert sl2.tolist() == [70, 0, 160]
    assert bt2.shape == (3, 8)  # widened to whole 128-token tiles
    assert bt2[0].tolist() == [3, 7, 0, 0, 0, 0, 0, 0]  # 3 used pages (-5 clamped to 0), rest -> last
    assert bt2[1].tolist() == [4] * 8  # nothing used: every entry is the (clamped) first page
    assert bt2[2].tolist() == [9, 8, 7, 6, 5, 5, 5, 5]
    assert int(bt2.min()) >= 0 and int(bt2.max()) < 10


def test_lse_base_conversion_and_empty_rows(rng):
    prob = decode_problem(batch=2, q_len=3, num_heads=2, dtype="float16", return_lse=True)
    s = rng.standard_normal((2, 3, 2, 50))
    lse_nat = np.log(np.exp(s).sum(-1))
    lse2 = jnp.asarray(lse_nat / math.log(2.0), jnp.float32)  # what the kernel writes
    lse2 = lse2.at[1, 0, :].set(-jnp.inf)
    out = jnp.full((2, 3, 2, 512), 7.0, jnp.float16)
    sl = jnp.array([40, 2], jnp.int32)  # request 1: row 0 sees 2 - 3 + 1 + 0 = 0 keys
    o, lse = B.finish_decode(prob, out, lse2, sl, fix_empty_rows=False)
    np.testing.assert_allclose(np.asarray(lse)[0], lse_nat[0], rtol=1e-6)
    assert np.isneginf(np.asarray(lse)[1, 0]).all() and bool((o == 7).all())
    o, lse = B.finish_decode(prob, out, lse2 * 0 + 1.0, sl, fix_empty_rows=True)
    assert bool((o[1, 0] == 0).all()) and bool((o[1, 1:] == 7).all()) and bool((o[0] == 7).all())
    assert np.isneginf(np.asarray(lse)[1, 0]).all() and np.isfinite(np.asarray(lse)[1, 1:]).all()
    np.testing.assert_allclose(np.asarray(lse)[0], math.log(2.0), rtol=1e-7)
    o, lse = B.finish_decode(prob, out, None, sl, fix_empty_rows=True)
    assert lse is None and bool((o[1, 0] == 0).all())


def test_visible_keys():
    v = B.visible_keys(jnp.array([5, 1], jnp.int32), 3)
    assert v.tolist() == [[3, 4, 5], [-1, 0, 1]]


@pytest.mark.parametrize("causal", [True, False])
def test_prefill_rows_with_keys(causal):
    cu_q = jnp.array([1, 4, 4, 9], jnp.int32)  # row 0 before the first request, rows 9..11 after
    cu_k = jnp.array([0, 2, 5, 5], jnp.int32)  # request 0: Lq 3 / Lk 2; request 2: Lk 0
    got = np.asarray(B.prefill_rows_with_keys(cu_q, cu_k, 12, causal=causal))
    want = np.zeros(12, bool)
    for i in range(3):  # request 0, rows 1..3, sees keys j <= i + 2 - 3
        want[1 + i] = (i - 1 >= 0) if causal else True
    np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------------------- capability reasons
@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"target": Target("cpu")}, "needs a CUDA Blackwell GPU"),
        ({"target": Target("cuda", "sm_90a", 132)}, "arch sm_90a is not supported"),
        ({"target": Target("cuda", "sm_110a", 148)}, "arch sm_110a is not supported"),
        ({"dtype": "float32"}, "dtype float32 not supported"),
        ({"kv_lora_rank": 256, "head_dim": 320}, "kv_lora_rank 256 not supported"),
        ({"head_dim": 544}, "head dim 544 not supported"),
        ({"page_size": 256}, "page_size 256 not supported"),
        ({"num_heads": 129}, "num_heads 129 not supported"),
        ({"q_len": 0}, "q_len 0 not supported"),
        ({"batch": 4096, "max_pages": 8192, "q_len": 16}, "workspace"),
    ],
)
def test_decode_reasons(kw, needle):
    if "workspace" == needle:  # force splits: many SMs per request
        kw["target"] = Target("cuda", "sm_100a", 1 << 22)
    reason = B.BACKEND.supports_decode(decode_problem(**kw))
    assert reason is not None and needle in reason, reason


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"target": Target("cpu")}, "needs a CUDA Blackwell GPU"),
        ({"target": Target("cuda", "sm_90a", 132)}, "arch sm_90a is not supported"),
        ({"dtype": "float32"}, "dtype float32 not supported"),
        ({"head_dim_qk": 128}, "head dims (Dqk, Dv) = (128, 128) not supported"),
        ({"num_q_tokens": 0}, "empty q"),
    ],
)
def test_prefill_reasons(kw, needle):
    reason = B.BACKEND.supports_prefill(prefill_problem(**kw))
    assert reason is not None and needle in reason, reason


def test_supported_calls_and_missing_package(monkeypatch):
    for dtype in ("bfloat16", "float16", "float8_e4m3fn"):
        for page in (16, 32, 64, 128):
            prob = decode_problem(dtype=dtype, page_size=page, target=SM103)
            assert B.BACKEND.supports_decode(prob) == B.missing_package()
        assert B.BACKEND.supports_prefill(prefill_problem(dtype=dtype)) == B.missing_package()
    monkeypatch.setattr(B, "missing_package", lambda: "the tokenspeed-mla package is not installed "
                        f"({B.INSTALL_HINT})")
    assert "pip install 'tokenspeed-jax[sm100]'" in B.BACKEND.supports_decode(decode_problem())
    assert "pip install 'tokenspeed-jax[sm100]'" in B.BACKEND.supports_prefill(prefill_problem())


def test_missing_package_names_install_command(monkeypatch):
    B.missing_package.cache_clear()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tokenspeed_mla" else real(name, *a))
    try:
        assert B.missing_package() == f"the tokenspeed-mla package is not installed ({B.INSTALL_HINT})"
    finally:
        B.missing_package.cache_clear()


@pytest.mark.skipif(not HAS_TS, reason="tokenspeed-mla not installed")
def test_registry_and_auto_selection():
    b = get_backend("sm100")
    assert b.name == "sm100" and b.priority == 100
    assert available_backends("decode", decode_problem())[0] == "sm100"
    assert available_backends("prefill", prefill_problem())[0] == "sm100"
    hopper = decode_problem(target=Target("cuda", "sm_90a", 132))
    assert "sm100" not in available_backends("decode", hopper)
    assert "sm100" not in available_backends("decode", decode_problem(target=Target("cpu")))
    assert backend_reasons("decode", decode_problem())["sm100"] is None


def test_runtime_scalar_algebra():
    pytest.importorskip("cutlass")
    from tokenspeed_jax.kernels.sm100.runtime_scalars import DeviceScalar

    s = DeviceScalar(tensor=None)
    t = (s * 2.0) * 0.5 * math.log2(math.e)
    assert t.factor == pytest.approx(math.log2(math.e)) and t is not s and s.factor == 1.0
    assert (3 * s).factor == 3.0
    with pytest.raises(TypeError, match="only multiplication by a Python number"):
        _ = s * s


def test_traced_decode_problem_uses_target_sms():
    """The plan of a traced call takes the SM count of the target (on a GPU: the device's)."""
    with jax.ensure_compile_time_eval():
        p1 = B._decode_plan(decode_problem(batch=1, target=Target("cuda", "sm_100a", 148)))
        p2 = B._decode_plan(decode_problem(batch=1, target=Target("cuda", "sm_100a", 40)))
    assert (p1.num_sms, p1.num_splits) == (148, 32) and (p2.num_sms, p2.num_splits) == (40, 20)
