"""Model-runner-facing MLA attention in the style of vllm-project/tpu-inference.

tpu-inference's JAX models take an ``AttentionMetadata`` pytree (``input_positions``, ``block_tables``,
``seq_lens``, ``query_start_loc``, ``request_distribution``) and an attention function that writes the
new latent KV into the cache and returns ``(new_kv_cache, outputs [T, N, v_head_dim])``.  This module
offers the same shape of interface over TOKENSPEED_MLA so a JAX DeepSeek model plugs in the same way:

* :class:`AttentionMetadata` carries tpu-inference's fields plus ``mla``, the
  :class:`~tokenspeed_jax.vllm.metadata.MLACommonMetadata` with the static decode / prefill split.
  ``block_tables`` is 2-D ``[num_reqs, max_blocks]`` (tpu-inference flattens it).
  ``request_distribution = [decode_end, prefill_end, mixed_end]`` cumulative request counts, like
  tpu-inference; every non-decode request is counted as "mixed" (chunked prefill with or without
  context), so it is ``[num_decodes, num_decodes, num_reqs]``.
* :func:`build_attention_metadata` builds it on the host from positions, query/sequence lengths and
  block tables (slot mapping derived from the positions).
* :func:`mla_attention` is the per-layer call (jit-compatible; metadata counts are static).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokenspeed_jax.vllm.builder import TokenspeedMLAMetadataBuilder
from tokenspeed_jax.vllm.impl import TokenspeedMLAImpl
from tokenspeed_jax.vllm.metadata import CommonAttentionMetadata, MLACommonMetadata, _pytree


@_pytree(meta=())
class AttentionMetadata:
    """tpu-inference's attention metadata, plus the MLA split (module docstring)."""

    input_positions: Any  # int32 [T]
    block_tables: Any  # int32 [num_reqs, max_blocks]
    seq_lens: Any  # int32 [num_reqs]
    query_start_loc: Any  # int32 [num_reqs + 1]
    request_distribution: Any  # int32 [3]
    mla: MLACommonMetadata


def build_attention_metadata(input_positions, query_lens, seq_lens, block_tables, *,
                             builder: TokenspeedMLAMetadataBuilder,
                             num_tokens: int | None = None) -> AttentionMetadata:
    """Host-side construction (decode requests first, as vLLM orders the batch).

    Args:
      input_positions: ``[T]`` position of each token in its request (``context_len + i``); rows past
        ``sum(query_lens)`` are padding.
      query_lens, seq_lens: ``[num_reqs]`` new tokens / total tokens per request.
      block_tables: ``[num_reqs, max_blocks]`` page ids.
      builder: the layer group's metadata builder (block size, speculative tokens, workspace).
      num_tokens: padded token count ``T`` (default ``len(input_positions)``).
    """
    pos = np.asarray(input_positions, np.int64)
    ql = np.asarray(query_lens, np.int64)
    sl = np.asarray(seq_lens, np.int64)
    bt = np.asarray(block_tables, np.int64)
    T = int(pos.shape[0]) if num_tokens is None else int(num_tokens)
    qsl = np.concatenate([[0], np.cumsum(ql)])
    if qsl[-1] > T:
        raise ValueError(f"query_lens: expected sum(query_lens) <= num_tokens = {T}, got {int(qsl[-1])}")
    bs = builder.block_size
    slot = np.full(T, -1, np.int64)
    req = np.repeat(np.arange(ql.shape[0]), ql)
    p = pos[: qsl[-1]]
    if np.any(p < 0):
        raise ValueError(f"input_positions: expected non-negative positions for the request tokens, got "
                         f"{int(p.min())} (a negative block index would pick a page from the table's end)")
    if np.any(p // bs >= bt.shape[1]):
        raise ValueError(f"input_positions: a position needs block {int((p // bs).max())} but block_tables has "
                         f"{bt.shape[1]} columns")
    slot[: qsl[-1]] = bt[req, p // bs] * bs + p % bs
    common = CommonAttentionMetadata.from_numpy(qsl, sl, bt, slot, num_actual_tokens=T)
    mla = builder.build(0, common)
    dist = np.array([mla.num_decodes, mla.num_decodes, mla.num_reqs], np.int32)
    return AttentionMetadata(
        input_positions=jnp.asarray(pos.astype(np.int32)), block_tables=common.block_table_tensor,
        seq_lens=common.seq_lens, query_start_loc=common.query_start_loc,
        request_distribution=jnp.asarray(dist), mla=mla,
    )


def mla_attention(q: jax.Array, kv_c: jax.Array, k_pe: jax.Array, kv_cache: jax.Array, md: AttentionMetadata, *,
                  impl: TokenspeedMLAImpl, layer: Any) -> tuple[jax.Array, jax.Array]:
    """One MLA layer's attention: cache update, absorbed decode, non-absorbed prefill.

    Args:
      q: ``[T, N, P + R]`` queries (``q_nope | q_pe``, rope applied); kv_c ``[T, kv_lora_rank]`` (normed
        latent); k_pe ``[T, R]`` (rope applied).  ``T`` = ``md.mla.num_actual_tokens``.
      kv_cache: ``[num_blocks, block_size, kv_lora_rank + R]`` (donate it under jit).
      impl: the layer's :class:`TokenspeedMLAImpl` built with an array ``kv_b_proj`` (W_UK / W_UV).
      layer: holds ``_q_scale`` / ``_k_scale`` (read on every call).

    Returns ``(new_kv_cache, out [T, N, v_head_dim])``; padding rows are 0.
    """
    m = md.mla
    if impl.W_UK is None:
        raise ValueError("impl: expected an impl built with an array kv_b_proj (W_UK / W_UV are needed to "
                         "absorb the decode queries)")
    T = q.shape[0]
    if T != m.num_actual_tokens:
        raise ValueError(f"q: expected {m.num_actual_tokens} token rows (num_actual_tokens), got {T}")
    N, P, V = impl.num_heads, impl.qk_nope_head_dim, impl.v_head_dim
    k_scale = getattr(layer, "_k_scale", 1.0)
    kv_cache = impl.do_kv_cache_update(kv_c, k_pe, kv_cache, m.slot_mapping, impl.kv_cache_dtype, k_scale)
    parts = []
    nd = m.num_decode_tokens
    if m.decode is not None:
        qd = q[:nd]
        ql_nope = jnp.einsum("tnp,lnp->tnl", qd[..., :P], impl.W_UK.astype(q.dtype),
                             preferred_element_type=jnp.float32).astype(q.dtype)
        o, _ = impl.forward_mqa((ql_nope, qd[..., P:]), kv_cache, m, layer)
        od = jnp.einsum("tnl,lnv->tnv", o, impl.W_UV.astype(o.dtype), preferred_element_type=jnp.float32)
        parts.append(od.astype(q.dtype))
    if m.prefill is not None:
        op = impl.forward_mha(q[nd:], kv_c[nd:], k_pe[nd:], kv_cache, m, k_scale)
        parts.append(op.reshape(T - nd, N, V).astype(q.dtype))
    elif T > nd:
        parts.append(jnp.zeros((T - nd, N, V), q.dtype))
    return kv_cache, jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
