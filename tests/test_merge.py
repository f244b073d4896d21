"""merge_attn_states: exact combination of two partial attentions (float64 reference), the -inf rules
(a -inf side is never read, both -inf gives 0 / -inf) and the chunked-prefill identity."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokenspeed_jax as tj
from tests import reference as ref

merge = jax.jit(tj.merge_attn_states)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_merge_random(rng, dtype):
    T, H, D = 37, 5, 24
    oa = ref.cast(rng.standard_normal((T, H, D)), dtype)
    ob = ref.cast(rng.standard_normal((T, H, D)), dtype)
    la = (rng.standard_normal((T, H)) * 8).astype(np.float32)
    lb = (rng.standard_normal((T, H)) * 8).astype(np.float32)
    la[0, :], lb[1, :] = -np.inf, -np.inf  # one side empty
    la[2, :] = lb[2, :] = -np.inf  # both empty
    la[3, 0], lb[3, 0] = 80.0, -80.0  # extreme imbalance, no overflow
    la[4, 0], lb[4, 0] = 1e4, 1e4  # huge but equal: no overflow
    oa = np.asarray(oa).copy()
    ob = np.asarray(ob).copy()
    oa[0] = np.nan  # a -inf side must not be read
    ob[1] = np.nan
    oa[2] = np.nan
    ob[2] = np.nan
    out, lse = merge(oa, la, ob, lb)
    assert jnp.dtype(out.dtype).name == dtype and lse.dtype == jnp.float32
    r_out, r_lse = ref.merge_attn_states(oa, la, ob, lb)
    ref.assert_close(out, r_out, atol=1e-6, what="out")
    ref.assert_close(lse, r_lse, dtype="float32", atol=1e-5, what="lse")
    assert (np.asarray(out[2]).astype(np.float32) == 0).all() and np.isneginf(np.asarray(lse[2])).all()
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(ob[0]))  # exactly the live side
    np.testing.assert_array_equal(np.asarray(lse[0]), lb[0])


def test_merge_equals_attention_over_the_union(rng):
    """Chunked context: attention over keys [0, a) merged with attention over [a, Lk) equals attention
    over [0, Lk) (non-causal halves), including rows where one chunk is empty."""
    Lq, Lk, a, H, D = 9, 23, 10, 3, 16
    q, k, v, cq, ck = ref.make_prefill_inputs(rng, lens_q=[Lq], lens_k=[Lk], Hq=H, Hk=H, Dqk=D, Dv=8,
                                              dtype="float32")
    pre = jax.jit(functools.partial(tj.mla_prefill, softmax_scale=0.25, causal=False, return_lse=True,
                                    backend="xla"))

    def run(kk, vv):
        return pre(q, kk, vv, cq, np.array([0, kk.shape[0]], np.int32))

    full = run(k, v)
    pa, pb = run(k[:a], v[:a]), run(k[a:], v[a:])
    out, lse = merge(pa[0], pa[1], pb[0], pb[1])
    np.testing.assert_allclose(np.asarray(out), np.asarray(full[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(full[1]), rtol=1e-6, atol=1e-6)
    empty = run(k[:0], v[:0])
    out, lse = merge(empty[0], empty[1], full[0], full[1])
    np.testing.assert_array_equal(np.asarray(out), np.asarray(full[0]))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(full[1]))
