"""FP8 operands of the seesaw decode loop (:class:`~.seesaw.MlaDecodeSeesawSm90` with e4m3 inputs): where the bytes of a
packed KV slot live (``[V^T 32 KB | P 4 KB | e4m3 staging 36 KB]``, each a QGMMA K-major operand: 64-byte rows, 64-byte
swizzle) and how ``V^T`` is built from the landed staging (``ldmatrix.trans`` + ``prmt`` + ``stmatrix``, tokens permuted
in 16-token groups, P stored in that order); the loop decides when.  Also :func:`store_p8` (the e4m3 P store the FP8 O^T
loops share) and the inline-PTX smem accesses.  Address functions take Python ints or DSL Int32:
tests/test_compile_sm90_decode.py checks the kernel's own addressing on an smem model.
"""

from __future__ import annotations

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, cute
from cutlass.tensor_utils import LayoutEnum

from tokenspeed_jax.kernels.sm90.helpers import Barrier, clear_nan_e4m3x4

_F8 = cutlass.Float8E4M3FN
_CHUNK = 64  # columns per 128-byte swizzle atom row (16-bit); one 64-byte e4m3 staging row


def sw64(off):
    """Byte offset ``off`` inside a 64-byte-row tile under the 64-byte swizzle ``S<2,4,3>`` (bits 7-8 XORed
    into bits 4-5; the QGMMA K-major layout of e4m3 operands 64 bytes wide).  Python ints or DSL Int32."""
    return off ^ ((off >> 3) & 0x30)


def ldsm_row_offset(lane, warp, hb):
    """Byte offset (swizzled, in a 4 KB staging chunk) of the row lane ``lane`` of warp ``warp`` addresses in
    :meth:`MlaDecodeSeesawSm90.transpose_v_packed`'s ``ldmatrix.x4.trans`` of block half ``hb`` (features ``32 hb ..``):
    matrix ``m = lane // 8`` holds tokens ``16 warp + 8 (m % 2) ..``, features ``16 (m // 2)`` further on."""
    t = 16 * warp + lane % 8 + 8 * ((lane >> 3) & 1)
    return sw64(t * _CHUNK + 16 * (2 * hb + (lane >> 4)))


def stsm_row_offset(lane, warp, hb):
    """Swizzled byte offset (in a chunk's 4 KB ``V^T`` block) of lane ``lane``'s row in the ``stmatrix.x4`` of block
    half ``hb``, tokens ``16 warp ..``: matrix ``m = lane // 8``, row ``r = lane % 8`` holds feature
    ``2r + ((r >= 4) ^ (m odd)) + 16 (m // 2) + 32 hb`` (the word :func:`p8_selectors` put in register ``m``).  A
    matrix's 8 rows have distinct features mod 8: no bank conflicts."""
    r = lane % 8
    m = lane >> 3
    f = 2 * r + ((r >> 2) ^ (m & 1)) + 16 * (m >> 1) + 32 * hb
    return sw64(f * _CHUNK + 16 * warp)


def p8_selectors(lane):
    """``prmt.b32`` selectors: a thread's ``ldmatrix.trans`` pair (tokens ``a, a+1`` | ``a+8, a+9`` of feature pair
    ``lane // 4``) -> its even / odd feature words (:func:`stsm_row_offset` order: even first only for pairs 0..3)."""
    sw = (lane >> 4) & 1  # feature pair lane // 4 >= 4
    return 0x6420 + sw * 0x1111, 0x7531 - sw * 0x1111


