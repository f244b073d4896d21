"""Split-KV combine kernel of the Hopper MLA decode: merges a split request's fp32 partials and LSEs
(``MlaDecodeSm90.out_row``) in slot order (deterministic, no atomics), writes exact zeros and -inf LSE for length-0
requests.  A mixin of :class:`~tokenspeed_jax.kernels.sm90.decode_common.MlaDecodeSm90` (its module docstring: the
split), using its ``R``, ``DV``, ``out_dtype``, ``num_ctas``, ``num_m_blocks``, ``max_slots`` and ``chunk``.

The unit of work is a *warp item*: one column chunk of one row of one split request, merged by one warp alone over
all the request's slots.  Warp items are independent (each warp has its own shared-memory buffers, no CTA barrier)
and spread over every warp of a one-wave grid.  Inside an item the slot partials are copied
:attr:`COMBINE_SLOTS_IN_FLIGHT` at a time per lane into the warp's buffer by 16-byte cp.async (all in flight before
the first is added), 4 columns a lane.  The item's width is chosen per batch, from the number of split requests:

* **quarters** (128 of the 512 columns, the whole warp on each slot): a request of ``k`` pieces costs
  ``ceil(k / 4)`` dependent L2 round trips; 4 items a row, so a batch of many two-piece requests (64 split requests
  of 32 rows: 8192 items) runs in one round of the grid's items;
* **32-column chunks** (16 items a row), when they still fit in one round of the grid's warps (split requests x rows
  x 16 <= warps: a few long requests, the small batches of single-user latency): the warp's 4 groups of 8 lanes take
  every 4th slot, so 16 slots are in flight and a request of ``k`` pieces costs ``ceil(k / 16)`` round trips (B=1 at
  128k, one request of 130 pieces: 9 instead of 33), then two butterfly shuffles add the 4 groups' sums.

The batch-invariant build keeps quarters whatever the batch (its order of additions depends on the request alone)."""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, cute
from cutlass.cute.nvgpu import cpasync

from tokenspeed_jax.kernels.sm90.helpers import LOG2_E, row_ptr


