"""FP8 MLA decode for Hopper, rows split between the warpgroups: each owns 32 query rows and all 512 features.

The O^T loop (:mod:`~tokenspeed_jax.kernels.sm90.mla_decode_ot`, FP8 P V modes 5-7) removes mode 4's ``V^T`` copy
(``O^T = V^T P^T``, ``V^T`` the register A operand loaded from the landed e4m3 staging), but its seesaw splits the
512 output features between the two warpgroups, so with 64 query rows each warpgroup holds the ``O^T`` of 256
features x 64 rows (128 registers) next to P and ``V^T`` of two tiles, and ptxas spilled.  On 32-row tiles (mode 7)
it fits, but each 32-row tile is its own CTA and reads the KV again (0.64-0.79x mode 4 with 64 or more rows).

This loop (FP8 P V mode "8") keeps a 64-row block per CTA and one KV stream, and splits the *rows* as FA3 does:

* warpgroup ``w`` computes query rows ``32 w .. 32 w + 31`` of the block over every KV tile, with no exchange with
  the other warpgroup: ``S^T (64 tokens x 32 rows) = K Q_w^T`` (the staging as the A operand, the warpgroup's 32 q
  rows as B; 16 accumulators), a column softmax (the 4 warps exchange column maxima through 512 bytes of shared
  memory), ``P^T`` stored as the K-major B operand (2 KB per warpgroup), and ``O^T (512 x 32) += V^T P^T`` as
  16 m64n32k32 QGMMAs with ``V^T`` from registers (the O^T loop's :meth:`load_vt`), in 4 sets of 128 features whose A
  fragments (16 registers) alternate between two buffers (``wait_group(1)`` before a buffer is reloaded).
  ``O^T`` is 128 registers, as in mode 4.
* The row statistics of a column are the same in every thread that holds it, so the running max, the O rescale
  (skipped when every scale of the warp is 1) and the LSE need no shared memory at all.
* Each warpgroup overlaps its own next QK with its softmax (FA3's intra-warpgroup overlap, :meth:`rs_step`): the
  retired ``S^T`` is copied out (16 moves) and the next tile's QK issued into the accumulators before the softmax.
  The two warpgroups run independently otherwise: turns on the tensor cores (FA3's ping-pong, two named barriers)
  measured no faster on the H200 and were dropped.
* KV: a ring of :attr:`stages` e4m3 staging buffers (36 KB each) with a full and an empty mbarrier each.  The
  producer warpgroup (24 registers, ``setmaxnreg``) loads tile ``i`` into buffer ``i % stages`` once the computing
  warpgroups released tile ``i - stages``: each warp's lane 0 arrives on the empty mbarrier once the warpgroup's QK of that tile retired
  and its PV was issued (the PV reads ``V^T`` from registers and P from its own tile, not the staging), behind a
  proxy fence for its ``ldmatrix`` reads.  With 4 stages an SM has up to 4 tiles (144 KB) in
  flight, where the seesaw loops free both slots in the same iteration (docs/sm90_decode.md, "Gaps", item 1).
* No L2 prefetch: the ring already loads 3 tiles ahead.
* Masking without per-column limits (:meth:`key_ok`): 8 limits live through the loop made ptxas spill.
* With S x H <= 32 the second warpgroup's rows would all be padding: the CTA is then warpgroup 0 and the producer
  (256 threads, no ``setmaxnreg``; :attr:`consumers`).

Per tile the tensor work is mode 4's (the QK on 64 x 64 x 576, the PV on 64 x 512 x 64), without the ``V^T``
transposes and without the seesaw's cross-warpgroup barriers.  Shared memory: Q 36 KB + 4 x 36 KB + P 4 KB + 2 KB
of column statistics.  The contract, grid (64-row blocks), plan, split-KV partials, combine kernel, precision (P as
``2^8 p`` in e4m3, row sums over the unrounded P) and the bounds rules (page ids clamped, keys past the split
masked in S with a select, V rows past the split read from a zero row) are the O^T loop's.  FP8 (e4m3) only,
TMA refills with pages >= 32.

Status (H200, 2026-12-01/02, docs/sm90_decode.md, "Row-split loop"): correct on its first GPU run (the check matrix's
FP8 cases, compute-sanitizer memcheck 0 errors, the GPU tests of modes 5/7/8) and **slower than mode 4**: 0.81-0.94x on
the 9 shapes of the issue matrix with more than 32 rows (one computing warpgroup for S x H <= 32: 0.94-1.03x mode 6's
O^T loop), unchanged by the ping-pong turns, the ring depth (2, 4, 5) or the intra-warpgroup overlap, i.e. bound by a
throughput, not a latency: shared-memory bandwidth.  Both warpgroups read
the whole K and V tile (and the QK's SS QGMMA with N = 32 reads 3 KB of operands per instruction), about 250 KB per
64-row tile against mode 4's 215 KB, and the issue-rate benchmark (``benchmarks/qgmma_rate.py``) shows QGMMA operand
reads and ``ldmatrix`` sharing 80-100 bytes per cycle in such mixes.  So it is opt-in
(``TOKENSPEED_SM90_DECODE_FP8_PV=8``, or ``9`` for S x H <= 32 only), not the default.
"""

