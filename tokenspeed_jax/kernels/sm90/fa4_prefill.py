"""Hopper (SM90) ragged prefill forward: FlashAttention-4's CuTe DSL kernel, adapted to our contract.

We depend on ``flash-attn-4`` (BSD) for the kernel and adapt it to our contract without copying its
source, through overrides of its ``@cute.jit`` device methods and one small kernel of our own:

* **softmax_scale is read from device memory.** FA4 takes the scale as a host ``Float32`` kernel
  argument, which would bake the value into the launch (and a new value could not be captured in a
  CUDA graph). Our launch passes the shape-``(1,)`` float32 scale tensor through FA4's otherwise unused
  ``learnable_sink`` tensor slot (FA4 forwards it untouched from ``__call__`` to ``kernel`` to ``mma``);
  :meth:`FA4PrefillSm90.mma` loads it once per consumer thread, forms ``scale * log2(e)`` exactly as
  FA4's host code would, and calls FA4's ``mma`` with ``learnable_sink=None``. The host ``softmax_scale``
  argument is a dummy constant. Cost: one cached 4-byte load per thread per CTA.
* **Rows that see no key give 0 and LSE -inf.** FA4 does not write q rows past ``cu_seqlens_q[-1]``, and
  for tiles that see no key (bottom-right causal with ``Lq > Lk``, requests with ``Lk = 0``) it still
  processes one out-of-range K/V block whose (negative) columns the masks do not remove, so those rows
  may get a softmax over another request's keys. The launch runs :func:`rows_without_keys_kernel` after
  FA4's kernel on the same stream and overwrites exactly those rows (an override of FA4's epilogue that
  wrote them in registers made ptxas reschedule FA4's main loop: ``docs/sm90_prefill_rejected.md``).

Not changed: V rows past a request's end inside its last K/V tile are loaded and multiplied by P = 0, so
up to ``tile_n - 1`` (<= 127) rows past ``cu_seqlens_k[-1]`` must be finite (the caller's contract, see
:mod:`tokenspeed_jax.backends.sm90_prefill` for why this is not patched here).

Layouts: q ``[Tq, Hq, Dqk]``, k ``[Tk, Hk, Dqk]``, v ``[Tk, Hk, Dv]``, out ``[Tq, Hq, Dv]`` row-major as
FA4 expects; our LSE ``[Tq, Hq]`` is handed to FA4 as the ``(Hq, Tq)`` view it writes into (strides
``(1, Hq)``), so no transpose pass is needed. FA4's LSE is already the natural log. Tile sizes come
from FA4's own SM90 heuristic.

CuTe DSL only; importing this module imports ``flash_attn.cute`` (which imports torch), so the backend
imports it lazily.
"""

from __future__ import annotations

import math

import cutlass
from cutlass import Float32, Int32, Int64, const_expr, cute
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from flash_attn.cute.utils import AuxData

from tokenspeed_jax.kernels.sm90.helpers import row_ptr

LOG2_E = math.log2(math.e)

_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


def _fa4_sm90_tiles(head_dim: int, head_dim_v: int, causal: bool):
    """FA4's own SM90 forward tile heuristic (tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap)."""
    from flash_attn.cute.interface import _tile_size_fwd_sm90

    cfg = _tile_size_fwd_sm90(head_dim, head_dim_v, causal, False)
    return cfg.m_block_size, cfg.n_block_size, cfg.mma_pv_is_rs, cfg.intra_wg_overlap


