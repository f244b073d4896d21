"""JAX transformations of the public ops: jit with static arguments, vmap over an extra leading axis
(shared or vmapped kv_cache, vmapped scales, nested vmap), jax.export round trips (serialize,
deserialize, call) of jitted decode and prefill, and the named scopes visible in jaxpr and HLO."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokenspeed_jax as tj
from tests import reference as ref

L, R, PS = 32, 16, 16


def decode_inputs(rng, V=None, dtype="float32"):
    """One batch of decode inputs, or V independent batches stacked on a new leading axis."""
    def one():
        return ref.make_decode_inputs(rng, seq_lens=rng.integers(0, 40, size=3), S=2, H=4, L=L, R=R,
                                      page_size=PS, dtype=dtype, extra_cols=3 - 0, extra_pages=0)
    if V is None:
        return one()
    parts = []
    for _ in range(V):
        q, kv, bt, sl = one()
        parts.append((q, kv, bt, sl))
    # pad pages / columns to common shapes (extra pages are NaN, extra columns garbage)
    P = max(p[1].shape[0] for p in parts)
    C = max(p[2].shape[1] for p in parts)
    out = []
    for q, kv, bt, sl in parts:
        kv = np.concatenate([kv, ref.cast(np.full((P - kv.shape[0],) + kv.shape[1:], np.nan), dtype)])
        bt = np.concatenate([bt, np.full((bt.shape[0], C - bt.shape[1]), 7, np.int32)], axis=1)
        out.append((q, kv, bt, sl))
    return tuple(np.stack([o[i] for o in out]) for i in range(4))


def decode(q, kv, bt, sl, ss=0.2, os_=1.0, **kw):
    return tj.mla_decode(q, kv, bt, sl, softmax_scale=ss, output_scale=os_, kv_lora_rank=L,
                         return_lse=True, backend="xla", **kw)


def test_jit_static_args(rng):
    q, kv, bt, sl = decode_inputs(rng)
    f = jax.jit(tj.mla_decode, static_argnames=("causal", "kv_lora_rank", "return_lse", "backend"))
    for causal in (True, False):
        out, lse = f(q, kv, bt, sl, softmax_scale=jnp.float32(0.3), causal=causal, kv_lora_rank=L,
                     return_lse=True)
        r_out, r_lse = ref.mla_decode(q, kv, bt, sl, softmax_scale=0.3, causal=causal, kv_lora_rank=L)
        ref.assert_close(out, r_out, what="out")
        ref.assert_close(lse, r_lse, dtype="float32", what="lse")
    g = jax.jit(tj.mla_prefill, static_argnames=("causal", "return_lse", "max_seqlen_q", "max_seqlen_k"))
    pq, pk, pv, cq, ck = ref.make_prefill_inputs(rng, lens_q=[3, 5], lens_k=[4, 9], Hq=2, Hk=1, Dqk=16, Dv=8,
                                                 dtype="float32")
    out = g(pq, pk, pv, cq, ck, softmax_scale=0.25, max_seqlen_q=5, max_seqlen_k=9)
    ref.assert_close(out, ref.mla_prefill(pq, pk, pv, cq, ck, softmax_scale=0.25)[0], what="prefill")


def _loop(fn, V, batched, *args):
    outs = [fn(*[a[v] if b else a for a, b in zip(args, batched)]) for v in range(V)]
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *outs)


@pytest.mark.parametrize("which", ["shared_cache", "vmapped_cache", "vmapped_scales",
                                   "vmapped_cache_and_scale"])
def test_vmap_decode(rng, which):
    V = 3
    q, kv, bt, sl = decode_inputs(rng, V)
    ss = np.array([0.1, 0.3, 0.05], np.float32)
    os_ = np.array([1.0, -2.0, 0.5], np.float32)
    if which == "shared_cache":
        # one cache shared by all V batches: make every batch's table point into batch 0's cache
        kv, bt, sl = kv[0], np.broadcast_to(bt[0], bt.shape), np.broadcast_to(sl[0], sl.shape)
        args, axes = (q, kv, bt, sl, 0.2, 1.0), (0, None, 0, 0, None, None)
    elif which == "vmapped_cache":
        args, axes = (q, kv, bt, sl, 0.2, 1.0), (0, 0, 0, 0, None, None)
    elif which == "vmapped_scales":
        args, axes = (q, kv[0], bt[0], sl[0], ss, os_), (0, None, None, None, 0, 0)
    else:
        args, axes = (q, kv, bt, sl, ss, 1.0), (0, 0, 0, 0, 0, None)
    got = jax.jit(jax.vmap(decode, in_axes=axes))(*args)
    want = _loop(decode, V, [a == 0 for a in axes], *args)
    for g, w, n in zip(got, want, ("out", "lse")):
        assert g.shape == w.shape, n
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6, atol=1e-6, err_msg=n)
    # and against the float64 reference, batch by batch
    for v in range(V):
        a = [x[v] if ax == 0 else x for x, ax in zip(args, axes)]
        r_out, r_lse = ref.mla_decode(*a[:4], softmax_scale=float(a[4]), output_scale=float(a[5]),
                                      kv_lora_rank=L)
        ref.assert_close(got[0][v], r_out, what=f"out[{v}]")
        ref.assert_close(got[1][v], r_lse, dtype="float32", what=f"lse[{v}]")


def test_vmapped_cache_cannot_reach_other_batches(rng):
    """With a vmapped cache, out-of-range page ids are clamped inside their own batch's cache: poisoning
    every other batch's cache with NaN does not change batch 0's (finite) result."""
    V = 2
    q, kv, bt, sl = decode_inputs(rng, V)
    bt = bt.copy()
    bt[0, :, 0] = 10_000  # out of range inside the used pages (unspecified, but must stay in batch 0)
    kv = np.asarray(kv).copy()
    kv[0] = np.nan_to_num(kv[0])
    f = jax.jit(jax.vmap(decode))
    a = f(q, kv, bt, sl)
    kv[1] = np.nan
    b = f(q, kv, bt, sl)
    np.testing.assert_array_equal(np.asarray(a[0][0]), np.asarray(b[0][0]))
    assert np.isfinite(np.asarray(b[0][0])).all()


def test_vmap_nested_and_out_only(rng):
    q, kv, bt, sl = decode_inputs(rng, 4)
    q2, kv2, bt2, sl2 = (x.reshape((2, 2) + x.shape[1:]) for x in (q, kv, bt, sl))
    def f(*a):
        return tj.mla_decode(*a, softmax_scale=0.2, kv_lora_rank=L, backend="xla")

    got = jax.jit(jax.vmap(jax.vmap(f)))(q2, kv2, bt2, sl2)
    want = jax.vmap(f)(q, kv, bt, sl)
    assert got.shape == (2, 2) + want.shape[1:]
    np.testing.assert_allclose(np.asarray(got).reshape(want.shape), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_vmap_prefill(rng):
    V = 3
    parts = [ref.make_prefill_inputs(rng, lens_q=[3, 4], lens_k=[5, 6], Hq=4, Hk=2, Dqk=16, Dv=8,
                                     dtype="float32") for _ in range(V)]
    q, k, v = (np.stack([p[i] for p in parts]) for i in range(3))
    cq = np.stack([p[3] for p in parts])
    ck = np.stack([np.array([0, 4, 11], np.int32)] * V)  # differ from the packing: rows 0 and 11 unused
    def run(q, k, v, cq, ck, ss):
        return tj.mla_prefill(q, k, v, cq, ck, softmax_scale=ss, return_lse=True, backend="xla")

    ss = np.array([0.2, 0.4, 0.1], np.float32)
    out, lse = jax.jit(jax.vmap(run))(q, k, v, cq, ck, ss)
    for i in range(V):
        r_out, r_lse = ref.mla_prefill(q[i], k[i], v[i], cq[i], ck[i], softmax_scale=float(ss[i]))
        ref.assert_close(out[i], r_out, what=f"out[{i}]")
        ref.assert_close(lse[i], r_lse, dtype="float32", what=f"lse[{i}]")


def _roundtrip(fn, *args):
    specs = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in args]
    exp = jax.export.export(jax.jit(fn))(*specs)
    blob = exp.serialize()
    assert isinstance(blob, (bytes, bytearray)) and len(blob) > 0
    back = jax.export.deserialize(blob)
    return back.call(*args), jax.jit(fn)(*args), exp


def test_export_roundtrip_decode(rng):
    q, kv, bt, sl = decode_inputs(rng, dtype="bfloat16")
    def fn(q, kv, bt, sl, ss):
        return tj.mla_decode(q, kv, bt, sl, softmax_scale=ss, kv_lora_rank=L, return_lse=True)

    got, want, exp = _roundtrip(fn, q, kv, bt, sl, np.float32(0.2))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    r_out, _ = ref.mla_decode(q, kv, bt, sl, softmax_scale=0.2, kv_lora_rank=L)
    ref.assert_close(got[0], r_out, what="exported out")
    assert "tokenspeed_mla_decode" in exp.mlir_module()


def test_export_roundtrip_prefill(rng):
    q, k, v, cq, ck = ref.make_prefill_inputs(rng, lens_q=[4, 0, 7], lens_k=[6, 2, 7], Hq=4, Hk=4, Dqk=24,
                                              Dv=16, dtype="bfloat16", pad_q=2)
    def fn(q, k, v, cq, ck):
        return tj.mla_prefill(q, k, v, cq, ck, softmax_scale=0.2)

    got, want, exp = _roundtrip(fn, q, k, v, cq, ck)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    ref.assert_close(got, ref.mla_prefill(q, k, v, cq, ck, softmax_scale=0.2)[0], what="exported prefill")
    assert "tokenspeed_mla_prefill" in exp.mlir_module()


def _name_stacks(jaxpr) -> set[str]:
    names = set()
    for e in jaxpr.eqns:
        names.add(str(e.source_info.name_stack))
        for p in e.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names |= _name_stacks(inner)
    return names


def test_named_scopes(rng):
    q, kv, bt, sl = decode_inputs(rng)
    pq, pk, pv, cq, ck = ref.make_prefill_inputs(rng, lens_q=[3], lens_k=[3], Hq=2, Hk=2, Dqk=16, Dv=8,
                                                 dtype="float32")
    oa = np.zeros((3, 2, 8), np.float32)
    la = np.zeros((3, 2), np.float32)
    ops = {
        "tokenspeed_mla_decode": (lambda: tj.mla_decode(q, kv, bt, sl, softmax_scale=0.1, kv_lora_rank=L)),
        "tokenspeed_mla_prefill": (lambda: tj.mla_prefill(pq, pk, pv, cq, ck, softmax_scale=0.1)),
        "tokenspeed_merge_attn_states": (lambda: tj.merge_attn_states(oa, la, oa, la)),
        "tokenspeed_concat_and_cache_mla": (lambda: tj.concat_and_cache_mla(
            np.zeros((2, L), np.float32), np.zeros((2, R), np.float32), np.zeros((2, PS, L + R), np.float32),
            np.array([0, 5], np.int32))),
        "tokenspeed_mla_kv_pack_quantize_fp8": (lambda: tj.mla_kv_pack_quantize_fp8(
            oa, la[:, :1], oa, k_scale=1.0, v_scale=1.0)),
    }
    for scope, fn in ops.items():
        jaxpr = jax.make_jaxpr(fn)()
        assert any(scope in n for n in _name_stacks(jaxpr.jaxpr)), scope
        lowered = jax.jit(fn).lower()
        assert scope in lowered.as_text(debug_info=True), scope
        assert scope in lowered.compile().as_text(), scope  # op_name metadata seen by the profiler


@pytest.mark.parametrize("bt_dtype", [np.int8, np.int16])
def test_vmapped_cache_with_narrow_int_block_table(rng, bt_dtype):
    """Regression: folding a vmapped cache offsets page ids by v * num_pages; with an int8 / int16 block
    table that arithmetic (and the clip to num_pages - 1) must not wrap around."""
    V, P = 3, 200
    kv = rng.standard_normal((V, P, PS, L + R)).astype(np.float32)
    q = rng.standard_normal((V, 2, 1, 2, L + R)).astype(np.float32)
    bt = rng.integers(0, 127, size=(V, 2, 2)).astype(bt_dtype)
    sl = rng.integers(0, 2 * PS + 1, size=(V, 2)).astype(np.int32)
    out, lse = jax.jit(jax.vmap(decode))(q, kv, bt, sl)
    for v in range(V):
        r_out, r_lse = ref.mla_decode(q[v], kv[v], bt[v], sl[v], softmax_scale=0.2, kv_lora_rank=L)
        ref.assert_close(out[v], r_out, what=f"out[{v}]")
        ref.assert_close(lse[v], r_lse, dtype="float32", what=f"lse[{v}]")
