"""The ``sm100`` backend (Blackwell B200/B300, GB200/GB300): the TokenSpeed MLA kernels as XLA FFI calls.

Decode runs TokenSpeed's ``BlackwellMultiHeadLatentAttentionForwardFP16`` (BF16/FP16) or ``...FP8``
(float8_e4m3fn in, BF16 out) class with its split-KV reduction; prefill runs its FMHA forward class
(``BlackwellFusedMultiHeadAttentionForward``, ragged varlen, Dqk 192 / Dv 128).  The classes come from the
``tokenspeed-mla`` package and are driven by our own ``@cute.jit`` launch functions
(:mod:`tokenspeed_jax.kernels.sm100`) through :func:`tokenspeed_jax.ffi.custom_call`, as the custom calls
``tokenspeed_mla_decode_sm100`` and ``tokenspeed_mla_prefill_sm100``.

What this module adds around the kernels, so that the calls meet the ``mla_decode`` / ``mla_prefill``
contracts (decode.py / prefill.py docstrings), with one extra precondition (finite tails, below):

* scales are operands: ``softmax_scale`` / ``output_scale`` are shape-(1,) float32 device buffers read by
  the kernels (:mod:`tokenspeed_jax.kernels.sm100.runtime_scalars`), never compile-time values;
* LSE: TokenSpeed's decode LSE is base 2; it is multiplied by ``ln 2`` (``-inf`` stays ``-inf``).  The
  prefill class already writes natural-log LSE;
* runtime data safety: ``seq_lens`` is clamped to ``[0, max_pages * page_size]`` and block-table
  entries to ``[0, num_pages)``; the table is widened to whole 128-token tiles and every entry past the
  pages a request uses is replaced by its last used page (:func:`decode_tables`), so no page a request
  does not own is ever read.  TokenSpeed loads whole 128-token KV tiles and multiplies the zero
  probabilities of masked keys by their V rows, so **the rows past ``seq_len`` inside a request's own
  last page must hold finite values** (any value: stale cache rows, zeros), and in prefill **k/v rows
  past ``cu_seqlens_k[-1]`` within 127 rows of it must be finite**: NaN/Inf there would reach the
  output (the decode contract's "pages it does not own may hold NaN" holds; finite tails is an extra
  precondition of this backend, documented in docs/sm100.md);
* empty rows: under the causal MTP mask a row ``i`` with ``seq_len - S + 1 + i <= 0`` sees no key.
  TokenSpeed masks with a finite ``-1e6``, so BF16/FP8 causal calls with ``S > 1`` pass
  ``local_visible_lens = clamp(seq_len - S + 1 + i, 0)`` (TokenSpeed's exact ``-inf`` mask with 0 / -inf
  for empty rows); FP16 (which TokenSpeed does not offer that input for) gets the 0 / -inf fix-up in
  XLA.  Prefill rows with no visible key or outside every request are set to 0 / -inf in XLA;
* workspace: the split-KV partials are one float32 buffer sized exactly by the plan
  (:func:`plan_sm100`), an extra output of the custom call, owned by XLA per call;
* SM count: from ``problem.target.num_sms`` (the device's multiprocessor count at run time).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import math
import pathlib

import jax
import jax.numpy as jnp

from tokenspeed_jax.kernels.sm100 import plan as P
from tokenspeed_jax.planner import DecodePlan, plan_sm100
from tokenspeed_jax.problems import FP8_DTYPE, KERNEL_DTYPES, DecodeProblem, PrefillProblem

INSTALL_HINT = "pip install 'tokenspeed-jax[sm100]'"
DECODE_TARGET = "mla_decode_sm100"
PREFILL_TARGET = "mla_prefill_sm100"
PAGE_SIZES = (16, 32, 64, 128)  # must divide TokenSpeed's 128-token KV tile
PREFILL_HEAD_DIMS = ((192, 128),)
MAX_HEADS = 128
LN2 = math.log(2.0)


@functools.cache
def missing_package() -> str | None:
    """A reason string when the kernels' Python packages are not importable, else None (no import)."""
    for module, dist in (("tokenspeed_mla", "tokenspeed-mla"), ("cutlass", "nvidia-cutlass-dsl"), ("torch", "torch")):
        if importlib.util.find_spec(module) is None:
            return f"the {dist} package is not installed ({INSTALL_HINT})"
    return None


