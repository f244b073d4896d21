"""The DeepSeek-V3/R1 model (Flax NNX): embeddings, decoder layers (MLA + dense MLP or MoE), final norm,
lm_head and the MTP layers (:mod:`tokenspeed_jax.models.deepseek.mtp`).

Attribute names mirror the checkpoint (``embed_tokens``, ``layers[i].self_attn.q_a_proj``, ...); the
mapping of checkpoint names to parameters lives in :mod:`tokenspeed_jax.models.deepseek.weights`.

Layers run in a Python loop (documented decision): the first ``first_k_dense_replace`` layers differ from
the rest, test and demo presets have 2-4 layers, and the loop keeps per-layer caches as a plain tuple.  A
61-layer model would want ``nnx.scan`` over the MoE layers to bound compile time; that is future work.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenspeed_jax.models.deepseek.attention import AttentionBatch, MLAttention
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
        if config.is_moe_layer(layer_idx):
            self.mlp = MoE(config, **kw)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, **kw)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **kw)

    def __call__(self, h, batch: AttentionBatch, kv_cache=None, k_scale=None):
        a, kv_cache = self.self_attn(self.input_layernorm(h), batch, kv_cache, k_scale)
        h = h + a
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, kv_cache


class DeepseekV3(nnx.Module):
    """DeepSeek-V3/R1 causal LM.  ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype
    (bfloat16 for real checkpoints on GPU, float32 for CPU parity tests)."""

    def __init__(
        self, config: DeepseekV3Config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs
    ):
        from tokenspeed_jax.models.deepseek.mtp import MTPLayer

        self.config = config
        self.dtype = dtype
        kw = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        self.embed_tokens = nnx.Embed(
            config.vocab_size,
            config.hidden_size,
            dtype=dtype,
            param_dtype=param_dtype,
            embedding_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )
        self.layers = nnx.List([DecoderLayer(config, i, **kw) for i in range(config.num_hidden_layers)])
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
    ) -> DeepseekV3:
        """A model with generated weights: normal(0, std) matrices, unit norm weights, zero router bias.

        Weights come from numpy (documented decision): initialising through ``jax.random`` compiles one
        threefry kernel per distinct shape, which costs tens of seconds on a small CPU."""
        param_dtype = dtype if param_dtype is None else param_dtype
        model = nnx.eval_shape(lambda: cls(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)))
        rng = np.random.default_rng(seed)
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            if path[-1] == "weight" and len(v.shape) == 1:
                a = np.ones(v.shape, np.float32)
            elif path[-1] == "e_score_correction_bias":
                a = np.zeros(v.shape, np.float32)
            else:
                a = rng.standard_normal(v.shape, dtype=np.float32) * np.float32(std)
            v.set_value(jnp.asarray(a, v.dtype))
        return model

    def __call__(self, input_ids: jax.Array, batch: AttentionBatch, cache: KVCache | None = None):
        """Main model over packed tokens ``input_ids [T]`` -> ``(hidden [T, hidden] after the final norm,
        new cache)``; ``cache=None`` runs attention without any cache (prefill mode only)."""
        h = self.embed_tokens(input_ids)
        new = []
        for i, layer in enumerate(self.layers):
            kv = None if cache is None else cache.layers[i]
            h, kv = layer(h, batch, kv, None if cache is None else cache.k_scale)
            new.append(kv)
        h = self.norm(h)
        if cache is not None:
            cache = cache.replace(layers=tuple(new) + cache.layers[len(new) :])
        return h, cache

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
        li = self.config.num_hidden_layers + depth
        emb = self.embed_tokens(next_ids)
        # Position 0's embedding input is zeroed, as vLLM/SGLang do for DeepSeek's MTP.
        emb = jnp.where((batch.positions == 0)[:, None], jnp.zeros((), emb.dtype), emb)
        h, kv = self.mtp[depth](emb, prev_hidden, batch, cache.layers[li], cache.k_scale)
        layers = list(cache.layers)
        layers[li] = kv
        return h, self.mtp[depth].logits(h), cache.replace(layers=tuple(layers))

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
    batch = AttentionBatch(
        positions=jnp.arange(T, dtype=jnp.int32),
        cu_seqlens_q=jnp.asarray(np.array([0, T], np.int32)),
        mode="prefill",
        max_seqlen_q=T,
    )
    h, _ = model(ids, batch, None)
    return model.lm_logits(h)