class CombineMixin:
    """The combine kernel, its launch and the main kernels' PDL trigger (module docstring)."""

    @cute.jit
    def allow_combine_launch(self):
        """Main kernels first: the combine grid may launch now (PDL; it waits for this grid: :meth:`combine_kernel`)."""
        cute.arch.griddepcontrol_launch_dependents()

    COMBINE_CTAS_PER_SM = 16  # combine CTAs of 4 warps: one wave on every SM (at most 32 registers a thread)
    COMBINE_SLOTS_IN_FLIGHT = 4  # slot partials a warp item loads before adding the first

    @property
    def combine_lse_regs(self) -> int:
        """Slot LSEs a combine lane holds: the workspace's slots over the 32 lanes."""
        return -(-self.max_slots // 32)

    @cute.jit
    def launch_combine(self, stream, o_accum: cute.Tensor, lse_accum: cute.Tensor, output_scale: cute.Tensor,
                       sched_cta: cute.Tensor, sched_req: cute.Tensor, out: cute.Tensor, lse: cute.Tensor):

        @cute.struct
        class CombineStorage:  # per warp: its slot partials in flight (cp.async, 16 bytes a lane and slot), weights
            buf: cute.struct.Align[cute.struct.MemRange[Float32, 4 * self.COMBINE_SLOTS_IN_FLIGHT * 128], 16]
            w: cute.struct.Align[cute.struct.MemRange[Float32, 4 * 32 * self.combine_lse_regs], 16]

        self.combine_kernel(o_accum, lse_accum, output_scale, sched_cta, sched_req, out, lse, CombineStorage).launch(
            grid=(self.COMBINE_CTAS_PER_SM, self.num_ctas * self.num_m_blocks, 1), block=(128, 1, 1),
            smem=CombineStorage.size_in_bytes(), stream=stream, use_pdl=True,
            min_blocks_per_mp=self.COMBINE_CTAS_PER_SM, preferred_smem_carveout=100)

    @cute.jit
    def warp_allreduce(self, x: Float32, is_max: cutlass.Constexpr[bool]) -> Float32:
        """Max (``is_max``) or sum of ``x`` over the warp's 32 lanes, returned to all (butterfly, deterministic)."""
        for k in cutlass.range_constexpr(5):
            y = cute.arch.shuffle_sync_bfly(x, offset=16 >> k)
            x = cute.arch.fmax(x, y) if is_max else x + y
        return x

    @cute.kernel
    def combine_kernel(self, mOacc: cute.Tensor, mLacc: cute.Tensor, mOS: cute.Tensor, mCta: cute.Tensor,
                       mReq: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor, Storage: cutlass.Constexpr):
        """A fixed one-wave grid (``COMBINE_CTAS_PER_SM`` x the SMs), 4 warps a CTA; the main kernel wrote the one-piece
        requests.  PDL (:meth:`allow_combine_launch`) launches it while the main grid runs, its CTAs taking SMs as main
        CTAs retire; ``griddepcontrol.wait`` holds every thread until the main grid is done and its writes are visible.
        What the schedule wrote (``mCta``, ``mReq``: before the main grid started) is read before that wait, while the
        main grid runs: the zero rows below and each warp's first item's request, so that after the wait an item's
        chain is its LSE and partial loads (issued together), the adds and the store.

        * Requests of length 0 (``mReq[b, 0] == 0``), ``b`` spread over the CTAs, rows over its warps: exact zero rows,
          LSE -inf.
        * Warp items ``((k, row), column chunk)`` (module docstring: quarters, or 32-column chunks where those fit
          one round of the grid's warps, ``gl`` 0 or 2) over the schedule's work list (``mCta[k, 6]``: the ``k``-th
          request cut into pieces; ``mCta[0, 7]`` of them, at most ``num_ctas - 1``), item ``i`` on the grid's warp
          ``i`` modulo the warps (a row's chunks on adjacent warps: adjacent loads).  The launch caps the kernel at
          the registers of its one-wave grid (``min_blocks_per_mp``; ``preferred_smem_carveout``: all of the SM's
          shared memory, which the grid's warp buffers need).
        * Batch-invariant schedule (:attr:`chunk` > 0): items over every request (more than ``num_ctas - 1`` may be
          split; requests of one piece skipped)."""
        tid, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        nx, ny, _ = cute.arch.grid_dim()
        cta, n_cta = by * nx + bx, nx * ny
        warp, lane = tid // 32, tid % 32
        NB = self.COMBINE_SLOTS_IN_FLIGHT
        st = cutlass.utils.SmemAllocator().allocate(Storage)
        sBuf = cute.make_tensor(st.buf.data_ptr(), cute.make_layout((4, 4 * NB * 32), stride=(1, 4)))
        NW = 32 * self.combine_lse_regs
        sW = cute.make_tensor(st.w.data_ptr() + warp * NW, cute.make_layout(NW))  # (this warp's)
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
        n_split = mCta[0, 7]
        gl = Int32(0)  # log2 of an item's lane groups: 0 (quarters) or 2 (32-column chunks)
        if cutlass.const_expr(self.chunk == 0):
            if n_split * (self.R * 16) <= n_cta * 4:
                gl = Int32(2)
        per_req = (self.R * 4) << gl
        n_req = n_split
        if cutlass.const_expr(self.chunk > 0):
            n_req = mReq.shape[0]
        item0, n_items = cta * 4 + warp, n_req * per_req
        b, ns, first = self.item_request(mCta, mReq, item0, n_items, per_req)  # (the warp's first item's, early)
        cute.arch.griddepcontrol_wait()
        for item in cutlass.range(item0, n_items, n_cta * 4, unroll=1):
            if item != item0:
                b, ns, first = self.item_request(mCta, mReq, item, n_items, per_req)
            if cutlass.const_expr(self.chunk > 0):
                if ns >= 2:
                    self.combine_item(mOacc, mLacc, mOS, mOut, mLse, sBuf, sW, res, item, b, ns, first, warp, lane,
                                      gl)
            else:  # (a listed request has >= 2 pieces; testing it here costs 10 registers)
                self.combine_item(mOacc, mLacc, mOS, mOut, mLse, sBuf, sW, res, item, b, ns, first, warp, lane, gl)

    @cute.jit
    def item_request(self, mCta: cute.Tensor, mReq: cute.Tensor, item: Int32, n_items: Int32, per_req: Int32):
        """``(b, pieces, first slot)`` of warp item ``item``'s request (zeros past ``n_items``): the ``item //
        per_req``-th request of the combine's work list (``mCta[k, 6]``), or that request itself (batch-invariant)."""
        b, ns, first = Int32(0), Int32(0), Int32(0)
        if item < n_items:
            if cutlass.const_expr(self.chunk > 0):
                b = item // per_req
            else:
                b = mCta[item // per_req, 6]
            ns, first = mReq[b, 0], mReq[b, 1]
        return b, ns, first

    @cute.jit
    def slot_max_sum(self, gL: cute.Tensor, sW: cute.Tensor, ns, lane):
        """``(max, ref, sum)`` over the ``ns`` slot LSEs ``gL``: lane ``l`` takes slots ``l, l + 32, ..`` in order (the
        same order for every batch with this piece count), then butterfly shuffles; ``ref`` is the max, or 0 where every
        slot is empty (-inf: exact zero weights); ``sum`` is that of the weights ``exp(lse_s - ref)``.  The default
        schedule's ``ns <= max_slots`` LSEs are loaded all at once (:attr:`combine_lse_regs` a lane) and the weights
        left in the warp's ``sW`` (published by a warp barrier); the batch-invariant one's (any count) are loaded
        again where added."""
        m = -Float32.inf
        part = Float32(0.0)
        if cutlass.const_expr(self.chunk > 0):
            for s in cutlass.range(lane, ns, 32, unroll=1):
                m = cute.arch.fmax(m, gL[s])
        else:
            lv = cute.make_rmem_tensor((self.combine_lse_regs,), Float32)
            for j in cutlass.range_constexpr(self.combine_lse_regs):
                lv[j] = -Float32.inf
                if lane + 32 * j < ns:
                    lv[j] = gL[lane + 32 * j]
                m = cute.arch.fmax(m, lv[j])
        m = self.warp_allreduce(m, True)
        ref = m
        if m == -Float32.inf:
            ref = Float32(0.0)
        if cutlass.const_expr(self.chunk > 0):
            for s in cutlass.range(lane, ns, 32, unroll=1):
                part = part + cute.arch.exp2((gL[s] - ref) * LOG2_E)
        else:
            for j in cutlass.range_constexpr(self.combine_lse_regs):
                wj = cute.arch.exp2((lv[j] - ref) * LOG2_E)
                sW[lane + 32 * j] = wj
                part = part + wj
            cute.arch.sync_warp()
        return m, ref, self.warp_allreduce(part, False)

    @cute.jit
    def slot_weight(self, gL: cute.Tensor, sW: cute.Tensor, ref, s):
        """Slot ``s``'s weight, bitwise the one :meth:`slot_max_sum` summed: from the warp's ``sW`` (default schedule),
        or ``exp(lse_s - ref)`` from the LSE (batch-invariant)."""
        res = Float32(0.0)
        if cutlass.const_expr(self.chunk > 0):
            res = cute.arch.exp2((gL[s] - ref) * LOG2_E)
        else:
            res = sW[s]
        return res

    @cute.jit
    def combine_item(self, mOacc, mLacc, mOS, mOut, mLse, sBuf, sW, res, item, b, ns, first, warp, lane, gl):
        """One warp merges row ``(item >> (2 + gl)) % R``, column chunk ``item % (4 << gl)`` (``128 >> gl`` columns)
        of request ``b`` over its ``ns >= 2`` slots from ``first`` (``mReq[b, 1]``).  Its ``2**gl`` lane groups
        (``32 >> gl`` lanes, 4 columns a lane) take the slots ``group, group + 2**gl, ..`` in order, each with
        :attr:`COMBINE_SLOTS_IN_FLIGHT` 16-byte cp.async copies in flight at a time (:meth:`load_slots`; the default
        build issues the first round before it reads the LSEs, so both loads are in flight together; not the
        batch-invariant build, where with its run-time LSE loops that spilled two registers); slot ``s``'s
        partial times its weight (:meth:`slot_weight`).  Butterfly shuffles add the
        groups' sums (the same sum in every lane, commutative adds), group 0 stores ``output_scale * acc / sum`` and
        the first chunk's lane 0 the LSE ``max + log(sum)``; exact zeros and -inf where every slot was empty (NaN: a
        piece saw a NaN / Inf key, NaN LSE)."""
        NB = self.COMBINE_SLOTS_IN_FLIGHT
        ng = Int32(1) << gl
        grp, lig = lane >> (5 - gl), lane & ((Int32(32) >> gl) - 1)
        r = (item >> (2 + gl)) % self.R
        chunk = item & ((Int32(4) << gl) - 1)
        col = chunk * (Int32(128) >> gl) + lig * 4
        lbase = Int64(first) * self.R + r
        gL = cute.make_tensor(mLacc.iterator + lbase, cute.make_layout(mLacc.shape[0], stride=self.R))
        if cutlass.const_expr(self.chunk == 0):
            self.load_slots(mOacc, sBuf, lbase, col, Int32(0), grp, ng, ns, warp, lane)  # (in flight beside the LSEs)
        m, ref, total = self.slot_max_sum(gL, sW, ns, lane)
        acc = cute.make_rmem_tensor((4,), Float32)
        acc.fill(0.0)
        w = cute.make_rmem_tensor((NB,), Float32)
        for s0 in cutlass.range(0, ns, NB * ng, unroll=1):  # (rounds; group `grp`: slots s0 + grp + j * ng)
            if cutlass.const_expr(self.chunk > 0):
                self.load_slots(mOacc, sBuf, lbase, col, s0, grp, ng, ns, warp, lane)
            elif s0 > 0:  # (the default build's first round is in flight already)
                self.load_slots(mOacc, sBuf, lbase, col, s0, grp, ng, ns, warp, lane)
            for j in cutlass.range_constexpr(NB):
                w[j] = self.slot_weight(gL, sW, ref, cutlass.min(s0 + grp + j * ng, ns - 1))
            cute.arch.cp_async_wait_group(0)
            for j in cutlass.range_constexpr(NB):
                v = sBuf[None, (warp * NB + j) * 32 + lane].load()
                for e in cutlass.range_constexpr(4):
                    acc[e] = cutlass.select_(s0 + grp + j * ng < ns, acc[e] + w[j] * v[e], acc[e])
        if gl > 0:  # the 4 groups' sums (lane bits 4 and 3)
            for k in cutlass.range_constexpr(2):
                for e in cutlass.range_constexpr(4):
                    acc[e] = acc[e] + cute.arch.shuffle_sync_bfly(acc[e], offset=16 >> k)
        inv = Float32(0.0)
        lse = -Float32.inf
        if total != 0.0:
            inv = mOS[0] / total
            lse = m + cute.math.log(total, fastmath=False)
        for e in cutlass.range_constexpr(4):
            res[e] = (acc[e] * inv).to(self.out_dtype)
        obase = Int64(b) * self.R + r
        if grp == 0:  # (gl 0: every lane)
            cute.make_tensor(row_ptr(mOut, obase, col, self.DV, 8), cute.make_layout(4)).store(res.load())
        if lane == 0 and chunk == 0:
            cute.make_tensor(mLse.iterator + obase, cute.make_layout(1))[0] = lse
        cute.arch.sync_warp()  # (the warp's sW and sBuf are free for its next item)

    @cute.jit
    def load_slots(self, mOacc, sBuf, lbase, col, s0, grp, ng, ns, warp, lane):
        """One round of :meth:`combine_item`: lane group ``grp``'s slots ``s0 + grp + j * ng`` (``j <``
        :attr:`COMBINE_SLOTS_IN_FLIGHT`; past the last slot: the last slot again), 4 columns from ``col`` each, into
        the warp's buffer by 16-byte cp.async, committed as one group (all in flight whatever the register allocator
        does)."""
        NB = self.COMBINE_SLOTS_IN_FLIGHT
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Float32,
                                   num_bits_per_copy=128)
        for j in cutlass.range_constexpr(NB):
            s = cutlass.min(s0 + grp + j * ng, ns - 1)
            cute.copy(atom, cute.make_tensor(row_ptr(mOacc, lbase + Int64(s) * self.R, col, self.DV, 16),
                                             cute.make_layout(4)), sBuf[None, (warp * NB + j) * 32 + lane])
        cute.arch.cp_async_commit_group()


__all__ = ["CombineMixin"]
