"""vLLM-compatible adapter: the ``TOKENSPEED_MLA`` backend surface over the public tokenspeed_jax ops.

Names and semantics mirror vLLM's V1 MLA backend interface (``AttentionBackendEnum``,
``CommonAttentionMetadata``, ``MLACommonMetadata``, the metadata builder, ``forward_mqa`` /
``forward_mha`` / ``do_kv_cache_update``) with JAX arrays and pytree metadata; :mod:`.runner` adds a
tpu-inference-style per-layer function.  ``docs/vllm.md`` maps every element and lists the differences.
"""

from tokenspeed_jax.vllm.backend import (
    TokenspeedMLABackend,
    TokenspeedMLAPrefillBackend,
    resolve_kernel_backend,
)
from tokenspeed_jax.vllm.builder import QueryLenSupport, TokenspeedMLAMetadataBuilder
from tokenspeed_jax.vllm.config import (
    DeviceCapability,
    MLAModelConfig,
    get_current_mla_config,
    set_current_mla_config,
)
from tokenspeed_jax.vllm.impl import TokenspeedMLAImpl, lse_base2_to_natural, lse_natural_to_base2
from tokenspeed_jax.vllm.metadata import (
    CommonAttentionMetadata,
    ContextChunk,
    MLACommonDecodeMetadata,
    MLACommonMetadata,
    MLACommonPrefillMetadata,
)
from tokenspeed_jax.vllm.registry import (
    AttentionBackendEnum,
    MLAPrefillBackendEnum,
    get_attn_backend,
    get_backend_priorities,
    get_mla_prefill_backend,
    register_backend,
    register_mla_prefill_backend,
    set_backend_priorities,
)
from tokenspeed_jax.vllm.runner import AttentionMetadata, build_attention_metadata, mla_attention

__all__ = [
    "AttentionBackendEnum",
    "AttentionMetadata",
    "CommonAttentionMetadata",
    "ContextChunk",
    "DeviceCapability",
    "MLACommonDecodeMetadata",
    "MLACommonMetadata",
    "MLACommonPrefillMetadata",
    "MLAModelConfig",
    "MLAPrefillBackendEnum",
    "QueryLenSupport",
    "TokenspeedMLABackend",
    "TokenspeedMLAImpl",
    "TokenspeedMLAMetadataBuilder",
    "TokenspeedMLAPrefillBackend",
    "build_attention_metadata",
    "get_attn_backend",
    "get_backend_priorities",
    "get_current_mla_config",
    "get_mla_prefill_backend",
    "lse_base2_to_natural",
    "lse_natural_to_base2",
    "mla_attention",
    "register_backend",
    "register_mla_prefill_backend",
    "resolve_kernel_backend",
    "set_backend_priorities",
    "set_current_mla_config",
]