@functools.cache
def tokenspeed_version() -> str:
    """tokenspeed-mla's version plus a digest of our kernel wrapper sources (part of the compile keys, so
    an upgrade of either invalidates the on-disk compile cache)."""
    try:
        version = importlib.metadata.version("tokenspeed-mla")
    except importlib.metadata.PackageNotFoundError:
        version = ""
    h = hashlib.sha256()
    for f in sorted(pathlib.Path(P.__file__).parent.glob("*.py")):
        h.update(f.read_bytes())
    return f"{version}+{h.hexdigest()[:12]}"


def _target_reason(target) -> str | None:
    if target.platform != "cuda" or not target.arch:
        return f"needs a CUDA Blackwell GPU (sm_100a / sm_103a), the call targets {target}"
    if target.arch not in P.SUPPORTED_ARCHS:
        return (
            f"arch {target.arch} is not supported by the TokenSpeed MLA kernels as built here "
            f"(supported: {', '.join(P.SUPPORTED_ARCHS)})"
        )
    return None


# Planning: tokenspeed_jax.planner.plan_sm100 (pure Python, beside the sm90 planner).


def _decode_plan(problem: DecodeProblem) -> DecodePlan:
    t = problem.target
    return plan_sm100(
        batch=problem.batch, q_len=problem.q_len, num_heads=problem.num_heads, max_kv_len=problem.max_kv_len,
        page_size=problem.page_size, dtype=problem.dtype, kv_lora_rank=problem.kv_lora_rank,
        rope_dim=problem.rope_dim, arch=t.arch, num_sms=t.num_sms or 148,
    )


def uses_visible_lens(problem: DecodeProblem) -> bool:
    """Whether the call passes ``local_visible_lens`` (causal MTP with BF16/FP8, see module docstring)."""
    return problem.causal and problem.q_len > 1 and problem.dtype in ("bfloat16", FP8_DTYPE)


def decode_config(problem: DecodeProblem, plan: DecodePlan | None = None):
    """The :class:`~tokenspeed_jax.kernels.sm100.decode.DecodeKernelConfig` of a call (imports CuTe DSL)."""
    from tokenspeed_jax.kernels.sm100.decode import DecodeKernelConfig

    plan = plan or _decode_plan(problem)
    extra = dict(plan.extra)
    return DecodeKernelConfig(
        arch=problem.target.arch, dtype=problem.dtype, page_size=problem.page_size,
        num_heads=problem.num_heads, q_len=problem.q_len, causal=problem.causal,
        return_lse=problem.return_lse, visible_lens=uses_visible_lens(problem), m_tile=plan.block_m,
        fold=plan.fold, pack_q=extra["pack_q"], splits=plan.num_splits,
        max_active_clusters=extra["max_active_clusters"], reducer_d_tiles=extra["reducer_d_tiles"],
        reducer_max_splits=min(extra["reducer_max_splits"], 256), tokenspeed_version=tokenspeed_version(),
    )


def prefill_config(problem: PrefillProblem):
    from tokenspeed_jax.kernels.sm100.prefill import PrefillKernelConfig

    return PrefillKernelConfig(
        arch=problem.target.arch, dtype=problem.dtype, batch=problem.batch, num_q_heads=problem.num_q_heads,
        num_kv_heads=problem.num_kv_heads, head_dim_qk=problem.head_dim_qk, head_dim_v=problem.head_dim_v,
        max_seqlen_q=problem.max_seqlen_q or problem.num_q_tokens,
        max_seqlen_k=problem.max_seqlen_k or problem.num_k_tokens,
        causal=problem.causal, return_lse=problem.return_lse, tokenspeed_version=tokenspeed_version(),
    )


