"""FP8 MLA decode for Hopper on 32- and 16-row tiles (S x H <= 32), each computing warpgroup on its own KV tiles.

Both matmuls transposed (``S^T = K Q^T``, ``O^T = V^T P^T``, query rows as N: the O^T loop's ``qk_t``); the computing
warpgroups share only the producer and the smem ring: warpgroup ``g`` runs tiles ``2 j + g`` (buffers ``2 (j % 2) + g``)
over **all** 512 features with its own running max, row sums, ``O^T``, FlashAttention-2 style: fold -> exp -> P^T store
-> ``O^T *= scale`` -> ``V^T`` loads + PV -> next QK -> both retired -> slot free.  No barrier between them in the loop:
one's softmax overlaps the other's tensor work in any phase (a shared running max would chain WG0's softmax -> SCALE0 ->
WG1's softmax -> SCALE1 -> ..., which, not the bytes, would set the iteration on these memory-bound shapes).  Costs:

* 512-feature ``O^T``: ``4 pv_n`` accumulators (128 at 32 rows) + ``V^T`` fragments of all 8 m-blocks (64 registers, one
  set).  The PV retires before the next QK issue (else ``V^T`` and S live together: ptxas spills in the loop).
* The epilogue merges the two partial states (each over half the split's tiles): column maxima via smem; each warpgroup
  rescales its ``O^T`` and row sums to the common max (``fold_max``: a warpgroup without keys contributes zeros), swaps
  the ``O^T`` half it does not store via the freed KV buffers (``4 pv_n / 2`` floats a thread each way,
  ``[writer][element][thread]``: both share one fragment layout, so thread ``t`` of one holds exactly what thread ``t``
  of the other needs), and stores its 256 features (:meth:`~.transposed_out.TransposedOutMixin.store_ot_rows`).
* Warpgroup ``g`` frees its own buffers, arriving on ``SLOT0_FREE + g`` once its PV of one retired and its next tile
  landed (loaded after the producer synced on its previous arrival: no arrival overtakes the sync of the one before).
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, cute
from cutlass.cute.nvgpu import warpgroup

from tokenspeed_jax.kernels.sm90.decode_trace import TRACE_EVENTS
from tokenspeed_jax.kernels.sm90.fp8_transposed_pv import (_BUF_BYTES, _CHUNK, _CHUNK_BYTES, _F8, _P_BYTES,
                                                            MlaDecodeFp8TransposedPvSm90)
from tokenspeed_jax.kernels.sm90.fp8_operands import clean_e4m3_rows
from tokenspeed_jax.kernels.sm90.helpers import LOG2_E, Barrier

# DecodeTraceMixin.mark points (both warpgroups run the same code: same names); "-" unused, as many as TRACE_EVENTS
_OWN_EVENTS = ("top", "column maxima + TAIL", "fold (own max, scale)", "exp", "P store + TAIL, O^T *= scale",
               "V^T loads + PV issue + retire", "wait next tile landed", "next QK issue", "QK retired",
               "SLOT*_FREE out")
TRACE_EVENTS_OWN = tuple((e, e) for e in _OWN_EVENTS) + (("-", "-"),) * (len(TRACE_EVENTS) - len(_OWN_EVENTS))


class MlaDecodeFp8TransposedSm90(MlaDecodeFp8TransposedPvSm90):
    """:class:`~.fp8_transposed_pv.MlaDecodeFp8TransposedPvSm90` on 32- / 16-row tiles (``qk_t``), each warpgroup on its
    own tiles (module docstring): same host side, prologue and producer; its own :meth:`consume`."""

    def __init__(self, **kw):
        super().__init__(qk_t=True, **kw)

    @cute.jit
    def clean_fp8_tail(self, stg: Int32, tile_start: Int32, split_end: Int32, wtid: Int32):
        """With :attr:`hidden_keys`: NaN bytes of the V of keys ``[split_end - hidden_keys, split_end)`` in the tile's
        staging at shared address ``stg`` -> 0 (:func:`~.fp8_operands.clean_e4m3_rows`) if it holds any, fenced for the
        async proxy (the buffer's next TMA refill).  By the owning warpgroup's 128 threads (no other reads its staging),
        after its QK retired, before its first V ``ldmatrix`` (a later warpgroup barrier publishes them)."""
        if cutlass.const_expr(self.hidden_keys > 0):
            lo, hi = self.hidden_rows(tile_start, split_end)
            if hi > lo:
                clean_e4m3_rows(stg, lo, hi, wtid, self.DV // _CHUNK, _CHUNK_BYTES)
                cute.arch.fence_view_async_shared()

    @cute.jit
    def consume(self, c, cta, b, seq, split_start, split_end, split, n_pairs):
        """WG ``wg``: tiles ``2 j + wg``, merge, epilogue; ``cta`` for :meth:`mark` (:data:`TRACE_EVENTS_OWN`)."""
        scale_log2, out_scale = c.mSS[0] * LOG2_E, c.mOS[0]  # (loaded once a piece)
        qk_mma, pv_mma = c.mmas
        sQ, st, bufs, wg, wtid, mblk, mbar, mTrace = c.sQ, c.st, c.bufs, c.wg, c.wtid, c.mblk, c.mbar, c.mTrace
        bn = self.block_n
        sM = st.row_max.get_tensor(cute.make_layout(64))
        sSum = st.row_sum.get_tensor(cute.make_layout(128))
        sRed = st.red.get_tensor(cute.make_layout(2 * 4 * 32))
        zero = st.zero_row.data_ptr().toint()
        stg0 = bufs.toint() + _P_BYTES
        qk_thr = qk_mma.get_slice(wtid)
        pv_thr = pv_mma.get_slice(wtid)
        tSrQ = qk_thr.make_fragment_B(qk_thr.partition_B(cute.local_tile(sQ[None, None, 0], (self.pv_n, self.D),
                                                                         (0, 0))))
        acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((bn, self.pv_n)))
        tScS = qk_thr.partition_C(cute.make_identity_tensor((bn, self.pv_n)))
        acc = pv_thr.make_fragment_C(pv_thr.partition_shape_C((self.DV, self.pv_n)))  # O^T, all 512 features
        acc.fill(0.0)
        a_layout = pv_thr.make_fragment_A(pv_thr.partition_shape_A((self.DV, bn))).layout
        a = cute.make_rmem_tensor((64,), Int32)  # V^T: 8 m-blocks x 2 k32 steps x 4 words (load_vt's order)
        tA = cute.make_tensor(cute.recast_ptr(a.iterator, dtype=_F8), a_layout)
        qk_mma.set(warpgroup.Field.ACCUMULATE, True)
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)

        nst = self.pv_n // 4
        lim = self.col_limits(mblk, seq, split_end, wtid)
        row_l = cute.make_rmem_tensor((nst,), Float32)
        m_run = cute.make_rmem_tensor((nst,), Float32)
        for i in cutlass.range_constexpr(nst):
            row_l[i] = 0.0
            m_run[i] = -Float32.inf
        ref = cute.make_rmem_tensor((nst,), Float32)
        sc = cute.make_rmem_tensor((nst,), Float32)

        if n_pairs > 0:  # first QK: pair 0, buffer wg
            self.landed(mbar + wg, 0)
            self.qk_tile(qk_mma, qk_thr, acc_s, tSrQ, bufs, wg)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
        for j in cutlass.range(n_pairs, unroll=1):
            u = j % 2
            k = 2 * u + wg
            more = j + 1 < n_pairs
            refill = j + 2 < n_pairs  # the producer refills this tile's buffer with pair j + 2's
            t = split_start + (2 * j + wg) * bn
            # (the causal tail's V, before the TAIL barrier below publishes it to this warpgroup's V^T loads)
            self.clean_fp8_tail(stg0 + k * _BUF_BYTES, t, split_end, wtid)
            self.mark(mTrace, cta, wg, wtid, j, 0)
            self.fold_t(acc_s, tScS, lim, t, scale_log2, None, None, None, sRed, row_l, ref, sc, wg, wtid,
                        (mTrace, cta, j, 1, 2), m_run)
            self.exp_t(acc_s, ref, row_l)
            self.mark(mTrace, cta, wg, wtid, j, 3)
            self.store_p_tile(acc_s, qk_thr, bufs, k, wtid)
            cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)  # (all of P^T stored)
            self.scale_cols(acc, sc)
            self.mark(mTrace, cta, wg, wtid, j, 4)
            self.load_vt(a, stg0 + k * _BUF_BYTES, zero, t, split_end, 0, wtid, 8)
            self.pv_ot(pv_mma, acc, tA, self.p_operand(pv_thr, bufs, k))
            warpgroup.commit_group()
            # the PV retires before the next QK is issued (module docstring: both in flight, ptxas spills)
            warpgroup.wait_group(0)
            self.mark(mTrace, cta, wg, wtid, j, 5)
            # the next QK, issued for the last pair too (S thrown away; :mod:`.fp8_transposed_pv`, "QK early")
            if more:
                self.landed(mbar + 2 * (1 - u) + wg, ((j + 1) // 2) % 2)
            self.mark(mTrace, cta, wg, wtid, j, 6)
            self.qk_tile(qk_mma, qk_thr, acc_s, tSrQ, bufs, 2 * (1 - u) + wg)
            warpgroup.commit_group()
            self.mark(mTrace, cta, wg, wtid, j, 7)
            warpgroup.wait_group(0)
            self.mark(mTrace, cta, wg, wtid, j, 8)
            if refill:  # (its next tile landed above: module docstring)
                cute.arch.fence_view_async_shared()  # (the ldmatrix reads before the refill's TMA writes)
                cute.arch.barrier_arrive(barrier_id=int(Barrier.SLOT0_FREE) + wg, number_of_threads=160)
            self.mark(mTrace, cta, wg, wtid, j, 9)

        # ---- merge: the common max of each column (its 2^8 P bias in it), both states rescaled to it
        self.epilogue_barrier(c, b)  # (with the producer: every TMA load consumed, the buffers free for the O^T swap)
        if wtid < 4:  # (warp 0's lanes 0..3 hold every column between them)
            for i in cutlass.range_constexpr(nst):
                sSum[wg * 64 + self.col_n(i, wtid)] = m_run[i]
        cute.arch.barrier(barrier_id=int(Barrier.ROW_SUM), number_of_threads=self.num_threads)
        for i in cutlass.range_constexpr(nst):
            n = self.col_n(i, wtid)
            m_new, _, f = self.fold_max(m_run[i], sSum[(1 - wg) * 64 + n])
            sc[i] = f
            row_l[i] = row_l[i] * f
            if wg == 0 and wtid < 4:
                sM[n] = m_new  # (row_sums_ot's LSE)
        self.scale_cols(acc, sc)
        # the half of O^T this warpgroup does not store -> the other one: [writer][element][thread] fp32
        half = 2 * self.pv_n  # 4 m-blocks x pv_n / 2 elements a thread
        sX = cute.make_tensor(cute.recast_ptr(bufs, dtype=Float32), cute.make_layout((128, half, 2),
                                                                                  stride=(1, 128, 128 * half)))
        if wg == 0:
            for e in cutlass.range_constexpr(half):
                sX[wtid, e, 0] = acc[half + e]
        else:
            for e in cutlass.range_constexpr(half):
                sX[wtid, e, 1] = acc[e]
        self.row_sums_ot(sM, row_l, None, sSum, sRed, c.mLse, c.mLacc, mblk, split, b, wg, wtid)  # (2 barriers)
        if wg == 0:
            for e in cutlass.range_constexpr(half):
                acc[e] = acc[e] + sX[wtid, e, 1]
            self.store_ot_rows(acc, sSum, c.mOut, c.mOacc, out_scale, mblk, split, b, wg, wtid, 0)
        else:
            for e in cutlass.range_constexpr(half):
                acc[half + e] = acc[half + e] + sX[wtid, e, 0]
            self.store_ot_rows(acc, sSum, c.mOut, c.mOacc, out_scale, mblk, split, b, wg, wtid, 4)


__all__ = ["TRACE_EVENTS_OWN", "MlaDecodeFp8TransposedSm90"]
