"""The sm90 decode planner (tokenspeed_jax/planner.py): hand-computed plan tables with exact workspace
bytes, invariants over a sweep of shapes, the problem -> plan mapping and the planner's argument errors.

Expected values are derived by hand from the planner's documented rule (``_plan_sm90`` docstring, as of
2026-11-29 20:00 UTC): 64-row tiles over rows = S*H, 64-token KV blocks; ``splits`` in
``1..min(n_blocks // 2 (1 below 4 blocks), ceil(num_sms / (batch * m_blocks)))`` maximising the wave
efficiency ``ctas / (waves * num_sms) - 0.002 * splits`` (``ctas = batch * m_blocks * splits``); no empty
trailing split; the persistent grid ``(m_blocks, num_sms // m_blocks, 1)`` and the schedule's fp32 workspace of
``2 (num_ctas - 1)`` slots (``o_accum [slots, rows, kv_lora_rank]`` + ``lse_accum [slots, rows]``) whatever the batch
(the ``nbytes`` column of TABLE is the old per-batch workspace and is not used).  If the rule changes, recompute the
table by hand, do not copy the code."""

from __future__ import annotations

import itertools

import pytest

import tokenspeed_jax as tj
from tokenspeed_jax import planner
from tokenspeed_jax.problems import DecodeProblem, Target

# batch, q_len, heads, max_kv_len, kv_lora_rank, num_sms -> m_blocks, splits, tokens_per_split, bytes
TABLE = [
    (1, 1, 128, 4096, 512, 132, 2, 32, 128, 8_388_608 + 16_384),
    (64, 2, 16, 8192, 512, 132, 1, 2, 4096, 8_388_608 + 16_384),  # 3 splits would need 2 waves
    (40, 1, 16, 8192, 512, 132, 1, 3, 2752, 3_932_160 + 7_680),  # 120 of 132 SMs; 4 would need 2 waves
    (1, 1, 128, 163840, 512, 132, 2, 66, 2496, 17_301_504 + 33_792),  # one full wave
    (132, 1, 128, 1024, 512, 132, 2, 1, 1024, 0),
    (1, 16, 128, 200, 512, 132, 32, 2, 128, 8_388_608 + 16_384),
    (3, 1, 1, 6400, 512, 78, 1, 25, 256, 153_600 + 300),
    (1, 1, 16, 150, 512, 132, 1, 1, 192, 0),
    (2, 4, 32, 2048, 256, 132, 2, 16, 128, 4_194_304 + 16_384),
    (1, 1, 1, 16, 512, 132, 1, 1, 64, 0),
]


@pytest.mark.parametrize("B,S,H,K,L,sms,m_blocks,splits,tps,nbytes", TABLE)
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_sm90_plan_table(B, S, H, K, L, sms, m_blocks, splits, tps, nbytes, dtype):
    """The per-request cut (splits, tokens per split) by hand; the persistent grid of num_sms // m_blocks CTAs per
    row block and the schedule's workspace, 2 (num_ctas - 1) fp32 slots of rows x (L + 1), whatever the batch."""
    p = tj.plan_mla_decode(batch=B, q_len=S, num_heads=H, max_kv_len=K, page_size=64, dtype=dtype,
                           kv_lora_rank=L, rope_dim=64, arch="sm_90a", num_sms=sms)
    assert (p.block_m, p.block_n, p.rows, p.fold) == (64, 64, S * H, S)
    assert (p.num_m_blocks, p.num_splits, p.tokens_per_split) == (m_blocks, splits, tps)
    G = sms // m_blocks
    slots = max(1, 2 * (G - 1))
    assert p.grid == (m_blocks, G, 1)
    assert {w.name: (w.shape, w.dtype) for w in p.workspace} == {
        "o_accum": ((slots, S * H, L), "float32"), "lse_accum": ((slots, S * H), "float32")}
    assert p.workspace_bytes == slots * S * H * (L + 1) * 4


def test_sm90_plan_workspace_by_hand():
    # H128 S1 on 132 SMs: 2 row blocks, 66 CTAs each, 130 slots of 128 rows x 513 floats
    p = tj.plan_mla_decode(batch=7, q_len=1, num_heads=128, max_kv_len=4096, page_size=64, num_sms=132)
    assert p.grid == (2, 66, 1) and p.workspace_bytes == 130 * 128 * 513 * 4
    # the workspace does not grow with the batch
    q = tj.plan_mla_decode(batch=700, q_len=1, num_heads=128, max_kv_len=4096, page_size=64, num_sms=132)
    assert q.workspace_bytes == p.workspace_bytes