# ------------------------------------------------------------------------------------------- backend
class Sm100Backend:
    name = "sm100"
    priority = 100

    def supports_decode(self, problem: DecodeProblem) -> str | None:
        reason = _target_reason(problem.target)
        if reason:
            return reason
        if problem.dtype not in KERNEL_DTYPES:
            return f"dtype {problem.dtype} not supported (supported: {', '.join(KERNEL_DTYPES)})"
        if problem.kv_lora_rank != P.LATENT_DIM:
            return f"kv_lora_rank {problem.kv_lora_rank} not supported (the TokenSpeed kernels need {P.LATENT_DIM})"
        if problem.rope_dim != P.ROPE_DIM:
            return (
                f"head dim {problem.head_dim} not supported (needs kv_lora_rank + rope_dim = "
                f"{P.LATENT_DIM} + {P.ROPE_DIM} = {P.LATENT_DIM + P.ROPE_DIM})"
            )
        if problem.page_size not in PAGE_SIZES:
            return f"page_size {problem.page_size} not supported (supported: {PAGE_SIZES}; it must divide 128)"
        if not 1 <= problem.num_heads <= MAX_HEADS:
            return f"num_heads {problem.num_heads} not supported (1..{MAX_HEADS})"
        if problem.q_len < 1:
            return f"q_len {problem.q_len} not supported (>= 1)"
        plan = _decode_plan(problem)
        if plan.workspace_bytes >= P.WORKSPACE_LIMIT:
            return f"split-KV workspace of {plan.workspace_bytes} bytes exceeds the kernel's int32 offsets"
        return missing_package()

    def supports_prefill(self, problem: PrefillProblem) -> str | None:
        reason = _target_reason(problem.target)
        if reason:
            return reason
        if problem.dtype not in KERNEL_DTYPES:
            return f"dtype {problem.dtype} not supported (supported: {', '.join(KERNEL_DTYPES)})"
        dims = (problem.head_dim_qk, problem.head_dim_v)
        if dims not in PREFILL_HEAD_DIMS:
            return f"head dims (Dqk, Dv) = {dims} not supported (supported: {PREFILL_HEAD_DIMS})"
        if problem.num_q_tokens < 1 or problem.num_k_tokens < 1:
            return "empty q or k/v arrays are not supported (use the xla backend)"
        return missing_package()

    # ------------------------------------------------------------------------------------- decode
    def decode(self, problem, q, kv_cache, block_table, seq_lens, softmax_scale, output_scale):
        from tokenspeed_jax import ffi
        from tokenspeed_jax.kernels.sm100.decode import launch_decode

        plan = _decode_plan(problem)
        cfg = decode_config(problem, plan)
        B, S, H = problem.batch, problem.q_len, problem.num_heads
        sl, bt = decode_tables(problem, block_table, seq_lens)
        inputs = [q, kv_cache, bt, sl, jnp.reshape(softmax_scale, (1,)), jnp.reshape(output_scale, (1,))]
        if cfg.visible_lens:
            inputs.append(jnp.maximum(visible_keys(sl, S), 0))
        outputs = [jax.ShapeDtypeStruct((B, S, H, problem.kv_lora_rank), jnp.dtype(problem.out_dtype))]
        if problem.return_lse:
            outputs.append(jax.ShapeDtypeStruct((B, S, H), jnp.float32))
        outputs += [jax.ShapeDtypeStruct(w.shape, jnp.dtype(w.dtype)) for w in plan.workspace]
        res = ffi.custom_call(
            DECODE_TARGET, launch_decode, outputs=outputs, compile_key=cfg,
            library_versions=("tokenspeed-mla",), config=cfg,
        )(*inputs)
        return finish_decode(problem, res[0], res[1] if problem.return_lse else None, sl,
                             fix_empty_rows=problem.causal and S > 1 and not cfg.visible_lens)

    # ------------------------------------------------------------------------------------ prefill
    def prefill(self, problem, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale):
        from tokenspeed_jax import ffi
        from tokenspeed_jax.kernels.sm100.prefill import launch_prefill

        cfg = prefill_config(problem)
        Tq, Hq, Tk = problem.num_q_tokens, problem.num_q_heads, problem.num_k_tokens
        cu_q = jnp.clip(cu_seqlens_q.astype(jnp.int32), 0, Tq)
        cu_k = jnp.clip(cu_seqlens_k.astype(jnp.int32), 0, Tk)
        outputs = [jax.ShapeDtypeStruct((Tq, Hq, problem.head_dim_v), jnp.dtype(problem.out_dtype))]
        if problem.return_lse:
            outputs.append(jax.ShapeDtypeStruct((Tq, Hq), jnp.float32))
        res = ffi.custom_call(
            PREFILL_TARGET, launch_prefill, outputs=outputs, compile_key=cfg,
            library_versions=("tokenspeed-mla",), config=cfg,
        )(q, k, v, cu_q, cu_k, jnp.reshape(softmax_scale, (1,)))
        valid = prefill_rows_with_keys(cu_q, cu_k, Tq, causal=problem.causal)
        out = jnp.where(valid[:, None, None], res[0], jnp.zeros((), res[0].dtype))
        lse = jnp.where(valid[:, None], res[1], -jnp.inf) if problem.return_lse else None
        return out, lse


