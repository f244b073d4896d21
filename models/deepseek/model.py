"""The DeepSeek-V3/R1 model (Flax NNX): embeddings, decoder layers (MLA + dense MLP or MoE), final norm,
lm_head and the MTP layers (:mod:`tokenspeed_jax.models.deepseek.mtp`).

Attribute names mirror the checkpoint (``embed_tokens``, ``layers[i].self_attn.q_a_proj``, ...); the
mapping of checkpoint names to parameters lives in :mod:`tokenspeed_jax.models.deepseek.weights`.

Layers are stacked and scanned (documented decision): ``dense_layers`` holds the first
``first_k_dense_replace`` layers and ``moe_layers`` the rest, each one :class:`DecoderLayer` whose
parameters carry a leading layer axis (built with ``nnx.vmap``), run by one ``jax.lax.scan`` per stack
over ``(parameters, layer index)`` with ``(hidden, whole cache)`` as the carry.  The compiled program holds
one dense and one MoE layer body whatever the depth (61 layers trace and lower in the time of 2).  The
layer index selects the layer's pages of the page-major cache (:mod:`tokenspeed_jax.models.deepseek.cache`).
The MTP layers stay a list (one layer in DeepSeek-V3/R1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenspeed_jax.models.deepseek.attention import AttentionBatch, MLAttention, decode_work
from tokenspeed_jax.models.deepseek.cache import KVCache
from tokenspeed_jax.models.deepseek.config import DeepseekV3Config
from tokenspeed_jax.models.deepseek.layers import MLP, RMSNorm, linear
from tokenspeed_jax.models.deepseek.moe import MoE


def check_token_ids(ids, vocab_size: int, name: str = "input_ids") -> None:
    """Raise ``ValueError`` naming the first token id outside ``[0, vocab_size)`` (host-side check: an
    out-of-range id would otherwise gather a clamped / NaN embedding row without any error)."""
    a = np.asarray(ids)
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name}: expected integer token ids, got dtype {a.dtype}")
    bad = (a < 0) | (a >= vocab_size)
    if a.size and bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name}: token id {int(a[idx])} at index {idx if len(idx) > 1 else idx[0]} is outside the "
            f"vocabulary [0, {vocab_size})"
        )


def _stacked(path) -> int:
    return int(path[0] in ("dense_layers", "moe_layers")) + int("experts" in [str(x) for x in path])


class DecoderLayer(nnx.Module):
    def __init__(
        self,
        config: DeepseekV3Config,
        layer_idx: int,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        kw = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        self.self_attn = MLAttention(config, **kw)
        self.is_moe = config.is_moe_layer(layer_idx)
        if self.is_moe:
            self.mlp = MoE(config, **kw)
        else:
            self.mlp = MLP(
                config.hidden_size, config.intermediate_size, fp8_block=config.fp8_block_size, **kw
            )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **kw)

    def __call__(self, h, batch: AttentionBatch, kv=None, k_scale=None, layer=0):
        # named scopes: the benchmark's profile breakdown (attention / moe / dense_mlp / rest) reads them
        with jax.named_scope("attention"):
            a, kv = self.self_attn(self.input_layernorm(h), batch, kv, k_scale, layer)
        h = h + a
        x = self.post_attention_layernorm(h)
        if self.is_moe:
            with jax.named_scope("moe"):
                h = h + self.mlp(x, batch.mesh)
        else:
            with jax.named_scope("dense_mlp"):
                h = h + self.mlp(x)
        return h, kv


def layer_stack(config: DeepseekV3Config, first: int, count: int, *, rngs: nnx.Rngs, **kw) -> DecoderLayer:
    """``count`` identical-shaped :class:`DecoderLayer` s (layer ``first``'s kind) as one module whose
    parameters have a leading layer axis."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return DecoderLayer(config, first, rngs=rngs, **kw)

    return make(rngs)


def run_stack(stack: DecoderLayer, first: int, h, batch: AttentionBatch, cache: KVCache | None):
    """``jax.lax.scan`` of a :func:`layer_stack` over its layers (global indices from ``first``)."""
    graphdef, state = nnx.split(stack)
    n = jax.tree.leaves(state)[0].shape[0]
    kv = None if cache is None else cache.kv
    k_scale = None if cache is None else cache.k_scale

    def body(carry, xs):
        h, kv = carry
        st, li = xs
        h, kv = nnx.merge(graphdef, st)(h, batch, kv, k_scale, li)
        return (h, kv), None

    (h, kv), _ = jax.lax.scan(body, (h, kv), (state, first + jnp.arange(n, dtype=jnp.int32)))
    return h, (None if cache is None else cache.replace(kv=kv))


class DeepseekV3(nnx.Module):
    """DeepSeek-V3/R1 causal LM.  ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype
    (bfloat16 for real checkpoints on GPU, float32 for CPU parity tests)."""

    def __init__(
        self, config: DeepseekV3Config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs
    ):
        from tokenspeed_jax.models.deepseek.mtp import MTPLayer

        self.config = config
        self.dtype = dtype
        self.mesh = None  # a jax.sharding.Mesh once placed on one (parallel.py); static, part of the graphdef
        kw = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        self.embed_tokens = nnx.Embed(
            config.vocab_size,
            config.hidden_size,
            dtype=dtype,
            param_dtype=param_dtype,
            embedding_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )
        L = config.num_hidden_layers
        self.num_dense = min(config.first_k_dense_replace, L) if config.n_routed_experts > 0 else L
        self.dense_layers = layer_stack(config, 0, self.num_dense, **kw) if self.num_dense else None
        n_moe = L - self.num_dense
        self.moe_layers = layer_stack(config, self.num_dense, n_moe, **kw) if n_moe else None
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **kw)
        self.lm_head = linear(config.hidden_size, config.vocab_size, **kw)
        self.mtp = nnx.List(
            [
                MTPLayer(config, config.num_hidden_layers + j, **kw)
                for j in range(config.num_nextn_predict_layers)
            ]
        )

    @classmethod
    def random(
        cls,
        config: DeepseekV3Config,
        *,
        dtype=jnp.float32,
        param_dtype=None,
        seed: int = 0,
        std: float = 0.02,
        mesh=None,
    ) -> DeepseekV3:
        """A model with generated weights: normal(0, std) matrices, unit norm weights, zero router bias.
        With ``config.quantization_config`` the projection weights are block-quantised to e4m3 + scales
        (the model an FP8 checkpoint loads into).  ``mesh``: parameters placed with their NamedSharding.

        Weights come from numpy (documented decision): initialising through ``jax.random`` compiles one
        threefry kernel per distinct shape, which costs tens of seconds on a small CPU."""
        from tokenspeed_jax.models.deepseek.parallel import check_mesh, param_sharding
        from tokenspeed_jax.models.deepseek.weights import quantize_fp8_block

        if mesh is not None:
            check_mesh(config, mesh)
        param_dtype = dtype if param_dtype is None else param_dtype
        model = nnx.eval_shape(lambda: cls(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)))
        rng = np.random.default_rng(seed)
        flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
        values = {}
        for path, v in flat.items():
            if path[-1].endswith("_scale_inv"):
                continue
            if path[-1] == "weight" and len(v.shape) - _stacked(path) == 1:
                a = np.ones(v.shape, np.float32)
            elif path[-1] == "e_score_correction_bias":
                a = np.zeros(v.shape, np.float32)
            else:
                a = rng.standard_normal(v.shape, dtype=np.float32) * np.float32(std)
            if np.dtype(v.dtype) == np.dtype(jnp.float8_e4m3fn):
                sp = path[:-1] + (path[-1] + "_scale_inv",)
                bo, bi = config.fp8_block_size
                q = np.empty(v.shape, v.dtype)
                sc = np.empty(flat[sp].shape, np.float32)
                for idx in np.ndindex(*v.shape[:-2]):
                    q[idx], sc[idx] = quantize_fp8_block(a[idx], (bi, bo))
                values[path], values[sp] = q, sc
            else:
                values[path] = a
        for path, v in flat.items():
            a = np.asarray(values[path]).astype(v.dtype)
            v.set_value(jax.device_put(a, param_sharding(path, a.shape, mesh)))
        model.mesh = mesh
        return model

    def with_decode_work(self, batch: AttentionBatch, cache: KVCache | None) -> AttentionBatch:
        """``batch`` on this model's mesh, with its decode work (:func:`tokenspeed_jax.mla_decode_work`, the sm90
        split-KV schedule) when it is a decode batch without one: what every layer's ``mla_decode`` of a forward
        shares.  The forwards compute it themselves, once and outside the layer scans; a step that runs two
        forwards on the same batch (verification and the MTP layer of a speculative round) calls this first and
        passes the result to both, so the step computes it once."""
        batch = batch.replace(mesh=self.mesh)
        return batch if cache is None else decode_work(self.config, batch, cache.kv)

    def __call__(self, input_ids: jax.Array, batch: AttentionBatch, cache: KVCache | None = None):
        """Main model over packed tokens ``input_ids [T]`` -> ``(hidden [T, hidden] after the final norm,
        new cache)``; ``cache=None`` runs attention without any cache (prefill mode only).  A decode batch
        gets its decode work here, before the layer scans (:meth:`with_decode_work`).  Concrete (untraced)
        ids outside the vocabulary raise ``ValueError`` (:func:`check_token_ids`)."""
        if not isinstance(input_ids, jax.core.Tracer):
            check_token_ids(input_ids, self.config.vocab_size, "input_ids")
        batch = self.with_decode_work(batch, cache)
        h = self.embed_tokens(input_ids)
        if self.dense_layers is not None:
            h, cache = run_stack(self.dense_layers, 0, h, batch, cache)
        if self.moe_layers is not None:
            h, cache = run_stack(self.moe_layers, self.num_dense, h, batch, cache)
        return self.norm(h), cache

    def lm_logits(self, h: jax.Array) -> jax.Array:
        """float32 logits ``[..., vocab]`` of final-norm hidden states."""
        return self.lm_head(h.astype(self.dtype)).astype(jnp.float32)

    def mtp_forward(
        self,
        next_ids: jax.Array,
        prev_hidden: jax.Array,
        batch: AttentionBatch,
        cache: KVCache,
        depth: int = 0,
    ):
        """MTP layer ``depth`` at positions ``batch.positions``: ``next_ids [T]`` are the tokens one
        position ahead, ``prev_hidden [T, hidden]`` the hidden states of the previous depth (the main
        model's final-norm output for the first draft).  Returns ``(mtp hidden [T, hidden], logits [T, V],
        new cache)``; the layer uses cache ``num_hidden_layers + depth``."""
        if not isinstance(next_ids, jax.core.Tracer):
            check_token_ids(next_ids, self.config.vocab_size, "next_ids")
        li = self.config.num_hidden_layers + depth
        batch = self.with_decode_work(batch, cache)
        emb = self.embed_tokens(next_ids)
        # Position 0's embedding input is zeroed, as vLLM/SGLang do for DeepSeek's MTP.
        emb = jnp.where((batch.positions == 0)[:, None], jnp.zeros((), emb.dtype), emb)
        h, kv = self.mtp[depth](emb, prev_hidden, batch, cache.kv, cache.k_scale, li)
        return h, self.mtp[depth].logits(h), cache.replace(kv=kv)

    def logits(self, input_ids) -> jax.Array:
        """Full-sequence causal logits ``[T, vocab]`` float32 of one request ``input_ids [T]`` (int32),
        through the prefill path (``mla_prefill``, no cache)."""
        ids = np.asarray(input_ids)
        if ids.ndim != 1 or ids.shape[0] < 1:
            raise ValueError(f"input_ids: expected a non-empty int32 [T], got shape {tuple(ids.shape)}")
        check_token_ids(ids, self.config.vocab_size, "input_ids")
        ids = jnp.asarray(ids, jnp.int32)
        graphdef, state = nnx.split(self)
        return _logits_fn(graphdef, state, ids)


@functools.partial(jax.jit, static_argnums=0)
def _logits_fn(graphdef, state, ids):
    model = nnx.merge(graphdef, state)
    T = ids.shape[0]
    nd = 1 if model.mesh is None else model.mesh.shape.get("data", 1)
    # DP attention: the request in data rank 0's slab, the other slabs empty (parallel.py's layout)
    cu = np.zeros(2 * nd, np.int32)
    cu[1] = T
    pos = jnp.arange(T, dtype=jnp.int32)
    batch = AttentionBatch(
        positions=jnp.concatenate([pos, jnp.zeros(((nd - 1) * T,), jnp.int32)]),
        cu_seqlens_q=jnp.asarray(cu),
        mode="prefill",
        max_seqlen_q=T,
    )
    ids = jnp.concatenate([ids, jnp.zeros(((nd - 1) * T,), jnp.int32)])
    h, _ = model(ids, batch, None)
    return model.lm_logits(h[:T])
