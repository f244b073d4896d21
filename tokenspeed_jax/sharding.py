"""Run :func:`~tokenspeed_jax.mla_decode` and :func:`~tokenspeed_jax.mla_prefill` under ``jax.shard_map``.

Two ways to split a call over the axes of a :class:`jax.sharding.Mesh`; either or both may be used (a 2-D
mesh ``("data", "model")`` runs data parallel over one axis and tensor parallel over the other).  Mesh
axes a call does not name replicate the work.  The per-device call is the ordinary op on the local
shards, so every backend works unchanged (the kernels see a smaller B or H).

Decode (``sharded_mla_decode``)
    Tensor parallel, ``head_axis``: q ``[B, S, H, D]`` is split along H, so each device runs ``H / n``
    heads.  Absorbed MLA decode shares one latent KV stream among all heads, so the latent cache, the
    block table and the lengths are replicated; out is split along H, LSE along H.  H must be a multiple
    of the axis size.

    The per-step work (:func:`~tokenspeed_jax.mla_decode_work`, the sm90 schedule) is computed once per
    step by :func:`sharded_mla_decode_work` and passed as ``sharded_mla_decode(..., work=)``.  It is the
    work of each shard's local call (``H / n`` heads, ``B / n`` requests): with ``head_axis`` alone every
    device has the same lengths and the work is replicated; with ``batch_axis`` each shard's schedule cuts
    its own requests, so the work's arrays get a leading axis of the ``batch_axis`` size, split over it
    (shard ``d`` holds the schedule of its requests).

    Data parallel, ``batch_axis``: q, block_table and seq_lens are split along B (a multiple of the axis
    size; device ``d`` serves requests ``d * B/n .. (d+1) * B/n - 1``).  The cache is either

    * ``cache_sharding="pages"`` (default): split along pages; device ``d`` holds pages
      ``d * P/n .. (d+1) * P/n - 1`` of the global ``[P, page_size, D]`` cache, a request's pages must live
      on the device that serves it, and its block-table entries are **shard-local** page ids in
      ``[0, P/n)``.  :func:`localize_block_table` turns global ids into that form.  This is what a
      data-parallel serving stack does (each replica owns its KV pool);
    * ``cache_sharding="replicated"``: every device holds the whole cache and the table holds global ids.

Prefill (``sharded_mla_prefill``)
    Tensor parallel, ``head_axis``: q ``[Tq, Hq, Dqk]`` split along Hq; k/v split along Hk when Hk is a
    multiple of the axis size (contiguous head blocks keep query head ``h`` on the device of its KV head
    ``h // (Hq/Hk)``), replicated when ``Hk == 1``.

    Data parallel, ``batch_axis``: ragged batches have no batch axis, so the caller lays them out per
    shard: q/k/v are split into ``n`` equal slabs of rows along axis 0, slab ``d`` packs the requests of
    device ``d`` from its row 0 (rows past its last request are padding: 0 output / LSE -inf, never
    read as keys), and ``cu_seqlens_q`` / ``cu_seqlens_k`` are the ``n`` shard-local offset arrays of
    ``B_local + 1`` entries each, concatenated (shape ``[n * (B_local + 1)]``, each part starting at 0).
    :func:`split_varlen_batch` builds this layout from an ordinary packed batch and returns the row map
    back.

Scales are replicated runtime scalars (Python floats or traced float32 arrays) in both ops.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tokenspeed_jax import _checks as C
from tokenspeed_jax.backends import has_decode_work, select_backend
from tokenspeed_jax.decode import DecodeWork, _check_batch_invariant, _decode_problem, mla_decode, mla_decode_work
from tokenspeed_jax.prefill import mla_prefill

__all__ = ["localize_block_table", "sharded_mla_decode", "sharded_mla_decode_work", "sharded_mla_prefill",
           "split_varlen_batch"]


def _shard_map(f, mesh, in_specs, out_specs):
    """``jax.shard_map`` (jax >= 0.7), else ``jax.experimental.shard_map.shard_map`` (older jax).

    Replication checking is off: the ops are custom calls / custom_vmap wrappers whose outputs are all
    sharded along the named axes (or replicated by construction)."""
    sm = getattr(jax, "shard_map", None)
    if sm is not None:
        return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as legacy  # pragma: no cover (jax < 0.7)

    return legacy(f, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def _axis(mesh: Mesh, axis, name: str) -> int:
    """Size of a named mesh axis (1 for None), with a clear error for unknown names."""
    if axis is None:
        return 1
    if not isinstance(axis, str):
        raise TypeError(f"{name}: expected a mesh axis name (str) or None, got {type(axis).__name__}")
    if axis not in mesh.shape:
        raise ValueError(f"{name}: expected one of the mesh axes {tuple(mesh.shape)}, got {axis!r}")
    return mesh.shape[axis]


def _divisible(what: str, size: int, n: int, axis: str, argname: str) -> None:
    if size % n:
        raise ValueError(f"{argname}: expected {what} to be a multiple of the size of mesh axis {axis!r} "
                         f"({n}), got {size}")


def _decode_layout(q, kv_cache, block_table, seq_lens, mesh, head_axis, batch_axis, cache_sharding):
    """Check the arguments of a sharded decode; returns ``(nh, nb, pages)``: the head and batch axis sizes and
    whether the cache is split along pages."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    for x, n in ((q, "q"), (kv_cache, "kv_cache"), (block_table, "block_table"), (seq_lens, "seq_lens")):
        C.array(x, n)
    C.rank(q, "q", 4, "[B, S, H, D]")
    C.rank(kv_cache, "kv_cache", 3, "[num_pages, page_size, D]")
    C.rank(block_table, "block_table", 2, "[B, max_pages]")
    C.rank(seq_lens, "seq_lens", 1, "[B]")
    C.dim("block_table", "batch (axis 0) equal to q's B", block_table.shape[0], q.shape[0])
    C.dim("seq_lens", "batch (axis 0) equal to q's B", seq_lens.shape[0], q.shape[0])
    nh = _axis(mesh, head_axis, "head_axis")
    nb = _axis(mesh, batch_axis, "batch_axis")
    if head_axis is not None and head_axis == batch_axis:
        raise ValueError(f"batch_axis: expected a mesh axis other than head_axis, got {batch_axis!r} twice")
    if cache_sharding not in ("pages", "replicated"):
        raise ValueError(f"cache_sharding: expected 'pages' or 'replicated', got {cache_sharding!r}")
    if head_axis is not None:
        _divisible("H (q axis 2)", q.shape[2], nh, head_axis, "q")
    pages = batch_axis is not None and cache_sharding == "pages"
    if batch_axis is not None:
        _divisible("B (q axis 0)", q.shape[0], nb, batch_axis, "q")
    if pages:
        _divisible("num_pages (axis 0)", kv_cache.shape[0], nb, batch_axis, "kv_cache")
    return nh, nb, pages


