"""Small device helpers shared by the SM90 kernels (CuTe DSL only)."""

from __future__ import annotations

import enum

import cutlass
from cutlass import Float32, Int32, Int64, cute

LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453


class Barrier(enum.IntEnum):
    """Named barrier ids of the decode kernels (0 is __syncthreads, reserved)."""

    ROW_SUM = 4  # per-warpgroup row sums published in smem (epilogue; the own-tiles loop's merge)
    # the seesaw handoffs between the two computing warpgroups (producer arrives, consumer syncs; 256 threads)
    SCALE0 = 6  # WG0 folded its tile into the shared row max (sM, scale0 published)
    SCALE1 = 7  # WG1 folded its tile (scale1 published)
    P0_READY = 8  # WG0's P in smem
    P1_READY = 9  # WG1's P in smem
    # 16-bit loops' refill sites, one id each so no warp reaches a site's next phase before the issuing warp left the
    # last: 128 threads (warps 1-3 arrive, warp 0 syncs and issues), 160 with the producer (its warp 0 syncs, issues)
    REFILL_A0 = 10
    REFILL_A1 = 11
    REFILL_B1 = 12
    REFILL_B0 = 13
    VT1_FREE = 11  # FP8 O^T loops: WG0's cross PV of slot 1 retired (WG0 arrives, WG1 syncs; 256 threads)
    # FP8 O^T loops: a buffer's readers are done, the producer may refill it (a computing warpgroup arrives, producer's
    # warp 0 syncs; 160 threads).  Ids 11-13 double as refill ids: a build uses one set (the compile test counts them)
    SLOT0_FREE = 12
    SLOT1_FREE = 13
    TAIL = 14  # + warpgroup index: one warpgroup's 128 threads (its P stored, column maxima exchanged, V rows zeroed)


@cute.jit
def quad_max(x: Float32) -> Float32:
    """Max over the 4 lanes of a quad (the lanes that share one accumulator row)."""
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return x


@cute.jit
def quad_sum(x: Float32) -> Float32:
    """Sum over the 4 lanes of a quad."""
    x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
    x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
    return x


@cute.jit
def row_ptr(base: cute.Tensor, row: Int64, col, row_elems: cutlass.Constexpr[int], align: cutlass.Constexpr[int]):
    """An ``align``-byte aligned pointer (the caller guarantees it) to element ``col`` of ``row`` of a row-major
    ``[*, row_elems]`` global tensor."""
    p = base.iterator + (row * row_elems + col)
    return cute.make_ptr(base.element_type, p.toint(), cute.AddressSpace.gmem, assumed_align=align)


@cute.jit
def clamp(x: Int32, lo: Int32, hi: Int32) -> Int32:
    return cutlass.min(cutlass.max(x, lo), hi)


# Non-finite values out of packed words by branch-free integer expressions, valid on the DSL's Int32 and numpy int32
# alike (+ and - wrap, >> is arithmetic and masked after), so tests/test_compile_sm90_decode.py checks them on every
# bit pattern; applied to the V of the keys a causal step hides from some query rows (``MlaDecodeSm90.hidden_keys``).
_SIGN16X2 = 0x80008000 - (1 << 32)  # bit 15 of each 16-bit half (as a signed 32-bit constant)
_SIGN8X4 = 0x80808080 - (1 << 32)  # bit 7 of each byte


def clear_nonfinite_16x2(w, exp_mask: int):
    """``w`` (two 16-bit floats in a 32-bit word) with each Inf or NaN half replaced by +0; ``exp_mask``: the exponent
    field (0x7F80 bfloat16, 0x7C00 float16).  A half is non-finite iff its exponent is all ones: ``u`` is 0 just there,
    ``u + 0x7FFF`` sets bit 15 of the other halves (no carry leaves a half), ``0x8000 | 0x8000 - 1`` spreads it."""
    e2 = exp_mask | (exp_mask << 16)
    u = (w & e2) ^ e2
    bad = ((u + 0x7FFF7FFF) & _SIGN16X2) ^ _SIGN16X2
    return w & ((bad | (bad - ((bad >> 15) & 0x00010001))) ^ -1)


def clear_nan_e4m3x4(w):
    """``w`` (four e4m3fn bytes in a 32-bit word) with each NaN byte (0x7F, 0xFF; e4m3fn has no Inf) replaced by 0:
    ``(b & 0x7F) + 1`` sets bit 7 of a byte iff it is NaN (no carry leaves a byte), which spreads to the byte."""
    bad = ((w & 0x7F7F7F7F) + 0x01010101) & _SIGN8X4
    return w & ((bad | (bad - ((bad >> 7) & 0x01010101))) ^ -1)

