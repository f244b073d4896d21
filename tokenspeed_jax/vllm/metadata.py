"""Attention metadata of the vLLM-compatible adapter, as JAX pytrees.

Names and meanings mirror vLLM's V1 ``CommonAttentionMetadata`` and ``MLACommonMetadata``.  Every class
is a frozen dataclass registered with :func:`jax.tree_util.register_dataclass`: arrays are pytree
leaves (they may be traced), **counts are static fields** (part of the treedef, so a jitted forward
specialises on them and re-traces when they change, exactly like any other shape).

Batch order is vLLM's: the ``num_decodes`` decode requests come first, then the ``num_prefills``
prefill requests; token rows follow the same order (``query_start_loc``).

Token / length vocabulary (vLLM's)::

    |---------- context_len ----------|-- query_len --|
    |------------------- seq_len ---------------------|

Padding: ``slot_mapping`` is ``-1`` for padded token rows (nothing is written); token rows at or past
``query_start_loc[num_reqs]`` belong to no request and produce zero output.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np


def _pytree(*, meta: tuple[str, ...]):
    """Frozen dataclass registered as a pytree; ``meta`` names the static fields."""

    def wrap(cls):
        cls = dataclasses.dataclass(frozen=True)(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        data = [n for n in names if n not in meta]
        return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=list(meta))

    return wrap


def _int32(x, name: str) -> np.ndarray:
    """``x`` as an int32 host array, or a ``ValueError`` naming ``name`` when a value lies outside int32: a
    cast would wrap it silently (int64 ``2**32 + 21`` -> 21, uint32 ``2**32 - 1`` -> -1)."""
    a = np.asarray(x)
    i32 = np.iinfo(np.int32)
    bad = a[(a < i32.min) | (a > i32.max)]
    if bad.size:
        raise ValueError(f"{name}: expected values in the int32 range, got {bad.flat[0].item()!r} (a cast would "
                         "wrap it)")
    return a.astype(np.int32)


@_pytree(meta=("num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len", "causal"))
class CommonAttentionMetadata:
    """Per-batch metadata shared by every layer (vLLM's ``CommonAttentionMetadata``).

    Arrays (int32):
      query_start_loc: ``[num_reqs + 1]`` token offset of each request; ``query_start_loc_cpu`` is its
        host (numpy) copy, which the builder reads (vLLM keeps the same pair).
      seq_lens: ``[num_reqs]`` context + new tokens of each request; ``seq_lens_cpu`` its host copy.
      block_table_tensor: ``[num_reqs, max_blocks]`` page ids of each request.
      slot_mapping: ``[num_actual_tokens]`` cache slot (``page * block_size + row``) of each new token,
        ``-1`` for padding.

    Static: ``num_reqs``, ``num_actual_tokens`` (rows of q, padding included), ``max_query_len``,
    ``max_seq_len``, ``causal`` (the MLA adapter supports causal decoder attention only).
    """

    query_start_loc: Any
    query_start_loc_cpu: Any
    seq_lens: Any
    seq_lens_cpu: Any
    block_table_tensor: Any
    slot_mapping: Any
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    causal: bool = True

    @classmethod
    def from_numpy(cls, query_start_loc, seq_lens, block_table, slot_mapping, *, num_actual_tokens=None,
                   causal: bool = True) -> CommonAttentionMetadata:
        """Build from host arrays (the counts are derived from them)."""
        qsl = _int32(query_start_loc, "query_start_loc")
        sl = _int32(seq_lens, "seq_lens")
        bt = _int32(block_table, "block_table")
        sm = _int32(slot_mapping, "slot_mapping")
        if qsl.ndim != 1 or qsl.shape[0] < 1:
            raise ValueError(f"query_start_loc: expected shape [num_reqs + 1], got {qsl.shape}")
        num_reqs = qsl.shape[0] - 1
        if sl.shape != (num_reqs,):
            raise ValueError(f"seq_lens: expected shape [num_reqs] = ({num_reqs},), got {sl.shape}")
        if bt.ndim != 2 or bt.shape[0] != num_reqs:
            raise ValueError(f"block_table: expected shape [num_reqs = {num_reqs}, max_blocks], got {bt.shape}")
        ql = np.diff(qsl)
        if num_actual_tokens is None:
            num_actual_tokens = int(sm.shape[0])
        return cls(
            query_start_loc=jax.numpy.asarray(qsl), query_start_loc_cpu=qsl,
            seq_lens=jax.numpy.asarray(sl), seq_lens_cpu=sl,
            block_table_tensor=jax.numpy.asarray(bt), slot_mapping=jax.numpy.asarray(sm),
            num_reqs=num_reqs, num_actual_tokens=int(num_actual_tokens),
            max_query_len=int(ql.max()) if num_reqs else 0,
            max_seq_len=int(sl.max()) if num_reqs else 0, causal=bool(causal),
        )


@_pytree(meta=("num_decodes", "query_len", "padded"))
class MLACommonDecodeMetadata:
    """Decode part (vLLM's ``MLACommonDecodeMetadata``): the first ``num_decodes`` requests.

    TOKENSPEED decode takes queries as ``[num_decodes, query_len, H, D]``.  ``token_index[b, s]`` is the
    row of the flat query that fills slot ``s`` of request ``b``, or ``-1`` for a padding slot, and
    ``query_mask = token_index >= 0``.  A request with fewer than ``query_len`` tokens occupies the
    *last* slots (right-aligned), so the bottom-right causal mask of ``mla_decode`` gives each real token
    exactly the keys it would see unpadded; padding slots read zeros and are dropped on output.
    ``padded`` is False when every decode has exactly ``query_len`` tokens (then ``token_index`` is the
    identity reshape).

    ``work`` is the step's :class:`tokenspeed_jax.DecodeWork` (the sm90 split-KV schedule), built once per step
    by the builder when it knows the model's MLA facts and passed to every layer's ``mla_decode``; ``None``:
    each layer's call computes it (FlashMLA's ``tile_scheduler_metadata`` / ``num_splits`` play this role in
    vLLM).
    """

    block_table: Any  # int32 [num_decodes, max_blocks]
    seq_lens: Any  # int32 [num_decodes]
    token_index: Any  # int32 [num_decodes, query_len]
    query_mask: Any  # bool [num_decodes, query_len]
    num_decodes: int
    query_len: int
    padded: bool
    work: Any = None  # tokenspeed_jax.DecodeWork | None


@_pytree(meta=("chunk_index", "num_requests", "seq_tot", "max_seq_len"))
class ContextChunk:
    """One chunk of the cached context of the prefill requests (vLLM's chunked-context metadata).

    Chunk ``i`` covers context tokens ``[starts[p], starts[p] + seq_lens[p])`` of prefill request ``p``;
    they are gathered into a per-call array of exactly ``seq_tot`` rows (the token slice
    ``workspace[cu_seq_lens[p]:cu_seq_lens[p + 1]]`` is request ``p``).  ``token_to_seq[t]`` /
    ``token_positions[t]`` give the request and context position of gathered row ``t``.
    """

    cu_seq_lens: Any  # int32 [num_prefills + 1]
    starts: Any  # int32 [num_prefills]
    seq_lens: Any  # int32 [num_prefills]
    token_to_seq: Any  # int32 [seq_tot]
    token_positions: Any  # int32 [seq_tot]
    chunk_index: int
    num_requests: int
    seq_tot: int
    max_seq_len: int


@_pytree(meta=("num_prefills", "max_query_len", "workspace_size"))
class MLACommonPrefillMetadata:
    """Prefill part (vLLM's ``MLACommonPrefillMetadata``): requests ``num_decodes..num_reqs``.

    ``query_start_loc`` is rebased to the first prefill token (it indexes the prefill slice of q).
    ``chunked_context`` is None when no prefill has cached context, else a tuple of
    :class:`ContextChunk` whose ``seq_tot`` never exceeds ``workspace_size`` rows.
    """

    block_table: Any  # int32 [num_prefills, max_blocks]
    query_start_loc: Any  # int32 [num_prefills + 1], rebased
    seq_lens: Any  # int32 [num_prefills]
    context_lens: Any  # int32 [num_prefills]
    chunked_context: tuple[ContextChunk, ...] | None
    num_prefills: int
    max_query_len: int
    workspace_size: int


@_pytree(meta=("num_reqs", "max_query_len", "max_seq_len", "num_actual_tokens", "num_decodes",
               "num_decode_tokens", "num_prefills", "head_dim"))
class MLACommonMetadata:
    """Per-layer MLA metadata built by :class:`~tokenspeed_jax.vllm.builder.TokenspeedMLAMetadataBuilder`
    (vLLM's ``MLACommonMetadata``).  ``decode`` / ``prefill`` are None when that part is empty.
    Decode tokens are rows ``[0, num_decode_tokens)`` of q; prefill tokens follow."""

    query_start_loc: Any
    slot_mapping: Any
    decode: MLACommonDecodeMetadata | None
    prefill: MLACommonPrefillMetadata | None
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    head_dim: int | None = None

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_actual_tokens - self.num_decode_tokens
