"""Multi-head latent attention (MLA) as a Flax NNX module, running on the public tokenspeed_jax ops.

Parameters (checkpoint names): ``q_a_proj -> q_a_layernorm -> q_b_proj`` (or ``q_proj`` when
``q_lora_rank`` is None), ``kv_a_proj_with_mqa -> kv_a_layernorm``, ``kv_b_proj``, ``o_proj``.

Two forms of the same attention (documented decision, as in vLLM/SGLang):

* Prefill (``batch.mode == "prefill"``) uses the non-absorbed form through :func:`tokenspeed_jax.mla_prefill`:
  ``k = [k_nope | k_pe]`` (192) and ``v`` (128) per head from ``kv_b_proj``, ragged over the packed
  requests.  With a chunked context (``batch.context_lens``), the tokens already in the paged cache are
  gathered, expanded by ``kv_b_proj`` and attended non-causally; the two partial results are combined
  with :func:`tokenspeed_jax.merge_attn_states`.
* Decode (``batch.mode == "decode"``, S = 1 or S = k+1 MTP verification) uses the absorbed form through
  :func:`tokenspeed_jax.mla_decode`: ``q_nope`` is multiplied by ``W_UK`` into the 512-dim latent, the
  output latent is mapped back by ``W_UV``; keys and values are the cache rows themselves.

Every call writes its new tokens' ``[kv_c | k_pe]`` rows into the layer's pages of the model's one paged
cache (``[num_pages, num_layers, page_size, D]``, :mod:`tokenspeed_jax.models.deepseek.cache`) with
:func:`tokenspeed_jax.concat_and_cache_mla` and returns the new cache: the cache is data passed in and
returned.

On a mesh (``batch.mesh``, axes ``data`` / ``tensor`` / ``expert``) the MLA custom calls run under
``shard_map`` through :mod:`tokenspeed_jax.sharding`: heads split over ``tensor`` (the projections'
kernels are split by heads, so q, the expanded k/v and the attention output stay head-sharded and
``o_proj``'s row split ends in one all-reduce), requests split over ``data`` (DP attention: each data rank
holds its own pages of the cache, block tables and slots are shard-local, prefill rows come as per-shard
slabs, :func:`tokenspeed_jax.sharding.split_varlen_batch`'s layout).
An FP8 (e4m3) cache stores ``x / k_scale``; decode
queries are quantised with a per-call dynamic scale ``q_scale = max|q| / 448`` and the scales are folded into
``softmax_scale`` / ``output_scale`` as the decode contract prescribes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import PartitionSpec as P
from tokenspeed_jax.models.deepseek.cache import layer_pages, layer_slots
from tokenspeed_jax.models.deepseek.config import DeepseekV3Config
from tokenspeed_jax.models.deepseek.layers import RMSNorm, linear
from tokenspeed_jax.models.deepseek.rope import apply_rope, rope_cos_sin, rope_frequencies

import tokenspeed_jax as ts
from tokenspeed_jax import sharding as tsh

E4M3_MAX = 448.0


@struct.dataclass
class AttentionBatch:
    """Per-call attention metadata shared by every layer (a pytree; ``mode``/``q_len``/``capacity``/
    ``backend`` are static).

    Tokens are packed: ``T`` rows, ``positions [T]`` their absolute positions, ``slot_mapping [T]`` their
    cache slots (``page * page_size + row``; -1 writes nothing, e.g. padding).

    prefill: ``cu_seqlens_q [B + 1]`` request boundaries (rows past ``cu_seqlens_q[-1]`` are padding).
      Chunked context: ``block_table [B, max_pages]`` and ``context_lens [B]`` (tokens of each request
      already in the cache, attended by every new token), ``context_capacity`` a static bound on
      ``sum(context_lens)``; ``context_lens is None`` means no context.
    decode: ``T = B * q_len`` rows ordered request-major; ``block_table [B, max_pages]`` and
      ``seq_lens [B]`` (cache length including the ``q_len`` new tokens).  ``work``: the step's
      :class:`tokenspeed_jax.DecodeWork` (the sm90 split-KV schedule), computed once per forward by
      :meth:`~tokenspeed_jax.models.deepseek.model.DeepseekV3.with_decode_work` before the layer loop and
      passed to every layer's decode call; None computes it in each call.
    ``mesh`` (static): run the custom calls under shard_map (module docstring); with a data axis > 1
      (DP attention) page ids / slots are shard-local and prefill rows / ``cu_seqlens_q`` are per-shard
      slabs (``[n * (B/n + 1)]`` offsets).
    """

    positions: jax.Array
    slot_mapping: jax.Array | None = None
    cu_seqlens_q: jax.Array | None = None
    block_table: jax.Array | None = None
    context_lens: jax.Array | None = None
    seq_lens: jax.Array | None = None
    work: ts.DecodeWork | None = None
    mode: str = struct.field(pytree_node=False, default="prefill")
    q_len: int = struct.field(pytree_node=False, default=1)
    context_capacity: int = struct.field(pytree_node=False, default=0)
    max_seqlen_q: int | None = struct.field(pytree_node=False, default=None)
    backend: str = struct.field(pytree_node=False, default="auto")
    mesh: jax.sharding.Mesh | None = struct.field(pytree_node=False, default=None)

    @property
    def head_axis(self) -> str | None:
        return "tensor" if self.mesh is not None and self.mesh.shape.get("tensor", 1) > 1 else None

    @property
    def batch_axis(self) -> str | None:
        return "data" if self.mesh is not None and self.mesh.shape.get("data", 1) > 1 else None

    def replace(self, **kw) -> AttentionBatch:
        return dataclasses.replace(self, **kw)


def gather_context(kv_cache: jax.Array, block_table: jax.Array, context_lens: jax.Array, capacity: int):
    """Pack the cached context rows of every request: ``(rows [capacity, D], cu_seqlens_ctx [B + 1])``.

    Row ``r < cu[-1]`` is token ``r - cu[b]`` of request ``b``; rows past ``cu[-1]`` are zero.
    """
    P, ps, D = kv_cache.shape
    lens = context_lens.astype(jnp.int32)
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lens)])
    r = jnp.arange(capacity, dtype=jnp.int32)
    B = lens.shape[0]
    req = jnp.clip(jnp.searchsorted(cu[1:], r, side="right"), 0, B - 1).astype(jnp.int32)
    pos = r - cu[req]
    page = jnp.take_along_axis(
        block_table[req], jnp.clip(pos // ps, 0, block_table.shape[1] - 1)[:, None], axis=1
    )[:, 0]
    rows = kv_cache.reshape(P * ps, D)[jnp.clip(page, 0, P - 1) * ps + pos % ps]
    rows = jnp.where((r < cu[-1])[:, None], rows, jnp.zeros((), rows.dtype))
    return rows, cu


def decode_work(config: DeepseekV3Config, batch: AttentionBatch, kv: jax.Array) -> AttentionBatch:
    """``batch`` with the decode work of its layers' ``mla_decode`` calls (``batch.work``), computed here once:
    every layer reads the same lengths through equally shaped views of the one cache ``kv [num_pages,
    num_layers, page_size, D]`` (queries in the cache dtype, :meth:`MLAttention._decode`), so one work serves all
    of them.  A prefill batch, or one that has its work, is returned as it is."""
    if batch.mode != "decode" or batch.work is not None:
        return batch
    c = config
    sd = jax.ShapeDtypeStruct
    Pn, L, ps, D = kv.shape
    B = batch.seq_lens.shape[0]
    q = sd((B, batch.q_len, c.num_attention_heads, c.kv_cache_dim), kv.dtype)
    flat, bt = sd((Pn * L, ps, D), kv.dtype), sd(batch.block_table.shape, batch.block_table.dtype)
    kw = {"causal": True, "kv_lora_rank": c.kv_lora_rank, "backend": batch.backend}
    if batch.mesh is None:
        work = ts.mla_decode_work(q, flat, bt, batch.seq_lens, **kw)
    else:
        work = tsh.sharded_mla_decode_work(q, flat, bt, batch.seq_lens, mesh=batch.mesh, head_axis=batch.head_axis,
                                           batch_axis=batch.batch_axis, cache_sharding="pages", **kw)
    return batch.replace(work=work)


def _quantize_fp8(x, scale):
    y = x.astype(jnp.float32) / scale
    return jnp.clip(y, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


class MLAttention(nnx.Module):
    def __init__(
        self, config: DeepseekV3Config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs
    ):
        c = config
        self.config = c
        self.dtype = dtype
        H = c.num_attention_heads
        kw = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs, "fp8_block": c.fp8_block_size}
        if c.q_lora_rank is None:
            self.q_proj = linear(c.hidden_size, H * c.qk_head_dim, **kw)
        else:
            self.q_a_proj = linear(c.hidden_size, c.q_lora_rank, **kw)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, dtype=dtype, param_dtype=param_dtype)
            self.q_b_proj = linear(c.q_lora_rank, H * c.qk_head_dim, **kw)
        self.kv_a_proj_with_mqa = linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, **kw)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, dtype=dtype, param_dtype=param_dtype)
        self.kv_b_proj = linear(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim), **kw)
        self.o_proj = linear(H * c.v_head_dim, c.hidden_size, **kw)
        inv_freq, self.rope_attention_factor = rope_frequencies(c)
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static data, not a parameter

    # ------------------------------------------------------------------------------ projections
    def _q(self, x, cos, sin):
        c = self.config
        if c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(x.shape[0], c.num_attention_heads, c.qk_head_dim)
        q_nope, q_pe = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :]
        return q_nope, apply_rope(q_pe, cos, sin, interleave=c.rope_interleave)

    def _kv_latent(self, x, cos, sin):
        c = self.config
        kv = self.kv_a_proj_with_mqa(x)
        kv_c = self.kv_a_layernorm(kv[:, : c.kv_lora_rank])
        k_pe = apply_rope(kv[:, c.kv_lora_rank :], cos, sin, interleave=c.rope_interleave)
        return kv_c, k_pe

    def _expand_kv(self, kv_c, k_pe):
        """Non-absorbed keys/values: ``k [T, H, nope + rope]``, ``v [T, H, v_head_dim]``."""
        c = self.config
        H = c.num_attention_heads
        kvb = self.kv_b_proj(kv_c.astype(self.dtype)).reshape(
            kv_c.shape[0], H, c.qk_nope_head_dim + c.v_head_dim
        )
        k_nope, v = kvb[..., : c.qk_nope_head_dim], kvb[..., c.qk_nope_head_dim :]
        pe = jnp.broadcast_to(k_pe[:, None, :].astype(k_nope.dtype), (kv_c.shape[0], H, c.qk_rope_head_dim))
        return jnp.concatenate([k_nope, pe], axis=-1), v

    def _w_uk_uv(self):
        c = self.config
        w = self.kv_b_proj.weight()
        w = w.reshape(c.kv_lora_rank, c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim)
        return w[..., : c.qk_nope_head_dim], w[..., c.qk_nope_head_dim :]

    # ---------------------------------------------------------------------------------- forward
    def __call__(
        self,
        x: jax.Array,
        batch: AttentionBatch,
        kv: jax.Array | None = None,
        k_scale: jax.Array | None = None,
        layer=0,
    ) -> tuple[jax.Array, jax.Array | None]:
        """``x [T, hidden]`` -> ``(out [T, hidden], new kv)``; ``kv`` is the model's whole cache
        ``[num_pages, num_layers, page_size, D]`` and ``layer`` (int or traced) this layer's index in it."""
        c = self.config
        cos, sin = rope_cos_sin(batch.positions, self.inv_freq, self.rope_attention_factor)
        q_nope, q_pe = self._q(x, cos, sin)
        kv_c, k_pe = self._kv_latent(x, cos, sin)
        fp8 = kv is not None and jnp.dtype(kv.dtype) == jnp.float8_e4m3fn
        flat = bt = None
        if kv is not None:
            Pn, L, ps, D = kv.shape
            flat = kv.reshape(Pn * L, ps, D)
            bt = None if batch.block_table is None else layer_pages(batch.block_table, layer, L)
            if batch.slot_mapping is not None:
                slots = layer_slots(batch.slot_mapping, layer, L, ps)
                flat = self._write(kv_c, k_pe, flat, slots, k_scale if fp8 else None, batch)
        if batch.mode == "prefill":
            out = self._prefill(q_nope, q_pe, kv_c, k_pe, batch, flat, bt, k_scale, fp8)
        elif batch.mode == "decode":
            if kv is None:
                raise ValueError("kv: expected the model's paged cache for a decode call, got None")
            out = self._decode(q_nope, q_pe, batch, flat, bt, k_scale, fp8)
        else:
            raise ValueError(f"batch.mode: expected 'prefill' or 'decode', got {batch.mode!r}")
        T = x.shape[0]
        out = self.o_proj(out.reshape(T, c.num_attention_heads * c.v_head_dim).astype(self.dtype))
        return out, None if kv is None else flat.reshape(kv.shape)

    @staticmethod
    def _write(kv_c, k_pe, flat, slots, scale, batch):
        """``concat_and_cache_mla``; under DP attention per data rank (shard-local slots)."""
        if batch.batch_axis is None:
            return ts.concat_and_cache_mla(kv_c, k_pe, flat, slots, scale=scale)
        d = batch.batch_axis
        sc = jnp.float32(1.0) if scale is None else scale

        def local(a, b, f, s, sc_):
            return ts.concat_and_cache_mla(a, b, f, s, scale=None if scale is None else sc_)

        return tsh._shard_map(
            local, batch.mesh, (P(d), P(d), P(d), P(d), P()), P(d)
        )(kv_c, k_pe, flat, slots, sc)

    def _prefill(self, q_nope, q_pe, kv_c, k_pe, batch, kv_cache, block_table, k_scale, fp8):
        c = self.config
        q = jnp.concatenate([q_nope, q_pe.astype(q_nope.dtype)], axis=-1)
        k, v = self._expand_kv(kv_c, k_pe)
        cu = batch.cu_seqlens_q
        kw = {"softmax_scale": c.softmax_scale, "backend": batch.backend}
        if batch.mesh is not None:
            if batch.context_lens is not None:
                raise NotImplementedError(
                    "prefill_chunk: chunked context prefill is not implemented on a mesh (prefill whole "
                    "prompts)"
                )
            return tsh.sharded_mla_prefill(
                q,
                k,
                v,
                cu,
                cu,
                mesh=batch.mesh,
                head_axis=batch.head_axis,
                batch_axis=batch.batch_axis,
                causal=True,
                max_seqlen_q=batch.max_seqlen_q,
                max_seqlen_k=batch.max_seqlen_q,
                **kw,
            )
        if batch.context_lens is None:
            return ts.mla_prefill(
                q,
                k,
                v,
                cu,
                cu,
                causal=True,
                max_seqlen_q=batch.max_seqlen_q,
                max_seqlen_k=batch.max_seqlen_q,
                **kw,
            )
        out_new, lse_new = ts.mla_prefill(
            q,
            k,
            v,
            cu,
            cu,
            causal=True,
            return_lse=True,
            max_seqlen_q=batch.max_seqlen_q,
            max_seqlen_k=batch.max_seqlen_q,
            **kw,
        )
        rows, cu_ctx = gather_context(kv_cache, block_table, batch.context_lens, batch.context_capacity)
        rows = rows.astype(jnp.float32) * k_scale if fp8 else rows
        kc, vc = self._expand_kv(rows[:, : c.kv_lora_rank], rows[:, c.kv_lora_rank :])
        out_ctx, lse_ctx = ts.mla_prefill(q, kc, vc, cu, cu_ctx, causal=False, return_lse=True, **kw)
        out, _ = ts.merge_attn_states(out_ctx, lse_ctx, out_new, lse_new)
        return out

    def _decode(self, q_nope, q_pe, batch, kv_cache, block_table, k_scale, fp8):
        c = self.config
        S = batch.q_len
        B = batch.seq_lens.shape[0]
        H = c.num_attention_heads
        w_uk, w_uv = self._w_uk_uv()
        q_lat = jnp.einsum("thd,chd->thc", q_nope, w_uk)
        q = jnp.concatenate([q_lat, q_pe.astype(q_lat.dtype)], axis=-1).reshape(B, S, H, c.kv_cache_dim)
        ss, os_ = c.softmax_scale, 1.0
        if fp8:
            q_scale = jnp.maximum(jnp.max(jnp.abs(q.astype(jnp.float32))), 1e-12) / E4M3_MAX
            q = _quantize_fp8(q, q_scale)
            ss = ss * q_scale * k_scale
            os_ = k_scale
        else:
            q = q.astype(kv_cache.dtype)
        dkw = {
            "softmax_scale": ss,
            "output_scale": os_,
            "causal": True,
            "kv_lora_rank": c.kv_lora_rank,
            "backend": batch.backend,
        }
        if batch.mesh is None:
            out = ts.mla_decode(q, kv_cache, block_table, batch.seq_lens, work=batch.work, **dkw)
        else:
            out = tsh.sharded_mla_decode(
                q,
                kv_cache,
                block_table,
                batch.seq_lens,
                mesh=batch.mesh,
                head_axis=batch.head_axis,
                batch_axis=batch.batch_axis,
                cache_sharding="pages",
                work=batch.work,
                **dkw,
            )
        out = out.reshape(B * S, H, c.kv_lora_rank).astype(self.dtype)
        return jnp.einsum("thc,chv->thv", out, w_uv)
