"""Model facts the capability queries need, and the device-capability type.

vLLM's backends read the model's MLA dims from ``get_current_vllm_config()``.  The adapter has no
VllmConfig; :class:`MLAModelConfig` carries the same facts (from the HF config: ``kv_lora_rank``,
``qk_rope_head_dim``, ``qk_nope_head_dim``, ``v_head_dim``, ``num_attention_heads``; from the engine:
tensor-parallel size, speculative tokens, model dtype) and :func:`set_current_mla_config` makes it current,
the way ``set_current_vllm_config`` does.  Capability answers are computed from these real values.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import NamedTuple

import jax.numpy as jnp


class DeviceCapability(NamedTuple):
    """CUDA compute capability (vLLM's ``DeviceCapability``)."""

    major: int
    minor: int

    def to_int(self) -> int:
        return self.major * 10 + self.minor

    def as_version_str(self) -> str:
        return f"{self.major}.{self.minor}"


def dtype_name(dtype) -> str:
    """``jnp.bfloat16`` / ``"bfloat16"`` / ``"bf16"`` / numpy dtypes -> the canonical numpy name."""
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}
    if isinstance(dtype, str):
        dtype = aliases.get(dtype, dtype)
    return jnp.dtype(dtype).name


@dataclasses.dataclass(frozen=True)
class MLAModelConfig:
    """The MLA facts of one model instance (all counts are totals; per-rank values are properties)."""

    num_attention_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    tensor_parallel_size: int = 1
    num_speculative_tokens: int = 0
    dtype: str = "bfloat16"

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "dtype":
                object.__setattr__(self, "dtype", dtype_name(v))
                continue
            low = 0 if f.name == "num_speculative_tokens" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{f.name}: expected an int >= {low}, got {v!r}")
        if self.num_attention_heads % self.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size: expected a divisor of num_attention_heads = "
                f"{self.num_attention_heads}, got {self.tensor_parallel_size}"
            )

    @property
    def num_heads(self) -> int:
        """Heads per tensor-parallel rank (what one attention call sees)."""
        return self.num_attention_heads // self.tensor_parallel_size

    @property
    def head_size(self) -> int:
        """Latent cache row width ``kv_lora_rank + qk_rope_head_dim`` (vLLM's MLA head_size)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def decode_query_len(self) -> int:
        return 1 + self.num_speculative_tokens


_current: contextvars.ContextVar[MLAModelConfig | None] = contextvars.ContextVar("tokenspeed_mla_config",
                                                                                  default=None)


def get_current_mla_config() -> MLAModelConfig | None:
    return _current.get()


@contextlib.contextmanager
def set_current_mla_config(config: MLAModelConfig):
    """Make ``config`` current for capability queries inside the block."""
    if not isinstance(config, MLAModelConfig):
        raise TypeError(f"config: expected MLAModelConfig, got {type(config).__name__}")
    token = _current.set(config)
    try:
        yield config
    finally:
        _current.reset(token)
