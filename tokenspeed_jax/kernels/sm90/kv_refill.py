"""How the seesaw family of sm90 decode loops fills its KV slots (a mixin of
:class:`~tokenspeed_jax.kernels.sm90.mla_decode_seesaw.MlaDecodeSeesawSm90`, so of the loops built on it): the
block-table reads ahead of a refill (cp.async page ids or TMA box coordinates), the cp.async and TMA refills of a slot's
column groups, and the L2 prefetch of later tiles.  Split from the loop by responsibility: the loop decides when a
group is refilled, this module how.  Uses the loop's ``page_size``, ``block_n``, ``box_rows``, ``subs``, ``D``,
``dtype``, ``mma_dtype``, ``use_tma``, ``producer`` and ``kv_evict``.
"""

from __future__ import annotations

import cutlass
from cutlass import Int32, Int64, cute

from tokenspeed_jax.kernels.sm90.helpers import clamp, row_ptr

_CHUNK = 64  # columns per 128-byte swizzle atom row (16-bit)
# MlaDecodeSeesawSm90(kv_evict=...): the L2 cache policy operand of the KV TMA loads (None: no hint); the values are
# the createpolicy encodings CUTLASS uses for its TMA cache hints (cute/arch/copy_sm90_tma.hpp, CacheHintSm90)
KV_EVICT_MODES = {"normal": None, "first": 0x12F0000000000000}


