"""``TokenspeedMLABackend`` (vLLM's attention-backend surface) and ``TokenspeedMLAPrefillBackend``.

Capability answers are never hard-coded for DeepSeek-R1: ``supports_combination`` /
``validate_configuration`` build the :class:`~tokenspeed_jax.problems.DecodeProblem` and
:class:`~tokenspeed_jax.problems.PrefillProblem` of the configuration (the model's real kv_lora_rank,
rope dim, per-rank heads, decode query length, page size, dtype, target) and ask the registered
tokenspeed backends (:func:`tokenspeed_jax.backends.backend_reasons`); their reason strings are passed on.

Which tokenspeed backend serves a call (``tokenspeed_backend``):

* ``"auto"`` (default): the most preferred backend whose ``supports`` accepts the call, except that on a
  CUDA target the ``xla`` reference is not used (a serving stack asking for TOKENSPEED_MLA on a GPU must
  get a kernel or a reason, never a silent reference fallback).  Off CUDA (CPU, TPU) ``auto`` is ``xla``.
* a backend name (``"xla"``, ``"sm90"``, ``"sm100"``): that backend or the reason it cannot run.

The resolved name is passed to ``mla_decode`` / ``mla_prefill`` explicitly, so the call runs on
exactly the backend the capability answer named.
"""

from __future__ import annotations

from typing import Any, ClassVar

from tokenspeed_jax.backends import all_backends, backend_reasons
from tokenspeed_jax.decode import PAGE_SIZES
from tokenspeed_jax.decode import contract_reason as decode_limits
from tokenspeed_jax.prefill import contract_reason as prefill_limits
from tokenspeed_jax.problems import FP8_DTYPE, DecodeProblem, PrefillProblem, Target
from tokenspeed_jax.runtime import arch_from_capability, current_target, target_override
from tokenspeed_jax.vllm.config import DeviceCapability, MLAModelConfig, dtype_name, get_current_mla_config

FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")


def kv_cache_kernel_dtype(kv_cache_dtype: str | None, model_dtype: str) -> str:
    """The array dtype of the cache (and of the decode query) for a vLLM ``kv_cache_dtype`` string."""
    if kv_cache_dtype in (None, "auto"):
        return model_dtype
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        return FP8_DTYPE
    return dtype_name(kv_cache_dtype)


def target_for(device_capability: DeviceCapability | tuple[int, int] | Target | None) -> Target:
    """The tokenspeed :class:`Target` of a device capability (None: the current target)."""
    if device_capability is None:
        return current_target()
    if isinstance(device_capability, Target):
        return device_capability
    major, minor = device_capability
    with target_override(arch_from_capability(int(major), int(minor))) as t:
        return t


def resolve_kernel_backend(op: str, problem: DecodeProblem | PrefillProblem,
                           requested: str = "auto") -> tuple[str | None, str | None]:
    """``(backend name, None)`` if a tokenspeed backend can run ``op`` on ``problem``, else
    ``(None, reason)`` quoting every backend's own reason (module docstring for ``"auto"``)."""
    # The op's own static limits first (heads, query tokens, page size, ...): backends answer only for
    # calls the op accepts, so a configuration the op would refuse is refused here, with the op's reason.
    limit = (decode_limits if op == "decode" else prefill_limits)(problem)
    if limit is not None:
        return None, f"mla_{op} cannot run MLA {op} for {_describe(problem)}: {limit}"
    reasons = backend_reasons(op, problem)
    on_cuda = problem.target.platform == "cuda"
    if requested == "auto":
        for name, r in reasons.items():
            if r is None and not (on_cuda and name == "xla"):
                return name, None
        detail = "; ".join(
            f"{n}: {'reference only, not chosen by auto on CUDA' if (n == 'xla' and on_cuda and r is None) else r}"
            for n, r in reasons.items()
        )
        return None, f"no tokenspeed backend can run MLA {op} for {_describe(problem)} ({detail})"
    if requested not in reasons:
        return None, f"unknown tokenspeed backend {requested!r} (registered: {sorted(reasons)})"
    r = reasons[requested]
    if r is None:
        return requested, None
    return None, f"tokenspeed backend {requested!r} cannot run MLA {op} for {_describe(problem)}: {r}"


def _describe(p) -> str:
    where = p.target.arch or p.target.platform
    if isinstance(p, DecodeProblem):
        return (f"{p.num_heads} heads x {p.q_len} query tokens, kv_lora_rank {p.kv_lora_rank}, rope "
                f"{p.rope_dim}, page {p.page_size}, {p.dtype} on {where}")
    return f"{p.num_q_heads} heads, qk {p.head_dim_qk} / v {p.head_dim_v}, {p.dtype} on {where}"