class FA4PrefillSm90(FlashAttentionForwardSm90):
    """FA4's SM90 forward with a device-resident softmax scale.

    Static configuration: ``dtype`` ("bfloat16"/"float16"), ``head_dim``, ``head_dim_v``,
    ``qhead_per_kvhead`` (Hq / Hk; GQA rows are packed as FA4 does), ``causal`` (bottom-right).
    """

    def __init__(self, dtype: str, head_dim: int, head_dim_v: int, qhead_per_kvhead: int, *, causal: bool):
        reason = self.can_implement_problem(dtype, head_dim, head_dim_v, qhead_per_kvhead)
        if reason is not None:
            raise ValueError(reason)
        tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap = _fa4_sm90_tiles(head_dim, head_dim_v, causal)
        super().__init__(
            _DTYPES[dtype],
            head_dim,
            head_dim_v,
            qhead_per_kvhead,
            is_causal=causal,
            is_local=False,
            pack_gqa=qhead_per_kvhead > 1,
            tile_m=tile_m,
            tile_n=tile_n,
            num_stages=2,
            num_threads=384,
            Q_in_regs=False,
            intra_wg_overlap=intra_wg_overlap,
            mma_pv_is_rs=mma_pv_is_rs,
        )

    @staticmethod
    def can_implement_problem(
        dtype: str, head_dim: int, head_dim_v: int, qhead_per_kvhead: int
    ) -> str | None:
        """None if this kernel handles the configuration, else why not."""
        if dtype not in _DTYPES:
            return f"dtype {dtype} (the FA4 Hopper forward takes bfloat16/float16)"
        for name, d in (("Dqk", head_dim), ("Dv", head_dim_v)):
            if not 8 <= d <= 256 or d % 8:
                return f"{name} = {d} (FA4's Hopper forward needs a multiple of 8 in [8, 256])"
        if qhead_per_kvhead < 1:
            return f"Hq / Hk = {qhead_per_kvhead}"
        return None

    # ------------------------------------------------------------------------------ device overrides
    @cute.jit
    def mma(
        self,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        mO: cute.Tensor,
        mLSE: cute.Tensor | None,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sVt: cute.Tensor,
        sP: cute.Tensor | None,
        sO: cute.Tensor,
        learnable_sink: cute.Tensor | None,
        pipeline_k,
        pipeline_v,
        pipeline_q,
        gmem_tiled_copy_O: cute.TiledCopy,
        tma_atom_O: cute.CopyAtom | None,
        tidx: Int32,
        softmax_scale_log2: Float32,
        softmax_scale: Float32 | None,
        block_info,
        SeqlenInfoCls,
        AttentionMaskCls,
        TileSchedulerCls,
        blocksparse_tensors,
        aux_data: AuxData = AuxData(),  # noqa: B008 - FA4's signature
        fastdiv_mods=None,
    ):
        # ``learnable_sink`` carries our (1,) float32 softmax-scale tensor (see the module docstring).
        scale_log2 = Float32(learnable_sink[0]) * Float32(LOG2_E)
        FlashAttentionForwardSm90.mma(
            self,
            tiled_mma_qk,
            tiled_mma_pv,
            mO,
            mLSE,
            sQ,
            sK,
            sVt,
            sP,
            sO,
            None,
            pipeline_k,
            pipeline_v,
            pipeline_q,
            gmem_tiled_copy_O,
            tma_atom_O,
            tidx,
            scale_log2,
            softmax_scale,
            block_info,
            SeqlenInfoCls,
            AttentionMaskCls,
            TileSchedulerCls,
            blocksparse_tensors,
            aux_data,
            fastdiv_mods,
        )


