"""Host and device code shared by the Hopper MLA decode main loops (CuTe DSL), which subclass :class:`MlaDecodeSm90`:
configuration, Q load, row limits, schedule walk, staged epilogue.  Launch: :mod:`tokenspeed_jax.kernels.sm90.decode`;
combine: :mod:`.combine`; contract: ``tokenspeed_jax.decode`` module docstring (cache row layout, mask, LSE, clamping).

* Persistent grid ``(row blocks, num_ctas)``: CTA ``(row block, g)`` walks range ``g`` of the length-balanced schedule
  (``tokenspeed_jax.decode_schedule``; :meth:`MlaDecodeSm90.piece`), each piece a whole main-loop run over one request's
  KV range for the block's rows ``r = s*H + h`` (heads fastest: KV read once for all S tokens and heads).
* Online softmax in the exp2 domain, fp32 statistics; masked scores are -inf, a row whose max is still -inf uses 0 as
  its reference so exp2 gives exact zeros.  seq_len is clamped to ``[0, max_pages*page_size]``, page ids to
  ``[0, num_pages)``; KV rows past a request's length are masked and never multiply a nonzero P.
* Split KV: a request within one CTA's range gets its output (times ``output_scale``) and LSE from it; one cut into
  ``k`` pieces, ``k`` normalised fp32 partials (``o_accum[slot, R, 512]``) and natural-log LSEs (``lse_accum[slot, R]``)
  in consecutive workspace slots (:meth:`MlaDecodeSm90.out_row`), merged in slot order (deterministic) by
  :meth:`~.combine.CombineMixin.combine_kernel`, which also writes length-0 requests' exact zeros and -inf LSE.
* ``softmax_scale`` and ``output_scale`` are read at run time from float32 device arrays of shape (1,)."""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, cute
from cutlass._mlir.dialects import cute as _cute_ir
from cutlass.cute.nvgpu import cpasync, warpgroup

from tokenspeed_jax.kernels.sm90.combine import CombineMixin
from tokenspeed_jax.kernels.sm90.helpers import LN_2, Barrier, clamp, quad_max, quad_sum, row_ptr

_K16 = 16  # wgmma K of 16-bit operands
_K32 = 32  # wgmma K of 8-bit operands
_CHUNK = 64  # columns of one 64-column chunk of a KV tile
_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float8_e4m3fn": cutlass.Float8E4M3FN}
_MIN_PAGE = 16  # TMA refills: at most 4 boxes of whole pages per 64-token chunk