class KvRefillMixin:
    """Block-table reads, refills and L2 prefetch of the KV slots (module docstring)."""

    @cute.jit
    def page_ids(self, mBT: cute.Tensor, b: Int32, tile_start: Int32, split_end: Int32, wtid: Int32):
        """Raw block-table entries of the rows this thread copies in :meth:`load_cols` (tokens
        ``tile_start + wtid//8 + 16m``, m < 4, clamped into the split), loaded ahead of the refill so the
        cp.async issue never waits on them.  Caller guarantees a non-empty split."""
        pgs = cute.make_rmem_tensor((4,), Int32)
        for m in cutlass.range_constexpr(4):
            tok = cutlass.min(tile_start + wtid // 8 + 16 * m, split_end - 1)
            pgs[m] = mBT[b, tok // self.page_size]
        return pgs

    @cute.jit
    def load_cols(self, sKs: cute.Tensor, mKV: cute.Tensor, pgs: cute.Tensor, tile_start: Int32,
                  split_end: Int32, num_pages: Int32, wtid: Int32, chunks: cutlass.Constexpr):
        """cp.async (no commit) of the 64-column chunks ``chunks`` (a tuple of chunk indices) of all 64 token
        rows of one tile into slot ``sKs``, by the 128 threads of one warpgroup: thread ``wtid`` copies rows
        ``wtid//8 + 16m`` (m < 4), 16-byte pieces ``wtid%8`` of every chunk.  Tokens at or past
        ``split_end`` are redirected to the last one (finite, masked); page ids (``pgs`` from
        :meth:`page_ids`) are clamped to ``[0, num_pages)``."""
        rows = self.gather_rows(pgs, tile_start, split_end, num_pages, wtid, 8)
        atom, tiled = self._row_copy(self.mma_dtype, 128, 8, threads=(16, 8))
        thr = tiled.get_slice(wtid)
        for c in cutlass.range_constexpr(len(chunks)):
            sX = cute.local_tile(sKs, (self.block_n, _CHUNK), (0, chunks[c]))
            tX = thr.partition_D(sX)  # (CPY, 4, 1)
            for m in cutlass.range_constexpr(4):
                dst = tX[None, m, 0]
                src = cute.make_tensor(row_ptr(mKV, rows[m], chunks[c] * _CHUNK + (wtid % 8) * 8, self.D, 16),
                                       dst.layout)
                cute.copy(atom, src, dst)

    @cute.jit
    def fill(self, sKs, mbar_ptr, mKV, pgs, tile_start, split_end, num_pages, wtid, chunks: cutlass.Constexpr):
        """Refill a column group of one slot and arrive on its mbarrier when this thread's copies land."""
        self.load_cols(sKs, mKV, pgs, tile_start, split_end, num_pages, wtid, chunks)
        cute.arch.cp_async_mbarrier_arrive_noinc(mbar_ptr)

    @cute.jit
    def tma_coords(self, mBT: cute.Tensor, b: Int32, tile_start: Int32, split_end: Int32, num_pages: Int32):
        """TMA coordinates of a tile's ``subs`` boxes, loaded ahead of the refill: ``(page, row block)`` of
        token ``tile_start + s * box_rows`` clamped into the split (boxes past ``split_end`` load finite
        rows of an in-range page; they are masked in S and zeroed in V by :meth:`zero_tail`), page ids
        clamped to ``[0, num_pages)``.  Caller guarantees a non-empty split."""
        crd = cute.make_rmem_tensor((self.subs, 2), Int32)
        for s in cutlass.range_constexpr(self.subs):
            tok = cutlass.min(tile_start + s * self.box_rows, split_end - 1)
            crd[s, 0] = clamp(mBT[b, tok // self.page_size], 0, num_pages - 1)
            crd[s, 1] = (tok % self.page_size) // self.box_rows
        return crd

    @cute.jit
    def l2_prefetch_tile(self, mKV: cute.Tensor, crd: cute.Tensor, tile_start: Int32, split_end: Int32):
        """One thread: ``cp.async.bulk.prefetch.L2`` of the cache rows of the tile starting at token
        ``tile_start`` (``crd``: its :meth:`tma_coords`), one contiguous range of ``box_rows`` rows (576
        elements each) per box; nothing for a tile at or past ``split_end``.  The coordinates are clamped as
        a refill's are, so every range lies inside the cache.  A prefetch is a hint: it writes nothing, and
        the refill that later reads the same rows finds them in L2 instead of waiting for HBM
        (docs/sm90_decode.md, "L2 prefetch").  Inline PTX, an effectful op that is never dropped.

        Issued by one thread of row block 0 only: the CTAs of the other row blocks of the request read the
        same rows at about the same time and find them in L2 too.  (H200, 2026-12-01, against no prefetch:
        with every row block prefetching, H128 S4 / S8 (8 / 16 row blocks) ran 2.7% / 2.5% slower; with
        row block 0 alone 2.4% / 0.8%.)"""
        nbytes = self.box_rows * self.D * (self.dtype.width // 8)
        if tile_start < split_end:
            for s in cutlass.range_constexpr(self.subs):
                row = Int64(crd[s, 0]) * self.page_size + crd[s, 1] * self.box_rows
                cute.arch.inline_ptx("cp.async.bulk.prefetch.L2.global [{$r0}], {$r1};",
                                     read_only_args=[row_ptr(mKV, row, 0, self.D, 16).toint(), Int32(nbytes)])

    @cute.jit
    def l2_prefetch_pair(self, mKV: cute.Tensor, crd0: cute.Tensor, crd1: cute.Tensor, pair_start: Int32,
                         split_end: Int32):
        """:meth:`l2_prefetch_tile` of both tiles of the pair starting at token ``pair_start``."""
        self.l2_prefetch_tile(mKV, crd0, pair_start, split_end)
        self.l2_prefetch_tile(mKV, crd1, pair_start + self.block_n, split_end)

    @cute.jit
    def refill(self, sKs, tAs, tAg, tma_atom, mbar_ptr, mKV, pgs, tile_start, split_end, num_pages, wg, wtid,
               chunks: cutlass.Constexpr, bar: cutlass.Constexpr, cbar=None):
        """Refill the 64-column chunks ``chunks`` of one slot, completing the mbarrier ``mbar_ptr``.

        TMA: the first warp of the warpgroup issues ``subs`` boxes per chunk (one elected lane) after an
        arrive-and-expect-tx of the group's bytes by its lane 0; with a barrier id ``bar`` (every refill
        after the columns' last wgmma) the other warps first arrive on it, i.e. their share of that wgmma
        has retired.  With ``cbar`` (the slot's 9 per-chunk mbarriers, the transposed 16-bit loop's
        ``chunk_bars``) chunk ``c`` completes ``cbar + c`` instead, so a QK can start on the first chunk to land.
        cp.async: :meth:`fill`."""
        if cutlass.const_expr(self.producer and bar is not None):  # a loop site: the producer issues (:meth:`produce`)
            cute.arch.barrier_arrive(barrier_id=int(bar), number_of_threads=160)
        elif cutlass.const_expr(self.use_tma):
            if cutlass.const_expr(bar is not None):
                if wtid < 32:
                    cute.arch.barrier(barrier_id=int(bar), number_of_threads=128)
                else:
                    cute.arch.barrier_arrive(barrier_id=int(bar), number_of_threads=128)
            if wtid < 32:  # the whole warp: the TMA copy elects its issuing lane (elect.sync)
                chunk_bytes = self.block_n * _CHUNK * (self.dtype.width // 8)
                if wtid == 0:
                    if cutlass.const_expr(cbar is None):
                        cute.arch.mbarrier_arrive_and_expect_tx(mbar_ptr, len(chunks) * chunk_bytes)
                    else:
                        for c in cutlass.range_constexpr(len(chunks)):
                            cute.arch.mbarrier_arrive_and_expect_tx(cbar + chunks[c], chunk_bytes)
                hint = {}
                if cutlass.const_expr(KV_EVICT_MODES[self.kv_evict] is not None):
                    hint["cache_policy"] = Int64(KV_EVICT_MODES[self.kv_evict])
                for c in cutlass.range_constexpr(len(chunks)):
                    done = mbar_ptr if cbar is None else cbar + chunks[c]  # (static: cbar is None or a pointer)
                    for sb in cutlass.range_constexpr(self.subs):
                        cute.copy(tma_atom, tAg[None, pgs[sb, 1], chunks[c], pgs[sb, 0]], tAs[None, sb, chunks[c]],
                                  tma_bar_ptr=done, **hint)
        else:
            self.fill(sKs, mbar_ptr, mKV, pgs, tile_start, split_end, num_pages, wtid, chunks)

    @cute.jit
    def coords(self, mBT, b, tile_start, split_end, num_pages, wtid):
        """Load-ahead operands of :meth:`refill` for one tile (TMA box coordinates or cp.async page ids)."""
        if cutlass.const_expr(self.use_tma):
            return self.tma_coords(mBT, b, tile_start, split_end, num_pages)
        else:
            return self.page_ids(mBT, b, tile_start, split_end, wtid)


__all__ = ["KV_EVICT_MODES", "KvRefillMixin"]