def decode_problem(cfg: MLAModelConfig, *, dtype: str, page_size: int, target: Target, q_len: int | None = None,
                   return_lse: bool = False, batch: int = 1, num_pages: int = 1,
                   max_pages: int = 1) -> DecodeProblem:
    """The decode call a model with ``cfg`` makes (capability queries use batch/pages of 1: static
    support does not depend on them)."""
    return DecodeProblem(
        batch=batch, q_len=cfg.decode_query_len if q_len is None else q_len, num_heads=cfg.num_heads,
        head_dim=cfg.head_size, kv_lora_rank=cfg.kv_lora_rank, page_size=page_size, num_pages=num_pages,
        max_pages=max_pages, dtype=dtype, causal=True, return_lse=return_lse, target=target,
    )


def prefill_problem(cfg: MLAModelConfig, *, dtype: str, target: Target, return_lse: bool = True,
                    causal: bool = True) -> PrefillProblem:
    """The (non-absorbed) prefill call of a model with ``cfg``; chunked context needs the LSE."""
    return PrefillProblem(
        batch=1, num_q_tokens=1, num_k_tokens=1, num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_heads,
        head_dim_qk=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, head_dim_v=cfg.v_head_dim, dtype=dtype,
        causal=causal, return_lse=return_lse, max_seqlen_q=None, max_seqlen_k=None, target=target,
    )


NO_CONFIG_REASON = (
    "TOKENSPEED_MLA needs the model's MLA dims to answer (kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, "
    "v_head_dim, heads per rank, speculative tokens): pass model_config= or call inside "
    "tokenspeed_jax.vllm.set_current_mla_config(...)"
)