@cute.jit
def fa4_prefill_launch(
    stream,
    q: cute.Tensor,
    k: cute.Tensor,
    v: cute.Tensor,
    cu_seqlens_q: cute.Tensor,
    cu_seqlens_k: cute.Tensor,
    softmax_scale: cute.Tensor,
    out: cute.Tensor,
    lse: cute.Tensor | None = None,
    *,
    dtype: cutlass.Constexpr,
    head_dim: cutlass.Constexpr,
    head_dim_v: cutlass.Constexpr,
    qhead_per_kvhead: cutlass.Constexpr,
    causal: cutlass.Constexpr,
    num_q_heads: cutlass.Constexpr = 0,
):
    """Launch :class:`FA4PrefillSm90` (static configuration from the constexprs) on one ragged batch.

    Operands in FFI order: q, k, v, cu_seqlens_q, cu_seqlens_k (int32 ``[B + 1]``), softmax_scale
    (float32 ``(1,)``), then outputs out and, when requested, lse ``[Tq, Hq]`` float32. The constexprs
    are plain values (not a kernel object) so the compile key has a stable text for the disk cache.

    FA4's own epilogue, then :func:`rows_without_keys_kernel` on the same stream gives every row with no
    visible key 0 / LSE -inf (``num_q_heads`` = Hq sizes its rows).
    """
    kernel = FA4PrefillSm90(dtype, head_dim, head_dim_v, qhead_per_kvhead, causal=causal)
    lse_view = None
    if const_expr(lse is not None):
        lse_view = cute.make_tensor(lse.iterator, cute.select(lse.layout, mode=[1, 0]))
    kernel(
        q,
        k,
        v,
        out,
        lse_view,
        Float32(1.0),  # dummy: the kernel reads the scale from ``softmax_scale`` (learnable_sink slot)
        cu_seqlens_q,
        cu_seqlens_k,
        None,  # seqused_q
        None,  # seqused_k
        None,  # page_table
        None,  # window_size_left
        None,  # window_size_right
        softmax_scale,  # -> learnable_sink slot
        None,  # blocksparse_tensors
        AuxData(),
        None,  # cu_total_m_blocks
        None,  # cu_total_splits_m_blocks
        stream,
    )
    rows = cute.size(out, mode=[0])
    grid = cutlass.min((rows + FIX_ROWS_PER_CTA - 1) // FIX_ROWS_PER_CTA, FIX_MAX_CTAS)
    rows_without_keys_kernel(out, lse, cu_seqlens_q, cu_seqlens_k, num_q_heads * head_dim_v, num_q_heads,
                             causal).launch(grid=(cutlass.max(grid, 1), 1, 1), block=(FIX_THREADS, 1, 1),
                                            stream=stream, use_pdl=True)


# rows_without_keys_kernel: 4 warps per CTA, 32 rows per warp at a time (one per lane); at most 2 CTAs per SM
# of a 132-SM H200 (the rows beyond are grid-strided)
FIX_THREADS = 128
FIX_ROWS_PER_CTA = 128
FIX_MAX_CTAS = 264


@cute.jit
def _request_of(cu_q: cute.Tensor, row: Int32, nb: Int32) -> Int32:
    """The request of q row ``row``: the number of ``j`` in ``1..nb`` with ``cu_q[j] <= row`` (binary search
    over the sorted offsets; ``nb`` = B for rows past ``cu_q[B]``)."""
    lo = Int32(0)
    n = nb
    while n > 0:
        half = n // 2
        if cu_q[lo + half + 1] <= row:
            lo = lo + half + 1
            n = n - half - 1
        else:
            n = half
    return lo


@cute.jit
def _sees_no_key(cu_q: cute.Tensor, cu_k: cute.Tensor, row: Int32, nb: Int32, causal: cutlass.Constexpr[bool]) -> Int32:
    """1 when q row ``row`` (< Tq) sees no key: past ``cu_q[B]``, a request with ``Lk <= 0``, or, bottom-right
    causal, a row ``i < Lq - Lk`` of its request; else 0."""
    b = _request_of(cu_q, row, nb)
    blank = Int32(1)
    if b < nb:
        lk = cu_k[b + 1] - cu_k[b]
        if lk > 0:
            blank = Int32(0)
            if const_expr(causal):  # noqa: SIM102 (a static test and a dynamic one do not join with `and`)
                if row - cu_q[b] < cu_q[b + 1] - cu_q[b] - lk:
                    blank = Int32(1)
    return blank


@cute.kernel
def rows_without_keys_kernel(out: cute.Tensor, lse: cute.Tensor | None, cu_q: cute.Tensor, cu_k: cute.Tensor,
                             row_elems: cutlass.Constexpr[int], heads: cutlass.Constexpr[int],
                             causal: cutlass.Constexpr[bool]):
    """0 / LSE -inf for every q row that sees no key: rows past ``cu_q[B]``, rows of requests with
    ``Lk <= 0`` and, bottom-right causal, rows ``i < Lq - Lk`` of a request (FA4 leaves the first unwritten
    and may write a softmax over another request's keys into the others, see the module docstring).

    Each warp takes 32 consecutive rows at a time (grid-strided), one per lane: the lane finds its row's
    request by binary search over ``cu_q`` (:func:`_sees_no_key`), so the dependent loads of 32 rows are in
    flight together (one row per warp at a time serialises those loads). A ballot
    collects the rows that see no key; the warp zeroes each of them with 16-byte stores. Every index stays
    inside ``out``, ``lse`` and the ``B + 1`` offsets for any offsets (the caller clips them to
    ``[0, Tq]`` / ``[0, Tk]``).

    Launched with programmatic dependent launch behind FA4's kernel: the searches read only the offsets
    (which FA4 does not write), so they may run before FA4 has finished; ``griddepcontrol.wait`` comes
    before the first store, and every thread waits once more before it exits, so this grid never
    completes before FA4's (the next kernel on the stream is ordered after this grid only)."""
    tid, _, _ = cute.arch.thread_idx()
    cta, _, _ = cute.arch.block_idx()
    nctas, _, _ = cute.arch.grid_dim()
    lane = tid % 32
    warps = FIX_THREADS // 32
    rows = cute.size(out, mode=[0])
    nb = cute.size(cu_q) - 1  # B
    zero = cute.make_rmem_tensor((8,), out.element_type)
    zero.fill(0.0)
    for base in cutlass.range((cta * warps + tid // 32) * 32, rows, nctas * warps * 32, unroll=1):
        row = base + lane
        blank = Int32(0)
        if row < rows:
            blank = _sees_no_key(cu_q, cu_k, row, nb, causal)
        mask = cute.arch.vote_ballot_sync(blank != 0)
        if mask != 0:
            cute.arch.griddepcontrol_wait()
            for i in cutlass.range(32, unroll=1):
                if (mask >> i) & 1 != 0:
                    r = Int64(base + i)
                    for k in cutlass.range(lane, row_elems // 8, 32, unroll=1):
                        g = cute.make_tensor(row_ptr(out, r, k * 8, row_elems, 16), cute.make_layout(8))
                        g.store(zero.load())
                    if const_expr(lse is not None):
                        for h in cutlass.range(lane, heads, 32, unroll=1):
                            lse[base + i, h] = -Float32.inf
    cute.arch.griddepcontrol_wait()