# ------------------------------------------------------------------------ XLA-side pre/post-processing
def decode_tables(problem: DecodeProblem, block_table, seq_lens):
    """Clamped ``seq_lens`` [B] and the block table the kernel reads, ``[B, cols]`` int32.

    ``cols`` rounds ``max_pages`` up to whole 128-token KV tiles (the kernel reads the table per tile
    and would substitute page 0 for columns past its end).  Entries are clamped to ``[0, num_pages)``
    and every column past the pages a request uses points at its last used page (page-granular
    NaN safety; see the module docstring).
    """
    ps, max_pages = problem.page_size, problem.max_pages
    sl = jnp.clip(seq_lens.astype(jnp.int32), 0, problem.max_kv_len)
    bt = jnp.clip(block_table.astype(jnp.int32), 0, problem.num_pages - 1)
    used = (sl + ps - 1) // ps
    last = jnp.take_along_axis(bt, jnp.clip(used - 1, 0, max_pages - 1)[:, None], axis=1)
    per_tile = P.BLOCK_N // ps
    cols = P.ceil_div(max_pages, per_tile) * per_tile
    bt = jnp.pad(bt, ((0, 0), (0, cols - max_pages)))
    bt = jnp.where(jnp.arange(cols, dtype=jnp.int32)[None, :] < used[:, None], bt, last)
    return sl, bt


def visible_keys(seq_lens, q_len: int):
    """``[B, S]`` int32: keys query token ``i`` sees under the causal MTP mask (``<= 0``: none)."""
    return seq_lens[:, None] - q_len + 1 + jnp.arange(q_len, dtype=jnp.int32)[None, :]


def finish_decode(problem: DecodeProblem, out, lse2, seq_lens, *, fix_empty_rows: bool):
    """Kernel outputs -> contract outputs: base-2 LSE to natural log (``* ln 2``; ``-inf`` stays), and,
    with ``fix_empty_rows``, causal rows that see no key set to 0 / ``-inf``."""
    lse = None if lse2 is None else lse2 * jnp.float32(LN2)
    if fix_empty_rows:
        empty = visible_keys(seq_lens, problem.q_len) <= 0
        out = jnp.where(empty[:, :, None, None], jnp.zeros((), out.dtype), out)
        if lse is not None:
            lse = jnp.where(empty[:, :, None], -jnp.inf, lse)
    return out, lse


def prefill_rows_with_keys(cu_q, cu_k, num_q_tokens: int, *, causal: bool):
    """``[Tq]`` bool: q rows inside a request that see at least one key (bottom-right causal)."""
    batch = cu_q.shape[0] - 1
    t = jnp.arange(num_q_tokens, dtype=jnp.int32)
    seg = jnp.searchsorted(cu_q[1:], t, side="right").astype(jnp.int32)
    segc = jnp.clip(seg, 0, batch - 1)
    len_q = jnp.take(cu_q[1:] - cu_q[:-1], segc)
    len_k = jnp.take(cu_k[1:] - cu_k[:-1], segc)
    pos = t - jnp.take(cu_q[:-1], segc)
    valid = (seg < batch) & (t >= cu_q[0]) & (len_k > 0)
    if causal:
        valid &= pos + len_k - len_q >= 0
    return valid


BACKEND = Sm100Backend()
