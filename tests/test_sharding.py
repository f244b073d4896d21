"""tokenspeed_jax.sharding on 8 virtual CPU devices (tests/conftest.py): tensor-parallel heads,
data-parallel batches (page-sharded cache with shard-local page ids, or a replicated cache), both on a
2-D mesh, for decode and prefill.  Results must equal the unsharded call (to one ulp of a 16-bit output,
``close``)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import tokenspeed_jax as tj
from tests import reference as ref
from tokenspeed_jax import sharding as ts

L, R, PS = 32, 16, 16

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (virtual) devices")


def mesh(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


@functools.partial(jax.jit, static_argnames=("causal",))
def unsharded_decode(q, kv, bt, sl, causal=True):
    return tj.mla_decode(q, kv, bt, sl, softmax_scale=0.2, kv_lora_rank=L, return_lse=True, causal=causal)


@jax.jit
def unsharded_prefill(q, k, v, cq, ck):
    return tj.mla_prefill(q, k, v, cq, ck, softmax_scale=0.3, return_lse=True)


def sharded_as(x, m, spec) -> bool:
    return x.sharding.is_equivalent_to(NamedSharding(m, spec), x.ndim)


# rounding allowed between the sharded and the unsharded program: XLA compiles each for its own shapes, so
# fp32 results may differ in the last bits and a 16-bit output may then round to the neighbouring value (seen
# on 2026-12-01: one bf16 element in 4608 of test_decode_tensor_parallel one ulp apart)
_ULP = {"bfloat16": 2.0**-7, "float16": 2.0**-10}


def close(got, want):
    for g, w in zip(got, want):
        rtol = _ULP.get(np.dtype(w.dtype).name, 1e-6)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=rtol, atol=1e-6)


def dp_decode_inputs(rng, n, per_shard_B, S=2, H=4, dtype="float32"):
    """Each shard gets its own local cache (NaN in pages it does not use); returns the global cache,
    the global-id table and the shard-local-id table."""
    parts = [ref.make_decode_inputs(rng, seq_lens=rng.integers(0, 50, size=per_shard_B), S=S, H=H, L=L, R=R,
                                    page_size=PS, dtype=dtype, extra_cols=4, extra_pages=0) for _ in range(n)]
    per = max(p[1].shape[0] for p in parts)
    cols = max(p[2].shape[1] for p in parts)
    q = np.concatenate([p[0] for p in parts])
    kv = np.concatenate([np.concatenate([p[1], ref.cast(np.full((per - p[1].shape[0], PS, L + R), np.nan),
                                                          dtype)]) for p in parts])
    local = np.concatenate([np.pad(p[2], ((0, 0), (0, cols - p[2].shape[1])), constant_values=-1)
                            for p in parts])
    sl = np.concatenate([p[3] for p in parts])
    glob = local + (np.arange(n * per_shard_B) // per_shard_B * per)[:, None]
    return q, kv, glob.astype(np.int32), local.astype(np.int32), sl, per


@pytest.mark.parametrize("causal", [True, False])
def test_decode_tensor_parallel(rng, causal):
    q, kv, bt, sl = ref.make_decode_inputs(rng, seq_lens=[5, 40, 0], S=3, H=16, L=L, R=R, page_size=PS,
                                           dtype="bfloat16")
    m = mesh((8,), ("model",))
    got = ts.sharded_mla_decode(q, kv, bt, sl, mesh=m, head_axis="model", softmax_scale=0.2, kv_lora_rank=L,
                                causal=causal, return_lse=True)
    want = unsharded_decode(q, kv, bt, sl, causal=causal)
    close(got, want)
    assert sharded_as(got[0], m, P(None, None, "model", None))
    r_out, _ = ref.mla_decode(q, kv, bt, sl, softmax_scale=0.2, causal=causal, kv_lora_rank=L)
    ref.assert_close(got[0], r_out, what="tp out")


@pytest.mark.parametrize("cache_sharding", ["pages", "replicated"])
def test_decode_data_parallel(rng, cache_sharding):
    q, kv, gbt, lbt, sl, per = dp_decode_inputs(rng, 8, 2)
    m = mesh((8,), ("data",))
    bt = lbt if cache_sharding == "pages" else gbt
    np.testing.assert_array_equal(ts.localize_block_table(gbt, num_pages=kv.shape[0], num_shards=8), lbt)
    f = jax.jit(lambda *a: ts.sharded_mla_decode(*a[:4], mesh=m, batch_axis="data", softmax_scale=a[4],
                                                 cache_sharding=cache_sharding, kv_lora_rank=L,
                                                 return_lse=True))
    got = f(q, kv, bt, sl, np.float32(0.2))
    want = unsharded_decode(q, kv, gbt, sl)
    close(got, want)
    assert sharded_as(got[0], m, P("data", None, None, None))
    assert np.isfinite(np.asarray(got[0])).all()


def test_decode_2d_mesh(rng):
    q, kv, gbt, lbt, sl, per = dp_decode_inputs(rng, 2, 3, S=2, H=8)
    m = mesh((2, 4), ("data", "model"))
    got = ts.sharded_mla_decode(q, kv, lbt, sl, mesh=m, batch_axis="data", head_axis="model",
                                softmax_scale=0.2, kv_lora_rank=L, return_lse=True)
    close(got, unsharded_decode(q, kv, gbt, sl))
    assert sharded_as(got[1], m, P("data", None, "model"))
    out = ts.sharded_mla_decode(q, kv, lbt, sl, mesh=m, batch_axis="data", softmax_scale=0.2, kv_lora_rank=L)
    np.testing.assert_allclose(np.asarray(out), np.asarray(got[0]), rtol=1e-6, atol=1e-6)


def test_prefill_tensor_parallel(rng):
    m = mesh((8,), ("model",))
    for Hq, Hk in ((16, 8), (8, 1)):
        q, k, v, cq, ck = ref.make_prefill_inputs(rng, lens_q=[3, 9, 0], lens_k=[5, 9, 2], Hq=Hq, Hk=Hk,
                                                  Dqk=24,
                                                  Dv=16, dtype="bfloat16", pad_q=2, pad_k=1)
        got = ts.sharded_mla_prefill(q, k, v, cq, ck, mesh=m, head_axis="model", softmax_scale=0.3,
                                     return_lse=True)
        want = unsharded_prefill(q, k, v, cq, ck)
        close(got, want)
        assert sharded_as(got[0], m, P(None, "model", None))


def test_prefill_data_parallel_and_2d(rng):
    lens_q, lens_k = [3, 9, 0, 4, 1, 7, 2], [5, 9, 2, 4, 8, 7, 2]
    q, k, v, cq, ck = ref.make_prefill_inputs(rng, lens_q=lens_q, lens_k=lens_k, Hq=4, Hk=2, Dqk=24, Dv=16,
                                              dtype="float32")
    want = unsharded_prefill(q, k, v, cq, ck)
    sq, sk, sv, scq, sck, rows = ts.split_varlen_batch(q, k, v, cq, ck, num_shards=4)
    m = mesh((4,), ("data",))
    got = jax.jit(lambda *a: ts.sharded_mla_prefill(*a, mesh=m, batch_axis="data", softmax_scale=0.3,
                                                    return_lse=True))(sq, sk, sv, scq, sck)
    close((np.asarray(got[0])[rows], np.asarray(got[1])[rows]), want)
    m2 = mesh((4, 2), ("data", "model"))
    got2 = ts.sharded_mla_prefill(sq, sk, sv, scq, sck, mesh=m2, batch_axis="data", head_axis="model",
                                  softmax_scale=0.3, return_lse=True)
    close((np.asarray(got2[0])[rows], np.asarray(got2[1])[rows]), want)


def test_sharding_errors(rng):
    q, kv, bt, sl = ref.make_decode_inputs(rng, seq_lens=[5, 3, 1], S=1, H=6, L=L, R=R, page_size=PS,
                                           dtype="float32")
    m = mesh((4,), ("model",))
    kw = dict(softmax_scale=0.1, kv_lora_rank=L)
    with pytest.raises(ValueError, match=r"^q: expected H \(q axis 2\) to be a multiple of .*'model' \(4\), "
                                         r"got 6"):
        ts.sharded_mla_decode(q, kv, bt, sl, mesh=m, head_axis="model", **kw)
    with pytest.raises(ValueError, match=r"^head_axis: expected one of the mesh axes \('model',\), got 'tp'"):
        ts.sharded_mla_decode(q, kv, bt, sl, mesh=m, head_axis="tp", **kw)
    with pytest.raises(ValueError, match=r"^q: expected B \(q axis 0\) to be a multiple"):
        ts.sharded_mla_decode(q, kv, bt, sl, mesh=m, batch_axis="model", **kw)
    with pytest.raises(ValueError, match=r"^cache_sharding: expected 'pages' or 'replicated', got 'rows'"):
        ts.sharded_mla_decode(q, kv, bt, sl, mesh=m, batch_axis="model", cache_sharding="rows", **kw)
    with pytest.raises(ValueError, match=r"^seq_lens: expected batch \(axis 0\) equal to q's B = 3, got 2"):
        ts.sharded_mla_decode(q, kv, bt, sl[:2], mesh=m, batch_axis="model", **kw)
    with pytest.raises(ValueError, match=r"^block_table: expected rank 2"):
        ts.sharded_mla_decode(q, kv, bt[0], sl, mesh=m, head_axis="model", **kw)
    with pytest.raises(TypeError, match=r"^head_axis: expected a mesh axis name \(str\) or None, got int"):
        ts.sharded_mla_decode(q, kv, bt, sl, mesh=m, head_axis=0, **kw)
    with pytest.raises(TypeError, match=r"^mesh: expected a jax.sharding.Mesh, got NoneType"):
        ts.sharded_mla_decode(q, kv, bt, sl, mesh=None, **kw)
    with pytest.raises(ValueError, match=r"^batch_axis: expected a mesh axis other than head_axis"):
        ts.sharded_mla_decode(q, kv, bt, sl, mesh=m, batch_axis="model", head_axis="model", **kw)
    pq, pk, pv, cq, ck = ref.make_prefill_inputs(rng, lens_q=[4], lens_k=[4], Hq=8, Hk=2, Dqk=8, Dv=8,
                                                 dtype="float32")
    with pytest.raises(ValueError, match=r"^k: expected Hk \(axis 1\) to be 1 or a multiple .* got 2"):
        ts.sharded_mla_prefill(pq, pk, pv, cq, ck, mesh=m, head_axis="model", softmax_scale=0.1)
    with pytest.raises(ValueError, match=r"^num_shards: expected a divisor of B = 3 and num_pages"):
        ts.localize_block_table(bt, num_pages=kv.shape[0], num_shards=2)
