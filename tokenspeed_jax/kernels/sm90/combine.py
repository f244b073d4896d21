"""Split-KV combine kernel of the Hopper MLA decode: merges a split request's fp32 partials and LSEs
(``MlaDecodeSm90.out_row``) in slot order (deterministic, no atomics), writes exact zeros and -inf LSE for length-0
requests.  A mixin of :class:`~tokenspeed_jax.kernels.sm90.decode_common.MlaDecodeSm90` (its module docstring: the
split), using its ``R``, ``DV``, ``out_dtype``, ``num_ctas``, ``num_m_blocks``, ``max_slots`` and ``chunk``."""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int64, cute

from tokenspeed_jax.kernels.sm90.helpers import LOG2_E, row_ptr


class CombineMixin:
    """The combine kernel, its launch and the main kernels' PDL trigger (module docstring)."""

    @cute.jit
    def allow_combine_launch(self):
        """Main kernels first: the combine grid may launch now (PDL; it waits for this grid: :meth:`combine_kernel`)."""
        cute.arch.griddepcontrol_launch_dependents()

    COMBINE_CTAS_PER_SM = 16  # combine CTAs of 128 threads: one wave on every SM, whatever the batch
    COMBINE_WARP_SLOTS = 8  # a split request of at most this many pieces: one warp per column quarter, all its slots

    @property
    def combine_lse_regs(self) -> int:
        """Slot LSEs a combine lane holds: the workspace's slots over the 32 lanes."""
        return -(-self.max_slots // 32)

    @cute.jit
    def launch_combine(self, stream, o_accum: cute.Tensor, lse_accum: cute.Tensor, output_scale: cute.Tensor,
                       sched_cta: cute.Tensor, sched_req: cute.Tensor, out: cute.Tensor, lse: cute.Tensor):

        @cute.struct
        class CombineStorage:
            acc: cute.struct.Align[cute.struct.MemRange[Float32, 384], 16]
            w: cute.struct.Align[cute.struct.MemRange[Float32, 4 * 32 * self.combine_lse_regs], 16]

        self.combine_kernel(o_accum, lse_accum, output_scale, sched_cta, sched_req, out, lse, CombineStorage).launch(
            grid=(self.COMBINE_CTAS_PER_SM, self.num_ctas * self.num_m_blocks, 1), block=(128, 1, 1),
            smem=CombineStorage.size_in_bytes(), stream=stream, use_pdl=True)

    @cute.jit
    def warp_allreduce(self, x: Float32, is_max: cutlass.Constexpr[bool]) -> Float32:
        """Max (``is_max``) or sum of ``x`` over the warp's 32 lanes, returned to all (butterfly, deterministic)."""
        for k in cutlass.range_constexpr(5):
            y = cute.arch.shuffle_sync_bfly(x, offset=16 >> k)
            x = cute.arch.fmax(x, y) if is_max else x + y
        return x

    @cute.jit
    def warp_max_ref(self, m: Float32):
        """``(max, ref)``: warp max of ``m`` and weight reference (0 if -inf: every slot empty, exact zero weights)."""
        m = self.warp_allreduce(m, True)
        ref = m
        if m == -Float32.inf:
            ref = Float32(0.0)
        return m, ref

    @cute.kernel
    def combine_kernel(self, mOacc: cute.Tensor, mLacc: cute.Tensor, mOS: cute.Tensor, mCta: cute.Tensor,
                       mReq: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor, Storage: cutlass.Constexpr):
        """A fixed one-wave grid (``COMBINE_CTAS_PER_SM`` x the SMs), 4 warps a CTA; the main kernel wrote the one-piece
        requests.  PDL (:meth:`allow_combine_launch`) launches it while the main grid runs, its CTAs taking SMs as main
        CTAs retire; ``griddepcontrol.wait`` holds every thread until the main grid is done and its writes are visible.

        * Rows ``(k, row)`` of the schedule's work list (``mCta[k, 6]``: the ``k``-th request cut into pieces;
          ``mCta[0, 7]`` of them, at most ``num_ctas - 1``), spread over the CTAs; a row is 4 items, its column
          quarters (a lane: 4 of the quarter's 128 columns).  A request of at most ``COMBINE_WARP_SLOTS`` pieces
          (the common case: a CTA range boundary cuts most split requests once or twice) has each of the 4 warps
          merge one quarter over all its slots alone (:meth:`combine_row_warp`: no shared-memory sum, no CTA barrier).
          A request of more pieces has the 4 warps take its quarters in turn and split each quarter's slots
          (:meth:`combine_row`: warp ``w``: slots ``w, w + 4, ..``), so a request cut over many CTAs (one long
          request: up to one piece per CTA) merges with 4 warps' loads in flight.  Either way each slot's fp32
          partial is weighted by ``exp(lse_s - max)`` (max and sum over all slots by shuffles) and the sums are
          added in a fixed order (deterministic, no atomics).
        * Requests of length 0 (``mReq[b, 0] == 0``), ``b`` spread over the CTAs: exact zero rows, LSE -inf.
        * Batch-invariant schedule (:attr:`chunk` > 0): items ``(b, row, column quarter)`` over every request (more
          than ``num_ctas - 1`` may be split; :meth:`combine_item`)."""
        cute.arch.griddepcontrol_wait()
        tid, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        nx, ny, _ = cute.arch.grid_dim()
        cta, n_cta = by * nx + bx, nx * ny
        warp, lane = tid // 32, tid % 32
        st = cutlass.utils.SmemAllocator().allocate(Storage)
        NL = self.combine_lse_regs
        sAcc = st.acc.get_tensor(cute.make_layout(384))
        sW = st.w.get_tensor(cute.make_layout(4 * 32 * NL))
        res = cute.make_rmem_tensor((4,), self.out_dtype)
        for b in cutlass.range(cta, mReq.shape[0], n_cta, unroll=1):
            if mReq[b, 0] == 0:  # a request of length 0: exact zeros, LSE -inf
                for r in cutlass.range(warp, self.R, 4, unroll=1):
                    obase = Int64(b) * self.R + r
                    res.fill(0.0)
                    for c in cutlass.range_constexpr(4):
                        cute.make_tensor(row_ptr(mOut, obase, c * 128 + lane * 4, self.DV, 8),
                                         cute.make_layout(4)).store(res.load())
                    if lane == 0:
                        cute.make_tensor(mLse.iterator + obase, cute.make_layout(1))[0] = -Float32.inf
        if cutlass.const_expr(self.chunk > 0):
            # (the batch-invariant schedule: every request, split or not, its items in the CTA's 4 warps)
            for item in cutlass.range(cta, mReq.shape[0] * (self.R * 4), n_cta, unroll=1):
                self.combine_item(mOacc, mLacc, mOS, mReq, mOut, mLse, sAcc, sW, res, item, item // (self.R * 4),
                                  warp, lane)
        else:
            for g in cutlass.range(cta, mCta[0, 7] * self.R, n_cta, unroll=1):  # (split request, row)
                b = mCta[g // self.R, 6]
                ns = mReq[b, 0]
                if ns <= self.COMBINE_WARP_SLOTS:  # (the same for the whole CTA)
                    self.combine_row_warp(mOacc, mLacc, mOS, mOut, mLse, sW, res, g * 4 + warp, b, ns, mReq[b, 1],
                                          warp, lane)
                else:
                    for q in cutlass.range(4, unroll=1):
                        self.combine_row(mOacc, mLacc, mOS, mReq, mOut, mLse, sAcc, sW, res, g * 4 + q, b, ns,
                                         warp, lane)

    @cute.jit
    def combine_item(self, mOacc, mLacc, mOS, mReq, mOut, mLse, sAcc, sW, res, item, b, warp, lane):
        """The batch-invariant combine's item (:attr:`chunk` > 0): row ``(item // 4) % R``, column quarter ``item % 4``
        of any request ``b`` (< 2 pieces: skipped), any slot count: lanes take slots ``lane, lane + 32, ..`` in order
        for max and sum (per piece count the same in any batch), weights recomputed from LSEs where added."""
        ns = mReq[b, 0]
        if ns >= 2:
            self.combine_row(mOacc, mLacc, mOS, mReq, mOut, mLse, sAcc, sW, res, item, b, ns, warp, lane)

    @cute.jit
    def combine_row(self, mOacc, mLacc, mOS, mReq, mOut, mLse, sAcc, sW, res, item, b, ns, warp, lane):
        """The 4 warps' merge of item ``item`` of request ``b`` (``ns`` >= 2 slots from ``mReq[b, 1]``): warp ``w``
        adds slots ``w, w + 4, ..`` (the next one's partial in flight), warp 0 the 4 sums in warp order."""
        NL = self.combine_lse_regs
        r = (item // 4) % self.R
        col = (item % 4) * 128 + lane * 4
        lbase = Int64(mReq[b, 1]) * self.R + r
        if cutlass.const_expr(self.chunk > 0):
            gL = cute.make_tensor(mLacc.iterator + lbase, cute.make_layout(mLacc.shape[0], stride=self.R))
            m = -Float32.inf
            for s in cutlass.range(lane, ns, 32, unroll=1):
                m = cute.arch.fmax(m, gL[s])
            m, ref = self.warp_max_ref(m)
            part = Float32(0.0)
            for s in cutlass.range(lane, ns, 32, unroll=1):
                part = part + cute.arch.exp2((gL[s] - ref) * LOG2_E)
            total = self.warp_allreduce(part, False)
        else:
            m, ref, total = self.slot_weights(mLacc, lbase, ns, sW, warp, lane, NL)
        cute.arch.sync_warp()
        acc = cute.make_rmem_tensor((4,), Float32)
        acc.fill(0.0)
        # slots warp, warp + 4, ..: slot s + 4's partial loads while slot s is added (past the last: valid row, unused)
        vc = cute.make_rmem_tensor((4,), Float32)
        vc.store(cute.make_tensor(row_ptr(mOacc, lbase + Int64(cutlass.min(warp, ns - 1)) * self.R, col,
                                          self.DV, 16), cute.make_layout(4)).load())
        for s in cutlass.range(warp, ns, 4, unroll=2):
            vn = cute.make_tensor(row_ptr(mOacc, lbase + Int64(cutlass.min(s + 4, ns - 1)) * self.R, col,
                                          self.DV, 16), cute.make_layout(4)).load()
            if cutlass.const_expr(self.chunk > 0):
                ws = cute.arch.exp2((gL[s] - ref) * LOG2_E)
            else:
                ws = sW[warp * NL * 32 + s]
            for j in cutlass.range_constexpr(4):
                acc[j] = acc[j] + ws * vc[j]
            vc.store(vn)
        if warp > 0:
            for j in cutlass.range_constexpr(4):
                sAcc[(warp - 1) * 128 + lane * 4 + j] = acc[j]
        cute.arch.barrier()
        if warp == 0:
            for o in cutlass.range_constexpr(3):
                for j in cutlass.range_constexpr(4):
                    acc[j] = acc[j] + sAcc[o * 128 + lane * 4 + j]
            self.store_row(mOS, mOut, mLse, res, acc, m, total, b, r, col, lane)
        cute.arch.barrier()  # sAcc is free for the next item

    @cute.jit
    def slot_weights(self, mLacc, lbase, ns, sW, warp, lane, NL: cutlass.Constexpr[int]):
        """``(max, ref, sum)`` of the ``ns <= 32 NL`` slot LSEs of the row at ``lbase`` (lane ``l`` loads slots ``l,
        l + 32, ..``, all in flight) and each slot's weight ``exp(lse_s - ref)`` into the warp's own ``sW`` copy (no
        CTA barrier; the caller's ``sync_warp`` publishes it to the warp)."""
        W = self.combine_lse_regs * 32  # (the warp's sW copy)
        gL = cute.make_tensor(mLacc.iterator + lbase, cute.make_layout(self.max_slots, stride=self.R))
        lv = cute.make_rmem_tensor((NL,), Float32)
        m = -Float32.inf
        for j in cutlass.range_constexpr(NL):
            lv[j] = -Float32.inf
            if lane + 32 * j < ns:
                lv[j] = gL[lane + 32 * j]
            m = cute.arch.fmax(m, lv[j])
        m, ref = self.warp_max_ref(m)
        part = Float32(0.0)
        for j in cutlass.range_constexpr(NL):
            w = cute.arch.exp2((lv[j] - ref) * LOG2_E)
            sW[warp * W + lane + 32 * j] = w
            part = part + w
        return m, ref, self.warp_allreduce(part, False)

    @cute.jit
    def store_row(self, mOS, mOut, mLse, res, acc, m, total, b, r, col, lane):
        """Output columns ``col..col + 3`` of row ``r`` of request ``b``: the weighted sum ``acc`` over the weights'
        sum ``total`` times ``output_scale``, and (column 0's lane) the LSE ``m + log(total)``; exact zeros and -inf
        where every slot was empty (NaN: a piece saw a NaN / Inf key, NaN LSE)."""
        inv = Float32(0.0)
        lse = -Float32.inf
        if total != 0.0:
            inv = mOS[0] / total
            lse = m + cute.math.log(total, fastmath=False)
        for j in cutlass.range_constexpr(4):
            res[j] = (acc[j] * inv).to(self.out_dtype)
        obase = Int64(b) * self.R + r
        cute.make_tensor(row_ptr(mOut, obase, col, self.DV, 8), cute.make_layout(4)).store(res.load())
        if lane == 0 and col == 0:
            cute.make_tensor(mLse.iterator + obase, cute.make_layout(1))[0] = lse

    @cute.jit
    def combine_row_warp(self, mOacc, mLacc, mOS, mOut, mLse, sW, res, item, b, ns, slot0, warp, lane):
        """One warp merges item ``item`` (row ``(item // 4) % R``, column quarter ``item % 4``) of split request ``b``
        over its ``ns <= COMBINE_WARP_SLOTS`` slots from ``slot0``: a lane's 16-byte loads of the partials, one slot
        at a time, added in slot order (two slots' loads in flight took the kernel from 32 to 38-40 registers, 12 CTAs
        an SM resident instead of the grid's 16)."""
        r = (item // 4) % self.R
        col = (item % 4) * 128 + lane * 4
        lbase = Int64(slot0) * self.R + r
        m, ref, total = self.slot_weights(mLacc, lbase, ns, sW, warp, lane, -(-self.COMBINE_WARP_SLOTS // 32))
        cute.arch.sync_warp()
        acc = cute.make_rmem_tensor((4,), Float32)
        acc.fill(0.0)
        W = self.combine_lse_regs * 32
        for s in cutlass.range(ns, unroll=1):
            v = cute.make_tensor(row_ptr(mOacc, lbase + Int64(s) * self.R, col, self.DV, 16),
                                 cute.make_layout(4)).load()
            ws = sW[warp * W + s]
            for j in cutlass.range_constexpr(4):
                acc[j] = acc[j] + ws * v[j]
        self.store_row(mOS, mOut, mLse, res, acc, m, total, b, r, col, lane)
        cute.arch.sync_warp()  # (the warp's sW copy is free for its next row)


__all__ = ["CombineMixin"]
