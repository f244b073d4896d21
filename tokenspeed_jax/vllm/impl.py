"""``TokenspeedMLAImpl``: vLLM's MLA attention-impl contracts (``do_kv_cache_update``, ``forward_mqa``,
``forward_mha``) over the public tokenspeed_jax ops.

Everything is functional (JAX): ``do_kv_cache_update`` returns the new cache (donate it under jit for an
in-place update) and ``forward_mha`` returns its output instead of writing ``output``.

Scales.  ``forward_mqa`` reads ``layer._q_scale`` / ``layer._k_scale`` on **every call** (Python floats or
float32 scalar arrays, which may be traced) and, for an FP8 cache, passes
``softmax_scale = scale * q_scale * k_scale`` and ``output_scale = k_scale`` (the FP8 convention of
:mod:`tokenspeed_jax.decode`); nothing is cached on the first call, so a profiling run with dummy scales
cannot poison later calls (the seed PR cached them).  The query is quantized with the static per-tensor
``q_scale`` (``e4m3(clip(q / q_scale))``) unless it already arrives as float8_e4m3fn.  A 16-bit cache
uses ``softmax_scale = scale`` and ``output_scale = 1``; q/k scales do not apply.

LSE.  vLLM reads the decode LSE in the base given by the impl's ``lse_base_on_e`` (True: natural log,
FlashAttention's convention and the default of vLLM's MLA impls; False: base 2, FlashInfer's).  tokenspeed
returns the natural-log LSE, so ``lse_base_on_e = True`` is this backend's answer; constructing the impl
with ``lse_base_on_e=False`` converts (``lse2 = lse / ln 2``) for a consumer that wants base 2.

Workspace.  There is no persistent buffer: decode workspace is sized by the planner per call inside
``mla_decode``, and each context chunk of ``forward_mha`` is gathered into an array of exactly
``ContextChunk.seq_tot`` rows.

Decode work.  ``forward_mqa`` passes the step's decode work (``MLACommonDecodeMetadata.work``, the sm90
split-KV schedule built once per step by the metadata builder) to ``mla_decode``, so no layer recomputes it;
a work built for another backend or shape raises ``ValueError`` naming ``work``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from tokenspeed_jax.cache import concat_and_cache_mla, quantize_e4m3
from tokenspeed_jax.decode import mla_decode
from tokenspeed_jax.merge import merge_attn_states
from tokenspeed_jax.problems import FP8_DTYPE, DecodeProblem
from tokenspeed_jax.runtime import current_target
from tokenspeed_jax.vllm.backend import (
    FP8_KV_CACHE_DTYPES,
    TokenspeedMLABackend,
    TokenspeedMLAPrefillBackend,
    resolve_kernel_backend,
)
from tokenspeed_jax.vllm.config import dtype_name
from tokenspeed_jax.vllm.metadata import MLACommonMetadata

LN2 = math.log(2.0)


def lse_natural_to_base2(lse: jax.Array) -> jax.Array:
    """``log2(sum exp(s))`` from ``ln(sum exp(s))`` (-inf stays -inf)."""
    return lse / LN2


def lse_base2_to_natural(lse: jax.Array) -> jax.Array:
    """``ln(sum exp(s))`` from ``log2(sum exp(s))`` (-inf stays -inf)."""
    return lse * LN2


def _scalar(v, name: str) -> jax.Array:
    if isinstance(v, bool | str | bytes) or v is None:  # jnp.asarray would parse a string scale silently
        raise TypeError(f"{name}: expected a float or a float32 scalar array, got {v!r:.40}")
    try:
        a = jnp.asarray(v, jnp.float32)
    except (TypeError, ValueError, OverflowError) as e:  # complex, a huge int, ragged lists
        raise TypeError(f"{name}: expected a float or a float32 scalar array, got {v!r:.40} ({e})") from None
    if a.size != 1:
        raise ValueError(f"{name}: expected a scalar, got shape {tuple(a.shape)}")
    return a.reshape(())


def _layer_scale(layer: Any, attr: str) -> jax.Array:
    if not hasattr(layer, attr):
        raise ValueError(f"layer: expected attribute {attr} (per-tensor scale) for an FP8 kv cache, "
                         f"got a {type(layer).__name__} without it")
    return _scalar(getattr(layer, attr), f"layer.{attr}")


class TokenspeedMLAImpl:
    """The TOKENSPEED_MLA attention impl (constructor mirrors vLLM's ``MLACommonImpl``).

    MLA arguments are keyword-only.  ``kv_b_proj`` is either the weight ``[kv_lora_rank, N * (P + V)]``
    (vLLM's ``kv_b_proj.weight.T``; ``W_UK`` / ``W_UV`` are split from it for :func:`mla_attention`) or a
    callable ``[T, kv_lora_rank] -> [T, N * (P + V)]`` (a tuple result's first item is used, like
    vLLM's ``ColumnParallelLinear``).  Extra options: ``tokenspeed_backend`` (see
    :mod:`tokenspeed_jax.vllm.backend`), ``lse_base_on_e`` and ``return_lse_for_decode`` (vLLM sets the
    latter when decode context parallelism needs the LSE).
    """

    can_return_lse_for_decode: bool = True
    lse_base_on_e: bool = True

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None, attn_type: str, kv_sharing_target_layer_name: str | None, *,
                 kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 kv_b_proj: jax.Array | Callable, q_lora_rank: int | None = None, qk_head_dim: int | None = None,
                 indexer: Any = None, q_pad_num_heads: int | None = None, tokenspeed_backend: str = "auto",
                 lse_base_on_e: bool = True, return_lse_for_decode: bool = False) -> None:
        if kv_sharing_target_layer_name is not None:
            raise NotImplementedError("KV sharing is not supported for MLA")
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap is not None:
            raise NotImplementedError("TokenspeedMLAImpl does not support alibi_slopes, sliding_window or "
                                      "logits_soft_cap")
        if attn_type != "decoder":
            raise NotImplementedError(f"attn_type: only 'decoder' attention is implemented, got {attn_type!r}")
        if indexer is not None:
            raise NotImplementedError("indexer: sparse MLA is not supported by TOKENSPEED_MLA")
        if num_kv_heads != 1:
            raise ValueError(f"num_kv_heads: expected 1 (one latent KV head), got {num_kv_heads}")
        if head_size != kv_lora_rank + qk_rope_head_dim:
            raise ValueError(f"head_size: expected kv_lora_rank + qk_rope_head_dim = "
                             f"{kv_lora_rank + qk_rope_head_dim}, got {head_size}")
        if qk_head_dim is not None and qk_head_dim != qk_nope_head_dim + qk_rope_head_dim:
            raise ValueError(f"qk_head_dim: expected qk_nope_head_dim + qk_rope_head_dim = "
                             f"{qk_nope_head_dim + qk_rope_head_dim}, got {qk_head_dim}")
        if kv_cache_dtype not in TokenspeedMLABackend.supported_kv_cache_dtypes:
            raise ValueError(f"kv_cache_dtype: expected one of {TokenspeedMLABackend.supported_kv_cache_dtypes}, "
                             f"got {kv_cache_dtype!r}")
        if not isinstance(lse_base_on_e, bool) or not isinstance(return_lse_for_decode, bool):
            raise TypeError("lse_base_on_e, return_lse_for_decode: expected Python bools")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.q_pad_num_heads = q_pad_num_heads
        self.tokenspeed_backend = tokenspeed_backend
        self.lse_base_on_e = lse_base_on_e
        self.need_to_return_lse_for_decode = return_lse_for_decode
        self.supports_quant_query_input = True
        self.kv_b_proj = kv_b_proj
        self.W_UK = self.W_UV = None
        self.process_weights_after_loading()
        self.prefill_backend = TokenspeedMLAPrefillBackend(
            num_heads, self.scale, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
            tokenspeed_backend=tokenspeed_backend)

    # ------------------------------------------------------------------------------------ weights
    def process_weights_after_loading(self, act_dtype=None) -> None:
        """Split ``W_UK [L, N, P]`` and ``W_UV [L, N, V]`` from an array ``kv_b_proj`` (cast to
        ``act_dtype`` if given); a callable ``kv_b_proj`` exposes its weight as ``.weight``, if at all."""
        w = self.kv_b_proj if hasattr(self.kv_b_proj, "shape") else getattr(self.kv_b_proj, "weight", None)
        if w is None:
            return
        L, N, P, V = self.kv_lora_rank, self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        if tuple(w.shape) != (L, N * (P + V)):
            raise ValueError(f"kv_b_proj: expected weight shape [kv_lora_rank, N * (P + V)] = ({L}, {N * (P + V)}), "
                             f"got {tuple(w.shape)}")
        w = jnp.asarray(w) if act_dtype is None else jnp.asarray(w, act_dtype)
        w3 = w.reshape(L, N, P + V)
        self.W_UK, self.W_UV = w3[..., :P], w3[..., P:]

    def _up_project(self, kv_c: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``kv_b_proj(kv_c)`` split into ``k_nope [T, N, P]`` and ``v [T, N, V]``."""
        if hasattr(self.kv_b_proj, "shape"):
            w = self.kv_b_proj
            y = jnp.einsum("tl,lo->to", kv_c, w.astype(kv_c.dtype), preferred_element_type=jnp.float32)
            y = y.astype(kv_c.dtype)
        else:
            y = self.kv_b_proj(kv_c)
            if isinstance(y, tuple):
                y = y[0]
        y = y.reshape(kv_c.shape[0], self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        return y[..., : self.qk_nope_head_dim], y[..., self.qk_nope_head_dim:]

    # ---------------------------------------------------------------------------------- kv cache
    def _check_cache(self, kv_cache, kv_cache_dtype: str) -> bool:
        name = jnp.dtype(kv_cache.dtype).name
        fp8 = kv_cache_dtype in FP8_KV_CACHE_DTYPES
        if fp8 != (name == FP8_DTYPE) or (kv_cache_dtype == "bfloat16" and name != "bfloat16"):
            raise TypeError(f"kv_cache: expected a cache array matching kv_cache_dtype {kv_cache_dtype!r}, "
                            f"got dtype {name}")
        if kv_cache.ndim != 3 or kv_cache.shape[-1] != self.head_size:
            raise ValueError(f"kv_cache: expected shape [num_blocks, block_size, {self.head_size}], "
                             f"got {tuple(kv_cache.shape)}")
        return fp8

    def do_kv_cache_update(self, kv_c_normed: jax.Array, k_pe: jax.Array, kv_cache: jax.Array,
                           slot_mapping: jax.Array, kv_cache_dtype: str, k_scale) -> jax.Array:
        """Write ``[kv_c | k_pe]`` rows (vLLM's ``concat_and_cache_mla`` layout; FP8 stores ``x / k_scale``)
        and return the new cache; slot ``-1`` writes nothing."""
        fp8 = self._check_cache(kv_cache, kv_cache_dtype)
        return concat_and_cache_mla(kv_c_normed, k_pe, kv_cache, slot_mapping,
                                    scale=_scalar(k_scale, "k_scale") if fp8 else None)

    # ---------------------------------------------------------------------------------- decode
    def forward_mqa(self, q: jax.Array | tuple[jax.Array, jax.Array], kv_cache: jax.Array,
                    attn_metadata: MLACommonMetadata, layer: Any) -> tuple[jax.Array, jax.Array | None]:
        """Absorbed MQA over the paged latent cache for the decode tokens.

        Args:
          q: ``[T, N, kv_lora_rank + rope]`` or ``(ql_nope [T, N, kv_lora_rank], q_pe [T, N, rope])`` with
            ``T = attn_metadata.num_decode_tokens``; 16-bit, or float8_e4m3fn already divided by q_scale.
          layer: provides ``_q_scale`` / ``_k_scale`` (read every call; FP8 cache only).

        Returns:
          ``o [T, N, kv_lora_rank]`` (q's dtype; bf16 for an FP8 q) and the LSE ``[T, N]`` float32 (base
          per ``lse_base_on_e``) when ``need_to_return_lse_for_decode``, else None.
        """
        md = attn_metadata
        dec = md.decode
        if dec is None:
            raise ValueError("attn_metadata: expected decode metadata (num_decodes > 0), got decode=None")
        if isinstance(q, tuple):
            if len(q) != 2:
                raise ValueError(f"q: expected (ql_nope, q_pe), got a tuple of {len(q)}")
            q = jnp.concatenate([q[0], q[1].astype(q[0].dtype)], axis=-1)
        T, N, D = q.shape
        if (T, N, D) != (md.num_decode_tokens, self.num_heads, self.head_size):
            raise ValueError(f"q: expected shape [num_decode_tokens, N, D] = ({md.num_decode_tokens}, "
                             f"{self.num_heads}, {self.head_size}), got {tuple(q.shape)}")
        fp8 = self._check_cache(kv_cache, self.kv_cache_dtype)
        q_is_fp8 = jnp.dtype(q.dtype).name == FP8_DTYPE
        out_dtype = jnp.bfloat16 if q_is_fp8 else q.dtype
        if fp8:
            q_scale = _layer_scale(layer, "_q_scale")
            k_scale = _layer_scale(layer, "_k_scale")
            if not q_is_fp8:
                q = quantize_e4m3(q, q_scale)
            softmax_scale = self.scale * q_scale * k_scale
            output_scale = k_scale
        else:
            if q_is_fp8:
                raise TypeError(f"q: float8_e4m3fn query needs an FP8 kv cache, the cache is "
                                f"{jnp.dtype(kv_cache.dtype).name}")
            q = q.astype(kv_cache.dtype)
            softmax_scale = jnp.float32(self.scale)
            output_scale = jnp.float32(1.0)

        B, S = dec.num_decodes, dec.query_len
        if dec.padded:
            idx = dec.token_index.reshape(-1)
            rows = jnp.take(q, jnp.clip(idx, 0, T - 1), axis=0)
            rows = jnp.where(dec.query_mask.reshape(-1)[:, None, None], rows, jnp.zeros((), q.dtype))
            q4 = rows.reshape(B, S, N, D)
        else:
            q4 = q.reshape(B, S, N, D)
        want_lse = self.need_to_return_lse_for_decode
        problem = DecodeProblem(
            batch=B, q_len=S, num_heads=N, head_dim=D, kv_lora_rank=self.kv_lora_rank,
            page_size=kv_cache.shape[1], num_pages=kv_cache.shape[0], max_pages=dec.block_table.shape[1],
            dtype=dtype_name(q.dtype), causal=True, return_lse=want_lse, target=current_target(),
        )
        name, reason = resolve_kernel_backend("decode", problem, self.tokenspeed_backend)
        if reason is not None:
            raise ValueError(f"backend: {reason}")
        res = mla_decode(q4, kv_cache, dec.block_table, dec.seq_lens, softmax_scale=softmax_scale,
                         output_scale=output_scale, causal=True, kv_lora_rank=self.kv_lora_rank,
                         return_lse=want_lse, backend=name, work=dec.work)
        o4, lse4 = res if want_lse else (res, None)
        o = self._unpad(o4.reshape(B * S, N, self.kv_lora_rank), dec, T)
        lse = None
        if want_lse:
            lse = self._unpad(lse4.reshape(B * S, N), dec, T)
            if not self.lse_base_on_e:
                lse = lse_natural_to_base2(lse)
        return o.astype(out_dtype), lse

    @staticmethod
    def _unpad(x: jax.Array, dec, T: int) -> jax.Array:
        if not dec.padded:
            return x
        idx = dec.token_index.reshape(-1)
        idx = jnp.where(idx >= 0, idx, T)  # padding slots scatter past the end and are dropped
        return jnp.zeros((T,) + x.shape[1:], x.dtype).at[idx].set(x, mode="drop")

    # --------------------------------------------------------------------------------- prefill
    def forward_mha(self, q: jax.Array, kv_c_normed: jax.Array, k_pe: jax.Array, kv_cache: jax.Array,
                    attn_metadata: MLACommonMetadata, k_scale, output: jax.Array | None = None) -> jax.Array:
        """Non-absorbed prefill attention with the ``kv_b_proj`` up-projection and chunked context.

        Args:
          q: ``[Tp, N, P + R]`` prefill queries (rows ``num_decode_tokens:`` of the batch); kv_c_normed
            ``[Tp, kv_lora_rank]`` and k_pe ``[Tp, R]`` (or ``[Tp, 1, R]``) of the same new tokens.
          kv_cache: the latent cache holding the prefills' context (dequantized with ``k_scale`` if FP8).
          output: optional ``[Tp, N * V]`` (or ``[Tp, N, V]``) array giving the result's shape and dtype.

        Returns ``[Tp, N * V]`` (or ``output``'s shape): the new tokens' causal attention merged with every
        context chunk through :func:`tokenspeed_jax.merge_attn_states`.
        """
        md = attn_metadata
        pre = md.prefill
        if pre is None:
            raise ValueError("attn_metadata: expected prefill metadata (num_prefills > 0), got prefill=None")
        Tp, N, Dq = q.shape
        if (N, Dq) != (self.num_heads, self.qk_head_dim):
            raise ValueError(f"q: expected shape [Tp, {self.num_heads}, {self.qk_head_dim}], got {tuple(q.shape)}")
        if k_pe.ndim == 3:
            k_pe = k_pe[:, 0]
        if kv_c_normed.shape != (Tp, self.kv_lora_rank) or k_pe.shape != (Tp, self.qk_rope_head_dim):
            raise ValueError(f"kv_c_normed, k_pe: expected [{Tp}, {self.kv_lora_rank}] and "
                             f"[{Tp}, {self.qk_rope_head_dim}], got {tuple(kv_c_normed.shape)} and "
                             f"{tuple(k_pe.shape)}")
        fp8 = self._check_cache(kv_cache, self.kv_cache_dtype)
        dt = q.dtype
        k, v = self._keys_values(kv_c_normed.astype(dt), k_pe.astype(dt))
        pb = self.prefill_backend
        # The metadata (arrays, tracers under jit) is installed for this call only: state set while
        # tracing must not outlive the trace (a leaked tracer fails far from here, on its next use).
        before = pb._prefill_metadata
        pb.prepare_metadata(pre)
        try:
            has_ctx = pre.chunked_context is not None
            res = pb.run_prefill_new_tokens(q, k, v, return_softmax_lse=has_ctx)
            if has_ctx:
                out, lse = res
                ks = _scalar(k_scale, "k_scale") if fp8 else None
                for ch in pre.chunked_context:
                    ws = self._gather_chunk(kv_cache, pre.block_table, ch, ks, dt)
                    kc, vc = self._keys_values(ws[:, : self.kv_lora_rank], ws[:, self.kv_lora_rank:])
                    o_c, lse_c = pb.run_prefill_context_chunk(ch.chunk_index, q, kc, vc)
                    out, lse = merge_attn_states(o_c, lse_c, out, lse)
            else:
                out = res
        finally:
            pb._prefill_metadata = before
        out = out.reshape(Tp, N * self.v_head_dim)
        if output is not None:
            if output.shape not in ((Tp, N * self.v_head_dim), (Tp, N, self.v_head_dim)):
                raise ValueError(f"output: expected shape [{Tp}, {N * self.v_head_dim}], got {tuple(output.shape)}")
            out = out.reshape(output.shape).astype(output.dtype)
        return out

    def _keys_values(self, kv_c, k_pe):
        k_nope, v = self._up_project(kv_c)
        T = kv_c.shape[0]
        pe = jnp.broadcast_to(k_pe[:, None, :], (T, self.num_heads, self.qk_rope_head_dim)).astype(k_nope.dtype)
        return jnp.concatenate([k_nope, pe], axis=-1), v

    @staticmethod
    def _gather_chunk(kv_cache, block_table, ch, k_scale, dtype):
        """Rows of context chunk ``ch`` (``[seq_tot, D]``, exactly), dequantized for an FP8 cache."""
        ps = kv_cache.shape[1]
        seq, pos = ch.token_to_seq, ch.token_positions
        pages = jnp.clip(block_table[seq, pos // ps], 0, kv_cache.shape[0] - 1)
        rows = kv_cache[pages, pos % ps]
        if k_scale is not None:
            return (rows.astype(jnp.float32) * k_scale).astype(dtype)
        return rows.astype(dtype)