# FP8 P V token order in 16-token groups (ldmatrix.trans order): position 4q + i holds token 2q + (0, 1, 8, 9)[i]
P8_TOKEN_ORDER = tuple(2 * (p // 4) + p % 2 + 8 * ((p // 2) % 2) for p in range(16))


def _ldsm4t(addr):
    """``ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16`` at the shared address ``addr`` (this lane's row)."""
    return cute.arch.inline_ptx(
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
        write_only_types=[Int32] * 4, read_only_args=[Int32(addr)])


def _stsm4(addr, r0, r1, r2, r3):
    """``stmatrix.sync.aligned.m8n8.x4.shared.b16`` of ``r0..r3`` at the shared address ``addr``."""
    cute.arch.inline_ptx("stmatrix.sync.aligned.m8n8.x4.shared.b16 [{$r0}], { {$r1}, {$r2}, {$r3}, {$r4} };",
                         read_only_args=[Int32(addr), Int32(r0), Int32(r1), Int32(r2), Int32(r3)])


def _prmt(a, b, sel):
    """``prmt.b32``: byte ``j`` of the result is byte ``sel[4j+3:4j]`` of ``{b, a}`` (a = bytes 0-3)."""
    return cute.arch.inline_ptx("prmt.b32 {$w0}, {$r0}, {$r1}, {$r2};", write_only_types=[Int32],
                                read_only_args=[Int32(a), Int32(b), Int32(sel)])


def _lds4i(addr):
    """``ld.shared.v4.b32`` at the shared address ``addr`` (16-byte aligned): 4 words."""
    return cute.arch.inline_ptx("ld.shared.v4.b32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
                                write_only_types=[Int32] * 4, read_only_args=[Int32(addr)])


def _sts4i(addr, w0, w1, w2, w3):
    """``st.shared.v4.b32`` of 4 words at the shared address ``addr`` (16-byte aligned)."""
    cute.arch.inline_ptx("st.shared.v4.b32 [{$r0}], { {$r1}, {$r2}, {$r3}, {$r4} };",
                         read_only_args=[Int32(addr), Int32(w0), Int32(w1), Int32(w2), Int32(w3)])


@cute.jit
def clean_e4m3_rows(stg: Int32, lo: Int32, hi: Int32, tid: Int32, chunks: cutlass.Constexpr[int],
                    chunk_bytes: cutlass.Constexpr[int]):
    """The NaN bytes of rows ``[lo, hi)`` (at most 32) in the first ``chunks`` 64-byte chunks of an e4m3 tile at shared
    address ``stg`` -> 0 (:func:`clear_nan_e4m3x4`): thread ``tid`` < ``4 (hi - lo)`` cleans the ``tid``-th 16 bytes of
    the rows in each chunk (no loop or division: few registers at the call sites).  The swizzle only permutes 16-byte
    units inside a row, so row ``r`` of a chunk is its bytes ``[64 r, 64 r + 64)``."""
    if tid < (hi - lo) * 4:
        addr = stg + lo * 64 + tid * 16
        for ch in cutlass.range_constexpr(chunks):
            x = _lds4i(addr + ch * chunk_bytes)
            _sts4i(addr + ch * chunk_bytes, clear_nan_e4m3x4(x[0]), clear_nan_e4m3x4(x[1]),
                   clear_nan_e4m3x4(x[2]), clear_nan_e4m3x4(x[3]))


class Fp8OperandsMixin:
    """FP8 operand methods of :class:`~.seesaw.MlaDecodeSeesawSm90`, which sets the attributes they read: ``block_m``,
    ``block_n``, ``D``, ``DV`` and ``mma_dtype`` (the 16-bit dtype whose slot size the packed slot keeps)."""

    def staging(self, slots_ptr):
        """e4m3 views ``(64 tokens, 576)`` of the two slots' staging (TMA lands the raw cache rows there), after ``V^T``
        and P (:meth:`pv8_views`): 4 KB per 64-column chunk, the QGMMA B layout the QK reads directly."""
        raw = cute.recast_ptr(slots_ptr, dtype=cutlass.Float8E4M3FN)
        chunk_bytes = self.block_n * _CHUNK * (self.mma_dtype.width // 8)
        slot_bytes = chunk_bytes * (self.D // _CHUNK)
        layout = cute.make_layout((self.block_n, (_CHUNK, self.D // _CHUNK)), stride=(_CHUNK, (1, chunk_bytes // 2)))
        sw = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.block_m, self.block_n, _CHUNK), _F8, 1).inner
        return tuple(cute.make_tensor(cute.recast_ptr(raw + (g * slot_bytes + self._packed_staging_offset()), sw),
                                      layout) for g in range(2))

    def _packed_staging_offset(self):
        """Byte offset of the e4m3 staging in a packed slot, after ``V^T`` (DV x 64) and P (64 x 64)."""
        return (self.DV + self.block_m) * self.block_n

    def pv8_views(self, slots_ptr):
        """Per slot: the e4m3 ``V^T`` view ``(512 features, 64 tokens)`` at the slot's start, the P tile
        ``(64 rows, 64 tokens)`` right after it, and the view P is stored through (tokens in :data:`P8_TOKEN_ORDER`,
        the transpose's ``V^T`` order).  Returns ``(V^T views, P operand views, P store views)``."""
        raw = cute.recast_ptr(slots_ptr, dtype=_F8)
        chunk_bytes = self.block_n * _CHUNK * (self.mma_dtype.width // 8)
        slot_bytes = chunk_bytes * (self.D // _CHUNK)
        sw = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.block_m, self.block_n, _CHUNK), _F8, 1).inner
        p = cute.make_layout((self.block_m, self.block_n), stride=(self.block_n, 1))
        vt = cute.make_layout((self.DV, self.block_n), stride=(self.block_n, 1))
        p_off = self.DV * self.block_n
        # logical token t = t0 + 2 t12 + 8 t3 + 16 g sits at position t0 + 4 t12 + 2 t3 + 16 g (P8_TOKEN_ORDER)
        ps_store = cute.make_layout((self.block_m, (2, 4, 2, self.block_n // 16)), stride=(self.block_n, (1, 4, 2, 16)))
        vts = tuple(cute.make_tensor(cute.recast_ptr(raw + g * slot_bytes, sw), vt) for g in range(2))
        ps = tuple(cute.make_tensor(cute.recast_ptr(raw + (g * slot_bytes + p_off), sw), p) for g in range(2))
        pss = tuple(cute.make_tensor(cute.recast_ptr(raw + (g * slot_bytes + p_off), sw), ps_store) for g in range(2))
        return vts, ps, pss

    @cute.jit
    def transpose_v_packed(self, w32: cute.Tensor, zero_row, slot: cutlass.Constexpr, tile_start: Int32,
                           split_end: Int32, wg: Int32, wtid: Int32):
        """Build a slot's ``V^T`` (:meth:`pv8_views`) from its landed staging, by its owner's 128 threads after its QK
        retired.  Warp ``w`` transposes tokens ``16 w ..`` of all 512 features in blocks of 16 tokens x 32 features: one
        ``ldmatrix.x4.trans`` (thread ``i`` gets tokens ``a, a+1`` and ``a+8, a+9``, ``a = 2 (i % 4)``, of feature pairs
        ``i // 4`` and ``i // 4 + 8``), 4 ``prmt.b32`` into one word per feature (4 tokens, in :data:`P8_TOKEN_ORDER`),
        one ``stmatrix.x4`` into the 16 ``V^T`` rows.  Addressing: :func:`ldsm_row_offset`, :func:`stsm_row_offset`,
        :func:`p8_selectors` (checked on a model in tests/test_compile_sm90_decode.py: no bank conflicts).  A lane whose
        ldmatrix row (token) is at or past ``split_end`` reads the 16-byte ``zero_row``: those V rows may hold anything
        (page tails, unowned NaN pages) and P is 0 there.  NaN bytes -> 0 in a tile holding keys :attr:`hidden_keys`
        covers (``tail_from``; :meth:`transpose_chunks`).  A proxy fence + warpgroup barrier publish ``V^T`` to the PVs
        (the other warpgroup's: behind its owner's later P0_READY / P1_READY arrival)."""
        slot_bytes = self.block_n * self.D * (self.mma_dtype.width // 8)
        base = w32.iterator.toint() + slot * slot_bytes
        stg = base + self._packed_staging_offset()
        lane = wtid % 32
        warp = wtid // 32
        sel0, sel1 = p8_selectors(lane)
        sel0, sel1 = Int32(sel0), Int32(sel1)
        cstep = Int32(self.block_n * _CHUNK)  # staging chunk stride (0 for the zero row)
        ld0 = stg + ldsm_row_offset(lane, warp, 0)
        ld1 = stg + ldsm_row_offset(lane, warp, 1)
        if 16 * warp + lane % 8 + 8 * ((lane >> 3) & 1) >= split_end - tile_start:
            z = zero_row.toint()
            cstep, ld0, ld1 = Int32(0), z, z
        st0 = base + stsm_row_offset(lane, warp, 0)
        st1 = base + stsm_row_offset(lane, warp, 1)
        if cutlass.const_expr(self.hidden_keys > 0):
            if tile_start + self.block_n > self.tail_from(split_end):
                self.transpose_chunks(ld0, ld1, cstep, st0, st1, sel0, sel1, True)
            else:
                self.transpose_chunks(ld0, ld1, cstep, st0, st1, sel0, sel1, False)
        else:
            self.transpose_chunks(ld0, ld1, cstep, st0, st1, sel0, sel1, False)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)

    @cute.jit
    def transpose_chunks(self, ld0, ld1, cstep, st0, st1, sel0, sel1, clean: cutlass.Constexpr):
        """:meth:`transpose_v_packed`'s loop over the 512 features; ``clean``: the NaN bytes of the loaded words -> 0
        (:func:`~.helpers.clear_nan_e4m3x4`; the tile holds keys ``MlaDecodeSm90.hidden_keys`` covers)."""
        for c0 in cutlass.range(0, self.DV // _CHUNK, 2, unroll=1):  # 2 chunks (4 ldmatrix) in flight
            regs = []
            for cc in cutlass.range_constexpr(2):
                regs.append(_ldsm4t(ld0 + (c0 + cc) * cstep))
                regs.append(_ldsm4t(ld1 + (c0 + cc) * cstep))
            for cc in cutlass.range_constexpr(2):
                for hb in cutlass.range_constexpr(2):
                    r = regs[2 * cc + hb]
                    if cutlass.const_expr(clean):
                        r = [clear_nan_e4m3x4(x) for x in r]
                    _stsm4((st1 if hb else st0) + (c0 + cc) * (self.block_n * _CHUNK),
                           _prmt(r[0], r[1], sel0), _prmt(r[0], r[1], sel1),
                           _prmt(r[2], r[3], sel0), _prmt(r[2], r[3], sel1))


@cute.jit
def store_p8(acc_s: cute.Tensor, tSsP: cute.Tensor):
    """P (fp32 x 2^8) -> e4m3 in ``tSsP`` (accumulator-layout P tile partition), wgmma-fenced (barrier: caller's)."""
    rP8 = cute.make_rmem_tensor_like(acc_s, _F8)
    rP8.store(acc_s.load().to(_F8))
    cute.autovec_copy(rP8, tSsP)
    cute.arch.fence_view_async_shared()


__all__ = ["P8_TOKEN_ORDER", "Fp8OperandsMixin", "clean_e4m3_rows", "ldsm_row_offset", "p8_selectors", "store_p8",
           "stsm_row_offset", "sw64"]
