"""Static problem descriptions handed to backends.

A problem is a frozen, hashable description of one call: shapes, dtypes, static flags and the target
device.  Backends answer ``supports_decode(problem)`` / ``supports_prefill(problem)`` with ``None`` (can
run it) or a reason string, and kernel compile caches key on these (plus arch and library versions).
Runtime values (scales, lengths, tables) are never part of a problem.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

FP8_DTYPE = "float8_e4m3fn"
HALF_DTYPES = ("bfloat16", "float16")
KERNEL_DTYPES = HALF_DTYPES + (FP8_DTYPE,)
ALL_DTYPES = KERNEL_DTYPES + ("float32",)


def out_dtype_name(dtype: str) -> str:
    """Output dtype of the attention ops: FP8 input gives bf16, every other input keeps its dtype."""
    return "bfloat16" if dtype == FP8_DTYPE else dtype


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a call will run: the JAX platform and, for CUDA, the SM architecture and SM count."""

    platform: str  # "cpu", "cuda", "rocm", "tpu"
    arch: str | None = None  # "sm_90a", "sm_100a", "sm_103a", ... (CUDA only)
    num_sms: int | None = None

    def __str__(self) -> str:
        """``"cpu"``, ``"cuda sm_90a (132 SMs)"``: the form reason strings and messages use."""
        if self.platform != "cuda":
            return self.platform
        sms = f" ({self.num_sms} SMs)" if self.num_sms else ""
        return f"cuda {self.arch or '(arch unknown)'}{sms}"

    @property
    def sm(self) -> int | None:
        """Compute capability as an int (90, 100, 103, ...), or None off CUDA."""
        if not self.arch:
            return None
        return int("".join(c for c in self.arch.removeprefix("sm_") if c.isdigit()))


@dataclasses.dataclass(frozen=True)
class DecodeProblem:
    """One ``mla_decode`` call: q ``[batch, q_len, num_heads, head_dim]`` over a paged latent cache
    ``[num_pages, page_size, head_dim]`` addressed by a ``[batch, max_pages]`` block table."""

    batch: int
    q_len: int
    num_heads: int
    head_dim: int
    kv_lora_rank: int
    page_size: int
    num_pages: int
    max_pages: int
    dtype: str
    causal: bool
    return_lse: bool
    target: Target
    batch_invariant: bool = False  # mla_decode(batch_invariant=): a request's result independent of its batch

    @property
    def rope_dim(self) -> int:
        return self.head_dim - self.kv_lora_rank

    @property
    def rows(self) -> int:
        """Query rows sharing one KV stream per request: q_len * num_heads."""
        return self.q_len * self.num_heads

    @property
    def max_kv_len(self) -> int:
        """Static upper bound on any request's KV length (the block table's capacity)."""
        return self.max_pages * self.page_size

    @property
    def out_dtype(self) -> str:
        return out_dtype_name(self.dtype)


@dataclasses.dataclass(frozen=True)
class PrefillProblem:
    """One ``mla_prefill`` call: ragged q ``[num_q_tokens, num_q_heads, head_dim_qk]``, k/v
    ``[num_k_tokens, num_kv_heads, head_dim_qk | head_dim_v]`` split into ``batch`` requests."""

    batch: int
    num_q_tokens: int
    num_k_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    dtype: str
    causal: bool
    return_lse: bool
    max_seqlen_q: int | None
    max_seqlen_k: int | None
    target: Target

    @property
    def out_dtype(self) -> str:
        return out_dtype_name(self.dtype)

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def dtype_name(x) -> str:
    return jnp.dtype(x.dtype).name
