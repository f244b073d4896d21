"""Absorbed-MLA paged decode for Hopper (SM90), CuTe DSL: main kernel + split-KV combine kernel.

Contract: ``tokenspeed_jax.decode`` module docstring (cache row layout, mask, LSE, clamping).

Structure (phase 1 of ``shared/design/sm90_mla_decode.md``, correctness first):

* One CTA = (64-row tile of the ``R = S*H`` query rows of one request, one KV split).  Rows are
  ``r = s*H + h`` (heads fastest), so the KV stream of a request is read once for all S tokens and all
  heads of a tile.  Rows past R are computed on a clamped copy of row R-1 and never stored.
* 256 threads = 2 math warpgroups.  Each ``block_n``-token KV tile (block_n x 576) is gathered through the
  block table with 16-byte ``cp.async`` into a ring of ``stages`` 128B-swizzled K-major smem tiles
  (``stages - 1`` tiles stream in while one is computed; the refill is issued right after the QK wgmmas
  so its block-table reads overlap them).  ``block_n = 64`` with 2 stages is what the planner uses;
  ``block_n = 32`` with 4 stages also exists (more bytes in flight) but measured ~20% slower on H200 because
  its 64x16 QK wgmmas re-read Q from smem twice as often.  cp.async rather than TMA because it handles
  every page size (16..256) and per-token clamping with one code path.
* FP8 (e4m3 q and kv, bf16 out): q is upcast to bf16 once while loading; KV tiles land as raw e4m3 in a
  staging ring (cp.async, ``stages`` deep) and are upcast (exactly) into one bf16 tile before the MMAs, so
  the math is the BF16 path's (bf16 wgmma, fp32 accumulation, P rounded to bf16).  HBM traffic is the
  FP8 bytes; FP8 tensor cores (QGMMA + V transpose) are future work.
* Warpgroup g computes ``S_g = Q K[32g:32g+32]^T`` (wgmma SS, 64x32x576), the two warpgroups exchange row
  maxima through smem, write bf16/fp16 ``P`` halves to one 64x64 swizzled smem tile, then each computes
  ``O[:, 256g:256g+256] += P V`` (wgmma SS, 64x256x64) with V an MN-major view of the same K tile (no copy).
* Online softmax in the exp2 domain, fp32 statistics; masked scores are -inf, a row whose max is still
  -inf uses 0 as its reference so exp2 gives exact zeros.  Tokens past a request's length are loaded from
  its last valid token (finite data, weight exactly 0), so NaN in pages it does not own never reaches a
  product.  seq_len is clamped to ``[0, max_pages*page_size]``, page ids to ``[0, num_pages)``.
* ``num_splits == 1``: the main kernel writes ``out`` (scaled by ``output_scale``) and ``lse``.  Otherwise it
  writes normalised fp32 partials ``o_accum[B, splits, R, 512]`` and natural-log ``lse_accum[B, splits, R]``
  (-inf for an empty split) and :meth:`combine_kernel` merges them in fixed split order (deterministic).
* ``softmax_scale`` and ``output_scale`` are read at run time from float32 device arrays of shape (1,).
* ``schedule`` (compile-time): ``"lockstep"`` is the loop above (its code is unchanged by the option: same
  PTX).  ``"overlap"`` (opt-in, ``block_n`` 64) computes bitwise the same result with a shorter per-tile
  chain: for 16-bit inputs :meth:`MlaDecodeSm90.mainloop_overlap` issues PV(i-1) before waiting for tile i,
  so TILE_READY and the QK(i) issue run under PV(i-1) and QK(i) queues behind it on the tensor cores; each
  warpgroup refills its own V half (+ half the rope columns) of the free slot as soon as its PV(i-1) retired
  (``wait_group(1)``), from block-table entries loaded one tile ahead; O's rescale is skipped when no row
  max of the warp moved.  FP8 keeps the lockstep loop (its upcast overwrites the bf16 tile PV reads) with
  only the rescale skip.
"""

from __future__ import annotations

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, cute
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from tokenspeed_jax.kernels.sm90.helpers import LN_2, LOG2_E, Barrier, clamp, quad_max, quad_sum, row_ptr

SCHEDULES = ("lockstep", "overlap")  # this class; "seesaw" is mla_decode_seesaw.MlaDecodeSeesawSm90
PAD_ROWS = ("copy", "zero")  # what a row block's rows past R hold (MlaDecodeSm90.pad_zero)
_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float8_e4m3fn": cutlass.Float8E4M3FN}