class MlaDecodeSm90(CombineMixin):
    """Static configuration of one decode kernel (module docstring), shared by the main loops.  Args: dtype ("bfloat16",
    "float16" or "float8_e4m3fn"), num_heads H, q_len S, page_size (a power of two >= 16), causal, num_ctas (persistent
    CTAs per row block), max_slots (fp32 partial slots), ``pad_zero``: a 64-row block's query rows past R are zeros,
    every key masked (else no row past R is read: no padding, or a loop on the real rows), ``chunk``: 0, or the
    batch-invariant piece length (a multiple of 128), ``prefetch``: the next piece's first loads issued at this one's
    epilogue barrier (:meth:`start_piece`; length-balanced schedule, producer-warpgroup loops), ``trace``: 0, or a debug
    build's iterations timed per warpgroup (``clock64`` marks; ``decode_trace``), ``piece_trace``: 0, or a debug build
    recording its first ``piece_trace`` pieces per CTA (``decode_trace``'s ``mark_piece``; ``benchmarks/piece_timeline.py``)."""

    block_m = 64
    block_n = 64
    num_threads = 256  # the two computing warpgroups
    prefetch_q = False  # with :attr:`prefetch`: the epilogue leaves the Q tile alone, the next one loads there

    def __init__(self, *, dtype: str, num_heads: int, q_len: int, page_size: int, causal: bool,
                 num_ctas: int, max_slots: int, pad_zero: bool = False, chunk: int = 0, prefetch: bool = False,
                 trace: int = 0, piece_trace: int = 0):
        why = self.can_implement(dtype=dtype, num_heads=num_heads, q_len=q_len, page_size=page_size)
        if why:
            raise ValueError(why)
        if num_ctas < 1 or max_slots < 1:
            raise ValueError(f"num_ctas and max_slots must be positive, got {num_ctas}, {max_slots}")
        self.dtype_name = dtype
        self.dtype = _DTYPES[dtype]
        self.fp8 = dtype == "float8_e4m3fn"
        self.mma_dtype = cutlass.BFloat16 if self.fp8 else self.dtype  # 16-bit operand dtype in smem / wgmma
        self.out_dtype = cutlass.BFloat16 if self.fp8 else self.dtype
        self.H, self.S = num_heads, q_len
        self.R = num_heads * q_len
        self.page_size = page_size
        self.causal = causal
        self.num_ctas = num_ctas
        self.max_slots = max_slots
        if chunk < 0 or chunk % (2 * self.block_n):
            raise ValueError(f"chunk: expected 0 or a positive multiple of {2 * self.block_n}, got {chunk}")
        self.chunk = chunk  # > 0: walk_chunks; the workspace's max_slots unused, the combine takes any slot count
        self.prefetch = bool(prefetch)
        if self.prefetch and chunk:
            raise ValueError("prefetch: the length-balanced schedule only (chunk 0)")
        self.D, self.DV = 576, 512
        self.num_m_blocks = -(-self.R // self.block_m)
        # rows past R of a row block (R % 64 != 0) load zeros and mask every key, so both matmuls' A operands are zeros
        # there (q, P): less tensor-core switching, lower power, a higher sustained SM clock (docs/sm90_decode.md)
        self.pad_zero = bool(pad_zero)
        # FP8: P is computed as 2^8 p (max 256 < 448, e4m3's largest finite), so p down to 2^-14 stays a normal e4m3
        # number (3 mantissa bits) and down to 2^-17 a subnormal; O and l carry the factor, the LSE takes it out
        self.p8_bias = 8.0 if self.fp8 else 0.0
        # causal S > 1: the last S - 1 keys, hidden from some query rows, are multiplied (by P = 0) in their tile's P V;
        # the loops zero their non-finite V after the QK (:meth:`tail_from`; docs/sm90_decode.md, "Causally hidden
        # keys": V is part of the key row, so a row that sees such a key has a NaN P anyway)
        self.hidden_keys = q_len - 1 if causal else 0
        if trace < 0:
            raise ValueError(f"trace: expected the number of iterations to time (0: a normal build), got {trace}")
        self.trace = int(trace)
        if piece_trace < 0 or (piece_trace and (trace or chunk)):
            raise ValueError(f"piece_trace: expected the number of pieces to record per CTA (0: a normal build), "
                             f"without trace or chunk, got {piece_trace} (trace {trace}, chunk {chunk})")
        self.piece_trace = int(piece_trace)
        # a producer warpgroup runs on 24 registers, the computing ones on 240: 2x128x240 + 128x24 = 384x168 (launch)
        self.producer_regs, self.consumer_regs = 24, 240
        self.box_rows = min(self.page_size, self.block_n)  # rows of one TMA box (one page or one tile)
        self.subs = self.block_n // self.box_rows  # boxes per 64-token tile and 64-column chunk

    def tail_from(self, split_end):
        """First key whose tile cleans its V, for a piece ending at ``split_end``: ``split_end`` (rows past it zeroed),
        or ``split_end - hidden_keys``, a superset of the hidden keys (from ``seq - S + 1 >= split_end - S + 1``)."""
        return split_end - self.hidden_keys

    def hidden_rows(self, tile_start, split_end):
        """``(lo, hi)``: the rows of the tile at ``tile_start`` holding the keys ``[split_end - hidden_keys,
        split_end)`` whose V the loops clean (empty where ``hi <= lo``)."""
        return (cutlass.max(split_end - self.hidden_keys - tile_start, 0),
                cutlass.min(split_end - tile_start, self.block_n))

    @staticmethod
    def can_implement(*, dtype, num_heads, q_len, page_size):
        if dtype not in _DTYPES:
            return f"dtype {dtype} not in {tuple(_DTYPES)}"
        if not 1 <= num_heads <= 128 or not 1 <= q_len <= 16:
            return f"num_heads in 1..128 and q_len in 1..16 required, got {num_heads}, {q_len}"
        if page_size < _MIN_PAGE or page_size & (page_size - 1):
            return f"page_size must be a power of two >= {_MIN_PAGE}, got {page_size}"
        return None

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
    def load_q_tile(self, sQ: cute.Tensor, mQ: cute.Tensor, mblk: Int32, b: Int32, tid: Int32):
        """The Q tile of row block ``mblk`` into ``sQ`` by 256 threads (raw e4m3 for the FP8 QK, else 16-bit rows by
        cp.async, one group the caller commits)."""
        if cutlass.const_expr(self.fp8):
            self.load_q_raw8(sQ, mQ, self.q_rows(mblk, b, tid), tid)
        else:
            self.load_rows(sQ, mQ, self.q_rows(mblk, b, tid), tid, zero_neg=self.pad_zero)

    @cute.jit
    def load_q_raw8(self, sQ: cute.Tensor, mQ: cute.Tensor, rows: cute.Tensor, tid: Int32):
        """e4m3 q rows -> e4m3 smem in the QGMMA A layout, unconverted: synchronous 8-byte loads and stores (thread
        t: rows ``t//8 + 32m``, bytes ``8 (t%8) + 64k``), published by the prologue's proxy fence and barrier."""
        _, tiled = self._row_copy(cutlass.Float8E4M3FN, 64, 8)
        tXsQ = tiled.get_slice(tid).partition_D(sQ)
        for m in cutlass.range_constexpr(cute.size(tXsQ, mode=[1])):
            for k in cutlass.range_constexpr(cute.size(tXsQ, mode=[2])):
                row = rows[m]
                if cutlass.const_expr(self.pad_zero):
                    row = cutlass.max(row, Int64(0))  # (-1: a zero row, q_rows; row 0 is read and replaced)
                src = cute.make_tensor(row_ptr(mQ, row, (tid % 8) * 8 + 64 * k, self.D, 8), cute.make_layout(8))
                f8 = cute.make_rmem_tensor((8,), cutlass.Float8E4M3FN)
                cute.autovec_copy(src, f8)
                if cutlass.const_expr(self.pad_zero):  # noqa: SIM102 (static + dynamic test)
                    if rows[m] < 0:  # a zero row (q_rows)
                        f8.fill(0.0)
                cute.autovec_copy(f8, tXsQ[None, m, k])

    @cute.jit
    def cta_start(self, Storage: cutlass.Constexpr):
        """First thing of a main kernel, after the combine's programmatic dependent launch (PDL) trigger: ``tid``, row
        block, ``g`` (CTA ``g`` walks range ``g``: :meth:`piece`), warpgroup, thread in warpgroup, shared storage."""
        tid, _, _ = cute.arch.thread_idx()
        mblk, g, _ = cute.arch.block_idx()
        self.allow_combine_launch()
        wg = cute.arch.make_warp_uniform(tid // 128)
        st = cutlass.utils.SmemAllocator().allocate(Storage)
        return tid, mblk, g, wg, tid % 128, st

    @cute.jit
    def init_mbarriers(self, st, tid: Int32, n_mbar: cutlass.Constexpr, tma_atom: cute.CopyAtom):
        """A main kernel's prologue: thread 0 initialises the ``n_mbar`` mbarriers of ``st.mbar`` (one arrival each) and
        prefetches the TMA descriptor; FP8: threads 0..3 zero ``st.zero_row`` (the 16 bytes a V^T load of a row past
        the split reads).  Fenced; the caller's CTA barrier publishes them before any arrive."""
        mbar = st.mbar.data_ptr()
        if tid == 0:
            for i in cutlass.range_constexpr(n_mbar):
                cute.arch.mbarrier_init(mbar + i, 1)
            cpasync.prefetch_descriptor(tma_atom)
        if cutlass.const_expr(self.fp8):  # noqa: SIM102 (static + dynamic test)
            if tid < 4:
                st.zero_row.get_tensor(cute.make_layout(4))[tid] = Int32(0)
        cute.arch.mbarrier_init_fence()

    @cute.jit
    def num_pairs(self, split_start: Int32, split_end: Int32):
        """Tile pairs (2 x 64 tokens) of the split ``[split_start, split_end)``, 0 if it is empty."""
        n = Int32(0)
        if split_end > split_start:
            n = (split_end - split_start + 2 * self.block_n - 1) // (2 * self.block_n)
        return n

    @cute.jit
    def piece(self, mCta: cute.Tensor, mBT: cute.Tensor, mSeq: cute.Tensor, g: Int32, b: Int32):
        """``(seq, start, end, slot)`` of request ``b``'s piece in CTA ``g``'s range, ``mCta[g] = (b_first, tok_first,
        b_last, tok_end, slot_first, slot_last, 0, 0)``: seq_len clamped to ``[0, max_pages * page_size]``, KV tokens
        ``[start, end)`` (empty for length 0), fp32 partial slot (-1: this CTA alone has it, writes its output)."""
        seq = clamp(mSeq[b], 0, mBT.shape[1] * self.page_size)
        start = Int32(0)
        end = seq
        slot = Int32(-1)
        if b == mCta[g, 0]:
            start = mCta[g, 1]
            slot = mCta[g, 4]
        if b == mCta[g, 2]:
            end = cutlass.min(mCta[g, 3], seq)
            slot = mCta[g, 5]
        return seq, start, end, slot

    def phase_bits(self, mbar):
        """The parity each mbarrier had at the current piece's start (bit ``k`` for the ``k``-th from ``mbar``,
        :attr:`mbar_base`): :attr:`ph`, one register the piece loop flips by a piece's completions (:meth:`landed`)."""
        self.mbar_base = mbar
        self.ph = cute.make_rmem_tensor((1,), Int32)
        self.ph[0] = Int32(0)
        return self.ph

    @cute.jit
    def run_pieces(self, c):
        """After the prologue every warpgroup walks its CTA's pieces (:meth:`walk_pieces`), ``setmaxnreg`` giving the
        producer (:attr:`producer`) :attr:`producer_regs`, others :attr:`consumer_regs`; ``c``: the kernel's values."""
        b_first = c.mCta[c.g, 0]
        b_last = c.mCta[c.g, 2]
        if cutlass.const_expr(self.producer):  # warpgroup 2 issues the refills, 0 and 1 compute
            if c.wg == 2:
                cute.arch.setmaxregister_decrease(self.producer_regs)
                self.walk_pieces(c, b_first, b_last, True)
            else:
                cute.arch.setmaxregister_increase(self.consumer_regs)
                self.walk_pieces(c, b_first, b_last, False)
        else:
            self.walk_pieces(c, b_first, b_last, False)

    @cute.jit
    def walk_pieces(self, c, b_first: Int32, b_last: Int32, producer: cutlass.Constexpr):
        """One warpgroup's walk over requests ``b_first..b_last`` (:meth:`piece`), each non-empty piece one
        :meth:`run_piece`; :attr:`chunk` > 0: ``chunk`` tokens at a time (:meth:`walk_chunks`)."""
        if cutlass.const_expr(self.chunk > 0):
            self.walk_chunks(c, b_first, b_last, producer)
        else:
            mCta, mBT, mSeq, g = c.mCta, c.mBT, c.mSeq, c.g
            c.b_last = b_last  # (prefetch: the next piece is looked up in b + 1..b_last at each epilogue barrier)
            c.b_first = b_first  # (piece_trace: a piece's record is its request's index in the range)
            if cutlass.const_expr(self.piece_trace > 0 and not producer):
                self.clear_piece_trace(c)
            # (prefetch: the warpgroups that issue loads ahead, the producer and with prefetch_q the computing ones)
            if cutlass.const_expr(self.prefetch and (producer or self.prefetch_q)):
                self.start_piece(c, self.next_piece(c, b_first, b_last), producer)
            for b in cutlass.range(b_first, b_last + 1, unroll=1):
                seq, start, end, slot = self.piece(mCta, mBT, mSeq, g, b)
                if end > start:
                    self.run_piece(c, b, seq, start, end, slot, producer)

    @cute.jit
    def next_piece(self, c, b: Int32, b_last: Int32):
        """:attr:`prefetch`: the first request of ``b..b_last`` with a non-empty piece in this CTA's range, or -1."""
        nb = Int32(-1)
        k = b
        while k <= b_last:
            _, start, end, _ = self.piece(c.mCta, c.mBT, c.mSeq, c.g, k)
            if end > start:
                nb = k
                k = b_last + 1
            else:
                k = k + 1
        return nb

    @cute.jit
    def start_piece(self, c, b: Int32, producer: cutlass.Constexpr):
        """:attr:`prefetch`: issue request ``b``'s first loads (none if ``b < 0``) ahead of :meth:`run_piece`, for the
        first piece before the walk, else at the previous one's epilogue barrier: the producer its first KV tiles
        (``produce_start``; no consumer reads a buffer after that barrier), the consumers Q (if :attr:`prefetch_q`)."""
        if b >= 0:
            _, start, end, _ = self.piece(c.mCta, c.mBT, c.mSeq, c.g, b)
            if cutlass.const_expr(producer):
                self.produce_start(c, b, start, end, self.num_pairs(start, end))
            elif cutlass.const_expr(self.prefetch_q):
                self.load_q_tile(c.sQ[None, None, 0], c.mQ, c.mblk, b, c.tid)
                cute.arch.cp_async_commit_group()

    @cute.jit
    def epilogue_barrier(self, c, b):
        """The computing warpgroups' CTA barrier before the epilogue of ``b``'s piece (every wgmma retired, every buffer
        read), every loop's; with :attr:`prefetch` and :attr:`prefetch_q` the next piece's Q tile follows
        (:meth:`next_piece` in ``b + 1..c.b_last``, looked up here so no value of it lives across the loop), which its
        run waits for.  Piece-trace builds mark both sides of the barrier and the Q tile's issue."""
        self.mark_piece(c, b, 2)
        cute.arch.barrier()
        self.mark_piece(c, b, 4)
        if cutlass.const_expr(self.prefetch and self.prefetch_q):
            self.start_piece(c, self.next_piece(c, b + 1, c.b_last), False)
            self.mark_piece(c, b, 5)

    @cute.jit
    def walk_chunks(self, c, b_first: Int32, b_last: Int32, producer: cutlass.Constexpr):
        """Batch-invariant walk (:attr:`chunk` > 0): request ``b``'s part ``[start, end)`` (:meth:`piece`; ``start`` a
        multiple of ``chunk``) runs as the pieces ``[cs, min(cs + chunk, end))`` for ``cs = start, start + chunk, ..``,
        as in every batch; one longer than ``chunk`` writes piece ``cs / chunk`` to slot ``b * P + cs / chunk``, ``P =
        ceil(capacity / chunk)`` (``B * P`` slots), a shorter one direct.  As one loop carrying only ``(b, cs)``, the
        run keeps its default-walk registers.  A run depends on ``(b, seq, cs, end, slot < 0)`` only: any CTA alike."""
        mCta, mBT, mSeq, g = c.mCta, c.mBT, c.mSeq, c.g
        b = b_first
        cs = mCta[g, 1]
        while b <= b_last:
            seq, _, end, _ = self.piece(mCta, mBT, mSeq, g, b)
            # (warp-uniform by a shuffle: without it ptxas treats the piece's run as a divergent path and serializes
            # the 16-bit S x H 16 loop's wgmmas, a WARPGROUP.DEPBAR after each)
            seq = cute.arch.make_warp_uniform(seq)
            end = cute.arch.make_warp_uniform(end)
            if end > cs:
                slot = Int32(-1)
                if seq > self.chunk:
                    per_req = (mBT.shape[1] * self.page_size + self.chunk - 1) // self.chunk
                    slot = b * per_req + cs // self.chunk
                self.run_piece(c, b, seq, cs, cutlass.min(cs + self.chunk, end), slot, producer)
            cs = cs + self.chunk
            if cs >= end:
                b = b + 1
                cs = Int32(0)

    @cute.jit
    def run_piece(self, c, b: Int32, seq: Int32, start: Int32, end: Int32, slot: Int32, producer: cutlass.Constexpr):
        """One non-empty piece ``[start, end)`` of request ``b``, a whole run of the loop between CTA barriers.  Hooks:
        ``produce_start`` and ``produce_rest(c, b, start, end, n_pairs)`` (the producer: first KV tiles, then after the
        barrier Q waits on, the refills), :meth:`load_piece_q`, ``consume(c, cta, b, seq, start, end, slot, n_pairs)``
        (computing warpgroups: loop and epilogue, which starts with the CTA barrier :meth:`epilogue_barrier`),
        ``advance_phases(n_pairs)`` (piece's mbarrier completions into :attr:`ph`).
        :attr:`prefetch`: the first KV tiles were issued ahead (:meth:`start_piece`), and the next piece's (in ``b +
        1..c.b_last``) are issued at this one's epilogue barrier."""
        tid, sM, g = c.tid, c.sM, c.g
        n_pairs = self.num_pairs(start, end)
        if cutlass.const_expr(producer):
            if cutlass.const_expr(not self.prefetch):
                self.produce_start(c, b, start, end, n_pairs)
            cute.arch.barrier()  # the consumers' Q tile landed
            self.produce_rest(c, b, start, end, n_pairs)
            cute.arch.barrier()  # the consumers' barrier before their epilogue: every buffer read
            if cutlass.const_expr(self.prefetch):
                self.start_piece(c, self.next_piece(c, b + 1, c.b_last), True)
        else:
            self.mark_piece(c, b, 0, (b, start, end, slot))
            if tid < 64:
                sM[tid] = -Float32.inf
            if cutlass.const_expr(self.prefetch and self.prefetch_q):
                cute.arch.cp_async_wait_group(0)  # the Q tile start_piece issued
            else:
                self.load_piece_q(c, b, start, end)
            cute.arch.fence_view_async_shared()  # q (generic stores) before the wgmmas read it
            cute.arch.barrier()
            self.mark_piece(c, b, 1)
            cta = g * self.num_m_blocks + c.mblk  # (debug traces: mark)
            self.clear_trace(c.mTrace, cta, c.wg, c.wtid)
            self.consume(c, cta, b, seq, start, end, slot, n_pairs)
            self.mark_piece(c, b, 6)
        cute.arch.barrier()  # the piece's epilogue done: its buffers are free
        if cutlass.const_expr(not producer):
            self.mark_piece(c, b, 3)
            self.advance_phases(n_pairs)

    @cute.jit
    def load_piece_q(self, c, b: Int32, split_start: Int32, split_end: Int32):
        """Computing warpgroups: the Q tile (:meth:`load_q_tile`), before :meth:`run_piece`'s fence and barrier."""
        self.load_q_tile(c.sQ[None, None, 0], c.mQ, c.mblk, b, c.tid)

    @cute.jit
    def q_rows(self, mblk: Int32, b: Int32, tid: Int32):
        """Global q rows ``[B*R]`` of the two tile rows ``tid//8 + 32m`` this thread loads; rows past R are
        a clamped copy of row R-1 (finite, never stored), or -1 (load zeros) with :attr:`pad_zero`."""
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
    def landed(self, mbar_ptr, phase):
        """Wait for a refill: completion ``phase`` of its mbarrier from the piece's start (:meth:`phase_bits`)."""
        k = (mbar_ptr.toint() - self.mbar_base.toint()) >> 3
        cute.arch.mbarrier_wait(mbar_ptr, phase ^ ((self.ph[0] >> k) & 1))

    def fresh_smem(self, c, views):
        """Re-derive ``views`` (storage tensors / pointers, or None) from a fresh copy of the storage's address where a
        main loop issues a wgmma, so its descriptors are built right there: ``c.mbar``'s address through a warp shuffle
        (``make_warp_uniform``) cannot be hoisted out of the loop, so each descriptor is computed at its use on the
        uniform datapath (ptxas drops the shuffle of a uniform value).  Otherwise ptxas hoisted a loop's ~30 invariant
        64-bit descriptors into vector registers, ``R2UR``-copied each to the wgmma's uniform registers and added the
        k-offsets on the vector ALUs; built at the iteration's top, they stayed live across the softmax in vector
        registers.  Pointers keep their type (swizzle, alignment): offsets from ``c.mbar`` are constant."""
        ref = c.mbar.toint()
        fresh = cute.arch.make_warp_uniform(ref)
        out = []
        for v in views:
            if v is None:
                out.append(None)
                continue
            p = v.iterator if isinstance(v, cute.Tensor) else v
            addr = Int64(fresh + (p.toint() - ref))
            q = _cute_ir.inttoptr(p.type, _cute_ir.assume(_cute_ir.ConstrainedIntType.get(p.alignment, 64),
                                                          addr.ir_value()))
            out.append(cute.make_tensor(q, v.layout) if isinstance(v, cute.Tensor) else q)
        return out

    @cute.jit
    def qk_chunks(self, qk_mma: cute.TiledMma, acc_s: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor,
                  chunks: cutlass.Constexpr, first: cutlass.Constexpr):
        """Issue ``S (+)= Q[:, chunks] K[:, chunks]^T`` (no commit); ``first``: S from zero.  The MMA always accumulates
        (ACCUMULATE is set once at kernel scope: set in a warpgroup's branch, it wouldn't dominate the other's uses)."""
        if cutlass.const_expr(first):
            acc_s.fill(0.0)
        warpgroup.fence()
        kpc = _CHUNK // (_K32 if cutlass.const_expr(self.fp8) else _K16)  # wgmma k-steps per 64-column chunk
        for c in cutlass.range_constexpr(len(chunks)):
            for kk in cutlass.range_constexpr(kpc):
                k = chunks[c] * kpc + kk
                cute.gemm(qk_mma, acc_s, tSrQ[None, None, k], tSrK[None, None, k], acc_s)

    @cute.jit
    def scaled_tile_max(self, acc_s: cute.Tensor, tScS: cute.Tensor, lim: cute.Tensor, tile_start: Int32,
                        scale_log2: Float32):
        """S -> exp2 domain in place, -inf for keys at or past the row's ``lim``; the quad-reduced row maxima."""
        mx = cute.make_rmem_tensor((2,), Float32)
        mx[0] = -Float32.inf
        mx[1] = -Float32.inf
        self.scale_mask(acc_s, tScS, lim, tile_start, scale_log2, mx)
        for h in cutlass.range_constexpr(2):
            mx[h] = quad_max(mx[h])
        return mx

    @cute.jit
    def scale_mask(self, acc_s: cute.Tensor, tScS: cute.Tensor, lim: cute.Tensor, tile_start: Int32,
                   scale_log2: Float32, mx: cute.Tensor, cols: cutlass.Constexpr = False):
        """S -> exp2 domain in place, -inf for keys at or past the row's ``lim``, folded into the maxima ``mx`` (one per
        row; ``cols``: ``S^T``, keys down rows, one per column: :meth:`~.transposed_out.TransposedOutMixin.col_n`).
        A tile whose 64 keys are all below the ``lim`` of every row of the warp (every tile of a piece but its last
        one or two) skips the per-key compare and select: the same values, a third of the instructions."""
        whole = tile_start + self.block_n <= lim[0]
        for i in cutlass.range_constexpr(1, cute.size(lim)):
            whole = whole & (tile_start + self.block_n <= lim[i])
        if cute.arch.vote_all_sync(whole):
            self.scale_scores(acc_s, tScS, lim, tile_start, scale_log2, mx, cols, False)
        else:
            self.scale_scores(acc_s, tScS, lim, tile_start, scale_log2, mx, cols, True)

    @cute.jit
    def scale_scores(self, acc_s: cute.Tensor, tScS: cute.Tensor, lim: cute.Tensor, tile_start: Int32,
                     scale_log2: Float32, mx: cute.Tensor, cols: cutlass.Constexpr, masked: cutlass.Constexpr):
        """:meth:`scale_mask`'s loop over the thread's scores; ``masked``: with the per-key compare and select."""
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            i = e % 2 + 2 * (e // 4) if cutlass.const_expr(cols) else (e // 2) % 2
            v = acc_s[e] * scale_log2
            if cutlass.const_expr(masked):  # noqa: SIM102 (static + dynamic test)
                if tile_start + tScS[e][0 if cutlass.const_expr(cols) else 1] >= lim[i]:
                    v = -Float32.inf
            acc_s[e] = v
            mx[i] = cute.arch.fmax(mx[i], v)

    @cute.jit
    def all_one(self, sc: cute.Tensor):
        """True where every scale of this thread's rows (columns) is exactly 1: no max moved (vote it per warp)."""
        one = sc[0] == 1.0
        for i in cutlass.range_constexpr(1, cute.size(sc)):
            one = one & (sc[i] == 1.0)
        return one

    @cute.jit
    def fold_max(self, m_prev: Float32, mx: Float32):
        """Fold a tile's row max ``mx`` into the shared running max ``m_prev``: ``(m_new, ref, scale)``, ``ref`` what P
        is computed against (0 while the max is -inf: exact zeros), ``scale = exp2(m_prev - ref)`` rescales state."""
        m_new = cute.arch.fmax(m_prev, mx)
        ref = m_new
        if m_new == -Float32.inf:
            ref = Float32(0.0)
        return m_new, ref, cute.arch.exp2(m_prev - ref)

    @cute.jit
    def exp_rows(self, acc_s: cute.Tensor, ref: cute.Tensor, row_l: cute.Tensor):
        """``P = exp2(S - ref)`` in place, added to the thread's partial row sums.  FP8: ``2^8 P`` (:attr:`p8_bias`);
        O and l carry the factor until the epilogue subtracts it from the row max for the LSE."""
        rb = ref
        if cutlass.const_expr(self.fp8):
            rb = cute.make_rmem_tensor((2,), Float32)
            for h in cutlass.range_constexpr(2):
                rb[h] = ref[h] - self.p8_bias
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            h = (e // 2) % 2
            p = cute.arch.exp2(acc_s[e] - rb[h])
            acc_s[e] = p
            row_l[h] = row_l[h] + p

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
    def fold_second_max(self, acc_s, tScS, lim, tile_start, scale_log2, sM, sSc0, sSc1, row_in, row_l, ref, sc, wtid):
        """Warpgroup 1, after SCALE0: fold its tile into the shared row max; ``sc`` = scale0 x its own scale (which it
        publishes in ``sSc1``), the row sums rescaled by it."""
        mx = self.scaled_tile_max(acc_s, tScS, lim, tile_start, scale_log2)
        for h in cutlass.range_constexpr(2):
            m_new, ref[h], s1 = self.fold_max(sM[row_in[h]], mx[h])
            sc[h] = sSc0[row_in[h]] * s1
            row_l[h] = row_l[h] * sc[h]
            if wtid % 4 == 0:
                sM[row_in[h]] = m_new
                sSc1[row_in[h]] = s1

    @cute.jit
    def epilogue(self, pv_thr, acc_o, row_m, row_l, row_in, sSum, mOut, mLse, mOacc, mLacc, out_scale, mblk,
                 slot, b, wg, wtid, stage):
        """O / l and the LSE of the CTA's rows: the output (times ``output_scale``) if ``slot < 0``, else the normalised
        fp32 partial and its LSE into workspace slot ``slot`` (:meth:`out_row`).  ``stage = (pointer, bytes)``: free
        shared memory (16-byte aligned, >= 36 KB) O leaves through in full 16-byte chunks (:meth:`store_o_staged`)."""
        self.share_row_sums(row_l, row_in, sSum, wg, wtid)
        inv = cute.make_rmem_tensor((2,), Float32)
        lse = cute.make_rmem_tensor((2,), Float32)
        for h in cutlass.range_constexpr(2):
            l_tot = sSum[row_in[h]] + sSum[64 + row_in[h]]
            inv[h] = 0.0
            lse[h] = -Float32.inf
            if l_tot != 0.0:  # (NaN: a key with NaN / Inf was seen, NaN LSE)
                inv[h] = 1.0 / l_tot
                lse[h] = (row_m[h] + cute.math.log2(l_tot, fastmath=False)) * LN_2
        tOcO = pv_thr.partition_C(cute.make_identity_tensor((self.block_m, self.DV // 2)))
        scale = Float32(1.0)
        if slot < 0:
            scale = out_scale
        for h in cutlass.range_constexpr(2):
            r = mblk * self.block_m + row_in[h]
            if r < self.R:  # noqa: SIM102 (dynamic tests)
                if wtid % 4 == 0 and wg == 0:
                    gL = cute.make_tensor(mLse.iterator + self.out_row(b, Int32(-1), r), cute.make_layout(1))
                    if slot >= 0:
                        gL = cute.make_tensor(mLacc.iterator + self.out_row(b, slot, r), cute.make_layout(1))
                    gL[0] = lse[h]
        fac = cute.make_rmem_tensor((2,), Float32)
        for h in cutlass.range_constexpr(2):
            fac[h] = inv[h] * scale
            if inv[h] == 0.0:  # a row without keys: exact zeros whatever output_scale holds (NaN, inf)
                fac[h] = 0.0
        for h in cutlass.range_constexpr(2):
            for e in cutlass.range_constexpr(cute.size(acc_o)):
                if cutlass.const_expr((e // 2) % 2 == h):
                    acc_o[e] = acc_o[e] * fac[h]
        if slot < 0:
            self.store_o_staged(acc_o, tOcO, row_in, stage, mOut, mOacc, mblk, slot, b, wg, wtid, True)
        else:
            self.store_o_staged(acc_o, tOcO, row_in, stage, mOut, mOacc, mblk, slot, b, wg, wtid, False)

    @cute.jit
    def share_row_sums(self, row_l: cute.Tensor, row_in: cute.Tensor, sSum: cute.Tensor, wg: Int32, wtid: Int32):
        """The epilogue's row sums of the thread's 2 rows, summed over their quad, into ``sSum[64 wg + row]`` (by
        one lane a row); both warpgroups' are there after the ROW_SUM barrier."""
        for h in cutlass.range_constexpr(2):
            row_l[h] = quad_sum(row_l[h])
            if wtid % 4 == 0:
                sSum[wg * 64 + row_in[h]] = row_l[h]
        cute.arch.barrier(barrier_id=int(Barrier.ROW_SUM), number_of_threads=self.num_threads)

    @cute.jit
    def out_row(self, b, slot, r):
        """Row of query row ``r`` of request ``b`` in ``out`` / ``lse`` (``slot < 0``) or in workspace slot ``slot``
        of the fp32 partials (``o_accum`` / ``lse_accum``), as an Int64."""
        row = Int64(b) * self.R + r
        if slot >= 0:
            row = Int64(slot) * self.R + r
        return row

    @cute.jit
    def store_o_staged(self, acc_o, tOcO, row_in, stage, mOut, mOacc, mblk, slot, b, wg, wtid,
                       direct: cutlass.Constexpr):
        """Warpgroup ``wg``'s scaled O (``acc_o``, 64 rows x 256 features) to ``out`` (``direct``) or fp32 partial slot
        ``slot`` through ``stage`` in passes of ``cw`` features (:func:`staged_pass_features`): threads write element
        pairs (4 or 8 bytes) into a 64-row tile, ``cw + 8`` elements a row (the 8 put a warp's pair stores, 8 rows x 4
        threads, on 32 distinct banks); after the warpgroup's TAIL barrier the warps copy whole row segments out, 16
        bytes a thread (coalesced).  Rows past R are not stored.  Q tile stage: 16-bit (72 KB) 1 pass (bf16) or 2
        (fp32); FP8 (36 KB) 2 or 4."""
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
                    gdst = row_ptr(mOut if direct else mOacc, self.out_row(b, slot, r), f, self.DV, 16)
                    cute.autovec_copy(chunk, cute.make_tensor(gdst, cute.make_layout(vec)))
            if cutlass.const_expr(p + 1 < (self.DV // 2) // cw):  # the next pass overwrites the tile
                cute.arch.barrier(barrier_id=int(Barrier.TAIL) + wg, number_of_threads=128)

    def launch_main(self, main, smem: int, stream, output_scale, sched_cta, sched_req, out, lse, o_accum, lse_accum):
        """Host side of every loop: launch its traced main kernel ``main`` (``smem`` bytes of shared memory: one CTA
        per SM) on the persistent grid ``(row blocks, num_ctas)`` (:meth:`cta_start`), then :meth:`launch_combine`."""
        main.launch(grid=(self.num_m_blocks, self.num_ctas, 1), block=(self.cta_threads, 1, 1), smem=smem,
                    stream=stream, min_blocks_per_mp=1)
        self.launch_combine(stream, o_accum, lse_accum, output_scale, sched_cta, sched_req, out, lse)


def staged_pass_features(elem_bytes: int, stage_bytes: int) -> int:
    """Features per pass of :meth:`MlaDecodeSm90.store_o_staged`: the most of 256 / 128 / 64 for which both
    warpgroups' 64-row tiles, rows of ``features + 8`` elements of ``elem_bytes``, fit in ``stage_bytes``."""
    for cw in (256, 128, 64):
        if 2 * 64 * (cw + 8) * elem_bytes <= stage_bytes:
            return cw
    raise ValueError(f"store_o_staged: {stage_bytes} bytes of shared memory are too few for O")


__all__ = ["MlaDecodeSm90", "staged_pass_features"]
