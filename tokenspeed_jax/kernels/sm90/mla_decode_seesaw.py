"""Absorbed-MLA paged decode for Hopper, schedule ``"seesaw"``: the two math warpgroups work out of phase.

Same contract, grid, split-KV partials, epilogue and combine kernel as :class:`MlaDecodeSm90` (this class
subclasses it and replaces only the main loop); bf16/fp16 inputs, and FP8 (e4m3) with TMA refills (below).

The ``"lockstep"`` schedule splits every 64-token KV tile between the two warpgroups (each computes QK^T for 32
tokens) and keeps them in lock step (three CTA-wide barriers per tile): the tensor cores idle during
every softmax, and each 64x32 QK wgmma re-reads Q from shared memory for half the tokens (profiled on the
H200: tensor pipe ~49% busy, 42% of warp time at barriers).  This schedule follows the structure of
FlashMLA's Hopper kernel (its "seesaw"; design read from its source, code our own):

* Two KV slots of 64 tokens.  Per iteration (a pair of tiles) warpgroup 0 owns tile ``2j`` in slot 0 and
  warpgroup 1 tile ``2j+1`` in slot 1 for ``S = Q K^T`` (64x64x576 wgmma, so Q is read from smem once per
  64 tokens).  O stays split by columns: WG0 holds ``O[:, :256]``, WG1 ``O[:, 256:]``, so every tile's
  ``P V`` is done by both warpgroups: each uses its own P from registers (RS wgmma) on its own tile and the
  other's P from shared memory (SS wgmma) on the other tile.
* One running row max shared through smem, updated in sequence: WG0 folds in tile 2j (``scale0``), then WG1
  folds in tile 2j+1 (``scale1``), and WG0 later rescales its P and O by ``scale1``.  So WG0's softmax runs
  under WG1's QK and WG1's softmax under WG0's PV: one warpgroup's CUDA-core work overlaps the other's
  tensor-core work.  Four named barriers (producer ``arrive``, consumer ``sync``) order the handoffs.
* P of a tile goes to smem in the 8 KB rope columns (512..575) of its own slot: only QK reads them and QK of
  that slot has retired.  No extra smem (Q 72 KB + 2 slots x 72 KB).
* KV refills are issued per column group as soon as the group's last reader retired, each group completing
  an mbarrier.  Two load paths, chosen at compile time (``kv_load``):
  - TMA (page sizes >= 16, the default): one 3-D descriptor over the cache ``(page_size, 576, num_pages)``,
    boxes of ``min(page_size, 64)`` rows x 64 columns (SW128, the layout of a 64-column chunk of a slot),
    ``64 / box rows`` boxes per chunk, issued by the first warp of the refilling warpgroup (the other warps
    arrive on a per-site named barrier first: their share of the freeing wgmma retired), lane 0 arriving
    with expect-tx on the group's mbarrier.  Page ids are clamped to ``[0, num_pages)`` and tokens into the
    split, so no box is ever out of bounds; rows of a partial last tile past the split may hold anything
    (page tails, unowned NaN pages): masked in S, and their V columns zeroed in smem by the slot's owner
    (:meth:`zero_tail`) before any PV reads them.  Measured 0.5-7% faster than cp.async on the H200.
  - cp.async gathers through the block table (page size 8, or ``kv_load="cp.async"``; per-token clamping as
    in the lockstep schedule; ``cp.async.mbarrier.arrive.noinc``, 128 arrivals).
  The groups:
    slot 0: A0 = cols 0..255 (WG0, after its own PV), B0 = cols 256..575 (WG1, after its cross PV, which
    also read P0 in the rope columns); slot 1: A1 = cols 0..255 + 512..575 (WG0, after its cross PV, which
    read P1), B1 = cols 256..511 (WG1, after its own PV).
  The next QK of a slot starts on the group its own warpgroup refilled first.  The block-table entries of
  a refill are loaded at the top of the iteration (:meth:`coords`), so the issue never waits on them.
  Measured on the H200 and removed: an L2 prefetch of the rows two pairs ahead (5-25% slower), and one
  TMA mbarrier per 64-column chunk so QK starts on the first chunk to land (faster on some memory-bound
  shapes, slower on compute-bound ones: 0.90x vs 0.92x FlashMLA geomean).
* L2 prefetch (TMA refills only; ``l2_prefetch``): one thread of the first row block issues
  ``cp.async.bulk.prefetch.L2`` for the tile pair after the next, one instruction per box-sized range of
  cache rows, either at the end of WG0's iteration (``"late"``: the rows wait in L2 from about the start
  of the iteration whose refills read them) or after WG0's own PV (``"early"``).  Measured on the H200
  (2026-12-01, docs/sm90_decode.md): ``"late"`` 6.9% faster for FP8 and 1.5% for BF16 (geometric means
  over the issue matrix), ``"early"`` up to 18% slower on memory-bound BF16 shapes.  Measured again with the
  loops of 2026-12-02 (producer warpgroups, the transposed and O^T loops, staged stores): ``"off"`` 1.06-1.14x
  ``"late"`` on the memory-bound 16-bit shapes and 1.025x (BF16) / 1.04x (FP8) in the geometric means, so
  ``"off"`` is the launch default since then (docs, "L2 prefetch off").
* A missing second tile (odd tile count) is computed as a fully masked tile on clamped, finite rows.
* FP8 (e4m3 q and cache; page sizes >= 16): the same loop, with QK^T on FP8 tensor cores (QGMMA
  m64n64k32, e4m3 x e4m3 -> fp32) and P V on fp16 operands.  The q tile stays e4m3 in smem (36 KB, 64-byte
  swizzle).  A cache refill lands raw: TMA boxes of 64-byte e4m3 rows in the QGMMA B layout, chunk ``c``
  in the upper half of the slot's fp16 chunk ``c`` (:meth:`staging`), which the QK reads directly.  After
  its QK retired, the slot's owner upcasts the V chunks 0..7 in place (:meth:`expand_v`: all reads of a
  chunk, a warpgroup barrier, then the writes; exact); the rope chunk stays e4m3 until P overwrites it.
  HBM traffic halves and the smem budget is the 16-bit one.  Products are exact in both matmuls
  (e4m3 x e4m3 and fp16 x fp16), but the QGMMA's fp32 accumulator keeps only about 14 bits per addition
  (measured on the H200: LSE errors up to 2.2e-3 against 1e-6 with the 16-bit QK; the check's FP8 LSE
  tolerance, ``benchmarks.decode.FP8_QK_ACC_EPS``, says why); P is rounded to fp16 (3 more bits than the
  bf16 of the 16-bit paths); bf16 output.  ``qk_fp8=False`` upcasts the whole slot before a 16-bit QK
  instead (the first FP8 seesaw, for A/B).  The FP8 scales are folded into ``softmax_scale`` /
  ``output_scale`` by the caller (decode contract).
* FP8 P V on FP8 tensor cores (``pv_fp8``): P is rounded to e4m3 (computed as ``2^8 p``; the row sums stay
  over the unrounded P) into the lower half of the rope chunk, the slot's owner transposes V into the lower
  halves of chunks 0..7 (:meth:`transpose_v`; byte permutes, conflict-free), and both PVs run as SS QGMMA
  (4 chunks x 2 k32 steps per half).  ``early_refill`` adds whole-slot refills right after the transpose
  (the staging is free then), one pair earlier than the column-group refills, with two barriers
  (VT0_FREE / VT1_FREE) guarding ``V^T`` and P against the other warpgroup's cross PV.  Measured on the H200
  (2026-12-01, docs/sm90_decode.md): both together 10.2% faster than the fp16 P V (geometric mean over
  the issue matrix), with output errors 7-13x the bf16 output rounding (the check's FP8_P_ROUND bound).
  (A build whose wgmmas ptxas serialized, C7520, measured the same; the CPU compile test bounds the
  WARPGROUP.DEPBAR count.)
* ``vt_packed`` (the backend's default): each slot packed as ``[V^T 32 KB | P 4 KB | staging 36 KB]``, so a
  warpgroup's ``V^T`` half is one K-major operand and each PV is 2 QGMMA m64n256k32; the transpose runs on
  ``ldmatrix.trans`` + ``prmt`` + ``stmatrix`` with tokens permuted inside 16-token groups (P stored in the same
  order; :meth:`transpose_v_packed`).  10.3% faster than without, bitwise the same output (H200, 2026-12-01).
* ``tma_producer`` (the backend's default for FP8 with early refills and for 16-bit with pages >= 32): a third
  warpgroup whose first warp issues every TMA refill (:meth:`produce`), so no computing warp stalls on a TMA
  issue (700-1200 cycles per refill in the FP8 timeline of 2026-12-01); ``setmaxnreg`` gives it 24 registers and
  the computing warpgroups 240 each.  The computing warpgroups' refill sites become arrivals on 160-thread
  barriers (the 16-bit loop's REFILL_* sites; the FP8 loop's SLOT0_FREE / SLOT1_FREE after the owner's
  transpose), which the producer's warp syncs on before it issues.  Measured on the H200 (2026-12-01,
  docs/sm90_decode.md): FP8 1.108x, BF16 1.055x, bitwise the same output.
"""

from __future__ import annotations

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, cute
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from tokenspeed_jax.kernels.sm90.decode_trace import TRACE_EVENTS, DecodeTraceMixin
from tokenspeed_jax.kernels.sm90.fp8_operands import Fp8OperandsMixin
from tokenspeed_jax.kernels.sm90.helpers import LOG2_E, Barrier, quad_max, row_ptr
from tokenspeed_jax.kernels.sm90.kv_refill import _CHUNK, KV_EVICT_MODES, KvRefillMixin
from tokenspeed_jax.kernels.sm90.mla_decode import MlaDecodeSm90

_K16 = 16  # wgmma K of 16-bit operands
_K32 = 32  # wgmma K of 8-bit operands
_F8 = cutlass.Float8E4M3FN
_ALL_CHUNKS = (0, 1, 2, 3, 4, 5, 6, 7, 8)
_MIN_TMA_PAGE = 16  # smaller pages load with cp.async (TMA would need > 4 boxes per chunk)
L2_PREFETCH_MODES = ("off", "late", "early")  # MlaDecodeSeesawSm90.l2_prefetch_tile


