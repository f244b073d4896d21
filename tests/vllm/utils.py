"""Shared pieces of the vLLM-adapter tests: batch specs, batch construction, float64 MLA reference.

Ported in structure from vLLM's tests/v1/attention/test_mla_backends.py (batch specs, context written
through ``do_kv_cache_update`` then blocks randomly permuted, per-request SDPA reference); sequence
lengths are trimmed for the 2-core CPU CI (see ``BATCH_SPECS``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from tokenspeed_jax.vllm import (
    TokenspeedMLAImpl,
    TokenspeedMLAMetadataBuilder,
    build_attention_metadata,
)

L, R, P, V = 512, 64, 128, 128  # DeepSeek-R1 MLA dims (the test model; the adapter reads them from config)
BLOCK = 16


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)


# vLLM's specs with sequence lengths divided by ~4 (and the two 32-request / 8-request "large" batches
# halved) so the float64 reference and the xla backend stay within the CPU budget; query lengths and the
# decode/prefill/mixed/spec structure are vLLM's.
BATCH_SPECS = {
    "small_decode": BatchSpec((32, 40), (1, 1)),
    "small_prefill": BatchSpec((32, 40), (8, 8)),
    "mixed_small": BatchSpec((32, 40, 48, 56), (1, 1, 5, 5)),
    "medium_decode": BatchSpec((32, 64, 128, 256, 32, 64, 128, 256), (1,) * 8),
    "medium_prefill": BatchSpec((64, 128, 256, 512), (16, 16, 16, 16)),
    "mixed_medium": BatchSpec((128, 256, 512, 128, 256, 512), (1, 1, 1, 7, 7, 7)),
    "large_decode": BatchSpec((512,) * 16, (1,) * 16),
    "large_prefill": BatchSpec((512,) * 4, (32,) * 4),
    "single_decode": BatchSpec((256,), (1,)),
    "single_prefill": BatchSpec((256,), (64,)),
    "spec_decode_small": BatchSpec((32, 64, 128, 256), (4, 4, 4, 4)),
    "spec_decode_medium": BatchSpec((128, 256, 512, 128, 256, 512), (8,) * 6),
    # vLLM: a workspace smaller than the context forces several context chunks (1024 rows there, 256
    # here for proportionally shorter contexts: 2 prefills with context -> 128 rows each -> 2 chunks;
    # every chunk is one more prefill call to compile, so the CPU test keeps it at two).
    "chunked_context_prefill": BatchSpec((262, 128), (12, 8)),
}
CHUNKED_WORKSPACE = {"chunked_context_prefill": 256}


def spec_tokens(name: str) -> int:
    """vLLM's test: spec-decode specs set num_speculative_tokens = query_len - 1, the others 0."""
    return BATCH_SPECS[name].query_lens[0] - 1 if name.startswith("spec_decode") else 0


class Layer:
    """vLLM's attention layer as far as the impl reads it: per-tensor scales."""

    def __init__(self, q_scale=1.0, k_scale=1.0):
        self._q_scale = q_scale
        self._k_scale = k_scale


def bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


@dataclasses.dataclass
class Batch:
    spec: BatchSpec
    heads: int
    q: np.ndarray  # [T, N, P + R] bf16
    kv_c: list[np.ndarray]  # per request [seq_len, L] bf16 (context + new)
    k_pe: list[np.ndarray]  # per request [seq_len, R] bf16
    w_kv_b: np.ndarray  # [L, N * (P + V)] bf16
    kv_cache: jnp.ndarray  # context written, blocks permuted
    block_table: np.ndarray
    md: object  # runner AttentionMetadata
    impl: TokenspeedMLAImpl
    scale: float

    @property
    def new_kv_c(self):
        return np.concatenate([k[s - q:] for k, s, q in zip(self.kv_c, self.spec.seq_lens, self.spec.query_lens)])

    @property
    def new_k_pe(self):
        return np.concatenate([k[s - q:] for k, s, q in zip(self.k_pe, self.spec.seq_lens, self.spec.query_lens)])


