"""FP8 MLA decode for Hopper with the P V transposed: ``O^T = V^T P^T``, ``V^T`` the register A operand.

8-bit wgmmas read only K-major smem operands, so ``O += P V`` needs ``V^T`` in smem (the FP8 seesaw's); not here:

* ``O^T (512 x rows) = V^T (512 x tokens) P^T (tokens x rows)``: ``V^T`` is the register A operand (8-bit ones may come
  from anywhere), loaded from the landed e4m3 staging by ``ldmatrix.x4.trans`` + 4 ``prmt.b32`` per 16 features x 32
  tokens (:func:`vt_a_row_offset`, :data:`VT_A_SELECTORS`); P is the K-major B operand, tokens in
  :data:`~.fp8_operands.P8_TOKEN_ORDER` in each 16-token group (the ``ldmatrix.trans`` word order).  Each warpgroup
  (WG0, WG1) owns 256 output features: 4 m64nNk32 QGMMAs (one per 64 features, N the query rows) per 32 tokens.
* A fragment row ``q`` of a warp's 16 is feature ``2q``, row ``q + 8`` feature ``2q + 1`` (:func:`ot_feature`): a pair's
  features sit in one thread, stored from the accumulators as one bf16x2 (fp32x2 for split partials).
* O rescales are per ``O^T`` column, from the row scales in smem; skipped when a warp's are all 1 (the steady state).
* Buffers: the staging lives until both PVs read it, so each warpgroup has two, 4 x (36 KB staging + 4 KB P) + 36 KB Q =
  196 KB; pair ``j`` uses buffers ``2 (j % 2) + {0, 1}``, refilled with pair ``j + 2`` once both its PVs retired.
* Barriers (:class:`~.helpers.Barrier`): SCALE0 / SCALE1 / P0_READY / P1_READY and TAIL as in the seesaw loop.
  SLOT0_FREE / SLOT1_FREE (160 threads: WG1 arrives, the producer's warp syncs): WG1 knows when a buffer's PVs both
  retired: slot 0 after its cross PV (WG0's own PV retired before its P0_READY, which that cross PV waited for); slot 1
  after its own PV and a sync on VT1_FREE, where WG0 arrives once its cross PV of slot 1 retired.  WG1 arrives for pair
  ``j`` only once pair ``j + 1`` landed, loaded after the producer synced on pair ``j - 1``'s arrivals: no arrival
  overtakes the producer's sync of the previous one.  Each warpgroup waits on the (completed) mbarrier phase of the
  other's tile before its ``ldmatrix`` reads it, and proxy-fences its reads before the arrivals freeing it for the TMA.
* Registers: this class runs 64-row blocks (S x H > 32, ``pv_n`` 64): 128 accumulators, 32 of S, 32 of ``V^T`` fit in
  240 registers with one ``V^T`` fragment set (WG1 retires its own PV before loading the cross ``V^T``, WG0 its cross PV
  before the next QK retires), 8 32-bit P words a thread (:meth:`MlaDecodeFp8TransposedPvSm90.store_p_tile`), and WG0
  rescaling P0 for WG1 in smem (e4m3), not holding its fp32 P over the own PV
  (:meth:`MlaDecodeFp8TransposedPvSm90.rescale_p_tile`: rounded twice where a row's max grew in WG1's tile).
* QK early: WG0 issues the next pair's QK right behind its own PV, to run during WG1's softmax (for the last pair too,
  on stale staging, its S thrown away: a wgmma inside the dynamic ``if`` made ptxas serialize every wgmma, C7520).  WG1
  releases P1 right after its P1 store and ``O^T *= scales``, so WG0's cross PV need not wait for WG1's own PV.
* ``qk_t`` (subclass in :mod:`.fp8_transposed`): ``S^T = K Q^T`` too (A: the staging as it lands, B: the first ``pv_n``
  q rows) on 32-row tiles (the planner's ``block_m=32`` plan); a query row's keys lie in all 4 warps, so the softmax
  exchanges each warp's column maxima through 1 KB of smem (:meth:`~.transposed_out.TransposedOutMixin.fold_t`).

Same contract, grid, split-KV partials and combine kernel as the seesaw loop; FP8 (e4m3) only; the producer warpgroup's
TMA refills need pages >= 32.  P is rounded to e4m3 as ``2^8 p``, the row sums over the unrounded P.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, cute
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from tokenspeed_jax.kernels.sm90.decode_common import MlaDecodeSm90
from tokenspeed_jax.kernels.sm90.decode_trace import TRACE_EVENTS, DecodeTraceMixin
from tokenspeed_jax.kernels.sm90.fp8_operands import _ldsm4t, _prmt, store_p8, sw64
from tokenspeed_jax.kernels.sm90.helpers import LOG2_E, Barrier, clear_nan_e4m3x4
from tokenspeed_jax.kernels.sm90.kv_refill import KvRefillMixin
from tokenspeed_jax.kernels.sm90.transposed_out import TransposedOutMixin

_F8 = cutlass.Float8E4M3FN
_CHUNK = 64  # features per e4m3 staging chunk (64-byte rows)
_CHUNK_BYTES = 64 * _CHUNK  # 64 tokens x 64 bytes
_P_BYTES = 64 * 64  # the e4m3 P tile of a buffer (64 rows x 64 tokens)
_STG_BYTES = 9 * _CHUNK_BYTES  # the e4m3 staging of a 64-token tile (576 columns)
_BUF_BYTES = _P_BYTES + _STG_BYTES  # one buffer: [P | staging]; 40960, a multiple of the swizzle's 512
_NBUF = 4  # two per warpgroup (pair j: buffers 2 (j % 2) + {0, 1})
_ALL_CHUNKS = (0, 1, 2, 3, 4, 5, 6, 7, 8)
_MIN_PAGE = 32  # the producer's coordinates (pages of 16: 4 boxes per chunk) spill in its 24 registers
_MAX_ROWS = 32  # query rows S x H (module docstring, "Registers")

# DecodeTraceMixin.mark points per warpgroup (time spent since the previous event); "-" unused.  64-row blocks: WG0
# skips marks 1, 2, 9, 10 (softmax: 3, "own PV" has the next QK's issue, "QK retired" the cross PV's issue + retire)
TRACE_EVENTS_OT = (
    ("top", "top"),
    ("column maxima + TAIL", "wait SCALE0 (WG0's max)"),
    ("fold (shared max, scale)", "column maxima + TAIL"),
    ("exp, SCALE0 out", "fold (shared max, scale), SCALE1 out"),
    ("P store + TAIL, O^T *= scale0", "exp"),
    ("own PV (V^T loads, issue, retire)", "P store + TAIL, O^T *= scales"),
    ("wait SCALE1 (WG1's max)", "own PV (V^T loads, issue)"),
    ("rescale + store P, O^T *= scale1", "cross V^T loads + wait P0_READY"),
    ("cross V^T loads + wait P1_READY", "cross PV issue, P1_READY out"),
    ("cross PV issue + wait next pair landed", "own + cross PV retired"),
    ("QK issue + cross PV retired", "wait next pair landed, SLOT0_FREE out"),
    ("QK retired", "QK issue + retired"),
    ("-", "wait VT1_FREE, SLOT1_FREE out"),
)
assert len(TRACE_EVENTS_OT) == len(TRACE_EVENTS)

# prmt.b32 selectors turning a thread's ldmatrix.trans pair (tokens 2c, 2c+1 | 2c+8, 2c+9 of feature pair q) into
# the words of feature 2q (bytes 0 and 2 of each) and feature 2q + 1 (bytes 1 and 3)
VT_A_SELECTORS = (0x6420, 0x7531)


def vt_a_row_offset(lane, warp, kb):
    """Swizzled byte offset (4 KB staging chunk) of lane ``lane``'s row, warp ``warp``, in the ``ldmatrix.x4.trans`` of
    k32 step ``kb``: token ``32 kb + lane``, the warp's 16 features from byte ``16 warp``; Python ints or DSL Int32."""
    return sw64((32 * kb + lane) * _CHUNK + 16 * warp)