def acc_to_a_layout(acc_layout: cute.Layout) -> cute.Layout:
    """Layout of a 16-bit wgmma accumulator fragment ``((2, 2, N/8), M, N)`` viewed as the register A
    operand of a following wgmma: ``((2, 2, 2), M, (N/16, N))`` (pairs of 8-column groups form one K=16
    step; the value order within a thread is the same)."""
    d = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    return cute.make_layout(
        ((d.shape[0][0], d.shape[0][1], d.shape[0][2][0]), d.shape[1], (d.shape[0][2][1], d.shape[2])),
        stride=((d.stride[0][0], d.stride[0][1], d.stride[0][2][0]), d.stride[1],
                (d.stride[0][2][1], d.stride[2])),
    )


class MlaDecodeSeesawSm90(Fp8OperandsMixin, KvRefillMixin, DecodeTraceMixin, MlaDecodeSm90):
    """Schedule "seesaw" of the sm90 decode kernel (module docstring).  Same arguments as the base class;
    16-bit dtypes, ``block_n`` 64."""

    def __init__(self, *, kv_load: str = "auto", qk_fp8: bool = True, pv_fp8: bool = False,
                 early_refill: bool = False, vt_packed: bool = False, tma_producer: bool = False, expand_group: int = 4,
                 l2_prefetch: str = "off", kv_evict: str = "normal", cross_first: bool = False, p_stsm: bool = False,
                 o_staged: bool = False, trace: int = 0, **kw):
        kw["schedule"] = "lockstep"
        super().__init__(**kw)
        # FP8: QK^T on FP8 tensor cores (e4m3 x e4m3 -> fp32, QGMMA k32) straight from the raw q tile and the
        # landed e4m3 staging; only V (cols 0..511) is upcast, after the QK (module docstring).  False: the
        # whole slot is upcast and QK runs on fp16 operands.
        self.qk8 = bool(self.fp8 and qk_fp8)
        # FP8: P V on FP8 tensor cores too (P rounded to e4m3, V transposed in smem; :meth:`transpose_v`)
        if pv_fp8 and not self.qk8:
            raise ValueError("pv_fp8 needs FP8 inputs and qk_fp8 (the QGMMA QK)")
        self.pv8 = bool(pv_fp8)
        # FP8 P V: the owner refills its whole slot right after building V^T (the staging is free once the QK and
        # the transpose read it), a pair earlier than the column-group refills after the PVs
        if early_refill and not self.pv8:
            raise ValueError("early_refill needs pv_fp8")
        self.early = bool(early_refill)
        # FP8 P V: each slot packed as [V^T 32 KB | P 4 KB | e4m3 staging 36 KB] instead of V^T and staging in the
        # lower / upper halves of the fp16-sized chunks: V^T of a warpgroup's 256 features is one K-major operand,
        # so each PV is 2 QGMMA m64n256k32 (P read once per k-step), and the transpose runs on ldmatrix.trans /
        # stmatrix with tokens permuted inside 16-token groups (P8_TOKEN_ORDER, P written in the same order)
        if vt_packed and not self.pv8:
            raise ValueError("vt_packed needs pv_fp8")
        self.vt_packed = bool(vt_packed)
        # pairs ahead of iteration j that its L2 prefetch loads: j + 2 (iteration j refills pair j + 1), with the
        # early refills j + 3 (iteration j refills pair j + 2)
        self.pf_ahead = 3 if self.early else 2
        # P is computed as 2^8 p with FP8 P V (max 256 < 448, e4m3's largest finite), so p down to 2^-14 stays
        # a normal e4m3 number (3 mantissa bits) and down to 2^-17 a subnormal; 2^-8 undone before the epilogue
        self.p8_bias = 8.0 if self.pv8 else 0.0
        # chunks upcast per warpgroup barrier (:meth:`expand_chunks`): all their reads, one barrier, all writes
        self.expand_group = expand_group
        if self.block_n != 64:
            raise ValueError(f"schedule 'seesaw' needs block_n 64, got {self.block_n}")
        if kv_load not in ("auto", "tma", "cp.async"):
            raise ValueError(f"kv_load: expected 'auto', 'tma' or 'cp.async', got {kv_load!r}")
        tma_ok = self.page_size >= _MIN_TMA_PAGE  # power of two: divides 64 or is a multiple of it
        if kv_load == "tma" and not tma_ok:
            raise ValueError(f"kv_load 'tma' needs page_size >= {_MIN_TMA_PAGE}, got {self.page_size}")
        if self.fp8 and (not tma_ok or kv_load == "cp.async"):
            raise ValueError(f"schedule 'seesaw' with FP8 needs the TMA refills (page_size >= {_MIN_TMA_PAGE}), "
                             f"got page_size {self.page_size}, kv_load {kv_load!r}")
        self.use_tma = tma_ok and kv_load != "cp.async"
        # a third, producer warpgroup (24 registers; the two computing warpgroups get 240) issues every TMA refill,
        # so no computing warp stalls on a TMA issue (:meth:`produce`; docs/sm90_decode.md, "Producer warpgroup"):
        # the 16-bit loop (its four column-group refills) or the FP8 one with packed slots and early refills
        if tma_producer and not (self.use_tma and (self.vt_packed and self.early if self.fp8 else True)):
            raise ValueError("tma_producer needs the TMA refills and, with FP8, vt_packed and early_refill")
        self.producer = bool(tma_producer)
        self.cta_threads = self.num_threads + (128 if self.producer else 0)
        self.producer_regs, self.consumer_regs = 24, 240  # 2 x 128 x 240 + 128 x 24 = 384 x 168 (the launch's)
        if self.fp8:
            # e4m3 -> fp16 is exact and one cvt per 2 values (-> bf16 takes 3); fp16 also keeps 3 more bits of P
            # than bf16.  fp32 accumulation and softmax statistics; bf16 output (module docstring).
            self.mma_dtype = cutlass.Float16
        # L2 prefetch of the pair after the next one (:meth:`l2_prefetch_tile`): "off", "late" (at the end of WG0's
        # iteration j, i.e. just before the iteration whose refills load it) or "early" (after WG0's own PV)
        if l2_prefetch not in L2_PREFETCH_MODES:
            raise ValueError(f"l2_prefetch: expected one of {L2_PREFETCH_MODES}, got {l2_prefetch!r}")
        # TMA refills only: the cp.async loop (page 8) has no registers to spare (it spilled with it)
        self.l2_prefetch = l2_prefetch if self.use_tma else "off"
        # debug builds only (benchmarks/trace_decode.py): clock64 at the TRACE_EVENTS points of the first ``trace``
        # iterations of each warpgroup, by its thread 0, into an extra int64 output (:meth:`mark`, decode_trace.py)
        if trace < 0:
            raise ValueError(f"trace: expected the number of iterations to time (0: a normal build), got {trace}")
        self.trace = int(trace)
        # L2 eviction priority of the KV cache's TMA loads (:data:`KV_EVICT_MODES`): "first" marks the lines a refill
        # read as the first to evict (each is read once per row block, and the row blocks of a request read it at about
        # the same time), so they do not push out the rows the L2 prefetch brought in for later; "normal" sets no hint
        if kv_evict not in KV_EVICT_MODES:
            raise ValueError(f"kv_evict: expected one of {tuple(KV_EVICT_MODES)}, got {kv_evict!r}")
        self.kv_evict = kv_evict
        # 16-bit loop: warpgroup 1 issues its cross PV (slot 0, P0 from smem) before its own (slot 1, P1 from registers)
        # and publishes P1 as soon as it is stored, so slot 0's refill B0, which warpgroup 0's next QK waits for, is
        # issued one PV earlier (docs/sm90_decode.md, "The BF16 memory-bound gap", item 2: no faster); with the
        # producer warpgroup each of its warps issues one refill group, so no group waits behind one issued later
        if cross_first and self.fp8:
            raise ValueError("cross_first: only the 16-bit loop (FP8 runs its own P V order)")
        self.cross_first = bool(cross_first)
        # 16-bit loop: P to the peer's shared tile by ``stmatrix`` (4 x4 per tile and thread, :meth:`put_p`) instead of
        # 16 32-bit stores.  Both loops: the epilogue stages O through the Q tile's shared memory (free once every QK
        # retired) and stores 16-byte chunks (:meth:`MlaDecodeSm90.store_o_staged`) instead of 2- or 4-byte elements
        if p_stsm and self.fp8:
            raise ValueError("p_stsm: only the 16-bit loop (FP8 stores e4m3 P, store_p8)")
        self.p_stsm, self.o_staged = bool(p_stsm), bool(o_staged)
        self.box_rows = min(self.page_size, self.block_n)  # rows of one TMA box (one page or one tile)
        self.subs = self.block_n // self.box_rows  # boxes per 64-token tile and 64-column chunk
        self.schedule = "seesaw"

    # ------------------------------------------------------------------------------------------ host
    def _seesaw_layouts(self):
        dt = self.mma_dtype
        tile_qk = (self.block_m, self.block_n, self.D)
        q_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile_qk, _F8 if self.qk8 else dt, 1)
        k_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile_qk, dt, 2)
        v_layout = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (self.block_m, self.DV, self.block_n), dt, 1)
        p_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.block_m, self.DV // 2, self.block_n),
                                                 dt, 1)
        return q_layout, k_layout, v_layout, p_layout

    # floats of shared memory for column statistics in the loop's storage (``Storage.red``): none used here (4, the
    # smallest field); the transposed 16-bit loop's fold_t / epilogue_ot need 2 x 4 x 32
    red_floats = 4
    # the 64-column chunks of the 16-bit refill groups by mbarrier, A0 and B0 (slot 0), A1 and B1 (slot 1) (module
    # docstring, "The groups"): the rope chunk 8 goes with the group refilled after the last PV that read the P
    # stored there.  The prologue and the producer warpgroup's loop load these (this loop's own refill sites name the
    # same chunks); the transposed 16-bit loop may move P and with it chunk 8 (MlaDecodeOt16Sm90, pt_q).
    col_groups = ((0, 1, 2, 3), (4, 5, 6, 7, 8), (0, 1, 2, 3, 8), (4, 5, 6, 7))
    # one TMA mbarrier per 64-column chunk of each slot (18, after the 4 group mbarriers), so a QK waits chunk by
    # chunk: the transposed 16-bit loop's chunk_bars; this loop tried it on 2026-11-29 and dropped it (module docstring)
    chunk_bars = False

    @property
    def n_mbar(self) -> int:
        """The loop's mbarriers: the 4 column groups' (A0, B0, A1, B1), then with :attr:`chunk_bars` 9 per slot."""
        return 4 + (18 if self.chunk_bars else 0)

    def chunk_bar(self, mbar, slot: int):
        """With :attr:`chunk_bars`, the first of slot ``slot``'s 9 per-chunk mbarriers (chunk ``c`` at ``+ c``);
        else None (the refills complete their group's mbarrier)."""
        return mbar + 4 + 9 * slot if self.chunk_bars else None

    def seesaw_mmas(self):
        """``(qk_mma, pv_ss, pv_rs, pv8)`` of the loop (traced in ``__call__``): the QK, the P V with P from shared
        memory and from registers, and with FP8 P V the e4m3 P V (else None)."""
        dt = self.mma_dtype
        K, MN = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
        qk_dt = _F8 if cutlass.const_expr(self.qk8) else dt
        qk_mma = sm90_utils.make_trivial_tiled_mma(qk_dt, qk_dt, K, K, Float32, (1, 1, 1),
                                                   (self.block_m, self.block_n))
        pv_ss = sm90_utils.make_trivial_tiled_mma(dt, dt, K, MN, Float32, (1, 1, 1), (self.block_m, self.DV // 2))
        pv_rs = sm90_utils.make_trivial_tiled_mma(dt, dt, K, MN, Float32, (1, 1, 1), (self.block_m, self.DV // 2),
                                                  a_source=warpgroup.OperandSource.RMEM)
        # FP8 P V: e4m3 P (smem) x e4m3 V^T (smem, tokens contiguous), one 64-feature chunk per instruction, or with
        # packed slots the warpgroup's 256 features
        pv8 = None
        if cutlass.const_expr(self.pv8):  # packed V^T: one instruction spans the warpgroup's 256 features
            pv8 = sm90_utils.make_trivial_tiled_mma(_F8, _F8, K, K, Float32, (1, 1, 1),
                                                    (self.block_m, self.DV // 2 if self.vt_packed else _CHUNK))
        return qk_mma, pv_ss, pv_rs, pv8

    @cute.jit
    def __call__(self, stream, q: cute.Tensor, kv: cute.Tensor, block_table: cute.Tensor, seq_lens: cute.Tensor,
                 softmax_scale: cute.Tensor, output_scale: cute.Tensor, out: cute.Tensor, lse: cute.Tensor,
                 o_accum: cute.Tensor = None, lse_accum: cute.Tensor = None, trace_buf: cute.Tensor = None):
        dt = self.mma_dtype
        q_layout, k_layout, v_layout, p_layout = self._seesaw_layouts()
        qk_mma, pv_ss, pv_rs, pv8 = self.seesaw_mmas()
        tma_atom, tma_kv = None, None
        if cutlass.const_expr(self.use_tma):
            # (page_size, 576, num_pages) view of the cache; one box = box_rows x 64 columns, SW128 like a
            # 64-column chunk of a KV slot
            kv_t = cute.make_tensor(kv.iterator, cute.select(kv.layout, mode=[1, 2, 0]))
            if cutlass.const_expr(self.qk8):  # raw e4m3 rows in the QGMMA B layout (64-byte swizzle)
                box = cute.select(sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR,
                                                                (self.block_m, self.box_rows, _CHUNK), _F8, 1),
                                  mode=[0, 1])
            elif cutlass.const_expr(self.fp8):  # raw e4m3 rows, dense (64 bytes), staged for the upcast
                box = cute.make_layout((self.box_rows, _CHUNK), stride=(_CHUNK, 1))
            else:
                box = cute.select(sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR,
                                                                (self.block_m, self.box_rows, _CHUNK), dt, 1),
                                  mode=[0, 1])
            tma_atom, tma_kv = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), kv_t, box,
                                                           (self.box_rows, _CHUNK))
        qk_dt = _F8 if cutlass.const_expr(self.qk8) else dt

        @cute.struct
        class Storage:
            mbar: cute.struct.MemRange[Int64, self.n_mbar]  # A0, B0, A1, B1 (module docstring); n_mbar
            row_max: cute.struct.MemRange[Float32, 64]
            scale0: cute.struct.MemRange[Float32, 64]
            scale1: cute.struct.MemRange[Float32, 64]
            row_sum: cute.struct.MemRange[Float32, 2 * 64]
            sQ: cute.struct.Align[cute.struct.MemRange[qk_dt, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(k_layout)], 1024]
            zero_row: cute.struct.Align[cute.struct.MemRange[Int32, 4], 16]  # packed transpose: rows past the split
            # column statistics of the transposed loops (16-byte aligned: fold_t's colmax "xpose" reads 4 at once)
            red: cute.struct.Align[cute.struct.MemRange[Float32, self.red_floats], 16]

        self.seesaw_kernel(qk_mma, pv_ss, pv_rs, pv8, q, kv, block_table, seq_lens, softmax_scale, output_scale, out,
                           lse, o_accum, lse_accum, trace_buf, q_layout, k_layout, v_layout, p_layout, tma_atom,
                           tma_kv, Storage).launch(
            grid=(self.num_m_blocks, self.num_splits, q.shape[0]), block=(self.cta_threads, 1, 1),
            smem=Storage.size_in_bytes(), stream=stream, min_blocks_per_mp=1, use_pdl=self.pdl_main)
        if cutlass.const_expr(self.num_splits > 1):
            self.launch_combine(stream, o_accum, lse_accum, output_scale, out, lse, q.shape[0])

    # ---------------------------------------------------------------------------------------- device
    @cute.jit
    def cta_start(self, Storage: cutlass.Constexpr):
        """First thing of a main kernel (this loop's and the O^T loop's): ``(tid, row block, split, request,
        warpgroup, thread in the warpgroup, shared storage)``, after the combine's PDL trigger."""
        tid, _, _ = cute.arch.thread_idx()
        mblk, split, b = cute.arch.block_idx()
        self.allow_combine_launch()
        wg = cute.arch.make_warp_uniform(tid // 128)
        st = cutlass.utils.SmemAllocator().allocate(Storage)
        return tid, mblk, split, b, wg, tid % 128, st

    @cute.jit
    def num_pairs(self, split_start: Int32, split_end: Int32):
        """Tile pairs (2 x 64 tokens) of the split ``[split_start, split_end)``, 0 if it is empty."""
        n = Int32(0)
        if split_end > split_start:
            n = (split_end - split_start + 2 * self.block_n - 1) // (2 * self.block_n)
        return n

    @cute.jit
    def load_q_tile(self, sQ: cute.Tensor, mQ: cute.Tensor, mblk: Int32, b: Int32, tid: Int32):
        """The Q tile of row block ``mblk`` into ``sQ`` by 256 threads (raw e4m3 for the QGMMA QK, upcast for an
        FP8 QK on fp16 operands, else 16-bit rows by cp.async)."""
        if cutlass.const_expr(self.qk8):
            self.load_q_raw8(sQ, mQ, self.q_rows(mblk, b, tid), tid)
        elif cutlass.const_expr(self.fp8):
            self.load_q_fp8(sQ, mQ, self.q_rows(mblk, b, tid), tid)
        else:
            self.load_rows(sQ, mQ, self.q_rows(mblk, b, tid), tid, zero_neg=self.pad_zero)

    @cute.jit
    def load_q_raw8(self, sQ: cute.Tensor, mQ: cute.Tensor, rows: cute.Tensor, tid: Int32):
        """e4m3 q rows -> e4m3 smem in the QGMMA A layout, unconverted: synchronous 8-byte loads and stores
        (thread t: rows ``t//8 + 32m``, bytes ``8 (t%8) + 64k``), published by the prologue's proxy fence
        and barrier."""
        _, tiled = self._row_copy(_F8, 64, 8)
        tXsQ = tiled.get_slice(tid).partition_D(sQ)
        for m in cutlass.range_constexpr(cute.size(tXsQ, mode=[1])):
            for k in cutlass.range_constexpr(cute.size(tXsQ, mode=[2])):
                row = rows[m]
                if cutlass.const_expr(self.pad_zero):
                    row = cutlass.max(row, Int64(0))  # (-1: a zero row, q_rows; row 0 is read and replaced)
                src = cute.make_tensor(row_ptr(mQ, row, (tid % 8) * 8 + 64 * k, self.D, 8), cute.make_layout(8))
                f8 = cute.make_rmem_tensor((8,), _F8)
                cute.autovec_copy(src, f8)
                if cutlass.const_expr(self.pad_zero):  # noqa: SIM102 (static + dynamic test)
                    if rows[m] < 0:  # a zero row (q_rows)
                        f8.fill(0.0)
                cute.autovec_copy(f8, tXsQ[None, m, k])

    @cute.jit
    def next_tile_v(self, sKs: cute.Tensor, sSt: cute.Tensor, w32: cute.Tensor, zero_row, slot: cutlass.Constexpr,
                    tAs: cute.Tensor, tAg: cute.Tensor, tma_atom: cute.CopyAtom, mbar_ptr, mKV: cute.Tensor,
                    crd: cute.Tensor, tile_start: Int32, split_end: Int32, num_pages: Int32, refill_next,
                    wg: Int32, wtid: Int32, tr):
        """End of an iteration with a next tile, by the owner of slot ``slot`` after the next QK retired:
        :meth:`ready_v` of the tile starting at ``tile_start``.  With ``early_refill`` it first waits for
        the other warpgroup's cross PV of the slot's last tile (VT0_FREE / VT1_FREE: that PV read the
        ``V^T`` and P about to be rebuilt), and afterwards, if ``refill_next``, refills the whole slot with
        the tile two steps ahead (``crd``: its coordinates).  ``tr``: ``(mTrace, cta, j, first event)`` for
        :meth:`mark`."""
        mTrace, cta, j, e0 = tr
        if cutlass.const_expr(self.early):
            cute.arch.barrier(barrier_id=int(Barrier.VT0_FREE) + slot, number_of_threads=self.num_threads)
        self.mark(mTrace, cta, wg, wtid, j, e0)
        self.ready_v(sKs, sSt, w32, zero_row, slot, tile_start, split_end, wg, wtid)
        self.mark(mTrace, cta, wg, wtid, j, e0 + 1)
        if cutlass.const_expr(self.producer and self.early):
            self.slot_free(slot, refill_next)
        elif cutlass.const_expr(self.early):  # noqa: SIM102 (static + dynamic test)
            if refill_next:
                self.refill(sKs, tAs, tAg, tma_atom, mbar_ptr, mKV, crd, tile_start + 2 * self.block_n,
                            split_end, num_pages, wg, wtid, _ALL_CHUNKS, None)
        self.mark(mTrace, cta, wg, wtid, j, e0 + 2)

    @cute.jit
    def produce(self, sK0: cute.Tensor, sK1: cute.Tensor, tAs0: cute.Tensor, tAs1: cute.Tensor, tAg: cute.Tensor,
                tma_atom: cute.CopyAtom, mbar, mKV: cute.Tensor, mBT: cute.Tensor, b: Int32, split_start: Int32,
                split_end: Int32, num_pages: Int32, n_pairs: Int32, wtid: Int32):
        """The producer warpgroup (:attr:`producer`) after the prologue, which it loaded: its warp 0 issues every
        refill of the loop, each once the computing warpgroup that last read those columns arrived on the refill's
        160-thread barrier.  FP8 (early refills): each slot whole with the tile two steps ahead, once the owner
        read the staging (its QK retired and it built ``V^T``: SLOT0_FREE / SLOT1_FREE).  16-bit: the four
        column groups of the next pair (below).  The TMA issue (9 boxes per 64-token tile with pages >= 64, 18 with
        32) stalls the issuing warp for hundreds of cycles (the H200 timeline of FP8 mode 3, 2026-12-01: 700-1200
        cycles per refill); here that warp is not a computing one."""
        bn = self.block_n
        if cutlass.const_expr(not self.early):
            # the 16-bit loop's four column-group refills of pair j + 1, in the order their sites are reached: A0 (slot
            # 0 cols 0..255, after WG0's own PV), B1 (slot 1 cols 256..511, WG1's own PV), B0 (slot 0 cols 256..575,
            # WG1's cross PV), A1 (slot 1 cols 0..255 + rope, WG0's cross PV); each site's warpgroup arrives on its
            # REFILL_* barrier.  No site waits for a later refill of the same pair, so the fixed order cannot block.
            cg = self.col_groups
            groups = ((Barrier.REFILL_A0, 0, 0, cg[0]),
                      (Barrier.REFILL_B1, 1, 3, cg[3]),
                      (Barrier.REFILL_B0, 0, 1, cg[1]),
                      (Barrier.REFILL_A1, 1, 2, cg[2]))
            if cutlass.const_expr(self.cross_first):
                # warpgroup 1 reaches B0 before B1 here, and warpgroup 0's A1 may come before either: warp g issues
                # group g alone, so each refill goes out as soon as its site is reached
                warp = cute.arch.make_warp_uniform(wtid // 32)
                for g in cutlass.range_constexpr(4):
                    if warp == g:
                        bar, s, m, chunks = groups[g]
                        for j in cutlass.range(n_pairs - 1, unroll=1):
                            t = split_start + (2 * j + 2 + s) * bn
                            crd = self.coords(mBT, b, t, split_end, num_pages, wtid)
                            cute.arch.barrier(barrier_id=int(bar), number_of_threads=160)
                            self.refill((sK0, sK1)[s], (tAs0, tAs1)[s], tAg, tma_atom, mbar + m, mKV, crd, t,
                                        split_end, num_pages, 2, wtid % 32, chunks, None, self.chunk_bar(mbar, s))
            elif wtid < 32:
                for j in cutlass.range(n_pairs - 1, unroll=1):
                    t2 = split_start + (2 * j + 2) * bn
                    for bar, s, m, chunks in groups:
                        t = t2 + s * bn
                        # loaded before the wait, one tile's at a time (24 registers: pages of 16 / 32 spilled
                        # with two tiles' coordinates live)
                        crd = self.coords(mBT, b, t, split_end, num_pages, wtid)
                        cute.arch.barrier(barrier_id=int(bar), number_of_threads=160)
                        self.refill((sK0, sK1)[s], (tAs0, tAs1)[s], tAg, tma_atom, mbar + m, mKV, crd, t, split_end,
                                    num_pages, 2, wtid, chunks, None, self.chunk_bar(mbar, s))
        elif wtid < 32:
            for j in cutlass.range(n_pairs - 1, unroll=1):
                for g in cutlass.range_constexpr(2):
                    t0 = split_start + (2 * j + g + 2) * bn  # the refill's tile
                    crd = self.coords(mBT, b, t0, split_end, num_pages, wtid)  # (clamped: always valid)
                    cute.arch.barrier(barrier_id=int(Barrier.SLOT0_FREE) + g, number_of_threads=160)
                    self.refill((sK0, sK1)[g], (tAs0, tAs1)[g], tAg, tma_atom, mbar + 2 * g, mKV, crd, t0, split_end,
                                num_pages, 2, wtid, _ALL_CHUNKS, None)

    @cute.jit
    def slot_free(self, slot, cond):
        """With the producer warpgroup: the owner read slot ``slot``'s staging (QK retired, ``V^T`` built), so the
        producer may refill it, if the slot has a next tile (``cond``)."""
        if cond:
            cute.arch.barrier_arrive(barrier_id=int(Barrier.SLOT0_FREE) + slot, number_of_threads=160)

    @cute.jit
    def zero_tail(self, sKs: cute.Tensor, tile_start: Int32, split_end: Int32, wg: Int32, wtid: Int32):
        """TMA only: zero the V columns (0..511) of a slot's rows at or past ``split_end``, so P = 0 there
        never meets a NaN (a page's rows past seq_len, or an unowned page, may hold anything).  Run by the
        slot's owner after its QK retired and the slot's refills landed; the warpgroup barrier publishes the
        zeros to its own PV, the P_READY barriers (after a proxy fence) to the other warpgroup's."""
        if tile_start + self.block_n > split_end:
            first = cutlass.max(split_end - tile_start, 0)
            for i in cutlass.range_constexpr(self.block_n * self.DV // 8 // 128):
                idx = wtid + 128 * i
                r = idx // (self.DV // 8)
                c0 = (idx % (self.DV // 8)) * 8
                if r >= first:
                    for e in cutlass.range_constexpr(8):
                        sKs[r, c0 + e] = self.mma_dtype(0.0)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)

    @cute.jit
    def landed(self, mbar_ptr, phase):
        """Wait for a column group's refill (completion ``phase`` of its mbarrier); cp.async writes are
        generic-proxy, so they also need a proxy fence before wgmma reads them (TMA writes do not)."""
        cute.arch.mbarrier_wait(mbar_ptr, phase)
        if cutlass.const_expr(not self.use_tma):
            cute.arch.fence_view_async_shared()

    @cute.jit
    def qk_chunks(self, qk_mma: cute.TiledMma, acc_s: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor,
                  chunks: cutlass.Constexpr, first: cutlass.Constexpr):
        """Issue ``S (+)= Q[:, chunks] K[:, chunks]^T`` (no commit); ``first``: S starts from zero.  (The MMA
        always accumulates: its ACCUMULATE field is set once at kernel scope, because a field set inside one
        warpgroup's branch would not dominate the other branch's uses.)"""
        if cutlass.const_expr(first):
            acc_s.fill(0.0)
        warpgroup.fence()
        kpc = _CHUNK // (_K32 if cutlass.const_expr(self.qk8) else _K16)  # wgmma k-steps per 64-column chunk
        for c in cutlass.range_constexpr(len(chunks)):
            for kk in cutlass.range_constexpr(kpc):
                k = chunks[c] * kpc + kk
                cute.gemm(qk_mma, acc_s, tSrQ[None, None, k], tSrK[None, None, k], acc_s)

    @cute.jit
    def pv(self, mma: cute.TiledMma, acc_o: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
           kstep: cutlass.Constexpr = _K16):
        """Issue ``O += P V_half`` (no commit); ``kstep``: the wgmma K (32 for the e4m3 QGMMA)."""
        warpgroup.fence()
        for k in cutlass.range_constexpr(self.block_n // kstep):
            cute.gemm(mma, acc_o, tA[None, None, k], tB[None, None, k], acc_o)

    @cute.jit
    def scaled_tile_max(self, acc_s: cute.Tensor, tScS: cute.Tensor, lim: cute.Tensor, tile_start: Int32,
                        scale_log2: Float32):
        """S -> exp2 domain in place, -inf for keys at or past the row's ``lim``; the quad-reduced row maxima."""
        mx = cute.make_rmem_tensor((2,), Float32)
        mx[0] = -Float32.inf
        mx[1] = -Float32.inf
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            h = (e // 2) % 2
            v = acc_s[e] * scale_log2
            if tile_start + tScS[e][1] >= lim[h]:
                v = -Float32.inf
            acc_s[e] = v
            mx[h] = cute.arch.fmax(mx[h], v)
        for h in cutlass.range_constexpr(2):
            mx[h] = quad_max(mx[h])
        return mx

    @cute.jit
    def fold_max(self, m_prev: Float32, mx: Float32):
        """Fold a tile's row max ``mx`` into the shared running max ``m_prev``: returns ``(m_new, ref,
        scale)``, where ``ref`` is what P is computed against (0 while the max is still -inf, so exp2 gives
        exact zeros) and ``scale = exp2(m_prev - ref)`` rescales state relative to ``m_prev``."""
        m_new = cute.arch.fmax(m_prev, mx)
        ref = m_new
        if m_new == -Float32.inf:
            ref = Float32(0.0)
        return m_new, ref, cute.arch.exp2(m_prev - ref)

    @cute.jit
    def exp_rows(self, acc_s: cute.Tensor, ref: cute.Tensor, row_l: cute.Tensor):
        """``P = exp2(S - ref)`` in place, added to the thread's partial row sums.  FP8 P V: ``2^8 P`` (the
        e4m3 cast keeps P's small values as normals; :attr:`p8_bias`); O and l carry the same factor until
        the epilogue (which subtracts it from the row max for the LSE)."""
        rb = ref
        if cutlass.const_expr(self.pv8):
            rb = cute.make_rmem_tensor((2,), Float32)
            for h in cutlass.range_constexpr(2):
                rb[h] = ref[h] - self.p8_bias
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            h = (e // 2) % 2
            p = cute.arch.exp2(acc_s[e] - rb[h])
            acc_s[e] = p
            row_l[h] = row_l[h] + p

    @cute.jit
    def fold_first(self, acc_s, tScS, lim, tile_start, scale_log2, sM, sSc0, row_in, row_l, ref, sc, wtid):
        """Warpgroup 0, first thing of an iteration: :meth:`fold_first_max`, then ``P`` (in place of ``acc_s``) against
        ``ref`` and the row sums."""
        self.fold_first_max(acc_s, tScS, lim, tile_start, scale_log2, sM, sSc0, row_in, row_l, ref, sc, wtid)
        self.exp_rows(acc_s, ref, row_l)

    @cute.jit
    def fold_first_max(self, acc_s, tScS, lim, tile_start, scale_log2, sM, sSc0, row_in, row_l, ref, sc, wtid):
        """Warpgroup 0: fold its tile (keys from ``tile_start``) into the shared row max ``sM``; ``ref`` = the new
        reference max, ``sc`` = its scale (also published in ``sSc0``), the row sums rescaled by it."""
        mx = self.scaled_tile_max(acc_s, tScS, lim, tile_start, scale_log2)
        for h in cutlass.range_constexpr(2):
            m_new, ref[h], sc[h] = self.fold_max(sM[row_in[h]], mx[h])
            row_l[h] = row_l[h] * sc[h]
            if wtid % 4 == 0:
                sM[row_in[h]] = m_new
                sSc0[row_in[h]] = sc[h]

    @cute.jit
    def fold_second(self, acc_s, tScS, lim, tile_start, scale_log2, sM, sSc0, sSc1, row_in, row_l, ref, sc, wtid):
        """Warpgroup 1, after SCALE0: :meth:`fold_second_max`, arrive on SCALE1, then ``P`` as :meth:`fold_first`."""
        self.fold_second_max(acc_s, tScS, lim, tile_start, scale_log2, sM, sSc0, sSc1, row_in, row_l, ref, sc, wtid)
        cute.arch.barrier_arrive(barrier_id=int(Barrier.SCALE1), number_of_threads=self.num_threads)
        self.exp_rows(acc_s, ref, row_l)

    @cute.jit
    def fold_second_max(self, acc_s, tScS, lim, tile_start, scale_log2, sM, sSc0, sSc1, row_in, row_l, ref, sc, wtid,
                        wait0: bool = False):
        """Warpgroup 1: fold its tile into the shared row max; ``sc`` = scale0 x its own scale (which it publishes in
        ``sSc1``), the row sums rescaled by it.  ``wait0``: wait for SCALE0 here, between its tile max and the fold
        (the O^T loop's ``softmax`` "max"), else the caller waited before."""
        mx = self.scaled_tile_max(acc_s, tScS, lim, tile_start, scale_log2)
        if cutlass.const_expr(wait0):
            cute.arch.barrier(barrier_id=int(Barrier.SCALE0), number_of_threads=self.num_threads)
        for h in cutlass.range_constexpr(2):
            m_new, ref[h], s1 = self.fold_max(sM[row_in[h]], mx[h])
            sc[h] = sSc0[row_in[h]] * s1
            row_l[h] = row_l[h] * sc[h]
            if wtid % 4 == 0:
                sM[row_in[h]] = m_new
                sSc1[row_in[h]] = s1

    def v_half(self, sKs: cute.Tensor, v_layout: cute.ComposedLayout, wg):
        """Warpgroup ``wg``'s 256 V features of slot ``sKs`` as a ``(features, tokens)`` MN-major view (``v_layout``:
        :meth:`_seesaw_layouts`): the P V's B operand here, the transposed 16-bit loop's ``V^T`` A operand."""
        sV = cute.make_tensor(cute.recast_ptr(sKs.iterator, v_layout.inner), v_layout.outer)
        return cute.local_tile(sV[None, None, 0], (self.DV // 2, self.block_n), (wg, 0))

    @cute.jit
    def stage_p(self, rP: cute.Tensor, acc_s: cute.Tensor, tSsP: cute.Tensor, stsm=None):
        """P (fp32, in ``acc_s``) -> the 16-bit register tile ``rP`` -> its shared-memory tile ``tSsP`` (:meth:`put_p`),
        fenced for the async proxy (a wgmma of another warpgroup reads it once the caller's barrier publishes it)."""
        rP.store(acc_s.load().to(rP.element_type))
        self.put_p(rP, tSsP, stsm)
        cute.arch.fence_view_async_shared()

    @cute.jit
    def put_p(self, rP: cute.Tensor, tSsP: cute.Tensor, stsm=None):
        """The register tile ``rP`` -> shared memory: ``stsm`` None, element by element into its accumulator-layout
        partition ``tSsP``; else ``(tiled_copy, rP retiled, destination)`` of :meth:`p_stsm_views` (``stmatrix``)."""
        if cutlass.const_expr(stsm is None):
            cute.autovec_copy(rP, tSsP)
        else:
            cute.copy(stsm[0], stsm[1], stsm[2])

    @cute.jit
    def p_stsm_views(self, qk_mma: cute.TiledMma, rP: cute.Tensor, sP0: cute.Tensor, sP1: cute.Tensor, wtid: Int32):
        """With :attr:`p_stsm`: ``stmatrix`` (x4, not transposed: a matrix row is 8 tokens of one query row, 16 bytes
        of the K-major P tile) tiled over the QK's accumulator layout, as the two :meth:`put_p` arguments for the P
        tiles ``sP0`` / ``sP1``; else ``(None, None)``."""
        if cutlass.const_expr(not self.p_stsm):
            return None, None
        atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.mma_dtype)
        tiled = cute.make_tiled_copy_C(atom, qk_mma)
        thr = tiled.get_slice(wtid)
        src = thr.retile(rP)
        return (tiled, src, thr.partition_D(sP0)), (tiled, src, thr.partition_D(sP1))

    @cute.jit
    def scale_o(self, acc_o: cute.Tensor, s: cute.Tensor):
        for e in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[e] = acc_o[e] * s[(e // 2) % 2]

    @cute.kernel
    def seesaw_kernel(self, qk_mma: cute.TiledMma, pv_ss: cute.TiledMma, pv_rs: cute.TiledMma, pv8: cute.TiledMma,
                      mQ: cute.Tensor,
                      mKV: cute.Tensor, mBT: cute.Tensor, mSeq: cute.Tensor, mSS: cute.Tensor, mOS: cute.Tensor,
                      mOut: cute.Tensor, mLse: cute.Tensor, mOacc: cute.Tensor, mLacc: cute.Tensor, mTrace: cute.Tensor,
                      q_layout: cute.ComposedLayout, k_layout: cute.ComposedLayout, v_layout: cute.ComposedLayout,
                      p_layout: cute.ComposedLayout, tma_atom: cute.CopyAtom, tma_kv: cute.Tensor,
                      Storage: cutlass.Constexpr):
        tid, mblk, split, b, wg, wtid, st = self.cta_start(Storage)
        bn = self.block_n
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
        seq, split_start, split_end = self.split_range(mBT, mSeq, b, split)
        n_pairs = self.num_pairs(split_start, split_end)

        if tid == 0:
            for i in cutlass.range_constexpr(self.n_mbar):
                cute.arch.mbarrier_init(mbar + i, 1 if cutlass.const_expr(self.use_tma) else 128)
            if cutlass.const_expr(self.use_tma):
                cpasync.prefetch_descriptor(tma_atom)
        if tid < 64:
            sM[tid] = -Float32.inf
        zrow = st.zero_row.data_ptr()  # (only the packed transpose reads it)
        cta = (b * self.num_splits + split) * self.num_m_blocks + mblk  # (debug traces: mark)
        self.clear_trace(mTrace, cta, wg, wtid)
        if cutlass.const_expr(self.vt_packed):  # noqa: SIM102 (static + dynamic test)
            if tid < 4:
                st.zero_row.get_tensor(cute.make_layout(4))[tid] = Int32(0)
        cute.arch.mbarrier_init_fence()
        # ---- Q tile (rows past R: clamped copy of row R-1, never stored), one cp.async group (FP8: upcast
        #      through registers)
        if cutlass.const_expr(self.producer):  # (the computing warpgroups' 256 threads)
            if wg < 2:
                self.load_q_tile(sQ[None, None, 0], mQ, mblk, b, tid)
        else:
            self.load_q_tile(sQ[None, None, 0], mQ, mblk, b, tid)
        cute.arch.cp_async_commit_group()
        cute.arch.barrier()  # mbarriers initialised before any arrive
        # ---- prologue: pair 0 into both slots (completion 0 of every mbarrier)
        sK0 = sK[None, None, 0]
        sK1 = sK[None, None, 1]
        tAs0, tAs1, tAg = None, None, None
        sSt0, sSt1 = None, None  # FP8: the e4m3 staging view of each slot (see :meth:`expand`)
        if cutlass.const_expr(self.fp8):
            sSt0, sSt1 = self.staging(st.sK.data_ptr())
        if cutlass.const_expr(self.use_tma):  # boxes: (page row block, chunk, page) -> slot (sub-box, chunk)
            gKV = cute.group_modes(cute.local_tile(tma_kv, (self.box_rows, _CHUNK), (None, None, None)), 0, 2)
            dst0, dst1 = (sSt0, sSt1) if cutlass.const_expr(self.fp8) else (sK0, sK1)
            tAs0, tAg = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(
                cute.local_tile(dst0, (self.box_rows, _CHUNK), (None, None)), 0, 2), gKV)
            tAs1, _ = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(
                cute.local_tile(dst1, (self.box_rows, _CHUNK), (None, None)), 0, 2), gKV)
        if n_pairs > 0:
            pg0 = self.coords(mBT, b, split_start, split_end, num_pages, wtid)
            pg1 = self.coords(mBT, b, split_start + bn, split_end, num_pages, wtid)
            if cutlass.const_expr(self.producer and self.early):  # the producer loads both slots (mbarriers +0, +2)
                if wg == 2:
                    self.refill(sK0, tAs0, tAg, tma_atom, mbar + 0, mKV, pg0, split_start, split_end, num_pages, wg,
                                wtid, _ALL_CHUNKS, None)
                    self.refill(sK1, tAs1, tAg, tma_atom, mbar + 2, mKV, pg1, split_start + bn, split_end,
                                num_pages, wg, wtid, _ALL_CHUNKS, None)
            elif cutlass.const_expr(self.producer):  # ... by column groups (mbarriers A0, B0, A1, B1)
                if wg == 2:
                    cb0, cb1 = self.chunk_bar(mbar, 0), self.chunk_bar(mbar, 1)
                    self.refill(sK0, tAs0, tAg, tma_atom, mbar + 0, mKV, pg0, split_start, split_end, num_pages, wg,
                                wtid, self.col_groups[0], None, cb0)
                    self.refill(sK1, tAs1, tAg, tma_atom, mbar + 2, mKV, pg1, split_start + bn, split_end, num_pages,
                                wg, wtid, self.col_groups[2], None, cb1)
                    self.refill(sK0, tAs0, tAg, tma_atom, mbar + 1, mKV, pg0, split_start, split_end, num_pages, wg,
                                wtid, self.col_groups[1], None, cb0)
                    self.refill(sK1, tAs1, tAg, tma_atom, mbar + 3, mKV, pg1, split_start + bn, split_end, num_pages,
                                wg, wtid, self.col_groups[3], None, cb1)
            elif cutlass.const_expr(self.early):  # each warpgroup its own slot, one mbarrier (+0, +2) per slot
                if wg == 0:
                    self.refill(sK0, tAs0, tAg, tma_atom, mbar + 0, mKV, pg0, split_start, split_end, num_pages, wg,
                                wtid, _ALL_CHUNKS, None)
                else:
                    self.refill(sK1, tAs1, tAg, tma_atom, mbar + 2, mKV, pg1, split_start + bn, split_end,
                                num_pages, wg, wtid, _ALL_CHUNKS, None)
            elif wg == 0:
                self.refill(sK0, tAs0, tAg, tma_atom, mbar + 0, mKV, pg0, split_start, split_end, num_pages, wg,
                            wtid, self.col_groups[0], None)
                self.refill(sK1, tAs1, tAg, tma_atom, mbar + 2, mKV, pg1, split_start + bn, split_end, num_pages,
                            wg, wtid, self.col_groups[2], None)
            else:
                self.refill(sK0, tAs0, tAg, tma_atom, mbar + 1, mKV, pg0, split_start, split_end, num_pages, wg,
                            wtid, self.col_groups[1], None)
                self.refill(sK1, tAs1, tAg, tma_atom, mbar + 3, mKV, pg1, split_start + bn, split_end, num_pages,
                            wg, wtid, self.col_groups[3], None)
            if cutlass.const_expr(self.l2_prefetch != "off"):  # the first pair not loaded here into L2
                pf = split_start + 2 * (self.pf_ahead - 1) * bn
                if pf < split_end:
                    crd0 = self.tma_coords(mBT, b, pf, split_end, num_pages)
                    crd1 = self.tma_coords(mBT, b, pf + bn, split_end, num_pages)
                    if tid + mblk == 0:  # one thread, of the first row block only (l2_prefetch_tile)
                        self.l2_prefetch_pair(mKV, crd0, crd1, pf, split_end)
        cute.arch.cp_async_wait_group(0)  # Q (the KV copies are tracked by the mbarriers)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier()

        ctx = (qk_mma, pv_ss, pv_rs, pv8, sQ, sK0, sK1, sSt0, sSt1, st, k_layout, v_layout, p_layout, wg, wtid, mblk,
               split, b, seq, split_start, split_end, n_pairs, sM, sSc0, sSc1, sSum, mbar, scale_log2, out_scale, mBT,
               mKV, num_pages, tAs0, tAs1, tAg, tma_atom, zrow, mTrace, cta, mOut, mLse, mOacc, mLacc)
        if cutlass.const_expr(self.producer):  # warpgroup 2 issues the refills, 0 and 1 compute
            if wg == 2:
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if n_pairs > 0:
                    self.produce(sK0, sK1, tAs0, tAs1, tAg, tma_atom, mbar, mKV, mBT, b, split_start, split_end,
                                 num_pages, n_pairs, wtid)
                cute.arch.barrier()  # the consumers' barrier before their epilogue
            else:
                cute.arch.setmaxregister_increase(self.consumer_regs)
                self.consume(ctx)
        else:
            self.consume(ctx)

    @cute.jit
    def consume(self, ctx):
        """The two computing warpgroups' part of :meth:`seesaw_kernel` after the prologue (all of it without the
        producer warpgroup): the MMA partitions, the first QK, the seesaw loop and the epilogue.  ``ctx``: the
        prologue's values, in :meth:`seesaw_kernel`'s order."""
        (qk_mma, pv_ss, pv_rs, pv8, sQ, sK0, sK1, sSt0, sSt1, st, k_layout, v_layout, p_layout, wg, wtid, mblk,
         split, b, seq, split_start, split_end, n_pairs, sM, sSc0, sSc1, sSum, mbar, scale_log2, out_scale, mBT,
         mKV, num_pages, tAs0, tAs1, tAg, tma_atom, zrow, mTrace, cta, mOut, mLse, mOacc, mLacc) = ctx
        bn = self.block_n
        # ---- MMA partitions (identical for both warpgroups; slot / column half picked by wg)
        qk_thr = qk_mma.get_slice(wtid)
        ss_thr = pv_ss.get_slice(wtid)
        tSrQ = qk_thr.make_fragment_A(qk_thr.partition_A(sQ[None, None, 0]))
        kq0, kq1 = (sSt0, sSt1) if cutlass.const_expr(self.qk8) else (sK0, sK1)  # the QK's B operand
        tSrK0 = qk_thr.make_fragment_B(qk_thr.partition_B(kq0))
        tSrK1 = qk_thr.make_fragment_B(qk_thr.partition_B(kq1))
        acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((self.block_m, bn)))
        acc_o = ss_thr.make_fragment_C(ss_thr.partition_shape_C((self.block_m, self.DV // 2)))
        acc_o.fill(0.0)
        tScS = qk_thr.partition_C(cute.make_identity_tensor((self.block_m, bn)))
        # P of slot g lives in its rope columns (chunk 8: 64 rows x 64 cols, same swizzled atom layout as P)
        sP0 = cute.make_tensor(cute.recast_ptr(sK0.iterator + self.DV * bn, p_layout.inner), p_layout.outer)
        sP1 = cute.make_tensor(cute.recast_ptr(sK1.iterator + self.DV * bn, p_layout.inner), p_layout.outer)
        tSsP0 = qk_thr.partition_C(sP0[None, None, 0])
        tSsP1 = qk_thr.partition_C(sP1[None, None, 0])
        tOsP0 = ss_thr.make_fragment_A(ss_thr.partition_A(sP0[None, None, 0]))
        tOsP1 = ss_thr.make_fragment_A(ss_thr.partition_A(sP1[None, None, 0]))
        tOrV0 = ss_thr.make_fragment_B(ss_thr.partition_B(self.v_half(sK0, v_layout, wg)))
        tOrV1 = ss_thr.make_fragment_B(ss_thr.partition_B(self.v_half(sK1, v_layout, wg)))
        # FP8 P V (pv8_views): e4m3 P tiles and V^T halves as QGMMA operands; O viewed in the QGMMA's (N = 64)
        # accumulator layout, the same registers in the same order as pv_ss's
        w32, acc_o8, tSsP8_0, tSsP8_1, tOsP8_0, tOsP8_1, tOrVt0, tOrVt1 = (None,) * 8
        if cutlass.const_expr(self.pv8):
            w32 = cute.make_tensor(cute.recast_ptr(st.sK.data_ptr(), dtype=Int32), cute.make_layout(
                cute.cosize(k_layout) * (self.mma_dtype.width // 8) // 4))
            (sVt0, sVt1), (sP80, sP81), (sP8s0, sP8s1) = self.pv8_views(st.sK.data_ptr())
            thr8 = pv8.get_slice(wtid)
            acc_o8 = cute.make_tensor(acc_o.iterator,
                                      thr8.make_fragment_C(thr8.partition_shape_C((self.block_m, self.DV // 2))).layout)
            tSsP8_0 = qk_thr.partition_C(sP8s0)
            tSsP8_1 = qk_thr.partition_C(sP8s1)
            tOsP8_0 = thr8.make_fragment_A(thr8.partition_A(sP80))
            tOsP8_1 = thr8.make_fragment_A(thr8.partition_A(sP81))
            tOrVt0 = thr8.make_fragment_B(thr8.partition_B(cute.local_tile(sVt0, (self.DV // 2, bn), (wg, 0))))
            tOrVt1 = thr8.make_fragment_B(thr8.partition_B(cute.local_tile(sVt1, (self.DV // 2, bn), (wg, 0))))
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

        # ---- first QK of each warpgroup (pair 0)
        if n_pairs > 0:
            if wg == 0:
                self.landed(mbar + 0, 0)
                if cutlass.const_expr(not self.early):
                    self.landed(mbar + 1, 0)
                self.expand(sK0, sSt0, wg, wtid, (0, 1, 2, 3, 4, 5, 6, 7, 8))
                self.qk_chunks(qk_mma, acc_s, tSrQ, tSrK0, (0, 1, 2, 3, 4, 5, 6, 7, 8), True)
            else:
                self.landed(mbar + 2, 0)
                if cutlass.const_expr(not self.early):
                    self.landed(mbar + 3, 0)
                self.expand(sK1, sSt1, wg, wtid, (0, 1, 2, 3, 4, 5, 6, 7, 8))
                self.qk_chunks(qk_mma, acc_s, tSrQ, tSrK1, (0, 1, 2, 3, 4, 5, 6, 7, 8), True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            if wg == 0:
                self.ready_v(sK0, sSt0, w32, zrow, 0, split_start, split_end, wg, wtid)
            else:
                self.ready_v(sK1, sSt1, w32, zrow, 1, split_start + bn, split_end, wg, wtid)
            if cutlass.const_expr(self.producer and self.early):
                self.slot_free(wg, n_pairs > 1)
            elif cutlass.const_expr(self.early):  # noqa: SIM102 (static + dynamic test)
                if n_pairs > 1:  # pair 1 right away: the staging is free after the transpose
                    if wg == 0:
                        pgE = self.coords(mBT, b, split_start + 2 * bn, split_end, num_pages, wtid)
                        self.refill(sK0, tAs0, tAg, tma_atom, mbar + 0, mKV, pgE, split_start + 2 * bn, split_end,
                                    num_pages, wg, wtid, _ALL_CHUNKS, None)
                    else:
                        pgE = self.coords(mBT, b, split_start + 3 * bn, split_end, num_pages, wtid)
                        self.refill(sK1, tAs1, tAg, tma_atom, mbar + 2, mKV, pgE, split_start + 3 * bn, split_end,
                                    num_pages, wg, wtid, _ALL_CHUNKS, None)

        if wg == 0:
            for j in cutlass.range(n_pairs, unroll=1):
                t0 = split_start + 2 * j * bn  # first token of this pair's tile in slot 0
                more = j + 1 < n_pairs
                ph = (j + 1) % 2  # parity of the refill completion the next QK waits for
                self.mark(mTrace, cta, wg, wtid, j, 0)
                pgA0, pgA1 = None, None
                if cutlass.const_expr(self.early):  # the whole-slot refill at the end: tile 2j + 4
                    pgA0 = self.coords(mBT, b, t0 + 4 * bn, split_end, num_pages, wtid)
                else:
                    pgA0 = self.coords(mBT, b, t0 + 2 * bn, split_end, num_pages, wtid)  # in flight during softmax
                    pgA1 = self.coords(mBT, b, t0 + 3 * bn, split_end, num_pages, wtid)
                pf = t0 + 2 * self.pf_ahead * bn  # pair j + pf_ahead
                crdP0, crdP1 = None, None
                if cutlass.const_expr(self.l2_prefetch != "off"):  # loaded here, used after the own PV or at the end
                    crdP0 = self.tma_coords(mBT, b, cutlass.min(pf, split_end - 1), split_end, num_pages)
                    crdP1 = self.tma_coords(mBT, b, cutlass.min(pf + bn, split_end - 1), split_end, num_pages)
                if cutlass.const_expr(self.use_tma and not self.pv8):  # (transpose_v zeroes them with FP8 P V)
                    self.zero_tail(sK0, t0, split_end, wg, wtid)
                # 1. fold tile 2j into the shared max; P0; O_L *= scale0; publish
                self.fold_first(acc_s, tScS, lim, t0, scale_log2, sM, sSc0, row_in, row_l, ref, sc, wtid)
                self.scale_o(acc_o, sc)
                cute.arch.barrier_arrive(barrier_id=int(Barrier.SCALE0), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, wg, wtid, j, 1)
                # 2. O_L += P0 V0_L (RS), then refill slot 0 cols 0..255 (only this warpgroup read them)
                if cutlass.const_expr(self.pv8):  # SS: P0 through smem (all 128 threads' parts, then the wgmma)
                    self.store_p8(acc_s, tSsP8_0)
                    cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)
                    self.mark(mTrace, cta, wg, wtid, j, 2)
                    self.pv(pv8, acc_o8, tOsP8_0, tOrVt0, _K32)
                else:
                    rP.store(acc_s.load().to(self.mma_dtype))
                    self.mark(mTrace, cta, wg, wtid, j, 2)
                    self.pv(pv_rs, acc_o, tOrP, tOrV0)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                self.mark(mTrace, cta, wg, wtid, j, 3)
                if cutlass.const_expr(not self.early):  # noqa: SIM102 (static + dynamic test)
                    if more:
                        self.refill(sK0, tAs0, tAg, tma_atom, mbar + 0, mKV, pgA0, t0 + 2 * bn, split_end, num_pages,
                                    wg, wtid, (0, 1, 2, 3), Barrier.REFILL_A0)
                if cutlass.const_expr(self.l2_prefetch == "early"):  # noqa: SIM102 (static + dynamic test)
                    if wtid + mblk == 0:  # one thread, of the first row block only (l2_prefetch_tile)
                        self.l2_prefetch_pair(mKV, crdP0, crdP1, pf, split_end)
                # 3. WG1 folded tile 2j+1: rescale P0 (-> smem for WG1), l, O_L by scale1
                cute.arch.barrier(barrier_id=int(Barrier.SCALE1), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, wg, wtid, j, 4)
                for h in cutlass.range_constexpr(2):
                    sc[h] = sSc1[row_in[h]]
                    row_l[h] = row_l[h] * sc[h]
                for e in cutlass.range_constexpr(cute.size(acc_s)):
                    acc_s[e] = acc_s[e] * sc[(e // 2) % 2]
                if cutlass.const_expr(self.pv8):  # (the own PV, which read the same tile, retired above)
                    self.store_p8(acc_s, tSsP8_0)
                else:
                    self.stage_p(rP, acc_s, tSsP0, stsm0)
                cute.arch.barrier_arrive(barrier_id=int(Barrier.P0_READY), number_of_threads=self.num_threads)
                self.scale_o(acc_o, sc)
                self.mark(mTrace, cta, wg, wtid, j, 5)
                # 4. O_L += P1 V1_L (SS; P1 from WG1's smem)
                cute.arch.barrier(barrier_id=int(Barrier.P1_READY), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, wg, wtid, j, 6)
                if cutlass.const_expr(self.pv8):
                    self.pv(pv8, acc_o8, tOsP8_1, tOrVt1, _K32)
                else:
                    self.pv(pv_ss, acc_o, tOsP1, tOrV1)
                warpgroup.commit_group()
                # 5. next QK on slot 0: own refill first, then (after the cross PV retired, refilling slot 1's
                #    cols 0..255 + 512..575) WG1's refill of cols 256..575
                if cutlass.const_expr(self.early):
                    if more:  # the whole slot landed; after the cross PV retired, WG1 may rebuild slot 1's V^T
                        self.landed(mbar + 0, ph)
                        self.mark(mTrace, cta, wg, wtid, j, 7)
                        self.qk_chunks(qk_mma, acc_s, tSrQ, tSrK0, _ALL_CHUNKS, True)
                        warpgroup.commit_group()
                        warpgroup.wait_group(1)
                        self.mark(mTrace, cta, wg, wtid, j, 8)
                        cute.arch.barrier_arrive(barrier_id=int(Barrier.VT1_FREE), number_of_threads=self.num_threads)
                elif more:
                    self.landed(mbar + 0, ph)
                    self.mark(mTrace, cta, wg, wtid, j, 7)
                    self.expand(sK0, sSt0, wg, wtid, (0, 1, 2, 3))
                    self.qk_chunks(qk_mma, acc_s, tSrQ, tSrK0, (0, 1, 2, 3), True)
                    warpgroup.commit_group()
                    warpgroup.wait_group(1)
                    self.mark(mTrace, cta, wg, wtid, j, 8)
                    self.refill(sK1, tAs1, tAg, tma_atom, mbar + 2, mKV, pgA1, t0 + 3 * bn, split_end, num_pages, wg,
                                wtid, (0, 1, 2, 3, 8), Barrier.REFILL_A1)
                    self.landed(mbar + 1, ph)
                    self.expand(sK0, sSt0, wg, wtid, (4, 5, 6, 7, 8))
                    self.qk_chunks(qk_mma, acc_s, tSrQ, tSrK0, (4, 5, 6, 7, 8), False)
                    warpgroup.commit_group()
                if cutlass.const_expr(self.l2_prefetch == "late"):  # noqa: SIM102 (static + dynamic test)
                    if wtid + mblk == 0:  # one thread, of the first row block only (l2_prefetch_tile)
                        self.l2_prefetch_pair(mKV, crdP0, crdP1, pf, split_end)
                warpgroup.wait_group(0)
                self.mark(mTrace, cta, wg, wtid, j, 9)
                if more:
                    self.next_tile_v(sK0, sSt0, w32, zrow, 0, tAs0, tAg, tma_atom, mbar + 0, mKV, pgA0, t0 + 2 * bn,
                                     split_end, num_pages, j + 2 < n_pairs, wg, wtid, (mTrace, cta, j, 10))
        else:
            for j in cutlass.range(n_pairs, unroll=1):
                t1 = split_start + (2 * j + 1) * bn  # first token of this pair's tile in slot 1
                more = j + 1 < n_pairs
                ph = (j + 1) % 2
                self.mark(mTrace, cta, wg, wtid, j, 0)
                pgB1, pgB0 = None, None
                if cutlass.const_expr(self.early):  # the whole-slot refill at the end: tile 2j + 5
                    pgB1 = self.coords(mBT, b, t1 + 4 * bn, split_end, num_pages, wtid)
                else:
                    pgB1 = self.coords(mBT, b, t1 + 2 * bn, split_end, num_pages, wtid)  # in flight during the waits
                    pgB0 = self.coords(mBT, b, t1 + bn, split_end, num_pages, wtid)
                if cutlass.const_expr(self.use_tma and not self.pv8):
                    self.zero_tail(sK1, t1, split_end, wg, wtid)
                # 1. after WG0: fold tile 2j+1 into the shared max; P1; O_R *= scale0*scale1; publish
                cute.arch.barrier(barrier_id=int(Barrier.SCALE0), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, wg, wtid, j, 1)
                self.fold_second(acc_s, tScS, lim, t1, scale_log2, sM, sSc0, sSc1, row_in, row_l, ref, sc, wtid)
                self.scale_o(acc_o, sc)
                self.mark(mTrace, cta, wg, wtid, j, 2)
                # 2. P1 -> smem (for WG0), O_R += P1 V1_R (RS)
                if cutlass.const_expr(self.pv8):  # SS: P1 through smem, for both PVs that read it
                    self.store_p8(acc_s, tSsP8_1)
                    cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)
                    self.mark(mTrace, cta, wg, wtid, j, 3)
                    self.pv(pv8, acc_o8, tOsP8_1, tOrVt1, _K32)
                    warpgroup.commit_group()
                elif cutlass.const_expr(self.cross_first):  # P1 published now, its PV issued after the cross PV
                    self.stage_p(rP, acc_s, tSsP1, stsm1)
                    cute.arch.barrier_arrive(barrier_id=int(Barrier.P1_READY), number_of_threads=self.num_threads)
                    self.mark(mTrace, cta, wg, wtid, j, 3)
                else:
                    rP.store(acc_s.load().to(self.mma_dtype))
                    self.put_p(rP, tSsP1, stsm1)
                    self.mark(mTrace, cta, wg, wtid, j, 3)
                    self.pv(pv_rs, acc_o, tOrP, tOrV1)
                    warpgroup.commit_group()
                    cute.arch.fence_view_async_shared()
                # 3. O_R += P0 V0_R (SS; P0 from WG0's smem), then release P1 to WG0 (cross_first: then the own PV)
                cute.arch.barrier(barrier_id=int(Barrier.P0_READY), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, wg, wtid, j, 4)
                if cutlass.const_expr(self.pv8):
                    self.pv(pv8, acc_o8, tOsP8_0, tOrVt0, _K32)
                else:
                    self.pv(pv_ss, acc_o, tOsP0, tOrV0)
                warpgroup.commit_group()
                if cutlass.const_expr(self.cross_first):
                    self.pv(pv_rs, acc_o, tOrP, tOrV1)
                    warpgroup.commit_group()
                else:
                    cute.arch.barrier_arrive(barrier_id=int(Barrier.P1_READY), number_of_threads=self.num_threads)
                self.mark(mTrace, cta, wg, wtid, j, 5)
                # 4. refills as the PVs retire: slot 1 cols 256..511 (own PV), slot 0 cols 256..575 (cross PV,
                #    which also read P0 in slot 0's rope columns); cross_first: the other way round
                warpgroup.wait_group(1)
                if cutlass.const_expr(not self.early):  # noqa: SIM102 (static + dynamic test)
                    if more:
                        if cutlass.const_expr(self.cross_first):
                            self.refill(sK0, tAs0, tAg, tma_atom, mbar + 1, mKV, pgB0, t1 + bn, split_end, num_pages,
                                        wg, wtid, (4, 5, 6, 7, 8), Barrier.REFILL_B0)
                        else:
                            self.refill(sK1, tAs1, tAg, tma_atom, mbar + 3, mKV, pgB1, t1 + 2 * bn, split_end,
                                        num_pages, wg, wtid, (4, 5, 6, 7), Barrier.REFILL_B1)
                warpgroup.wait_group(0)
                self.mark(mTrace, cta, wg, wtid, j, 6)
                if cutlass.const_expr(self.early):
                    if more:  # the cross PV of slot 0 retired: WG0 may rebuild its V^T and P; then the next QK
                        cute.arch.barrier_arrive(barrier_id=int(Barrier.VT0_FREE), number_of_threads=self.num_threads)
                        self.landed(mbar + 2, ph)
                        self.mark(mTrace, cta, wg, wtid, j, 7)
                        self.qk_chunks(qk_mma, acc_s, tSrQ, tSrK1, _ALL_CHUNKS, True)
                        warpgroup.commit_group()
                elif more:
                    if cutlass.const_expr(self.cross_first):
                        self.refill(sK1, tAs1, tAg, tma_atom, mbar + 3, mKV, pgB1, t1 + 2 * bn, split_end, num_pages,
                                    wg, wtid, (4, 5, 6, 7), Barrier.REFILL_B1)
                    else:
                        self.refill(sK0, tAs0, tAg, tma_atom, mbar + 1, mKV, pgB0, t1 + bn, split_end, num_pages, wg,
                                    wtid, (4, 5, 6, 7, 8), Barrier.REFILL_B0)
                    # 5. next QK on slot 1: own columns first, then WG0's refill (cols 0..255 + rope)
                    self.landed(mbar + 3, ph)
                    self.mark(mTrace, cta, wg, wtid, j, 7)
                    self.expand(sK1, sSt1, wg, wtid, (4, 5, 6, 7))
                    self.qk_chunks(qk_mma, acc_s, tSrQ, tSrK1, (4, 5, 6, 7), True)
                    self.landed(mbar + 2, ph)
                    self.expand(sK1, sSt1, wg, wtid, (0, 1, 2, 3, 8))
                    self.qk_chunks(qk_mma, acc_s, tSrQ, tSrK1, (0, 1, 2, 3, 8), False)
                    warpgroup.commit_group()
                warpgroup.wait_group(0)
                self.mark(mTrace, cta, wg, wtid, j, 8)
                if more:
                    self.next_tile_v(sK1, sSt1, w32, zrow, 1, tAs1, tAg, tma_atom, mbar + 2, mKV, pgB1, t1 + 2 * bn,
                                     split_end, num_pages, j + 2 < n_pairs, wg, wtid, (mTrace, cta, j, 9))

        # ---- epilogue (base class): both warpgroups' O and l are relative to the final shared max
        cute.arch.barrier()
        row_m = cute.make_rmem_tensor((2,), Float32)
        for h in cutlass.range_constexpr(2):
            row_m[h] = sM[row_in[h]]
            if cutlass.const_expr(self.pv8):  # O and l both carry P's 2^8 (exp_rows): O / l needs nothing, the LSE
                row_m[h] = row_m[h] - self.p8_bias  # (row max + log2 l) takes it out of the max
        stage = None  # (every QK retired: the barrier above)
        if cutlass.const_expr(self.o_staged):  # the Q tile: 64 x 576 e4m3 or 16-bit values
            stage = (sQ.iterator, self.block_m * self.D * (1 if self.qk8 else 2))
        self.epilogue(ss_thr, acc_o, row_m, row_l, row_in, sSum, mOut, mLse, mOacc, mLacc, out_scale, mblk,
                      split, b, wg, wtid, stage)



@cute.jit
def launch_mla_decode_seesaw(stream, q: cute.Tensor, kv: cute.Tensor, block_table: cute.Tensor,
                             seq_lens: cute.Tensor, softmax_scale: cute.Tensor, output_scale: cute.Tensor,
                             out: cute.Tensor, lse: cute.Tensor, o_accum: cute.Tensor = None,
                             lse_accum: cute.Tensor = None, *, dtype: cutlass.Constexpr,
                             num_heads: cutlass.Constexpr, q_len: cutlass.Constexpr, page_size: cutlass.Constexpr,
                             causal: cutlass.Constexpr, num_splits: cutlass.Constexpr,
                             tokens_per_split: cutlass.Constexpr, block_n: cutlass.Constexpr = 64,
                             schedule: cutlass.Constexpr = "seesaw", pdl: cutlass.Constexpr = True,
                             qk_fp8: cutlass.Constexpr = True, pv_fp8: cutlass.Constexpr = False,
                             early_refill: cutlass.Constexpr = False, vt_packed: cutlass.Constexpr = False,
                             tma_producer: cutlass.Constexpr = False, l2_prefetch: cutlass.Constexpr = "off",
                             kv_evict: cutlass.Constexpr = "normal", cross_first: cutlass.Constexpr = False,
                             pdl_main: cutlass.Constexpr = False, pad_rows: cutlass.Constexpr = "copy",
                             p_stsm: cutlass.Constexpr = False, o_staged: cutlass.Constexpr = False):
    """FFI launch function of schedule "seesaw" (same ABI as ``launch_mla_decode``); ``"seesaw-cpasync"``
    forces the cp.async refills where TMA would be used; ``qk_fp8=False`` runs an FP8 QK on fp16 operands;
    ``pv_fp8=True`` runs the FP8 P V on FP8 tensor cores (P rounded to e4m3; :meth:`MlaDecodeSeesawSm90.transpose_v`);
    ``l2_prefetch``: the L2 prefetch mode ("off", "late", "early"; :meth:`MlaDecodeSeesawSm90.l2_prefetch_tile`);
    ``kv_evict``: the KV loads' L2 eviction hint (:data:`KV_EVICT_MODES`); ``cross_first``: the 16-bit loop's
    warpgroup 1 runs its cross PV first; ``pad_rows``: what the rows past R of a row block hold (:data:`PAD_ROWS`;
    ``"zero"``: zeros, every key masked); ``p_stsm``: the 16-bit loop stores P by ``stmatrix``; ``o_staged``: its
    epilogue stages O through shared memory."""
    MlaDecodeSeesawSm90(dtype=dtype, num_heads=num_heads, q_len=q_len, page_size=page_size, causal=causal,
                        num_splits=num_splits, tokens_per_split=tokens_per_split, block_n=block_n,
                        kv_load="cp.async" if schedule == "seesaw-cpasync" else "auto", pdl=pdl, qk_fp8=qk_fp8,
                        pv_fp8=pv_fp8, early_refill=early_refill, vt_packed=vt_packed, tma_producer=tma_producer,
                        l2_prefetch=l2_prefetch, kv_evict=kv_evict, cross_first=cross_first, pdl_main=pdl_main,
                        pad_rows=pad_rows, p_stsm=p_stsm, o_staged=o_staged)(
        stream, q, kv, block_table, seq_lens, softmax_scale, output_scale, out, lse, o_accum, lse_accum)


@cute.jit
def launch_mla_decode_seesaw_traced(stream, q: cute.Tensor, kv: cute.Tensor, block_table: cute.Tensor,
                                    seq_lens: cute.Tensor, softmax_scale: cute.Tensor, output_scale: cute.Tensor,
                                    out: cute.Tensor, lse: cute.Tensor, trace_buf: cute.Tensor,
                                    o_accum: cute.Tensor = None, lse_accum: cute.Tensor = None, *,
                                    dtype: cutlass.Constexpr, num_heads: cutlass.Constexpr, q_len: cutlass.Constexpr,
                                    page_size: cutlass.Constexpr, causal: cutlass.Constexpr,
                                    num_splits: cutlass.Constexpr, tokens_per_split: cutlass.Constexpr,
                                    trace: cutlass.Constexpr, pdl: cutlass.Constexpr = True,
                                    l2_prefetch: cutlass.Constexpr = "off", tma_producer: cutlass.Constexpr = False,
                                    kv_evict: cutlass.Constexpr = "normal", cross_first: cutlass.Constexpr = False,
                                    pad_rows: cutlass.Constexpr = "copy", p_stsm: cutlass.Constexpr = False,
                                    o_staged: cutlass.Constexpr = False):
    """Debug build of the seesaw loop as the backend runs it (FP8: packed slots, early refills, pages >= 32;
    ``tma_producer``: with the producer warpgroup, FP8 mode 4 or the 16-bit default) with
    :meth:`DecodeTraceMixin.mark` timestamps in ``trace_buf`` (int64 ``(ctas, 2, trace,
    len(TRACE_EVENTS))``, the first ``ctas`` CTAs in ``(b, split, row block)`` order), an extra output after
    ``lse`` (benchmarks/trace_decode.py)."""
    fp8 = dtype == "float8_e4m3fn"
    MlaDecodeSeesawSm90(dtype=dtype, num_heads=num_heads, q_len=q_len, page_size=page_size, causal=causal,
                        num_splits=num_splits, tokens_per_split=tokens_per_split, block_n=64, pdl=pdl, qk_fp8=True,
                        pv_fp8=fp8, early_refill=fp8, vt_packed=fp8, tma_producer=tma_producer, l2_prefetch=l2_prefetch,
                        kv_evict=kv_evict, cross_first=cross_first, trace=trace, pad_rows=pad_rows, p_stsm=p_stsm,
                        o_staged=o_staged)(
        stream, q, kv, block_table, seq_lens, softmax_scale, output_scale, out, lse, o_accum, lse_accum, trace_buf)


__all__ = ["KV_EVICT_MODES", "L2_PREFETCH_MODES", "TRACE_EVENTS", "MlaDecodeSeesawSm90", "acc_to_a_layout",
           "launch_mla_decode_seesaw", "launch_mla_decode_seesaw_traced"]