class TokenspeedMLABackend:
    """The ``TOKENSPEED_MLA`` attention backend (vLLM's ``AttentionBackend`` surface, class methods only)."""

    accept_output_buffer: ClassVar[bool] = True
    supported_dtypes: ClassVar[list[str]] = ["float16", "bfloat16"]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "bfloat16", "fp8", "fp8_e4m3"]
    tokenspeed_backend: ClassVar[str] = "auto"

    # ------------------------------------------------------------------------------------- identity
    @staticmethod
    def get_name() -> str:
        return "TOKENSPEED_MLA"

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @staticmethod
    def get_impl_cls():
        # By qualified name, as vLLM's registry resolves backends: impl.py imports this module (its checks
        # and the prefill backend), so importing impl here would close an import circle.
        return _resolve("tokenspeed_jax.vllm.impl.TokenspeedMLAImpl")

    @staticmethod
    def get_builder_cls():
        from tokenspeed_jax.vllm.builder import TokenspeedMLAMetadataBuilder

        return TokenspeedMLAMetadataBuilder

    @staticmethod
    def get_metadata_cls():
        from tokenspeed_jax.vllm.metadata import MLACommonMetadata

        return MLACommonMetadata

    # -------------------------------------------------------------------------------------- layout
    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        """Page sizes of the ``mla_decode`` contract; the kernel page size is the cache block size."""
        return list(PAGE_SIZES)

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, int, int]:
        """``(num_blocks, block_size, head_size)``: one latent row ``[kv_c | k_pe]`` per token."""
        if num_kv_heads != 1:
            raise ValueError(f"num_kv_heads: expected 1 (MLA has one latent KV head), got {num_kv_heads}")
        if block_size not in PAGE_SIZES:
            raise ValueError(f"block_size: expected one of {list(PAGE_SIZES)}, got {block_size}")
        if cache_dtype_str not in TokenspeedMLABackend.supported_kv_cache_dtypes:
            raise ValueError(f"cache_dtype_str: expected one of {TokenspeedMLABackend.supported_kv_cache_dtypes}, "
                             f"got {cache_dtype_str!r}")
        return (num_blocks, block_size, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        return (0, 1, 2, 3) if include_num_layers_dimension else (0, 1, 2)

    # --------------------------------------------------------------------------------- capability
    @classmethod
    def supports_dtype(cls, dtype) -> bool:
        return dtype_name(dtype) in cls.supported_dtypes

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: str | None) -> bool:
        return kv_cache_dtype is None or kv_cache_dtype in cls.supported_kv_cache_dtypes

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or block_size in cls.get_supported_kernel_block_sizes()

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability | tuple[int, int] | None) -> bool:
        """Coarse filter only (no shapes are known here): any non-CUDA platform (None) runs the ``xla``
        reference; on CUDA, ``tokenspeed_backend="xla"`` runs anywhere and kernels need SM90 or newer.
        The precise answer, from the real backends, is :meth:`supports_combination`."""
        if capability is None or cls.tokenspeed_backend == "xla":
            return True
        return int(capability[0]) >= 9

    @classmethod
    def supports_combination(cls, head_size: int, dtype, kv_cache_dtype: str | None, block_size: int | None,
                             use_mla: bool, has_sink: bool, use_sparse: bool,
                             device_capability: DeviceCapability | tuple[int, int] | None, *,
                             model_config: MLAModelConfig | None = None,
                             tokenspeed_backend: str | None = None) -> str | None:
        """None if the tokenspeed backends can run this model's decode and prefill, else the reason."""
        cfg = model_config if model_config is not None else get_current_mla_config()
        if cfg is None:
            return NO_CONFIG_REASON
        if head_size != cfg.head_size:
            return (f"head_size {head_size} does not match the model's kv_lora_rank + qk_rope_head_dim = "
                    f"{cfg.kv_lora_rank} + {cfg.qk_rope_head_dim} = {cfg.head_size}")
        if not cls.supports_dtype(dtype) or not cls.supports_kv_cache_dtype(kv_cache_dtype):
            return None  # reported by validate_configuration's own checks
        model = dtype_name(dtype)
        cache = kv_cache_kernel_dtype(kv_cache_dtype, model)
        if cache != FP8_DTYPE and cache != model:
            return (f"kv_cache_dtype {kv_cache_dtype!r} stores {cache} but the model dtype is {model}: TOKENSPEED "
                    f"decode reads q and the cache in one dtype (use 'auto', or fp8)")
        requested = tokenspeed_backend or cls.tokenspeed_backend
        target = target_for(device_capability)
        sizes = [block_size] if block_size is not None else cls.get_supported_kernel_block_sizes()
        decode_reason = None
        for ps in sizes:
            if ps not in cls.get_supported_kernel_block_sizes():
                return None  # reported by validate_configuration's block_size check
            _, decode_reason = resolve_kernel_backend(
                "decode", decode_problem(cfg, dtype=cache, page_size=ps, target=target), requested)
            if decode_reason is None:
                break
        if decode_reason is not None:
            return decode_reason
        _, prefill_reason = resolve_kernel_backend(
            "prefill", prefill_problem(cfg, dtype=model, target=target), requested)
        return prefill_reason

    @classmethod
    def validate_configuration(cls, head_size: int, dtype, kv_cache_dtype: str | None, block_size: int | None,
                               use_mla: bool, has_sink: bool, use_sparse: bool,
                               device_capability: DeviceCapability | tuple[int, int] | None,
                               attn_type: str = "decoder", *, model_config: MLAModelConfig | None = None,
                               tokenspeed_backend: str | None = None) -> list[str]:
        """Every reason this backend cannot serve the configuration (empty list: it can)."""
        reasons: list[str] = []
        if not cls.supports_dtype(dtype):
            reasons.append(f"dtype {_safe_dtype(dtype)} not supported (supported: {cls.supported_dtypes})")
        if not cls.supports_kv_cache_dtype(kv_cache_dtype):
            reasons.append(f"kv_cache_dtype {kv_cache_dtype!r} not supported (supported: "
                           f"{cls.supported_kv_cache_dtypes})")
        if not cls.supports_block_size(block_size):
            reasons.append(f"block_size {block_size} not supported (supported: "
                           f"{cls.get_supported_kernel_block_sizes()})")
        if not use_mla:
            reasons.append("non-MLA not supported")
        if has_sink:
            reasons.append("attention sinks not supported")
        if use_sparse:
            reasons.append("sparse not supported")
        if not cls.supports_compute_capability(device_capability):
            reasons.append(f"compute capability {_cap_str(device_capability)} not supported (TOKENSPEED kernels "
                           f"need SM90 or newer)")
        if attn_type != "decoder":
            reasons.append(f"attention type {attn_type} not supported")
        combo = cls.supports_combination(head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink,
                                         use_sparse, device_capability, model_config=model_config,
                                         tokenspeed_backend=tokenspeed_backend)
        if combo is not None:
            reasons.append(combo)
        return reasons

    @classmethod
    def get_required_kv_cache_layout(cls):
        return None


def _resolve(qualname: str) -> Any:
    """The object at ``module.attr`` (vLLM's ``resolve_obj_by_qualname``)."""
    import importlib

    module, _, attr = qualname.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _safe_dtype(d) -> str:
    try:
        return dtype_name(d)
    except TypeError:
        return repr(d)


def _cap_str(c) -> str:
    return "none" if c is None else f"{int(c[0])}.{int(c[1])}"


