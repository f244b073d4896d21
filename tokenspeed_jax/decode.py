"""``mla_decode``: absorbed MLA decode and MTP (speculative) decode over a paged latent cache.

This docstring is the normative statement of the decode contract; other modules refer to it.

KV-cache row layout
    ``kv_cache[num_pages, page_size, D]`` with ``D = kv_lora_rank + rope_dim`` (576 = 512 + 64 for
    DeepSeek-R1).  Row ``r`` of a page holds ``[kv_c (kv_lora_rank) | k_pe (rope_dim)]`` of one token; V is
    the first ``kv_lora_rank`` values of the same row (vLLM's ``concat_and_cache_mla`` byte layout).  Token
    ``j`` of request ``b`` lives at ``kv_cache[block_table[b, j // page_size], j % page_size]``.

FP8 scale convention
    FP8 (e4m3) caches store ``x / k_scale``.  The caller folds every scale into the two runtime scalars:
    ``softmax_scale = scale * q_scale * k_scale`` and ``output_scale = k_scale`` (V is the same rows).

Scores and mask
    ``s_j = softmax_scale * <q, kv_j>`` over all D dims in fp32.  With ``causal=True`` query token ``i``
    (0-based, of ``S``) sees keys ``j < seq_len - S + 1 + i`` (bottom-right aligned MTP mask); with
    ``causal=False`` it sees ``j < seq_len``.  ``out = output_scale * sum_j softmax(s)_j * kv_j[:kv_lora_rank]``.
    A score past float32's range is +-inf (fp32 arithmetic, not a wider reference's): a visible +inf score
    makes its row NaN, as an infinite key does.

LSE
    ``[B, S, H]`` float32, natural log of ``sum_j exp(s_j)``, independent of ``output_scale``.  A row that
    sees no key (``seq_len == 0``, or ``seq_len < S`` under causal) gives exactly 0 output and LSE ``-inf``.

Runtime data safety (clamp, documented decision)
    ``seq_lens`` is clamped to ``[0, max_pages * page_size]`` and block-table entries to
    ``[0, num_pages)`` before any access, so no input can read outside the cache; entries past the pages a
    request uses are never read for its result and pages it does not own may hold NaN.  The ``sm90`` kernels
    clamp every length and table entry they read themselves, so int32 arrays reach them unchanged (no XLA
    clamp kernel before each call); other dtypes and backends are clamped by ``mla_decode``.  The clamp is done
    in the input's own integer dtype before the conversion to int32 (``_checks.clamp_index``): uint32
    ``2**32 - 1`` or an int64 NumPy length past ``2**31`` is a huge length (the capacity), never a wrapped
    negative one; bool and float arrays are refused.  Out-of-range values inside a request's used range give
    an unspecified (but memory-safe) result; ``validate=True`` reports them through
    ``jax.experimental.checkify`` instead (compared in their own dtype as well).

Non-finite values
    A NaN or Inf in the cache reaches only the output rows whose keys include it: rows past ``seq_len``
    (also inside an owned page), pages a request does not own, and under ``causal`` the keys a query token
    cannot see yet (token ``j >= seq_len - S + 1 + i``) may hold anything.  A row that sees no key is
    exactly 0 (LSE ``-inf``) whatever the scales hold, a NaN or infinite ``output_scale`` included.  A row
    that sees a NaN key gets a NaN output and a NaN LSE (its sum of weights is NaN).  The
    ``xla`` backend holds all of it by construction (``backends/xla.py``).  The ``sm90`` kernels hold rows
    past ``seq_len``, unowned pages and non-finite scales (``tests/gpu/test_hostile_sm90.py``).  The
    causally masked keys of an MTP step (``seq_len - S + 1 + i <= j < seq_len``) lie inside the request's
    own length and are read by all of its query rows in one P V matrix product; the kernels replace the
    non-finite values of those keys' V by 0 after the scores and before P V (V is part of the key row, so a
    row that sees such a key gets a NaN score anyway).  The one difference from the ``xla`` backend left:
    a key there that a row sees, whose score is exactly ``-inf`` and whose V holds an infinity, adds 0 to
    that row where ``xla`` makes it NaN (``0 * inf``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from tokenspeed_jax import _checks as C
from tokenspeed_jax.backends import defer_to_lowering_platform, has_decode_work, select_backend, trace_switches
from tokenspeed_jax.problems import ALL_DTYPES, DecodeProblem, out_dtype_name
from tokenspeed_jax.runtime import current_target

MAX_Q_LEN = 16
MAX_HEADS = 128
PAGE_SIZES = (16, 32, 64, 128, 256)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["arrays"],
                   meta_fields=["backend", "key", "sharding", "batch_invariant"])
@dataclasses.dataclass(frozen=True)
class DecodeWork:
    """What a decode backend derives from ``seq_lens`` and the static problem alone, computed once per decode step
    (:func:`mla_decode_work`) and shared by every layer's ``mla_decode(..., work=)``.

    A pytree: ``arrays`` are its leaves (pass it through ``jax.jit``, ``lax.scan`` carries or closures like any
    array), the other fields are static.  Treat it as opaque.

    * ``arrays``: the backend's device arrays: ``sm90``, the split-KV schedule ``(cta [num_ctas, 8], req [B, 2])``
      int32 (:mod:`tokenspeed_jax.decode_schedule`); empty for backends without per-step work (``xla``,
      ``sm100``).
    * ``backend``: the name of the backend it was built for.
    * ``key``: what the arrays depend on besides the lengths (``sm90``: the batch size and the schedule's
      :class:`~tokenspeed_jax.decode_schedule.ScheduleSpec`; ``None`` for backends without work).
      ``mla_decode`` refuses a work whose key differs from its own call's.
    * ``sharding``: ``None``, or for :func:`tokenspeed_jax.sharding.sharded_mla_decode_work` the
      ``(mesh, head_axis, batch_axis)`` it was computed for (per shard).
    * ``batch_invariant``: the ``batch_invariant`` it was built with (``mla_decode`` refuses a work of the other
      mode, on every backend).
    """

    arrays: tuple[jax.Array, ...]
    backend: str
    key: Hashable = None
    sharding: tuple | None = None
    batch_invariant: bool = False


def mla_decode_work(
    q,
    kv_cache,
    block_table,
    seq_lens: jax.Array,
    *,
    causal: bool = True,
    kv_lora_rank: int = 512,
    backend: str = "auto",
    batch_invariant: bool = False,
) -> DecodeWork:
    """The per-step work of :func:`mla_decode`: compute it once per decode step and pass it to every layer's call
    as ``mla_decode(..., work=...)``.

    The ``sm90`` backend cuts the batch's KV work into a length-balanced schedule (on CUDA one small CuTe DSL kernel,
    ~7-8 µs of device time plus its launch; elsewhere a few dozen jnp ops); ``mla_decode`` without ``work`` computes
    it in every call, i.e. per layer.
    Every layer of a step has the same lengths and shapes, so one schedule serves them all (FlashMLA's
    ``get_mla_metadata``).  Backends without per-step work (``xla``, ``sm100``) return an empty work, which
    ``mla_decode`` accepts and ignores, so the same model code runs on every backend.

    Args:
      q, kv_cache, block_table: the decode call's arrays, or anything with ``.shape`` and ``.dtype``
        (``jax.ShapeDtypeStruct``): only their shapes and dtypes are read.  The work depends on the shapes
        (batch, query tokens, heads, page size, table width, dtype), not on the number of cache pages.
      seq_lens: int ``[B]`` the lengths of the step (values are read: clamped to the table's capacity, as
        ``mla_decode`` clamps them).
      causal, kv_lora_rank, backend, batch_invariant: as the calls that will use it pass them
        (``backend="auto"`` picks the backend the calls pick); a work of one ``batch_invariant`` mode is refused
        by calls of the other.

    Returns:
      A :class:`DecodeWork`.  Inside ``jax.jit`` it is computed on the device with no host sync.  Results of
      ``mla_decode(..., work=mla_decode_work(...))`` are bitwise identical to ``mla_decode(...)`` on the same
      lengths.  The lengths are not checked at run time: a work built from other lengths gives wrong results.
    """
    if isinstance(seq_lens, jax.ShapeDtypeStruct):
        raise TypeError("seq_lens: expected the step's lengths as an array (the work is computed from their "
                        "values), got a jax.ShapeDtypeStruct")
    problem = _decode_problem(q, kv_cache, block_table, seq_lens, causal, kv_lora_rank, False, batch_invariant)
    impl = select_backend("decode", problem, backend)
    _check_batch_invariant(impl, problem)
    if not has_decode_work(impl):
        return DecodeWork((), impl.name, batch_invariant=problem.batch_invariant)
    with jax.named_scope("tokenspeed_mla_decode_work"):
        seq_lens = C.clamp_index(seq_lens, 0, problem.max_kv_len)
        arrays = tuple(impl.decode_work(problem, seq_lens))
    return DecodeWork(arrays, impl.name, impl.decode_work_key(problem), batch_invariant=problem.batch_invariant)


def _check_batch_invariant(impl, problem: DecodeProblem) -> None:
    """A ``ValueError`` naming ``batch_invariant`` when it is asked of a backend without that mode (the backend's
    ``decode_batch_invariant`` attribute: ``sm90`` runs it, ``xla`` accepts it)."""
    if problem.batch_invariant and not getattr(impl, "decode_batch_invariant", False):
        raise ValueError(f"batch_invariant: backend {impl.name!r} has no batch-invariant decode (backend='sm90' has)")


def _work_arrays(work, impl, problem: DecodeProblem) -> tuple:
    """The arrays of ``work`` for a call of ``impl`` on ``problem`` (``()``: none), or a ``TypeError`` /
    ``ValueError`` naming ``work`` when it was built for another call."""
    if work is None:
        return ()
    if not isinstance(work, DecodeWork):
        raise TypeError(f"work: expected a DecodeWork from tokenspeed_jax.mla_decode_work, got {type(work).__name__}")
    if work.sharding is not None:
        raise ValueError("work: built by tokenspeed_jax.sharding.sharded_mla_decode_work for a mesh; pass it to "
                         "sharded_mla_decode (mla_decode takes the work of mla_decode_work)")
    if work.batch_invariant != problem.batch_invariant:
        raise ValueError(f"work: built with batch_invariant={work.batch_invariant}, this call has batch_invariant="
                         f"{problem.batch_invariant}; build it with the batch_invariant of the calls that use it")
    if work.backend != impl.name:
        raise ValueError(f"work: built for backend {work.backend!r}, this call runs on backend {impl.name!r}; build "
                         "it with the arguments of the calls that use it (the same shapes, dtypes and backend=)")
    if not has_decode_work(impl):
        if work.arrays:
            raise ValueError(f"work: backend {impl.name!r} has no per-step work, got {len(work.arrays)} arrays")
        return ()
    key = impl.decode_work_key(problem)
    if work.key != key:
        raise ValueError(f"work: built for a different problem: its key is {work.key}, this call needs {key} "
                         f"({problem}); build it with the arguments of the calls that use it")
    got = tuple(work.arrays)
    want = _work_shapes(impl, problem, trace_switches(impl))
    if _shapes(got) != list(want):
        raise ValueError(f"work: expected arrays (shape, dtype) {list(want)} for this call, got {_shapes(got)}")
    return got


def _shapes(xs) -> list:
    return [(tuple(x.shape), jnp.dtype(x.dtype).name) if hasattr(x, "shape") and hasattr(x, "dtype")
            else type(x).__name__ for x in xs]


@functools.lru_cache(maxsize=256)
def _work_shapes(impl, problem: DecodeProblem, switches: tuple) -> tuple:
    """``(shape, dtype)`` of each array ``impl.decode_work(problem, seq_lens)`` returns: abstract evaluation
    (a trace of the schedule), once per backend, problem and trace-time switches in a process, not once
    per ``mla_decode`` call that checks its ``work`` (every layer of every traced step)."""
    del switches  # part of the key
    return tuple(_shapes(jax.eval_shape(lambda s: tuple(impl.decode_work(problem, s)),
                                        jax.ShapeDtypeStruct((problem.batch,), jnp.int32))))


def mla_decode(
    q: jax.Array,
    kv_cache: jax.Array,
    block_table: jax.Array,
    seq_lens: jax.Array,
    *,
    softmax_scale: float | jax.Array,
    output_scale: float | jax.Array = 1.0,
    causal: bool = True,
    kv_lora_rank: int = 512,
    return_lse: bool = False,
    backend: str = "auto",
    validate: bool = False,
    work: DecodeWork | None = None,
    batch_invariant: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Multi-head latent attention decode (S = 1) and MTP decode (S = 2..16) over a paged cache.

    Args:
      q: ``[B, S, H, D]`` queries, ``D = kv_lora_rank + rope_dim``; H in 1..128, S in 1..16.
      kv_cache: ``[num_pages, page_size, D]`` latent cache (row layout in the module docstring);
        page_size a power of two in 16..256.  Same dtype as q: bf16, fp16, float8_e4m3fn (or float32 on
        the xla backend).
      block_table: int32 ``[B, max_pages]`` page ids per request.
      seq_lens: int32 ``[B]`` total KV length of each request, including its S new tokens.
      softmax_scale: runtime float32 scalar (Python float or traced); scores are ``softmax_scale * q.k``.
      output_scale: runtime float32 scalar multiplying the output (not the LSE).
      causal: bottom-right aligned MTP mask (module docstring) when True.
      kv_lora_rank: latent width; V is ``kv[..., :kv_lora_rank]``.
      return_lse: also return the natural-log LSE ``[B, S, H]`` float32.
      backend: ``"auto"`` or a registered backend name (``"xla"``, ``"sm90"``, ``"sm100"``).
      validate: check runtime data (lengths vs. table capacity, page ids in range) with
        ``jax.experimental.checkify``; eager calls raise, jitted calls must be wrapped in
        ``checkify.checkify``.
      work: the step's :class:`DecodeWork` from :func:`mla_decode_work` (built with this call's shapes, dtype,
        ``causal``, ``kv_lora_rank``, ``backend`` and ``seq_lens``), shared by every layer of a decode step;
        ``None`` computes it inside this call.  The result is bitwise identical either way.  A work built for
        another backend or another problem raises ``ValueError`` naming ``work``; its lengths are not checked.
        Under ``jax.vmap`` the call folds the mapped axis into its batch and computes its own work.
      batch_invariant: make a request's output and LSE bitwise identical whatever batch it is in (its other
        requests, their number and lengths, its position, the table width; not the backend, the shapes S, H,
        page size, dtype, nor the device).  ``sm90``: the batch-invariant schedule
        (``docs/sm90_decode_schedule.md``, "Batch invariance"): every request is cut into pieces of a fixed
        number of its own tokens (``sm90_decode.invariant_chunk``: from the dtype and S x H only), each piece
        computed the same way whatever CTA runs it, the pieces merged in an order fixed by the request's own piece
        count; its fp32 workspace grows with the batch size.  ``xla`` (the reference): accepted and ignored; its
        result is a batched XLA computation whose batch invariance is not guaranteed (XLA picks its matrix product
        algorithms per shape).  Other backends (``sm100``) refuse it with a ``ValueError`` naming
        ``batch_invariant``.

    Returns:
      ``out [B, S, H, kv_lora_rank]`` (bf16 for fp8 input, else the input dtype), or ``(out, lse)``.
    """
    problem = _decode_problem(q, kv_cache, block_table, seq_lens, causal, kv_lora_rank, return_lse, batch_invariant)
    if not isinstance(validate, bool):
        raise TypeError(f"validate: expected a Python bool, got {validate!r}")
    ss = C.f32_scalar(softmax_scale, "softmax_scale")
    os_ = C.f32_scalar(output_scale, "output_scale")
    impl = select_backend("decode", problem, backend)
    _check_batch_invariant(impl, problem)
    work_arrays = _work_arrays(work, impl, problem)
    with jax.named_scope("tokenspeed_mla_decode"):
        if validate:
            check_decode_inputs(block_table, seq_lens, num_pages=problem.num_pages,
                                page_size=problem.page_size)
        # The documented clamp, in the inputs' own dtypes (module docstring); backends get int32 in range, or
        # int32 as given where the backend's kernels clamp every entry they read (``decode_clamps_indices``).
        own = getattr(impl, "decode_clamps_indices", False)
        block_table = _clamp_index(block_table, 0, problem.num_pages - 1, own)
        seq_lens = _clamp_index(seq_lens, 0, problem.max_kv_len, own)
        call = _vmappable_decode(impl.name, problem.causal, problem.kv_lora_rank, problem.return_lse,
                                 problem.target, trace_switches(impl), problem.batch_invariant)
        out, lse = defer_to_lowering_platform("decode", problem, backend, call, q, kv_cache, block_table, seq_lens,
                                              ss, os_, work_arrays)
    return (out, lse) if return_lse else out