def ot_feature(wg, mb, warp, row):
    """Output feature of accumulator row ``row`` (0..15) of warp ``warp``, m-block ``mb``, warpgroup ``wg``."""
    return 256 * wg + 64 * mb + 16 * warp + 2 * (row % 8) + row // 8


# P stored by 32-bit words (without qk_t): a thread's word (h, g) is row 16 warp + lane // 4 + 8 h, positions 16 g + 4c
# to 16 g + 4c + 3 (c = lane % 4; P8_TOKEN_ORDER: tokens 2c, 2c+1, 2c+8, 2c+9 of 16-token group g; accumulator elements:
# p8_word_elements), built by one prmt (P8_WORD_SELECTORS[h]) of the thread's e4m3 words 2g, 2g+1 (elements 8g to 8g+7)
P8_WORD_SELECTORS = (0x5410, 0x7632)


def p8_word_elements(h, g):
    """The QK accumulator elements (``e = v0 + 2 v1 + 4 v2``: row half ``v1``, column ``8 v2 + 2 (lane % 4) + v0``)
    in bytes 0..3 of P word ``(h, g)`` (above)."""
    return (8 * g + 2 * h, 8 * g + 2 * h + 1, 8 * g + 4 + 2 * h, 8 * g + 5 + 2 * h)


