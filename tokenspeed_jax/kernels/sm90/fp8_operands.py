"""FP8 operands of the seesaw decode loop (:class:`~tokenspeed_jax.kernels.sm90.mla_decode_seesaw.MlaDecodeSeesawSm90`):
the e4m3 staging of a KV slot as TMA lands it, its upcast for the 16-bit paths, and for the FP8 P V the e4m3
``V^T`` (built by a transpose in shared memory) and P tiles that the QGMMA PVs read, in the two slot layouts
(fp16-sized chunks, or packed: ``vt_packed``).  Split from the loop by responsibility: this module knows where
the bytes of a slot live and how they are rearranged; the loop (``mla_decode_seesaw``) decides when.

The module-level address functions work on Python ints and DSL Int32 alike, so
tests/test_compile_sm90_decode.py checks the kernel's own addressing on a model of shared memory.
"""

from __future__ import annotations

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, cute
from cutlass.tensor_utils import LayoutEnum

from tokenspeed_jax.kernels.sm90.helpers import Barrier

_F8 = cutlass.Float8E4M3FN
_CHUNK = 64  # columns per 128-byte swizzle atom row (16-bit); one 64-byte e4m3 staging row


def sw64(off):
    """Byte offset ``off`` inside a 64-byte-row tile under the 64-byte swizzle ``S<2,4,3>`` (bits 7-8 XORed
    into bits 4-5; the QGMMA K-major layout of e4m3 operands 64 bytes wide).  Python ints or DSL Int32."""
    return off ^ ((off >> 3) & 0x30)


def vt_word_offsets(tg, fw, k, i):
    """:meth:`MlaDecodeSeesawSm90.transpose_v` addressing, for Python ints (tests) and DSL Int32 alike: byte
    offsets (swizzled, inside a 4 KB tile) of the staging word of token ``4 tg + k``, features ``4 fw ..``,
    and of the ``V^T`` word of feature ``4 fw + i``, tokens ``4 tg ..``."""
    return sw64((4 * tg + k) * _CHUNK + 4 * fw), sw64((4 * fw + i) * _CHUNK + 4 * tg)


def ldsm_row_offset(lane, warp, hb):
    """:meth:`MlaDecodeSeesawSm90.transpose_v_packed` (``ldmatrix.trans`` / ``stmatrix``), for Python
    ints (tests) and DSL Int32 alike: byte offset (swizzled, inside a 4 KB staging chunk) of the row that lane
    ``lane`` of warp ``warp`` addresses in the ``ldmatrix.x4.trans`` of the block half ``hb`` (features
    ``32 hb ..`` of the chunk).  Matrix ``lane // 8``: tokens ``16 warp + 8 (m % 2) ..``, features ``16 (m // 2)``
    further on."""
    t = 16 * warp + lane % 8 + 8 * ((lane >> 3) & 1)
    return sw64(t * _CHUNK + 16 * (2 * hb + (lane >> 4)))


def stsm_row_offset(lane, warp, hb):
    """Byte offset (swizzled, inside a chunk's 4 KB ``V^T`` block) of the row that lane ``lane`` addresses in the
    ``stmatrix.x4`` of block half ``hb``: matrix ``m = lane // 8``, row ``r = lane % 8`` holds feature
    ``2r + ((r >= 4) ^ (m odd)) + 16 (m // 2) + 32 hb`` (the word :func:`p8_selectors` put in register ``m``), token
    positions ``16 warp ..``.  The 8 rows of a matrix have distinct features mod 8: no bank conflicts."""
    r = lane % 8
    m = lane >> 3
    f = 2 * r + ((r >> 2) ^ (m & 1)) + 16 * (m >> 1) + 32 * hb
    return sw64(f * _CHUNK + 16 * warp)


def p8_selectors(lane):
    """``prmt.b32`` selectors that turn a thread's ``ldmatrix.trans`` pair (tokens ``a, a+1`` and ``a+8, a+9`` of
    feature pair ``lane // 4``) into the words of its even / odd feature, in the register order
    :func:`stsm_row_offset` expects: even first for feature pairs 0..3, odd first for 4..7."""
    sw = (lane >> 4) & 1  # feature pair lane // 4 >= 4
    return 0x6420 + sw * 0x1111, 0x7531 - sw * 0x1111