def make_batch(rng, spec: BatchSpec, *, heads: int, kv_cache_dtype: str = "auto", k_scale: float = 1.0,
               num_speculative_tokens: int = 0, workspace: int | None = None,
               nonuniform_decode: str = "pad", pad_tokens: int = 0, tokenspeed_backend: str = "xla") -> Batch:
    N = heads
    T = sum(spec.query_lens)
    scale = (P + R) ** -0.5
    q = bf16(rng.standard_normal((T + pad_tokens, N, P + R)))
    kv_c = [bf16(rng.standard_normal((s, L))) for s in spec.seq_lens]
    k_pe = [bf16(rng.standard_normal((s, R))) for s in spec.seq_lens]
    w = bf16(rng.standard_normal((L, N * (P + V))) / np.sqrt(L))
    impl = TokenspeedMLAImpl(
        N, L + R, scale, 1, None, None, kv_cache_dtype, None, "decoder", None, kv_lora_rank=L,
        qk_nope_head_dim=P, qk_rope_head_dim=R, v_head_dim=V, kv_b_proj=jnp.asarray(w),
        tokenspeed_backend=tokenspeed_backend)

    # Blocks: request i owns cdiv(seq_len, BLOCK) consecutive blocks starting at 1 (block 0 is the null
    # block); a few spare blocks; every unwritten row is NaN and must never be read.
    nblk = [-(-s // BLOCK) for s in spec.seq_lens]
    used = 1 + sum(nblk)
    num_blocks = used + 3
    fp8 = kv_cache_dtype in ("fp8", "fp8_e4m3")
    cdt = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    cache = jnp.full((num_blocks, BLOCK, L + R), jnp.nan, cdt)
    max_blocks = max(nblk) + 1
    bt = np.zeros((spec.batch_size, max_blocks), np.int64)
    start = 1
    ctx_slots = []
    for i, (s, ql) in enumerate(zip(spec.seq_lens, spec.query_lens)):
        bt[i, : nblk[i]] = np.arange(start, start + nblk[i])
        c = s - ql
        ctx_slots.append(start * BLOCK + np.arange(c))
        start += nblk[i]
    # Write every context through do_kv_cache_update (the FP8 path quantizes with k_scale).
    all_c = np.concatenate([kv_c[i][: s - ql] for i, (s, ql) in enumerate(zip(spec.seq_lens, spec.query_lens))])
    all_pe = np.concatenate([k_pe[i][: s - ql] for i, (s, ql) in enumerate(zip(spec.seq_lens, spec.query_lens))])
    slots = np.concatenate(ctx_slots)
    if slots.size:
        update = jax.jit(impl.do_kv_cache_update, static_argnums=(4,))
        cache = update(jnp.asarray(all_c), jnp.asarray(all_pe), cache, jnp.asarray(slots, jnp.int32),
                       kv_cache_dtype, jnp.float32(k_scale))
    # Randomly permute the used blocks (block 0 stays the null block) and remap the block table.
    perm = rng.permutation(used - 1) + 1  # new block b holds old block perm[b - 1]
    c_np = np.array(cache)
    c_np[1:used] = c_np[perm]
    cache = jnp.asarray(c_np)
    inv = np.zeros(used, np.int64)
    inv[perm] = np.arange(1, used)
    bt = np.where(bt > 0, inv[np.clip(bt, 0, used - 1)], 0)

    builder = TokenspeedMLAMetadataBuilder(block_size=BLOCK, num_speculative_tokens=num_speculative_tokens,
                                           chunked_prefill_workspace_size=workspace or 64 * 1024,
                                           nonuniform_decode=nonuniform_decode, head_dim=L + R)
    pos = np.concatenate([np.arange(s - ql, s) for s, ql in zip(spec.seq_lens, spec.query_lens)]
                         + [np.zeros(pad_tokens, np.int64)])
    md = build_attention_metadata(pos, spec.query_lens, spec.seq_lens, bt, builder=builder)
    return Batch(spec, N, q, kv_c, k_pe, w, cache, bt, md, impl, scale)


def reference(b: Batch, *, latent: bool = False):
    """Per-request SDPA in float64 (MLA: keys ``q_nope . k_nope + q_pe . k_pe`` with ``k_nope = kv_c W_UK``,
    values ``kv_c W_UV``; computed in the absorbed form, which is the same sum).

    Returns ``(out [T, N, V], lse [T, N])`` or, with ``latent``, the absorbed output ``[T, N, L]``.
    """
    N = b.heads
    w = np.asarray(b.w_kv_b, np.float64).reshape(L, N, P + V)
    w_uk, w_uv = w[..., :P], w[..., P:]
    q = np.asarray(b.q, np.float64)
    outs, lses = [], []
    t0 = 0
    for i, (s, ql) in enumerate(zip(b.spec.seq_lens, b.spec.query_lens)):
        qi = q[t0:t0 + ql]
        t0 += ql
        kvc = np.asarray(b.kv_c[i], np.float64)
        kpe = np.asarray(b.k_pe[i], np.float64)
        qa = np.einsum("tnp,lnp->tnl", qi[..., :P], w_uk)
        sc = b.scale * (np.einsum("tnl,kl->tnk", qa, kvc) + np.einsum("tnr,kr->tnk", qi[..., P:], kpe))
        vis = np.arange(s)[None, :] < (s - ql + 1 + np.arange(ql))[:, None]  # bottom-right causal
        sc = np.where(vis[:, None, :], sc, -np.inf)
        m = sc.max(-1, keepdims=True)
        p = np.exp(sc - m)
        lsum = p.sum(-1)
        o_lat = np.einsum("tnk,kl->tnl", p, kvc) / lsum[..., None]
        outs.append(o_lat if latent else np.einsum("tnl,lnv->tnv", o_lat, w_uv))
        lses.append(m[..., 0] + np.log(lsum))
    return np.concatenate(outs), np.concatenate(lses)
