"""Launch wrapper of TokenSpeed's Blackwell FMHA forward class for ragged MLA prefill (CuTe DSL only).

``launch_prefill`` is the ``@cute.jit`` function behind the ``tokenspeed_mla_prefill_sm100`` custom call.
It drives ``tokenspeed_mla.fmha.BlackwellFusedMultiHeadAttentionForward`` the way TokenSpeed's
``tokenspeed_mla_prefill`` does (M128 x N128 tiles, two softmax warpgroups per CTA, non-persistent,
skip-correction on, exp2 emulation off on SM100/SM103), with three differences: the softmax scale stays
in device memory (:mod:`.runtime_scalars`), the output dtype follows the input (BF16 for FP8 and BF16,
FP16 for FP16), and the maximum per-request lengths that size the grid are static (the op's
``max_seqlen_q/k`` hints, else the total token counts).

Operand order (``launch(stream, *inputs, *outputs)``)::

    q [Tq, Hq, Dqk], k [Tk, Hk, Dqk], v [Tk, Hk, Dv], cu_seqlens_q int32 [B + 1],
    cu_seqlens_k int32 [B + 1], softmax_scale f32 [1]
    -> out [Tq, Hq, Dv], (lse f32 [Tq, Hq] natural log if config.return_lse)

The class computes ``lse = log(row_sum) + scale * row_max`` (natural log) and writes 0 / -inf for the rows
of requests without keys; bottom-right causal alignment comes from its ``WINDOW_MASK_INFERENCE`` mask
with ``window_size_right = 0`` (query ``i`` sees keys ``j <= i + Lk - Lq``).
"""

from __future__ import annotations

import dataclasses
import math

import cutlass
from cutlass import Float32, Int32, cute

from tokenspeed_jax.kernels.sm100.runtime_scalars import DeviceScalar, with_device_scalars

LOG2_E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class PrefillKernelConfig:
    """Static configuration of one prefill kernel build (the compile key)."""

    arch: str
    dtype: str
    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    return_lse: bool
    tokenspeed_version: str = ""


def kernel_class() -> type:
    from tokenspeed_mla.fmha import BlackwellFusedMultiHeadAttentionForward as base

    return with_device_scalars(base, (("kernel", ("scale_softmax_log2", "scale_softmax")),))


def make_kernel(config: PrefillKernelConfig):
    from tokenspeed_mla import fmha_helpers

    mask = (
        fmha_helpers.MaskEnum.WINDOW_MASK_INFERENCE if config.causal else fmha_helpers.MaskEnum.RESIDUAL_MASK
    )
    head_dim = (
        (config.head_dim_qk, config.head_dim_v)
        if config.head_dim_qk != config.head_dim_v
        else config.head_dim_qk
    )
    return kernel_class()(
        qk_acc_dtype=cutlass.Float32,
        pv_acc_dtype=cutlass.Float32,
        mma_tiler=(128, 128),
        head_dim=head_dim,
        is_persistent=False,
        mask_type=mask,
        enable_ex2_emulation=False,
        enable_skip_correction=True,
    )


def _token_view(t: cute.Tensor, heads: int, group: int, dim: int) -> cute.Tensor:
    """``[T, H, D]`` as the class's ``(1, T, heads, group, D)`` (only the pointer and ``T`` are read)."""
    return cute.make_tensor(
        t.iterator,
        cute.make_layout(
            (1, t.shape[0], heads, group, dim),
            stride=(0, heads * group * dim, group * dim, dim, 1),
        ),
    )


@cute.jit
def launch_prefill(
    stream,
    q: cute.Tensor,
    k: cute.Tensor,
    v: cute.Tensor,
    cu_seqlens_q: cute.Tensor,
    cu_seqlens_k: cute.Tensor,
    softmax_scale: cute.Tensor,
    out: cute.Tensor,
    *rest,
    config: cutlass.Constexpr,
):
    lse = rest[0] if config.return_lse else None
    hk = config.num_kv_heads
    hr = config.num_q_heads // config.num_kv_heads
    problem_size = (
        Int32(config.batch),
        Int32(config.max_seqlen_q),
        Int32(q.shape[0]),
        Int32(config.max_seqlen_k),
        Int32(config.num_q_heads),
        Int32(hk),
        Int32(config.head_dim_qk),
        Int32(config.head_dim_v),
    )
    ss = DeviceScalar(softmax_scale)
    kernel = make_kernel(config)
    kernel(
        _token_view(q, hk, hr, config.head_dim_qk),
        _token_view(k, hk, 1, config.head_dim_qk),
        _token_view(v, hk, 1, config.head_dim_v),
        _token_view(out, hk, hr, config.head_dim_v),
        problem_size,
        cu_seqlens_q,
        cu_seqlens_k,
        lse,
        ss * LOG2_E,
        ss,
        Float32(1.0),
        None,  # skip_softmax_threshold_log2
        None,  # window_size_left
        Int32(0) if config.causal else None,  # window_size_right: bottom-right causal
        None,
        None,
        stream,
        False,
    )
