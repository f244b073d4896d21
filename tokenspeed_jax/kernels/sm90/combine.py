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

        * Work items ``(k, row, column quarter)`` over the schedule's work list (``mCta[k, 6]``: the ``k``-th request
          cut into pieces; ``mCta[0, 7]`` of them, at most ``num_ctas - 1``), spread over the CTAs.  An item's 4 warps
          split its slots (warp ``w``: slots ``w, w + 4, ..``; a lane: 4 of the quarter's 128 columns), each weighting
          its fp32 partials by ``exp(lse_s - max)`` (every warp takes max and sum over all slots by shuffles); warp 0
          adds the 4 warp sums from shared memory in warp order (deterministic, no atomics), writes output row and LSE.
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
        n_items = mCta[0, 7] * (self.R * 4)
        if cutlass.const_expr(self.chunk > 0):
            n_items = mReq.shape[0] * (self.R * 4)  # (the batch-invariant schedule: every request, split or not)
        for item in cutlass.range(cta, n_items, n_cta, unroll=1):
            if cutlass.const_expr(self.chunk > 0):
                self.combine_item(mOacc, mLacc, mOS, mReq, mOut, mLse, sAcc, sW, res, item, item // (self.R * 4),
                                  warp, lane)
            else:
                self.combine_item(mOacc, mLacc, mOS, mReq, mOut, mLse, sAcc, sW, res, item,
                                  mCta[item // (self.R * 4), 6], warp, lane)

    @cute.jit
    def combine_item(self, mOacc, mLacc, mOS, mReq, mOut, mLse, sAcc, sW, res, item, b, warp, lane):
        """:meth:`combine_kernel` item: row ``(item // 4) % R``, column quarter ``item % 4`` of split request ``b``.
        :attr:`chunk` > 0: any request (< 2 pieces: skipped) and slot count: lanes take slots ``lane, lane + 32, ..`` in
        order for max and sum (per piece count the same in any batch), weights recomputed from LSEs where added."""
        ns = mReq[b, 0]
        if cutlass.const_expr(self.chunk > 0):
            if ns >= 2:
                self.combine_row(mOacc, mLacc, mOS, mReq, mOut, mLse, sAcc, sW, res, item, b, ns, warp, lane)
        else:
            self.combine_row(mOacc, mLacc, mOS, mReq, mOut, mLse, sAcc, sW, res, item, b, ns, warp, lane)

    @cute.jit
    def combine_row(self, mOacc, mLacc, mOS, mReq, mOut, mLse, sAcc, sW, res, item, b, ns, warp, lane):
        """The merge of :meth:`combine_item` (``ns`` >= 2 slots from ``mReq[b, 1]``)."""
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
            gL = cute.make_tensor(mLacc.iterator + lbase, cute.make_layout(self.max_slots, stride=self.R))
            lv = cute.make_rmem_tensor((NL,), Float32)  # slot lane + 32 j's LSE, all loads in flight
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
                sW[warp * NL * 32 + lane + 32 * j] = w  # (each warp its own copy: no CTA barrier)
                part = part + w
            total = self.warp_allreduce(part, False)
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
            inv = Float32(0.0)
            lse = -Float32.inf
            if total != 0.0:  # (NaN: a piece saw a NaN / Inf key, NaN LSE)
                inv = mOS[0] / total
                lse = m + cute.math.log(total, fastmath=False)
            for j in cutlass.range_constexpr(4):
                res[j] = (acc[j] * inv).to(self.out_dtype)
            obase = Int64(b) * self.R + r
            cute.make_tensor(row_ptr(mOut, obase, col, self.DV, 8), cute.make_layout(4)).store(res.load())
            if lane == 0 and col == 0:
                cute.make_tensor(mLse.iterator + obase, cute.make_layout(1))[0] = lse
        cute.arch.barrier()  # sAcc is free for the next item


__all__ = ["CombineMixin"]