def _clamp_index(x, lo: int, hi: int, in_kernel: bool):
    """``C.clamp_index(x, lo, hi)``, or a JAX int32 ``x`` unchanged when ``in_kernel`` (the backend clamps every
    entry it reads to the same bounds: no XLA kernel for a clamp that is done anyway)."""
    if in_kernel and isinstance(x, jax.Array) and x.dtype == jnp.int32:
        return x
    return C.clamp_index(x, lo, hi)


def contract_reason(problem: DecodeProblem) -> str | None:
    """None if ``problem`` is inside ``mla_decode``'s static limits (every backend's common ground:
    1..16 query tokens, 1..128 heads, a page size in ``PAGE_SIZES``, ``D > kv_lora_rank``), else the reason.
    ``mla_decode`` raises ``ValueError`` for the same limits; capability queries (the vLLM backend) ask
    this before asking the backends, so both always agree."""
    p = problem
    if not 1 <= p.q_len <= MAX_Q_LEN:
        return f"{p.q_len} query tokens per request (mla_decode takes 1..{MAX_Q_LEN})"
    if not 1 <= p.num_heads <= MAX_HEADS:
        return f"{p.num_heads} heads (mla_decode takes 1..{MAX_HEADS} per call)"
    if p.page_size not in PAGE_SIZES:
        return f"page size {p.page_size} (mla_decode takes {list(PAGE_SIZES)})"
    if p.head_dim <= p.kv_lora_rank:
        return f"head dim {p.head_dim} <= kv_lora_rank {p.kv_lora_rank} (no rope dims)"
    if p.dtype not in ALL_DTYPES:
        return f"dtype {p.dtype} (mla_decode takes {list(ALL_DTYPES)})"
    if min(p.batch, p.num_pages, p.max_pages, p.kv_lora_rank) < 1:
        return "an empty batch, cache or block table"
    return None