def test_sm90_plan_invariants():
    """Over a sweep: splits cover every KV block, none is empty, the workspace is the schedule's, and the
    default SM count of sm_90a (132) is used when none is given."""
    for B, S, H, K in itertools.product([1, 2, 7, 64, 200], [1, 2, 16], [1, 16, 128], [16, 64, 65, 1000,
                                                                                       4096, 163840]):
        p = tj.plan_mla_decode(batch=B, q_len=S, num_heads=H, max_kv_len=K, page_size=64)
        n_blocks = -(-K // 64)
        assert p.num_m_blocks == -(-S * H // 64)
        assert p.tokens_per_split % p.block_n == 0
        assert p.num_splits * p.tokens_per_split >= K
        assert (p.num_splits - 1) * p.tokens_per_split < K
        assert 1 <= p.num_splits <= max(1, n_blocks // 2)
        want = -(-132 // (B * p.num_m_blocks))
        assert p.num_splits <= want
        ctas = B * p.num_m_blocks * p.num_splits
        if p.num_splits > 1:  # splitting never adds a wave over the unsplit grid
            assert -(-ctas // 132) <= max(1, -(-(B * p.num_m_blocks) // 132))
        rows = S * H
        G = 132 // p.num_m_blocks
        assert p.workspace_bytes == max(1, 2 * (G - 1)) * rows * (512 + 1) * 4
        assert p.num_sms == 132 and p.arch == "sm_90a"


def test_plan_for_problem_uses_target():
    prob = DecodeProblem(batch=2, q_len=2, num_heads=16, head_dim=576, kv_lora_rank=512, page_size=64,
                         num_pages=100, max_pages=50, dtype="bfloat16", causal=True, return_lse=False,
                         target=Target("cuda", "sm_90a", 78))
    p = planner.plan_for_problem(prob)
    assert p == tj.plan_mla_decode(batch=2, q_len=2, num_heads=16, max_kv_len=3200, page_size=64,
                                   arch="sm_90a", num_sms=78)
    assert p.num_sms == 78


def test_register_planner(monkeypatch):
    monkeypatch.setitem(planner._PLANNERS, "sm90", lambda **kw: ("custom", kw["num_sms"]))
    assert tj.plan_mla_decode(batch=1, q_len=1, num_heads=1, max_kv_len=64, page_size=64) == ("custom", 132)
    monkeypatch.undo()
    calls = []
    monkeypatch.setitem(planner._PLANNERS, "sm90", lambda **kw: calls.append(kw) or "x")
    planner.register_planner("sm90", lambda **kw: "registered")
    assert tj.plan_mla_decode(batch=1, q_len=1, num_heads=1, max_kv_len=64, page_size=64) == "registered"


@pytest.mark.parametrize("name", ["batch", "q_len", "num_heads", "max_kv_len", "page_size", "kv_lora_rank",
                                  "rope_dim"])
@pytest.mark.parametrize("bad", [0, -3, 2.0, True, None])
def test_plan_bad_ints(name, bad):
    kw = dict(batch=1, q_len=1, num_heads=1, max_kv_len=64, page_size=64)
    kw[name] = bad
    with pytest.raises(ValueError, match=f"^{name}: expected a positive int"):
        tj.plan_mla_decode(**kw)


def test_plan_bad_dtype_and_arch(monkeypatch):
    kw = dict(batch=1, q_len=1, num_heads=1, max_kv_len=64, page_size=64)
    with pytest.raises(ValueError, match="^dtype: expected one of"):
        tj.plan_mla_decode(**kw, dtype="float32")
    with pytest.raises(ValueError, match="^arch: no decode planner for 'sm_80'"):
        tj.plan_mla_decode(**kw, arch="sm_80")
    monkeypatch.delitem(planner._PLANNERS, "sm90")
    with pytest.raises(ValueError, match="^arch: no decode planner registered for 'sm_90a'"):
        tj.plan_mla_decode(**kw)
