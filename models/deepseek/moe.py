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

Expert parallelism (documented decision): on a mesh the ``E`` experts are split into contiguous chunks
over all of its axes (``data``, ``tensor``, ``expert``, in that order: 8 chunks on 8 devices whatever the
mesh's shape) and the experts run under ``shard_map``.  Dispatch is an **all-gather** of the tokens over
``data`` (free when ``data`` is 1: after attention every tensor / expert rank already holds all tokens),
each device runs its local experts on the (token, expert) pairs routed to them, and combine is a
**reduce-scatter** over ``data`` plus an all-reduce over ``tensor`` x ``expert`` of the ``[T, hidden]``
partial sums.  All-to-all would move only the routed rows, but JAX's static shapes then need a capacity
per (source, destination) pair (tokens dropped past it) or a ragged all-to-all; the gather / reduce-scatter
form has static shapes, drops nothing, equals the unsharded result, and at decode sizes (``T * hidden``
of a few MB per layer) is latency-bound either way.  Prefill at large T is where all-to-all would win.

FP8 experts keep e4m3 ``[E, in, out]`` with ``*_scale_inv [E, in/128, out/128]``, dequantised inside the
step (per local expert under EP).  When a step routes fewer (token, expert) pairs than there are local experts
(decode at small batch), each pair's expert weights are gathered first and only those are dequantised and
multiplied (``Experts._gathered``): the grouped matmul's dequantisation of every expert is what dominated the
R1-width decode step on the H200 (``docs/model.md``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from tokenspeed_jax.models.deepseek.config import DeepseekV3Config
from tokenspeed_jax.models.deepseek.layers import FP8, MLP, dequantize, fp8_scale_shape

from tokenspeed_jax import sharding as tsh

from tokenspeed_jax.models.deepseek.parallel import EXPERT_AXES  # noqa: E402


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
        block = config.fp8_block_size
        self.fp8 = block is not None
        self.fp8_block = None if block is None else tuple(block)
        for name, shape in (("gate_proj", (E, D, I)), ("up_proj", (E, D, I)), ("down_proj", (E, I, D))):
            if self.fp8:
                setattr(self, name, nnx.Param(jnp.zeros(shape, FP8)))
                sshape = (E,) + fp8_scale_shape(shape[1], shape[2], block)
                setattr(self, name + "_scale_inv", nnx.Param(jnp.ones(sshape, jnp.float32)))
            else:
                setattr(self, name, nnx.Param(init(rngs.params(), shape, param_dtype)))

    def _params(self):
        names = ("gate_proj", "up_proj", "down_proj")
        w = [getattr(self, n)[...] for n in names]
        s = [getattr(self, n + "_scale_inv")[...] for n in names] if self.fp8 else [None] * 3
        return w, s

    def _local(self, x, weights, idx, w, s, e0):
        """Experts ``e0 .. e0 + len(w[0]) - 1`` on the (token, expert) pairs routed to them -> float32
        ``[T, hidden]`` partial sums (pairs routed elsewhere contribute 0)."""
        T, D = x.shape
        K = idx.shape[1]
        El = w[0].shape[0]
        if self.fp8 and T * K < El:
            return self._gathered(x, weights, idx, w, s, e0)
        loc = idx.reshape(-1) - e0
        valid = (loc >= 0) & (loc < El)
        key = jnp.where(valid, loc, El)
        order = jnp.argsort(key, stable=True)
        tok = (order // K).astype(jnp.int32)
        xs = x.astype(self.dtype)[tok]
        sizes = jnp.bincount(key, length=El + 1)[:El].astype(jnp.int32)
        gw, uw, dw = (dequantize(a, b, self.dtype, self.fp8_block) for a, b in zip(w, s))
        g = jax.lax.ragged_dot(xs, gw, sizes)
        u = jax.lax.ragged_dot(xs, uw, sizes)
        y = jax.lax.ragged_dot(jax.nn.silu(g) * u, dw, sizes)
        wt = jnp.where(valid, weights.reshape(-1), 0.0)[order]
        y = jnp.where(valid[order][:, None], y.astype(jnp.float32) * wt[:, None], 0.0)
        return jnp.zeros((T, D), jnp.float32).at[tok].add(y)

    def _gathered(self, x, weights, idx, w, s, e0):
        """:meth:`_local` for FP8 experts when the step routes fewer (token, expert) pairs than there are local
        experts (decode): each pair's expert weights are gathered (e4m3 and scales) and only those are
        dequantised, instead of every local expert's (the grouped matmul dequantises all ``E`` whatever the
        routing: R1's 256 experts at batch 1 would dequantise 32x the weights the step uses)."""
        T, D = x.shape
        K = idx.shape[1]
        El = w[0].shape[0]
        loc = idx.reshape(-1) - e0  # pair n = (token n // K, its k-th expert)
        valid = (loc >= 0) & (loc < El)
        e = jnp.clip(loc, 0, El - 1)
        gw, uw, dw = (dequantize(a[e], b[e], self.dtype, self.fp8_block) for a, b in zip(w, s))
        xs = jnp.repeat(x.astype(self.dtype), K, axis=0)  # [T * K, D]
        g = jnp.einsum("nd,ndi->ni", xs, gw)
        u = jnp.einsum("nd,ndi->ni", xs, uw)
        y = jnp.einsum("ni,nid->nd", jax.nn.silu(g) * u, dw)
        wt = jnp.where(valid, weights.reshape(-1), 0.0)
        y = jnp.where(valid[:, None], y.astype(jnp.float32) * wt[:, None], 0.0)
        return y.reshape(T, K, D).sum(axis=1)

    def __call__(self, x: jax.Array, weights: jax.Array, idx: jax.Array, mesh=None) -> jax.Array:
        w, s = self._params()
        if mesh is None:
            return self._local(x, weights, idx, w, s, 0).astype(self.dtype)
        data = mesh.shape.get("data", 1) > 1
        tok_spec = P("data") if data else P()
        e_spec = P(EXPERT_AXES)
        n = 1
        for a in EXPERT_AXES:
            n *= mesh.shape.get(a, 1)
        E = w[0].shape[0]
        if E % n:
            raise ValueError(
                f"n_routed_experts: expected a multiple of the mesh's {n} devices (experts are split over "
                f"all of {EXPERT_AXES}), got {E}"
            )
        fp8 = self.fp8

        def local(x, weights, idx, w, s):
            if data:  # dispatch: every device sees every token of its data group
                x, weights, idx = (jax.lax.all_gather(a, "data", tiled=True) for a in (x, weights, idx))
            e0 = jax.lax.axis_index(EXPERT_AXES) * w[0].shape[0]
            y = self._local(x, weights, idx, w, s if fp8 else [None] * 3, e0)
            y = jax.lax.psum(y, ("tensor", "expert"))
            if data:  # combine
                y = jax.lax.psum_scatter(y, "data", tiled=True)
            return y

        s_in = s if fp8 else [jnp.zeros((E,), jnp.float32)] * 3
        y = tsh._shard_map(
            local, mesh, (tok_spec, tok_spec, tok_spec, [e_spec] * 3, [e_spec] * 3), tok_spec
        )(x, weights, idx, list(w), list(s_in))
        return y.astype(self.dtype)


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
            fp8_block=config.fp8_block_size,
        )

    def __call__(self, x: jax.Array, mesh=None) -> jax.Array:
        w, idx = self.gate(x)
        return self.experts(x, w, idx, mesh) + self.shared_experts(x)
