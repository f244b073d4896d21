"""The length-balanced split-KV schedule of the Hopper decode kernel, computed on the device.

A decode batch never has equal lengths, so a split plan fixed by the block table's *capacity* leaves the
batch paced by its longest request.  This module cuts the batch's *actual* work into one contiguous range
per CTA of a persistent grid, from ``seq_lens`` and inside the caller's ``jax.jit`` (a few jnp ops: no host
sync, replayed by CUDA graphs).  Design brief: FlashMLA's ``get_decoding_sched_meta`` (one range of
``[begin_req, begin_block) .. [end_req, end_block)`` per CTA, a fixed start/drain cost per request).

Work model (all in units of ``unit`` = 128 KV tokens, one tile pair of the main loop):

* request ``b`` has ``n_b = ceil(L_b / unit)`` units, ``L_b = clip(seq_lens[b], 0, capacity)`` (the clamp
  the kernel applies too); its cost is ``n_b + fixed_cost`` (``0`` for an empty request).
* Units are laid end to end in request order; a *cut* is a position in that order.  CTA ``g`` of the
  ``num_ctas`` owns units ``[P[g], P[g+1])``: the part of each request in that range is one *piece*.
* The **balanced** cut puts ``P[g]`` at cost position ``g * total / num_ctas`` (rounded to a unit).
* The **per-request** cut (the static plan's shape: request ``b`` split at multiples of
  ``split_units``) puts every cut on a multiple of ``split_units`` inside a request, so each request's
  pieces are fixed ranges of its own tokens.  On full-length batches this is the static plan exactly.
* ``choose`` mode computes both and keeps the per-request cut unless its busiest CTA has more than
  ``prefer`` times the busiest balanced CTA's cost (balanced cuts cost a Q reload, a pipeline restart and
  an fp32 partial per extra piece, which a bandwidth-bound full-length batch does not win back).

**Batch-invariant** schedule (``chunk > 0``): every request is cut at every multiple of ``chunk`` tokens of its
own, so request ``b`` has exactly ``ceil(L_b / chunk)`` pieces (one, direct, when ``L_b <= chunk``) whatever
the other requests are; its cost is ``n_b + fixed_cost * pieces_b``, and the ``num_ctas`` ranges are cut at
piece boundaries only, each at the boundary nearest to cost position ``g * total / num_ctas``.  A CTA's range
then holds whole pieces, several of them per request possibly; the kernel walks it chunk by chunk.  Piece ``j``
of a request of ``k >= 2`` pieces writes slot ``b * P + j``, ``P = ceil(capacity / chunk)`` (computed by the
kernel from the request alone), and the combine merges a request's partials in an order that depends on its own
piece count alone.  Slots: ``B * P`` (:meth:`ScheduleSpec.slots`), so this workspace grows with the batch size.
In ``cta`` the slot columns are -1 (the kernel computes the slots), ``split_k`` is -1 (the combine's work list is
every request) and ``n_split`` the number of requests of two pieces or more.

A request whose units all fall in one CTA is *direct*: that CTA writes its final output.  A request cut by
``k >= 2`` CTAs writes ``k`` fp32 partials into consecutive workspace *slots* and the combine kernel merges
them in order (deterministic).  Each interior cut splits at most one request in two, so at most
``2 * (num_ctas - 1)`` slots are ever used: the workspace depends on neither the batch size nor the
lengths.  A request of length 0 has no piece; the combine writes its exact 0 output and ``-inf`` LSE.

Kernel metadata (int32, all computed here):

* ``cta`` ``[num_ctas, 8]``: ``(b_first, tok_first, b_last, tok_end, slot_first, slot_last, split_k, n_split)``: CTA
  ``g`` runs requests ``b_first..b_last`` (none if ``b_last < b_first``); the first starts at KV token
  ``tok_first``, the last ends at token ``tok_end`` (exclusive); the ones between are whole.  The first's
  and last's fp32 partial slots, ``-1`` for direct.  Requests between them are direct.  ``split_k`` (row ``k``)
  is the ``k``-th request cut into pieces, in request order, ``-1`` past the last: the combine's work list
  (at most ``num_ctas - 1`` requests are cut, since each interior cut lies inside at most one); ``n_split``
  (every row) is its length.
* ``req`` ``[B, 2]``: ``(num_pieces, first_slot)`` per request for the combine (``num_pieces`` 0: empty
  request, 1: direct, else merge slots ``first_slot .. first_slot + num_pieces - 1``).

:func:`reference_pieces` lists the same pieces in plain numpy for tests.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

UNIT = 128  # KV tokens per schedule unit (one tile pair of the main loops)
MODES = ("choose", "balanced", "per_request")
SCOPE = "tokenspeed_decode_schedule"  # the name scope of the schedule's operations in a lowered program
KERNEL_MAX_CTAS = 255  # the CUDA schedule kernel's grid bound (one thread per cut, 256 threads); above: the jnp ops


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """Static parameters of a schedule (part of the decode call's trace, never of the kernel compile).

    num_ctas: CTAs per row block of the persistent grid (``num_sms // m_blocks``).
    capacity: the block table's token capacity (``max_pages * page_size``), the kernel's length clamp.
    split_units: per-request cut granularity in units (the static plan's tokens per split / ``unit``).
    fixed_cost: start/drain cost of a piece, in units (FlashMLA: 5 blocks of 64 tokens; the sm90 backend:
      ``sm90_decode._FIXED_COST``).
    mode: ``"choose"`` (per call, on the device), ``"balanced"`` or ``"per_request"``.
    prefer: the per-request cut is kept while its busiest CTA costs at most ``prefer`` x the balanced one's.
    chunk: ``0``, or the batch-invariant schedule's piece length in tokens (a multiple of ``unit``; ``mode``,
      ``split_units`` and ``prefer`` are then unused).
    """

    num_ctas: int
    capacity: int
    split_units: int
    fixed_cost: int = 3
    mode: str = "choose"
    prefer: float = 1.08
    unit: int = UNIT
    chunk: int = 0

    def __post_init__(self):
        for name in ("num_ctas", "capacity", "split_units", "unit"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if isinstance(self.fixed_cost, bool) or not isinstance(self.fixed_cost, int) or self.fixed_cost < 0:
            raise ValueError(f"fixed_cost: expected an int >= 0, got {self.fixed_cost!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {self.mode!r}")
        if not self.prefer >= 1.0:
            raise ValueError(f"prefer: expected a float >= 1, got {self.prefer!r}")
        if (isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 0
                or self.chunk % self.unit):
            raise ValueError(f"chunk: expected 0 or a positive multiple of unit={self.unit}, got {self.chunk!r}")

    @property
    def max_slots(self) -> int:
        """Workspace slots any schedule can use: ``2 * (num_ctas - 1)``, at least 1 (``planner.schedule_slots``)."""
        from tokenspeed_jax.planner import schedule_slots

        return schedule_slots(self.num_ctas)

    def slots(self, batch: int) -> int:
        """Workspace slots of a schedule of ``batch`` requests: :attr:`max_slots`, or for the batch-invariant
        schedule ``batch * ceil(capacity / chunk)`` when a request can have two pieces (``capacity > chunk``), at
        least 1."""
        if not self.chunk:
            return self.max_slots
        per_req = -(-self.capacity // self.chunk)
        return max(1, batch * per_req) if per_req >= 2 else 1


def _cuts(n, K, T, x, fixed_cost, split_units):
    """Unit positions of the cuts at cost positions ``x``: the request whose cost range holds ``x``, and the
    unit inside it past its fixed cost, rounded up to a multiple of ``split_units``."""
    B = n.shape[0]
    b = jnp.searchsorted(K[1:], x, side="right", method="compare_all")  # first request whose cost range ends after x
    bc = jnp.minimum(b, B - 1)
    t = jnp.clip(x - K[bc] - fixed_cost, 0, n[bc])
    if split_units > 1:
        t = jnp.minimum((t + split_units - 1) // split_units * split_units, n[bc])
    return jnp.where(b < B, T[bc] + t, T[B])


def _cta_load(P, T, fixed_cost):
    """Cost of each CTA's range ``[P[g], P[g+1])``: its units plus ``fixed_cost`` per request it touches."""
    lo, hi = P[:-1], P[1:]
    b0 = jnp.searchsorted(T[1:], lo, side="right", method="compare_all")
    b1 = jnp.searchsorted(T[1:], hi - 1, side="right", method="compare_all")
    pieces = jnp.where(hi > lo, b1 - b0 + 1, 0)
    return (hi - lo) + fixed_cost * pieces


def decode_schedule(seq_lens: jax.Array, spec: ScheduleSpec, *, cuda_kernel: bool = False
                    ) -> tuple[jax.Array, jax.Array]:
    """``(cta [num_ctas, 8], req [B, 2])`` int32 metadata for ``seq_lens`` (module docstring).  Traceable.

    ``cuda_kernel``: where the program is lowered for CUDA, compute the same arrays with one CuTe DSL kernel
    (:mod:`tokenspeed_jax.kernels.sm90.schedule`, one launch instead of about a dozen small XLA kernels; the sm90
    backend's choice) when ``spec.num_ctas <= KERNEL_MAX_CTAS``; every other platform lowers the jnp ops
    (``jax.lax.platform_dependent``).

    Its operations carry the name scope :data:`SCOPE`, so a lowered program shows where (and how often) a
    schedule is computed: once per decode step, outside the layer loop, when the step shares one
    (``tokenspeed_jax.mla_decode_work``)."""
    if seq_lens.ndim != 1:
        raise ValueError(f"seq_lens: expected shape [B], got {seq_lens.shape}")
    seq_lens = seq_lens.astype(jnp.int32)
    with jax.named_scope(SCOPE):
        if not cuda_kernel or spec.num_ctas > KERNEL_MAX_CTAS:
            return _schedule(seq_lens, spec)
        return jax.lax.platform_dependent(seq_lens, default=lambda s: _schedule(s, spec),
                                          cuda=lambda s: _schedule_kernel(s, spec))


@dataclasses.dataclass(frozen=True)
class ScheduleKernelKey:
    """The schedule kernel's compile key: what its code depends on (the capacity and the per-request cut are
    operands, so neither a batch size nor a table width compiles anything)."""

    num_ctas: int
    fixed_cost: int
    mode: str
    prefer: float
    unit: int
    chunk: int


def _schedule_kernel(seq_lens, spec: ScheduleSpec):
    """:func:`_schedule` as the CuTe DSL kernel's custom call ``tokenspeed_decode_schedule_sm90``."""
    from cutlass.jax import TensorSpec

    from tokenspeed_jax import ffi

    B = seq_lens.shape[0]
    key = ScheduleKernelKey(spec.num_ctas, spec.fixed_cost, spec.mode, float(spec.prefer), spec.unit, spec.chunk)
    call = ffi.custom_call(
        "decode_schedule_sm90", ffi.LaunchRef("tokenspeed_jax.kernels.sm90.schedule", "launch_schedule"),
        outputs=[jax.ShapeDtypeStruct((spec.num_ctas, 8), jnp.int32), jax.ShapeDtypeStruct((B, 2), jnp.int32),
                 jax.ShapeDtypeStruct((2 * B + 2,), jnp.int32)],
        compile_key=key, input_specs=(TensorSpec(divisibility=(1,)), TensorSpec(divisibility=(2,))),
        output_specs=(TensorSpec(divisibility=(spec.num_ctas, 8)), TensorSpec(divisibility=(1, 2)),
                      TensorSpec(divisibility=(2,))),
        dynamic_shapes=True, **dataclasses.asdict(key))
    cta, req, _ = call(seq_lens, jnp.array([spec.capacity, spec.split_units], jnp.int32))
    return cta, req


def _schedule(seq_lens, spec: ScheduleSpec):
    u, G, c = spec.unit, spec.num_ctas, spec.fixed_cost
    L = jnp.clip(seq_lens, 0, spec.capacity)  # (int32: decode_schedule)
    n = (L + (u - 1)) // u
    if spec.chunk:
        return _invariant(n, L, spec)
    cost = jnp.where(n > 0, n + c, 0)
    zero = jnp.zeros((1,), jnp.int32)
    K = jnp.concatenate([zero, jnp.cumsum(cost, dtype=jnp.int32)])  # cost prefix [B+1]
    T = jnp.concatenate([zero, jnp.cumsum(n, dtype=jnp.int32)])  # unit prefix [B+1]
    total = K[-1]
    g = jnp.arange(G + 1, dtype=jnp.int32)
    x = g * total // G  # (int32: total * G < 2**31 up to ~16M units, i.e. 2G tokens in a batch)
    if spec.mode == "balanced":
        P = _cuts(n, K, T, x, c, 1)
    elif spec.mode == "per_request":
        P = _cuts(n, K, T, x, c, spec.split_units)
    else:
        Pb = _cuts(n, K, T, x, c, 1)
        Ps = _cuts(n, K, T, x, c, spec.split_units)
        lb = jnp.max(_cta_load(Pb, T, c))
        ls = jnp.max(_cta_load(Ps, T, c))
        P = jnp.where(ls.astype(jnp.float32) <= spec.prefer * lb.astype(jnp.float32), Ps, Pb)
    return _metadata(P, n, L, T, spec)


def _invariant(n, L, spec: ScheduleSpec):
    """The batch-invariant schedule (module docstring): pieces of ``chunk`` tokens of each request, the CTA ranges
    cut at the piece boundaries nearest to the even cost shares."""
    B, G, u, c = n.shape[0], spec.num_ctas, spec.unit, spec.fixed_cost
    cu = spec.chunk // u  # units per piece
    pieces = (n + (cu - 1)) // cu
    zero = jnp.zeros((1,), jnp.int32)
    K = jnp.concatenate([zero, jnp.cumsum(n + c * pieces, dtype=jnp.int32)])  # cost prefix
    T = jnp.concatenate([zero, jnp.cumsum(n, dtype=jnp.int32)])  # unit prefix
    x = jnp.arange(G + 1, dtype=jnp.int32) * K[-1] // G
    b = jnp.searchsorted(K[1:], x, side="right", method="compare_all")
    bc = jnp.minimum(b, B - 1)
    j = jnp.clip((x - K[bc] + (cu + c) // 2) // (cu + c), 0, pieces[bc])  # the nearest piece boundary
    P = jnp.where(b < B, T[bc] + jnp.minimum(j * cu, n[bc]), T[B])

    lo, hi, nonempty, b_first, b_last, tok_first, tok_end = _ranges(P, T, L, B, u)
    split = pieces >= 2
    first = jnp.arange(B, dtype=jnp.int32) * (-(-spec.capacity // spec.chunk))  # request b's slots: b * P + j
    n_split = jnp.sum(split, dtype=jnp.int32)
    cta = jnp.stack([
        jnp.where(nonempty, b_first, 1), jnp.where(nonempty, tok_first, 0),
        jnp.where(nonempty, b_last, 0), jnp.where(nonempty, tok_end, 0),
        jnp.full((G,), -1, jnp.int32), jnp.full((G,), -1, jnp.int32),
        jnp.full((G,), -1, jnp.int32), jnp.broadcast_to(n_split, (G,)),
    ], axis=1).astype(jnp.int32)
    req = jnp.stack([pieces, jnp.where(split, first, -1)], axis=1).astype(jnp.int32)
    return cta, req


def _ranges(P, T, L, B, u):
    """The CTA ranges of the unit cuts ``P [G+1]``: ``(lo, hi, nonempty, b_first, b_last, tok_first, tok_end)``
    (the first and last request each range meets, the first's start and the last's end in KV tokens)."""
    lo, hi = P[:-1], P[1:]
    nonempty = hi > lo
    b_first = jnp.minimum(jnp.searchsorted(T[1:], lo, side="right", method="compare_all"), B - 1)
    b_last = jnp.minimum(jnp.searchsorted(T[1:], hi - 1, side="right", method="compare_all"), B - 1)
    tok_first = (lo - T[b_first]) * u
    tok_end = jnp.minimum((hi - T[b_last]) * u, L[b_last])
    return lo, hi, nonempty, b_first, b_last, tok_first, tok_end


def _metadata(P, n, L, T, spec: ScheduleSpec):
    B, G, u = n.shape[0], spec.num_ctas, spec.unit
    lo, hi, nonempty, b_first, b_last, tok_first, tok_end = _ranges(P, T, L, B, u)
    # per request: the CTAs whose range meets its units, and its slots
    f = jnp.searchsorted(hi, T[:-1], side="right", method="compare_all")  # first g with P[g+1] > T[b]
    last = jnp.searchsorted(lo, T[1:], side="left", method="compare_all") - 1  # last g with P[g] < T[b] + n[b]
    # (empty CTAs, P[g] == P[g+1], may sit between a request's CTAs: count and rank the non-empty ones)
    ne = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nonempty, dtype=jnp.int32)])
    pieces = jnp.where(n > 0, ne[jnp.maximum(last + 1, 0)] - ne[jnp.minimum(f, G)], 0).astype(jnp.int32)
    split = pieces >= 2
    used = jnp.where(split, pieces, 0)
    first_slot = (jnp.cumsum(used, dtype=jnp.int32) - used).astype(jnp.int32)

    # the requests cut into pieces, in request order, one per CTA row of the metadata (each of the G - 1 interior
    # cuts lies inside at most one request, so at most G - 1 of them): the combine's work list
    n_split = jnp.cumsum(split, dtype=jnp.int32)
    k = jnp.arange(G, dtype=jnp.int32)
    kth = jnp.searchsorted(n_split, k, side="right", method="compare_all")  # first b with n_split[b] > k
    split_list = jnp.where(k < n_split[-1], kth, -1).astype(jnp.int32)

    def slot_of(b):
        return jnp.where(split[b], first_slot[b] + ne[:-1] - ne[jnp.minimum(f[b], G)], -1)

    cta = jnp.stack([
        jnp.where(nonempty, b_first, 1), jnp.where(nonempty, tok_first, 0),
        jnp.where(nonempty, b_last, 0), jnp.where(nonempty, tok_end, 0),
        jnp.where(nonempty, slot_of(b_first), -1), jnp.where(nonempty, slot_of(b_last), -1),
        split_list, jnp.broadcast_to(n_split[-1], (G,)),
    ], axis=1).astype(jnp.int32)
    req = jnp.stack([pieces, jnp.where(split, first_slot, -1)], axis=1).astype(jnp.int32)
    return cta, req


def reference_pieces(cta: np.ndarray, req: np.ndarray, seq_lens: np.ndarray, capacity: int, chunk: int = 0):
    """The pieces a kernel following ``cta`` runs, as ``[(g, b, tok_start, tok_end, slot)]`` (numpy;
    the walk of the kernel's CTA loop, for tests and the CPU emulation).  ``chunk``: the batch-invariant
    schedule's (:attr:`ScheduleSpec.chunk`): each request's part of a range is walked ``chunk`` tokens at a time,
    piece ``j`` of a request ``b`` longer than ``chunk`` in slot ``b * ceil(capacity / chunk) + j``."""
    L = np.clip(np.asarray(seq_lens, np.int64), 0, capacity)
    out = []
    for g, (b0, t0, b1, t1, s0, s1, _, _) in enumerate(np.asarray(cta)):
        for b in range(int(b0), int(b1) + 1):
            start = int(t0) if b == b0 else 0
            end = int(t1) if b == b1 else int(L[b])
            if chunk:
                per_req = -(-capacity // chunk)
                for cs in range(start, end, chunk):
                    out.append((g, b, cs, min(cs + chunk, end), b * per_req + cs // chunk if L[b] > chunk else -1))
                continue
            if end > start:
                slot = int(s0) if b == b0 else (int(s1) if b == b1 else -1)
                out.append((g, b, start, end, slot))
    return out


__all__ = ["KERNEL_MAX_CTAS", "MODES", "SCOPE", "UNIT", "ScheduleKernelKey", "ScheduleSpec", "decode_schedule", "reference_pieces"]