def p8_word_offset(lane, warp, h, g):
    """Swizzled P-tile byte offset of P word ``(h, g)`` of lane ``lane``, warp ``warp`` (Python ints or DSL Int32)."""
    return sw64((16 * warp + lane // 4 + 8 * h) * 64 + 16 * g + 4 * (lane % 4))


def _lds32(addr):
    """``ld.shared.b32`` at the shared address ``addr``."""
    return cute.arch.inline_ptx("ld.shared.b32 {$w0}, [{$r0}];", write_only_types=[Int32],
                                read_only_args=[Int32(addr)])


def _sts32(addr, v):
    """``st.shared.b32`` of ``v`` at the shared address ``addr``."""
    cute.arch.inline_ptx("st.shared.b32 [{$r0}], {$r1};", read_only_args=[Int32(addr), Int32(v)])


class MlaDecodeFp8TransposedPvSm90(TransposedOutMixin, KvRefillMixin, DecodeTraceMixin, MlaDecodeSm90):
    """``O^T = V^T P^T``, 64-row blocks (module docstring).  Arguments: the base's + ``qk_t`` (transposed QK)."""

    pair_step = 1  # output features of an O^T accumulator row pair q, q + 8 (store_ot_pair): f and f + 1

    def __init__(self, *, qk_t: bool = False, **kw):
        super().__init__(**kw)
        if not self.fp8:
            raise ValueError(f"the O^T loop needs float8_e4m3fn inputs, got {self.dtype_name}")
        if self.page_size < _MIN_PAGE:
            raise ValueError(f"the O^T loop needs page_size >= {_MIN_PAGE}, got {self.page_size}")
        # the producer warpgroup issues every refill (24 registers; the computing warpgroups get 240)
        self.producer = True
        self.cta_threads = self.num_threads + 128
        # qk_t: S^T = K Q^T, the pv_n query rows as N, on 32-row tiles (block_m; the planner's block_m=32 plan)
        self.qk_t = bool(qk_t)
        if self.qk_t:
            self.block_m = _MAX_ROWS
            self.num_m_blocks = -(-self.R // self.block_m)
        # the PVs' query rows (O^T's N): 16 / 32 for S x H <= 32 (padded rows need no P V), else 64 ("Registers")
        self.pv_n = 16 if self.R <= 16 else (32 if self.R <= _MAX_ROWS or self.qk_t else 64)

    # ------------------------------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, stream, q: cute.Tensor, kv: cute.Tensor, block_table: cute.Tensor, seq_lens: cute.Tensor,
                 softmax_scale: cute.Tensor, output_scale: cute.Tensor, sched_cta: cute.Tensor, sched_req: cute.Tensor,
                 out: cute.Tensor, lse: cute.Tensor, o_accum: cute.Tensor, lse_accum: cute.Tensor,
                 trace_buf: cute.Tensor = None):
        K = warpgroup.OperandMajorMode.K
        q_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.block_m, self.block_n, self.D), _F8, 1)
        if cutlass.const_expr(self.qk_t):  # S^T (tokens x rows) = K (staging, A) Q^T (the first pv_n q rows, B)
            qk_mma = sm90_utils.make_trivial_tiled_mma(_F8, _F8, K, K, Float32, (1, 1, 1), (self.block_n, self.pv_n))
        else:
            qk_mma = sm90_utils.make_trivial_tiled_mma(_F8, _F8, K, K, Float32, (1, 1, 1),
                                                       (self.block_m, self.block_n))
        # O^T (features x rows) += V^T (registers) P^T (smem, K-major): one m64n64k32 per 64 features and 32 tokens
        pv_mma = sm90_utils.make_trivial_tiled_mma(_F8, _F8, K, K, Float32, (1, 1, 1), (_CHUNK, self.pv_n),
                                                   a_source=warpgroup.OperandSource.RMEM)
        self.pv_mma_repr = str(pv_mma)  # (its TV layouts, which load_vt / scale_ot / epilogue_ot assume: the CPU test)
        tma_atom, tma_kv = self.kv_tma(kv)

        @cute.struct
        class Storage:
            mbar: cute.struct.MemRange[Int64, _NBUF]  # one per buffer
            row_max: cute.struct.MemRange[Float32, 64]
            scale0: cute.struct.MemRange[Float32, 64]
            scale1: cute.struct.MemRange[Float32, 64]
            row_sum: cute.struct.MemRange[Float32, 2 * 64]
            sQ: cute.struct.Align[cute.struct.MemRange[_F8, cute.cosize(q_layout)], 1024]
            bufs: cute.struct.Align[cute.struct.MemRange[_F8, _NBUF * _BUF_BYTES], 1024]
            zero_row: cute.struct.Align[cute.struct.MemRange[Int32, 4], 16]  # V rows past the split
            # S^T (qk_t): per warpgroup and warp, column maxima / sums
            red: cute.struct.Align[cute.struct.MemRange[Float32, 2 * 4 * 32], 16]

        main = self.ot_kernel(qk_mma, pv_mma, q, kv, block_table, seq_lens, softmax_scale, output_scale, sched_cta,
                              out, lse, o_accum, lse_accum, trace_buf, q_layout, tma_atom, tma_kv, Storage)
        self.launch_main(main, Storage.size_in_bytes(), stream, output_scale, sched_cta, sched_req, out, lse, o_accum,
                         lse_accum)

    # ---------------------------------------------------------------------------------------- device
    def _swz(self):
        return sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.block_m, self.block_n, _CHUNK), _F8, 1).inner

    def stg_view(self, bufs_ptr, k):
        """e4m3 staging ``(64 tokens, (64, 9 chunks))`` of buffer ``k`` (static or dynamic): the QGMMA B layout
        the TMA boxes land in (64-byte rows, 64-byte swizzle), chunks 4 KB apart."""
        layout = cute.make_layout((self.block_n, (_CHUNK, self.D // _CHUNK)), stride=(_CHUNK, (1, _CHUNK_BYTES)))
        return cute.make_tensor(cute.recast_ptr(bufs_ptr + (k * _BUF_BYTES + _P_BYTES), self._swz()), layout)

    def p_views(self, bufs_ptr, k):
        """Buffer ``k``'s e4m3 P tile as ``(store view, operand view)``: the QK accumulator is stored through the first
        (P8_TOKEN_ORDER in 16-token groups), the PV reads the second as K-major B ``(pv_n rows, 64 tokens)``."""
        ptr = cute.recast_ptr(bufs_ptr + k * _BUF_BYTES, self._swz())
        store = cute.make_layout((self.block_m, (2, 4, 2, self.block_n // 16)), stride=(self.block_n, (1, 4, 2, 16)))
        return (cute.make_tensor(ptr, store),
                cute.make_tensor(ptr, cute.make_layout((self.pv_n, self.block_n), stride=(self.block_n, 1))))

    def p_store(self, qk_thr, bufs, k):
        """QK accumulator partition of buffer ``k``'s P store view (``qk_t``: both ``S^T``, (tokens, rows))."""
        if cutlass.const_expr(self.qk_t):
            ptr = cute.recast_ptr(bufs + k * _BUF_BYTES, self._swz())
            view = cute.make_tensor(ptr, cute.make_layout(((2, 4, 2, self.block_n // 16), self.pv_n),
                                                          stride=((1, 4, 2, 16), self.block_n)))
        else:
            view = self.p_views(bufs, k)[0]
        return qk_thr.partition_C(view)

    @cute.jit
    def store_p_tile(self, acc_s: cute.Tensor, qk_thr, bufs, k, wtid: Int32):
        """P (fp32 x 2^8) -> e4m3 in buffer ``k``'s P tile, fenced for wgmma: with ``qk_t`` via :meth:`p_store`, else by
        8 32-bit stores a thread (:data:`P8_WORD_SELECTORS`), not 32 view byte stores (~20 address registers)."""
        if cutlass.const_expr(self.qk_t):
            store_p8(acc_s, self.p_store(qk_thr, bufs, k))
        else:
            rP8 = cute.make_rmem_tensor_like(acc_s, _F8)
            rP8.store(acc_s.load().to(_F8))
            w = cute.make_tensor(cute.recast_ptr(rP8.iterator, dtype=Int32), cute.make_layout(8))
            base = bufs.toint() + k * _BUF_BYTES
            lane = wtid % 32
            for h in cutlass.range_constexpr(2):
                for g in cutlass.range_constexpr(4):
                    _sts32(base + p8_word_offset(lane, wtid // 32, h, g),
                           _prmt(w[2 * g], w[2 * g + 1], Int32(P8_WORD_SELECTORS[h])))
            cute.arch.fence_view_async_shared()

    @cute.jit
    def rescale_p_tile(self, bufs, k, sc: cute.Tensor, wtid: Int32):
        """WG0's P0 (buffer ``k``'s P tile) times its rows' ``scale1`` (``sc``: this thread's 2 rows) for WG1's cross
        PV, in its e4m3 words (:func:`p8_word_offset`; "Registers").  Nothing for a warp whose 16 rows all have scale 1
        (steady state, P exact); else its words are rounded to e4m3 twice (docs/sm90_decode.md, "FP8 error bounds")."""
        if not cute.arch.vote_all_sync(self.all_one(sc)):
            base = bufs.toint() + k * _BUF_BYTES
            lane = wtid % 32
            for h in cutlass.range_constexpr(2):
                for g in cutlass.range_constexpr(4):
                    addr = base + p8_word_offset(lane, wtid // 32, h, g)
                    r = cute.make_rmem_tensor((1,), Int32)
                    r[0] = _lds32(addr)
                    f8 = cute.make_tensor(cute.recast_ptr(r.iterator, dtype=_F8), cute.make_layout(4))
                    f8.store((f8.load().to(Float32) * sc[h]).to(_F8))
                    _sts32(addr, r[0])
        cute.arch.fence_view_async_shared()  # (every iteration, for warpgroup 1's cross PV)

    def qk_tile(self, qk_mma, qk_thr, acc_s, tSrQ, bufs, k):
        """Issue buffer ``k``'s QK (no commit): ``S = Q K^T``, with ``qk_t`` ``S^T = K Q^T`` (staging A, q B)."""
        stg = self.stg_view(bufs, k)
        if cutlass.const_expr(self.qk_t):
            self.qk_chunks(qk_mma, acc_s, qk_thr.make_fragment_A(qk_thr.partition_A(stg)), tSrQ, _ALL_CHUNKS, True)
        else:
            self.qk_chunks(qk_mma, acc_s, tSrQ, qk_thr.make_fragment_B(qk_thr.partition_B(stg)), _ALL_CHUNKS, True)

    def p_operand(self, pv_thr, bufs, k):
        """Buffer ``k``'s ``P^T`` (K-major PV B operand), built at use: at the loop top it spilled in the softmax."""
        return pv_thr.make_fragment_B(pv_thr.partition_B(self.p_views(bufs, k)[1]))

    @cute.jit
    def load_vt(self, a: cute.Tensor, stg: Int32, zero: Int32, tile_start: Int32, split_end: Int32,
                chunk0: cutlass.Constexpr, wtid: Int32, n_mb: cutlass.Constexpr = 4):
        """``V^T`` A fragments of ``n_mb`` m-blocks (64 features each) from feature ``64 chunk0`` on, of one tile, from
        the e4m3 staging at smem address ``stg`` (``a``: ``8 n_mb`` words, word ``4 mb + 4 n_mb kb + r`` = register
        ``a_r`` of m-block ``mb``, k32 step ``kb``; this loop: a warpgroup's 256 features, ``chunk0`` 4 x warpgroup):
        per (mb, kb) one ``ldmatrix.x4.trans`` (:func:`vt_a_row_offset`) and 4 ``prmt``.  Lanes whose token is at or
        past ``split_end`` read the 16-byte zero row ``zero``: those V rows may hold anything (page tails, unowned NaN
        pages), P is 0 there.  Without ``qk_t``, NaN bytes -> 0 in the words of a tile holding keys ``hidden_keys``
        covers (``tail_from``; :func:`~.helpers.clear_nan_e4m3x4`), in each reader's registers: no warpgroup waits for
        another's cleaning; ``qk_t`` cleans its staging instead (``clean_fp8_tail``): each loop takes the way adding
        no spill to its main loop (docs/sm90_decode.md, "Causally hidden keys")."""
        if cutlass.const_expr(self.hidden_keys > 0 and not self.qk_t):
            if tile_start + self.block_n > self.tail_from(split_end):
                self.load_vt_words(a, stg, zero, tile_start, split_end, chunk0, wtid, n_mb, True)
            else:
                self.load_vt_words(a, stg, zero, tile_start, split_end, chunk0, wtid, n_mb, False)
        else:
            self.load_vt_words(a, stg, zero, tile_start, split_end, chunk0, wtid, n_mb, False)

    @cute.jit
    def load_vt_words(self, a: cute.Tensor, stg: Int32, zero: Int32, tile_start: Int32, split_end: Int32,
                      chunk0: cutlass.Constexpr, wtid: Int32, n_mb: cutlass.Constexpr, clean: cutlass.Constexpr):
        """:meth:`load_vt`'s loads; ``clean``: the NaN bytes of every loaded word -> 0."""
        lane = wtid % 32
        warp = wtid // 32
        s0, s1 = Int32(VT_A_SELECTORS[0]), Int32(VT_A_SELECTORS[1])
        for kb in cutlass.range_constexpr(2):
            addr = stg + vt_a_row_offset(lane, warp, kb) + chunk0 * _CHUNK_BYTES
            step = Int32(_CHUNK_BYTES)
            if 32 * kb + lane >= split_end - tile_start:
                addr, step = zero, Int32(0)
            for mb in cutlass.range_constexpr(n_mb):
                r = _ldsm4t(addr + mb * step)
                if cutlass.const_expr(clean):
                    r = [clear_nan_e4m3x4(x) for x in r]
                w = 4 * mb + 4 * n_mb * kb
                a[w + 0] = _prmt(r[0], r[1], s0)
                a[w + 1] = _prmt(r[0], r[1], s1)
                a[w + 2] = _prmt(r[2], r[3], s0)
                a[w + 3] = _prmt(r[2], r[3], s1)

    @cute.jit
    def pv_tile(self, pv_mma, pv_thr, acc, a, tA, bufs, stg0, k, zero, tile_start, split_end,
                chunk0: cutlass.Constexpr, wtid):
        """``O^T += V^T P^T`` for the tile in buffer ``k`` (``stg0``: the shared address of buffer 0's staging):
        :meth:`load_vt` into ``a`` (viewed as ``tA``), issue (:meth:`pv_ot`) and commit (the caller waits)."""
        self.load_vt(a, stg0 + k * _BUF_BYTES, zero, tile_start, split_end, chunk0, wtid)
        self.pv_ot(pv_mma, acc, tA, self.p_operand(pv_thr, bufs, k))
        warpgroup.commit_group()

    @cute.jit
    def pv_ot(self, mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor):
        """Issue ``O^T += V^T P^T`` for one tile (no commit): 2 k32 steps x 4 m-blocks."""
        warpgroup.fence()
        for kb in cutlass.range_constexpr(self.block_n // 32):
            cute.gemm(mma, acc, tA[None, None, kb], tB[None, None, kb], acc)

    @cute.kernel
    def ot_kernel(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, mQ: cute.Tensor, mKV: cute.Tensor,
                  mBT: cute.Tensor, mSeq: cute.Tensor, mSS: cute.Tensor, mOS: cute.Tensor, mCta: cute.Tensor,
                  mOut: cute.Tensor, mLse: cute.Tensor, mOacc: cute.Tensor, mLacc: cute.Tensor, mTrace: cute.Tensor,
                  q_layout: cute.ComposedLayout, tma_atom: cute.CopyAtom, tma_kv: cute.Tensor,
                  Storage: cutlass.Constexpr):
        """The persistent CTA ``(row block, g)``: producer and computing warpgroups walk the pieces (:meth:`run_pieces`)
        of its schedule range, each a whole run (Q load, first two pairs, loop, epilogue) between CTA barriers;
        mbarriers initialised once, their phase parity carried across pieces (:meth:`landed`)."""
        tid, mblk, g, wg, wtid, st = self.cta_start(Storage)
        self.phase_bits(st.mbar.data_ptr())
        sQ = st.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sM = st.row_max.get_tensor(cute.make_layout(64))
        mbar = st.mbar.data_ptr()
        bufs = st.bufs.data_ptr()

        num_pages = mKV.shape[0]
        self.init_mbarriers(st, tid, _NBUF, tma_atom)
        tAs, tAg = self.kv_partitions(tma_atom, tma_kv, [self.stg_view(bufs, k) for k in range(_NBUF)])
        cute.arch.barrier()  # mbarriers initialised before any arrive
        self.run_pieces(SimpleNamespace(
            tid=tid, mblk=mblk, g=g, wg=wg, wtid=wtid, st=st, mCta=mCta, mBT=mBT, mSeq=mSeq, mQ=mQ, mSS=mSS, mOS=mOS,
            mOut=mOut, mLse=mLse, mOacc=mOacc, mLacc=mLacc, mTrace=mTrace, mmas=(qk_mma, pv_mma), sQ=sQ, sM=sM,
            mbar=mbar, bufs=bufs, num_pages=num_pages, tAs=tAs, tAg=tAg, tma_atom=tma_atom))

    def advance_phases(self, n_pairs: Int32):
        """After a piece (:meth:`walk_pieces`): its phase flips (buffers 0, 1 hold the even pairs, 2, 3 the odd)."""
        ph = self.ph
        ph[0] = ph[0] ^ ((((n_pairs + 1) >> 1) & 1) * 3) ^ (((n_pairs >> 1) & 1) * 12)

    @cute.jit
    def produce_start(self, c, b, split_start, split_end, n_pairs):
        """The producer's first loads of a piece (``run_piece``): pairs 0 and 1 into buffers 0..3."""
        tAs, tAg, tma_atom, mbar, mBT, num_pages, wtid = c.tAs, c.tAg, c.tma_atom, c.mbar, c.mBT, c.num_pages, c.wtid
        for k in cutlass.range_constexpr(_NBUF):
            t0 = split_start + k * self.block_n
            if k < 2 or n_pairs > 1:
                crd = self.coords(mBT, b, t0, split_end, num_pages)
                self.refill(tAs[k], tAg, tma_atom, mbar + k, crd, wtid, _ALL_CHUNKS, None)

    @cute.jit
    def produce_rest(self, c, b, split_start, split_end, n_pairs):
        """The producer's refills after the Q tile: pair j's buffers 2 (j % 2) + g, once both its PVs retired
        (SLOT*_FREE), with pair j + 2 (buffers 2 + g: buffer g's TMA destination, 2 buffers on; unrolled by pairs
        instead, the loop spilled one of the 24 registers)."""
        tAs, tAg, tma_atom, mbar, mBT, num_pages, wtid = c.tAs, c.tAg, c.tma_atom, c.mbar, c.mBT, c.num_pages, c.wtid
        bn = self.block_n
        if wtid < 32:
            for j in cutlass.range(n_pairs - 2, unroll=1):
                u = j % 2
                for g in cutlass.range_constexpr(2):
                    t0 = split_start + (2 * j + 4 + g) * bn
                    crd = self.coords(mBT, b, t0, split_end, num_pages)
                    dst = cute.make_tensor(tAs[g].iterator + u * (2 * _BUF_BYTES), tAs[g].layout)
                    cute.arch.barrier(barrier_id=int(Barrier.SLOT0_FREE) + g, number_of_threads=160)
                    self.refill(dst, tAg, tma_atom, mbar + 2 * u + g, crd, wtid, _ALL_CHUNKS, None)

    @cute.jit
    def consume(self, c, cta, b, seq, split_start, split_end, split, n_pairs):
        """The computing warpgroups on 64-row blocks (:meth:`walk_pieces`, after the Q tile): first QK, the loop (module
        docstring), epilogue; ``c``: :meth:`ot_kernel`'s values, ``cta`` for :meth:`mark` (:data:`TRACE_EVENTS_OT`)."""
        scale_log2, out_scale = c.mSS[0] * LOG2_E, c.mOS[0]  # (loaded once a piece)
        qk_mma, pv_mma = c.mmas
        sQ, st, bufs, wg, wtid, mblk, mbar, mTrace = c.sQ, c.st, c.bufs, c.wg, c.wtid, c.mblk, c.mbar, c.mTrace
        bn = self.block_n
        sM = st.row_max.get_tensor(cute.make_layout(64))
        sSc0 = st.scale0.get_tensor(cute.make_layout(64))
        sSc1 = st.scale1.get_tensor(cute.make_layout(64))
        sSum = st.row_sum.get_tensor(cute.make_layout(128))
        zero = st.zero_row.data_ptr().toint()
        stg0 = bufs.toint() + _P_BYTES  # shared address of buffer 0's staging
        qk_thr = qk_mma.get_slice(wtid)
        pv_thr = pv_mma.get_slice(wtid)
        sRed = st.red.get_tensor(cute.make_layout(2 * 4 * 32))
        tSrQ = qk_thr.make_fragment_A(qk_thr.partition_A(sQ[None, None, 0]))
        acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((self.block_m, bn)))
        tScS = qk_thr.partition_C(cute.make_identity_tensor((self.block_m, bn)))
        acc = pv_thr.make_fragment_C(pv_thr.partition_shape_C((self.DV // 2, self.pv_n)))  # O^T, 256 features
        acc.fill(0.0)
        a_layout = pv_thr.make_fragment_A(pv_thr.partition_shape_A((self.DV // 2, bn))).layout
        # one V^T fragment set for the own and the other tile: each PV retires before the next V^T loads ("Registers")
        a_own = cute.make_rmem_tensor((32,), Int32)
        tA_own = cute.make_tensor(cute.recast_ptr(a_own.iterator, dtype=_F8), a_layout)
        a_x, tA_x = a_own, tA_own
        qk_mma.set(warpgroup.Field.ACCUMULATE, True)
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)

        row_in, lim = self.row_limits(tScS, mblk, seq, split_end)
        row_l = cute.make_rmem_tensor((2,), Float32)
        for i in cutlass.range_constexpr(2):
            row_l[i] = 0.0
        ref = cute.make_rmem_tensor((2,), Float32)
        sc = cute.make_rmem_tensor((2,), Float32)

        if n_pairs > 0:  # first QK: pair 0, buffer wg
            self.landed(mbar + wg, 0)
            self.qk_tile(qk_mma, qk_thr, acc_s, tSrQ, bufs, wg)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

        if wg == 0:
            for j in cutlass.range(n_pairs, unroll=1):
                u = j % 2
                more = j + 1 < n_pairs
                refill = j + 2 < n_pairs  # the producer refills this pair's buffers with pair j + 2
                t0 = split_start + 2 * j * bn
                self.mark(mTrace, cta, 0, wtid, j, 0)
                # 1. fold tile 2j into the shared max; P0; publish
                self.fold_first_max(acc_s, tScS, lim, t0, scale_log2, sM, sSc0, row_in, row_l, ref, sc, wtid)
                self.exp_rows(acc_s, ref, row_l)
                cute.arch.barrier_arrive(barrier_id=int(Barrier.SCALE0), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, 0, wtid, j, 3)
                # 2. P0 -> smem; TAIL (all rows' scale0); O^T *= scale0; O^T += V0^T P0^T, then the next QK ("QK early")
                self.store_p_tile(acc_s, qk_thr, bufs, 2 * u, wtid)
                cute.arch.barrier(barrier_id=int(Barrier.TAIL), number_of_threads=128)
                self.scale_ot(acc, sSc0, None, wtid)
                self.mark(mTrace, cta, 0, wtid, j, 4)
                self.pv_tile(pv_mma, pv_thr, acc, a_own, tA_own, bufs, stg0, 2 * u, zero, t0, split_end, 0, wtid)
                if more:
                    self.landed(mbar + 2 * (1 - u), ((j + 1) // 2) % 2)
                self.qk_tile(qk_mma, qk_thr, acc_s, tSrQ, bufs, 2 * (1 - u))
                warpgroup.commit_group()
                warpgroup.wait_group(1)  # (the own PV retired; the QK may still run)
                self.mark(mTrace, cta, 0, wtid, j, 5)
                # 3. WG1 folded tile 2j+1: rescale P0 (in smem, for WG1), l and O^T by scale1
                cute.arch.barrier(barrier_id=int(Barrier.SCALE1), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, 0, wtid, j, 6)
                for h in cutlass.range_constexpr(2):
                    sc[h] = sSc1[row_in[h]]
                    row_l[h] = row_l[h] * sc[h]
                self.rescale_p_tile(bufs, 2 * u, sc, wtid)  # (the own PV, which read P0, retired)
                cute.arch.barrier_arrive(barrier_id=int(Barrier.P0_READY), number_of_threads=self.num_threads)
                self.scale_ot(acc, sSc1, None, wtid)
                self.mark(mTrace, cta, 0, wtid, j, 7)
                # 4. O^T += V1^T P1^T (P1 from WG1); ldmatrix after a wait on the (completed) phase WG1 waited for
                self.landed(mbar + 2 * u + 1, (j // 2) % 2)
                self.load_vt(a_x, stg0 + (2 * u + 1) * _BUF_BYTES, zero, t0 + bn, split_end, 0, wtid)
                cute.arch.barrier(barrier_id=int(Barrier.P1_READY), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, 0, wtid, j, 8)
                self.pv_ot(pv_mma, acc, tA_x, self.p_operand(pv_thr, bufs, 2 * u + 1))
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                # 5. the cross PV (and the next QK) retired: WG1 may free slot 1 (VT1_FREE)
                if refill:
                    cute.arch.fence_view_async_shared()  # (the ldmatrix reads before the refill's TMA writes)
                    cute.arch.barrier_arrive(barrier_id=int(Barrier.VT1_FREE), number_of_threads=self.num_threads)
                warpgroup.wait_group(0)
                self.mark(mTrace, cta, 0, wtid, j, 11)
        else:
            for j in cutlass.range(n_pairs, unroll=1):
                u = j % 2
                more = j + 1 < n_pairs
                refill = j + 2 < n_pairs
                t1 = split_start + (2 * j + 1) * bn
                self.mark(mTrace, cta, 1, wtid, j, 0)
                # 1. after WG0: fold tile 2j+1 into the shared max; P1; publish
                cute.arch.barrier(barrier_id=int(Barrier.SCALE0), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, 1, wtid, j, 1)
                self.fold_second_max(acc_s, tScS, lim, t1, scale_log2, sM, sSc0, sSc1, row_in, row_l, ref, sc, wtid)
                cute.arch.barrier_arrive(barrier_id=int(Barrier.SCALE1), number_of_threads=self.num_threads)
                self.exp_rows(acc_s, ref, row_l)
                self.mark(mTrace, cta, 1, wtid, j, 4)
                # 2. P1 -> smem (both PVs read it); O^T *= scale0 * scale1; P1_READY (P1 fenced, scales read); own PV
                self.store_p_tile(acc_s, qk_thr, bufs, 2 * u + 1, wtid)
                cute.arch.barrier(barrier_id=int(Barrier.TAIL) + 1, number_of_threads=128)
                self.scale_ot(acc, sSc0, sSc1, wtid)
                cute.arch.barrier_arrive(barrier_id=int(Barrier.P1_READY), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, 1, wtid, j, 5)
                self.pv_tile(pv_mma, pv_thr, acc, a_own, tA_own, bufs, stg0, 2 * u + 1, zero, t1, split_end, 4, wtid)
                self.mark(mTrace, cta, 1, wtid, j, 6)
                # 3. O^T += V0^T P0^T (P0 from WG0; the tile's landing as in WG0)
                self.landed(mbar + 2 * u, (j // 2) % 2)
                warpgroup.wait_group(0)
                self.load_vt(a_x, stg0 + 2 * u * _BUF_BYTES, zero, t1 - bn, split_end, 4, wtid)
                cute.arch.barrier(barrier_id=int(Barrier.P0_READY), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, 1, wtid, j, 7)
                self.pv_ot(pv_mma, acc, tA_x, self.p_operand(pv_thr, bufs, 2 * u))
                warpgroup.commit_group()
                self.mark(mTrace, cta, 1, wtid, j, 8)
                # 4. both PVs retired: slot 0 free (WG0's own PV retired before P0_READY), announced once the next pair
                #    landed (module docstring); next QK; slot 1 free once WG0's cross PV retired too (VT1_FREE)
                warpgroup.wait_group(0)
                self.mark(mTrace, cta, 1, wtid, j, 9)
                if more:
                    self.landed(mbar + 2 * (1 - u) + 1, ((j + 1) // 2) % 2)
                    if refill:
                        cute.arch.fence_view_async_shared()
                        cute.arch.barrier_arrive(barrier_id=int(Barrier.SLOT0_FREE), number_of_threads=160)
                    self.mark(mTrace, cta, 1, wtid, j, 10)
                    self.qk_tile(qk_mma, qk_thr, acc_s, tSrQ, bufs, 2 * (1 - u) + 1)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                    self.mark(mTrace, cta, 1, wtid, j, 11)
                    if refill:
                        cute.arch.barrier(barrier_id=int(Barrier.VT1_FREE), number_of_threads=self.num_threads)
                        cute.arch.barrier_arrive(barrier_id=int(Barrier.SLOT1_FREE), number_of_threads=160)
                    self.mark(mTrace, cta, 1, wtid, j, 12)

        # ---- epilogue: both WGs' O^T and l relative to the final shared max (its 2^8 P bias taken out for the LSE)
        self.epilogue_barrier(c, b)
        self.epilogue_ot(acc, sM, row_l, row_in, sSum, sRed, c.mOut, c.mLse, c.mOacc, c.mLacc, out_scale, mblk,
                         split, b, wg, wtid)

    def acc_feature(self, wg, mb, warp, q):
        """Output feature of ``O^T`` accumulator row ``q`` (0..7; row ``q + 8`` is :meth:`store_ot_pair`'s second) of
        warp ``warp``, m-block ``mb``, warpgroup ``wg``: :func:`ot_feature`."""
        return ot_feature(wg, mb, warp, q)


__all__ = ["P8_WORD_SELECTORS", "TRACE_EVENTS_OT", "VT_A_SELECTORS", "MlaDecodeFp8TransposedPvSm90", "ot_feature",
           "p8_word_elements", "p8_word_offset", "vt_a_row_offset"]
