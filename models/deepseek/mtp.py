"""The multi-token-prediction (MTP) layer of DeepSeek-V3, used as the draft model of speculative decoding.

Checkpoint layout (DeepSeek-V3/R1; transformers does not implement MTP): layer ``num_hidden_layers + d``,
i.e. ``model.layers.61.*`` for R1, holds ``enorm``, ``hnorm``, ``eh_proj`` ([hidden, 2 * hidden]), a full
decoder block (``self_attn``, ``mlp`` (MoE), ``input_layernorm``, ``post_attention_layernorm``) and
``shared_head.norm`` / ``shared_head.head``; its ``embed_tokens`` duplicates the main embedding and is
not loaded (the main ``embed_tokens`` is used).

At position ``i`` the layer combines the previous depth's hidden state ``h_i`` and the embedding of token
``t_{i+1}``: ``x = eh_proj([enorm(emb(t_{i+1})) | hnorm(h_i)])`` (vLLM/SGLang order; like them, the embedding
input at
position 0 is zeroed), runs the decoder
block (with its own paged latent cache) and predicts ``t_{i+2}`` through ``shared_head``.  For the first
depth ``h_i`` is the main model's final-norm output (as vLLM feeds it); chained drafts (k > 1 with one
layer) feed the MTP block's own output back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from tokenspeed_jax.models.deepseek.config import DeepseekV3Config
from tokenspeed_jax.models.deepseek.layers import RMSNorm, linear
from tokenspeed_jax.models.deepseek.model import DecoderLayer


class SharedHead(nnx.Module):
    def __init__(
        self, config: DeepseekV3Config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs
    ):
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.head = linear(
            config.hidden_size, config.vocab_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )

    def __call__(self, h):
        return self.head(self.norm(h)).astype(jnp.float32)


class MTPLayer(DecoderLayer):
    def __init__(
        self,
        config: DeepseekV3Config,
        layer_idx: int,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        super().__init__(config, layer_idx, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        kw = {"dtype": dtype, "param_dtype": param_dtype}
        self.enorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **kw)
        self.hnorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **kw)
        self.eh_proj = linear(
            2 * config.hidden_size, config.hidden_size, rngs=rngs, fp8_block=config.fp8_block_size, **kw
        )
        self.shared_head = SharedHead(config, rngs=rngs, **kw)

    def __call__(self, emb: jax.Array, prev_hidden: jax.Array, batch, kv=None, k_scale=None, layer=0):
        x = self.eh_proj(jnp.concatenate([self.enorm(emb), self.hnorm(prev_hidden)], axis=-1))
        return super().__call__(x, batch, kv, k_scale, layer)

    def logits(self, h: jax.Array) -> jax.Array:
        return self.shared_head(h)
