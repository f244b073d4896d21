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
