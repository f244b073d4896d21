"""Small building blocks: RMSNorm, the bias-free ``Linear`` (optionally FP8 block-quantised) and the dense
SwiGLU MLP (also the MoE's shared experts).

FP8 weights (DeepSeek-R1's release format) stay FP8 in memory: ``kernel`` is float8_e4m3fn ``[in, out]``
(the transpose of the checkpoint's ``[out, in]``) and ``kernel_scale_inv`` float32
``[ceil(in / bi), ceil(out / bo)]`` (the transpose of ``weight_scale_inv`` for ``(bo, bi)`` blocks).  The
matmul runs inside the jitted step in one of two forms, chosen by the number of rows (tokens) ``M`` of the call,
which is static:

* ``M <= KBLOCK_MAX_ROWS`` (decode steps): :func:`fp8_block_matmul`, the e4m3 kernel cast to the compute dtype
  (exact) and multiplied per 128-row input block into float32 partials ``[in / bi, M, out]``, which are scaled by
  their blocks' ``scale_inv`` and summed.  XLA fuses the cast into the matmul's operand, so the kernel is read once
  as e4m3; the float32 partials are ``in / bi`` times the output, small while ``M`` is.
* larger ``M`` (prefill): :func:`dequantize` (e4m3 -> float32 times the block's scale, rounded once to the compute
  dtype), then one matmul; XLA writes the dequantised kernel once per call, which a long prompt amortises.

Measured on the H200 (``benchmarks/fp8_matmul_forms.py`` on R1's shapes, bf16; ``docs/model.md``): XLA does not fuse the
per-block scale multiply of :func:`dequantize` into the dot, so that form costs 1.9-3.6x the matmul with bf16
weights at ``M = 1..16`` (o_proj 16384 x 7168: 213 vs 63 us at M = 1); the block-partial form takes 52-121 us at
``M = 1`` on the four shapes (o_proj 59 us), and is still faster than dequantise-then-matmul at ``M = 64``
(o_proj 178 vs 215 us).  The two forms round differently (float32 partials vs a bf16-rounded dequantised kernel):
within float32 rounding of each other in float32, within bf16 rounding in bf16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

FP8 = jnp.float8_e4m3fn


def _block_dims(din: int, dout: int, block) -> tuple[int, int]:
    """``(bo, bi)`` of checkpoint blocks ``block = (bo, bi)`` on an ``[in, out]`` weight: a block past the weight
    is the weight."""
    return min(block[0], max(dout, 1)), min(block[1], max(din, 1))


def dequantize(w: jax.Array, scale_inv: jax.Array | None, dtype, block=(128, 128)) -> jax.Array:
    """``w [..., in, out]`` (e4m3) times its per-block ``scale_inv [..., ceil(in/bi), ceil(out/bo)]``,
    in ``dtype``, for checkpoint blocks ``block = (bo, bi)``; ``scale_inv=None`` is a plain cast."""
    if scale_inv is None:
        return w.astype(dtype)
    din, dout = w.shape[-2:]
    bo, bi = _block_dims(din, dout, block)
    s = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), bi, axis=-2), bo, axis=-1)[..., :din, :dout]
    return (w.astype(jnp.float32) * s).astype(dtype)


KBLOCK_MAX_ROWS = 64  # rows (tokens) up to which an FP8 Linear multiplies per input block (module docstring)


def fp8_block_matmul(x: jax.Array, w: jax.Array, scale_inv: jax.Array, dtype, block=(128, 128)) -> jax.Array:
    """``x [..., in] @ dequantize(w, scale_inv)`` for ``w [in, out]`` e4m3 without materialising the dequantised
    kernel: ``sum_k scale_inv[k, out // bo] * (x[..., k-th block] @ w[k-th block])``, the block products in float32
    (``w`` cast exactly to ``dtype``), the result in ``dtype``.  A partial last input block is zero-padded."""
    din, dout = w.shape
    bo, bi = _block_dims(din, dout, block)
    kb = -(-din // bi)
    lead = x.shape[:-1]
    xm = x.reshape(-1, din).astype(dtype)
    wk = w.astype(dtype)
    if kb * bi != din:
        xm = jnp.pad(xm, ((0, 0), (0, kb * bi - din)))
        wk = jnp.pad(wk, ((0, kb * bi - din), (0, 0)))
    xb, wb = xm.reshape(-1, kb, bi), wk.reshape(kb, bi, dout)

    def products(a, b):  # float32 block products of the compute-dtype operands
        return jnp.einsum("mkc,kcn->kmn", a, b, preferred_element_type=jnp.float32)

    # XLA:CPU has no bf16 x bf16 -> f32 dot: there the operands are widened first (exact, the same products)
    part = jax.lax.platform_dependent(
        xb, wb, cpu=lambda a, b: products(a.astype(jnp.float32), b.astype(jnp.float32)), default=products)
    s = jnp.repeat(scale_inv.astype(jnp.float32), bo, axis=-1)[:, :dout]  # [kb, out]
    y = jnp.einsum("kmn,kn->mn", part, s)
    return y.astype(dtype).reshape(lead + (dout,))


def fp8_scale_shape(din: int, dout: int, block: tuple[int, int]) -> tuple[int, int]:
    """Shape of the transposed ``kernel_scale_inv`` of an ``[in, out]`` kernel with checkpoint blocks
    ``(bo, bi)`` (``quantization_config.weight_block_size``)."""
    bo, bi = block
    return (-(-din // bi), -(-dout // bo))


class RMSNorm(nnx.Module):
    """``weight * (x * rsqrt(mean(x^2) + eps))`` with the normalisation in float32 (transformers'
    ``DeepseekV3RMSNorm``); the weight is named ``weight`` as in the checkpoint."""

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-6,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs | None = None,
    ):
        del rngs  # initialised to ones; kept for the uniform ``*, rngs`` signature
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(self.dtype) * xf.astype(self.dtype)).astype(self.dtype)


class Linear(nnx.Module):
    """Bias-free ``x @ kernel`` (kernel ``[in, out]``).  With ``fp8_block`` the kernel is e4m3 with a
    ``kernel_scale_inv`` (module docstring); otherwise it is ``param_dtype``."""

    def __init__(
        self,
        din: int,
        dout: int,
        *,
        dtype,
        param_dtype,
        rngs: nnx.Rngs,
        std: float = 0.02,
        fp8_block: tuple[int, int] | None = None,
    ):
        self.dtype = dtype
        self.fp8 = fp8_block is not None
        self.fp8_block = None if fp8_block is None else tuple(fp8_block)
        if self.fp8:
            # Generated weights come from DeepseekV3.random / the loader; unit scales and zeros here.
            self.kernel = nnx.Param(jnp.zeros((din, dout), FP8))
            self.kernel_scale_inv = nnx.Param(jnp.ones(fp8_scale_shape(din, dout, fp8_block), jnp.float32))
        else:
            self.kernel = nnx.Param(nnx.initializers.normal(std)(rngs.params(), (din, dout), param_dtype))

    def weight(self) -> jax.Array:
        """The kernel in the compute dtype (dequantised per block when FP8)."""
        if not self.fp8:
            return self.kernel[...].astype(self.dtype)
        return dequantize(self.kernel[...], self.kernel_scale_inv[...], self.dtype, self.fp8_block)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.fp8 and x.size // max(x.shape[-1], 1) <= KBLOCK_MAX_ROWS:
            return fp8_block_matmul(x, self.kernel[...], self.kernel_scale_inv[...], self.dtype, self.fp8_block)
        return jnp.dot(x.astype(self.dtype), self.weight())


def linear(
    din: int, dout: int, *, dtype, param_dtype, rngs: nnx.Rngs, std: float = 0.02, fp8_block=None
) -> Linear:
    """A bias-free :class:`Linear` (kernel ``[in, out]``, the transpose of the checkpoint's ``[out, in]``)."""
    return Linear(din, dout, dtype=dtype, param_dtype=param_dtype, rngs=rngs, std=std, fp8_block=fp8_block)


class MLP(nnx.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
        fp8_block=None,
    ):
        kw = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs, "fp8_block": fp8_block}
        self.gate_proj = linear(hidden_size, intermediate_size, **kw)
        self.up_proj = linear(hidden_size, intermediate_size, **kw)
        self.down_proj = linear(intermediate_size, hidden_size, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
