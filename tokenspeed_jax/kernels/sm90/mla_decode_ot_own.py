"""The FP8 O^T loop's 32- and 16-row tiles with each warpgroup on its own tiles (``loop32`` "own").

In :class:`~tokenspeed_jax.kernels.sm90.mla_decode_ot.MlaDecodeOtSm90` the two computing warpgroups share one
``O^T``: each owns 256 of the 512 output features for every tile, warpgroup 0 computes P of the even tiles and
warpgroup 1 of the odd ones, and each runs a PV on its own tile and a cross PV on the other's.  The running row max
is therefore one chain through both warpgroups: warpgroup 0's softmax -> SCALE0 -> warpgroup 1's softmax -> SCALE1
-> warpgroup 0's next softmax, plus P0_READY / P1_READY before each cross PV.  At B64/K81920/H32/S1 (32 rows, the
memory-bound FP8 point furthest from its roofline: 79.5-84.5% in the full-matrix runs of 2026-12-02/03, 89-90% in
the interleaved A/Bs) that chain, not the bytes, sets the iteration (docs/sm90_decode.md, "Gaps").

Here (``TOKENSPEED_SM90_DECODE_OT32_LOOP=own``) the warpgroups share nothing but the producer and the shared-memory
ring: warpgroup ``g`` runs tiles ``2 j + g`` (buffers ``2 (j % 2) + g``, the same as before) over **all** 512
features, with its own running max, row sums and ``O^T``, FlashAttention-2 style: fold -> exp -> P^T store -> ``O^T
*= scale`` -> ``V^T`` loads + PV -> next QK -> both retired -> slot free.  No barrier between the warpgroups in the
loop, so one warpgroup's softmax runs beside the other's tensor work whatever their phase.  The costs:

* ``O^T`` of 512 features: ``4 pv_n`` accumulator registers (128 at 32 rows, against 64), and the ``V^T`` fragments
  of all 8 m-blocks of a tile (64 registers, one set instead of two).
* The epilogue merges the two partial states (each over half of the split's tiles): the column maxima through shared
  memory, each warpgroup rescales its ``O^T`` and row sums to the common max (``fold_max``: a warpgroup without keys
  contributes zeros), swaps the half of ``O^T`` it does not store through the freed KV buffers (``4 pv_n / 2``
  floats a thread each way, laid out ``[writer][element][thread]``: both warpgroups' accumulators have the same
  fragment layout, so thread ``t`` of one holds exactly the elements thread ``t`` of the other needs), and stores its
  256 features as before (:meth:`~tokenspeed_jax.kernels.sm90.mla_decode_ot.MlaDecodeOtSm90.store_ot_rows`).
* Each warpgroup frees its own buffers (SLOT0_FREE / SLOT1_FREE: warpgroup ``g`` arrives on ``SLOT0_FREE + g`` once its
  PV of the buffer retired and its next tile landed; that tile was loaded after the producer synced on the
  warpgroup's previous arrival, so no arrival overtakes the producer's sync of the one before).

The math per tile is the same as the shared loop's (the same QGMMAs, P rounded to e4m3 as ``2^8 p``, row sums over the
unrounded P), but the sums and ``O^T`` accumulate in another order (two partial states, merged once), so outputs differ
from the shared loop's by rounding, not bitwise.

Status (H200, 2026-12-03; docs/sm90_decode.md, "Own tiles"): correct on its first GPU run (the FP8 check cases 11/11
with modes 10 and 7, compute-sanitizer memcheck 0 errors with mode 10, the decode GPU test file 63 passed and the vLLM
adapter's FP8 cases 8 passed with it the default); 1.07x the shared loop at B64/K81920/H32/S1, 1.13x at B128/K4096/H16,
1.21x at B1, 0.96x at B64/K81920/H16/S1 in one interleaved A/B; in the matrix B64/K81920/H32/S1 at 87.8% of the copy
roofline (79.5-84.5% with the shared loop).  The backend's default on the 32- and 16-row tiles
(``TOKENSPEED_SM90_DECODE_OT32_LOOP=own``).
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, cute
from cutlass.cute.nvgpu import warpgroup

from tokenspeed_jax.kernels.sm90.helpers import Barrier
from tokenspeed_jax.kernels.sm90.mla_decode_ot import _BUF_BYTES, _F8, _P_BYTES, MlaDecodeOtSm90
from tokenspeed_jax.kernels.sm90.mla_decode_seesaw import TRACE_EVENTS

LOOP32_MODES = ("shared", "own")  # the 32- / 16-row tiles' loop (module docstring; "shared": the base class's)

# DecodeTraceMixin.mark points of an iteration (debug builds, benchmarks/trace_decode.py): both warpgroups run the same
# code, so the same names; "-" unused (as many slots as TRACE_EVENTS, the trace buffer's shape)
_OWN_EVENTS = ("top", "column maxima + TAIL", "fold (own max, scale)", "exp", "P store + TAIL, O^T *= scale",
               "V^T loads + PV issue + retire", "wait next tile landed", "next QK issue", "QK retired",
               "SLOT*_FREE out")
TRACE_EVENTS_OWN = tuple((e, e) for e in _OWN_EVENTS) + (("-", "-"),) * (len(TRACE_EVENTS) - len(_OWN_EVENTS))


class MlaDecodeOtOwnSm90(MlaDecodeOtSm90):
    """:class:`MlaDecodeOtSm90` on 32- / 16-row tiles (``qk_t``) with each warpgroup on its own tiles (module
    docstring).  The shared loop's switches (``qk_early``, ``softmax``, ``p1_ready``, ``p0_late``, ``p0_fence``) have
    nothing to act on here and must keep their defaults."""

    def __init__(self, *, loop32: str = "own", **kw):
        super().__init__(**kw)
        if not self.qk_t:
            raise ValueError("loop32='own': only the O^T loop's 32- / 16-row tiles (qk_t, S x H <= 32 or FP8 P V mode "
                             f"7), got qk_t={self.qk_t}")
        if (self.qk_early, self.softmax, self.p1_ready) != ("after", "exp", "cross"):
            raise ValueError(f"loop32='own' has no cross-warpgroup chain: qk_early, softmax and p1_ready keep their "
                             f"defaults, got {self.qk_early!r}, {self.softmax!r}, {self.p1_ready!r}")
        self.schedule = "seesaw-ot-own"
        if loop32 != "own":
            raise ValueError(f"loop32 must be 'own' here, got {loop32!r}")

    @cute.jit
    def consume_ot(self, qk_mma, pv_mma, sQ, st, bufs, wg, wtid, mblk, split, b, seq, split_start, split_end, n_pairs,
                   mbar, scale_log2, out_scale, mBT, mKV, num_pages, mOut, mLse, mOacc, mLacc, tr):
        """Warpgroup ``wg``'s tiles ``2 j + wg`` (module docstring), then the merge and the epilogue.  ``tr``:
        ``(mTrace, cta)`` for :meth:`mark` (events :data:`TRACE_EVENTS_OWN`)."""
        bn = self.block_n
        mTrace, cta = tr
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
            self.mark(mTrace, cta, wg, wtid, j, 0)
            self.fold_t(acc_s, tScS, lim, t, scale_log2, None, None, None, sRed, row_l, ref, sc, wg, wtid,
                        (mTrace, cta, j, 1, 2), False, m_run)
            self.exp_t(acc_s, ref, row_l)
            self.mark(mTrace, cta, wg, wtid, j, 3)
            self.store_p_tile(acc_s, qk_thr, bufs, k, wtid)
            cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)  # (all of P^T stored)
            self.scale_cols(acc, sc)
            self.mark(mTrace, cta, wg, wtid, j, 4)
            self.load_vt(a, stg0 + k * _BUF_BYTES, zero, t, split_end, 0, wtid, 8)
            self.pv_ot(pv_mma, acc, tA, self.p_operand(pv_thr, bufs, k))
            warpgroup.commit_group()
            # the PV retires before the next QK is issued: with both in flight the V^T fragments and S live together,
            # and ptxas spilled 160 / 316 bytes at 32 rows (measured 0.69x at B64/K81920/H32/S1, 2026-12-03)
            warpgroup.wait_group(0)
            self.mark(mTrace, cta, wg, wtid, j, 5)
            # the next QK (issued for the last pair too, on stale staging, its S thrown away: a wgmma inside the
            # dynamic if made ptxas serialize every wgmma, as in the shared loop)
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
        cute.arch.barrier()  # (with the producer: every TMA load consumed, the buffers free for the O^T swap)
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
        self.row_sums_ot(sM, row_l, None, sSum, sRed, mLse, mLacc, mblk, split, b, wg, wtid)  # (2 barriers)
        if wg == 0:
            for e in cutlass.range_constexpr(half):
                acc[e] = acc[e] + sX[wtid, e, 1]
            self.store_ot_rows(acc, sSum, mOut, mOacc, out_scale, mblk, split, b, wg, wtid, 0)
        else:
            for e in cutlass.range_constexpr(half):
                acc[half + e] = acc[half + e] + sX[wtid, e, 0]
            self.store_ot_rows(acc, sSum, mOut, mOacc, out_scale, mblk, split, b, wg, wtid, 4)


@cute.jit
def launch_mla_decode_ot_own(stream, q: cute.Tensor, kv: cute.Tensor, block_table: cute.Tensor, seq_lens: cute.Tensor,
                             softmax_scale: cute.Tensor, output_scale: cute.Tensor, out: cute.Tensor, lse: cute.Tensor,
                             o_accum: cute.Tensor = None, lse_accum: cute.Tensor = None, *, dtype: cutlass.Constexpr,
                             num_heads: cutlass.Constexpr, q_len: cutlass.Constexpr, page_size: cutlass.Constexpr,
                             causal: cutlass.Constexpr, num_splits: cutlass.Constexpr,
                             tokens_per_split: cutlass.Constexpr, block_n: cutlass.Constexpr = 64,
                             schedule: cutlass.Constexpr = "seesaw", pdl: cutlass.Constexpr = True,
                             l2_prefetch: cutlass.Constexpr = "off", qk_t: cutlass.Constexpr = True,
                             kv_evict: cutlass.Constexpr = "normal", pdl_main: cutlass.Constexpr = False,
                             colmax: cutlass.Constexpr = "shfl", loop32: cutlass.Constexpr = "own"):
    """FFI launch function of the "own" loop (same ABI as ``launch_mla_decode_ot``; ``loop32`` is the backend's
    switch, always "own" here)."""
    MlaDecodeOtOwnSm90(dtype=dtype, num_heads=num_heads, q_len=q_len, page_size=page_size, causal=causal,
                       num_splits=num_splits, tokens_per_split=tokens_per_split, block_n=block_n, pdl=pdl,
                       l2_prefetch=l2_prefetch, qk_t=qk_t, kv_evict=kv_evict, pdl_main=pdl_main, colmax=colmax,
                       loop32=loop32)(
        stream, q, kv, block_table, seq_lens, softmax_scale, output_scale, out, lse, o_accum, lse_accum)


@cute.jit
def launch_mla_decode_ot_own_traced(stream, q: cute.Tensor, kv: cute.Tensor, block_table: cute.Tensor,
                                    seq_lens: cute.Tensor, softmax_scale: cute.Tensor, output_scale: cute.Tensor,
                                    out: cute.Tensor, lse: cute.Tensor, trace_buf: cute.Tensor,
                                    o_accum: cute.Tensor = None, lse_accum: cute.Tensor = None, *,
                                    dtype: cutlass.Constexpr, num_heads: cutlass.Constexpr, q_len: cutlass.Constexpr,
                                    page_size: cutlass.Constexpr, causal: cutlass.Constexpr,
                                    num_splits: cutlass.Constexpr, tokens_per_split: cutlass.Constexpr,
                                    trace: cutlass.Constexpr, pdl: cutlass.Constexpr = True,
                                    l2_prefetch: cutlass.Constexpr = "off", qk_t: cutlass.Constexpr = True,
                                    colmax: cutlass.Constexpr = "shfl", loop32: cutlass.Constexpr = "own"):
    """Debug build of the "own" loop with :meth:`DecodeTraceMixin.mark` timestamps at the :data:`TRACE_EVENTS_OWN`
    points (as ``launch_mla_decode_ot_traced``)."""
    MlaDecodeOtOwnSm90(dtype=dtype, num_heads=num_heads, q_len=q_len, page_size=page_size, causal=causal,
                       num_splits=num_splits, tokens_per_split=tokens_per_split, block_n=64, pdl=pdl,
                       l2_prefetch=l2_prefetch, qk_t=qk_t, colmax=colmax, loop32=loop32, trace=trace)(
        stream, q, kv, block_table, seq_lens, softmax_scale, output_scale, out, lse, o_accum, lse_accum, trace_buf)


__all__ = ["LOOP32_MODES", "TRACE_EVENTS_OWN", "MlaDecodeOtOwnSm90", "launch_mla_decode_ot_own",
           "launch_mla_decode_ot_own_traced"]
