"""16-bit Hopper MLA decode, both matmuls transposed, for S x H <= 32 query rows: ``S^T = K Q^T``, ``O^T = V^T P^T``.

The seesaw loop runs every matmul on 64 query rows, padded when a request has fewer.  This loop keeps its contract, plan
(one 64-row block), split-KV partials, combine kernel, slots, refill groups (TMA, pages >= 32), producer warpgroup and
barriers, and shrinks the matmuls to the real rows (a quarter to a half of the multiply-adds): less power per tile, so a
higher SM clock under sustained load.  Numerics: the seesaw loop's fp32 accumulation and statistics and P rounding; the
sums run in another order (bitwise different, within the check's tolerances).

* ``S^T (64 tokens x N) = K Q^T``: A = the landed KV slot, B = the first ``N`` q rows (:attr:`pv_n`: rows rounded up to
  16 or 32), both K-major; 36 m64nNk16 per tile instead of 36 m64n64k16, 8 or 16 accumulator registers, not 32.
* Softmax per column of ``S^T`` (a query row's 64 keys lie in all 4 warps): column maxima through 1 KB of shared memory
  and the warpgroup's barrier (:meth:`~.transposed_out.TransposedOutMixin.fold_t`, ``exp_t``).
* ``P^T`` (N rows x 64 tokens, K-major, 2 or 4 KB) goes to its slot's rope columns like the seesaw P (only the QK reads
  them, and it retired), where both PVs read it (SS); WG0 stores it twice as there: before its own PV, and rescaled by
  scale1 for the cross PV once its own PV retired.
* ``O^T (256 features x N) += V^T P^T`` per warpgroup, 4 m-blocks of 64 features: A = the slot read MN-major (16-bit
  wgmmas take either major mode: unlike FP8 no copy, no register path); 4 x (N / 2) accumulator registers instead of
  128; per-column O rescales (``scale_ot``).
* Epilogue ``epilogue_ot``: natural feature order (accumulator row ``q`` / ``q + 8`` = feature ``q`` / ``q + 8``).
"""

from __future__ import annotations

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, cute
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from tokenspeed_jax.kernels.sm90.helpers import Barrier
from tokenspeed_jax.kernels.sm90.seesaw import MlaDecodeSeesawSm90
from tokenspeed_jax.kernels.sm90.transposed_out import TransposedOutMixin

_MAX_ROWS = 32  # query rows S x H (pv_n 16 or 32; the O^T loop's limit)
_MIN_PAGE = 32  # the producer warpgroup's (its coordinates of 16-token pages spill in 24 registers)
_ALL_CHUNKS = tuple(range(9))  # the first QK of each warpgroup (both groups of its slot landed)


