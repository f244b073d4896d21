"""Small device helpers shared by the SM90 kernels (CuTe DSL only)."""

from __future__ import annotations

import enum

import cutlass
from cutlass import Float32, Int32, Int64, cute

LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453


class Barrier(enum.IntEnum):
    """Named barrier ids of the decode kernel (0 is __syncthreads, reserved)."""

    TILE_READY = 1  # a KV tile landed in smem (and the previous tile is fully consumed)
    ROW_MAX = 2  # per-warpgroup row maxima published in smem
    P_READY = 3  # both warpgroups' halves of P are in smem
    ROW_SUM = 4  # per-warpgroup row sums published in smem (epilogue)
    CONVERTED = 5  # FP8: the staged tile is upcast into the bf16 compute tile
    # schedule "seesaw" (producer arrives, consumer syncs; 256 threads)
    SCALE0 = 6  # WG0 folded its tile into the shared row max (sM, scale0 published)
    SCALE1 = 7  # WG1 folded its tile (scale1 published)
    P0_READY = 8  # WG0's P in smem
    P1_READY = 9  # WG1's P in smem (and its cross PV issued; the O^T loop's p1_ready 'store': not)
    # schedule "seesaw" with TMA refills (128 threads of one warpgroup; warps 1-3 arrive, warp 0 syncs and
    # issues): one id per refill site, so no warp can reach a site's next phase before its warp 0 left the
    # last one (a 256-thread barrier separates consecutive uses)
    REFILL_A0 = 10
    REFILL_A1 = 11
    REFILL_B1 = 12
    REFILL_B0 = 13
    # FP8 P V with whole-slot refills (``early_refill``; the refill sites above are unused there): the other
    # warpgroup's cross PV of a slot retired, so its owner may overwrite the slot's V^T and P (producer arrives,
    # owner syncs; 256 threads)
    VT0_FREE = 10
    VT1_FREE = 11
    # ... with the producer warpgroup (``tma_producer``): the slot's owner read its staging (QK retired, V^T built),
    # the producer may refill it (owner arrives, producer warp 0 syncs; 160 threads).  The ids of REFILL_B1 /
    # REFILL_B0, which the 16-bit loop's producer build uses at its refill sites: a build must use one set only
    # (an arrival on the wrong set gave wrong results on the H200, 2026-12-01; the compile test counts them)
    SLOT0_FREE = 12
    SLOT1_FREE = 13
    TAIL = 14  # + warpgroup index: V rows past the split zeroed (all 128 threads sync)


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
    """An ``align``-byte aligned pointer to element ``col`` of ``row`` of a row-major ``[*, row_elems]``
    global tensor (the caller guarantees the alignment)."""
    p = base.iterator + (row * row_elems + col)
    return cute.make_ptr(base.element_type, p.toint(), cute.AddressSpace.gmem, assumed_align=align)


@cute.jit
def clamp(x: Int32, lo: Int32, hi: Int32) -> Int32:
    return cutlass.min(cutlass.max(x, lo), hi)
