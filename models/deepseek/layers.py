"""Small building blocks: RMSNorm and the dense SwiGLU MLP (also the MoE's shared experts)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


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


def linear(din: int, dout: int, *, dtype, param_dtype, rngs: nnx.Rngs, std: float = 0.02) -> nnx.Linear:
    """A bias-free ``nnx.Linear`` (kernel ``[in, out]``, the transpose of the checkpoint's ``[out, in]``)."""
    return nnx.Linear(
        din,
        dout,
        use_bias=False,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=nnx.initializers.normal(std),
        rngs=rngs,
    )


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
    ):
        kw = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        self.gate_proj = linear(hidden_size, intermediate_size, **kw)
        self.up_proj = linear(hidden_size, intermediate_size, **kw)
        self.down_proj = linear(intermediate_size, hidden_size, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