def _decode_problem(q, kv_cache, block_table, seq_lens, causal, kv_lora_rank, return_lse,
                    batch_invariant=False) -> DecodeProblem:
    C.array(q, "q")
    C.array(kv_cache, "kv_cache")
    C.array(block_table, "block_table")
    C.array(seq_lens, "seq_lens")
    C.rank(q, "q", 4, "[B, S, H, D]")
    C.rank(kv_cache, "kv_cache", 3, "[num_pages, page_size, D]")
    C.rank(block_table, "block_table", 2, "[B, max_pages]")
    C.rank(seq_lens, "seq_lens", 1, "[B]")
    causal = C.static_bool(causal, "causal")
    return_lse = C.static_bool(return_lse, "return_lse")
    batch_invariant = C.static_bool(batch_invariant, "batch_invariant")
    kv_lora_rank = C.static_pos_int(kv_lora_rank, "kv_lora_rank")
    dtype = C.float_dtype(q, "q", ALL_DTYPES)
    C.same_dtype(q, "q", kv_cache, "kv_cache")
    C.int_dtype(block_table, "block_table")
    C.int_dtype(seq_lens, "seq_lens")
    B, S, H, D = q.shape
    num_pages, page_size, Dk = kv_cache.shape
    if D <= kv_lora_rank:
        raise ValueError(
            f"q: expected head dim D = kv_lora_rank + rope_dim > kv_lora_rank = {kv_lora_rank}, got D = {D}"
        )
    C.dim("kv_cache", "head dim (last axis) equal to q's D", Dk, D)
    if not 1 <= S <= MAX_Q_LEN:
        raise ValueError(f"q: expected S (axis 1, query tokens per request) in 1..{MAX_Q_LEN}, got {S}")
    if not 1 <= H <= MAX_HEADS:
        raise ValueError(f"q: expected H (axis 2, heads) in 1..{MAX_HEADS}, got {H}")
    if B < 1:
        raise ValueError(f"q: expected batch B (axis 0) >= 1, got {B}")
    if page_size not in PAGE_SIZES:
        raise ValueError(f"kv_cache: expected page_size (axis 1) a power of two in {PAGE_SIZES}, got {page_size}")
    if num_pages < 1:
        raise ValueError(f"kv_cache: expected num_pages (axis 0) >= 1, got {num_pages}")
    C.dim("block_table", "batch (axis 0) equal to q's B", block_table.shape[0], B)
    C.dim("seq_lens", "batch (axis 0) equal to q's B", seq_lens.shape[0], B)
    if block_table.shape[1] < 1:
        raise ValueError(f"block_table: expected max_pages (axis 1) >= 1, got {block_table.shape[1]}")
    return DecodeProblem(
        batch=B, q_len=S, num_heads=H, head_dim=D, kv_lora_rank=kv_lora_rank, page_size=page_size,
        num_pages=num_pages, max_pages=block_table.shape[1], dtype=dtype, causal=causal,
        return_lse=return_lse, target=current_target(), batch_invariant=batch_invariant,
    )