class TokenspeedMLAPrefillBackend:
    """The ``TOKENSPEED_MLA`` MLA prefill backend (vLLM's ``MLAPrefillBackend`` surface).

    Runs non-absorbed ragged attention through :func:`tokenspeed_jax.mla_prefill`.  LSE layout differs
    from vLLM's prefill backends: ``[T, H]`` (token-major, what :func:`tokenspeed_jax.merge_attn_states`
    takes) instead of FlashAttention's ``[H, T]``; natural log, like FlashAttention.
    """

    supported_dtypes: ClassVar[list[str]] = ["float16", "bfloat16"]
    tokenspeed_backend: ClassVar[str] = "auto"

    @staticmethod
    def get_name() -> str:
        return "TOKENSPEED_MLA"

    @classmethod
    def supports_compute_capability(cls, device_capability) -> bool:
        return TokenspeedMLABackend.supports_compute_capability(device_capability)

    @classmethod
    def supports_dtype(cls, dtype) -> bool:
        return dtype_name(dtype) in cls.supported_dtypes

    @classmethod
    def is_available(cls) -> bool:
        return bool(all_backends())

    @classmethod
    def validate_configuration(cls, device_capability, dtype, *, model_config: MLAModelConfig | None = None,
                               tokenspeed_backend: str | None = None) -> list[str]:
        reasons = []
        if not cls.supports_compute_capability(device_capability):
            reasons.append(f"compute capability {_cap_str(device_capability)} not supported")
        if not cls.supports_dtype(dtype):
            reasons.append(f"dtype {_safe_dtype(dtype)} not supported (supported: {cls.supported_dtypes})")
            return reasons
        cfg = model_config if model_config is not None else get_current_mla_config()
        if cfg is None:
            reasons.append(NO_CONFIG_REASON)
            return reasons
        _, r = resolve_kernel_backend(
            "prefill", prefill_problem(cfg, dtype=dtype_name(dtype), target=target_for(device_capability)),
            tokenspeed_backend or cls.tokenspeed_backend)
        if r is not None:
            reasons.append(r)
        return reasons

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, vllm_config: Any = None, *,
                 tokenspeed_backend: str | None = None) -> None:
        self.num_heads = num_heads
        self.scale = float(scale)
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.tokenspeed_backend = tokenspeed_backend or type(self).tokenspeed_backend
        self._prefill_metadata = None

    def prepare_metadata(self, prefill_metadata) -> None:
        """Install the metadata the ``run_prefill_*`` calls read (vLLM's surface).  Under ``jax.jit`` the
        metadata holds tracers: reset it (``prepare_metadata(None)``) before the trace ends, as
        ``TokenspeedMLAImpl.forward_mha`` does."""
        self._prefill_metadata = prefill_metadata

    def _run(self, q, k, v, cu_q, cu_k, *, causal, return_lse, max_q, max_k):
        from tokenspeed_jax.prefill import mla_prefill

        problem = PrefillProblem(
            batch=cu_q.shape[0] - 1, num_q_tokens=q.shape[0], num_k_tokens=k.shape[0], num_q_heads=q.shape[1],
            num_kv_heads=k.shape[1], head_dim_qk=q.shape[2], head_dim_v=v.shape[2], dtype=dtype_name(q.dtype),
            causal=causal, return_lse=return_lse, max_seqlen_q=max_q, max_seqlen_k=max_k,
            target=current_target(),
        )
        name, reason = resolve_kernel_backend("prefill", problem, self.tokenspeed_backend)
        if reason is not None:
            raise ValueError(f"backend: {reason}")
        return mla_prefill(q, k, v, cu_q, cu_k, softmax_scale=self.scale, causal=causal, return_lse=return_lse,
                           max_seqlen_q=max_q, max_seqlen_k=max_k, backend=name)

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse: bool):
        """Causal attention of the prefill tokens among themselves: ``out [T, H, Dv]`` (and LSE
        ``[T, H]``)."""
        md = self._prefill_metadata
        if md is None:
            raise ValueError("prefill_metadata: call prepare_metadata() before running prefill")
        return self._run(q, k, v, md.query_start_loc, md.query_start_loc, causal=True,
                         return_lse=return_softmax_lse, max_q=md.max_query_len, max_k=md.max_query_len)

    def run_prefill_context_chunk(self, chunk_idx: int, q, k, v):
        """Non-causal attention of the prefill tokens over context chunk ``chunk_idx``: ``(out, lse)``."""
        md = self._prefill_metadata
        if md is None or md.chunked_context is None:
            raise ValueError("prefill_metadata: no chunked context prepared")
        ch = md.chunked_context[chunk_idx]
        return self._run(q, k, v, md.query_start_loc, ch.cu_seq_lens, causal=False, return_lse=True,
                         max_q=md.max_query_len, max_k=max(1, ch.max_seq_len))
