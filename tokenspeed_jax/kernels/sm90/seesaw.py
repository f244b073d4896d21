"""The seesaw loop of the Hopper MLA decode: two computing warpgroups work out of phase on alternate KV tiles.

Runs 16-bit inputs (the table's choice for S x H > 32, and for every S x H with 16-token pages) and FP8 with 16-token
pages.  Structure after FlashMLA's Hopper kernel (its "seesaw"; design read from its source, code our own):

* Two KV slots of 64 tokens x 576.  Per iteration (a pair of tiles) WG0 owns tile ``2j`` in slot 0, WG1 tile ``2j+1`` in
  slot 1 for ``S = Q K^T`` (64x64x576, Q read from shared memory once per 64 tokens); a missing second tile (odd tile
  count) is computed fully masked.  O is split by columns (WG0 ``O[:, :256]``, WG1 ``O[:, 256:]``), so both do every
  tile's ``P V``: own P on the own tile, the other's P from shared memory on the other.  A tile's P goes to the rope
  columns (512..575) of its own slot: only QK reads them, and that QK retired.
* One running row max in shared memory, updated in sequence: WG0 folds in tile 2j (``scale0``), then WG1 tile 2j+1
  (``scale1``); WG0 later rescales its P and O by ``scale1``.  So WG0's softmax runs under WG1's QK, WG1's under WG0's
  PV.  Named barriers (producer ``arrive``, consumer ``sync``; 256 threads): SCALE0 (WG0's fold published) -> SCALE1
  (WG1's) -> P0_READY (WG0's rescaled P in shared memory) and P1_READY (WG1's P stored, its cross PV issued).
* KV refills by TMA per column group once its last reader retired, each group completing an mbarrier
  (:mod:`.kv_refill`): slot 0: A0 = cols 0..255 (after WG0's own PV), B0 = 256..575 (after WG1's cross PV, which also
  read P0 in the rope columns); slot 1: A1 = 0..255 + 512..575 (after WG0's cross PV, which read P1), B1 = 256..511
  (after WG1's own PV).  A slot's next QK starts on the group its own warpgroup refilled first.  A refill's block-table
  entries load at the top of the iteration, so the issue never waits on them.  Rows of a partial last tile past the
  split may hold anything (page tails, unowned NaN pages): masked in S, their V columns zeroed by the slot's owner
  (:meth:`MlaDecodeSeesawSm90.zero_tail`; FP8: the transpose) before any PV.
* ``producer`` (16-bit, pages >= 32: with 16-token pages, 4 boxes per chunk, its coordinates would spill): a third
  warpgroup issues every refill (:meth:`MlaDecodeSeesawSm90.produce`; ``setmaxnreg``: 24 registers, 240 per computing
  WG); each loop site arrives on its 160-thread REFILL_* barrier, which the producer's warp 0 syncs on before it issues.
* 16-bit: P to the peer's tile by ``stmatrix``; the epilogue stages O through the Q tile's shared memory and leaves in
  16-byte chunks (:meth:`~tokenspeed_jax.kernels.sm90.decode_common.MlaDecodeSm90.store_o_staged`).  A row block with
  rows past R loads zeros there and masks every key of theirs.
* FP8 (e4m3 q and cache, bf16 output; the caller folds the FP8 scales into ``softmax_scale`` / ``output_scale``, decode
  contract): QK^T by QGMMA m64n64k32 straight from the raw q tile (36 KB) and the landed e4m3 staging.  Slots are packed
  ``[V^T 32 KB | P 4 KB | staging 36 KB]`` (:mod:`.fp8_operands`): after its QK retired the owner transposes V
  (``ldmatrix.trans`` + ``prmt`` + ``stmatrix``, tokens permuted in 16-token groups, P in the same order); both PVs are
  SS QGMMA m64n256k32.  P is ``2^8 p`` rounded to e4m3 (row sums over the unrounded P; the LSE takes the bias out).
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, cute
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from tokenspeed_jax.kernels.sm90.decode_common import _K16, _K32, MlaDecodeSm90
from tokenspeed_jax.kernels.sm90.decode_trace import DecodeTraceMixin
from tokenspeed_jax.kernels.sm90.fp8_operands import Fp8OperandsMixin, store_p8
from tokenspeed_jax.kernels.sm90.helpers import LOG2_E, Barrier, clear_nonfinite_16x2
from tokenspeed_jax.kernels.sm90.kv_refill import KvRefillMixin
_F8 = cutlass.Float8E4M3FN
_ALL_CHUNKS = (0, 1, 2, 3, 4, 5, 6, 7, 8)
_EXP_MASK = {cutlass.BFloat16: 0x7F80, cutlass.Float16: 0x7C00}  # the exponent field of a 16-bit float


def acc_to_a_layout(acc_layout: cute.Layout) -> cute.Layout:
    """A 16-bit wgmma accumulator fragment ``((2, 2, N/8), M, N)`` as the register A operand of a following wgmma:
    ``((2, 2, 2), M, (N/16, N))`` (pairs of 8-column groups form one K=16 step; same value order in a thread)."""
    d = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    return cute.make_layout(
        ((d.shape[0][0], d.shape[0][1], d.shape[0][2][0]), d.shape[1], (d.shape[0][2][1], d.shape[2])),
        stride=((d.stride[0][0], d.stride[0][1], d.stride[0][2][0]), d.stride[1],
                (d.stride[0][2][1], d.stride[2])),
    )


class MlaDecodeSeesawSm90(Fp8OperandsMixin, KvRefillMixin, DecodeTraceMixin, MlaDecodeSm90):
    """The seesaw loop (module docstring).  Arguments: the base class's, plus ``producer`` (a third warpgroup issues the
    refills; 16-bit, pages >= 32) and ``pad_zero`` (default: a row block with rows past R pads them with zeros)."""

    def __init__(self, *, producer: bool = False, pad_zero: bool | None = None, **kw):
        rows = kw["num_heads"] * kw["q_len"]
        super().__init__(pad_zero=rows % self.block_m != 0 if pad_zero is None else pad_zero, **kw)
        if producer and (self.fp8 or self.page_size < 32):
            raise ValueError(f"producer: 16-bit inputs with page_size >= 32 only, got {self.dtype_name} with "
                             f"page_size {self.page_size}")
        self.producer = bool(producer)  # the third warpgroup (module docstring; :meth:`produce`)
        self.cta_threads = self.num_threads + (128 if self.producer else 0)
        if self.fp8:
            self.mma_dtype = cutlass.Float16  # 16-bit dtype of the slot layouts (a slot: 64 tokens x 576 x 2 bytes)
        self.p_stsm = not self.fp8  # 16-bit P to the peer's tile by stmatrix (FP8 stores e4m3 P: store_p8)

    # ------------------------------------------------------------------------------------------ host
    def _seesaw_layouts(self):
        dt = self.mma_dtype
        tile_qk = (self.block_m, self.block_n, self.D)
        q_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile_qk, _F8 if self.fp8 else dt, 1)
        k_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile_qk, dt, 2)
        v_layout = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (self.block_m, self.DV, self.block_n), dt, 1)
        p_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.block_m, self.DV // 2, self.block_n),
                                                 dt, 1)
        return q_layout, k_layout, v_layout, p_layout

    red_floats = 4  # ``Storage.red`` (column statistics): unused (4: smallest field); transposed 16-bit: 2 x 4 x 32
    # 64-col chunks of refill groups A0, B0, A1, B1 (module docstring); rope chunk 8: with the last PV reading its P
    col_groups = ((0, 1, 2, 3), (4, 5, 6, 7, 8), (0, 1, 2, 3, 8), (4, 5, 6, 7))
    n_mbar = 4  # one mbarrier per column group: A0, B0, A1, B1

    def seesaw_mmas(self):
        """``(qk_mma, pv_ss, pv_rs, pv8)``: QK; 16-bit P V, P from smem / registers; FP8 e4m3 P V (else None)."""
        dt = self.mma_dtype
        K, MN = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
        qk_dt = _F8 if cutlass.const_expr(self.fp8) else dt
        qk_mma = sm90_utils.make_trivial_tiled_mma(qk_dt, qk_dt, K, K, Float32, (1, 1, 1),
                                                   (self.block_m, self.block_n))
        pv_ss = sm90_utils.make_trivial_tiled_mma(dt, dt, K, MN, Float32, (1, 1, 1), (self.block_m, self.DV // 2))
        pv_rs = sm90_utils.make_trivial_tiled_mma(dt, dt, K, MN, Float32, (1, 1, 1), (self.block_m, self.DV // 2),
                                                  a_source=warpgroup.OperandSource.RMEM)
        pv8 = None  # FP8 P V: e4m3 P (smem) x e4m3 V^T (smem, tokens contiguous), one QGMMA over the WG's 256 features
        if cutlass.const_expr(self.fp8):
            pv8 = sm90_utils.make_trivial_tiled_mma(_F8, _F8, K, K, Float32, (1, 1, 1), (self.block_m, self.DV // 2))
        return qk_mma, pv_ss, pv_rs, pv8

    @cute.jit
    def __call__(self, stream, q: cute.Tensor, kv: cute.Tensor, block_table: cute.Tensor, seq_lens: cute.Tensor,
                 softmax_scale: cute.Tensor, output_scale: cute.Tensor, sched_cta: cute.Tensor, sched_req: cute.Tensor,
                 out: cute.Tensor, lse: cute.Tensor, o_accum: cute.Tensor, lse_accum: cute.Tensor,
                 trace_buf: cute.Tensor = None):
        dt = self.mma_dtype
        q_layout, k_layout, v_layout, p_layout = self._seesaw_layouts()
        qk_mma, pv_ss, pv_rs, pv8 = self.seesaw_mmas()
        tma_atom, tma_kv = self.kv_tma(kv)  # (FP8: raw e4m3 rows in the QGMMA B layout)
        qk_dt = _F8 if cutlass.const_expr(self.fp8) else dt

        @cute.struct
        class Storage:
            mbar: cute.struct.MemRange[Int64, self.n_mbar]  # A0, B0, A1, B1 (module docstring)
            row_max: cute.struct.MemRange[Float32, 64]
            scale0: cute.struct.MemRange[Float32, 64]
            scale1: cute.struct.MemRange[Float32, 64]
            row_sum: cute.struct.MemRange[Float32, 2 * 64]
            sQ: cute.struct.Align[cute.struct.MemRange[qk_dt, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(k_layout)], 1024]
            zero_row: cute.struct.Align[cute.struct.MemRange[Int32, 4], 16]  # FP8 transpose: rows past the split
            red: cute.struct.Align[cute.struct.MemRange[Float32, self.red_floats], 16]  # column statistics

        main = self.seesaw_kernel(qk_mma, pv_ss, pv_rs, pv8, q, kv, block_table, seq_lens, softmax_scale, output_scale,
                                  sched_cta, out, lse, o_accum, lse_accum, trace_buf, q_layout, k_layout, v_layout,
                                  p_layout, tma_atom, tma_kv, Storage)
        self.launch_main(main, Storage.size_in_bytes(), stream, output_scale, sched_cta, sched_req, out, lse, o_accum,
                         lse_accum)

    # ---------------------------------------------------------------------------------------- device
    @cute.jit
    def ready_v(self, w32: cute.Tensor, zero_row, slot: cutlass.Constexpr, tile_start: Int32, split_end: Int32,
                wg: Int32, wtid: Int32):
        """By a slot's owner after its QK retired: FP8 builds its ``V^T`` (:meth:`transpose_v_packed`); 16-bit: none."""
        if cutlass.const_expr(self.fp8):
            self.transpose_v_packed(w32, zero_row, slot, tile_start, split_end, wg, wtid)

    @cute.jit
    def next_qk_retired(self, mTrace, cta, wg, wtid, j, ev: cutlass.Constexpr, more, w32, zrow, slot: cutlass.Constexpr,
                        tile_start: Int32, split_end: Int32):
        """End of WG ``wg``'s iteration ``j`` (tile ``tile_start``, ``slot``): next QK retired (event ``ev``), then with
        a next pair :meth:`ready_v` (events ``ev + 1 .. ev + 3``: TRACE_EVENTS' wait, transpose, refill)."""
        warpgroup.wait_group(0)
        self.mark(mTrace, cta, wg, wtid, j, ev)
        if more:
            self.mark(mTrace, cta, wg, wtid, j, ev + 1)
            self.ready_v(w32, zrow, slot, tile_start + 2 * self.block_n, split_end, wg, wtid)
            self.mark(mTrace, cta, wg, wtid, j, ev + 2)
            self.mark(mTrace, cta, wg, wtid, j, ev + 3)

    @cute.jit
    def produce(self, tAs0: cute.Tensor, tAs1: cute.Tensor, tAg: cute.Tensor, tma_atom: cute.CopyAtom, mbar,
                mBT: cute.Tensor, b: Int32, split_start: Int32, split_end: Int32, num_pages: Int32, n_pairs: Int32,
                wtid: Int32):
        """The producer (:attr:`producer`; module docstring) after the prologue, which it loaded: warp 0 issues pair
        j + 1's refills in the order their sites are reached, A0, B1, B0, A1; none waits for a later refill of the same
        pair, so the order cannot block.  A TMA issue stalls its warp hundreds of cycles, here not a computing one."""
        bn = self.block_n
        cg = self.col_groups
        groups = ((Barrier.REFILL_A0, 0, 0, cg[0]),
                  (Barrier.REFILL_B1, 1, 3, cg[3]),
                  (Barrier.REFILL_B0, 0, 1, cg[1]),
                  (Barrier.REFILL_A1, 1, 2, cg[2]))
        if wtid < 32:
            for j in cutlass.range(n_pairs - 1, unroll=1):
                t2 = split_start + (2 * j + 2) * bn
                for bar, s, m, chunks in groups:
                    t = t2 + s * bn
                    # before the wait, a tile at a time (two tiles' coordinates spill in 24 registers, pages 16 / 32)
                    crd = self.coords(mBT, b, t, split_end, num_pages)
                    cute.arch.barrier(barrier_id=int(bar), number_of_threads=160)
                    self.refill((tAs0, tAs1)[s], tAg, tma_atom, mbar + m, crd, wtid, chunks, None)

    @cute.jit
    def zero_tail(self, sKs: cute.Tensor, tile_start: Int32, split_end: Int32, wg: Int32, wtid: Int32):
        """16-bit: zero V (cols 0..511) of a slot's rows at or past ``split_end`` so P = 0 there never meets a NaN, and
        with :attr:`hidden_keys` :meth:`clean_hidden_v`.  By the owner once its QK retired and its refills landed; the
        WG barrier publishes the zeros to its own PV, P0_READY / P1_READY (after a proxy fence) to the other WG's."""
        if tile_start + self.block_n > self.tail_from(split_end):
            first = cutlass.max(split_end - tile_start, 0)
            for i in cutlass.range_constexpr(self.block_n * self.DV // 8 // 128):
                idx = wtid + 128 * i
                r = idx // (self.DV // 8)
                c0 = (idx % (self.DV // 8)) * 8
                if r >= first:
                    for e in cutlass.range_constexpr(8):
                        sKs[r, c0 + e] = self.mma_dtype(0.0)
            if cutlass.const_expr(self.hidden_keys > 0):
                self.clean_hidden_v(sKs, tile_start, split_end, wtid)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)

    @cute.jit
    def clean_hidden_v(self, sKs: cute.Tensor, tile_start: Int32, split_end: Int32, wtid: Int32):
        """Inf / NaN -> 0 in V of the slot's rows for keys ``[split_end - hidden_keys, split_end)`` (why:
        ``MlaDecodeSm90.hidden_keys``; :func:`~.helpers.clear_nonfinite_16x2`): 2 rows x 64 threads x 8 values a step,
        in the slot's swizzled view.  Fixed predicated steps, as the zeroing: per-thread loop bounds made ptxas treat
        all the loop's later wgmmas as divergent and serialize them (C7520, transposed batch-invariant build)."""
        per_row = self.DV // 8
        c0 = (wtid % per_row) * 8
        exp_mask = _EXP_MASK[self.mma_dtype]
        v = cute.make_rmem_tensor((8,), self.mma_dtype)
        w = cute.recast_tensor(v, Int32)
        lo, hi = self.hidden_rows(tile_start, split_end)
        for step in cutlass.range_constexpr(-(-self.hidden_keys * per_row // 128)):
            r = lo + wtid // per_row + (128 // per_row) * step
            if r < hi:
                for e in cutlass.range_constexpr(8):
                    v[e] = sKs[r, c0 + e]
                for i in cutlass.range_constexpr(4):
                    w[i] = clear_nonfinite_16x2(w[i], exp_mask)
                for e in cutlass.range_constexpr(8):
                    sKs[r, c0 + e] = v[e]

    @cute.jit
    def pv(self, mma: cute.TiledMma, acc_o: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
           kstep: cutlass.Constexpr = _K16):
        """Issue ``O += P V_half`` (no commit); ``kstep``: the wgmma K (32 for the e4m3 QGMMA)."""
        warpgroup.fence()
        for k in cutlass.range_constexpr(self.block_n // kstep):
            cute.gemm(mma, acc_o, tA[None, None, k], tB[None, None, k], acc_o)

    @cute.jit
    def fold_first(self, acc_s, tScS, lim, tile_start, scale_log2, sM, sSc0, row_in, row_l, ref, sc, wtid):
        """WG0, first in an iteration: :meth:`fold_first_max`, then ``P`` (in ``acc_s``) against ``ref``, row sums."""
        self.fold_first_max(acc_s, tScS, lim, tile_start, scale_log2, sM, sSc0, row_in, row_l, ref, sc, wtid)
        self.exp_rows(acc_s, ref, row_l)

    @cute.jit
    def fold_second(self, acc_s, tScS, lim, tile_start, scale_log2, sM, sSc0, sSc1, row_in, row_l, ref, sc, wtid):
        """Warpgroup 1, after SCALE0: :meth:`fold_second_max`, arrive on SCALE1, then ``P`` as :meth:`fold_first`."""
        self.fold_second_max(acc_s, tScS, lim, tile_start, scale_log2, sM, sSc0, sSc1, row_in, row_l, ref, sc, wtid)
        cute.arch.barrier_arrive(barrier_id=int(Barrier.SCALE1), number_of_threads=self.num_threads)
        self.exp_rows(acc_s, ref, row_l)

    def v_half(self, sKs: cute.Tensor, v_layout: cute.ComposedLayout, wg):
        """Warpgroup ``wg``'s 256 V features of slot ``sKs``, ``(features, tokens)`` MN-major (:meth:`_seesaw_layouts`):
        the P V's B operand here, the transposed 16-bit loop's ``V^T`` A operand."""
        sV = cute.make_tensor(cute.recast_ptr(sKs.iterator, v_layout.inner), v_layout.outer)
        return cute.local_tile(sV[None, None, 0], (self.DV // 2, self.block_n), (wg, 0))

    @cute.jit
    def stage_p(self, rP: cute.Tensor, acc_s: cute.Tensor, tSsP: cute.Tensor, stsm=None):
        """P (fp32 ``acc_s``) -> 16-bit ``rP`` -> smem ``tSsP`` (:meth:`put_p`), fenced for the async proxy: another
        WG's wgmma reads it once the caller's barrier publishes it."""
        rP.store(acc_s.load().to(rP.element_type))
        self.put_p(rP, tSsP, stsm)
        cute.arch.fence_view_async_shared()

    @cute.jit
    def put_p(self, rP: cute.Tensor, tSsP: cute.Tensor, stsm=None):
        """``rP`` -> smem: element-wise into ``tSsP`` (``stsm`` None), else ``stmatrix`` (:meth:`p_stsm_views`)."""
        if cutlass.const_expr(stsm is None):
            cute.autovec_copy(rP, tSsP)
        else:
            cute.copy(stsm[0], stsm[1], stsm[2])

    @cute.jit
    def p_stsm_views(self, qk_mma: cute.TiledMma, rP: cute.Tensor, sP0: cute.Tensor, sP1: cute.Tensor, wtid: Int32):
        """16-bit: ``stmatrix`` (x4, not transposed: a matrix row is 8 tokens of a query row, 16 bytes of the K-major P
        tile) over the QK's accumulator layout, as :meth:`put_p`'s ``stsm`` for ``sP0`` / ``sP1``; FP8: None, None."""
        if cutlass.const_expr(not self.p_stsm):
            return None, None
        atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.mma_dtype)
        tiled = cute.make_tiled_copy_C(atom, qk_mma)
        thr = tiled.get_slice(wtid)
        src = thr.retile(rP)
        return (tiled, src, thr.partition_D(sP0)), (tiled, src, thr.partition_D(sP1))

    @cute.jit
    def scale_o(self, acc_o: cute.Tensor, s: cute.Tensor):
        """``acc_o`` (O, or P) ``*= s`` on the thread's two rows.  With the producer, nothing where every row of the
        warp has scale 1 (no max moved); without it the test stays out: there ptxas then serialized every wgmma of
        the loop (C7520; the computing warpgroups issue the refills)."""
        if cutlass.const_expr(self.producer):
            if not cute.arch.vote_all_sync(self.all_one(s)):
                for e in cutlass.range_constexpr(cute.size(acc_o)):
                    acc_o[e] = acc_o[e] * s[(e // 2) % 2]
        else:
            for e in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[e] = acc_o[e] * s[(e // 2) % 2]

    @cute.kernel
    def seesaw_kernel(self, qk_mma: cute.TiledMma, pv_ss: cute.TiledMma, pv_rs: cute.TiledMma, pv8: cute.TiledMma,
                      mQ: cute.Tensor,
                      mKV: cute.Tensor, mBT: cute.Tensor, mSeq: cute.Tensor, mSS: cute.Tensor, mOS: cute.Tensor,
                      mCta: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor, mOacc: cute.Tensor, mLacc: cute.Tensor,
                      mTrace: cute.Tensor, q_layout: cute.ComposedLayout, k_layout: cute.ComposedLayout,
                      v_layout: cute.ComposedLayout, p_layout: cute.ComposedLayout, tma_atom: cute.CopyAtom,
                      tma_kv: cute.Tensor, Storage: cutlass.Constexpr):
        """Persistent CTA ``(row block, g)``: runs its range's pieces (:meth:`run_pieces`: Q load, prologue refills,
        loop, epilogue between CTA barriers); mbarriers initialised once, phase parity carried over (:meth:`landed`)."""
        tid, mblk, g, wg, wtid, st = self.cta_start(Storage)
        self.phase_bits(st.mbar.data_ptr())
        sQ = st.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK = st.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sM = st.row_max.get_tensor(cute.make_layout(64))
        sSc0 = st.scale0.get_tensor(cute.make_layout(64))
        sSc1 = st.scale1.get_tensor(cute.make_layout(64))
        sSum = st.row_sum.get_tensor(cute.make_layout(128))
        mbar = st.mbar.data_ptr()  # + 0: A0, 1: B0, 2: A1, 3: B1

        scale_log2 = mSS[0] * LOG2_E
        out_scale = mOS[0]
        num_pages = mKV.shape[0]
        self.init_mbarriers(st, tid, self.n_mbar, tma_atom)
        zrow = st.zero_row.data_ptr()  # (only the FP8 transpose reads it)
        sK0 = sK[None, None, 0]
        sK1 = sK[None, None, 1]
        sSt0, sSt1 = None, None  # FP8: the e4m3 staging view of each slot (:meth:`staging`)
        if cutlass.const_expr(self.fp8):
            sSt0, sSt1 = self.staging(st.sK.data_ptr())
        (tAs0, tAs1), tAg = self.kv_partitions(tma_atom, tma_kv, (sSt0, sSt1) if cutlass.const_expr(self.fp8)
                                               else (sK0, sK1))
        cute.arch.barrier()  # mbarriers initialised before any arrive
        self.run_pieces(SimpleNamespace(
            tid=tid, mblk=mblk, g=g, wg=wg, wtid=wtid, st=st, mCta=mCta, mBT=mBT, mSeq=mSeq, mQ=mQ, mOut=mOut,
            mLse=mLse, mOacc=mOacc, mLacc=mLacc, mTrace=mTrace, mmas=(qk_mma, pv_ss, pv_rs, pv8), sQ=sQ, sK0=sK0,
            sK1=sK1, sSt0=sSt0, sSt1=sSt1, k_layout=k_layout, v_layout=v_layout, p_layout=p_layout, sM=sM, sSc0=sSc0,
            sSc1=sSc1, sSum=sSum, mbar=mbar, scale_log2=scale_log2, out_scale=out_scale, num_pages=num_pages,
            tAs0=tAs0, tAs1=tAs1, tAg=tAg, tma_atom=tma_atom, zrow=zrow))

    @cute.jit
    def produce_start(self, c, b: Int32, split_start: Int32, split_end: Int32, n_pairs: Int32):
        """The producer's first loads of a piece (``run_piece``): pair 0 (:meth:`prologue_refills`)."""
        self.prologue_refills(c.tAs0, c.tAs1, c.tAg, c.tma_atom, c.mbar, c.mBT, b, split_start, split_end,
                              c.num_pages, c.wg, c.wtid)

    @cute.jit
    def produce_rest(self, c, b: Int32, split_start: Int32, split_end: Int32, n_pairs: Int32):
        """The producer's refills of a piece after its Q tile (:meth:`produce`)."""
        self.produce(c.tAs0, c.tAs1, c.tAg, c.tma_atom, c.mbar, c.mBT, b, split_start, split_end, c.num_pages,
                     n_pairs, c.wtid)

    @cute.jit
    def load_piece_q(self, c, b: Int32, split_start: Int32, split_end: Int32):
        """Q by cp.async (FP8: sync, :meth:`load_q_tile`); no producer: pair 0 meanwhile (:meth:`prologue_refills`)."""
        self.load_q_tile(c.sQ[None, None, 0], c.mQ, c.mblk, b, c.tid)
        cute.arch.cp_async_commit_group()
        if cutlass.const_expr(not self.producer):
            self.prologue_refills(c.tAs0, c.tAs1, c.tAg, c.tma_atom, c.mbar, c.mBT, b, split_start, split_end,
                                  c.num_pages, c.wg, c.wtid)
        cute.arch.cp_async_wait_group(0)  # Q (the KV copies are tracked by the mbarriers)

    def advance_phases(self, n_pairs: Int32):
        """After a piece (:meth:`walk_pieces`): every mbarrier completed ``n_pairs`` times."""
        ph = self.ph
        ph[0] = ph[0] ^ (Int32(0) - (n_pairs & 1))

    @cute.jit
    def prologue_refills(self, tAs0, tAs1, tAg, tma_atom, mbar, mBT, b, split_start, split_end, num_pages, wg, wtid):
        """Pair 0 into both slots (1 completion per mbarrier): the producer alone, or each computing WG its groups."""
        bn = self.block_n
        pg0 = self.coords(mBT, b, split_start, split_end, num_pages)
        pg1 = self.coords(mBT, b, split_start + bn, split_end, num_pages)
        cg = self.col_groups
        if cutlass.const_expr(self.producer):  # the producer loads both slots by column groups (A0, A1, B0, B1)
            self.refill(tAs0, tAg, tma_atom, mbar + 0, pg0, wtid, cg[0], None)
            self.refill(tAs1, tAg, tma_atom, mbar + 2, pg1, wtid, cg[2], None)
            self.refill(tAs0, tAg, tma_atom, mbar + 1, pg0, wtid, cg[1], None)
            self.refill(tAs1, tAg, tma_atom, mbar + 3, pg1, wtid, cg[3], None)
        elif wg == 0:
            self.refill(tAs0, tAg, tma_atom, mbar + 0, pg0, wtid, cg[0], None)
            self.refill(tAs1, tAg, tma_atom, mbar + 2, pg1, wtid, cg[2], None)
        else:
            self.refill(tAs0, tAg, tma_atom, mbar + 1, pg0, wtid, cg[1], None)
            self.refill(tAs1, tAg, tma_atom, mbar + 3, pg1, wtid, cg[3], None)

    @cute.jit
    def mma_ops(self, c, wg: cutlass.Constexpr):
        """MMA operands, built at a wgmma's issue (``wg``: the issuing WG, constant so the V descriptors stay uniform)
        from a fresh copy of the shared address (:meth:`~.decode_common.MlaDecodeSm90.fresh_smem`): ``tSrQ``; per slot
        ``tSrK``, ``tOsP`` (SS P V's A), ``tOrV`` (this WG's V half), FP8 ``tOsP8``, ``tOrVt`` (e4m3 P, V^T)."""
        qk_mma, pv_ss, _, pv8 = c.mmas
        bn = self.block_n
        wtid = c.wtid
        sQ, sK0, sK1, sSt0, sSt1, skp = self.fresh_smem(c, (c.sQ, c.sK0, c.sK1, c.sSt0, c.sSt1, c.st.sK.data_ptr()))
        qk_thr = qk_mma.get_slice(wtid)
        ss_thr = pv_ss.get_slice(wtid)
        kq = (sSt0, sSt1) if cutlass.const_expr(self.fp8) else (sK0, sK1)  # the QK's B operand
        p_layout = c.p_layout
        sP = [cute.make_tensor(cute.recast_ptr(k.iterator + self.DV * bn, p_layout.inner), p_layout.outer)
              for k in (sK0, sK1)]
        o = SimpleNamespace(
            tSrQ=qk_thr.make_fragment_A(qk_thr.partition_A(sQ[None, None, 0])),
            tSrK=[qk_thr.make_fragment_B(qk_thr.partition_B(k)) for k in kq],
            tOsP=[ss_thr.make_fragment_A(ss_thr.partition_A(x[None, None, 0])) for x in sP],
            tOrV=[ss_thr.make_fragment_B(ss_thr.partition_B(self.v_half(k, c.v_layout, wg))) for k in (sK0, sK1)],
            tOsP8=None, tOrVt=None)
        if cutlass.const_expr(self.fp8):
            (sVt0, sVt1), (sP80, sP81), _ = self.pv8_views(skp)
            thr8 = pv8.get_slice(wtid)
            o.tOsP8 = [thr8.make_fragment_A(thr8.partition_A(x)) for x in (sP80, sP81)]
            o.tOrVt = [thr8.make_fragment_B(thr8.partition_B(cute.local_tile(x, (self.DV // 2, bn), (wg, 0))))
                       for x in (sVt0, sVt1)]
        return o

    @cute.jit
    def consume(self, c, cta, b, seq, split_start, split_end, split, n_pairs):
        """Computing WGs' part of a piece after Q (:meth:`walk_pieces`); ``c``: :meth:`seesaw_kernel`'s values."""
        qk_mma, pv_ss, pv_rs, pv8 = c.mmas
        sQ, st, wg, wtid, mblk = c.sQ, c.st, c.wg, c.wtid, c.mblk
        sK0, sK1, sM, sSc0, sSc1, sSum, mbar, mTrace = c.sK0, c.sK1, c.sM, c.sSc0, c.sSc1, c.sSum, c.mbar, c.mTrace
        tAs0, tAs1, tAg, tma_atom, mBT, num_pages = c.tAs0, c.tAs1, c.tAg, c.tma_atom, c.mBT, c.num_pages
        zrow, scale_log2, p_layout = c.zrow, c.scale_log2, c.p_layout
        bn = self.block_n
        fp8 = self.fp8
        qk_thr = qk_mma.get_slice(wtid)
        ss_thr = pv_ss.get_slice(wtid)
        acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((self.block_m, bn)))
        acc_o = ss_thr.make_fragment_C(ss_thr.partition_shape_C((self.block_m, self.DV // 2)))
        acc_o.fill(0.0)
        tScS = qk_thr.partition_C(cute.make_identity_tensor((self.block_m, bn)))
        # P of slot g lives in its rope columns (chunk 8: 64 rows x 64 cols, same swizzled atom layout as P)
        sP0 = cute.make_tensor(cute.recast_ptr(sK0.iterator + self.DV * bn, p_layout.inner), p_layout.outer)
        sP1 = cute.make_tensor(cute.recast_ptr(sK1.iterator + self.DV * bn, p_layout.inner), p_layout.outer)
        tSsP0 = qk_thr.partition_C(sP0[None, None, 0])
        tSsP1 = qk_thr.partition_C(sP1[None, None, 0])
        # FP8 P V (pv8_views): e4m3 P stores; O in the QGMMA's (N = 64) accumulator layout, pv_ss's registers and order
        w32, acc_o8, tSsP8_0, tSsP8_1 = (None,) * 4
        if cutlass.const_expr(fp8):
            w32 = cute.make_tensor(cute.recast_ptr(st.sK.data_ptr(), dtype=Int32), cute.make_layout(
                cute.cosize(c.k_layout) * (self.mma_dtype.width // 8) // 4))
            _, _, (sP8s0, sP8s1) = self.pv8_views(st.sK.data_ptr())
            thr8 = pv8.get_slice(wtid)
            acc_o8 = cute.make_tensor(acc_o.iterator,
                                      thr8.make_fragment_C(thr8.partition_shape_C((self.block_m, self.DV // 2))).layout)
            tSsP8_0 = qk_thr.partition_C(sP8s0)
            tSsP8_1 = qk_thr.partition_C(sP8s1)
            pv8.set(warpgroup.Field.ACCUMULATE, True)
        rP = cute.make_rmem_tensor_like(acc_s, self.mma_dtype)  # own P, the RS operand
        tOrP = cute.make_tensor(rP.iterator, acc_to_a_layout(rP.layout))
        stsm0, stsm1 = self.p_stsm_views(qk_mma, rP, sP0[None, None, 0], sP1[None, None, 0], wtid)
        qk_mma.set(warpgroup.Field.ACCUMULATE, True)
        pv_ss.set(warpgroup.Field.ACCUMULATE, True)
        pv_rs.set(warpgroup.Field.ACCUMULATE, True)

        row_in, lim = self.row_limits(tScS, mblk, seq, split_end)
        row_l = cute.make_rmem_tensor((2,), Float32)
        row_l[0] = 0.0
        row_l[1] = 0.0
        ref = cute.make_rmem_tensor((2,), Float32)
        sc = cute.make_rmem_tensor((2,), Float32)

        # operands: mma_ops at each wgmma issue, one name per site (a name set in two dynamic branches keeps one type)
        if n_pairs > 0:  # first QK of each warpgroup (pair 0)
            if wg == 0:
                self.landed(mbar + 0, 0)
                self.landed(mbar + 1, 0)
                o1 = self.mma_ops(c, 0)
                self.qk_chunks(qk_mma, acc_s, o1.tSrQ, o1.tSrK[0], _ALL_CHUNKS, True)
            else:
                self.landed(mbar + 2, 0)
                self.landed(mbar + 3, 0)
                o2 = self.mma_ops(c, 1)
                self.qk_chunks(qk_mma, acc_s, o2.tSrQ, o2.tSrK[1], _ALL_CHUNKS, True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            if wg == 0:
                self.ready_v(w32, zrow, 0, split_start, split_end, wg, wtid)
            else:
                self.ready_v(w32, zrow, 1, split_start + bn, split_end, wg, wtid)

        if wg == 0:
            for j in cutlass.range(n_pairs, unroll=1):
                t0 = split_start + 2 * j * bn  # first token of this pair's tile in slot 0
                more = j + 1 < n_pairs
                ph = (j + 1) % 2  # parity of the refill completion the next QK waits for
                self.mark(mTrace, cta, wg, wtid, j, 0)
                pgA0 = self.coords(mBT, b, t0 + 2 * bn, split_end, num_pages)  # in flight during softmax
                pgA1 = self.coords(mBT, b, t0 + 3 * bn, split_end, num_pages)
                if cutlass.const_expr(not fp8):  # (the FP8 transpose zeroes those rows of V^T)
                    self.zero_tail(sK0, t0, split_end, wg, wtid)
                # 1. fold tile 2j into the shared max; P0; O_L *= scale0; publish
                self.fold_first(acc_s, tScS, lim, t0, scale_log2, sM, sSc0, row_in, row_l, ref, sc, wtid)
                self.scale_o(acc_o, sc)
                cute.arch.barrier_arrive(barrier_id=int(Barrier.SCALE0), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, wg, wtid, j, 1)
                # 2. O_L += P0 V0_L (RS; FP8: SS, P0 via smem), then refill A0 (slot 0 cols 0..255: only this WG reads)
                if cutlass.const_expr(fp8):  # (all 128 threads' parts of P0, then the wgmma)
                    store_p8(acc_s, tSsP8_0)
                    cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)
                    self.mark(mTrace, cta, wg, wtid, j, 2)
                    o3 = self.mma_ops(c, 0)
                    self.pv(pv8, acc_o8, o3.tOsP8[0], o3.tOrVt[0], _K32)
                else:
                    rP.store(acc_s.load().to(self.mma_dtype))
                    self.mark(mTrace, cta, wg, wtid, j, 2)
                    o4 = self.mma_ops(c, 0)
                    self.pv(pv_rs, acc_o, tOrP, o4.tOrV[0])
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                self.mark(mTrace, cta, wg, wtid, j, 3)
                if more:
                    self.refill(tAs0, tAg, tma_atom, mbar + 0, pgA0, wtid, (0, 1, 2, 3), Barrier.REFILL_A0)
                # 3. WG1 folded tile 2j+1: rescale P0 (-> smem for WG1), l, O_L by scale1
                cute.arch.barrier(barrier_id=int(Barrier.SCALE1), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, wg, wtid, j, 4)
                for h in cutlass.range_constexpr(2):
                    sc[h] = sSc1[row_in[h]]
                    row_l[h] = row_l[h] * sc[h]
                self.scale_o(acc_s, sc)
                if cutlass.const_expr(fp8):  # (the own PV, which read the same tile, retired above)
                    store_p8(acc_s, tSsP8_0)
                else:
                    self.stage_p(rP, acc_s, tSsP0, stsm0)
                cute.arch.barrier_arrive(barrier_id=int(Barrier.P0_READY), number_of_threads=self.num_threads)
                self.scale_o(acc_o, sc)
                self.mark(mTrace, cta, wg, wtid, j, 5)
                # 4. O_L += P1 V1_L (SS; P1 from WG1's smem)
                cute.arch.barrier(barrier_id=int(Barrier.P1_READY), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, wg, wtid, j, 6)
                if cutlass.const_expr(fp8):
                    o5 = self.mma_ops(c, 0)
                    self.pv(pv8, acc_o8, o5.tOsP8[1], o5.tOrVt[1], _K32)
                else:
                    o6 = self.mma_ops(c, 0)
                    self.pv(pv_ss, acc_o, o6.tOsP[1], o6.tOrV[1])
                warpgroup.commit_group()
                if more:  # 5. next QK on slot 0: own A0 first, then (after the cross PV retired: refill A1) WG1's B0
                    self.landed(mbar + 0, ph)
                    self.mark(mTrace, cta, wg, wtid, j, 7)
                    o7 = self.mma_ops(c, 0)
                    self.qk_chunks(qk_mma, acc_s, o7.tSrQ, o7.tSrK[0], (0, 1, 2, 3), True)
                    warpgroup.commit_group()
                    warpgroup.wait_group(1)
                    self.mark(mTrace, cta, wg, wtid, j, 8)
                    self.refill(tAs1, tAg, tma_atom, mbar + 2, pgA1, wtid, (0, 1, 2, 3, 8), Barrier.REFILL_A1)
                    self.landed(mbar + 1, ph)
                    o8 = self.mma_ops(c, 0)
                    self.qk_chunks(qk_mma, acc_s, o8.tSrQ, o8.tSrK[0], (4, 5, 6, 7, 8), False)
                    warpgroup.commit_group()
                self.next_qk_retired(mTrace, cta, wg, wtid, j, 9, more, w32, zrow, 0, t0, split_end)
        else:
            for j in cutlass.range(n_pairs, unroll=1):
                t1 = split_start + (2 * j + 1) * bn  # first token of this pair's tile in slot 1
                more = j + 1 < n_pairs
                ph = (j + 1) % 2
                self.mark(mTrace, cta, wg, wtid, j, 0)
                pgB1 = self.coords(mBT, b, t1 + 2 * bn, split_end, num_pages)  # in flight during the waits
                pgB0 = self.coords(mBT, b, t1 + bn, split_end, num_pages)
                if cutlass.const_expr(not fp8):
                    self.zero_tail(sK1, t1, split_end, wg, wtid)
                # 1. after WG0: fold tile 2j+1 into the shared max; P1; O_R *= scale0*scale1; publish
                cute.arch.barrier(barrier_id=int(Barrier.SCALE0), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, wg, wtid, j, 1)
                self.fold_second(acc_s, tScS, lim, t1, scale_log2, sM, sSc0, sSc1, row_in, row_l, ref, sc, wtid)
                self.scale_o(acc_o, sc)
                self.mark(mTrace, cta, wg, wtid, j, 2)
                # 2. P1 -> smem (for WG0), O_R += P1 V1_R (16-bit: RS; FP8: SS, P1 through smem for both PVs)
                if cutlass.const_expr(fp8):
                    store_p8(acc_s, tSsP8_1)
                    cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)
                    self.mark(mTrace, cta, wg, wtid, j, 3)
                    o9 = self.mma_ops(c, 1)
                    self.pv(pv8, acc_o8, o9.tOsP8[1], o9.tOrVt[1], _K32)
                    warpgroup.commit_group()
                else:
                    rP.store(acc_s.load().to(self.mma_dtype))
                    self.put_p(rP, tSsP1, stsm1)
                    self.mark(mTrace, cta, wg, wtid, j, 3)
                    o10 = self.mma_ops(c, 1)
                    self.pv(pv_rs, acc_o, tOrP, o10.tOrV[1])
                    warpgroup.commit_group()
                    cute.arch.fence_view_async_shared()
                # 3. O_R += P0 V0_R (SS; P0 from WG0's smem), then release P1 to WG0
                cute.arch.barrier(barrier_id=int(Barrier.P0_READY), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, wg, wtid, j, 4)
                if cutlass.const_expr(fp8):
                    o11 = self.mma_ops(c, 1)
                    self.pv(pv8, acc_o8, o11.tOsP8[0], o11.tOrVt[0], _K32)
                else:
                    o12 = self.mma_ops(c, 1)
                    self.pv(pv_ss, acc_o, o12.tOsP[0], o12.tOrV[0])
                warpgroup.commit_group()
                cute.arch.barrier_arrive(barrier_id=int(Barrier.P1_READY), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, wg, wtid, j, 5)
                warpgroup.wait_group(1)  # 4. refills as the PVs retire: B1 (own PV), B0 (cross PV, read P0 too)
                if more:
                    self.refill(tAs1, tAg, tma_atom, mbar + 3, pgB1, wtid, (4, 5, 6, 7), Barrier.REFILL_B1)
                warpgroup.wait_group(0)
                self.mark(mTrace, cta, wg, wtid, j, 6)
                if more:
                    self.refill(tAs0, tAg, tma_atom, mbar + 1, pgB0, wtid, (4, 5, 6, 7, 8), Barrier.REFILL_B0)
                    self.landed(mbar + 3, ph)  # 5. next QK on slot 1: own B1 first, then WG0's A1 (0..255 + rope)
                    self.mark(mTrace, cta, wg, wtid, j, 7)
                    o13 = self.mma_ops(c, 1)
                    self.qk_chunks(qk_mma, acc_s, o13.tSrQ, o13.tSrK[1], (4, 5, 6, 7), True)
                    self.landed(mbar + 2, ph)
                    o14 = self.mma_ops(c, 1)
                    self.qk_chunks(qk_mma, acc_s, o14.tSrQ, o14.tSrK[1], (0, 1, 2, 3, 8), False)
                    warpgroup.commit_group()
                self.next_qk_retired(mTrace, cta, wg, wtid, j, 8, more, w32, zrow, 1, t1, split_end)

        self.epilogue_barrier(c, b)  # ---- epilogue (every QK retired: O reuses the Q tile's smem)
        row_m = cute.make_rmem_tensor((2,), Float32)  # both WGs' O and l are relative to the final shared max
        for h in cutlass.range_constexpr(2):
            row_m[h] = sM[row_in[h]]
            if cutlass.const_expr(fp8):  # O and l both carry P's 2^8 (exp_rows): O / l needs nothing, the LSE
                row_m[h] = row_m[h] - self.p8_bias  # (row max + log2 l) takes it out of the max
        stage = (sQ.iterator, self.block_m * self.D * (1 if fp8 else 2))  # O leaves via sQ (64 x 576 e4m3 / 16-bit)
        self.epilogue(ss_thr, acc_o, row_m, row_l, row_in, sSum, c.mOut, c.mLse, c.mOacc, c.mLacc, c.out_scale,
                      mblk, split, b, wg, wtid, stage)


__all__ = ["MlaDecodeSeesawSm90", "acc_to_a_layout"]
