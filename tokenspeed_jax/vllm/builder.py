"""``TokenspeedMLAMetadataBuilder``: split a batch into decodes and prefills and plan the context chunks.

Mirrors vLLM's ``MLACommonMetadataBuilder.build`` on the host (numpy), producing the pytree metadata of
:mod:`tokenspeed_jax.vllm.metadata`.  Decisions that differ from vLLM (see ``docs/vllm.md``):

* Non-uniform decode query lengths.  TOKENSPEED decode takes ``[num_decodes, S, H, D]``.  With
  ``nonuniform_decode="pad"`` (default) ``S`` is the longest decode query and shorter decodes are padded
  with an explicit mask (``MLACommonDecodeMetadata.token_index`` / ``query_mask``, right-aligned so the
  causal mask stays exact); with ``"reject"`` such a batch raises ``ValueError``.  Nothing is ever
  reinterpreted (the seed PR's ``unsqueeze`` fallback read past the query).  vLLM instead moves every
  request from the first non-uniform one on to the prefill path.
* The batch must already be in vLLM's order (decodes first); a decode-sized request after a prefill
  raises ``ValueError`` instead of being silently mis-split.
* ``common_prefix_len`` (cascade attention) must be 0.
* Context chunks are sized from ``chunked_prefill_workspace_size`` exactly as vLLM does (equal share per
  prefill with context, rounded down to the block size); each chunk is gathered into a per-call array
  of exactly ``seq_tot`` rows, there is no persistent workspace buffer.
* The decode work (:func:`tokenspeed_jax.mla_decode_work`: the sm90 split-KV schedule) is computed here,
  once per step, like FlashMLA's ``get_mla_metadata`` in vLLM's FlashMLA builder, and every layer's
  ``forward_mqa`` passes it to ``mla_decode`` (``MLACommonDecodeMetadata.work``).  It needs the model's MLA
  facts (``model_config`` or the current :class:`~tokenspeed_jax.vllm.MLAModelConfig`), the cache dtype and
  the tokenspeed backend, as the impl has them; without a model config it is None and each layer's call
  computes its own.
"""

from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np

from tokenspeed_jax.decode import MAX_Q_LEN, mla_decode_work
from tokenspeed_jax.runtime import current_target
from tokenspeed_jax.vllm.backend import decode_problem, kv_cache_kernel_dtype, resolve_kernel_backend
from tokenspeed_jax.vllm.config import MLAModelConfig, get_current_mla_config
from tokenspeed_jax.vllm.metadata import (
    CommonAttentionMetadata,
    ContextChunk,
    MLACommonDecodeMetadata,
    MLACommonMetadata,
    MLACommonPrefillMetadata,
)


