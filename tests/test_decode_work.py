"""``mla_decode_work`` / ``mla_decode(work=)``: the per-step decode work (the sm90 split-KV schedule) computed once
and shared by every call of a step.

* xla (runs here): the work is empty and the result is bitwise the one without it, eager, jitted, vmapped, with
  shape-only (``jax.ShapeDtypeStruct``) arguments.
* sm90 (traced for ``sm_90a`` on this CPU; the custom call is replaced by a recorder, the kernel cannot run here):
  the work's arrays are ``sm90_decode.schedule_of`` of the clamped lengths, the kernel receives exactly them with
  and without ``work``, and a lowered program that shares one work computes the schedule once, outside any loop.
* a work built for another backend, problem, shape or layout is refused naming ``work``.
* ``tokenspeed_jax.sharding``: the work of each shard's local call (tensor parallel: replicated; data parallel: a
  leading axis over the batch axis).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import tokenspeed_jax as tj
from tests import reference as ref
from tests.hlo import schedule_sites
from tokenspeed_jax import sharding as tsh
from tokenspeed_jax.problems import DecodeProblem, Target
from tokenspeed_jax.runtime import target_override

L, R = 32, 16
sd = jax.ShapeDtypeStruct


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


# ------------------------------------------------------------------------------------------------ xla
@pytest.mark.parametrize("seq_lens,S,H,dtype", [([5, 40, 0], 1, 4, "float32"), ([3, 17, 64, 1], 4, 8, "bfloat16"),
                                                ([9, 2], 2, 3, "float8_e4m3fn")])
def test_xla_work_is_empty_and_bitwise_identical(rng, seq_lens, S, H, dtype):
    q, kv, bt, sl = ref.make_decode_inputs(rng, seq_lens=seq_lens, S=S, H=H, L=L, R=R, page_size=16, dtype=dtype)
    kw = dict(softmax_scale=0.2, kv_lora_rank=L, return_lse=True)
    w = tj.mla_decode_work(q, kv, bt, sl, kv_lora_rank=L)
    assert w == tj.DecodeWork((), "xla") and jax.tree.leaves(w) == []
    # shapes alone are enough
    assert tj.mla_decode_work(sd(q.shape, q.dtype), sd(kv.shape, kv.dtype), sd(bt.shape, bt.dtype), sl,
                              kv_lora_rank=L) == w
    want = tj.mla_decode(q, kv, bt, sl, **kw)
    got = tj.mla_decode(q, kv, bt, sl, work=w, **kw)

    @jax.jit
    def step(q, kv, bt, sl):  # one work per step, shared by two "layers"
        w = tj.mla_decode_work(q, kv, bt, sl, kv_lora_rank=L)
        return [tj.mla_decode(q, kv, bt, sl, work=w, **kw) for _ in range(2)]

    for g in [got, *step(q, kv, bt, sl)]:
        for a, b in zip(g, want):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # under vmap the call folds the mapped axis into its batch (and computes its own work)
    v = jax.vmap(lambda q: tj.mla_decode(q, kv, bt, sl, work=w, **kw))(jnp.stack([q, q]))
    np.testing.assert_array_equal(np.asarray(v[0][1], np.float32), np.asarray(want[0], np.float32))


def test_work_is_a_pytree_through_jit_and_scan(rng):
    q, kv, bt, sl = ref.make_decode_inputs(rng, seq_lens=[4, 30], S=1, H=2, L=L, R=R, page_size=16, dtype="float32")
    w = tj.mla_decode_work(q, kv, bt, sl, kv_lora_rank=L)

    @jax.jit
    def layers(w, q):
        def body(x, _):
            return x + tj.mla_decode(q, kv, bt, sl, softmax_scale=0.2, kv_lora_rank=L, work=w), None

        return jax.lax.scan(body, jnp.zeros(q.shape[:3] + (L,), q.dtype), None, length=3)[0]

    want = 3 * tj.mla_decode(q, kv, bt, sl, softmax_scale=0.2, kv_lora_rank=L)
    np.testing.assert_allclose(np.asarray(layers(w, q)), np.asarray(want), rtol=1e-6)


# ----------------------------------------------------------------------------------------------- sm90
def _record_kernel(monkeypatch) -> list:
    """Replace ``tokenspeed_jax.ffi.custom_call``: each launch of the sm90 decode records the schedule it receives
    (operands 6 and 7: ``cta``, ``req``) through a host callback and returns zeros (the schedule kernel's call, the
    CUDA branch of ``decode_schedule``, returns zeros: on this CPU the jnp branch runs)."""
    seen = []

    def fake_call(target, launch, *, outputs, compile_key, **kw):
        if target != "mla_decode_sm90":  # the schedule kernel's call: traced for CUDA only, never run here
            return lambda *a: [jnp.zeros(o.shape, o.dtype) for o in outputs]

        def call(*inputs):
            jax.debug.callback(lambda c, r: seen.append((np.asarray(c), np.asarray(r))), inputs[6], inputs[7])
            return [jnp.zeros(o.shape, o.dtype) for o in outputs]

        return call

    monkeypatch.setattr("tokenspeed_jax.ffi.custom_call", fake_call)
    return seen


def _lowering_kernel(monkeypatch):
    """Replace ``tokenspeed_jax.ffi.custom_call`` by a plain FFI call of the same name (lowers for CUDA here, no
    CuTe DSL compile)."""

    def fake_call(target, launch, *, outputs, compile_key, **kw):
        return lambda *a: jax.ffi.ffi_call("tokenspeed_" + target, list(outputs))(*a)

    monkeypatch.setattr("tokenspeed_jax.ffi.custom_call", fake_call)


def _problem(B, S, H, page, max_pages, dtype, num_pages=40):
    return DecodeProblem(batch=B, q_len=S, num_heads=H, head_dim=576, kv_lora_rank=512, page_size=page,
                         num_pages=num_pages, max_pages=max_pages, dtype=dtype, causal=True, return_lse=False,
                         target=Target("cuda", "sm_90a", 132))


def _sm90_args(B, S, H, page, max_pages, dtype, num_pages=40):
    return (jnp.zeros((B, S, H, 576), dtype), jnp.zeros((num_pages, page, 576), dtype),
            jnp.zeros((B, max_pages), jnp.int32))


@pytest.mark.parametrize("B,S,H,page,max_pages,dtype", [(5, 1, 16, 64, 12, "bfloat16"),
                                                        (3, 3, 128, 16, 40, "float8_e4m3fn"),
                                                        (130, 2, 8, 32, 4, "float16")])
def test_sm90_work_is_the_schedule_the_kernel_gets(monkeypatch, rng, B, S, H, page, max_pages, dtype):
    pytest.importorskip("cutlass")  # (the sm90 backend's supports() needs it)
    from tokenspeed_jax.backends import sm90_decode

    seen = _record_kernel(monkeypatch)
    cap = max_pages * page
    sl = rng.integers(0, cap + 1, B).astype(np.int32)
    sl[0], sl[-1] = 0, cap + 1000  # an empty request; one past the capacity (clamped)
    sl = jnp.asarray(sl)
    q, kv, bt = _sm90_args(B, S, H, page, max_pages, dtype)
    p = _problem(B, S, H, page, max_pages, dtype)
    with target_override("sm_90a"):
        w = tj.mla_decode_work(q, kv, bt, sl, backend="sm90")
        assert tj.mla_decode_work(sd(q.shape, q.dtype), kv, bt, sl).backend == "sm90"  # auto picks it
        tj.mla_decode(q, kv, bt, sl, softmax_scale=0.1, backend="sm90", work=w)
        tj.mla_decode(q, kv, bt, sl, softmax_scale=0.1, backend="sm90")
        # the same work for another cache size (the schedule does not depend on it)
        q2, kv2, bt2 = _sm90_args(B, S, H, page, max_pages, dtype, num_pages=7)
        tj.mla_decode(q2, kv2, bt2, sl, softmax_scale=0.1, backend="sm90", work=w)
    want = sm90_decode.schedule_of(p, jnp.clip(sl, 0, cap))
    assert w.backend == "sm90" and w.key == sm90_decode.work_key(p) and w.sharding is None
    assert [a.shape for a in w.arrays] == [(w.key[1].num_ctas, 8), (B, 2)]
    for got in [w.arrays, *seen]:
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert len(seen) == 3


def test_sm90_shared_work_is_computed_once_outside_the_loop(monkeypatch):
    """A program that computes one work and runs the decode in a scan over layers holds one schedule, outside the
    while loop; without ``work`` it holds the schedule inside the loop body (the check can fail)."""
    pytest.importorskip("cutlass")
    from tokenspeed_jax.backends import sm90_decode

    _lowering_kernel(monkeypatch)
    args = (sd((4, 2, 16, 576), jnp.bfloat16), sd((64, 64, 576), jnp.bfloat16), sd((4, 9), jnp.int32),
            sd((4,), jnp.int32))
    G = sm90_decode.work_key(_problem(4, 2, 16, 64, 9, "bfloat16"))[1].num_ctas

    def program(shared):
        def f(q, kv, bt, sl):
            w = tj.mla_decode_work(q, kv, bt, sl, backend="sm90") if shared else None

            def layer(x, i):
                return x + tj.mla_decode(q, kv, bt + i, sl, softmax_scale=0.1, backend="sm90", work=w), None

            return jax.lax.scan(layer, jnp.zeros((4, 2, 16, 512), jnp.bfloat16), jnp.arange(3))[0]

        with target_override("sm_90a"):
            return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))

    assert schedule_sites(program(True), G) == [0]
    assert schedule_sites(program(False), G) == [1]


def test_work_check_evaluates_the_schedule_once(monkeypatch):
    """``mla_decode(work=)`` checks the work's arrays against the shapes of the backend's ``decode_work``, an
    abstract evaluation of the schedule done once per backend and problem in a process: not again for every layer
    of a step, nor when another step (or the same one in a new trace) checks a work of the same problem."""
    pytest.importorskip("cutlass")
    from tokenspeed_jax import decode as D
    from tokenspeed_jax.backends import sm90 as S

    _lowering_kernel(monkeypatch)
    calls = []
    orig = S.Sm90Backend.decode_work

    def counting(self, problem, seq_lens):
        calls.append(problem)
        return orig(self, problem, seq_lens)

    monkeypatch.setattr(S.Sm90Backend, "decode_work", counting)
    D._work_shapes.cache_clear()
    args = (sd((4, 2, 16, 576), jnp.bfloat16), sd((64, 64, 576), jnp.bfloat16), sd((4, 9), jnp.int32),
            sd((4,), jnp.int32))

    def step(q, kv, bt, sl):
        w = tj.mla_decode_work(q, kv, bt, sl, backend="sm90")
        return [tj.mla_decode(q, kv, bt, sl, softmax_scale=0.1, backend="sm90", work=w) for _ in range(3)]

    with target_override("sm_90a"):
        jax.jit(step).trace(*args)
        assert len(calls) == 2  # the work, and the check's shapes (once for the three layers)
        jax.jit(lambda *a: step(*a)).trace(*args)  # another traced step: its own work, the check remembered
        assert len(calls) == 3


def test_work_errors(monkeypatch, rng):
    pytest.importorskip("cutlass")
    _record_kernel(monkeypatch)
    kw = dict(softmax_scale=0.1)
    sl = jnp.asarray([3, 70, 0], jnp.int32)
    q, kv, bt = _sm90_args(3, 1, 16, 64, 4, "bfloat16")
    with target_override("sm_90a"):
        w = tj.mla_decode_work(q, kv, bt, sl)
        w_xla = tj.mla_decode_work(q, kv, bt, sl, backend="xla")
        with pytest.raises(TypeError, match=r"^work: expected a DecodeWork from tokenspeed_jax.mla_decode_work, "
                                            r"got tuple"):
            tj.mla_decode(q, kv, bt, sl, work=w.arrays, **kw)
        with pytest.raises(ValueError, match=r"^work: built for backend 'xla', this call runs on backend 'sm90'"):
            tj.mla_decode(q, kv, bt, sl, work=w_xla, **kw)
        with pytest.raises(ValueError, match=r"^work: built for backend 'sm90', this call runs on backend 'xla'"):
            tj.mla_decode(q, kv, bt, sl, work=w, backend="xla", **kw)
        # another problem: a wider table (another capacity), more heads (another grid), another batch
        q5, kv5, bt5 = _sm90_args(3, 1, 16, 64, 5, "bfloat16")
        with pytest.raises(ValueError, match=r"^work: built for a different problem: its key is \(3, "
                                             r"ScheduleSpec\(num_ctas=132, capacity=256,.* this call needs \(3, "
                                             r"ScheduleSpec\(num_ctas=132, capacity=320"):
            tj.mla_decode(q5, kv5, bt5, sl, work=w, **kw)
        qh, kvh, bth = _sm90_args(3, 1, 128, 64, 4, "bfloat16")
        with pytest.raises(ValueError, match=r"^work: built for a different problem.*num_ctas=66"):
            tj.mla_decode(qh, kvh, bth, sl, work=w, **kw)
        q2, kv2, bt2 = _sm90_args(2, 1, 16, 64, 4, "bfloat16")
        with pytest.raises(ValueError, match=r"^work: built for a different problem: its key is \(3, .* needs \(2,"):
            tj.mla_decode(q2, kv2, bt2, sl[:2], work=w, **kw)
        # wrong arrays under the right key
        bad = dataclasses.replace(w, arrays=(w.arrays[0][:-1], w.arrays[1]))
        with pytest.raises(ValueError, match=r"^work: expected arrays \(shape, dtype\) \[\(\(132, 8\), 'int32'\), "
                                             r"\(\(3, 2\), 'int32'\)\] for this call, got \[\(\(131, 8\)"):
            tj.mla_decode(q, kv, bt, sl, work=bad, **kw)
        with pytest.raises(ValueError, match=r"^work: expected arrays .* got \[\(\(132, 8\), 'int32'\)\]$"):
            tj.mla_decode(q, kv, bt, sl, work=dataclasses.replace(w, arrays=w.arrays[:1]), **kw)
        with pytest.raises(ValueError, match=r"^work: backend 'xla' has no per-step work, got 2 arrays"):
            tj.mla_decode(q, kv, bt, sl, backend="xla", work=dataclasses.replace(w_xla, arrays=w.arrays), **kw)
        with pytest.raises(ValueError, match=r"^work: built by tokenspeed_jax.sharding.sharded_mla_decode_work"):
            tj.mla_decode(q, kv, bt, sl, work=dataclasses.replace(w, sharding=(None, None, "data")), **kw)
        with pytest.raises(TypeError, match=r"^seq_lens: expected the step's lengths as an array"):
            tj.mla_decode_work(q, kv, bt, sd((3,), jnp.int32))
        with pytest.raises(ValueError, match=r"^backend: expected a backend that can run this call"):
            tj.mla_decode_work(q, kv, bt, sl, kv_lora_rank=448, backend="sm90")


def test_sm90_batch_invariant_work(monkeypatch, rng):
    """``batch_invariant=True``: the work is the batch-invariant schedule (``schedule_of`` of the problem with
    ``batch_invariant``), the kernel gets it with and without ``work``; a work of one mode is refused by a call of the
    other, naming ``work``, on sm90 and on xla; a non-bool is refused naming ``batch_invariant``."""
    pytest.importorskip("cutlass")
    from tokenspeed_jax.backends import sm90_decode

    seen = _record_kernel(monkeypatch)
    B, S, H, page, max_pages = 6, 2, 16, 64, 200
    cap = max_pages * page
    sl = jnp.asarray(rng.integers(0, cap + 1, B).astype(np.int32))
    q, kv, bt = _sm90_args(B, S, H, page, max_pages, "bfloat16")
    kw = dict(softmax_scale=0.1, backend="sm90")
    p = dataclasses.replace(_problem(B, S, H, page, max_pages, "bfloat16"), batch_invariant=True)
    with target_override("sm_90a"):
        w = tj.mla_decode_work(q, kv, bt, sl, backend="sm90", batch_invariant=True)
        w0 = tj.mla_decode_work(q, kv, bt, sl, backend="sm90")
        tj.mla_decode(q, kv, bt, sl, work=w, batch_invariant=True, **kw)
        tj.mla_decode(q, kv, bt, sl, batch_invariant=True, **kw)
        assert w.batch_invariant and not w0.batch_invariant
        assert w.key == sm90_decode.work_key(p) and w.key[1].chunk == sm90_decode.invariant_chunk(p)
        with pytest.raises(ValueError, match=r"^work: built with batch_invariant=True, this call has "
                                             r"batch_invariant=False"):
            tj.mla_decode(q, kv, bt, sl, work=w, **kw)
        with pytest.raises(ValueError, match=r"^work: built with batch_invariant=False, this call has "
                                             r"batch_invariant=True"):
            tj.mla_decode(q, kv, bt, sl, work=w0, batch_invariant=True, **kw)
        with pytest.raises(TypeError, match=r"batch_invariant"):
            tj.mla_decode(q, kv, bt, sl, batch_invariant=1, **kw)
        with pytest.raises(TypeError, match=r"batch_invariant"):
            tj.mla_decode_work(q, kv, bt, sl, batch_invariant="yes")
    want = sm90_decode.schedule_of(p, sl)
    assert len(seen) == 2
    for got in [w.arrays, *seen]:
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert (np.asarray(want[0])[:, 6] == -1).all()  # (the invariant schedule's mark: no work list)
    # xla: accepted (the reference has no schedule), the work's mode checked all the same
    qx, kvx, btx, slx = ref.make_decode_inputs(rng, seq_lens=[5, 40], S=1, H=2, L=L, R=R, page_size=16,
                                               dtype="float32")
    wx = tj.mla_decode_work(qx, kvx, btx, slx, kv_lora_rank=L, batch_invariant=True)
    a = tj.mla_decode(qx, kvx, btx, slx, softmax_scale=0.2, kv_lora_rank=L, work=wx, batch_invariant=True)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(tj.mla_decode(qx, kvx, btx, slx, softmax_scale=0.2,
                                                                          kv_lora_rank=L)))
    with pytest.raises(ValueError, match=r"^work: built with batch_invariant=True"):
        tj.mla_decode(qx, kvx, btx, slx, softmax_scale=0.2, kv_lora_rank=L, work=wx)


# --------------------------------------------------------------------------------------------- sharding
needs8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (virtual) devices")


@needs8
@pytest.mark.parametrize("head_axis,batch_axis", [("model", None), (None, "data"), ("model", "data")])
def test_sharded_work_xla_bitwise(rng, head_axis, batch_axis):
    q, kv, bt, sl = ref.make_decode_inputs(rng, seq_lens=[5, 40, 0, 7], S=2, H=8, L=L, R=R, page_size=16,
                                           dtype="bfloat16")
    m = _mesh((2, 4), ("data", "model"))
    kw = dict(mesh=m, head_axis=head_axis, batch_axis=batch_axis, cache_sharding="replicated", kv_lora_rank=L)
    w = tsh.sharded_mla_decode_work(q, kv, bt, sl, **kw)
    assert w == tj.DecodeWork((), "xla", None, (m, head_axis, batch_axis))
    got = tsh.sharded_mla_decode(q, kv, bt, sl, softmax_scale=0.2, return_lse=True, work=w, **kw)
    want = tsh.sharded_mla_decode(q, kv, bt, sl, softmax_scale=0.2, return_lse=True, **kw)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _sharded_sm90_case(rng, B, S, H, page, maxp):
    """A (data 4 x model 2) mesh, bf16 sm90 decode inputs of 16 pages with random lengths up to the capacity,
    and the sharded call's keywords (heads over ``model``, requests over ``data``)."""
    m = _mesh((4, 2), ("data", "model"))
    q, kv, bt = _sm90_args(B, S, H, page, maxp, "bfloat16", num_pages=16)
    sl = jnp.asarray(rng.integers(0, maxp * page + 1, B).astype(np.int32))
    return m, q, kv, bt, sl, dict(mesh=m, head_axis="model", batch_axis="data", backend="sm90")


