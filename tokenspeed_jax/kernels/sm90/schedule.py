"""The length-balanced decode schedule as one CuTe DSL kernel: one CTA computes ``(cta, req)`` from ``seq_lens``.

The same integers as :func:`tokenspeed_jax.decode_schedule.decode_schedule` (whose module docstring defines them),
in one launch instead of about a dozen small XLA kernels: the backend uses it when a call computes its own schedule
on a CUDA target.  One CTA of :data:`THREADS` threads, any batch size (read at run time):

1. Request ``b``'s units ``n_b`` and cost (``n_b + fixed_cost``, or ``n_b + fixed_cost * pieces_b`` for the
   batch-invariant schedule) are scanned into the prefixes ``K`` (cost) and ``T`` (units), ``[B + 1]`` each: each
   thread sums a contiguous segment of requests, a block scan of the segment sums gives each segment's offset, and
   the thread writes its segment's prefixes.  They live in shared memory where ``B <= SMEM_BATCH`` (the binary
   searches of steps 2-5 then read ~30-cycle shared memory instead of global memory, several hundred cycles per
   dependent load), else in the ``scratch`` output (left unwritten on the shared-memory path).
2. Thread ``g`` of the first ``num_ctas + 1`` computes cut ``P[g]`` (binary searches over ``K``), in shared memory;
   ``choose`` mode computes both cuts and the busiest CTA of each (block max), and keeps one for every ``g``.
3. Thread ``g < num_ctas``: its range's first and last request and token bounds, and whether it is empty.
4. Per request (segments again): its pieces (binary searches over the cuts), slots (a block scan of the pieces of
   split requests) and, for a split request, its entry in the combine's work list (``cta[k, 6]``, scattered).
5. Thread ``g``: the slots of its first and last piece.

The block-wide barriers between the steps also order the steps' global writes and reads (``bar.sync`` makes a
CTA's global writes visible to the whole CTA).  All arithmetic is int32, as in the jnp version, and the ``choose``
comparison is the same float32 product, so the arrays are equal bit for bit
(``tests/gpu/test_sm90_decode.py::test_schedule_kernel_matches_jnp``).
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, cute

from tokenspeed_jax.decode_schedule import KERNEL_MAX_CTAS as _MAX_CTAS  # num_ctas + 1 cuts, one per thread

THREADS = 256
_WARPS = THREADS // 32
SMEM_BATCH = 2048  # the largest batch whose prefixes K and T (2 B + 2 Int32, 16 KB) are kept in shared memory


@cute.jit
def _count_le(a: cute.Tensor, base: Int32, n: Int32, x: Int32, nbits: Int32):
    """``#{i in [0, n): a[base + i] <= x}`` for a nondecreasing ``a[base .. base + n)`` (``2**nbits > n``)."""
    pos = Int32(0)
    for k in cutlass.range(nbits, unroll=1):
        step = Int32(1) << (nbits - 1 - k)
        if pos + step <= n:
            if a[base + pos + step - 1] <= x:
                pos = pos + step
    return pos


@cute.jit
def _bits(n: Int32):
    """The smallest ``k`` with ``2**k > n`` (``n >= 0``)."""
    k = Int32(0)
    while (Int32(1) << k) <= n:
        k = k + 1
    return k


@cute.jit
def _block_exclusive_scan(x: Int32, s_warp: cute.Tensor, tid: Int32):
    """``(exclusive prefix of x over the CTA's threads in thread order, the CTA's total)``: a shuffle scan in each
    warp, the warp totals through shared memory ``s_warp`` (:data:`_WARPS` Int32).  Ends with a CTA barrier."""
    lane, warp = tid % 32, tid // 32
    inc = x
    for k in cutlass.range_constexpr(5):
        y = cute.arch.shuffle_sync_up(inc, offset=1 << k)
        if lane >= (1 << k):
            inc = inc + y
    if lane == 31:
        s_warp[warp] = inc
    cute.arch.barrier()
    before = Int32(0)
    total = Int32(0)
    for w in cutlass.range_constexpr(_WARPS):
        v = s_warp[w]
        if w < warp:
            before = before + v
        total = total + v
    cute.arch.barrier()  # s_warp may be reused
    return before + inc - x, total