class QueryLenSupport(enum.Enum):
    """vLLM's decode query-length support levels; TOKENSPEED decode is ``UNIFORM``."""

    SINGLE_ONLY = "single_only"
    UNIFORM = "uniform"
    VARLEN = "varlen"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TokenspeedMLAMetadataBuilder:
    """Builds :class:`MLACommonMetadata` from :class:`CommonAttentionMetadata` (host side, not jitted).

    Args (keyword-only):
      block_size: cache page size (rows per block).
      num_speculative_tokens: MTP / speculative tokens per decode; ``reorder_batch_threshold`` is
        ``1 + num_speculative_tokens`` (requests with at most that many new tokens are decodes).
      chunked_prefill_workspace_size: most context rows gathered per chunk (vLLM's workspace rows).
        Default: vLLM's formula via :meth:`determine_chunked_prefill_workspace_size` when
        ``max_model_len`` and ``max_num_seqs`` are given, else 64 Ki rows.
      nonuniform_decode: ``"pad"`` or ``"reject"`` (module docstring).
      head_dim: recorded in the metadata (``kv_lora_rank + qk_rope_head_dim``), optional.
      model_config: the model's MLA facts (default: the current config,
        :func:`~tokenspeed_jax.vllm.get_current_mla_config`, at construction); with them ``build`` computes the
        step's decode work (module docstring).
      kv_cache_dtype, tokenspeed_backend: the impl's (``TokenspeedMLAImpl``) cache dtype string and tokenspeed
        backend, which the decode work must be built for.
    """

    query_len_support = QueryLenSupport.UNIFORM

    def __init__(self, *, block_size: int, num_speculative_tokens: int = 0,
                 chunked_prefill_workspace_size: int | None = None, max_model_len: int | None = None,
                 max_num_seqs: int | None = None, nonuniform_decode: str = "pad",
                 head_dim: int | None = None, model_config: MLAModelConfig | None = None,
                 kv_cache_dtype: str = "auto", tokenspeed_backend: str = "auto") -> None:
        for n, v in (("block_size", block_size), ("num_speculative_tokens", num_speculative_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if n == "block_size" else 0):
                raise ValueError(f"{n}: expected a {'positive' if n == 'block_size' else 'non-negative'} int, "
                                 f"got {v!r}")
        if 1 + num_speculative_tokens > MAX_Q_LEN:
            raise ValueError(
                f"num_speculative_tokens: expected at most {MAX_Q_LEN - 1} (TOKENSPEED decode takes up to "
                f"{MAX_Q_LEN} query tokens per request), got {num_speculative_tokens}"
            )
        if nonuniform_decode not in ("pad", "reject"):
            raise ValueError(f"nonuniform_decode: expected 'pad' or 'reject', got {nonuniform_decode!r}")
        if chunked_prefill_workspace_size is None:
            if max_model_len is not None and max_num_seqs is not None:
                chunked_prefill_workspace_size = self.determine_chunked_prefill_workspace_size(
                    max_model_len=max_model_len, max_num_seqs=max_num_seqs, block_size=block_size)
            else:
                chunked_prefill_workspace_size = 64 * 1024
        if (isinstance(chunked_prefill_workspace_size, bool) or not isinstance(chunked_prefill_workspace_size, int)
                or chunked_prefill_workspace_size < block_size):
            raise ValueError(
                f"chunked_prefill_workspace_size: expected an int >= block_size = {block_size}, "
                f"got {chunked_prefill_workspace_size!r}"
            )
        self.block_size = block_size
        self.num_speculative_tokens = num_speculative_tokens
        self.reorder_batch_threshold = 1 + num_speculative_tokens
        self.chunked_prefill_workspace_size = chunked_prefill_workspace_size
        self.nonuniform_decode = nonuniform_decode
        self.head_dim = head_dim
        if model_config is None:
            model_config = get_current_mla_config()
        if model_config is not None and not isinstance(model_config, MLAModelConfig):
            raise TypeError(f"model_config: expected an MLAModelConfig or None, got {type(model_config).__name__}")
        if not isinstance(tokenspeed_backend, str):
            raise TypeError(f"tokenspeed_backend: expected a backend name or 'auto', got {tokenspeed_backend!r}")
        self.model_config = model_config
        self.kv_cache_dtype = kv_cache_dtype
        self.tokenspeed_backend = tokenspeed_backend

    @staticmethod
    def determine_chunked_prefill_workspace_size(*, max_model_len: int, max_num_seqs: int,
                                                 block_size: int) -> int:
        """vLLM's rule: ``min(max(8 * max_model_len, 4 * max_num_seqs * block_size), 64 Ki)`` rows, and at
        least one block per sequence."""
        size = min(max(8 * max_model_len, 4 * max_num_seqs * block_size), 64 * 1024)
        return max(size, max_num_seqs * block_size)

    # ------------------------------------------------------------------------------------------ build
    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> MLACommonMetadata:
        """Split decodes (first) from prefills and build the metadata (``fast_build`` is accepted for
        signature compatibility and ignored)."""
        del fast_build
        if common_prefix_len != 0:
            raise ValueError(f"common_prefix_len: expected 0 (cascade attention is not supported), "
                             f"got {common_prefix_len}")
        m = common_attn_metadata
        if not isinstance(m, CommonAttentionMetadata):
            raise TypeError(f"common_attn_metadata: expected CommonAttentionMetadata, got {type(m).__name__}")
        if not m.causal:
            raise ValueError("common_attn_metadata: expected causal=True (MLA decoder attention), got False")
        try:
            qsl = np.asarray(m.query_start_loc_cpu, np.int64)
            seq_lens = np.asarray(m.seq_lens_cpu, np.int64)
        except Exception as e:  # traced values
            raise TypeError("common_attn_metadata: query_start_loc_cpu / seq_lens_cpu must be concrete host "
                            "arrays (build() runs on the host, outside jit)") from e
        num_reqs = m.num_reqs
        query_lens = np.diff(qsl)
        if qsl.shape != (num_reqs + 1,) or qsl[0] != 0 or np.any(query_lens < 0):
            raise ValueError(f"query_start_loc: expected non-decreasing [num_reqs + 1 = {num_reqs + 1}] "
                             f"offsets from 0, got {qsl.tolist()}")
        if np.any(seq_lens < query_lens):
            raise ValueError(f"seq_lens: expected seq_len >= query_len per request, got seq_lens "
                             f"{seq_lens.tolist()} for query lens {query_lens.tolist()}")
        if qsl[-1] > m.num_actual_tokens:
            raise ValueError(f"query_start_loc: last offset {int(qsl[-1])} exceeds num_actual_tokens "
                             f"= {m.num_actual_tokens}")

        is_decode = query_lens <= self.reorder_batch_threshold
        num_decodes = int(np.argmin(is_decode)) if not is_decode.all() else num_reqs
        if is_decode[num_decodes:].any():
            bad = int(num_decodes + np.argmax(is_decode[num_decodes:]))
            raise ValueError(
                f"common_attn_metadata: batch is not in decode-first order: request {bad} has query_len "
                f"{int(query_lens[bad])} <= reorder_batch_threshold = {self.reorder_batch_threshold} but "
                f"follows prefill request {num_decodes}; reorder the batch (query lens {query_lens.tolist()})"
            )
        num_prefills = num_reqs - num_decodes
        num_decode_tokens = int(qsl[num_decodes])

        decode = self._build_decode(m, query_lens[:num_decodes], qsl) if num_decodes else None
        prefill = (self._build_prefill(m, qsl, query_lens, seq_lens, num_decodes) if num_prefills else None)
        return MLACommonMetadata(
            query_start_loc=m.query_start_loc, slot_mapping=m.slot_mapping, decode=decode, prefill=prefill,
            num_reqs=num_reqs, max_query_len=m.max_query_len, max_seq_len=m.max_seq_len,
            num_actual_tokens=m.num_actual_tokens, num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens, num_prefills=num_prefills, head_dim=self.head_dim,
        )

    def _build_decode(self, m: CommonAttentionMetadata, qlens: np.ndarray, qsl: np.ndarray):
        nd = qlens.shape[0]
        S = max(1, int(qlens.max()))
        uniform = bool(np.all(qlens == S))
        if not uniform and self.nonuniform_decode == "reject":
            raise ValueError(
                f"common_attn_metadata: TOKENSPEED decode needs one query length for every decode request, "
                f"got decode query lens {qlens.tolist()} (build with nonuniform_decode='pad' to pad them "
                f"with a mask)"
            )
        slot = np.arange(S)[None, :]
        first = S - qlens[:, None]  # right-aligned: slot s holds token s - first of the request
        token_index = np.where(slot >= first, qsl[:nd, None] + slot - first, -1).astype(np.int32)
        block_table, seq_lens = m.block_table_tensor[:nd], m.seq_lens[:nd]
        return MLACommonDecodeMetadata(
            block_table=block_table, seq_lens=seq_lens,
            token_index=jnp.asarray(token_index), query_mask=jnp.asarray(token_index >= 0),
            num_decodes=nd, query_len=S, padded=not uniform, work=self._decode_work(block_table, seq_lens, S),
        )

    def _decode_work(self, block_table, seq_lens, S: int):
        """The step's decode work (module docstring) for ``[num_decodes, S]`` queries, or None without a model
        config.  Built for the backend ``forward_mqa`` resolves for the same call, so every layer can use it."""
        cfg = self.model_config
        if cfg is None:
            return None
        dtype = kv_cache_kernel_dtype(self.kv_cache_dtype, cfg.dtype)
        nd, max_pages = block_table.shape
        problem = decode_problem(cfg, dtype=dtype, page_size=self.block_size, target=current_target(), q_len=S,
                                 batch=nd, max_pages=max_pages)
        name, reason = resolve_kernel_backend("decode", problem, self.tokenspeed_backend)
        if reason is not None:
            raise ValueError(f"tokenspeed_backend: {reason}")
        sd = jax.ShapeDtypeStruct
        # (shapes only: the work does not depend on the cache's page count, one page stands for it)
        q = sd((nd, S, cfg.num_heads, cfg.head_size), jnp.dtype(dtype))
        kv = sd((1, self.block_size, cfg.head_size), jnp.dtype(dtype))
        bt = sd(tuple(block_table.shape), block_table.dtype)
        return _work_fn(q, kv, bt, cfg.kv_lora_rank, name)(seq_lens)

    def _build_prefill(self, m, qsl, query_lens, seq_lens, nd):
        np_ = m.num_reqs - nd
        pq = qsl[nd:] - qsl[nd]
        ctx = (seq_lens - query_lens)[nd:]
        chunks = None
        if ctx.max() > 0:
            chunks = self._context_chunks(ctx)
        return MLACommonPrefillMetadata(
            block_table=m.block_table_tensor[nd:], query_start_loc=jnp.asarray(pq.astype(np.int32)),
            seq_lens=m.seq_lens[nd:], context_lens=jnp.asarray(ctx.astype(np.int32)),
            chunked_context=chunks, num_prefills=np_, max_query_len=int(query_lens[nd:].max()),
            workspace_size=self.chunked_prefill_workspace_size,
        )

    def _context_chunks(self, ctx: np.ndarray) -> tuple[ContextChunk, ...]:
        with_ctx = int((ctx > 0).sum())
        max_chunk = self.chunked_prefill_workspace_size // with_ctx
        max_chunk = (max_chunk // self.block_size) * self.block_size  # page-aligned chunk starts
        if max_chunk <= 0:
            raise ValueError(
                f"chunked_prefill_workspace_size: {self.chunked_prefill_workspace_size} rows cannot give one "
                f"block ({self.block_size} rows) to each of the {with_ctx} prefills with context"
            )
        n = _cdiv(int(ctx.max()), max_chunk)
        out = []
        for i in range(n):
            starts = np.full(ctx.shape, i * max_chunk, np.int64)
            lens = np.clip(np.minimum(ctx, starts + max_chunk) - starts, 0, None)
            cu = np.concatenate([[0], np.cumsum(lens)])
            tot = int(cu[-1])
            seq = np.repeat(np.arange(ctx.shape[0]), lens)
            pos = starts[seq] + (np.arange(tot) - cu[seq])
            out.append(ContextChunk(
                cu_seq_lens=jnp.asarray(cu.astype(np.int32)), starts=jnp.asarray(starts.astype(np.int32)),
                seq_lens=jnp.asarray(lens.astype(np.int32)), token_to_seq=jnp.asarray(seq.astype(np.int32)),
                token_positions=jnp.asarray(pos.astype(np.int32)), chunk_index=i,
                num_requests=int(ctx.shape[0]), seq_tot=tot, max_seq_len=int(lens.max()),
            ))
        return tuple(out)


@functools.lru_cache(maxsize=64)
def _work_fn(q, kv, bt, kv_lora_rank: int, backend: str):
    """``mla_decode_work`` for these shapes, jitted (``build`` runs on the host: one dispatch per step)."""
    return jax.jit(lambda seq_lens: mla_decode_work(q, kv, bt, seq_lens, kv_lora_rank=kv_lora_rank, backend=backend))
