"""``mla_prefill`` on Hopper (sm_90a): FlashAttention-4's CuTe DSL forward as the custom call
``tokenspeed_mla_prefill_sm90``.

Semantics are exactly :mod:`tokenspeed_jax.prefill`'s; the kernel is
:class:`tokenspeed_jax.kernels.sm90.fa4_prefill.FA4PrefillSm90` (FA4's ``FlashAttentionForwardSm90`` with
its softmax scale read from device memory) followed by our ``rows_without_keys_kernel``, see that module.
Decisions:

* **softmax_scale stays a runtime operand.** FA4 takes it as a host float; the kernel subclass reads it
  from the ``(1,)`` float32 operand instead (one load per thread), so a new value neither recompiles
  nor breaks CUDA-graph capture, and the arithmetic (``scale * log2(e)`` in fp32) is FA4's own.
* **Rows with no visible key** (rows past ``cu_seqlens_q[-1]``, requests with ``Lk = 0``, bottom-right causal
  rows ``i < Lq - Lk``) give 0 and LSE -inf. FA4 leaves the first unwritten and, for a tile that sees no key,
  still processes one out-of-range K/V block whose columns are not all masked, so it may write a softmax over
  another request's keys there. The same custom call launches, after FA4's kernel and on the same stream, a
  small kernel of ours that finds each row's request by binary search over ``cu_seqlens_q`` and overwrites
  exactly those rows (at S=8192 the clip below and this kernel together add about 20 µs a call,
  docs/sm90_prefill.md; the alternatives measured and deleted are in docs/sm90_prefill_rejected.md). cu_seqlens
  are clipped to ``[0, Tq]`` / ``[0, Tk]`` in one tiny fused XLA op (clamp, not trap: garbage lengths stay in
  bounds).
* **K/V rows past ``cu_seqlens_k[-1]`` are made finite here, by construction** (:func:`finite_v_tail`).
  FA4 loads whole ``tile_n``-row K/V tiles (``tile_n`` <= 128 for every head-dim pair here) by TMA, so it
  reads up to ``KV_TAIL_ROWS`` = 127 rows past ``cu_seqlens_k[-1]``, the caller's padding, and multiplies
  their V by probabilities that are exactly 0; ``0 * NaN`` in the P@V tensor-core product would turn NaN/Inf
  there into NaN outputs of the last request.  (K rows are harmless: masked scores are replaced by -inf
  before the softmax.)  Before the call the ``KV_TAIL_ROWS`` V rows from ``cu_seqlens_k[-1]`` on are set to
  0 with a dynamic slice / select / dynamic-update-slice of ``KV_TAIL_ROWS x Hk x Dv`` elements: XLA does
  that in place when V is an intermediate of the same jit (the model's and the vLLM adapter's V is the
  ``kv_b_proj`` up-projection), and copies V once when V is a non-donated jit argument (about 4% at S=8192,
  the price of the guarantee; donate V to avoid it).  Rejected alternatives: bounding the TMA descriptor at
  ``cu_seqlens_k[-1]`` needs that device value on the host (a sync, no CUDA graphs); zeroing the tail in
  shared memory means re-implementing FA4's consumer loop for the one partial tile.  Inside the buffer the
  rows past a request's end belong to the next request: a non-finite V row there may still reach the rows of
  every request whose tiles cover it (contract in :mod:`tokenspeed_jax.prefill`).
* **LSE** is written by FA4 straight into our ``[Tq, Hq]`` layout through a transposed view; it is
  already the natural log. Without ``return_lse`` no LSE is computed.
* **FP8 e4m3 inputs** are upcast to bf16 before the call (exact: every e4m3 value is a bf16 value),
  which costs one read of the fp8 tensors and one bf16 write+read (about 3 bytes per element of q, k, v);
  see ``benchmarks/prefill.py``. FA4 has no Hopper FP8 forward; a native FP8 kernel (FA3-style
  e4m3 WGMMA with V transposed in shared memory) would halve the K/V bytes and double the tensor-core
  rate, which matters for long-context prefill.
* **One compile for all token counts and batch sizes**: operand extents are read at run time
  (``ffi.custom_call(..., dynamic_shapes=True)`` with explicit divisibility hints), so the compile key
  is (dtype, Dqk, Dv, Hq, Hk, causal, return_lse) plus arch and library versions, cached on disk.
* **max_seqlen_q / max_seqlen_k** hints are validated by ``mla_prefill`` but not needed here: FA4's
  Hopper varlen scheduler sizes its grid from the static token count and reads each request's length on
  the device, so results and speed do not depend on them. ``Tk == 0`` (static) returns 0 / -inf
  without a launch.
* Packaging: ``flash-attn-4`` and ``quack-kernels`` import torch at module import (seconds), so they are
  imported only when CuTe DSL compiles the kernel: the call names its launch function with
  ``ffi.LaunchRef``, and a process whose kernel is in the compile cache (e.g. on disk from an earlier
  process) never imports them; :func:`supports` checks them without importing them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util

import jax
import jax.numpy as jnp

from tokenspeed_jax.problems import FP8_DTYPE, PrefillProblem

TARGET = "mla_prefill_sm90"
INSTALL_HINT = "pip install 'tokenspeed-jax[hopper]'"
# Rows past cu_seqlens_k[-1] that FA4 may read (tile_n - 1, tile_n <= 128); they must be finite.
KV_TAIL_ROWS = 127
# The @cute.jit launch function (module, name); its module imports flash_attn and torch, so the call names it
# (ffi.LaunchRef) and it is imported only when CuTe DSL compiles the kernel: a warm process never imports them.
_LAUNCH = ("tokenspeed_jax.kernels.sm90.fa4_prefill", "fa4_prefill_launch")
# (Dqk, Dv) pairs compiled in CI (tests/test_compile_sm90_prefill.py) and checked on the H200.
HEAD_DIMS = ((192, 128), (128, 128), (64, 64), (256, 256))
_DTYPES = ("bfloat16", "float16", FP8_DTYPE)


@dataclasses.dataclass(frozen=True)
class PrefillKernelConfig:
    """Static configuration of one compiled prefill kernel (the FFI compile key)."""

    kernel: str
    dtype: str  # kernel input dtype (fp8 inputs run as bfloat16)
    head_dim: int
    head_dim_v: int
    num_q_heads: int
    num_kv_heads: int
    causal: bool
    return_lse: bool


@functools.cache
def _missing_packages() -> str | None:
    """Which optional package is absent (checked without importing torch or the DSL), or None."""
    for module, dist in (
        ("cutlass", "nvidia-cutlass-dsl"),
        ("flash_attn", "flash-attn-4"),
        ("quack", "quack-kernels"),
        ("torch", "torch"),
    ):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return dist
    try:
        importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        # flash_attn exists but is not FA4 (e.g. FlashAttention-2): no CuTe DSL Hopper forward.
        if importlib.util.find_spec("flash_attn.cute") is None:
            return "flash-attn-4"
    return None


def supports(problem: PrefillProblem) -> str | None:
    """None when this backend runs ``problem``, else the reason (cheap; imports nothing heavy)."""
    t = problem.target
    if t.platform != "cuda" or t.arch != "sm_90a":
        return f"needs a Hopper sm_90a target, the call targets {t}"
    if problem.dtype not in _DTYPES:
        return f"dtype {problem.dtype} is not supported (bfloat16, float16, float8_e4m3fn)"
    dims = (problem.head_dim_qk, problem.head_dim_v)
    if dims not in HEAD_DIMS:
        return f"head dims (Dqk, Dv) = {dims} are not supported (supported: {', '.join(map(str, HEAD_DIMS))})"
    if problem.num_q_heads % problem.num_kv_heads:
        return f"Hq = {problem.num_q_heads} is not a multiple of Hk = {problem.num_kv_heads}"
    missing = _missing_packages()
    if missing is not None:
        return f"{missing} is not installed: {INSTALL_HINT}"
    return None


def _specs(problem: PrefillProblem):
    from cutlass.jax import TensorSpec

    Hq, Hk, Dqk, Dv = problem.num_q_heads, problem.num_kv_heads, problem.head_dim_qk, problem.head_dim_v

    def spec(*div):  # extents read at run time; 16-byte pointer alignment as FA4's torch path assumes
        return TensorSpec(divisibility=div, ptr_assumed_align=16)

    inputs = (spec(1, Hq, Dqk), spec(1, Hk, Dqk), spec(1, Hk, Dv), spec(1), spec(1), spec(1))
    outputs = (spec(1, Hq, Dv),) + ((spec(1, Hq),) if problem.return_lse else ())
    return inputs, outputs


def prefill(problem: PrefillProblem, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale):
    """Run one ragged prefill batch (shapes and semantics: :mod:`tokenspeed_jax.prefill`)."""
    from tokenspeed_jax import ffi

    Tq, Hq, Dqk = q.shape
    Tk, Hk, _ = k.shape
    Dv = v.shape[2]
    out_dtype = jnp.bfloat16 if problem.dtype == FP8_DTYPE else q.dtype
    if Tq == 0 or Tk == 0:  # nothing to attend: 0 output, LSE -inf (no launch)
        out = jnp.zeros((Tq, Hq, Dv), out_dtype)
        lse = jnp.full((Tq, Hq), -jnp.inf, jnp.float32)
        return out, (lse if problem.return_lse else None)
    kdtype = "bfloat16" if problem.dtype == FP8_DTYPE else problem.dtype
    if problem.dtype == FP8_DTYPE:  # exact upcast (e4m3 is a subset of bf16)
        q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))

    cu_q = jnp.clip(cu_seqlens_q.astype(jnp.int32), 0, Tq)
    cu_k = jnp.clip(cu_seqlens_k.astype(jnp.int32), 0, Tk)
    v = finite_v_tail(v, cu_k[-1])
    scale = jnp.asarray(softmax_scale, jnp.float32).reshape((1,))

    cfg = PrefillKernelConfig("fa4_sm90", kdtype, Dqk, Dv, Hq, Hk, problem.causal, problem.return_lse)
    outputs = [jax.ShapeDtypeStruct((Tq, Hq, Dv), out_dtype)]
    if problem.return_lse:
        outputs.append(jax.ShapeDtypeStruct((Tq, Hq), jnp.float32))
    input_specs, output_specs = _specs(problem)
    call = ffi.custom_call(
        TARGET,
        ffi.LaunchRef(*_LAUNCH),
        outputs=outputs,
        compile_key=cfg,
        input_specs=input_specs,
        output_specs=output_specs,
        library_versions=("flash-attn-4", "quack-kernels"),
        dynamic_shapes=True,
        dtype=kdtype,
        head_dim=Dqk,
        head_dim_v=Dv,
        qhead_per_kvhead=Hq // Hk,
        causal=problem.causal,
        num_q_heads=Hq,
    )
    res = call(q, k, v, cu_q, cu_k, scale)
    return res[0], (res[1] if problem.return_lse else None)


def finite_v_tail(v, end):
    """``v [Tk, Hk, Dv]`` with rows ``[end, end + KV_TAIL_ROWS)`` (those FA4 may read past the last request,
    module docstring) set to 0; ``end`` is the int32 ``cu_seqlens_k[-1]`` in ``[0, Tk]``.  The window is read
    back from v, so rows before ``end`` are kept where the window has to start earlier (``end`` near Tk)."""
    Tk = v.shape[0]
    rows = min(KV_TAIL_ROWS, Tk)
    start = jnp.clip(end, 0, Tk - rows)
    win = jax.lax.dynamic_slice_in_dim(v, start, rows, axis=0)
    past = (start + jnp.arange(rows, dtype=jnp.int32)) >= end
    win = jnp.where(past[:, None, None], jnp.zeros((), v.dtype), win)
    return jax.lax.dynamic_update_slice_in_dim(v, win, start, axis=0)