@cute.jit
def _block_max(x: Int32, s_warp: cute.Tensor, tid: Int32):
    """The max of ``x`` over the CTA's threads, returned to all.  Ends with a CTA barrier."""
    for k in cutlass.range_constexpr(5):
        x = cutlass.max(x, cute.arch.shuffle_sync_bfly(x, offset=16 >> k))
    if tid % 32 == 0:
        s_warp[tid // 32] = x
    cute.arch.barrier()
    m = s_warp[0]
    for w in cutlass.range_constexpr(1, _WARPS):
        m = cutlass.max(m, s_warp[w])
    cute.arch.barrier()
    return m


class MlaDecodeScheduleKernel:
    """The kernel of one :class:`tokenspeed_jax.decode_schedule.ScheduleSpec`: its grid, cost model, mode and chunk
    are compile-time values; the table's capacity and the per-request cut (which change with the table's width)
    are the run-time operand ``params = (capacity, split_units)``, so a new table width compiles nothing."""

    def __init__(self, *, num_ctas: int, fixed_cost: int, mode: str, prefer: float, unit: int, chunk: int):
        if not 1 <= num_ctas <= _MAX_CTAS:
            raise ValueError(f"num_ctas: expected 1..{_MAX_CTAS}, got {num_ctas}")
        self.G, self.c, self.mode, self.prefer, self.u, self.chunk = num_ctas, fixed_cost, mode, prefer, unit, chunk

    @cute.jit
    def __call__(self, stream, mSeq: cute.Tensor, mPar: cute.Tensor, mCta: cute.Tensor, mReq: cute.Tensor,
                 mScr: cute.Tensor):

        @cute.struct
        class Storage:
            warp: cute.struct.MemRange[Int32, _WARPS]
            cut: cute.struct.MemRange[Int32, _MAX_CTAS + 1]  # P [G + 1]
            cut2: cute.struct.MemRange[Int32, _MAX_CTAS + 1]  # the per-request cut (choose mode)
            ne: cute.struct.MemRange[Int32, _MAX_CTAS + 1]  # non-empty ranges before range g [G + 1]
            pre: cute.struct.MemRange[Int32, 2 * SMEM_BATCH + 2]  # K and T where B <= SMEM_BATCH

        self.kernel(mSeq, mPar, mCta, mReq, mScr, Storage).launch(grid=(1, 1, 1), block=(THREADS, 1, 1),
                                                            smem=Storage.size_in_bytes(), stream=stream)

    @cute.jit
    def units(self, mSeq: cute.Tensor, cap: Int32, b: Int32):
        """Request ``b``'s units: ``ceil(clip(seq_lens[b], 0, capacity) / unit)``."""
        return (cutlass.min(cutlass.max(mSeq[b], Int32(0)), cap) + (self.u - 1)) // self.u

    @cute.jit
    def cost(self, n: Int32):
        """A request's cost of ``n`` units (module docstring of ``decode_schedule``)."""
        res = Int32(0)
        if cutlass.const_expr(self.chunk > 0):
            cu = self.chunk // self.u
            res = n + self.c * ((n + (cu - 1)) // cu)
        else:
            if n > 0:
                res = n + self.c
        return res

    @cute.jit
    def cut(self, mScr: cute.Tensor, B: Int32, nbits: Int32, x: Int32, su: Int32):
        """The unit position of the cut at cost position ``x`` (``decode_schedule._cuts`` / ``_invariant``)."""
        b = _count_le(mScr, Int32(1), B, x, nbits)  # first request whose cost range ends after x
        bc = cutlass.min(b, B - 1)
        Tb = mScr[B + 1 + bc]
        n = mScr[B + 2 + bc] - Tb
        res = mScr[B + 1 + B]
        if cutlass.const_expr(self.chunk > 0):
            cu = self.chunk // self.u
            pieces = (n + (cu - 1)) // cu
            j = cutlass.min(cutlass.max((x - mScr[bc] + (cu + self.c) // 2) // (cu + self.c), Int32(0)), pieces)
            if b < B:
                res = Tb + cutlass.min(j * cu, n)
        else:
            t = cutlass.min(cutlass.max(x - mScr[bc] - self.c, Int32(0)), n)
            t = cutlass.min((t + (su - 1)) // su * su, n)  # (su = 1: the balanced cut)
            if b < B:
                res = Tb + t
        return res

    @cute.jit
    def load(self, mScr: cute.Tensor, B: Int32, nbits: Int32, sP: cute.Tensor, g: Int32):
        """The cost of range ``g`` of the cuts ``sP`` (``decode_schedule._cta_load``); 0 past the last range."""
        res = Int32(0)
        if g < self.G:
            lo, hi = sP[g], sP[g + 1]
            if hi > lo:
                b0 = _count_le(mScr, B + 2, B, lo, nbits)
                b1 = _count_le(mScr, B + 2, B, hi - 1, nbits)
                res = (hi - lo) + self.c * (b1 - b0 + 1)
        return res

    @cute.kernel
    def kernel(self, mSeq: cute.Tensor, mPar: cute.Tensor, mCta: cute.Tensor, mReq: cute.Tensor,
               mScr: cute.Tensor, Storage: cutlass.Constexpr):
        tid, _, _ = cute.arch.thread_idx()
        st = cutlass.utils.SmemAllocator().allocate(Storage)
        sWarp = st.warp.get_tensor(cute.make_layout(_WARPS))
        sP = st.cut.get_tensor(cute.make_layout(_MAX_CTAS + 1))
        sP2 = st.cut2.get_tensor(cute.make_layout(_MAX_CTAS + 1))
        sNe = st.ne.get_tensor(cute.make_layout(_MAX_CTAS + 1))
        sPre = st.pre.get_tensor(cute.make_layout(2 * SMEM_BATCH + 2))
        if mSeq.shape[0] <= SMEM_BATCH:
            self.body(mSeq, mPar, mCta, mReq, sPre, sWarp, sP, sP2, sNe, tid)
        else:
            self.body(mSeq, mPar, mCta, mReq, mScr, sWarp, sP, sP2, sNe, tid)

    @cute.jit
    def body(self, mSeq: cute.Tensor, mPar: cute.Tensor, mCta: cute.Tensor, mReq: cute.Tensor, mScr: cute.Tensor,
             sWarp: cute.Tensor, sP: cute.Tensor, sP2: cute.Tensor, sNe: cute.Tensor, tid: Int32):
        """Steps 1-5 (module docstring) with the prefixes ``K``, ``T`` in ``mScr`` (shared or global memory)."""
        G = self.G
        B = mSeq.shape[0]
        cap, su = mPar[0], mPar[1]
        nbits = _bits(B)
        seg = (B + (THREADS - 1)) // THREADS
        b_lo = cutlass.min(tid * seg, B)
        b_hi = cutlass.min(b_lo + seg, B)

        # 1. the prefixes K (scratch[0 .. B]) and T (scratch[B + 1 .. 2B + 1])
        sk, sn = Int32(0), Int32(0)
        for b in cutlass.range(b_lo, b_hi, unroll=1):
            n = self.units(mSeq, cap, b)
            sk = sk + self.cost(n)
            sn = sn + n
        k0, _ = _block_exclusive_scan(sk, sWarp, tid)
        t0, _ = _block_exclusive_scan(sn, sWarp, tid)
        if tid == 0:
            mScr[0] = Int32(0)
            mScr[B + 1] = Int32(0)
        for b in cutlass.range(b_lo, b_hi, unroll=1):
            n = self.units(mSeq, cap, b)
            k0 = k0 + self.cost(n)
            t0 = t0 + n
            mScr[b + 1] = k0
            mScr[B + 2 + b] = t0
        cute.arch.barrier()

        # 2. the cuts P[0 .. G]
        total = mScr[B]
        if tid <= G:
            x = tid * total // G
            if cutlass.const_expr(self.chunk > 0 or self.mode == "balanced"):
                sP[tid] = self.cut(mScr, B, nbits, x, Int32(1))
            elif cutlass.const_expr(self.mode == "per_request"):
                sP[tid] = self.cut(mScr, B, nbits, x, su)
            else:
                sP[tid] = self.cut(mScr, B, nbits, x, Int32(1))
                sP2[tid] = self.cut(mScr, B, nbits, x, su)
        cute.arch.barrier()
        if cutlass.const_expr(self.chunk == 0 and self.mode == "choose"):
            lb = _block_max(self.load(mScr, B, nbits, sP, tid), sWarp, tid)
            ls = _block_max(self.load(mScr, B, nbits, sP2, tid), sWarp, tid)
            if ls.to(Float32) <= Float32(self.prefer) * lb.to(Float32):
                if tid <= G:
                    sP[tid] = sP2[tid]
            cute.arch.barrier()

        # 3. range g's requests and token bounds; the non-empty ranges before each range (sNe)
        nonempty = Int32(0)
        b_first, b_last = Int32(1), Int32(0)
        if tid < G:
            lo, hi = sP[tid], sP[tid + 1]
            if hi > lo:
                nonempty = Int32(1)
                b_first = cutlass.min(_count_le(mScr, B + 2, B, lo, nbits), B - 1)
                b_last = cutlass.min(_count_le(mScr, B + 2, B, hi - 1, nbits), B - 1)
                L = cutlass.min(cutlass.max(mSeq[b_last], Int32(0)), cap)
                mCta[tid, 0] = b_first
                mCta[tid, 1] = (lo - mScr[B + 1 + b_first]) * self.u
                mCta[tid, 2] = b_last
                mCta[tid, 3] = cutlass.min((hi - mScr[B + 1 + b_last]) * self.u, L)
            else:
                mCta[tid, 0] = Int32(1)
                mCta[tid, 1] = Int32(0)
                mCta[tid, 2] = Int32(0)
                mCta[tid, 3] = Int32(0)
            mCta[tid, 4] = Int32(-1)
            mCta[tid, 5] = Int32(-1)
            mCta[tid, 6] = Int32(-1)
        ne0, _ = _block_exclusive_scan(nonempty, sWarp, tid)
        if tid <= G:
            sNe[tid] = ne0
        cute.arch.barrier()

        # 4. per request: pieces, slots, the combine's work list
        gbits = _bits(Int32(G))
        su, ss = Int32(0), Int32(0)
        for b in cutlass.range(b_lo, b_hi, unroll=1):
            p = self.pieces(mScr, B, sP, sNe, gbits, b)
            if p >= 2:
                su = su + p
                ss = ss + 1
        slot, n_before = _block_exclusive_scan(su, sWarp, tid)
        k, n_split = _block_exclusive_scan(ss, sWarp, tid)
        for b in cutlass.range(b_lo, b_hi, unroll=1):
            p = self.pieces(mScr, B, sP, sNe, gbits, b)
            mReq[b, 0] = p
            mReq[b, 1] = Int32(-1)
            if p >= 2:
                if cutlass.const_expr(self.chunk > 0):
                    mReq[b, 1] = b * ((cap + (self.chunk - 1)) // self.chunk)
                else:
                    mReq[b, 1] = slot
                    mCta[k, 6] = b
                slot = slot + p
                k = k + 1
        cute.arch.barrier()

        # 5. range g's first and last piece's slots; the work list's length
        if tid < G:
            mCta[tid, 7] = n_split
            if cutlass.const_expr(self.chunk == 0):
                if nonempty > 0:
                    mCta[tid, 4] = self.slot_of(mScr, mReq, B, sP, sNe, gbits, b_first, tid)
                    mCta[tid, 5] = self.slot_of(mScr, mReq, B, sP, sNe, gbits, b_last, tid)

    @cute.jit
    def pieces(self, mScr: cute.Tensor, B: Int32, sP: cute.Tensor, sNe: cute.Tensor, gbits: Int32, b: Int32):
        """Request ``b``'s pieces: ``ceil(n_b / chunk units)`` (batch-invariant), else the non-empty ranges that
        meet its units ``[T[b], T[b + 1])`` (``decode_schedule._metadata``)."""
        t0, t1 = mScr[B + 1 + b], mScr[B + 2 + b]
        n = t1 - t0
        res = Int32(0)
        if cutlass.const_expr(self.chunk > 0):
            cu = self.chunk // self.u
            res = (n + (cu - 1)) // cu
        else:
            if n > 0:
                f = _count_le(sP, Int32(1), Int32(self.G), t0, gbits)  # first g with P[g + 1] > T[b]
                last = _count_le(sP, Int32(0), Int32(self.G), t1 - 1, gbits) - 1  # last g with P[g] < T[b + 1]
                res = sNe[cutlass.max(last + 1, Int32(0))] - sNe[cutlass.min(f, Int32(self.G))]
        return res

    @cute.jit
    def slot_of(self, mScr, mReq, B: Int32, sP: cute.Tensor, sNe: cute.Tensor, gbits: Int32, b: Int32, g: Int32):
        """The slot of request ``b``'s piece in range ``g`` (-1: direct)."""
        res = Int32(-1)
        first = mReq[b, 1]
        if first >= 0:
            f = _count_le(sP, Int32(1), Int32(self.G), mScr[B + 1 + b], gbits)
            res = first + sNe[g] - sNe[cutlass.min(f, Int32(self.G))]
        return res


@cute.jit
def launch_schedule(stream, seq_lens: cute.Tensor, params: cute.Tensor, cta: cute.Tensor, req: cute.Tensor,
                    scratch: cute.Tensor, *, num_ctas: cutlass.Constexpr, fixed_cost: cutlass.Constexpr,
                    mode: cutlass.Constexpr, prefer: cutlass.Constexpr, unit: cutlass.Constexpr,
                    chunk: cutlass.Constexpr):
    """FFI launch function (ABI: ``tokenspeed_jax.decode_schedule.decode_schedule`` on CUDA): ``seq_lens [B]``,
    ``params = (capacity, split_units)``, then the outputs ``cta [num_ctas, 8]``, ``req [B, 2]`` and the
    ``scratch [2 B + 2]`` prefixes."""
    MlaDecodeScheduleKernel(num_ctas=num_ctas, fixed_cost=fixed_cost, mode=mode, prefer=prefer, unit=unit,
                            chunk=chunk)(stream, seq_lens, params, cta, req, scratch)


__all__ = ["THREADS", "MlaDecodeScheduleKernel", "launch_schedule"]