class MlaDecodeSm90:
    """Static configuration of one decode kernel (see module docstring).

    Args: dtype ("bfloat16" | "float16" | "float8_e4m3fn"), num_heads H, q_len S, page_size, causal,
    num_splits, tokens_per_split (multiple of block_n), block_n (32 | 64), head_dim D (576),
    kv_lora_rank (512).
    """

    block_m = 64
    num_threads = 256

    def __init__(self, *, dtype: str, num_heads: int, q_len: int, page_size: int, causal: bool,
                 num_splits: int, tokens_per_split: int, block_n: int = 64, head_dim: int = 576,
                 kv_lora_rank: int = 512, schedule: str = "lockstep", pdl: bool = True, pdl_main: bool = False,
                 pad_rows: str = "copy"):
        why = self.can_implement(dtype=dtype, num_heads=num_heads, q_len=q_len, page_size=page_size,
                                 tokens_per_split=tokens_per_split, head_dim=head_dim,
                                 kv_lora_rank=kv_lora_rank)
        if why:
            raise ValueError(why)
        if block_n not in (32, 64) or tokens_per_split % block_n:
            raise ValueError(f"block_n must be 32 or 64 and divide tokens_per_split, got {block_n}, {tokens_per_split}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if schedule == "overlap" and block_n != 64:
            raise ValueError(f"schedule 'overlap' needs block_n 64, got {block_n}")
        if pad_rows not in PAD_ROWS:
            raise ValueError(f"pad_rows: expected one of {PAD_ROWS}, got {pad_rows!r}")
        self.dtype_name = dtype
        self.dtype = _DTYPES[dtype]
        self.fp8 = dtype == "float8_e4m3fn"
        self.mma_dtype = cutlass.BFloat16 if self.fp8 else self.dtype  # operand dtype in smem / wgmma
        self.out_dtype = cutlass.BFloat16 if self.fp8 else self.dtype
        self.block_n = block_n
        # ring depth: fills ~225 KB of smem (see docs/sm90_decode.md for the budget)
        self.stages = {(False, 64): 2, (False, 32): 4, (True, 64): 2, (True, 32): 6}[(self.fp8, block_n)]
        self.H, self.S = num_heads, q_len
        self.R = num_heads * q_len
        self.page_size = page_size
        self.causal = causal
        self.num_splits = num_splits
        self.tokens_per_split = tokens_per_split
        self.D, self.DV = head_dim, kv_lora_rank
        self.num_m_blocks = -(-self.R // self.block_m)
        # schedule "overlap" (opt-in, see the module docstring): block-table prefetch one tile ahead, O
        # rescale skipped when no row max moved, and (16-bit inputs) PV(i) left in flight under QK(i+1).
        self.schedule = schedule
        self.overlap = schedule == "overlap"
        self.defer_pv = self.overlap and not self.fp8
        # split-KV: launch the combine kernel with programmatic dependent launch (see combine_kernel)
        self.pdl = bool(pdl)
        # the main kernel itself launched with PDL too (:meth:`allow_combine_launch`): its CTAs may take SMs while the
        # previous kernel of the stream drains, and wait for it to complete before their first global read
        self.pdl_main = bool(pdl_main)
        # the tile rows past R (a row block of R < 64 query rows): "copy" loads row R-1 into them (finite, its scores
        # computed and never stored); "zero" loads zeros and masks every key of theirs, so the padded rows of both
        # matmuls' A operands are zeros (q) and exact zeros (P) -- the same results, less switching in the tensor
        # cores, which lowers the power draw and so raises the SM clock under sustained load (docs/sm90_decode.md,
        # "Power")
        self.pad_zero = pad_rows == "zero"

    @staticmethod
    def can_implement(*, dtype, num_heads, q_len, page_size, tokens_per_split, head_dim, kv_lora_rank):
        if dtype not in _DTYPES:
            return f"dtype {dtype} not in {tuple(_DTYPES)}"
        if head_dim != 576 or kv_lora_rank != 512:
            return f"head_dim/kv_lora_rank must be 576/512 (DeepSeek MLA), got {head_dim}/{kv_lora_rank}"
        if not 1 <= num_heads <= 128 or not 1 <= q_len <= 16:
            return f"num_heads in 1..128 and q_len in 1..16 required, got {num_heads}, {q_len}"
        if page_size < 8 or page_size & (page_size - 1):
            return f"page_size must be a power of two >= 8, got {page_size}"
        if tokens_per_split % 64:
            return f"tokens_per_split must be a multiple of 64, got {tokens_per_split}"
        return None

    # ------------------------------------------------------------------------------------------ host
    def _layouts(self):
        dt = self.mma_dtype
        tile_qk = (self.block_m, self.block_n, self.D)
        q_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile_qk, dt, 1)
        k_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile_qk, dt, 1 if self.fp8 else self.stages)
        # V = MN-major view (d, token) of one K stage: same bytes, 128B swizzle, K (token) tiled first.
        v_layout = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (self.block_m, self.DV, self.block_n), dt, 1)
        p_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (self.block_m, self.DV // 2, self.block_n),
                                                 dt, 1)
        # FP8 staging ring: raw e4m3 rows, row-major (not an MMA operand)
        st_layout = cute.make_layout((self.block_n, self.D, self.stages),
                                     stride=(self.D, 1, self.block_n * self.D))
        return q_layout, k_layout, v_layout, p_layout, st_layout

    @cute.jit
    def __call__(self, stream, q: cute.Tensor, kv: cute.Tensor, block_table: cute.Tensor, seq_lens: cute.Tensor,
                 softmax_scale: cute.Tensor, output_scale: cute.Tensor, out: cute.Tensor, lse: cute.Tensor, o_accum: cute.Tensor = None,
                 lse_accum: cute.Tensor = None):
        dt = self.mma_dtype
        q_layout, k_layout, v_layout, p_layout, st_layout = self._layouts()
        st_elems = cute.cosize(st_layout) if cutlass.const_expr(self.fp8) else 0
        qk_mma = sm90_utils.make_trivial_tiled_mma(
            dt, dt, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32, (1, 1, 1),
            (self.block_m, self.block_n // 2))
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            dt, dt, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32, (1, 1, 1),
            (self.block_m, self.DV // 2))

        @cute.struct
        class Storage:
            row_max: cute.struct.MemRange[Float32, 2 * 64]
            row_sum: cute.struct.MemRange[Float32, 2 * 64]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(k_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(p_layout)], 1024]
            sSt: cute.struct.Align[cute.struct.MemRange[cutlass.Float8E4M3FN, st_elems], 1024]

        self.kernel(qk_mma, pv_mma, q, kv, block_table, seq_lens, softmax_scale, output_scale, out, lse, o_accum, lse_accum,
                    q_layout, k_layout, v_layout, p_layout, st_layout, Storage).launch(
            grid=(self.num_m_blocks, self.num_splits, q.shape[0]), block=(self.num_threads, 1, 1),
            smem=Storage.size_in_bytes(), stream=stream, min_blocks_per_mp=1, use_pdl=self.pdl_main)
        if cutlass.const_expr(self.num_splits > 1):
            self.launch_combine(stream, o_accum, lse_accum, output_scale, out, lse, q.shape[0])

    # ---------------------------------------------------------------------------------------- device
    def _row_copy(self, dtype, bits: int, vals: int, threads=(32, 8)):
        """Tiled copy over ``threads`` = (rows, threads per row) threads (default 256: 32 x 8), ``vals``
        contiguous elements each; cp.async for 16-byte copies of 16-bit data."""
        if bits == 128 and dtype.width == 16:
            op = cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL)
        else:
            op = cute.nvgpu.CopyUniversalOp()
        atom = cute.make_copy_atom(op, dtype, num_bits_per_copy=bits)
        return atom, cute.make_tiled_copy_tv(atom, cute.make_ordered_layout(threads, order=(1, 0)),
                                             cute.make_layout((1, vals)))

    @cute.jit
    def gather_rows(self, pgs: cute.Tensor, tile_start: Int32, split_end: Int32, num_pages: Int32, wtid: Int32,
                    threads_per_row: cutlass.Constexpr[int]):
        """Global cache rows of the tile rows thread ``wtid`` of a warpgroup copies when each row is split
        over ``threads_per_row`` threads: tokens ``tile_start + wtid // threads_per_row + (128 //
        threads_per_row) * m`` (m < size of ``pgs``, their raw block-table entries, clamped here to
        ``[0, num_pages)``), redirected to the split's last token at or past ``split_end`` (finite, masked)."""
        rows = cute.make_rmem_tensor((cute.size(pgs),), Int64)
        for m in cutlass.range_constexpr(cute.size(pgs)):
            tok = cutlass.min(tile_start + wtid // threads_per_row + (128 // threads_per_row) * m, split_end - 1)
            rows[m] = Int64(clamp(pgs[m], 0, num_pages - 1)) * self.page_size + tok % self.page_size
        return rows

    @cute.jit
    def load_rows(self, sX: cute.Tensor, base: cute.Tensor, rows: cute.Tensor, tid: Int32,
                  zero_neg: cutlass.Constexpr = False):
        """cp.async 16-bit rows: smem row 32m + t//8 <- global row ``rows[m]`` of ``base`` (row-major, D
        wide); thread t copies the 16-byte chunks (t % 8) + 8k.  ``zero_neg``: a negative ``rows[m]`` (a padded
        q row, :meth:`q_rows`) stores zeros instead (plain stores: the reader's proxy fence publishes them)."""
        atom, tiled = self._row_copy(self.mma_dtype, 128, 8)
        tXsX = tiled.get_slice(tid).partition_D(sX)  # (CPY, rows/32, 9)
        for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
            for k in cutlass.range_constexpr(cute.size(tXsX, mode=[2])):
                dst = tXsX[None, m, k]
                if cutlass.const_expr(zero_neg):
                    if rows[m] < 0:
                        z = cute.make_rmem_tensor((8,), self.mma_dtype)
                        z.fill(0.0)
                        cute.autovec_copy(z, dst)
                    else:
                        self.copy_chunk(atom, base, rows[m], (tid % 8) * 8 + 64 * k, dst)
                else:
                    self.copy_chunk(atom, base, rows[m], (tid % 8) * 8 + 64 * k, dst)

    @cute.jit
    def copy_chunk(self, atom: cute.CopyAtom, base: cute.Tensor, row: Int64, col, dst: cute.Tensor):
        """One 16-byte cp.async of :meth:`load_rows`: elements ``col..col+7`` of global ``row`` into ``dst``."""
        cute.copy(atom, cute.make_tensor(row_ptr(base, row, col, self.D, 16), dst.layout), dst)

    @cute.jit
    def split_range(self, mBT: cute.Tensor, mSeq: cute.Tensor, b: Int32, split: Int32):
        """``(seq, split_start, split_end)`` of request ``b``'s KV split: seq_len clamped to
        ``[0, max_pages * page_size]``; the split covers ``[split_start, split_end)`` (empty if
        ``split_end <= split_start``)."""
        seq = clamp(mSeq[b], 0, mBT.shape[1] * self.page_size)
        split_start = split * self.tokens_per_split
        split_end = cutlass.min(split_start + self.tokens_per_split, seq)
        return seq, split_start, split_end

    @cute.jit
    def q_rows(self, mblk: Int32, b: Int32, tid: Int32):
        """Global q rows ``[B*R]`` of the two tile rows ``tid//8 + 32m`` this thread loads; rows past R are
        a clamped copy of row R-1 (finite, never stored), or -1 (load zeros) with ``pad_rows="zero"``."""
        qrows = cute.make_rmem_tensor((2,), Int64)
        for m in cutlass.range_constexpr(2):
            r0 = mblk * self.block_m + tid // 8 + 32 * m
            r = cutlass.min(r0, self.R - 1)
            qrows[m] = Int64(b) * self.R + r
            if cutlass.const_expr(self.pad_zero):  # noqa: SIM102 (static + dynamic test)
                if r0 >= self.R:
                    qrows[m] = Int64(-1)
        return qrows

    @cute.jit
    def row_limits(self, tScS: cute.Tensor, mblk: Int32, seq: Int32, split_end: Int32):
        """``(row_in, lim)``: the tile rows of this thread's two accumulator rows and the first masked key
        of each (bottom-right causal: ``seq - S + 1 + s``; else ``seq``; at most ``split_end``)."""
        row_in = cute.make_rmem_tensor((2,), Int32)
        row_in[0] = tScS[0][0]
        row_in[1] = tScS[2][0]
        lim = cute.make_rmem_tensor((2,), Int32)
        for h in cutlass.range_constexpr(2):
            s_tok = (mblk * self.block_m + row_in[h]) // self.H
            lim_h = seq
            if cutlass.const_expr(self.causal):
                lim_h = seq - self.S + 1 + s_tok
            lim[h] = cutlass.min(lim_h, split_end)
            if cutlass.const_expr(self.pad_zero):  # noqa: SIM102 (static + dynamic test)
                if mblk * self.block_m + row_in[h] >= self.R:
                    lim[h] = 0  # a padded row: every key masked, P exactly 0
        return row_in, lim

    @cute.jit
    def load_q_fp8(self, sQ: cute.Tensor, mQ: cute.Tensor, rows: cute.Tensor, tid: Int32):
        """e4m3 q rows -> bf16 smem (exact upcast), synchronous 8-byte global loads."""
        _, tiled = self._row_copy(self.mma_dtype, 128, 8)
        tXsQ = tiled.get_slice(tid).partition_D(sQ)
        for m in cutlass.range_constexpr(cute.size(tXsQ, mode=[1])):
            for k in cutlass.range_constexpr(cute.size(tXsQ, mode=[2])):
                row = rows[m]
                if cutlass.const_expr(self.pad_zero):
                    row = cutlass.max(row, Int64(0))  # (-1: a zero row, q_rows; row 0 is read and replaced)
                src = cute.make_tensor(row_ptr(mQ, row, (tid % 8) * 8 + 64 * k, self.D, 8), cute.make_layout(8))
                f8 = cute.make_rmem_tensor((8,), cutlass.Float8E4M3FN)
                cute.autovec_copy(src, f8)
                b16 = cute.make_rmem_tensor((8,), self.mma_dtype)
                b16.store(f8.load().to(self.mma_dtype))
                if cutlass.const_expr(self.pad_zero):  # noqa: SIM102 (static + dynamic test)
                    if rows[m] < 0:  # a zero row (q_rows)
                        b16.fill(0.0)
                cute.autovec_copy(b16, tXsQ[None, m, k])

    @cute.jit
    def kv_rows(self, mBT, b, tile_start, split_end, num_pages, tid, count: cutlass.Constexpr[int],
                stride: cutlass.Constexpr[int], first):
        """Global cache rows of tokens ``tile_start + first + stride*m`` (m < count).  Tokens at or past the
        split end are redirected to the request's last visible token: finite data whose probability is
        exactly 0, so NaN in pages a request does not own never reaches a product."""
        rows = cute.make_rmem_tensor((count,), Int64)
        for m in cutlass.range_constexpr(count):
            tok = cutlass.min(tile_start + first + stride * m, split_end - 1)
            pg = clamp(mBT[b, tok // self.page_size], 0, num_pages - 1)
            rows[m] = Int64(pg) * self.page_size + tok % self.page_size
        return rows

    @cute.jit
    def load_kv(self, sK, sSt, stage, mKV, mBT, b, tile_start, split_end, num_pages, tid):
        """Issue the cp.async of one KV tile into ring slot ``stage`` (no commit)."""
        if cutlass.const_expr(not self.fp8):
            rows = self.kv_rows(mBT, b, tile_start, split_end, num_pages, tid, self.block_n // 32, 32, tid // 8)
            self.load_rows(sK[None, None, stage], mKV, rows, tid)
        else:
            # raw e4m3 rows: chunk c = tid + 256 j of the tile is 16 bytes at (row c // 36, col 16 (c % 36))
            n_chunks = self.block_n * (self.D // 16)
            atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                       cutlass.Float8E4M3FN, num_bits_per_copy=128)
            sFlat = cute.make_tensor(sSt[None, None, stage].iterator, cute.make_layout((16, n_chunks), stride=(1, 16)))
            for j in cutlass.range_constexpr((n_chunks + 255) // 256):
                c = tid + 256 * j
                if c < n_chunks:
                    row, col = c // (self.D // 16), c % (self.D // 16)
                    grow = self.kv_rows(mBT, b, tile_start, split_end, num_pages, tid, 1, 0, row)
                    src = cute.make_tensor(row_ptr(mKV, grow[0], col * 16, self.D, 16), cute.make_layout(16))
                    cute.copy(atom, src, sFlat[None, c])

    @cute.jit
    def convert_kv(self, sSt_stage: cute.Tensor, sKc: cute.Tensor, tid: Int32):
        """Upcast one staged e4m3 tile into the bf16 swizzled compute tile (exact)."""
        _, tiled = self._row_copy(self.mma_dtype, 128, 8)
        _, tiled8 = self._row_copy(cutlass.Float8E4M3FN, 64, 8)
        tXsK = tiled.get_slice(tid).partition_D(sKc)
        tXsS = tiled8.get_slice(tid).partition_S(sSt_stage)
        for m in cutlass.range_constexpr(cute.size(tXsK, mode=[1])):
            for k in cutlass.range_constexpr(cute.size(tXsK, mode=[2])):
                f8 = cute.make_rmem_tensor((8,), cutlass.Float8E4M3FN)
                cute.autovec_copy(tXsS[None, m, k], f8)
                b16 = cute.make_rmem_tensor((8,), self.mma_dtype)
                b16.store(f8.load().to(self.mma_dtype))
                cute.autovec_copy(b16, tXsK[None, m, k])

    @cute.jit
    def page_ids(self, pgs: cute.Tensor, mBT: cute.Tensor, b: Int32, tile_start: Int32, split_end: Int32,
                 wtid: Int32):
        """Schedule "overlap": raw block-table entries of tokens ``tile_start + wtid//4 + 32m`` (m < 2, the
        rows :meth:`load_kv_half` copies), loaded one tile ahead so the refill never waits on them.  Tokens
        are clamped into the split (caller guarantees ``split_end > tile_start >= 0`` of a non-empty split)."""
        for m in cutlass.range_constexpr(2):
            tok = cutlass.min(tile_start + wtid // 4 + 32 * m, split_end - 1)
            pgs[m] = mBT[b, tok // self.page_size]

    @cute.jit
    def load_kv_half(self, sKs: cute.Tensor, mKV: cute.Tensor, pgs: cute.Tensor, tile_start: Int32,
                     split_end: Int32, num_pages: Int32, wg: Int32, wtid: Int32):
        """Schedule "overlap": warpgroup ``wg`` refills only the columns it alone reads in PV, V columns
        ``[256wg, 256wg+256)``, plus rope columns ``[512+32wg, 512+32wg+32)`` (read only by QK), of all 64 rows
        of one tile (cp.async, no commit).  Thread ``wtid`` copies rows ``wtid//4 + 32m`` (m < 2), 16-byte
        chunks ``wtid%4 + 4k``; page ids come from :meth:`page_ids` (clamped to ``[0, num_pages)`` here)."""
        rows = self.gather_rows(pgs, tile_start, split_end, num_pages, wtid, 4)
        atom, tiled = self._row_copy(self.mma_dtype, 128, 8, threads=(32, 4))
        thr = tiled.get_slice(wtid)
        half = self.DV // 2
        rope_w = (self.D - self.DV) // 2
        for part in cutlass.range_constexpr(2):
            width = half if part == 0 else rope_w
            col0 = wg * half if part == 0 else self.DV + wg * rope_w
            sX = cute.local_tile(sKs, (self.block_n, width), (0, wg + (0 if part == 0 else self.DV // rope_w)))
            tX = thr.partition_D(sX)  # (CPY, 2, width / 32)
            for m in cutlass.range_constexpr(cute.size(tX, mode=[1])):
                for k in cutlass.range_constexpr(cute.size(tX, mode=[2])):
                    dst = tX[None, m, k]
                    col = col0 + (wtid % 4) * 8 + 32 * k
                    src = cute.make_tensor(row_ptr(mKV, rows[m], col, self.D, 16), dst.layout)
                    cute.copy(atom, src, dst)

    @cute.jit
    def rescale_o(self, acc_o: cute.Tensor, alpha: cute.Tensor):
        """Schedule "overlap": ``O *= alpha`` per row, skipped when every alpha of the warp is exactly 1
        (no row max moved; alpha <= 1 always), which is bitwise the same result."""
        moved = cute.arch.vote_any_sync(cutlass.min(alpha[0], alpha[1]) < Float32(1.0))
        if moved:
            for e in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[e] = acc_o[e] * alpha[(e // 2) % 2]

    @cute.jit
    def issue_pv(self, pv_mma: cute.TiledMma, acc_o: cute.Tensor, tOrP: cute.Tensor, sKs: cute.Tensor,
                 v_layout: cute.ComposedLayout, wg: Int32, wtid: Int32):
        """Issue ``O[:, 256wg:256wg+256] += P V_wg`` (wgmma SS, V = MN-major view of K tile ``sKs``), no commit."""
        pv_thr = pv_mma.get_slice(wtid)
        sV = cute.make_tensor(cute.recast_ptr(sKs.iterator, v_layout.inner), v_layout.outer)
        sVw = cute.local_tile(sV[None, None, 0], (self.DV // 2, self.block_n), (wg, 0))
        tOrV = pv_thr.make_fragment_B(pv_thr.partition_B(sVw))
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            cute.gemm(pv_mma, acc_o, tOrP[None, None, k], tOrV[None, None, k], acc_o)

    @cute.jit
    def wait_tile(self):
        """Wait for this thread's cp.async of the current tile (``stages - 2`` groups may stay in flight), make
        them visible to the async proxy, then TILE_READY: every thread's copies of the tile landed and the
        previous iteration is fully done (its ring slot is free)."""
        cute.arch.cp_async_wait_group(self.stages - 2)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(Barrier.TILE_READY), number_of_threads=self.num_threads)

    @cute.jit
    def issue_qk(self, qk_mma: cute.TiledMma, qk_thr, acc_s: cute.Tensor, tSrQ: cute.Tensor, sKs: cute.Tensor,
                 wg: Int32):
        """Issue ``S_wg = Q K[32wg:32wg+32]^T`` (wgmma SS, 64x32x576) from K tile ``sKs``, no commit."""
        sKw = cute.local_tile(sKs, (self.block_n // 2, self.D), (wg, 0))
        tSrK = qk_thr.make_fragment_B(qk_thr.partition_B(sKw))
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            qk_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(qk_mma, acc_s, tSrQ[None, None, k], tSrK[None, None, k], acc_s)

    @cute.jit
    def mask_scale_max(self, acc_s: cute.Tensor, tScS: cute.Tensor, lim: cute.Tensor, tile_start: Int32,
                       scale_log2: Float32, wg: Int32):
        """Scale S into the exp2 domain in place, -inf for keys at or past the row's ``lim``; returns this
        thread's max of each of its two rows (not yet reduced over the quad)."""
        tile_max = cute.make_rmem_tensor((2,), Float32)
        tile_max[0] = -Float32.inf
        tile_max[1] = -Float32.inf
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            h = (e // 2) % 2
            key = tile_start + wg * (self.block_n // 2) + tScS[e][1]
            v = acc_s[e] * scale_log2
            if key >= lim[h]:
                v = -Float32.inf
            acc_s[e] = v
            tile_max[h] = cute.arch.fmax(tile_max[h], v)
        return tile_max

    @cute.jit
    def update_row_max(self, tile_max: cute.Tensor, sMax: cute.Tensor, row_in: cute.Tensor, row_m: cute.Tensor,
                       row_l: cute.Tensor, wg: Int32, wtid: Int32):
        """Reduce ``tile_max`` over the quad, exchange it with the other warpgroup through ``sMax``
        (ROW_MAX), then the online-softmax update: ``row_m`` <- new max, ``row_l *= alpha``.  Returns
        ``(alpha, ref)``: the O/l rescale factor and the reference P is computed against (0 for a row whose
        max is still -inf, so exp2 gives exact zeros)."""
        for h in cutlass.range_constexpr(2):
            tile_max[h] = quad_max(tile_max[h])
            if wtid % 4 == 0:
                sMax[wg * 64 + row_in[h]] = tile_max[h]
        cute.arch.barrier(barrier_id=int(Barrier.ROW_MAX), number_of_threads=self.num_threads)
        alpha = cute.make_rmem_tensor((2,), Float32)
        ref = cute.make_rmem_tensor((2,), Float32)
        for h in cutlass.range_constexpr(2):
            other = sMax[(1 - wg) * 64 + row_in[h]]
            m_new = cute.arch.fmax(row_m[h], cute.arch.fmax(tile_max[h], other))
            ref[h] = m_new
            if m_new == -Float32.inf:
                ref[h] = 0.0
            alpha[h] = cute.arch.exp2(row_m[h] - ref[h])
            row_m[h] = m_new
            row_l[h] = row_l[h] * alpha[h]
        return alpha, ref

    @cute.jit
    def store_p(self, acc_s: cute.Tensor, ref: cute.Tensor, row_l: cute.Tensor, tSsP: cute.Tensor):
        """``P = exp2(S - ref)`` (added to ``row_l``), to the P smem tile in the operand dtype, then P_READY."""
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            h = (e // 2) % 2
            p = cute.arch.exp2(acc_s[e] - ref[h])
            acc_s[e] = p
            row_l[h] = row_l[h] + p
        rP = cute.make_rmem_tensor_like(acc_s, self.mma_dtype)
        rP.store(acc_s.load().to(self.mma_dtype))
        cute.autovec_copy(rP, tSsP)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(Barrier.P_READY), number_of_threads=self.num_threads)

    @cute.jit
    def mainloop_overlap(self, qk_mma, pv_mma, tSrQ, acc_s, acc_o, tScS, tSsP, tOrP, row_in, lim, row_m, row_l,
                         pgs, sK, sMax, mKV, mBT, b, split_start, split_end, num_pages, n_tiles, scale_log2, wg,
                         wtid, v_layout):
        """Schedule "overlap" (16-bit inputs, ``block_n`` 64, 2-slot ring).  Iteration i:

        1. issue PV(i-1) (P(i-1) in smem since P_READY(i-1), O already rescaled), commit (an empty group for
           i = 0, so every iteration has the same group structure);
        2. wait for tile i (cp.async) + TILE_READY, while PV(i-1) runs on the tensor cores;
        3. issue QK(i), commit: it queues right behind PV(i-1), no tensor-core bubble between them;
        4. wait_group(1): PV(i-1) retired for this warpgroup (groups retire in order).  Refill the columns of
           slot (i+1)%2 that only this warpgroup reads in PV (its V half) plus its half of the rope columns
           (read only by QK(i-1), retired before ROW_MAX(i-1)), from page ids loaded one tile earlier; then
           load the page ids of tile i+2;
        5. wait_group(0): S(i) ready; mask, row max exchange (ROW_MAX), O *= alpha (skipped when no row
           max moved), P(i) -> smem (sP is free: both warpgroups retired PV(i-1) before ROW_MAX(i)), P_READY.
        No wgmma group is pending across the loop back-edge (ptxas serializes every wgmma otherwise); the
        last PV is issued after the loop.  Barriers per tile: TILE_READY, ROW_MAX, P_READY (as lockstep).
        """
        bn, P = self.block_n, self.stages
        qk_thr = qk_mma.get_slice(wtid)
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        for i in cutlass.range(n_tiles, unroll=1):
            stage = i % P
            tile_start = split_start + i * bn
            if i > 0:
                self.issue_pv(pv_mma, acc_o, tOrP, sK[None, None, (i + P - 1) % P], v_layout, wg, wtid)
            warpgroup.commit_group()
            self.wait_tile()  # tile i landed
            self.issue_qk(qk_mma, qk_thr, acc_s, tSrQ, sK[None, None, stage], wg)  # S = Q K_g^T
            warpgroup.commit_group()
            warpgroup.wait_group(1)  # PV(i-1) retired (this warpgroup)
            if i + 1 < n_tiles:
                self.load_kv_half(sK[None, None, (i + 1) % P], mKV, pgs, tile_start + bn, split_end, num_pages,
                                  wg, wtid)
            cute.arch.cp_async_commit_group()
            self.page_ids(pgs, mBT, b, tile_start + 2 * bn, split_end, wtid)
            warpgroup.wait_group(0)  # QK(i) retired
            # ---- softmax step: as the lockstep schedule
            tile_max = self.mask_scale_max(acc_s, tScS, lim, tile_start, scale_log2, wg)
            alpha, ref = self.update_row_max(tile_max, sMax, row_in, row_m, row_l, wg, wtid)
            self.rescale_o(acc_o, alpha)  # PV(i-1) retired, PV(i) not issued yet
            self.store_p(acc_s, ref, row_l, tSsP)
        if n_tiles > 0:
            self.issue_pv(pv_mma, acc_o, tOrP, sK[None, None, (n_tiles - 1) % P], v_layout, wg, wtid)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.kernel
    def kernel(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, mQ: cute.Tensor, mKV: cute.Tensor,
               mBT: cute.Tensor, mSeq: cute.Tensor, mSS: cute.Tensor, mOS: cute.Tensor, mOut: cute.Tensor,
               mLse: cute.Tensor, mOacc: cute.Tensor, mLacc: cute.Tensor, q_layout: cute.ComposedLayout,
               k_layout: cute.ComposedLayout, v_layout: cute.ComposedLayout, p_layout: cute.ComposedLayout,
               st_layout: cute.Layout, Storage: cutlass.Constexpr):
        tid, _, _ = cute.arch.thread_idx()
        mblk, split, b = cute.arch.block_idx()
        self.allow_combine_launch()
        wg = cute.arch.make_warp_uniform(tid // 128)
        wtid = tid % 128
        bn, P = self.block_n, self.stages
        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(Storage)
        sQ = st.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK = st.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sP = st.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner)
        sSt = sK  # FP8 staging ring (unused for 16-bit inputs)
        if cutlass.const_expr(self.fp8):
            sSt = st.sSt.get_tensor(st_layout)
        sMax = st.row_max.get_tensor(cute.make_layout(128))
        sSum = st.row_sum.get_tensor(cute.make_layout(128))

        scale_log2 = mSS[0] * LOG2_E
        out_scale = mOS[0]
        num_pages = mKV.shape[0]
        seq, split_start, split_end = self.split_range(mBT, mSeq, b, split)
        n_tiles = Int32(0)
        if split_end > split_start:
            n_tiles = (split_end - split_start + bn - 1) // bn

        # ---- Q tile: rows past R are a clamped copy of row R-1 (finite, never stored).
        qrows = self.q_rows(mblk, b, tid)
        if cutlass.const_expr(self.fp8):
            self.load_q_fp8(sQ[None, None, 0], mQ, qrows, tid)
        else:
            self.load_rows(sQ[None, None, 0], mQ, qrows, tid, zero_neg=self.pad_zero)
        # ---- prologue: tiles 0 .. P-2 in flight, one commit group each (Q joins group 0)
        for j in cutlass.range_constexpr(P - 1):
            if j < n_tiles:
                self.load_kv(sK, sSt, j, mKV, mBT, b, split_start + j * bn, split_end, num_pages, tid)
            cute.arch.cp_async_commit_group()

        # ---- schedule "overlap" (16-bit): block-table entries of the first in-loop refill (tile 1)
        pgs = None
        if cutlass.const_expr(self.defer_pv):
            pgs = cute.make_rmem_tensor((2,), Int32)
            pgs[0] = 0
            pgs[1] = 0
            if n_tiles > 0:
                self.page_ids(pgs, mBT, b, split_start + bn, split_end, wtid)

        # ---- MMA partitions
        qk_thr = qk_mma.get_slice(wtid)
        pv_thr = pv_mma.get_slice(wtid)
        tSrQ = qk_thr.make_fragment_A(qk_thr.partition_A(sQ[None, None, 0]))
        acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((self.block_m, bn // 2)))
        acc_o = pv_thr.make_fragment_C(pv_thr.partition_shape_C((self.block_m, self.DV // 2)))
        acc_o.fill(0.0)
        tScS = qk_thr.partition_C(cute.make_identity_tensor((self.block_m, bn // 2)))
        sPw = cute.local_tile(sP[None, None, 0], (self.block_m, bn // 2), (0, wg))
        tSsP = qk_thr.partition_C(sPw)
        tOrP = pv_thr.make_fragment_A(pv_thr.partition_A(sP[None, None, 0]))
        row_in, lim = self.row_limits(tScS, mblk, seq, split_end)
        row_m = cute.make_rmem_tensor((2,), Float32)
        row_l = cute.make_rmem_tensor((2,), Float32)
        for h in cutlass.range_constexpr(2):
            row_m[h] = -Float32.inf
            row_l[h] = 0.0

        if cutlass.const_expr(self.defer_pv):
            self.mainloop_overlap(qk_mma, pv_mma, tSrQ, acc_s, acc_o, tScS, tSsP, tOrP, row_in, lim, row_m, row_l,
                                  pgs, sK, sMax, mKV, mBT, b, split_start, split_end, num_pages, n_tiles,
                                  scale_log2, wg, wtid, v_layout)
        else:
            for i in cutlass.range(n_tiles, unroll=1):
                stage = i % P
                tile_start = split_start + i * bn
                self.wait_tile()  # tile i (and Q) landed; iteration i-1 is fully done (its slot is free)
                sKs = sK[None, None, 0]
                if cutlass.const_expr(self.fp8):
                    self.convert_kv(sSt[None, None, stage], sKs, tid)
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier(barrier_id=int(Barrier.CONVERTED), number_of_threads=self.num_threads)
                else:
                    sKs = sK[None, None, stage]
                self.issue_qk(qk_mma, qk_thr, acc_s, tSrQ, sKs, wg)  # S = Q K_g^T
                warpgroup.commit_group()
                # Refill the slot of tile i-1 (free since TILE_READY) while the QK wgmmas run: the block-table
                # reads and address math of the prefetch stay off the critical path.
                if i + P - 1 < n_tiles:
                    self.load_kv(sK, sSt, (i + P - 1) % P, mKV, mBT, b, tile_start + (P - 1) * bn, split_end,
                                 num_pages, tid)
                cute.arch.cp_async_commit_group()
                warpgroup.wait_group(0)
                # ---- softmax step: mask, scale, row max (exchanged between the two warpgroups), P -> smem
                tile_max = self.mask_scale_max(acc_s, tScS, lim, tile_start, scale_log2, wg)
                alpha, ref = self.update_row_max(tile_max, sMax, row_in, row_m, row_l, wg, wtid)
                if cutlass.const_expr(self.overlap):
                    # PV(i-1) retired (wait_group above) and PV(i) not issued: O is free; rescaling before
                    # P_READY lets the barrier absorb it
                    self.rescale_o(acc_o, alpha)
                self.store_p(acc_s, ref, row_l, tSsP)
                # ---- O = alpha O + P V_g
                if cutlass.const_expr(not self.overlap):
                    for e in cutlass.range_constexpr(cute.size(acc_o)):
                        acc_o[e] = acc_o[e] * alpha[(e // 2) % 2]
                pv_mma.set(warpgroup.Field.ACCUMULATE, True)
                self.issue_pv(pv_mma, acc_o, tOrP, sKs, v_layout, wg, wtid)
                warpgroup.commit_group()
                warpgroup.wait_group(0)

        cute.arch.cp_async_wait_group(0)
        self.epilogue(pv_thr, acc_o, row_m, row_l, row_in, sSum, mOut, mLse, mOacc, mLacc, out_scale, mblk,
                      split, b, wg, wtid)

    @cute.jit
    def epilogue(self, pv_thr, acc_o, row_m, row_l, row_in, sSum, mOut, mLse, mOacc, mLacc, out_scale, mblk,
                 split, b, wg, wtid, stage=None):
        """O / l and the LSE of this CTA's rows (``split`` partials to the fp32 workspace with more than one split).
        ``stage`` None: each thread stores its accumulator elements straight to global memory (2 or 4 bytes each,
        8 rows per warp instruction).  Else ``(pointer, bytes)``: free shared memory, 16-byte aligned, at least 36 KB
        (:meth:`store_o_staged`): O goes through it and leaves in full 16-byte chunks."""
        for h in cutlass.range_constexpr(2):
            row_l[h] = quad_sum(row_l[h])
            if wtid % 4 == 0:
                sSum[wg * 64 + row_in[h]] = row_l[h]
        cute.arch.barrier(barrier_id=int(Barrier.ROW_SUM), number_of_threads=self.num_threads)
        inv = cute.make_rmem_tensor((2,), Float32)
        lse = cute.make_rmem_tensor((2,), Float32)
        for h in cutlass.range_constexpr(2):
            l_tot = sSum[row_in[h]] + sSum[64 + row_in[h]]
            inv[h] = 0.0
            lse[h] = -Float32.inf
            if l_tot > 0.0:
                inv[h] = 1.0 / l_tot
                lse[h] = (row_m[h] + cute.math.log2(l_tot, fastmath=False)) * LN_2
        tOcO = pv_thr.partition_C(cute.make_identity_tensor((self.block_m, self.DV // 2)))
        direct = cutlass.const_expr(self.num_splits == 1)
        if cutlass.const_expr(stage is not None):
            for h in cutlass.range_constexpr(2):
                r = mblk * self.block_m + row_in[h]
                if r < self.R:  # noqa: SIM102 (dynamic tests)
                    if wtid % 4 == 0 and wg == 0:
                        gL = cute.make_tensor((mLse if direct else mLacc).iterator + self.out_row(b, split, r),
                                              cute.make_layout(1))
                        gL[0] = lse[h]
                for e in cutlass.range_constexpr(cute.size(acc_o)):
                    if cutlass.const_expr((e // 2) % 2 == h):
                        acc_o[e] = acc_o[e] * (inv[h] * out_scale if direct else inv[h])
            self.store_o_staged(acc_o, tOcO, row_in, stage, mOut, mOacc, mblk, split, b, wg, wtid)
            return
        for h in cutlass.range_constexpr(2):
            r = mblk * self.block_m + row_in[h]
            if r < self.R:
                if cutlass.const_expr(direct):
                    base = Int64(b) * self.R + r
                    gO = cute.make_tensor(mOut.iterator + base * self.DV, cute.make_layout(self.DV))
                    if wtid % 4 == 0 and wg == 0:
                        gL = cute.make_tensor(mLse.iterator + base, cute.make_layout(1))
                        gL[0] = lse[h]
                    for e in cutlass.range_constexpr(cute.size(acc_o)):
                        if cutlass.const_expr((e // 2) % 2 == h):
                            gO[wg * (self.DV // 2) + tOcO[e][1]] = (acc_o[e] * (inv[h] * out_scale)).to(self.out_dtype)
                else:
                    base = (Int64(b) * self.num_splits + split) * self.R + r
                    gO = cute.make_tensor(mOacc.iterator + base * self.DV, cute.make_layout(self.DV))
                    if wtid % 4 == 0 and wg == 0:
                        gL = cute.make_tensor(mLacc.iterator + base, cute.make_layout(1))
                        gL[0] = lse[h]
                    for e in cutlass.range_constexpr(cute.size(acc_o)):
                        if cutlass.const_expr((e // 2) % 2 == h):
                            gO[wg * (self.DV // 2) + tOcO[e][1]] = acc_o[e] * inv[h]

    def out_row(self, b, split, r):
        """Row of query row ``r`` of request ``b`` in ``out`` / ``lse`` (one split) or in the fp32 partials of split
        ``split`` (``o_accum`` / ``lse_accum``), as an Int64."""
        if self.num_splits == 1:
            return Int64(b) * self.R + r
        return (Int64(b) * self.num_splits + split) * self.R + r

    @cute.jit
    def store_o_staged(self, acc_o, tOcO, row_in, stage, mOut, mOacc, mblk, split, b, wg, wtid):
        """The scaled O of warpgroup ``wg`` (64 rows x its 256 features, in ``acc_o``) to ``out`` (or the fp32 partials)
        through the shared memory ``stage`` = ``(pointer, bytes)``, in passes of ``cw`` features, the most of 256 /
        128 / 64 for which both warpgroups' tiles fit: each thread writes its element pairs (4 or 8 bytes) into a
        64-row tile with rows of ``cw + 8`` elements (the 8 put a warp's pair stores, 8 rows x 4 threads, on 32
        distinct banks: a row is 4 banks on for 4-byte pairs, 8 for 8-byte ones), the warpgroup syncs on its TAIL
        barrier, then the warps copy whole row segments out, 16 bytes per thread (coalesced).  16-bit Q tile (72 KB):
        one pass (bf16) or two (fp32); FP8 Q tile (36 KB): two or four.  Rows past R are not stored."""
        direct = cutlass.const_expr(self.num_splits == 1)
        et = self.out_dtype if direct else Float32
        eb = et.width // 8
        cw = staged_pass_features(eb, stage[1])
        pitch = cw + 8  # elements per staged row
        vec = 16 // eb  # elements per 16-byte chunk
        cpr = cw // vec  # chunks per row segment (16 or 32)
        base = cute.recast_ptr(stage[0], dtype=et) + wg * 64 * pitch
        pair = cute.make_rmem_tensor((2,), et)
        chunk = cute.make_rmem_tensor((vec,), et)
        for p in cutlass.range_constexpr((self.DV // 2) // cw):
            for e in cutlass.range_constexpr(cute.size(acc_o)):
                # (element e = v + 2 h + 4 j: column 8 j + 2 (lane % 4) + v of row row_in[h])
                if cutlass.const_expr(e % 2 == 0 and (8 * (e // 4)) // cw == p):
                    pair[0] = acc_o[e].to(et)
                    pair[1] = acc_o[e + 1].to(et)
                    off = row_in[(e // 2) % 2] * pitch + tOcO[e][1] - p * cw
                    sdst = cute.make_ptr(et, (base + off).toint(), cute.AddressSpace.smem, assumed_align=2 * eb)
                    cute.autovec_copy(pair, cute.make_tensor(sdst, cute.make_layout(2)))
            cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)
            for i in cutlass.range_constexpr(64 * cpr // 128):
                row = (128 // cpr) * i + wtid // cpr
                c = (wtid % cpr) * vec
                r = mblk * self.block_m + row
                if r < self.R:
                    src = cute.make_ptr(et, (base + row * pitch + c).toint(), cute.AddressSpace.smem, assumed_align=16)
                    cute.autovec_copy(cute.make_tensor(src, cute.make_layout(vec)), chunk)
                    f = wg * (self.DV // 2) + p * cw + c
                    gdst = row_ptr(mOut if direct else mOacc, self.out_row(b, split, r), f, self.DV, 16)
                    cute.autovec_copy(chunk, cute.make_tensor(gdst, cute.make_layout(vec)))
            if cutlass.const_expr(p + 1 < (self.DV // 2) // cw):  # the next pass overwrites the tile
                cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)

    @cute.jit
    def allow_combine_launch(self):
        """Main kernels, first thing: with PDL the combine grid (or with :attr:`pdl_main` the next kernel of the
        stream) may be launched now (it waits for this grid to complete before reading; :meth:`combine_kernel`).
        With :attr:`pdl_main` this grid was launched early too: it waits here, before any global memory access,
        until the previous kernel of the stream completed and its writes are visible."""
        if cutlass.const_expr((self.num_splits > 1 and self.pdl) or self.pdl_main):
            cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.pdl_main):
            cute.arch.griddepcontrol_wait()

    def combine_shape(self):
        """``(C, G)`` of the combine kernel: each CTA merges ``DV / C`` columns of one row; its 128
        threads form ``G`` split groups of ``128 / G`` column threads (4 columns each). Up to 8 splits one
        thread merges all of them (C = G = 1, the loads unrolled); beyond, 8 x 8 keeps enough loads in
        flight when one request is split over the whole GPU (B=1: 128 splits x 16 rows)."""
        return (1, 1) if self.num_splits <= 8 else (8, 8)

    def combine_lse_slots(self) -> int:
        """Split LSEs each of the combine's 128 threads reads (``ceil(splits / 128)``)."""
        return -(-self.num_splits // 128)

    @cute.jit
    def launch_combine(self, stream, o_accum: cute.Tensor, lse_accum: cute.Tensor, output_scale: cute.Tensor,
                       out: cute.Tensor, lse: cute.Tensor, batch):
        C, _G = self.combine_shape()
        nw = self.combine_lse_slots() * 128

        @cute.struct
        class CombineStorage:
            red: cute.struct.MemRange[Float32, 8]
            w: cute.struct.Align[cute.struct.MemRange[Float32, nw], 16]
            acc: cute.struct.Align[cute.struct.MemRange[Float32, 512], 16]

        self.combine_kernel(o_accum, lse_accum, output_scale, out, lse, CombineStorage).launch(
            grid=(self.R, batch, C), block=(128, 1, 1), smem=CombineStorage.size_in_bytes(), stream=stream,
            use_pdl=self.pdl)

    @cute.jit
    def block_allreduce(self, x: Float32, sRed: cute.Tensor, slot: cutlass.Constexpr[int],
                        is_max: cutlass.Constexpr[bool], tid: Int32) -> Float32:
        """Max (``is_max``) or sum of ``x`` over the 128 threads, returned to all of them: butterfly over each
        warp, the 4 warp results through ``sRed[slot:slot + 4]``, folded in warp order (deterministic)."""
        for k in cutlass.range_constexpr(5):
            y = cute.arch.shuffle_sync_bfly(x, offset=16 >> k)
            x = cute.arch.fmax(x, y) if is_max else x + y
        if tid % 32 == 0:
            sRed[slot + tid // 32] = x
        cute.arch.barrier()
        r = sRed[slot]
        for w in cutlass.range_constexpr(1, 4):
            r = cute.arch.fmax(r, sRed[slot + w]) if is_max else r + sRed[slot + w]
        return r

    @cute.kernel
    def combine_kernel(self, mOacc: cute.Tensor, mLacc: cute.Tensor, mOS: cute.Tensor, mOut: cute.Tensor,
                       mLse: cute.Tensor, Storage: cutlass.Constexpr):
        """One CTA per (row, request, column chunk): LSE-weighted sum of the split partials in a fixed order
        (deterministic, no atomics). The split LSEs are read by all 128 threads at once and reduced in the
        block; the weights go through smem; each split group sums its splits in order, then group 0 adds
        the groups in order.

        Launched with programmatic dependent launch (PDL): the main kernel signals
        ``griddepcontrol.launch_dependents`` at its start, so this grid is launched while the main grid
        runs and its CTAs take SMs as main CTAs retire; ``griddepcontrol.wait`` holds every thread until
        the main grid has completed and its writes are visible."""
        if cutlass.const_expr(self.pdl_main):  # the next main kernel may launch (it waits for this grid)
            cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        tid, _, _ = cute.arch.thread_idx()
        r, b, chunk = cute.arch.block_idx()
        ns = self.num_splits
        C, G = self.combine_shape()
        T = 128 // G
        NL = self.combine_lse_slots()
        NI = -(-ns // G)
        st = cutlass.utils.SmemAllocator().allocate(Storage)
        sRed = st.red.get_tensor(cute.make_layout(8))
        sW = st.w.get_tensor(cute.make_layout(NL * 128))
        sAcc = st.acc.get_tensor(cute.make_layout(512))
        lbase = Int64(b) * ns * self.R + r
        gL = cute.make_tensor(mLacc.iterator + lbase, cute.make_layout(ns, stride=self.R))
        lv = cute.make_rmem_tensor((NL,), Float32)
        m = -Float32.inf
        for j in cutlass.range_constexpr(NL):
            lv[j] = -Float32.inf
            if tid + 128 * j < ns:
                lv[j] = gL[tid + 128 * j]
            m = cute.arch.fmax(m, lv[j])
        m = self.block_allreduce(m, sRed, 0, True, tid)
        part = Float32(0.0)
        for j in cutlass.range_constexpr(NL):
            w = Float32(0.0)
            if m != -Float32.inf:
                w = cute.arch.exp2((lv[j] - m) * LOG2_E)
            sW[tid + 128 * j] = w
            part = part + w
        total = self.block_allreduce(part, sRed, 4, False, tid)
        g, c = tid // T, tid % T
        col = chunk * (self.DV // C) + c * 4
        acc = cute.make_rmem_tensor((4,), Float32)
        acc.fill(0.0)
        for i in cutlass.range_constexpr(NI):
            if g + G * i < ns:
                s = g + G * i
                gO = cute.make_tensor(row_ptr(mOacc, lbase + Int64(s) * self.R, col, self.DV, 16), cute.make_layout(4))
                v = gO.load()
                w = sW[s]
                for j in cutlass.range_constexpr(4):
                    acc[j] = acc[j] + w * v[j]
        if cutlass.const_expr(G > 1):
            for j in cutlass.range_constexpr(4):
                sAcc[tid * 4 + j] = acc[j]
            cute.arch.barrier()
        if g == 0:
            if cutlass.const_expr(G > 1):
                for k in cutlass.range_constexpr(1, G):
                    for j in cutlass.range_constexpr(4):
                        acc[j] = acc[j] + sAcc[(k * T + c) * 4 + j]
            inv = Float32(0.0)
            lse = -Float32.inf
            if total > 0.0:
                inv = mOS[0] / total
                lse = m + cute.math.log(total, fastmath=False)
            obase = Int64(b) * self.R + r
            res = cute.make_rmem_tensor((4,), self.out_dtype)
            for j in cutlass.range_constexpr(4):
                res[j] = (acc[j] * inv).to(self.out_dtype)
            gOut = cute.make_tensor(row_ptr(mOut, obase, col, self.DV, 8), cute.make_layout(4))
            gOut.store(res.load())
            if tid == 0 and chunk == 0:
                gLse = cute.make_tensor(mLse.iterator + obase, cute.make_layout(1))
                gLse[0] = lse


def staged_pass_features(elem_bytes: int, stage_bytes: int) -> int:
    """Features per pass of :meth:`MlaDecodeSm90.store_o_staged`: the most of 256 / 128 / 64 for which both
    warpgroups' 64-row tiles, rows of ``features + 8`` elements of ``elem_bytes``, fit in ``stage_bytes``."""
    for cw in (256, 128, 64):
        if 2 * 64 * (cw + 8) * elem_bytes <= stage_bytes:
            return cw
    raise ValueError(f"store_o_staged: {stage_bytes} bytes of shared memory are too few for O")


@cute.jit
def launch_mla_decode(stream, q: cute.Tensor, kv: cute.Tensor, block_table: cute.Tensor, seq_lens: cute.Tensor,
                      softmax_scale: cute.Tensor, output_scale: cute.Tensor, out: cute.Tensor, lse: cute.Tensor,
                      o_accum: cute.Tensor = None, lse_accum: cute.Tensor = None, *,
                      dtype: cutlass.Constexpr, num_heads: cutlass.Constexpr, q_len: cutlass.Constexpr,
                      page_size: cutlass.Constexpr, causal: cutlass.Constexpr, num_splits: cutlass.Constexpr,
                      tokens_per_split: cutlass.Constexpr, block_n: cutlass.Constexpr = 64,
                      schedule: cutlass.Constexpr = "lockstep", pdl: cutlass.Constexpr = True,
                      pdl_main: cutlass.Constexpr = False):
    """FFI launch function (``tokenspeed_jax.ffi`` ABI): inputs, outputs, then the split-KV workspace."""
    MlaDecodeSm90(dtype=dtype, num_heads=num_heads, q_len=q_len, page_size=page_size, causal=causal,
                  num_splits=num_splits, tokens_per_split=tokens_per_split, block_n=block_n,
                  schedule=schedule, pdl=pdl, pdl_main=pdl_main)(
        stream, q, kv, block_table, seq_lens, softmax_scale, output_scale, out, lse, o_accum, lse_accum)


__all__ = ["MlaDecodeSm90", "launch_mla_decode"]
