"""How the decode loops fill their KV slots (a mixin of the loops): the cache's TMA atom and partitions, the block-table
reads ahead of a refill (TMA box coordinates) and the TMA refills of a slot's 64-column chunks, completing an mbarrier;
the loop decides when a group is refilled, this module how.  Uses the loop's ``page_size``, ``block_m``, ``block_n``,
``box_rows``, ``subs``, ``dtype`` and ``producer``.

The cache is viewed as ``(page_size, 576, num_pages)``; a TMA box is ``box_rows = min(page_size, 64)`` rows x 64 columns
in a slot's 64-column chunk layout (16-bit: 128-byte swizzle; e4m3: QGMMA B, 64-byte swizzle), ``subs = 64 / box_rows``
a chunk.  Page ids are clamped to ``[0, num_pages)``, tokens into the split: no box is out of bounds; a partial last
tile's rows past the split may hold anything (page tails, unowned NaN pages): loops mask them in S, zero them in V."""

from __future__ import annotations

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, cute
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum

from tokenspeed_jax.kernels.sm90.helpers import clamp

_CHUNK = 64  # columns per 64-column chunk (128 bytes of 16-bit values, 64 of e4m3)


class KvRefillMixin:
    """Block-table reads and TMA refills of the KV slots (module docstring)."""

    def kv_tma(self, kv: cute.Tensor):
        """``(atom, tensor)`` of the cache's TMA loads (traced in ``__call__``; view and box: module docstring)."""
        kv_t = cute.make_tensor(kv.iterator, cute.select(kv.layout, mode=[1, 2, 0]))
        box = cute.select(sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (self.block_m, self.box_rows, _CHUNK),
                                                        self.dtype, 1), mode=[0, 1])
        return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), kv_t, box, (self.box_rows, _CHUNK))

    def kv_partitions(self, tma_atom: cute.CopyAtom, tma_kv: cute.Tensor, dsts):
        """The TMA partitions of the refills (in the kernel's prologue): ``([the partition of each slot of dsts],
        the cache's)``; boxes: (page row block, chunk, page) -> slot (sub-box, chunk)."""
        gKV = cute.group_modes(cute.local_tile(tma_kv, (self.box_rows, _CHUNK), (None, None, None)), 0, 2)
        tAs = []
        for dst in dsts:
            t, tAg = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(
                cute.local_tile(dst, (self.box_rows, _CHUNK), (None, None)), 0, 2), gKV)
            tAs.append(t)
        return tAs, tAg

    @cute.jit
    def coords(self, mBT: cute.Tensor, b: Int32, tile_start: Int32, split_end: Int32, num_pages: Int32, wtid=None):
        """TMA coordinates of a tile's ``subs`` boxes, loaded ahead of the refill: ``(page, row block)`` of token
        ``tile_start + s * box_rows`` clamped into the split (non-empty), page ids into ``[0, num_pages)``."""
        crd = cute.make_rmem_tensor((self.subs, 2), Int32)
        for s in cutlass.range_constexpr(self.subs):
            tok = cutlass.min(tile_start + s * self.box_rows, split_end - 1)
            crd[s, 0] = clamp(mBT[b, tok // self.page_size], 0, num_pages - 1)
            crd[s, 1] = (tok % self.page_size) // self.box_rows
        return crd

    @cute.jit
    def refill(self, tAs, tAg, tma_atom, mbar_ptr, crd, wtid, chunks: cutlass.Constexpr, bar: cutlass.Constexpr):
        """Refill the 64-column chunks ``chunks`` of one slot (``tAs``: its TMA partition; ``crd``: the tile's
        :meth:`coords`), completing the mbarrier ``mbar_ptr``: the calling warpgroup's first warp issues ``subs`` boxes
        per chunk (one elected lane) after its lane 0's arrive-and-expect-tx of the group's bytes.  With a barrier id
        ``bar`` (a refill after the columns' last wgmma) the other warps first arrive on it (their share of it retired);
        with :attr:`producer` a loop site only arrives on ``bar`` (160 threads) and the producer warpgroup issues."""
        if cutlass.const_expr(self.producer and bar is not None):  # a loop site: the producer issues
            cute.arch.barrier_arrive(barrier_id=int(bar), number_of_threads=160)
        else:
            if cutlass.const_expr(bar is not None):
                if wtid < 32:
                    cute.arch.barrier(barrier_id=int(bar), number_of_threads=128)
                else:
                    cute.arch.barrier_arrive(barrier_id=int(bar), number_of_threads=128)
            if wtid < 32:  # the whole warp: the TMA copy elects its issuing lane (elect.sync)
                chunk_bytes = self.block_n * _CHUNK * (self.dtype.width // 8)
                if wtid == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar_ptr, len(chunks) * chunk_bytes)
                for c in cutlass.range_constexpr(len(chunks)):
                    for sb in cutlass.range_constexpr(self.subs):
                        cute.copy(tma_atom, tAg[None, crd[sb, 1], chunks[c], crd[sb, 0]], tAs[None, sb, chunks[c]],
                                  tma_bar_ptr=mbar_ptr)


__all__ = ["KvRefillMixin"]
