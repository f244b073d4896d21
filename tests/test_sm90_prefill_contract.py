"""The k/v tail contract of ``mla_prefill`` (``tokenspeed_jax.prefill`` module docstring) against the sm90
backend's kernel: FA4 reads at most ``tile_n - 1`` rows past ``cu_seqlens_k[-1]``, and the documented
bound ``KV_TAIL_ROWS`` covers every head-dim pair the backend claims (CPU; the values themselves are
checked on the H200 by ``tests/gpu/test_sm90_prefill.py::test_unowned_v_rows_contract``)."""

from __future__ import annotations

import pytest

import tokenspeed_jax.prefill
from tokenspeed_jax.backends import sm90_prefill


def test_contract_states_the_bound():
    doc = " ".join(tokenspeed_jax.prefill.__doc__.split())
    assert f"up to {sm90_prefill.KV_TAIL_ROWS} rows past ``cu_seqlens_k[-1]``" in doc
    assert "must hold finite values" in doc
    assert "KV_TAIL_ROWS" in sm90_prefill.__doc__


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # flash_attn / quack import-time notices
@pytest.mark.skipif(
    sm90_prefill._missing_packages() is not None, reason="flash-attn-4 / CuTe DSL not installed"
)
def test_kv_tail_bound_covers_fa4_tiles():
    from tokenspeed_jax.kernels.sm90.fa4_prefill import _fa4_sm90_tiles

    for dqk, dv in sm90_prefill.HEAD_DIMS:
        for causal in (True, False):
            tile_n = _fa4_sm90_tiles(dqk, dv, causal)[1]
            assert 1 <= tile_n - 1 <= sm90_prefill.KV_TAIL_ROWS, (dqk, dv, causal, tile_n)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", [
    ([0, 5, 5, 9], [0, 3, 3, 12], 12),    # an empty request (Lq = 0), padding rows past cu_q[-1]
    ([0, 4, 8, 10], [0, 0, 6, 8], 10),    # a request with Lk = 0; causal Lq > Lk in the first
    ([0, 6, 9], [0, 2, 9], 9),            # causal Lq > Lk: rows i < Lq - Lk see nothing
    ([0, 3, 7], [0, 5, 11], 7),           # every row sees a key: the pass is skipped
])
def test_rows_without_keys(case, causal):
    """EMPTY_ROWS_ENV="xla": the conditional XLA pass sets exactly the rows with no visible key to 0 /
    -inf, against a per-row numpy reference; the other rows pass through bit for bit (NaN included)."""
    import jax.numpy as jnp
    import numpy as np

    cq, ck, Tq = case
    rng = np.random.default_rng(0)
    out = rng.standard_normal((Tq, 2, 4)).astype(np.float32)
    out[rng.random(Tq) < 0.3] = np.nan  # garbage the kernel may leave in any row
    lse = rng.standard_normal((Tq, 2)).astype(np.float32)
    o, lo = sm90_prefill._rows_without_keys(jnp.asarray(out), jnp.asarray(lse), jnp.asarray(cq, jnp.int32),
                                            jnp.asarray(ck, jnp.int32), causal)
    vis = np.zeros(Tq, bool)
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        for i in range(lq):
            vis[cq[b] + i] = lk > 0 and (not causal or i >= lq - lk)
    exp_o = np.where(vis[:, None, None], out, 0.0)
    exp_l = np.where(vis[:, None], lse, -np.inf)
    np.testing.assert_array_equal(np.asarray(o), exp_o)
    np.testing.assert_array_equal(np.asarray(lo), exp_l)
    o2, lo2 = sm90_prefill._rows_without_keys(jnp.asarray(out), None, jnp.asarray(cq, jnp.int32),
                                              jnp.asarray(ck, jnp.int32), causal)
    assert lo2 is None
    np.testing.assert_array_equal(np.asarray(o2), exp_o)