@needs8
def test_sharded_work_sm90_is_each_shards_schedule(monkeypatch, rng):
    """Data parallel: shard ``d`` of the work is the schedule of its own requests (leading axis split over the batch
    axis); tensor parallel: the replicated schedule of ``H / n`` heads; the sharded call lowers with it and holds
    no schedule of its own."""
    pytest.importorskip("cutlass")
    from tokenspeed_jax.backends import sm90_decode

    B, S, H, page, maxp, n = 8, 1, 64, 64, 6, 4
    m, q, kv, bt, sl, kw = _sharded_sm90_case(rng, B, S, H, page, maxp)
    _record_kernel(monkeypatch)  # (eager here: the schedule's CUDA branch is traced, not compiled)
    with target_override("sm_90a"):
        w = tsh.sharded_mla_decode_work(q, kv, bt, sl, **kw)
        w_tp = tsh.sharded_mla_decode_work(q, kv, bt, sl, mesh=m, head_axis="model", backend="sm90")
    local = _problem(B // n, S, H // 2, page, maxp, "bfloat16", num_pages=4)
    assert w.key == sm90_decode.work_key(local) and w.sharding == (m, "model", "data")
    assert [a.shape for a in w.arrays] == [(n, w.key[1].num_ctas, 8), (n, B // n, 2)]
    assert all(a.sharding.is_equivalent_to(NamedSharding(m, P("data")), a.ndim) for a in w.arrays)
    for d in range(n):
        want = sm90_decode.schedule_of(local, sl[d * 2:(d + 1) * 2])
        for a, b in zip(w.arrays, want):
            np.testing.assert_array_equal(np.asarray(a[d]), np.asarray(b))
    tp = _problem(B, S, H // 2, page, maxp, "bfloat16")
    assert w_tp.key == sm90_decode.work_key(tp)
    for a, b in zip(w_tp.arrays, sm90_decode.schedule_of(tp, sl)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    _lowering_kernel(monkeypatch)

    def f(q, kv, bt, sl, w):
        return tsh.sharded_mla_decode(q, kv, bt, sl, softmax_scale=0.1, cache_sharding="pages", work=w, **kw)

    with target_override("sm_90a"):
        lo = jax.jit(f).trace(q, kv, bt, sl, w).lower(lowering_platforms=("cuda",))
    assert "custom_call @tokenspeed_mla_decode_sm90" in lo.as_text()
    assert schedule_sites(lo, w.key[1].num_ctas) == []


@needs8
def test_sharded_work_errors(rng):
    q, kv, bt, sl = ref.make_decode_inputs(rng, seq_lens=[5, 40, 0, 7], S=1, H=8, L=L, R=R, page_size=16,
                                           dtype="float32")
    m = _mesh((2, 4), ("data", "model"))
    kw = dict(softmax_scale=0.2, kv_lora_rank=L, cache_sharding="replicated")
    w = tsh.sharded_mla_decode_work(q, kv, bt, sl, mesh=m, batch_axis="data", cache_sharding="replicated",
                                    kv_lora_rank=L)
    with pytest.raises(ValueError, match=r"^work: built by mla_decode_work for an unsharded call"):
        tsh.sharded_mla_decode(q, kv, bt, sl, mesh=m, batch_axis="data", work=tj.mla_decode_work(q, kv, bt, sl,
                                                                                                   kv_lora_rank=L),
                               **kw)
    with pytest.raises(ValueError, match=r"^work: built for head_axis=None, batch_axis='data' on its mesh, this "
                                         r"call has head_axis='model', batch_axis=None"):
        tsh.sharded_mla_decode(q, kv, bt, sl, mesh=m, head_axis="model", work=w, **kw)
    with pytest.raises(TypeError, match=r"^work: expected a DecodeWork from .*sharded_mla_decode_work, got dict"):
        tsh.sharded_mla_decode(q, kv, bt, sl, mesh=m, batch_axis="data", work={}, **kw)
    with pytest.raises(ValueError, match=r"^q: expected B \(q axis 0\) to be a multiple"):
        tsh.sharded_mla_decode_work(q[:3], kv, bt[:3], sl[:3], mesh=m, batch_axis="model", kv_lora_rank=L)
    with pytest.raises(TypeError, match=r"^seq_lens: expected the step's lengths as an array"):
        tsh.sharded_mla_decode_work(q, kv, bt, sd((4,), jnp.int32), mesh=m, batch_axis="data", kv_lora_rank=L)


def test_batch_invariant_refused_without_the_mode(monkeypatch, rng):
    """A backend without ``decode_batch_invariant`` (sm100) refuses ``batch_invariant=True`` naming it, in both
    ``mla_decode`` and ``mla_decode_work``; the default mode is untouched."""
    from tokenspeed_jax.backends import xla

    q, kv, bt, sl = ref.make_decode_inputs(rng, seq_lens=[5, 40], S=1, H=2, L=L, R=R, page_size=16, dtype="float32")
    monkeypatch.delattr(xla.XlaBackend, "decode_batch_invariant")
    with pytest.raises(ValueError, match=r"^batch_invariant: backend 'xla' has no batch-invariant decode"):
        tj.mla_decode(q, kv, bt, sl, softmax_scale=0.2, kv_lora_rank=L, batch_invariant=True)
    with pytest.raises(ValueError, match=r"^batch_invariant: backend 'xla'"):
        tj.mla_decode_work(q, kv, bt, sl, kv_lora_rank=L, batch_invariant=True)
    tj.mla_decode(q, kv, bt, sl, softmax_scale=0.2, kv_lora_rank=L)


@needs8
def test_sharded_batch_invariant_work(monkeypatch, rng):
    """``sharded_mla_decode_work(batch_invariant=True)``: shard ``d``'s work is the batch-invariant schedule of its
    own requests; a sharded call of the other mode refuses it naming ``work``; xla runs it bitwise as without."""
    pytest.importorskip("cutlass")
    from tokenspeed_jax.backends import sm90_decode

    B, S, H, page, maxp, n = 8, 1, 64, 64, 200, 4
    m, q, kv, bt, sl, kw = _sharded_sm90_case(rng, B, S, H, page, maxp)
    _record_kernel(monkeypatch)  # (eager here: the schedule's CUDA branch is traced, not compiled)
    with target_override("sm_90a"):
        w = tsh.sharded_mla_decode_work(q, kv, bt, sl, batch_invariant=True, **kw)
    local = dataclasses.replace(_problem(B // n, S, H // 2, page, maxp, "bfloat16", num_pages=4),
                                batch_invariant=True)
    assert w.batch_invariant and w.key == sm90_decode.work_key(local) and w.key[1].chunk > 0
    for d in range(n):
        for a, b in zip(w.arrays, sm90_decode.schedule_of(local, sl[d * 2:(d + 1) * 2])):
            np.testing.assert_array_equal(np.asarray(a[d]), np.asarray(b))
    _lowering_kernel(monkeypatch)
    with target_override("sm_90a"):
        with pytest.raises(ValueError, match=r"^work: built with batch_invariant=True, this call has "
                                             r"batch_invariant=False"):
            tsh.sharded_mla_decode(q, kv, bt, sl, softmax_scale=0.1, work=w, **kw)
        lo = jax.jit(lambda q, kv, bt, sl, w: tsh.sharded_mla_decode(
            q, kv, bt, sl, softmax_scale=0.1, work=w, batch_invariant=True, **kw)).trace(q, kv, bt, sl, w).lower(
            lowering_platforms=("cuda",))
    assert "custom_call @tokenspeed_mla_decode_sm90" in lo.as_text()
    # xla: the flag is carried and accepted
    qx, kvx, btx, slx = ref.make_decode_inputs(rng, seq_lens=[5, 40, 0, 7], S=2, H=8, L=L, R=R, page_size=16,
                                               dtype="float32")
    kx = dict(mesh=m, head_axis="model", batch_axis="data", cache_sharding="replicated", kv_lora_rank=L)
    wx = tsh.sharded_mla_decode_work(qx, kvx, btx, slx, batch_invariant=True, **kx)
    got = tsh.sharded_mla_decode(qx, kvx, btx, slx, softmax_scale=0.2, work=wx, batch_invariant=True, **kx)
    want = tsh.sharded_mla_decode(qx, kvx, btx, slx, softmax_scale=0.2, **kx)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
