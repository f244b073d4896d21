"""Launch wrapper of TokenSpeed's Blackwell MLA decode classes (CuTe DSL only: no jax, no torch here).

``launch_decode`` is the ``@cute.jit`` function behind the ``tokenspeed_mla_decode_sm100`` custom call.
It receives the operands exactly as XLA passes them and drives TokenSpeed's kernel classes
(``BlackwellMultiHeadLatentAttentionForwardFP16`` for BF16/FP16, ``...FP8`` for float8_e4m3fn with BF16
output), whose ``__call__`` launches the split-KV kernel and, with ``splits > 1``, the reduction kernel.
The static configuration is :class:`DecodeKernelConfig` (built by the ``sm100`` backend from the plan in
:mod:`tokenspeed_jax.kernels.sm100.plan`).

Operand order (``launch(stream, *inputs, *outputs)``)::

    q [B, S, H, 576], kv_cache [P, page, 576], block_table int32 [B, max_pages], seq_lens int32 [B],
    softmax_scale f32 [1], output_scale f32 [1], (visible_lens int32 [B, S] if config.visible_lens)
    -> out [B, S, H, 512], (lse f32 [B, S, H] base 2 if config.return_lse),
       (workspace f32 [n] if config.splits > 1)

q and the cache rows are split into their latent (first 512) and rope (last 64) parts by views (no
copy); the classes read them with TMA through runtime strides.  The scales stay in device memory and
are read by the kernels (:mod:`.runtime_scalars`).
"""

from __future__ import annotations

import dataclasses

import cutlass
from cutlass import Int32, cute

from tokenspeed_jax.kernels.sm100.plan import LATENT_DIM, ROPE_DIM, compute_capability
from tokenspeed_jax.kernels.sm100.runtime_scalars import DeviceScalar, with_device_scalars

FP8 = "float8_e4m3fn"


@dataclasses.dataclass(frozen=True)
class DecodeKernelConfig:
    """Static configuration of one decode kernel build (the compile key)."""

    arch: str  # "sm_100a" | "sm_103a"
    dtype: str  # "bfloat16" | "float16" | "float8_e4m3fn"
    page_size: int
    num_heads: int
    q_len: int
    causal: bool
    return_lse: bool
    visible_lens: bool  # pass TokenSpeed's local_visible_lens (exact -inf masking of empty rows)
    m_tile: int
    fold: int
    pack_q: bool
    splits: int
    max_active_clusters: int
    reducer_d_tiles: int = 1  # FP8 only
    reducer_max_splits: int = 4  # FP8 only
    tokenspeed_version: str = ""

    @property
    def fp8(self) -> bool:
        return self.dtype == FP8


def kernel_class(fp8: bool) -> type:
    """TokenSpeed's decode class for the dtype, with its scales read from device memory."""
    if fp8:
        from tokenspeed_mla.mla_decode_fp8 import BlackwellMultiHeadLatentAttentionForwardFP8 as base

        kernels = (
            ("split_kv_kernel", ("softmax_scale_log2", "output_scale")),
            ("reduction_kernel", ("output_scale",)),
        )
    else:
        from tokenspeed_mla.mla_decode_fp16 import BlackwellMultiHeadLatentAttentionForwardFP16 as base

        kernels = (("split_kv_kernel", ("softmax_scale_log2", "output_scale")),)
    return with_device_scalars(base, kernels)


def make_kernel(config: DecodeKernelConfig):
    """The configured TokenSpeed kernel object (arguments as ``tokenspeed_mla_decode`` sets them)."""
    kwargs = {
        "acc_dtype": cutlass.Float32,
        "lse_dtype": cutlass.Float32,
        "mma_qk_tiler_mn": (config.m_tile, 128),
        "mma_pv_tiler_mn": (config.m_tile, 256),
        "max_active_clusters": config.max_active_clusters,
        "page_size": config.page_size,
        "skip_correction_threshold": 8.0 if config.fp8 else 0.0,
        "is_persistent": False,  # variable lengths: one CTA (pair) per (tile, request, split)
        "is_var_seq": True,
        "is_var_split_kv": False,
        "fold_sq_factor": config.fold,
        "is_causal": config.causal,
        "num_heads": config.num_heads,
        "seq_len_q": config.q_len,
        "window_left": -1,
        "pack_q": config.pack_q,
        "compute_capability": compute_capability(config.arch),
    }
    if config.fp8:
        kwargs.update(
            reducer_d_tiles=config.reducer_d_tiles,
            reducer_max_splits=config.reducer_max_splits,
            partial_fp16=False,
        )
    return kernel_class(config.fp8)(**kwargs)


def _split_rest(rest, config: DecodeKernelConfig):
    rest = list(rest)
    visible = rest.pop(0) if config.visible_lens else None
    out = rest.pop(0)
    lse = rest.pop(0) if config.return_lse else None
    ws = rest.pop(0) if config.splits > 1 else None
    if rest:
        raise TypeError(f"launch_decode: {len(rest)} unexpected trailing buffers for {config}")
    return visible, out, lse, ws


def _last_dim_view(t: cute.Tensor, offset: int, width: int) -> cute.Tensor:
    """Columns ``[offset, offset + width)`` of the last mode of ``t`` (a strided view)."""
    shape = tuple(t.shape[i] for i in range(cute.rank(t) - 1)) + (width,)
    return cute.make_tensor(t.iterator + offset, cute.make_layout(shape, stride=t.stride))


@cute.jit
def launch_decode(
    stream,
    q: cute.Tensor,
    kv_cache: cute.Tensor,
    block_table: cute.Tensor,
    seq_lens: cute.Tensor,
    softmax_scale: cute.Tensor,
    output_scale: cute.Tensor,
    *rest,
    config: cutlass.Constexpr,
):
    visible, out, lse, ws = _split_rest(rest, config)
    q_latent = _last_dim_view(q, 0, LATENT_DIM)
    q_rope = _last_dim_view(q, LATENT_DIM, ROPE_DIM)
    c_latent = _last_dim_view(kv_cache, 0, LATENT_DIM)
    c_rope = _last_dim_view(kv_cache, LATENT_DIM, ROPE_DIM)
    workspace = None
    if cutlass.const_expr(ws is not None):
        # TokenSpeed addresses its workspace in bytes (int8 pointer); ours is an f32 buffer.
        workspace = cute.make_tensor(
            cute.recast_ptr(ws.iterator, dtype=cutlass.Int8), cute.make_layout(ws.shape[0] * 4)
        )
    kernel = make_kernel(config)
    ss = DeviceScalar(softmax_scale)
    os_ = DeviceScalar(output_scale)
    if cutlass.const_expr(config.fp8):
        kernel(q_latent, q_rope, c_latent, c_rope, block_table, out, lse, workspace, Int32(config.splits),
               seq_lens, seq_lens, None, ss, os_, stream, False, visible)
    else:
        kernel(q_latent, q_rope, c_latent, c_rope, block_table, out, lse, workspace, Int32(config.splits),
               seq_lens, None, ss, os_, stream, False, visible)