def sharded_mla_decode_work(
    q,
    kv_cache,
    block_table,
    seq_lens: jax.Array,
    *,
    mesh: Mesh,
    head_axis: str | None = None,
    batch_axis: str | None = None,
    cache_sharding: str = "pages",
    causal: bool = True,
    kv_lora_rank: int = 512,
    backend: str = "auto",
    batch_invariant: bool = False,
) -> DecodeWork:
    """The per-step work of :func:`sharded_mla_decode` (module docstring): each shard's
    :func:`~tokenspeed_jax.mla_decode_work` of its local call, computed under ``shard_map`` once per decode
    step and passed to every layer as ``sharded_mla_decode(..., work=)``.

    Args: as :func:`sharded_mla_decode` (global shapes; q / kv_cache / block_table may be
    ``jax.ShapeDtypeStruct`` s, only their shapes and dtypes are read; ``seq_lens`` are the step's lengths).

    Returns a :class:`~tokenspeed_jax.DecodeWork` for this mesh and these axes: with ``batch_axis``, arrays with a
    leading axis of the axis size split over it (shard ``d``: the work of its requests); without, the
    replicated work of the local call.  Backends without per-step work return an empty one.
    """
    if isinstance(seq_lens, jax.ShapeDtypeStruct):
        raise TypeError("seq_lens: expected the step's lengths as an array (the work is computed from their "
                        "values), got a jax.ShapeDtypeStruct")
    nh, nb, pages = _decode_layout(q, kv_cache, block_table, seq_lens, mesh, head_axis, batch_axis, cache_sharding)
    causal = C.static_bool(causal, "causal")
    kv_lora_rank = C.static_pos_int(kv_lora_rank, "kv_lora_rank")
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a backend name or 'auto', got {type(backend).__name__}")
    sd = jax.ShapeDtypeStruct
    B, S, H, D = q.shape
    P_, ps, Dk = kv_cache.shape
    local = (sd((B // nb, S, H // nh, D), q.dtype), sd((P_ // nb if pages else P_, ps, Dk), kv_cache.dtype),
             sd((B // nb, block_table.shape[1]), block_table.dtype))
    problem = _decode_problem(*local, sd((B // nb,), seq_lens.dtype), causal, kv_lora_rank, False, batch_invariant)
    impl = select_backend("decode", problem, backend)
    _check_batch_invariant(impl, problem)
    layout = (mesh, head_axis, batch_axis)
    if not has_decode_work(impl):
        return DecodeWork((), impl.name, None, layout, problem.batch_invariant)
    fn = _work_fn(mesh, batch_axis, local, causal, kv_lora_rank, impl.name, problem.batch_invariant)
    return DecodeWork(tuple(fn(seq_lens)), impl.name, impl.decode_work_key(problem), layout, problem.batch_invariant)


@functools.lru_cache(maxsize=256)
def _work_fn(mesh, batch_axis, local, causal, kv_lora_rank, backend, batch_invariant=False):
    """One jitted shard_map computing each shard's work from its lengths (leading axis over ``batch_axis``)."""
    spec = P(batch_axis)

    def per_shard(sl):
        w = mla_decode_work(*local, sl, causal=causal, kv_lora_rank=kv_lora_rank, backend=backend,
                            batch_invariant=batch_invariant)
        return tuple(a[None] for a in w.arrays) if batch_axis is not None else w.arrays

    out_shapes = jax.eval_shape(
        lambda sl: mla_decode_work(*local, sl, causal=causal, kv_lora_rank=kv_lora_rank, backend=backend,
                                   batch_invariant=batch_invariant).arrays,
        jax.ShapeDtypeStruct(local[2].shape[:1], jax.numpy.int32))
    mapped = _shard_map(per_shard, mesh, (spec,), tuple(spec if batch_axis is not None else P() for _ in out_shapes))

    @jax.jit
    def run(sl):
        with jax.named_scope("tokenspeed_sharded_mla_decode_work"):
            return mapped(sl)

    return run


def _sharded_work(work, mesh, head_axis, batch_axis, nb, batch_invariant=False):
    """``(arrays, (backend, key, count))`` of ``work`` for a sharded call, or ``((), None)`` without one; a
    ``TypeError`` / ``ValueError`` naming ``work`` when it was built for another layout."""
    if work is None:
        return (), None
    if not isinstance(work, DecodeWork):
        raise TypeError("work: expected a DecodeWork from tokenspeed_jax.sharding.sharded_mla_decode_work, got "
                        f"{type(work).__name__}")
    if work.sharding is None:
        raise ValueError("work: built by mla_decode_work for an unsharded call; build the work of a sharded call "
                         "with tokenspeed_jax.sharding.sharded_mla_decode_work (the same mesh and axes)")
    if work.sharding != (mesh, head_axis, batch_axis):
        _, wh, wb = work.sharding
        raise ValueError(f"work: built for head_axis={wh!r}, batch_axis={wb!r} on its mesh, this call has "
                         f"head_axis={head_axis!r}, batch_axis={batch_axis!r} on mesh {dict(mesh.shape)}; build it "
                         "with sharded_mla_decode_work and this call's mesh and axes")
    if work.batch_invariant != batch_invariant:
        raise ValueError(f"work: built with batch_invariant={work.batch_invariant}, this call has batch_invariant="
                         f"{batch_invariant}; build it with the batch_invariant of the calls that use it")
    arrays = tuple(work.arrays)
    if batch_axis is not None:
        for a in arrays:
            if not a.shape or a.shape[0] != nb:
                raise ValueError(f"work: expected arrays with a leading axis of the size of mesh axis {batch_axis!r} "
                                 f"({nb}), got shape {tuple(a.shape)}")
    return arrays, (work.backend, work.key, len(arrays))


def sharded_mla_decode(
    q: jax.Array,
    kv_cache: jax.Array,
    block_table: jax.Array,
    seq_lens: jax.Array,
    *,
    mesh: Mesh,
    head_axis: str | None = None,
    batch_axis: str | None = None,
    cache_sharding: str = "pages",
    softmax_scale: float | jax.Array,
    output_scale: float | jax.Array = 1.0,
    causal: bool = True,
    kv_lora_rank: int = 512,
    return_lse: bool = False,
    backend: str = "auto",
    work: DecodeWork | None = None,
    batch_invariant: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """:func:`~tokenspeed_jax.mla_decode` with heads split over ``head_axis`` (tensor parallel) and/or
    requests split over ``batch_axis`` (data parallel); see the module docstring for the layouts.

    Args:
      q, kv_cache, block_table, seq_lens: as in ``mla_decode`` (global shapes).  With ``batch_axis`` and
        ``cache_sharding="pages"`` the block table holds shard-local page ids (:func:`localize_block_table`).
      mesh: the device mesh.  head_axis / batch_axis: mesh axis names, or None.
      cache_sharding: ``"pages"`` (split the cache along pages over ``batch_axis``) or ``"replicated"``.
        Ignored without ``batch_axis`` (tensor parallel always replicates the latent cache).
      softmax_scale, output_scale, causal, kv_lora_rank, return_lse, backend, batch_invariant: as in
        ``mla_decode`` (``batch_invariant``: each shard's call is batch-invariant over its own requests).
      work: the step's work from :func:`sharded_mla_decode_work` (same mesh, axes and arguments), shared by
        every layer; None computes it inside each shard's call.  Bitwise the same result either way.

    Returns:
      ``out [B, S, H, kv_lora_rank]`` (or ``(out, lse)``) sharded along B over ``batch_axis`` and along H
      over ``head_axis``.
    """
    nh, nb, pages = _decode_layout(q, kv_cache, block_table, seq_lens, mesh, head_axis, batch_axis, cache_sharding)
    C.static_bool(return_lse, "return_lse")
    ss = C.f32_scalar(softmax_scale, "softmax_scale")
    os_ = C.f32_scalar(output_scale, "output_scale")

    causal = C.static_bool(causal, "causal")
    kv_lora_rank = C.static_pos_int(kv_lora_rank, "kv_lora_rank")
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a backend name or 'auto', got {type(backend).__name__}")
    batch_invariant = C.static_bool(batch_invariant, "batch_invariant")
    arrays, meta = _sharded_work(work, mesh, head_axis, batch_axis, nb, batch_invariant)
    fn = _decode_fn(mesh, head_axis, batch_axis, pages, causal, kv_lora_rank, bool(return_lse), backend, meta,
                    batch_invariant)
    return fn(q, kv_cache, block_table, seq_lens, ss, os_, arrays)


@functools.lru_cache(maxsize=256)
def _decode_fn(mesh, head_axis, batch_axis, pages, causal, kv_lora_rank, return_lse, backend, work_meta=None,
               batch_invariant=False):
    """One jitted shard_map per static configuration (eager shard_map would dispatch op by op); ``work_meta``:
    ``(backend, key, number of arrays)`` of the work passed in, or None."""
    q_spec = P(batch_axis, None, head_axis, None)
    kv_spec = P(batch_axis, None, None) if pages else P()
    out_specs = q_spec if not return_lse else (q_spec, P(batch_axis, None, head_axis))
    n_work = 0 if work_meta is None else work_meta[2]
    w_spec = P(batch_axis) if batch_axis is not None else P()
    in_specs = (q_spec, kv_spec, P(batch_axis, None), P(batch_axis), P(), P(), (w_spec,) * n_work)

    def local(q, kv, bt, sl, ss, os_, arrays):
        work = None
        if work_meta is not None:
            if batch_axis is not None:
                arrays = tuple(a[0] for a in arrays)
            work = DecodeWork(tuple(arrays), work_meta[0], work_meta[1], batch_invariant=batch_invariant)
        return mla_decode(q, kv, bt, sl, softmax_scale=ss, output_scale=os_, causal=causal,
                          kv_lora_rank=kv_lora_rank, return_lse=return_lse, backend=backend, work=work,
                          batch_invariant=batch_invariant)

    mapped = _shard_map(local, mesh, in_specs, out_specs)

    @jax.jit
    def run(*args):
        with jax.named_scope("tokenspeed_sharded_mla_decode"):
            return mapped(*args)

    return run


def sharded_mla_prefill(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    *,
    mesh: Mesh,
    head_axis: str | None = None,
    batch_axis: str | None = None,
    softmax_scale: float | jax.Array,
    causal: bool = True,
    return_lse: bool = False,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    backend: str = "auto",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """:func:`~tokenspeed_jax.mla_prefill` with heads split over ``head_axis`` and/or per-shard ragged
    batches over ``batch_axis`` (layout in the module docstring; :func:`split_varlen_batch` builds it).

    Without ``batch_axis`` the cu_seqlens are the ordinary ``[B + 1]`` offsets (replicated).  With it they
    are ``[n * (B_local + 1)]`` shard-local offsets and q/k/v rows are ``n`` equal per-shard slabs.
    max_seqlen_* are per-request hints, valid for every shard.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    for x, n in ((q, "q"), (k, "k"), (v, "v"), (cu_seqlens_q, "cu_seqlens_q"),
                 (cu_seqlens_k, "cu_seqlens_k")):
        C.array(x, n)
    C.rank(q, "q", 3, "[Tq, Hq, Dqk]")
    C.rank(k, "k", 3, "[Tk, Hk, Dqk]")
    C.rank(v, "v", 3, "[Tk, Hk, Dv]")
    C.rank(cu_seqlens_q, "cu_seqlens_q", 1, "[B + 1]")
    C.rank(cu_seqlens_k, "cu_seqlens_k", 1, "[B + 1]")
    nh = _axis(mesh, head_axis, "head_axis")
    nb = _axis(mesh, batch_axis, "batch_axis")
    if head_axis is not None and head_axis == batch_axis:
        raise ValueError(f"batch_axis: expected a mesh axis other than head_axis, got {batch_axis!r} twice")
    C.static_bool(return_lse, "return_lse")
    kv_head_axis = None
    if head_axis is not None:
        _divisible("Hq (q axis 1)", q.shape[1], nh, head_axis, "q")
        if k.shape[1] % nh == 0:
            kv_head_axis = head_axis
        elif k.shape[1] != 1:
            raise ValueError(f"k: expected Hk (axis 1) to be 1 or a multiple of the size of mesh axis "
                             f"{head_axis!r} ({nh}), got {k.shape[1]}")
    if batch_axis is not None:
        _divisible("Tq (axis 0, n equal per-shard slabs)", q.shape[0], nb, batch_axis, "q")
        _divisible("Tk (axis 0, n equal per-shard slabs)", k.shape[0], nb, batch_axis, "k")
        _divisible("length (n shard-local offset arrays)", cu_seqlens_q.shape[0], nb, batch_axis,
                   "cu_seqlens_q")
        _divisible("length (n shard-local offset arrays)", cu_seqlens_k.shape[0], nb, batch_axis,
                   "cu_seqlens_k")
    ss = C.f32_scalar(softmax_scale, "softmax_scale")

    causal = C.static_bool(causal, "causal")
    max_seqlen_q = C.static_pos_int(max_seqlen_q, "max_seqlen_q", allow_none=True)
    max_seqlen_k = C.static_pos_int(max_seqlen_k, "max_seqlen_k", allow_none=True)
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a backend name or 'auto', got {type(backend).__name__}")
    fn = _prefill_fn(mesh, head_axis, kv_head_axis, batch_axis, causal, bool(return_lse), max_seqlen_q,
                     max_seqlen_k, backend)
    return fn(q, k, v, cu_seqlens_q, cu_seqlens_k, ss)


@functools.lru_cache(maxsize=256)
def _prefill_fn(mesh, head_axis, kv_head_axis, batch_axis, causal, return_lse, max_seqlen_q, max_seqlen_k,
                backend):
    q_spec = P(batch_axis, head_axis, None)
    kv_spec = P(batch_axis, kv_head_axis, None)
    cu_spec = P(batch_axis)
    out_specs = q_spec if not return_lse else (q_spec, P(batch_axis, head_axis))

    def local(q, k, v, cq, ck, ss):
        return mla_prefill(q, k, v, cq, ck, softmax_scale=ss, causal=causal, return_lse=return_lse,
                           max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, backend=backend)

    mapped = _shard_map(local, mesh, (q_spec, kv_spec, kv_spec, cu_spec, cu_spec, P()), out_specs)

    @jax.jit
    def run(*args):
        with jax.named_scope("tokenspeed_sharded_mla_prefill"):
            return mapped(*args)

    return run


# ------------------------------------------------------------------------------- host-side layouts
def localize_block_table(block_table, *, num_pages: int, num_shards: int) -> np.ndarray:
    """Global page ids -> shard-local ids for data-parallel decode with a page-sharded cache.

    Request ``b`` is served by shard ``d = b // (B / num_shards)``, which holds global pages
    ``[d * P/n, (d+1) * P/n)``; its entries become ``id - d * P/n``.  Entries outside the shard's range are
    left as they are minus the offset (they are garbage either way: only pages a request uses are read, and
    those must be on its shard; ``mla_decode(validate=True)`` inside the shard reports violations).
    """
    bt = np.asarray(block_table)
    if bt.ndim != 2:
        raise ValueError(f"block_table: expected rank 2 [B, max_pages], got shape {bt.shape}")
    B = bt.shape[0]
    if B % num_shards or num_pages % num_shards:
        raise ValueError(f"num_shards: expected a divisor of B = {B} and num_pages = {num_pages}, "
                         f"got {num_shards}")
    per = num_pages // num_shards
    shard = np.arange(B) // (B // num_shards)
    return (bt - (shard * per)[:, None]).astype(bt.dtype)


def split_varlen_batch(q, k, v, cu_seqlens_q, cu_seqlens_k, *, num_shards: int):
    """Host-side re-layout of a packed ragged batch for data-parallel ``sharded_mla_prefill``.

    Requests are dealt to shards in contiguous groups of ``ceil(B / num_shards)`` (a short last group is
    padded with empty requests).  Returns ``(q, k, v, cu_seqlens_q, cu_seqlens_k, q_rows)`` where the
    arrays have the per-shard layout of the module docstring (equal slabs, padding rows of q zero and of
    k/v zero) and ``q_rows [Tq]`` maps each original q row to its row in the new layout, so
    ``out_global = out_sharded[q_rows]``.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    cq, ck = np.asarray(cu_seqlens_q).astype(np.int64), np.asarray(cu_seqlens_k).astype(np.int64)
    for cu, name, rows in ((cq, "cu_seqlens_q", q.shape[0]), (ck, "cu_seqlens_k", k.shape[0])):
        # host-side slicing: offsets must be real row ranges (the ops clamp; this copy would misplace rows)
        if cu.ndim != 1 or cu.shape[0] < 2 or cu[0] < 0 or np.any(np.diff(cu) < 0) or cu[-1] > rows:
            raise ValueError(f"{name}: expected [B + 1] non-decreasing offsets in [0, {rows}] (the array's "
                             f"rows), got {cu.tolist()[:16]}")
    if ck.shape != cq.shape:
        raise ValueError(f"cu_seqlens_k: expected the shape of cu_seqlens_q {cq.shape}, got {ck.shape}")
    B = len(cq) - 1
    n = int(num_shards)
    if n < 1:
        raise ValueError(f"num_shards: expected a positive int, got {num_shards!r}")
    bl = -(-B // n)
    groups = [list(range(d * bl, min(B, (d + 1) * bl))) for d in range(n)]
    tq = max(1, max(sum(int(cq[b + 1] - cq[b]) for b in g) for g in groups))
    tk = max(1, max(sum(int(ck[b + 1] - ck[b]) for b in g) for g in groups))
    out_q = np.zeros((n * tq,) + q.shape[1:], q.dtype)
    out_k = np.zeros((n * tk,) + k.shape[1:], k.dtype)
    out_v = np.zeros((n * tk,) + v.shape[1:], v.dtype)
    new_cq = np.zeros((n, bl + 1), np.int32)
    new_ck = np.zeros((n, bl + 1), np.int32)
    q_rows = np.zeros(int(cq[-1] - cq[0]), np.int64)
    for d, g in enumerate(groups):
        at_q = at_k = 0
        for i, b in enumerate(g):
            lq, lk = int(cq[b + 1] - cq[b]), int(ck[b + 1] - ck[b])
            out_q[d * tq + at_q:d * tq + at_q + lq] = q[cq[b]:cq[b + 1]]
            out_k[d * tk + at_k:d * tk + at_k + lk] = k[ck[b]:ck[b + 1]]
            out_v[d * tk + at_k:d * tk + at_k + lk] = v[ck[b]:ck[b + 1]]
            q_rows[cq[b] - cq[0]:cq[b + 1] - cq[0]] = d * tq + at_q + np.arange(lq)
            at_q, at_k = at_q + lq, at_k + lk
            new_cq[d, i + 1], new_ck[d, i + 1] = at_q, at_k
        new_cq[d, len(g) + 1:], new_ck[d, len(g) + 1:] = at_q, at_k
    return out_q, out_k, out_v, new_cq.reshape(-1), new_ck.reshape(-1), q_rows