# token order of the packed FP8 P V operands inside each 16-token group (the ldmatrix.trans order): position
# 4q + (0, 1, 2, 3) holds tokens 2q, 2q + 1, 2q + 8, 2q + 9
P8_TOKEN_ORDER = tuple(2 * (p // 4) + p % 2 + 8 * ((p // 2) % 2) for p in range(16))


def _ldsm4t(addr):
    """``ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16`` at the shared address ``addr`` (this lane's row)."""
    return cute.arch.inline_ptx(
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
        write_only_types=[Int32] * 4, read_only_args=[Int32(addr)])


def _lds4f(addr):
    """``ld.shared.v4.f32`` at the shared address ``addr`` (16-byte aligned): 4 floats."""
    return cute.arch.inline_ptx("ld.shared.v4.f32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
                                write_only_types=[Float32] * 4, read_only_args=[Int32(addr)])


def _stsm4(addr, r0, r1, r2, r3):
    """``stmatrix.sync.aligned.m8n8.x4.shared.b16`` of ``r0..r3`` at the shared address ``addr``."""
    cute.arch.inline_ptx("stmatrix.sync.aligned.m8n8.x4.shared.b16 [{$r0}], { {$r1}, {$r2}, {$r3}, {$r4} };",
                         read_only_args=[Int32(addr), Int32(r0), Int32(r1), Int32(r2), Int32(r3)])


def _prmt(a, b, sel):
    """``prmt.b32``: byte ``j`` of the result is byte ``sel[4j+3:4j]`` of ``{b, a}`` (a = bytes 0-3)."""
    return cute.arch.inline_ptx("prmt.b32 {$w0}, {$r0}, {$r1}, {$r2};", write_only_types=[Int32],
                                read_only_args=[Int32(a), Int32(b), Int32(sel)])


class Fp8OperandsMixin:
    """The FP8 operand methods of :class:`~tokenspeed_jax.kernels.sm90.mla_decode_seesaw.MlaDecodeSeesawSm90`
    (which sets the attributes they read: ``fp8``, ``qk8``, ``pv8``, ``vt_packed``, ``block_m``, ``block_n``,
    ``D``, ``DV``, ``mma_dtype``, ``expand_group``, and the base class's ``_row_copy``)."""

    def staging(self, slots_ptr):
        """FP8: e4m3 views ``(64 tokens, 576)`` of the two slots' staging areas.  The raw row-major e4m3 chunk
        ``c`` (64 rows x 64 bytes = 4 KB) lands in the upper half of the slot's fp16 chunk ``c`` (bytes
        ``8192 c + 4096 ..``), where :meth:`expand` turns it into the fp16 chunk in place."""
        raw = cute.recast_ptr(slots_ptr, dtype=cutlass.Float8E4M3FN)
        chunk_bytes = self.block_n * _CHUNK * (self.mma_dtype.width // 8)
        slot_bytes = chunk_bytes * (self.D // _CHUNK)
        if self.vt_packed:  # after V^T and P (pv8_views), 4 KB per chunk
            layout = cute.make_layout((self.block_n, (_CHUNK, self.D // _CHUNK)), stride=(_CHUNK, (1, chunk_bytes // 2)))
            sw = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.block_m, self.block_n, _CHUNK), _F8,
                                               1).inner
            return tuple(cute.make_tensor(cute.recast_ptr(raw + (g * slot_bytes + self._packed_staging_offset()), sw),
                                          layout) for g in range(2))
        layout = cute.make_layout((self.block_n, (_CHUNK, self.D // _CHUNK)), stride=(_CHUNK, (1, chunk_bytes)))
        if self.qk8:  # the QGMMA B operand layout: rows of 64 bytes, 64-byte swizzle (the TMA box's)
            sw = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.block_m, self.block_n, _CHUNK), _F8,
                                               1).inner
            return tuple(cute.make_tensor(cute.recast_ptr(raw + (g * slot_bytes + chunk_bytes // 2), sw), layout)
                         for g in range(2))
        return tuple(cute.make_tensor(raw + (g * slot_bytes + chunk_bytes // 2), layout) for g in range(2))

    @cute.jit
    def expand(self, sKs: cute.Tensor, sSt: cute.Tensor, wg: Int32, wtid: Int32, chunks: cutlass.Constexpr):
        """FP8 with a 16-bit QK (no-op otherwise): :meth:`expand_chunks` of the landed chunks ``chunks``
        before the slot's QK reads them."""
        if cutlass.const_expr(self.fp8 and not self.qk8):
            self.expand_chunks(sKs, sSt, wg, wtid, chunks)

    @cute.jit
    def expand_v(self, sKs: cute.Tensor, sSt: cute.Tensor, wg: Int32, wtid: Int32):
        """FP8 with the QGMMA QK (no-op otherwise): :meth:`expand_chunks` of the V columns (chunks 0..7)
        after the slot's QK retired (it read the e4m3 staging that the upcast overwrites).  The rope chunk
        stays e4m3: only the QK reads it, and P later takes its place.  Both warpgroups' PVs on the slot
        come after: the owner's in program order (the warpgroup barrier at the end), the other
        warpgroup's behind the P_READY barrier its owner arrives at later (after the proxy fence)."""
        if cutlass.const_expr(self.qk8):
            self.expand_chunks(sKs, sSt, wg, wtid, (0, 1, 2, 3, 4, 5, 6, 7))

    @cute.jit
    def expand_chunks(self, sKs: cute.Tensor, sSt: cute.Tensor, wg: Int32, wtid: Int32,
                      chunks: cutlass.Constexpr):
        """FP8: upcast the e4m3 chunks ``chunks`` of a slot's staging into its 16-bit chunks (exact), by the
        128 threads of the slot's QK warpgroup.

        Each group of ``expand_group`` chunks is expanded in place: every thread first reads its 4 x 8 bytes
        of each e4m3 chunk, a warpgroup barrier orders all reads before any write (the 16-bit chunk covers
        the e4m3 bytes), then it writes its 4 x 16 bytes per chunk (thread ``wtid``: rows ``wtid//8 + 16m``,
        columns ``8 (wtid%8)..``).  A proxy fence and a barrier publish the chunks to the wgmmas (async
        proxy).  The barrier id is the warpgroup's :attr:`Barrier.TAIL` id (:meth:`zero_tail` uses it at
        other points of the same 128-thread sequence)."""
        if cutlass.const_expr(self.fp8):  # (also traced, unused, for 16-bit dtypes)
            _, tiled16 = self._row_copy(self.mma_dtype, 128, 8, threads=(16, 8))
            _, tiled8 = self._row_copy(cutlass.Float8E4M3FN, 64, 8, threads=(16, 8))
            thr16 = tiled16.get_slice(wtid)
            thr8 = tiled8.get_slice(wtid)
            g = self.expand_group
            for c0 in cutlass.range_constexpr(0, len(chunks), g):
                grp = chunks[c0:c0 + g]
                f8 = [cute.make_rmem_tensor((8,), cutlass.Float8E4M3FN) for _ in range(4 * len(grp))]
                for c in cutlass.range_constexpr(len(grp)):
                    src = thr8.partition_S(cute.local_tile(sSt, (self.block_n, _CHUNK), (0, grp[c])))
                    for m in cutlass.range_constexpr(4):
                        cute.autovec_copy(src[None, m, 0], f8[4 * c + m])
                cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)
                for c in cutlass.range_constexpr(len(grp)):
                    dst = thr16.partition_D(cute.local_tile(sKs, (self.block_n, _CHUNK), (0, grp[c])))
                    for m in cutlass.range_constexpr(4):
                        b16 = cute.make_rmem_tensor((8,), self.mma_dtype)
                        b16.store(f8[4 * c + m].load().to(self.mma_dtype))
                        cute.autovec_copy(b16, dst[None, m, 0])
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)

    def _packed_staging_offset(self):
        """Packed slot (:attr:`vt_packed`): byte offset of the e4m3 staging, after ``V^T`` (DV x 64) and P (64 x 64)."""
        return (self.DV + self.block_m) * self.block_n

    def pv8_views(self, slots_ptr):
        """FP8 P V (:attr:`pv8`): per slot, the e4m3 ``V^T`` view ``((64 features, 8 chunks), 64 tokens)`` in the
        lower halves of the fp16-sized chunks 0..7 (chunk ``c``'s features at bytes ``8192 c ..``, 4 KB), and
        the e4m3 P tile ``(64 rows, 64 tokens)`` in the lower half of the rope chunk 8.  Both are QGMMA K-major
        operands: 64-byte rows, 64-byte swizzle (``S<2,4,3>``, the staging's).  The upper halves hold the
        landed e4m3 staging (:meth:`staging`), so building ``V^T`` reads one half and writes the other.
        Packed slots (:attr:`vt_packed`): ``V^T`` is ``(512 features, 64 tokens)`` at the slot's start, P right
        after it, the staging after P; the third view returned is the one P is stored through (tokens in
        :data:`P8_TOKEN_ORDER` inside each 16-token group, the order the packed transpose writes ``V^T`` in).
        Returns ``(V^T views, P operand views, P store views)``, one per slot."""
        raw = cute.recast_ptr(slots_ptr, dtype=_F8)
        chunk_bytes = self.block_n * _CHUNK * (self.mma_dtype.width // 8)
        slot_bytes = chunk_bytes * (self.D // _CHUNK)
        sw = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.block_m, self.block_n, _CHUNK), _F8, 1).inner
        vt = cute.make_layout(((_CHUNK, self.DV // _CHUNK), self.block_n), stride=((_CHUNK, chunk_bytes), 1))
        p = cute.make_layout((self.block_m, self.block_n), stride=(self.block_n, 1))
        p_off = (self.D // _CHUNK - 1) * chunk_bytes
        ps_store = p  # the view P is written through (token order)
        if self.vt_packed:  # V^T rows contiguous (one K-major operand of 512 features), P right after
            vt = cute.make_layout((self.DV, self.block_n), stride=(self.block_n, 1))
            p_off = self.DV * self.block_n
            # logical token t = t0 + 2 t12 + 8 t3 + 16 g sits at position t0 + 4 t12 + 2 t3 + 16 g (P8_TOKEN_ORDER)
            ps_store = cute.make_layout((self.block_m, (2, 4, 2, self.block_n // 16)),
                                        stride=(self.block_n, (1, 4, 2, 16)))
        vts = tuple(cute.make_tensor(cute.recast_ptr(raw + g * slot_bytes, sw), vt) for g in range(2))
        ps = tuple(cute.make_tensor(cute.recast_ptr(raw + (g * slot_bytes + p_off), sw), p) for g in range(2))
        pss = tuple(cute.make_tensor(cute.recast_ptr(raw + (g * slot_bytes + p_off), sw), ps_store) for g in range(2))
        return vts, ps, pss

    @cute.jit
    def transpose_v(self, w32: cute.Tensor, zero_row, slot: cutlass.Constexpr, tile_start: Int32, split_end: Int32, wg: Int32,
                    wtid: Int32):
        """FP8 P V: build a slot's ``V^T`` (e4m3, features x tokens, :meth:`pv8_views`) from its landed e4m3
        staging, by the 128 threads of the slot's owner after its QK retired; V rows at or past ``split_end``
        become zeros (P is 0 there and the rows may hold NaN), which replaces :meth:`zero_tail`.

        ``w32``: 32-bit words of both slots.  Each thread transposes 16 blocks of 4 tokens x 4 features
        (4-byte words): 4 word loads from the staging rows, 12 byte permutes (``prmt.b32``), 4 word stores
        into 4 ``V^T`` rows.  Thread ``wtid`` (lane ``l``, warp ``w``) owns token group ``tg = 4 w + l // 8``
        (tokens ``4 tg ..``) and feature words ``fw = l % 8 + 8 h`` (h < 2) of every chunk.  Both the loads
        and the stores of a warp hit 32 distinct banks under the 64-byte swizzle: a thread reads its token
        rows rotated by ``(l >> 4) & 1`` and writes its feature rows rotated by ``(l >> 1) & 3``
        (:func:`vt_word_offsets`, checked in tests/test_compile_sm90_decode.py).  Reads (upper halves) and
        writes (lower halves) never overlap, so no barrier separates them; a proxy fence and a warpgroup
        barrier publish ``V^T`` to the PVs (the other warpgroup's behind the P_READY barrier, as before)."""
        if cutlass.const_expr(self.vt_packed):
            self.transpose_v_packed(w32, zero_row, slot, tile_start, split_end, wg, wtid)
        elif cutlass.const_expr(self.pv8):
            chunk_bytes = self.block_n * _CHUNK * (self.mma_dtype.width // 8)
            base = slot * chunk_bytes * (self.D // _CHUNK)
            lane = wtid % 32
            tg = (wtid // 32) * 4 + lane // 8
            rot_r = (lane >> 4) & 1
            rot_w = (lane >> 1) & 3
            first = split_end - tile_start  # tokens of this tile at or past the split: zero rows
            sel_f = Int32(0x5410)
            if rot_r == 1:
                sel_f = Int32(0x4105)
            # a loop, not unrolled: four copies of the transpose (one per call site) unrolled over 8 chunks made
            # instruction fetch the second stall reason on the H200 (ncu, 2026-12-01: "no_instruction" 0.92 per
            # issued instruction at B64/H32/S4); each batch is 2 chunks x 2 halves, 16 loads in flight
            for c0 in cutlass.range(0, self.DV // _CHUNK, 2, unroll=1):
                regs = []
                for bi in cutlass.range_constexpr(4):
                    c = c0 + bi // 2
                    fw = lane % 8 + 8 * (bi % 2)
                    for s in cutlass.range_constexpr(4):
                        k = (s + rot_r) & 3
                        rd, _ = vt_word_offsets(tg, fw, k, 0)
                        v = w32[(base + c * chunk_bytes + chunk_bytes // 2 + rd) >> 2]
                        if 4 * tg + k >= first:
                            v = Int32(0)
                        regs.append(v)
                for bi in cutlass.range_constexpr(4):
                    c = c0 + bi // 2
                    fw = lane % 8 + 8 * (bi % 2)
                    r = regs[4 * bi:4 * bi + 4]
                    for s in cutlass.range_constexpr(4):
                        i = (s + rot_w) & 3
                        sel = i | ((i + 4) << 4)
                        x = _prmt(r[0], r[1], sel)
                        y = _prmt(r[2], r[3], sel)
                        _, wr = vt_word_offsets(tg, fw, 0, i)
                        w32[(base + c * chunk_bytes + wr) >> 2] = _prmt(x, y, sel_f)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)

    @cute.jit
    def transpose_v_packed(self, w32: cute.Tensor, zero_row, slot: cutlass.Constexpr, tile_start: Int32,
                           split_end: Int32, wg: Int32, wtid: Int32):
        """:meth:`transpose_v` for the packed slot (:attr:`vt_packed`).  Warp ``w`` of the owner transposes tokens
        ``16 w ..`` of all 512 features in blocks of 16 tokens x 32 features: one ``ldmatrix.x4.trans`` (thread
        ``i`` gets tokens ``a, a+1`` and ``a+8, a+9``, ``a = 2 (i % 4)``, of feature pairs ``i // 4`` and
        ``i // 4 + 8``), 4 ``prmt.b32`` into one word per feature (4 tokens, in :data:`P8_TOKEN_ORDER`), one
        ``stmatrix.x4`` into the 16 ``V^T`` rows.  Addressing: :func:`ldsm_row_offset`, :func:`stsm_row_offset`,
        :func:`p8_selectors`, checked with a model of the instructions in tests/test_compile_sm90_decode.py
        (no bank conflicts).  A lane whose ldmatrix row is a token at or past ``split_end`` points it at a 16-byte
        zero row instead (``zero_row``), which zeroes those V rows as :meth:`zero_tail` would."""
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
        for c0 in cutlass.range(0, self.DV // _CHUNK, 2, unroll=1):  # 2 chunks (4 ldmatrix) in flight
            regs = []
            for cc in cutlass.range_constexpr(2):
                regs.append(_ldsm4t(ld0 + (c0 + cc) * cstep))
                regs.append(_ldsm4t(ld1 + (c0 + cc) * cstep))
            for cc in cutlass.range_constexpr(2):
                for hb in cutlass.range_constexpr(2):
                    r = regs[2 * cc + hb]
                    _stsm4((st1 if hb else st0) + (c0 + cc) * (self.block_n * _CHUNK),
                           _prmt(r[0], r[1], sel0), _prmt(r[0], r[1], sel1),
                           _prmt(r[2], r[3], sel0), _prmt(r[2], r[3], sel1))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)

    @cute.jit
    def ready_v(self, sKs: cute.Tensor, sSt: cute.Tensor, w32: cute.Tensor, zero_row, slot: cutlass.Constexpr,
                tile_start: Int32, split_end: Int32, wg: Int32, wtid: Int32):
        """After a slot's QK retired, by its owner: V for the PVs (:meth:`transpose_v` with FP8 P V, else
        :meth:`expand_v`, a no-op for 16-bit inputs)."""
        if cutlass.const_expr(self.pv8):
            self.transpose_v(w32, zero_row, slot, tile_start, split_end, wg, wtid)
        else:
            self.expand_v(sKs, sSt, wg, wtid)

    @cute.jit
    def store_p8(self, acc_s: cute.Tensor, tSsP: cute.Tensor):
        """FP8 P V: P (fp32, already scaled by 2^8) -> e4m3 in the slot's P tile; the proxy fence publishes it
        to wgmma (the caller adds the barrier its readers need)."""
        rP8 = cute.make_rmem_tensor_like(acc_s, _F8)
        rP8.store(acc_s.load().to(_F8))
        cute.autovec_copy(rP8, tSsP)
        cute.arch.fence_view_async_shared()


__all__ = ["P8_TOKEN_ORDER", "Fp8OperandsMixin", "ldsm_row_offset", "p8_selectors", "stsm_row_offset", "sw64",
           "vt_word_offsets"]
