"""Output side of the transposed loops (S^T = K Q^T, O^T = V^T P^T; query rows as the MMA N dimension): per-column
softmax statistics and O^T epilogue.  Mixin of :class:`~tokenspeed_jax.kernels.sm90.transposed.MlaDecodeTransposedSm90`
(16-bit) and :class:`~tokenspeed_jax.kernels.sm90.fp8_transposed_pv.MlaDecodeFp8TransposedPvSm90` (FP8, and its 32-row
subclass); the loop class sets ``pv_n``, ``qk_t`` and the accumulator row order: :meth:`acc_feature` (output feature of
a warp's accumulator row ``q``) and :attr:`pair_step` (feature distance of rows ``q`` and ``q + 8``).  A thread of a
warpgroup holds ``pv_n / 4`` columns (query rows) of ``S^T`` / ``O^T``: column ``i`` is
``8 (i // 2) + 2 (lane % 4) + i % 2`` (:meth:`TransposedOutMixin.col_n`), accumulator element ``e`` belongs to column
``e % 2 + 2 (e // 4)`` (``((e // 4) % (pv_n / 8))`` for the O^T accumulators' m-blocks).  A column's keys (tokens) lie
in all 4 warps, so maxima and sums go through 1 KB of shared memory (``sRed``: per warpgroup and warp, 32 columns).
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, cute

from tokenspeed_jax.kernels.sm90.helpers import LN_2, Barrier, row_ptr


class TransposedOutMixin:
    """Column statistics and the O^T epilogue of the transposed loops (module docstring)."""

    def col_n(self, i, wtid):
        """``qk_t``: the query row of this thread's column ``i`` (module docstring)."""
        return 8 * (i // 2) + 2 * (wtid % 4) + i % 2

    @cute.jit
    def col_limits(self, mblk: Int32, seq: Int32, split_end: Int32, wtid: Int32):
        """``qk_t``: the first masked key of each of this thread's columns (as :meth:`row_limits` for rows)."""
        lim = cute.make_rmem_tensor((self.pv_n // 4,), Int32)
        for i in cutlass.range_constexpr(self.pv_n // 4):
            s_tok = (mblk * self.block_m + self.col_n(i, wtid)) // self.H
            li = seq
            if cutlass.const_expr(self.causal):
                li = seq - self.S + 1 + s_tok
            lim[i] = cutlass.min(li, split_end)
        return lim

    @cute.jit
    def fold_t(self, acc_s, tScS, lim, tile_start, scale_log2, sM, sSc_in, sSc_out, sRed, row_l, ref, sc, wg, wtid,
               mk=None, m_reg=None):
        """``qk_t``: :meth:`fold_first` (``sSc_in`` None; WG0) or :meth:`fold_second` (``sSc_in``: scale0; WG1, arriving
        on SCALE1 after this) minus the exp, for ``S^T``: a row's keys span the 4 warps (tokens are M), so warp column
        maxima (2 tokens, then 8 lanes by 3 butterfly shuffles) go through ``sRed`` and the WG barrier (TAIL id); the
        shared max is read before it, written after it by warp 0's lanes 0..3 (one writer per row).  ``m_reg``: per-WG
        running max in registers, not ``sM`` (``sM``, ``sSc_out`` None).  ``mk``:
        ``(mTrace, cta, j, event after barrier, end event or None)`` for :meth:`mark` (debug)."""
        nc = self.pv_n // 4
        lane = wtid % 32
        warp = wtid // 32
        mprev = cute.make_rmem_tensor((nc,), Float32)
        mx = cute.make_rmem_tensor((nc,), Float32)
        for i in cutlass.range_constexpr(nc):
            if cutlass.const_expr(m_reg is not None):
                mprev[i] = m_reg[i]
            else:
                mprev[i] = sM[self.col_n(i, wtid)]
            mx[i] = -Float32.inf
        self.scale_mask(acc_s, tScS, lim, tile_start, scale_log2, mx, True)
        for i in cutlass.range_constexpr(nc):
            for off in cutlass.range_constexpr(3):
                mx[i] = cute.arch.fmax(mx[i], cute.arch.shuffle_sync_bfly(mx[i], offset=4 << off))
            if lane < 4:
                sRed[(4 * wg + warp) * 32 + self.col_n(i, wtid)] = mx[i]
        cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)
        if cutlass.const_expr(mk is not None):
            self.mark(mk[0], mk[1], wg, wtid, mk[2], mk[3])
        for i in cutlass.range_constexpr(nc):
            n = self.col_n(i, wtid)
            t = sRed[4 * wg * 32 + n]
            for w in cutlass.range_constexpr(1, 4):
                t = cute.arch.fmax(t, sRed[(4 * wg + w) * 32 + n])
            m_new, ref[i], s = self.fold_max(mprev[i], t)
            sc[i] = s
            if cutlass.const_expr(sSc_in is not None):
                sc[i] = sSc_in[n] * s
            row_l[i] = row_l[i] * sc[i]
            if cutlass.const_expr(m_reg is not None):
                m_reg[i] = m_new
            elif wtid < 4:
                sM[n] = m_new
                sSc_out[n] = s
        if cutlass.const_expr(mk is not None and mk[4] is not None):
            self.mark(mk[0], mk[1], wg, wtid, mk[2], mk[4])

    @cute.jit
    def exp_t(self, acc_s: cute.Tensor, ref: cute.Tensor, row_l: cute.Tensor):
        """``qk_t``: :meth:`exp_rows` for ``S^T`` (per column; the 2^8 P bias)."""
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            i = e % 2 + 2 * (e // 4)
            p = cute.arch.exp2(acc_s[e] - (ref[i] - self.p8_bias))
            acc_s[e] = p
            row_l[i] = row_l[i] + p

    @cute.jit
    def scale_ot(self, acc: cute.Tensor, sa: cute.Tensor, sb: cute.Tensor, wtid: Int32):
        """``O^T[:, n] *= sa[n] (* sb[n])`` on the thread's columns (:meth:`col_n`); skipped if no warp row max grew."""
        c2 = 2 * (wtid % 4)
        s = cute.make_rmem_tensor((self.pv_n // 4,), Float32)
        for i in cutlass.range_constexpr(self.pv_n // 4):
            n = 8 * (i // 2) + c2 + i % 2
            if cutlass.const_expr(sb is None):
                s[i] = sa[n]
            else:
                s[i] = sa[n] * sb[n]
        self.scale_cols(acc, s)

    @cute.jit
    def scale_cols(self, acc: cute.Tensor, s: cute.Tensor):
        """``O^T`` (any m-blocks) *= ``s[i]`` on column ``i`` (:meth:`col_n`); skipped if all the warp's ``s`` are 1."""
        if not cute.arch.vote_all_sync(self.all_one(s)):
            for e in cutlass.range_constexpr(cute.size(acc)):
                acc[e] = acc[e] * s[e % 2 + 2 * ((e // 4) % (self.pv_n // 8))]

    @cute.jit
    def store_lse(self, mLse: cute.Tensor, mLacc: cute.Tensor, m: Float32, l_tot: Float32, r: Int32, split: Int32,
                  b: Int32):
        """LSE of query row ``r`` (``m``: final max, exp2 domain, with P's 2^8 bias; ``l_tot``: row sum; -inf without
        keys) into ``lse``, or with split partials ``lse_accum``; nothing for a padding row (``r >= R``)."""
        lse = -Float32.inf
        if l_tot != 0.0:  # (NaN: a key with NaN / Inf was seen, NaN LSE)
            lse = (m - self.p8_bias + cute.math.log2(l_tot, fastmath=False)) * LN_2
        R = self.R
        direct = split < 0
        if r < R:  # (:meth:`out_row` written out: with a call of it here the DSL refused this `if`)
            if direct:
                g_out = cute.make_tensor(mLse.iterator + (Int64(b) * R + r), cute.make_layout(1))
                g_out[0] = lse
            else:
                g_acc = cute.make_tensor(mLacc.iterator + (Int64(split) * R + r), cute.make_layout(1))
                g_acc[0] = lse

    @cute.jit
    def epilogue_ot(self, acc, sM, row_l, row_in, sSum, sRed, mOut, mLse, mOacc, mLacc, out_scale, mblk, split, b, wg,
                    wtid):
        """Row sums across both WGs (``qk_t``: also a column's lanes and warps), the LSE (one thread per row,
        :meth:`store_lse`), and ``O = O^T^T / l`` from the accumulators: thread ``(warp w, lane 4q + c)`` holds features
        ``f, f + 1`` (:func:`ot_feature`) of rows ``n = 8 v2 + 2c + v0`` (``n < pv_n``), one 2-element store each."""
        self.row_sums_ot(sM, row_l, row_in, sSum, sRed, mLse, mLacc, mblk, split, b, wg, wtid)
        self.store_ot_rows(acc, sSum, mOut, mOacc, out_scale, mblk, split, b, wg, wtid, 0)

    @cute.jit
    def row_sums_ot(self, sM, row_l, row_in, sSum, sRed, mLse, mLacc, mblk, split, b, wg, wtid):
        """:meth:`epilogue_ot`'s row sums (into ``sSum``) and LSE; two barriers of both warpgroups."""
        if cutlass.const_expr(self.qk_t):  # column sums over the thread's tokens, its column's 8 lanes, 4 warps, 2 WGs
            lane = wtid % 32
            for i in cutlass.range_constexpr(self.pv_n // 4):
                t = row_l[i]
                for off in cutlass.range_constexpr(3):
                    t = t + cute.arch.shuffle_sync_bfly(t, offset=4 << off)
                if lane < 4:
                    sRed[(4 * wg + wtid // 32) * 32 + self.col_n(i, wtid)] = t
            cute.arch.barrier(barrier_id=int(Barrier.ROW_SUM), number_of_threads=self.num_threads)
            if wg == 0 and wtid < 4:  # one thread a row: its total into sSum (the output loop's), and the LSE
                for i in cutlass.range_constexpr(self.pv_n // 4):
                    n = self.col_n(i, wtid)
                    l_tot = sRed[n]
                    for w in cutlass.range_constexpr(1, 8):
                        l_tot = l_tot + sRed[w * 32 + n]
                    sSum[n] = l_tot
                    sSum[64 + n] = Float32(0.0)
                    self.store_lse(mLse, mLacc, sM[n], l_tot, mblk * self.block_m + n, split, b)
            cute.arch.barrier(barrier_id=int(Barrier.ROW_SUM), number_of_threads=self.num_threads)
        else:
            self.share_row_sums(row_l, row_in, sSum, wg, wtid)
            if wg == 0 and wtid % 4 == 0:
                for h in cutlass.range_constexpr(2):
                    self.store_lse(mLse, mLacc, sM[row_in[h]], sSum[row_in[h]] + sSum[64 + row_in[h]],
                                   mblk * self.block_m + row_in[h], split, b)

    @cute.jit
    def store_ot_rows(self, acc, sSum, mOut, mOacc, out_scale, mblk, split, b, wg, wtid, mb0: cutlass.Constexpr):
        """``O = O^T^T / l`` of WG ``wg``'s 256 features from accumulator m-blocks ``mb0 .. mb0 + 3``
        (:meth:`epilogue_ot`; ``mb0`` 4: WG1 of ``fp8_transposed``, whose accumulators hold all 512)."""
        lane = wtid % 32
        c2 = 2 * (lane % 4)
        for i in cutlass.range_constexpr(self.pv_n // 4):
            n = 8 * (i // 2) + c2 + i % 2
            r = mblk * self.block_m + n
            l_tot = sSum[n] + sSum[64 + n]
            inv = Float32(0.0)
            if l_tot != 0.0:  # (NaN: a key with NaN / Inf was seen, NaN LSE)
                inv = 1.0 / l_tot
            if r < self.R:
                for mb in cutlass.range_constexpr(4):
                    f = self.acc_feature(wg, mb, wtid // 32, lane // 4)  # and f + 1 (accumulator row q + 8)
                    self.store_ot_pair(acc, i % 2 + 4 * (i // 2) + (self.pv_n // 2) * (mb0 + mb), inv, out_scale,
                                       mOut, mOacc, b, split, r, f)

    @cute.jit
    def store_ot_pair(self, acc: cute.Tensor, e: cutlass.Constexpr, inv: Float32, out_scale: Float32,
                      mOut: cute.Tensor, mOacc: cute.Tensor, b: Int32, split: Int32, r: Int32, f: Int32):
        """Features ``f``, ``f + pair_step`` of row ``r`` (:attr:`pair_step` 1: the register ``V^T``'s row permutation
        pairs them in a thread): accumulator elements ``e``, ``e + 2`` (A rows ``q``, ``q + 8``) times ``inv`` (1 / row
        sum) into ``out`` (x ``out_scale``; bf16x2 store) if ``split`` < 0, else ``o_accum`` slot ``split`` (fp32x2)."""
        if split < 0:
            sc = inv * out_scale
            if inv == 0.0:  # a row without keys: exact zeros whatever output_scale holds (NaN, inf)
                sc = Float32(0.0)
            self.store_ot_pair_to(acc, e, sc, mOut, Int64(b) * self.R + r, f, True)
        else:
            self.store_ot_pair_to(acc, e, inv, mOacc, Int64(split) * self.R + r, f, False)

    @cute.jit
    def store_ot_pair_to(self, acc: cute.Tensor, e: cutlass.Constexpr, scale: Float32, mDst: cute.Tensor, row: Int64,
                         f: Int32, direct: cutlass.Constexpr):
        """:meth:`store_ot_pair` into row ``row`` of ``mDst`` (``out`` when ``direct``, else ``o_accum``)."""
        dt = self.out_dtype if direct else Float32
        if cutlass.const_expr(self.pair_step == 1):
            o = cute.make_rmem_tensor((2,), dt)
            o[0] = (acc[e] * scale).to(dt)
            o[1] = (acc[e + 2] * scale).to(dt)
            cute.autovec_copy(o, cute.make_tensor(row_ptr(mDst, row, f, self.DV, 2 * (dt.width // 8)),
                                                  cute.make_layout(2)))
        else:
            for h in cutlass.range_constexpr(2):
                dst = cute.make_tensor(row_ptr(mDst, row, f + self.pair_step * h, self.DV, dt.width // 8),
                                       cute.make_layout(1))
                dst[0] = (acc[e + 2 * h] * scale).to(dt)


__all__ = ["TransposedOutMixin"]