def check_decode_inputs(block_table, seq_lens, *, num_pages: int, page_size: int) -> None:
    """checkify checks of the runtime decode data (see ``mla_decode(validate=True)``)."""
    max_pages = block_table.shape[1]
    cap = max_pages * page_size
    checkify.check(jnp.all(C.index_in_range(seq_lens, 0, None)),
                   "seq_lens: expected every length >= 0, got a negative length")
    checkify.check(
        jnp.all(C.index_in_range(seq_lens, None, cap)),
        f"seq_lens: expected every length <= max_pages * page_size = {cap}",
    )
    sl = C.clamp_index(seq_lens, 0, cap)
    used = jnp.arange(max_pages)[None, :] < (sl[:, None] + page_size - 1) // page_size
    ok = C.index_in_range(block_table, 0, num_pages - 1)
    checkify.check(
        jnp.all(ok | ~used),
        f"block_table: expected page ids in [0, {num_pages}) for every page a request uses",
    )


@functools.lru_cache(maxsize=64)
def _vmappable_decode(backend_name: str, causal: bool, kv_lora_rank: int, return_lse: bool, target,
                      switches: tuple = (), batch_invariant: bool = False):
    """The backend call wrapped in a ``custom_vmap`` that folds a vmapped axis into the batch.

    Cached on the static flags only, never on shapes (batch, pages and table width vary per call in a
    serving process and are read from the operands inside), and bounded: the values of the backend's
    trace-time environment switches (``Backend.trace_env``) are part of the key, since JAX caches the trace
    of the returned function.

    ``work``: the arrays of the call's :class:`DecodeWork` (``()``: the backend computes its work inside).
    A vmapped call drops them: the folded batch is another problem, whose work the backend computes.

    A vmapped axis of size V over q / block_table / seq_lens becomes V*B requests.  A vmapped kv_cache
    ``[V, num_pages, ...]`` is folded into ``V*num_pages`` pages with block-table entries offset by
    ``v * num_pages`` (after clamping, so a request still only reaches its own cache).  Vmapped scales
    cannot be folded (one scale per kernel call), so that case runs the V calls sequentially.
    """
    from tokenspeed_jax.backends import get_backend

    impl = get_backend(backend_name)

    @jax.custom_batching.custom_vmap
    def call(q, kv_cache, block_table, seq_lens, ss, os_, work=()):
        p = _decode_problem(q, kv_cache, block_table, seq_lens, causal, kv_lora_rank, return_lse, batch_invariant)
        p = DecodeProblem(**{**p.__dict__, "target": target})
        if has_decode_work(impl):
            out, lse = impl.decode(p, q, kv_cache, block_table, seq_lens, ss, os_, work=tuple(work) or None)
        else:
            out, lse = impl.decode(p, q, kv_cache, block_table, seq_lens, ss, os_)
        if lse is None:
            lse = jnp.zeros((), jnp.float32)  # placeholder; dropped by mla_decode
        return out, lse

    @call.def_vmap
    def rule(axis_size, in_batched, q, kv_cache, block_table, seq_lens, ss, os_, work=()):
        qb, kb, bb, sb, ssb, osb = in_batched[:6]
        if ssb or osb:
            bcast = lambda x, b: x if b else jnp.broadcast_to(x, (axis_size,) + x.shape)  # noqa: E731
            args = [bcast(x, b) for x, b in zip((q, kv_cache, block_table, seq_lens, ss, os_), in_batched[:6])]
            out = jax.lax.map(lambda a: call(*a), tuple(args))
            return out, (True, True)
        V = axis_size
        if V == 0:  # an empty vmap: nothing to run (the folded batch would be B = 0, which the op refuses)
            _, B, S, H, _ = q.shape if qb else (0,) + q.shape
            out = jnp.zeros((0, B, S, H, kv_lora_rank), out_dtype_name(jnp.dtype(q.dtype).name))
            lse = jnp.zeros((0, B, S, H), jnp.float32) if return_lse else jnp.zeros((), jnp.float32)
            return (out, lse), (True, return_lse)
        q = q if qb else jnp.broadcast_to(q, (V,) + q.shape)
        block_table = block_table if bb else jnp.broadcast_to(block_table, (V,) + block_table.shape)
        seq_lens = seq_lens if sb else jnp.broadcast_to(seq_lens, (V,) + seq_lens.shape)
        B = q.shape[1]
        if kb:
            P = kv_cache.shape[1]
            offs = (jnp.arange(V, dtype=jnp.int32) * P)[:, None, None]  # int32: narrow ids overflow
            block_table = jnp.clip(block_table.astype(jnp.int32), 0, P - 1) + offs
            kv_cache = kv_cache.reshape((V * P,) + kv_cache.shape[2:])
        out, lse = call(
            q.reshape((V * B,) + q.shape[2:]), kv_cache, block_table.reshape((V * B,) + block_table.shape[2:]),
            seq_lens.reshape(V * B), ss, os_,
        )
        out = out.reshape((V, B) + out.shape[1:])
        if return_lse:
            lse = lse.reshape((V, B) + lse.shape[1:])
        return (out, lse), (True, return_lse)

    return call