class MlaDecodeTransposedSm90(TransposedOutMixin, MlaDecodeSeesawSm90):
    """``S^T = K Q^T``, ``O^T = V^T P^T`` (module docstring): the seesaw loop's host side, prologue and producer, its
    own computing part (:meth:`consume`).  The base class's arguments; 16-bit dtypes, S x H <= 32, page_size >= 32."""

    red_floats = 2 * 4 * 32  # the seesaw storage's column statistics: per warpgroup and warp, 32 columns (fold_t)
    prefetch_q = True  # the epilogue (epilogue_ot) stores O from the accumulators: sQ is free from its first barrier
    pair_step = 8  # accumulator rows q and q + 8 are features f and f + 8 (natural order; store_ot_pair)

    def __init__(self, **kw):
        if kw.get("dtype") not in ("bfloat16", "float16"):
            raise ValueError(f"the transposed 16-bit loop needs bfloat16 or float16 inputs, got {kw.get('dtype')}")
        MlaDecodeSeesawSm90.__init__(self, producer=True, pad_zero=False, **kw)
        if self.page_size < _MIN_PAGE:
            raise ValueError(f"the transposed 16-bit loop needs page_size >= {_MIN_PAGE}, got {self.page_size}")
        if self.R > _MAX_ROWS:
            raise ValueError(f"the transposed 16-bit loop needs S x H <= {_MAX_ROWS}, got {self.R}")
        self.qk_t = True  # (the O^T loop's column-statistics paths: fold_t, col_limits, epilogue_ot)
        self.pv_n = 16 if self.R <= 16 else 32

    # ------------------------------------------------------------------------------------------ host
    def seesaw_mmas(self):
        """Seesaw ``(qk_mma, pv_ss, pv_rs, pv8)`` transposed: ``S^T``, ``O^T`` per 64 features (module docstring)."""
        dt = self.mma_dtype
        K, MN = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
        qk_mma = sm90_utils.make_trivial_tiled_mma(dt, dt, K, K, Float32, (1, 1, 1), (self.block_n, self.pv_n))
        pv_mma = sm90_utils.make_trivial_tiled_mma(dt, dt, MN, K, Float32, (1, 1, 1), (64, self.pv_n))
        return qk_mma, pv_mma, None, None

    # ---------------------------------------------------------------------------------------- device
    def acc_feature(self, wg, mb, warp, q):
        """Feature of ``O^T`` accumulator row ``q`` of ``warp``, ``mb``, ``wg``: natural order (module docstring)."""
        return 256 * wg + 64 * mb + 16 * warp + q

    @cute.jit
    def qk_landed(self, qk_mma, acc_s, tSrK, tSrQ, mbar, groups: cutlass.Constexpr, chunks: cutlass.Constexpr, phase,
                  first: cutlass.Constexpr):
        """Wait for column groups ``groups`` (completion ``phase``); issue the QK of ``chunks`` (no commit)."""
        for g in cutlass.range_constexpr(len(groups)):
            self.landed(mbar + groups[g], phase)
        self.qk_chunks(qk_mma, acc_s, tSrK, tSrQ, chunks, first)

    @cute.jit
    def operand_views(self, c, sQ, sK0, sK1, wg):
        """MMA operands and P^T stores ``(tSrQ, tSrK0, tSrK1, tOrVt0, tOrVt1, tOsPt0, tOsPt1, tSsP0, tSsP1)`` of ``sQ``,
        ``sK0``, ``sK1`` (the kernel's, or :meth:`~.decode_common.MlaDecodeSm90.fresh_smem` copies; roles: module
        docstring; V^T: this WG's 256 features of :meth:`v_half`); P^T stored through its (tokens, rows) transpose from
        S^T.  ``wg``: constant in its own loop (a runtime index there made the V^T descriptors vector values)."""
        qk_mma, pv_mma, _, _ = c.mmas
        wtid = c.wtid
        bn = self.block_n
        dt = self.mma_dtype
        qk_thr = qk_mma.get_slice(wtid)
        pv_thr = pv_mma.get_slice(wtid)
        tSrQ = qk_thr.make_fragment_B(qk_thr.partition_B(cute.local_tile(sQ[None, None, 0], (self.pv_n, self.D),
                                                                         (0, 0))))
        tSrK0 = qk_thr.make_fragment_A(qk_thr.partition_A(sK0))
        tSrK1 = qk_thr.make_fragment_A(qk_thr.partition_A(sK1))
        tOrVt0 = pv_thr.make_fragment_A(pv_thr.partition_A(self.v_half(sK0, c.v_layout, wg)))
        tOrVt1 = pv_thr.make_fragment_A(pv_thr.partition_A(self.v_half(sK1, c.v_layout, wg)))
        pt_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (64, self.pv_n, bn), dt, 1)
        pt_store = cute.select(pt_layout.outer, mode=[1, 0, 2])
        pt0, pt1 = sK0.iterator + self.DV * bn, sK1.iterator + self.DV * bn  # the slots' rope columns
        tOsPt0 = pv_thr.make_fragment_B(pv_thr.partition_B(cute.make_tensor(
            cute.recast_ptr(pt0, pt_layout.inner), pt_layout.outer)[None, None, 0]))
        tOsPt1 = pv_thr.make_fragment_B(pv_thr.partition_B(cute.make_tensor(
            cute.recast_ptr(pt1, pt_layout.inner), pt_layout.outer)[None, None, 0]))
        tSsP0 = qk_thr.partition_C(cute.make_tensor(cute.recast_ptr(pt0, pt_layout.inner), pt_store)[None, None, 0])
        tSsP1 = qk_thr.partition_C(cute.make_tensor(cute.recast_ptr(pt1, pt_layout.inner), pt_store)[None, None, 0])
        return tSrQ, tSrK0, tSrK1, tOrVt0, tOrVt1, tOsPt0, tOsPt1, tSsP0, tSsP1

    @cute.jit
    def qk_ops(self, c, slot: cutlass.Constexpr):
        """``(tSrK, tSrQ)`` of the QK on ``slot``, built at issue (:meth:`~.decode_common.MlaDecodeSm90.fresh_smem`)."""
        sQ, sK0, sK1 = self.fresh_smem(c, (c.sQ, c.sK0, c.sK1))
        tSrQ, tSrK0, tSrK1, _, _, _, _, _, _ = self.operand_views(c, sQ, sK0, sK1, 0)
        return (tSrK0, tSrK1)[slot], tSrQ

    @cute.jit
    def pv_ops(self, c, slot: cutlass.Constexpr, wg: cutlass.Constexpr):
        """``(tOrVt, tOsPt)``: warpgroup ``wg``'s PV operands on ``slot``, built as :meth:`qk_ops`."""
        sQ, sK0, sK1 = self.fresh_smem(c, (c.sQ, c.sK0, c.sK1))
        _, _, _, tOrVt0, tOrVt1, tOsPt0, tOsPt1, _, _ = self.operand_views(c, sQ, sK0, sK1, wg)
        return ((tOrVt0, tOsPt0), (tOrVt1, tOsPt1))[slot]

    @cute.jit
    def consume(self, c, cta, b, seq, split_start, split_end, split, n_pairs):
        """First QK, loop, epilogue.  ``c``: :meth:`~.seesaw.MlaDecodeSeesawSm90.seesaw_kernel`'s values (with
        :attr:`prefetch` the next Q tile loads in the epilogue, :meth:`epilogue_barrier`)."""
        qk_mma, pv_mma, _, _ = c.mmas
        sQ, sK0, sK1, st, wg, wtid, mblk, mTrace = c.sQ, c.sK0, c.sK1, c.st, c.wg, c.wtid, c.mblk, c.mTrace
        sM, sSc0, sSc1, sSum, mbar, scale_log2 = c.sM, c.sSc0, c.sSc1, c.sSum, c.mbar, c.scale_log2
        tAs0, tAs1, tAg, tma_atom = c.tAs0, c.tAs1, c.tAg, c.tma_atom
        bn = self.block_n
        dt = self.mma_dtype
        qk_thr = qk_mma.get_slice(wtid)
        pv_thr = pv_mma.get_slice(wtid)
        sRed = st.red.get_tensor(cute.make_layout(2 * 4 * 32))
        acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((bn, self.pv_n)))
        tScS = qk_thr.partition_C(cute.make_identity_tensor((bn, self.pv_n)))
        acc = pv_thr.make_fragment_C(pv_thr.partition_shape_C((self.DV // 2, self.pv_n)))
        acc.fill(0.0)
        _, _, _, _, _, _, _, tSsP0, tSsP1 = self.operand_views(c, sQ, sK0, sK1, wg)
        cg = self.col_groups  # A0, B0, A1, B1
        rP = cute.make_rmem_tensor_like(acc_s, dt)
        qk_mma.set(warpgroup.Field.ACCUMULATE, True)
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)

        nst = self.pv_n // 4  # columns (query rows) of S^T / O^T per thread
        lim = self.col_limits(mblk, seq, split_end, wtid)
        row_l = cute.make_rmem_tensor((nst,), Float32)
        for i in cutlass.range_constexpr(nst):
            row_l[i] = 0.0
        ref = cute.make_rmem_tensor((nst,), Float32)
        sc = cute.make_rmem_tensor((nst,), Float32)

        if n_pairs > 0:  # first QK of each WG (pair 0; the producer loaded all 4 column groups, completion 0)
            if wg == 0:
                self.qk_landed(qk_mma, acc_s, *self.qk_ops(c, 0), mbar, (0, 1), _ALL_CHUNKS, 0, True)
            else:
                self.qk_landed(qk_mma, acc_s, *self.qk_ops(c, 1), mbar, (2, 3), _ALL_CHUNKS, 0, True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

        if wg == 0:
            for j in cutlass.range(n_pairs, unroll=1):
                t0 = split_start + 2 * j * bn
                more = j + 1 < n_pairs
                ph = (j + 1) % 2
                self.mark(mTrace, cta, wg, wtid, j, 0)
                self.zero_tail(sK0, t0, split_end, wg, wtid)
                # 1. fold tile 2j into the shared max; P0^T; publish
                self.fold_t(acc_s, tScS, lim, t0, scale_log2, sM, None, sSc0, sRed, row_l, ref, sc, 0, wtid)
                self.exp_t(acc_s, ref, row_l)
                cute.arch.barrier_arrive(barrier_id=int(Barrier.SCALE0), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, wg, wtid, j, 1)
                # 2. P0^T -> slot 0 rope (all 128 threads': the WG barrier, also publishing every column's scale0);
                #    O^T *= scale0; O^T += V0^T P0^T; refill A0 (slot 0 cols 0..255)
                self.stage_p(rP, acc_s, tSsP0)
                cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)
                self.scale_ot(acc, sSc0, None, wtid)
                self.mark(mTrace, cta, wg, wtid, j, 2)
                self.pv(pv_mma, acc, *self.pv_ops(c, 0, 0))
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                self.mark(mTrace, cta, wg, wtid, j, 3)
                if more:
                    self.refill(tAs0, tAg, tma_atom, mbar + 0, None, wtid, cg[0], Barrier.REFILL_A0)
                # 3. WG1 folded tile 2j+1: rescale P0^T (-> smem for WG1; the own PV that read it retired), l, O^T
                cute.arch.barrier(barrier_id=int(Barrier.SCALE1), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, wg, wtid, j, 4)
                for i in cutlass.range_constexpr(nst):
                    sc[i] = sSc1[self.col_n(i, wtid)]
                    row_l[i] = row_l[i] * sc[i]
                for e in cutlass.range_constexpr(cute.size(acc_s)):
                    acc_s[e] = acc_s[e] * sc[e % 2 + 2 * (e // 4)]
                self.stage_p(rP, acc_s, tSsP0)
                cute.arch.barrier_arrive(barrier_id=int(Barrier.P0_READY), number_of_threads=self.num_threads)
                self.scale_ot(acc, sSc1, None, wtid)
                self.mark(mTrace, cta, wg, wtid, j, 5)
                # 4. O^T += V1^T P1^T (P1^T from WG1)
                cute.arch.barrier(barrier_id=int(Barrier.P1_READY), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, wg, wtid, j, 6)
                self.pv(pv_mma, acc, *self.pv_ops(c, 1, 0))
                warpgroup.commit_group()
                if more:  # 5. next QK on slot 0: own A0 first, then (after the cross PV retired: refill A1) WG1's B0
                    self.mark(mTrace, cta, wg, wtid, j, 7)
                    self.qk_landed(qk_mma, acc_s, *self.qk_ops(c, 0), mbar, (0,), cg[0], ph, True)
                    warpgroup.commit_group()
                    warpgroup.wait_group(1)
                    self.mark(mTrace, cta, wg, wtid, j, 8)
                    self.refill(tAs1, tAg, tma_atom, mbar + 2, None, wtid, cg[2], Barrier.REFILL_A1)
                    self.qk_landed(qk_mma, acc_s, *self.qk_ops(c, 0), mbar, (1,), cg[1], ph, False)
                    warpgroup.commit_group()
                warpgroup.wait_group(0)
                self.mark(mTrace, cta, wg, wtid, j, 9)
        else:
            for j in cutlass.range(n_pairs, unroll=1):
                t1 = split_start + (2 * j + 1) * bn
                more = j + 1 < n_pairs
                ph = (j + 1) % 2
                self.mark(mTrace, cta, wg, wtid, j, 0)
                self.zero_tail(sK1, t1, split_end, wg, wtid)
                # 1. after WG0: fold tile 2j+1 into the shared max (scale = scale0 x its own); P1^T; publish
                cute.arch.barrier(barrier_id=int(Barrier.SCALE0), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, wg, wtid, j, 1)
                self.fold_t(acc_s, tScS, lim, t1, scale_log2, sM, sSc0, sSc1, sRed, row_l, ref, sc, 1, wtid)
                cute.arch.barrier_arrive(barrier_id=int(Barrier.SCALE1), number_of_threads=self.num_threads)
                self.exp_t(acc_s, ref, row_l)
                self.mark(mTrace, cta, wg, wtid, j, 2)
                # 2. P1^T -> rope columns of slot 1 (for both PVs); O^T *= scale0 x scale1; O^T += V1^T P1^T
                self.stage_p(rP, acc_s, tSsP1)
                cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)
                self.scale_ot(acc, sSc0, sSc1, wtid)
                self.mark(mTrace, cta, wg, wtid, j, 3)
                self.pv(pv_mma, acc, *self.pv_ops(c, 1, 1))
                warpgroup.commit_group()
                # 3. O^T += V0^T P0^T (P0^T from WG0), then release P1^T to WG0
                cute.arch.barrier(barrier_id=int(Barrier.P0_READY), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, wg, wtid, j, 4)
                self.pv(pv_mma, acc, *self.pv_ops(c, 0, 1))
                warpgroup.commit_group()
                cute.arch.barrier_arrive(barrier_id=int(Barrier.P1_READY), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, wg, wtid, j, 5)
                warpgroup.wait_group(1)  # 4. refills as the PVs retire (col_groups): B1 (own PV), B0 (cross PV)
                if more:
                    self.refill(tAs1, tAg, tma_atom, mbar + 3, None, wtid, cg[3], Barrier.REFILL_B1)
                warpgroup.wait_group(0)
                self.mark(mTrace, cta, wg, wtid, j, 6)
                if more:
                    self.refill(tAs0, tAg, tma_atom, mbar + 1, None, wtid, cg[1], Barrier.REFILL_B0)
                    self.mark(mTrace, cta, wg, wtid, j, 7)  # 5. next QK on slot 1: own B1 first, then WG0's A1
                    self.qk_landed(qk_mma, acc_s, *self.qk_ops(c, 1), mbar, (3,), cg[3], ph, True)
                    self.qk_landed(qk_mma, acc_s, *self.qk_ops(c, 1), mbar, (2,), cg[2], ph, False)
                    warpgroup.commit_group()
                warpgroup.wait_group(0)
                self.mark(mTrace, cta, wg, wtid, j, 8)

        self.epilogue_barrier(c, b)  # ---- epilogue: both WGs' O^T, l are relative to the final shared max
        self.epilogue_ot(acc, sM, row_l, None, sSum, sRed, c.mOut, c.mLse, c.mOacc, c.mLacc, c.out_scale, mblk,
                         split, b, wg, wtid)


__all__ = ["MlaDecodeTransposedSm90"]