from __future__ import annotations

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, cute
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from tokenspeed_jax.kernels.sm90.helpers import LOG2_E, Barrier
from tokenspeed_jax.kernels.sm90.mla_decode_ot import (
    _ALL_CHUNKS,
    _CHUNK,
    _CHUNK_BYTES,
    _STG_BYTES,
    MlaDecodeOtSm90,
    ot_feature,
)

_F8 = cutlass.Float8E4M3FN
_ROWS = 32  # query rows per warpgroup
_P_BYTES = _ROWS * 64  # a warpgroup's e4m3 P^T tile (32 rows x 64 tokens)
_SETS = 4  # PV sets of 128 features (2 m-blocks) per tile


class MlaDecodeRsSm90(MlaDecodeOtSm90):
    """FP8 MLA decode with the rows split between the warpgroups (module docstring).  Same arguments as the seesaw
    class plus ``stages`` (the KV ring's buffers); FP8 only."""

    def __init__(self, *, stages: int = 4, **kw):
        kw.pop("qk_t", None)
        super().__init__(qk_t=True, **kw)
        self.schedule = "rowsplit-ot"
        self.block_m = 2 * _ROWS
        self.num_m_blocks = -(-self.R // self.block_m)
        self.pv_n = _ROWS
        if stages not in (2, 3, 4, 5):
            raise ValueError(f"stages: expected 2..5 KV buffers, got {stages}")
        self.stages = stages
        # computing warpgroups: with S x H <= 32 the second one's rows would all be padding, so it is left out (the
        # CTA is warpgroup 0 and the producer; no setmaxnreg: 256 threads have all the registers they can use)
        self.consumers = 1 if self.R <= _ROWS else 2
        self.cta_threads = 128 * (self.consumers + 1)

    # ------------------------------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, stream, q: cute.Tensor, kv: cute.Tensor, block_table: cute.Tensor, seq_lens: cute.Tensor,
                 softmax_scale: cute.Tensor, output_scale: cute.Tensor, out: cute.Tensor, lse: cute.Tensor,
                 o_accum: cute.Tensor = None, lse_accum: cute.Tensor = None):
        K = warpgroup.OperandMajorMode.K
        q_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.block_m, self.block_n, self.D), _F8, 1)
        # S^T (tokens x the warpgroup's 32 rows) = K (staging, A) Q_w^T (B)
        qk_mma = sm90_utils.make_trivial_tiled_mma(_F8, _F8, K, K, Float32, (1, 1, 1), (self.block_n, _ROWS))
        qk_mma0 = sm90_utils.make_trivial_tiled_mma(_F8, _F8, K, K, Float32, (1, 1, 1), (self.block_n, _ROWS))
        # O^T (features x rows) += V^T (registers) P^T (smem, K-major): one m64n32k32 per 64 features and 32 tokens
        pv_mma = sm90_utils.make_trivial_tiled_mma(_F8, _F8, K, K, Float32, (1, 1, 1), (_CHUNK, _ROWS),
                                                   a_source=warpgroup.OperandSource.RMEM)
        self.pv_mma_repr = str(pv_mma)
        tma_atom, tma_kv = self.kv_tma(kv)

        @cute.struct
        class Storage:
            full: cute.struct.MemRange[Int64, self.stages]  # a tile landed (TMA transaction bytes)
            empty: cute.struct.MemRange[Int64, self.stages]  # the computing warpgroups read it (their warps arrive)
            red: cute.struct.MemRange[Float32, 2 * 2 * 4 * 32]  # per warpgroup, tile parity, warp: column maxima / sums
            sQ: cute.struct.Align[cute.struct.MemRange[_F8, cute.cosize(q_layout)], 1024]
            stg: cute.struct.Align[cute.struct.MemRange[_F8, self.stages * _STG_BYTES], 1024]
            p: cute.struct.Align[cute.struct.MemRange[_F8, 2 * _P_BYTES], 1024]
            zero_row: cute.struct.Align[cute.struct.MemRange[Int32, 4], 16]  # V rows past the split

        self.rs_kernel(qk_mma, qk_mma0, pv_mma, q, kv, block_table, seq_lens, softmax_scale, output_scale, out, lse, o_accum,
                       lse_accum, q_layout, tma_atom, tma_kv, Storage).launch(
            grid=(self.num_m_blocks, self.num_splits, q.shape[0]), block=(self.cta_threads, 1, 1),
            smem=Storage.size_in_bytes(), stream=stream, min_blocks_per_mp=1, use_pdl=self.pdl_main)
        if cutlass.const_expr(self.num_splits > 1):
            self.launch_combine(stream, o_accum, lse_accum, output_scale, out, lse, q.shape[0])

    # ---------------------------------------------------------------------------------------- device
    def stg_at(self, stg_ptr, k):
        """e4m3 staging ``(64 tokens, (64, 9 chunks))`` of ring buffer ``k`` (static or dynamic)."""
        layout = cute.make_layout((self.block_n, (_CHUNK, self.D // _CHUNK)), stride=(_CHUNK, (1, _CHUNK_BYTES)))
        return cute.make_tensor(cute.recast_ptr(stg_ptr + k * _STG_BYTES, self._swz()), layout)

    def p_at(self, p_ptr, wg):
        """Warpgroup ``wg``'s ``P^T`` tile: ``(store view (tokens in P8_TOKEN_ORDER, rows), operand view (rows,
        token positions))``, the O^T loop's ``qk_t`` views on 32 rows."""
        ptr = cute.recast_ptr(p_ptr + wg * _P_BYTES, self._swz())
        store = cute.make_layout(((2, 4, 2, self.block_n // 16), _ROWS), stride=((1, 4, 2, 16), self.block_n))
        return (cute.make_tensor(ptr, store),
                cute.make_tensor(ptr, cute.make_layout((_ROWS, self.block_n), stride=(self.block_n, 1))))

    @cute.jit
    def key_ok(self, tok: Int32, g: Int32, split_end: Int32, i: cutlass.Constexpr):
        """Whether key ``tok`` is unmasked for this thread's column ``i``: ``tok < split_end`` and, causal, ``tok <
        seq - S + 1 + s`` with ``s = row // H`` the query token of row ``row = row0 + 8 (i // 2) + i % 2``, i.e.
        ``(tok - seq + S) H - row0 <= 8 (i // 2) + i % 2`` (``g`` is that left side, one per key): no per-column
        limits stay live through the loop (8 of them made ptxas spill)."""
        ok = tok < split_end
        if cutlass.const_expr(self.causal):
            ok = ok & (g <= 8 * (i // 2) + i % 2)
        return ok

    @cute.jit
    def col_reduce(self, vals: cute.Tensor, sRed: cute.Tensor, use_max: cutlass.Constexpr, wg: Int32, wtid: Int32):
        """Reduce each of this thread's 8 column values over the column's 8 lanes and the warpgroup's 4 warps (max
        or sum) through ``sRed`` (this warpgroup's and tile parity's 4 x 32 floats) and the warpgroup's barrier;
        ``vals`` is overwritten with the totals (the same in every thread of a column)."""
        lane = wtid % 32
        warp = wtid // 32
        for i in cutlass.range_constexpr(_ROWS // 4):
            v = vals[i]
            for off in cutlass.range_constexpr(3):
                o = cute.arch.shuffle_sync_bfly(v, offset=4 << off)
                v = cute.arch.fmax(v, o) if cutlass.const_expr(use_max) else v + o
            if lane < 4:
                sRed[warp * 32 + self.col_n(i, wtid)] = v
        cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)
        for i in cutlass.range_constexpr(_ROWS // 4):
            n = self.col_n(i, wtid)
            t = sRed[n]
            for w in cutlass.range_constexpr(1, 4):
                t = cute.arch.fmax(t, sRed[w * 32 + n]) if cutlass.const_expr(use_max) else t + sRed[w * 32 + n]
            vals[i] = t

    @cute.jit
    def softmax_rs(self, acc_s, tScS, lims, tile_start, scale_log2, mrun, sRed, row_l, sc, wg, wtid):
        """Mask (``lims``: ``(seq, split_end, row0)``, :meth:`key_ok`) and scale ``S^T`` (exp2 domain), fold the
        tile's column maxima into the running max ``mrun`` (registers), ``sc`` = the rescale of the previous state,
        the row sums rescaled, then ``2^8 P`` in place."""
        seq, split_end, row0 = lims
        mx = cute.make_rmem_tensor((_ROWS // 4,), Float32)
        for i in cutlass.range_constexpr(_ROWS // 4):
            mx[i] = -Float32.inf
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            i = e % 2 + 2 * (e // 4)
            v = acc_s[e] * scale_log2
            tok = tile_start + tScS[e][0]
            if not self.key_ok(tok, (tok - seq + self.S) * self.H - row0, split_end, i):
                v = -Float32.inf
            acc_s[e] = v
            mx[i] = cute.arch.fmax(mx[i], v)
        self.col_reduce(mx, sRed, True, wg, wtid)
        ref = cute.make_rmem_tensor((_ROWS // 4,), Float32)
        for i in cutlass.range_constexpr(_ROWS // 4):
            mrun[i], ref[i], sc[i] = self.fold_max(mrun[i], mx[i])
            row_l[i] = row_l[i] * sc[i]
        self.exp_t(acc_s, ref, row_l)

    @cute.jit
    def scale_rs(self, accs, sc: cute.Tensor):
        """``O^T[:, n] *= sc[n]`` for this thread's 8 columns; nothing when every scale of the warp is 1."""
        one = sc[0] == 1.0
        for i in cutlass.range_constexpr(1, _ROWS // 4):
            one = one & (sc[i] == 1.0)
        if not cute.arch.vote_all_sync(one):
            for h in cutlass.range_constexpr(_SETS):
                for e in cutlass.range_constexpr(cute.size(accs[h])):
                    accs[h][e] = accs[h][e] * sc[e % 2 + 2 * ((e // 4) % 4)]

    @cute.jit
    def qk_rs(self, qk_mmas, acc_s: cute.Tensor, tSrK: cute.Tensor, tSrQ: cute.Tensor):
        """Issue ``S^T = K Q_w^T`` (no commit): the first k32 step overwrites the accumulators (``qk_mmas[0]``, its
        ACCUMULATE field off; ``qk_mmas[1]`` accumulates), so no instruction defines them between the wgmmas (a
        zero fill there made ptxas serialize every wgmma of the loop)."""
        warpgroup.fence()
        for k in cutlass.range_constexpr(self.D // 32):
            cute.gemm(qk_mmas[min(k, 1)], acc_s, tSrK[None, None, k], tSrQ[None, None, k], acc_s)

    @cute.kernel
    def rs_kernel(self, qk_mma: cute.TiledMma, qk_mma0: cute.TiledMma, pv_mma: cute.TiledMma, mQ: cute.Tensor, mKV: cute.Tensor,
                  mBT: cute.Tensor, mSeq: cute.Tensor, mSS: cute.Tensor, mOS: cute.Tensor, mOut: cute.Tensor,
                  mLse: cute.Tensor, mOacc: cute.Tensor, mLacc: cute.Tensor, q_layout: cute.ComposedLayout,
                  tma_atom: cute.CopyAtom, tma_kv: cute.Tensor, Storage: cutlass.Constexpr):
        tid, mblk, split, b, wg, wtid, st = self.cta_start(Storage)
        bn = self.block_n
        ns = self.stages
        sQ = st.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        full = st.full.data_ptr()
        empty = st.empty.data_ptr()
        stg = st.stg.data_ptr()

        num_pages = mKV.shape[0]
        seq, split_start, split_end = self.split_range(mBT, mSeq, b, split)
        n_tiles = Int32(0)
        if split_end > split_start:
            n_tiles = (split_end - split_start + bn - 1) // bn
        if tid == 0:
            for i in cutlass.range_constexpr(ns):
                cute.arch.mbarrier_init(full + i, 1)
                cute.arch.mbarrier_init(empty + i, 4 * self.consumers)
            cpasync.prefetch_descriptor(tma_atom)
        if tid < 4:
            st.zero_row.get_tensor(cute.make_layout(4))[tid] = Int32(0)
        cute.arch.mbarrier_init_fence()
        if wg < 2:  # the e4m3 q tile (64 rows), by the first 256 threads (with one computing warpgroup, the producer too)
            self.load_q_tile(sQ[None, None, 0], mQ, mblk, b, tid)
        cute.arch.barrier()  # mbarriers initialised before any arrive

        gKV = cute.group_modes(cute.local_tile(tma_kv, (self.box_rows, _CHUNK), (None, None, None)), 0, 2)
        tAs, tAg = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(
            cute.local_tile(self.stg_at(stg, 0), (self.box_rows, _CHUNK), (None, None)), 0, 2), gKV)
        if wg == self.consumers:  # the producer fills the ring
            for k in cutlass.range_constexpr(ns):
                if k < n_tiles:
                    t0 = split_start + k * bn
                    crd = self.coords(mBT, b, t0, split_end, num_pages, wtid)
                    dst = cute.make_tensor(tAs.iterator + k * _STG_BYTES, tAs.layout)
                    self.refill(None, dst, tAg, tma_atom, full + k, mKV, crd, t0, split_end, num_pages, wg, wtid,
                                _ALL_CHUNKS, None)
        cute.arch.fence_view_async_shared()  # q (generic stores) before the QGMMAs read it
        cute.arch.barrier()

        if wg == self.consumers:
            if cutlass.const_expr(self.consumers == 2):
                cute.arch.setmaxregister_decrease(self.producer_regs)
            if wtid < 32:  # tile i into buffer i % ns once the computing warpgroups released tile i - ns
                for j in cutlass.range(n_tiles - ns, unroll=1):
                    i = j + ns
                    k = i % ns
                    t0 = split_start + i * bn
                    crd = self.coords(mBT, b, t0, split_end, num_pages, wtid)
                    dst = cute.make_tensor(tAs.iterator + k * _STG_BYTES, tAs.layout)
                    cute.arch.mbarrier_wait(empty + k, (j // ns) % 2)
                    self.refill(None, dst, tAg, tma_atom, full + k, mKV, crd, t0, split_end, num_pages, wg, wtid,
                                _ALL_CHUNKS, None)
        else:
            if cutlass.const_expr(self.consumers == 2):
                cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume_rs(qk_mma, qk_mma0, pv_mma, sQ, st, wg, wtid, mblk, split, b, seq, split_start, split_end, n_tiles,
                            full, empty, mSS[0] * LOG2_E, mOS[0], mOut, mLse, mOacc, mLacc)

    @cute.jit
    def consume_rs(self, qk_mma, qk_mma0, pv_mma, sQ, st, wg, wtid, mblk, split, b, seq, split_start, split_end, n_tiles,
                   full, empty, scale_log2, out_scale, mOut, mLse, mOacc, mLacc):
        """One computing warpgroup: its 32 rows over every tile of the split (module docstring), then its epilogue."""
        bn = self.block_n
        stg = st.stg.data_ptr()
        zero = st.zero_row.data_ptr().toint()
        p_store, p_op = self.p_at(st.p.data_ptr(), wg)
        red = st.red.get_tensor(cute.make_layout(2 * 2 * 128))
        qk_thr = qk_mma.get_slice(wtid)
        pv_thr = pv_mma.get_slice(wtid)
        tSrQ = qk_thr.make_fragment_B(qk_thr.partition_B(cute.local_tile(sQ[None, None, 0], (_ROWS, self.D),
                                                                         (wg, 0))))
        acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((bn, _ROWS)))
        tScS = qk_thr.partition_C(cute.make_identity_tensor((bn, _ROWS)))
        tSsP = qk_thr.partition_C(p_store)
        accs = []
        for h in cutlass.range_constexpr(_SETS):  # O^T, 128 features each
            t = pv_thr.make_fragment_C(pv_thr.partition_shape_C((2 * _CHUNK, _ROWS)))
            t.fill(0.0)
            accs.append(t)
        a_layout = pv_thr.make_fragment_A(pv_thr.partition_shape_A((2 * _CHUNK, bn))).layout
        a_regs = [cute.make_rmem_tensor((16,), Int32), cute.make_rmem_tensor((16,), Int32)]
        tA = [cute.make_tensor(cute.recast_ptr(a_regs[x].iterator, dtype=_F8), a_layout) for x in range(2)]
        tB = pv_thr.make_fragment_B(pv_thr.partition_B(p_op))
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        qk_mmas = (qk_mma0, qk_mma)
        qk_mma0.set(warpgroup.Field.ACCUMULATE, False)
        qk_mma.set(warpgroup.Field.ACCUMULATE, True)

        nc = _ROWS // 4  # this thread's columns (query rows)
        mrun = cute.make_rmem_tensor((nc,), Float32)
        row_l = cute.make_rmem_tensor((nc,), Float32)
        sc = cute.make_rmem_tensor((nc,), Float32)
        for i in cutlass.range_constexpr(nc):
            mrun[i] = -Float32.inf
            row_l[i] = 0.0
        s_w = cute.make_rmem_tensor_like(acc_s)  # this tile's S^T, copied out while the next QK writes acc_s

        # QK of tile 0, retired here: a wgmma group still pending where the loop starts made ptxas serialize every
        # wgmma of the loop (C7515)
        if n_tiles > 0:
            cute.arch.mbarrier_wait(full, 0)
            self.qk_rs(qk_mmas, acc_s, qk_thr.make_fragment_A(qk_thr.partition_A(self.stg_at(stg, 0))), tSrQ)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
        ctx = (qk_mmas, qk_thr, tSrQ, pv_mma, accs, tA, a_regs, tB, tScS, tSsP, (mblk, seq), mrun, row_l, sc, red, stg,
               zero, full, empty, split_start, split_end, scale_log2, wg, wtid)
        for i in cutlass.range(n_tiles, unroll=1):
            self.rs_step(i, n_tiles, acc_s, s_w, ctx)
        warpgroup.wait_group(0)
        self.epilogue_rs(accs, mrun, row_l, red, mOut, mLse, mOacc, mLacc, out_scale, mblk, split, b, wg, wtid,
                         n_tiles)

    @cute.jit
    def rs_step(self, i: Int32, n_tiles: Int32, acc_s: cute.Tensor, s_cur: cute.Tensor, ctx):
        """Tile ``i`` of one warpgroup (its S^T in ``acc_s``, retired): copied to ``s_cur``, and the next tile's QK into
        ``acc_s`` first, so it runs under this tile's softmax (FA3's intra-warpgroup overlap; a second accumulator
        alternating with the first would need the loop unrolled by two, whose guarded second half made ptxas
        serialize the wgmmas, C7520); then P, the O^T rescale once the previous PV retired, this tile's PV in 4
        sets, and the buffer's release.  Groups pending on entry: the previous PV's last two sets (retired first: ptxas
        serializes every wgmma when the accumulators are read or rescaled while any wgmma group is pending, C7514 /
        C7515); on exit: this PV's last two."""
        (qk_mmas, qk_thr, tSrQ, pv_mma, accs, tA, a_regs, tB, tScS, tSsP, (mblk, seq), mrun, row_l, sc, red, stg, zero,
         full, empty, split_start, split_end, scale_log2, wg, wtid) = ctx
        bn = self.block_n
        ns = self.stages
        k = i % ns
        t0 = split_start + i * bn
        warpgroup.wait_group(0)  # the previous PV retired
        s_cur.store(acc_s.load())
        if i + 1 < n_tiles:
            k1 = (i + 1) % ns
            cute.arch.mbarrier_wait(full + k1, ((i + 1) // ns) % 2)
            self.qk_rs(qk_mmas, acc_s, qk_thr.make_fragment_A(qk_thr.partition_A(self.stg_at(stg, k1))), tSrQ)
        warpgroup.commit_group()  # (an empty group after the last tile: the waits below count the same)
        sRed = cute.make_tensor(red.iterator + (wg * 2 + i % 2) * 128, cute.make_layout(128))
        row0 = mblk * self.block_m + _ROWS * wg + 2 * (wtid % 4)  # this thread's first column's query row
        self.softmax_rs(s_cur, tScS, (seq, split_end, row0), t0, scale_log2, mrun, sRed, row_l, sc, wg, wtid)
        warpgroup.wait_group(0)  # the next QK retired (ptxas serializes the wgmmas if O^T is rescaled while any runs)
        self.store_p8(s_cur, tSsP)
        self.scale_rs(accs, sc)
        cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)  # all of P stored
        sk = stg.toint() + k * _STG_BYTES
        for h in cutlass.range_constexpr(_SETS):
            if cutlass.const_expr(h >= 2):
                warpgroup.wait_group(1)  # set h - 2 retired: its A registers are free
            # V^T of features 128 h .. 128 h + 127 (m-blocks 2 h, 2 h + 1; word 4 mb + 8 kb + r)
            self.load_vt(a_regs[h % 2], sk, zero, t0, split_end, 2 * h, wtid, n_mb=2)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(bn // 32):
                cute.gemm(pv_mma, accs[h], tA[h % 2][None, None, kb], tB[None, None, kb], accs[h])
            warpgroup.commit_group()
        # this warpgroup is done with buffer k: its QK retired, and the PV reads V^T from registers (the ldmatrix
        # loads above) and P from the P tile; the proxy fence orders those reads before the refill's TMA
        cute.arch.fence_view_async_shared()
        cute.arch.sync_warp()
        if wtid % 32 == 0:
            cute.arch.mbarrier_arrive(empty + k)

    @cute.jit
    def epilogue_rs(self, accs, mrun, row_l, red, mOut, mLse, mOacc, mLacc, out_scale, mblk, split, b, wg, wtid,
                    n_tiles):
        """Column sums (lanes, warps), the LSE (by warp 0's lanes 0..3, one per row) and ``O = O^T^T / l`` from the
        accumulators: thread ``(warp w, lane 4q + c)`` holds features ``f, f + 1`` (:func:`ot_feature`) of its 8
        rows, one 2-element store each."""
        # (the thread's rows re-derived from the indices: ptxas otherwise keeps the loop's copies of them live through
        # the loop, and spilled one)
        tid, _, _ = cute.arch.thread_idx()
        wtid = tid % 128
        mblk, _, _ = cute.arch.block_idx()
        sRed = cute.make_tensor(red.iterator + (wg * 2 + n_tiles % 2) * 128, cute.make_layout(128))
        self.col_reduce(row_l, sRed, False, wg, wtid)
        lane = wtid % 32
        for i in cutlass.range_constexpr(_ROWS // 4):
            n = self.col_n(i, wtid)
            r = mblk * self.block_m + _ROWS * wg + n
            l_tot = row_l[i]
            if wtid < 4:
                self.store_lse(mLse, mLacc, mrun[i], l_tot, r, split, b)
            inv = Float32(0.0)
            if l_tot > 0.0:
                inv = 1.0 / l_tot
            if r < self.R:
                for h in cutlass.range_constexpr(_SETS):
                    for mb in cutlass.range_constexpr(2):
                        f = ot_feature(0, 2 * h + mb, wtid // 32, lane // 4)  # and f + 1 (accumulator row q + 8)
                        self.store_ot_pair(accs[h], i % 2 + 4 * (i // 2) + 16 * mb, inv, out_scale, mOut, mOacc, b,
                                           split, r, f)


@cute.jit
def launch_mla_decode_rs(stream, q: cute.Tensor, kv: cute.Tensor, block_table: cute.Tensor, seq_lens: cute.Tensor,
                         softmax_scale: cute.Tensor, output_scale: cute.Tensor, out: cute.Tensor, lse: cute.Tensor,
                         o_accum: cute.Tensor = None, lse_accum: cute.Tensor = None, *, dtype: cutlass.Constexpr,
                         num_heads: cutlass.Constexpr, q_len: cutlass.Constexpr, page_size: cutlass.Constexpr,
                         causal: cutlass.Constexpr, num_splits: cutlass.Constexpr,
                         tokens_per_split: cutlass.Constexpr, block_n: cutlass.Constexpr = 64,
                         schedule: cutlass.Constexpr = "seesaw", pdl: cutlass.Constexpr = True,
                         stages: cutlass.Constexpr = 4, kv_evict: cutlass.Constexpr = "normal",
                         pdl_main: cutlass.Constexpr = False):
    """FFI launch function of the row-split loop (FP8 P V mode "8"; same ABI as ``launch_mla_decode_seesaw``;
    ``schedule`` is the backend's, always "seesaw" here)."""
    MlaDecodeRsSm90(dtype=dtype, num_heads=num_heads, q_len=q_len, page_size=page_size, causal=causal,
                    num_splits=num_splits, tokens_per_split=tokens_per_split, block_n=block_n, pdl=pdl,
                    l2_prefetch="off", stages=stages, kv_evict=kv_evict, pdl_main=pdl_main)(
        stream, q, kv, block_table, seq_lens, softmax_scale, output_scale, out, lse, o_accum, lse_accum)


__all__ = ["MlaDecodeRsSm90", "launch_mla_decode_rs"]
