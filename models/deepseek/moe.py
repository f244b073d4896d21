"""DeepSeek-V3 mixture of experts: group-limited sigmoid routing with correction bias + shared experts.

Routing (``noaux_tc``, as transformers' ``DeepseekV3TopkRouter`` and DeepSeek's reference), in float32:
``s = sigmoid(x @ gate.weight^T)``; ``c = s + e_score_correction_bias``; group score = sum of the top-2
``c`` of each of ``n_group`` groups; keep the ``topk_group`` best groups; pick the ``num_experts_per_tok``
experts with the largest ``c`` among them; weights are the *uncorrected* ``s`` of those experts,
normalised to sum 1 when ``norm_topk_prob`` (``+1e-20``), times ``routed_scaling_factor``.

Experts run as a grouped matmul (documented decision: correct first, then reasonably fast): the
``T * top_k`` (token, expert) pairs are sorted by expert and multiplied with ``jax.lax.ragged_dot``
against stacked expert weights ``[E, in, out]``, then scattered back weighted.  Compute is proportional to
the routed tokens, not to ``E``; there is no capacity factor and no token is dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from tokenspeed_jax.models.deepseek.config import DeepseekV3Config
from tokenspeed_jax.models.deepseek.layers import MLP


class Router(nnx.Module):
    """``gate.weight [E, hidden]`` (checkpoint layout) and ``gate.e_score_correction_bias [E]``, float32."""

    def __init__(self, config: DeepseekV3Config, *, rngs: nnx.Rngs):
        E = config.n_routed_experts
        self.config = config
        self.weight = nnx.Param(
            nnx.initializers.normal(0.02)(rngs.params(), (E, config.hidden_size), jnp.float32)
        )
        self.e_score_correction_bias = nnx.Param(jnp.zeros((E,), jnp.float32))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [T, hidden]`` -> ``(weights [T, top_k] float32, expert ids [T, top_k] int32)``."""
        c = self.config
        E, G = c.n_routed_experts, c.n_group
        logits = jnp.dot(
            x.astype(jnp.float32), self.weight[...].astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST
        )
        scores = jax.nn.sigmoid(logits)
        choice = scores + self.e_score_correction_bias[...][None, :]
        grouped = choice.reshape(-1, G, E // G)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
        _, gidx = jax.lax.top_k(group_scores, c.topk_group)
        gmask = jnp.zeros_like(group_scores, dtype=bool).at[jnp.arange(x.shape[0])[:, None], gidx].set(True)
        emask = jnp.repeat(gmask, E // G, axis=-1)
        masked = jnp.where(emask, choice, -jnp.inf)
        _, idx = jax.lax.top_k(masked, c.num_experts_per_tok)
        w = jnp.take_along_axis(scores, idx, axis=-1)
        if c.norm_topk_prob:
            w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
        return w * c.routed_scaling_factor, idx.astype(jnp.int32)


class Experts(nnx.Module):
    """Stacked routed experts: ``gate_proj, up_proj [E, hidden, inter]``, ``down_proj [E, inter, hidden]``
    (the transpose of each checkpoint ``experts.{e}.*.weight``)."""

    def __init__(
        self, config: DeepseekV3Config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs
    ):
        E, D, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        init = nnx.initializers.normal(0.02)
        self.dtype = dtype
        self.gate_proj = nnx.Param(init(rngs.params(), (E, D, I), param_dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (E, D, I), param_dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (E, I, D), param_dtype))

    def __call__(self, x: jax.Array, weights: jax.Array, idx: jax.Array) -> jax.Array:
        T, D = x.shape
        K = idx.shape[1]
        E = self.gate_proj.shape[0]
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        tok = (order // K).astype(jnp.int32)
        xs = x.astype(self.dtype)[tok]
        sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
        g = jax.lax.ragged_dot(xs, self.gate_proj[...].astype(self.dtype), sizes)
        u = jax.lax.ragged_dot(xs, self.up_proj[...].astype(self.dtype), sizes)
        y = jax.lax.ragged_dot(jax.nn.silu(g) * u, self.down_proj[...].astype(self.dtype), sizes)
        y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
        return jnp.zeros((T, D), jnp.float32).at[tok].add(y).astype(self.dtype)


class MoE(nnx.Module):
    """``experts(x) + shared_experts(x)`` (checkpoint names ``mlp.gate``, ``mlp.experts``,
    ``mlp.shared_experts``)."""

    def __init__(
        self, config: DeepseekV3Config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs
    ):
        self.gate = Router(config, rngs=rngs)
        self.experts = Experts(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.shared_experts = MLP(
            config.hidden_size,
            config.moe_intermediate_size * config.n_shared_experts,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        w, idx = self.gate(x)
        return self.experts(x, w, idx) + self.shared_experts(x)
