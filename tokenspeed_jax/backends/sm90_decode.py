"""Decode half of the ``sm90`` backend: our CuTe DSL MLA decode kernels for Hopper.

Contract: :mod:`tokenspeed_jax.decode`.  Planning: ``_plan_sm90`` in :mod:`tokenspeed_jax.planner`; the split-KV
schedule is computed on the device from the lengths, inside the caller's jit (:mod:`tokenspeed_jax.decode_schedule`:
one contiguous range of the batch's actual work per persistent CTA); the fp32 partials are XLA-owned extra outputs of
the custom call whose size depends on neither the batch size nor the lengths.  Design, loops and measurements:
``docs/sm90_decode.md``, ``docs/sm90_decode_schedule.md``.

Which kernel runs is one frozen :class:`Sm90DecodeConfig`, chosen by :func:`select_config` from the problem alone;
``decode(..., config=...)`` runs another one (benchmarks and tests).  The compile key is derived from the problem's
static fields, the plan and the config; no environment variable changes what is generated.  FP8 (e4m3 q and cache,
scales folded into ``softmax_scale`` / ``output_scale``) runs QK^T and P V on FP8 tensor cores (error bound:
``docs/sm90_decode.md``).  Outputs are bf16 (fp16 for fp16 inputs).

Custom call ``tokenspeed_mla_decode_sm90`` (the main kernel, then the combine kernel): the scales are (1,)-shaped
float32 operands and every operand extent is read at run time (:func:`operand_specs`), so neither a new scale nor a
new batch size, cache size or table width recompiles: one CuTe DSL compile per :class:`DecodeKernelKey`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tokenspeed_jax.decode_schedule import ScheduleSpec, decode_schedule
from tokenspeed_jax.planner import plan_for_problem
from tokenspeed_jax.problems import KERNEL_DTYPES, DecodeProblem

TARGET = "mla_decode_sm90"
# the main loops (tokenspeed_jax.kernels.sm90.decode.LOOPS; no cutlass import here)
LOOPS = ("seesaw", "transposed", "fp8_transposed_pv", "fp8_transposed")
_MIN_PAGE = 16  # the decode contract's smallest page (TMA refills: at most 4 boxes per 64-token chunk)
_MIN_PRODUCER_PAGE = 32  # the producer warpgroup's coordinates of 16-token pages spill in its 24 registers
_MAX_TRANSPOSED_ROWS = 32  # S x H of the transposed loops (query rows as the MMA N dimension)


@dataclasses.dataclass(frozen=True)
class Sm90DecodeConfig:
    """One Hopper decode kernel.

    ``loop``: the main loop (:data:`LOOPS`):

    * ``"seesaw"``: two warpgroups own alternate 64-token KV tiles of a 64-row query block, out of phase, so one's
      softmax runs under the other's matmuls.  16-bit, or FP8 with 16-token pages.
    * ``"transposed"``: 16-bit, S x H <= 32: the seesaw with both matmuls transposed (S^T = K Q^T, O^T = V^T P^T),
      the query rows the MMA N dimension; pages >= 32, with the producer warpgroup.
    * ``"fp8_transposed_pv"``: FP8, S x H > 32, pages >= 32: 64-row blocks, O^T = V^T P^T with V^T a register
      operand loaded straight from the e4m3 KV staging.
    * ``"fp8_transposed"``: FP8, S x H <= 32, pages >= 32: both matmuls transposed on 32-row tiles, each warpgroup
      its own KV tiles over all 512 features, merged once in the epilogue.

    ``producer``: a third warpgroup issues the TMA refills (pages >= 32; the transposed loops always have it).

    ``prefetch``: the producer warpgroup issues the next piece's first KV tiles at the current piece's epilogue
    barrier, and the ``"transposed"`` loop's computing warpgroups its Q tile, so a CTA's next piece does not start on
    their latency (the length-balanced schedule's walk, loops with the producer warpgroup except ``"fp8_transposed"``,
    whose epilogue uses the KV buffers; docs/sm90_decode_schedule.md, "Prefetch across pieces").
    """

    loop: str
    producer: bool
    prefetch: bool = False


# every config by name (benchmarks' --config, tests): what select_config picks, and the seesaw without its producer
CONFIGS = {
    "seesaw": Sm90DecodeConfig("seesaw", producer=True, prefetch=True),
    "seesaw_noproducer": Sm90DecodeConfig("seesaw", producer=False),
    "transposed": Sm90DecodeConfig("transposed", producer=True, prefetch=True),
    "fp8_transposed_pv": Sm90DecodeConfig("fp8_transposed_pv", producer=True, prefetch=True),
    "fp8_transposed": Sm90DecodeConfig("fp8_transposed", producer=True),
}


@dataclasses.dataclass(frozen=True)
class DecodeKernelKey:
    """What the generated code depends on beyond operand shapes and dtypes: the problem's static fields, the
    persistent grid and workspace of the schedule and the config (built by :func:`kernel_key`).  ``chunk``: 0, or
    the batch-invariant schedule's piece length (:func:`invariant_chunk`), whose workspace is sized per call
    (``max_slots`` is then 1, unused by the kernels)."""

    config: Sm90DecodeConfig
    dtype: str
    num_heads: int
    q_len: int
    page_size: int
    causal: bool
    num_ctas: int
    max_slots: int
    chunk: int = 0


def supports(problem: DecodeProblem) -> str | None:
    """None when the sm90 decode kernel runs ``problem``, else why not."""
    t = problem.target
    if t.platform != "cuda" or t.sm is None or t.sm // 10 != 9:
        return f"sm90 decode needs a CUDA sm_90 target, the call targets {t}"
    if problem.dtype not in KERNEL_DTYPES:
        return f"sm90 decode kernel supports dtypes {KERNEL_DTYPES}, got {problem.dtype}"
    if problem.kv_lora_rank != 512 or problem.head_dim != 576:
        return (f"sm90 decode kernel needs kv_lora_rank 512 and head_dim 576 (DeepSeek MLA), got "
                f"{problem.kv_lora_rank} and {problem.head_dim}")
    if problem.page_size < _MIN_PAGE:
        return (f"sm90 decode kernel needs page_size >= {_MIN_PAGE} (its KV refills are TMA loads of whole "
                f"pages), got {problem.page_size}")
    if not 1 <= problem.num_heads <= 128 or not 1 <= problem.q_len <= 16:
        return f"sm90 decode kernel needs H in 1..128 and S in 1..16, got H={problem.num_heads} S={problem.q_len}"
    try:
        import cutlass  # noqa: F401
    except ImportError:
        return "sm90 decode needs nvidia-cutlass-dsl>=4.8.1: pip install 'tokenspeed-jax[cute]'"
    return None


def select_config(problem: DecodeProblem) -> Sm90DecodeConfig:
    """The kernel for ``problem``: the whole policy.

    ===========  ===========  ========  =======================================
    dtype        S x H        page      config
    ===========  ===========  ========  =======================================
    16-bit       <= 32        >= 32     ``transposed``, producer, prefetch
    16-bit       > 32         >= 32     ``seesaw``, producer, prefetch
    16-bit       any          16        ``seesaw``
    FP8          <= 32        >= 32     ``fp8_transposed``, producer
    FP8          > 32         >= 32     ``fp8_transposed_pv``, producer, prefetch
    FP8          any          16        ``seesaw``
    ===========  ===========  ========  =======================================

    ``batch_invariant`` runs the same loops without prefetch (its walk runs each request chunk by chunk).
    """
    fp8 = problem.dtype == "float8_e4m3fn"
    if problem.page_size < _MIN_PRODUCER_PAGE:
        return Sm90DecodeConfig("seesaw", producer=False)
    if problem.rows <= _MAX_TRANSPOSED_ROWS:
        loop = "fp8_transposed" if fp8 else "transposed"
    else:
        loop = "fp8_transposed_pv" if fp8 else "seesaw"
    return Sm90DecodeConfig(loop, producer=True, prefetch=loop != "fp8_transposed" and not problem.batch_invariant)


def check_config(problem: DecodeProblem, config: Sm90DecodeConfig) -> None:
    """Raise ``ValueError`` naming ``config`` unless ``config`` is a kernel this build runs for ``problem``."""
    if not isinstance(config, Sm90DecodeConfig):
        raise TypeError(f"config: expected an Sm90DecodeConfig, got {type(config).__name__}")
    fp8 = problem.dtype == "float8_e4m3fn"
    rows, page, loop = problem.rows, problem.page_size, config.loop
    why = None
    if loop not in LOOPS:
        why = f"loop: expected one of {LOOPS}, got {loop!r}"
    elif not isinstance(config.producer, bool):
        why = f"producer: expected a bool, got {config.producer!r}"
    elif not isinstance(config.prefetch, bool):
        why = f"prefetch: expected a bool, got {config.prefetch!r}"
    elif config.prefetch and (not config.producer or loop == "fp8_transposed" or problem.batch_invariant):
        why = ("prefetch: the loops with the producer warpgroup other than 'fp8_transposed', without "
               "batch_invariant")
    elif config.producer and page < _MIN_PRODUCER_PAGE:
        why = f"the producer warpgroup needs page_size >= {_MIN_PRODUCER_PAGE}, got {page}"
    elif loop == "seesaw" and fp8 and (config.producer or page >= _MIN_PRODUCER_PAGE):
        why = f"the FP8 seesaw runs 16-token pages without a producer, got page_size {page}"
    elif loop != "seesaw" and not config.producer:
        why = f"loop {loop!r} needs the producer warpgroup (producer=True)"
    elif loop == "transposed" and (fp8 or rows > _MAX_TRANSPOSED_ROWS):
        why = f"loop 'transposed' runs 16-bit inputs with S x H <= 32, got {problem.dtype} with S x H = {rows}"
    elif loop == "fp8_transposed" and (not fp8 or rows > _MAX_TRANSPOSED_ROWS):
        why = f"loop 'fp8_transposed' runs FP8 inputs with S x H <= 32, got {problem.dtype} with S x H = {rows}"
    elif loop == "fp8_transposed_pv" and (not fp8 or rows <= _MAX_TRANSPOSED_ROWS):
        why = f"loop 'fp8_transposed_pv' runs FP8 inputs with S x H > 32, got {problem.dtype} with S x H = {rows}"
    if why:
        raise ValueError(f"config: {config} does not run this problem: {why}")


def plan_for_config(problem: DecodeProblem, config: Sm90DecodeConfig):
    """The planner's plan for ``problem`` as ``config`` tiles it (32-row tiles for ``fp8_transposed``)."""
    return plan_for_problem(problem, block_m=32 if config.loop == "fp8_transposed" else 64)


# the batch-invariant schedule: a piece's overhead (fixed start/drain cost and its fp32 partial's write and read) is
# held to at most 1/INVARIANT_OVERHEAD of the piece's own KV work, by the schedule's cost model (invariant_chunk)
INVARIANT_OVERHEAD = 8
# the schedule's fixed cost of a piece in 64-token tiles (Q load, pipeline start and drain, epilogue, fp32 partial):
# 16, the fastest of 2..32 on the H100 with the prefetch across pieces (docs/sm90_decode_schedule.md, "The fixed
# cost of a piece")
_FIXED_COST = 16
# the batch-invariant chunk's start/drain estimate per piece, in 64-token tiles (FlashMLA's constant; invariant_chunk)
_START_DRAIN = 5


def invariant_chunk(problem: DecodeProblem) -> int:
    """The piece length (tokens) of the batch-invariant schedule: a function of the dtype and ``S x H`` only (never
    of the batch size, the lengths or the table width, so a request's pieces are the same in every batch of a model).

    A piece costs, beyond its KV tokens, a fixed start/drain cost (``5 x 64`` tokens) and the write and
    read of its fp32 partial by each row block (``2 x min(S x H, 64) x 513 x 4`` bytes), counted in KV tokens of the
    row block's stream (576 bytes a token in FP8, 1152 in 16-bit).  The chunk is the smallest power of two, at least
    2048, of at least :data:`INVARIANT_OVERHEAD` times that overhead: 4096 for 16-bit S x H <= 32 and FP8 S x H <= 16,
    8192 above.  Smaller chunks cost every large batch more (more pieces, partials and combine work); larger
    ones leave a small batch of long requests fewer pieces than CTAs (``ceil(L / chunk)`` CTAs busy for one request)."""
    kv_bytes = problem.head_dim * (1 if problem.dtype == "float8_e4m3fn" else 2)
    partial = 2 * min(problem.rows, 64) * (problem.kv_lora_rank + 1) * 4
    overhead = _START_DRAIN * 64 + partial / kv_bytes
    chunk = 2048
    while chunk < INVARIANT_OVERHEAD * overhead:
        chunk *= 2
    return chunk


def schedule_spec(problem: DecodeProblem, plan) -> ScheduleSpec:
    """The schedule of a call (:mod:`tokenspeed_jax.decode_schedule`): ``num_sms // m_blocks`` persistent CTAs per
    row block, the block table's capacity, and the static plan's tokens per split as the per-request cut (the one a
    full-length batch keeps), in 64-token units (the kernels' KV tile) with a fixed cost of :data:`_FIXED_COST` tiles
    per piece; with ``problem.batch_invariant`` the batch-invariant schedule of :func:`invariant_chunk` pieces."""
    return ScheduleSpec(num_ctas=max(1, plan.num_sms // plan.num_m_blocks), capacity=problem.max_kv_len,
                        split_units=max(1, plan.tokens_per_split // 64), fixed_cost=_FIXED_COST, unit=64,
                        chunk=invariant_chunk(problem) if problem.batch_invariant else 0)


def kernel_key(problem: DecodeProblem, config: Sm90DecodeConfig, plan) -> DecodeKernelKey:
    """The compile key: the problem's static fields, the schedule's grid and workspace, and the config."""
    spec = schedule_spec(problem, plan)
    return DecodeKernelKey(config, problem.dtype, problem.num_heads, problem.q_len, problem.page_size,
                           problem.causal, spec.num_ctas, 1 if spec.chunk else spec.max_slots, spec.chunk)


def schedule_of(problem: DecodeProblem, seq_lens, config: Sm90DecodeConfig | None = None):
    """The schedule arrays ``(cta, req)`` of a call (what :func:`decode` computes when not given ``work``)."""
    config = select_config(problem) if config is None else config
    return decode_schedule(seq_lens, schedule_spec(problem, plan_for_config(problem, config)), cuda_kernel=True)


def work_key(problem: DecodeProblem, config: Sm90DecodeConfig | None = None) -> tuple[int, ScheduleSpec]:
    """What the schedule of a call depends on besides the lengths: ``(batch, ScheduleSpec)`` (the grid, the table's
    capacity, the per-request cut and the batch-invariant chunk).  Calls with equal keys and lengths have equal
    schedules, so one ``mla_decode_work`` serves every layer of a decode step; a different key is another call's
    schedule."""
    config = select_config(problem) if config is None else config
    return problem.batch, schedule_spec(problem, plan_for_config(problem, config))


def operand_specs(problem: DecodeProblem, spec: ScheduleSpec):
    """``(inputs, outputs)``: the ``cutlass.jax.TensorSpec`` of each operand of the custom call.  Every extent is read
    at run time (``ffi.custom_call(..., dynamic_shapes=True)``), so one compiled object serves every batch size,
    cache size and table width: the varying extents (B, num_pages, max_pages) carry the divisibility hint 1 and the
    others, fixed by the compile key (S, H, page size, D, the grid and the workspace), their own extent, the hints
    the kernels were compiled with when every extent was a hint."""
    from cutlass.jax import TensorSpec

    S, H, D, L, R = problem.q_len, problem.num_heads, problem.head_dim, problem.kv_lora_rank, problem.rows

    def t(*divisibility):
        return TensorSpec(divisibility=divisibility)

    inputs = (t(1, S, H, D), t(1, problem.page_size, D), t(1, 1), t(1), t(1), t(1), t(spec.num_ctas, 8), t(1, 2))
    slots = 1 if spec.chunk else spec.max_slots  # (the batch-invariant workspace: B * ceil(capacity / chunk) slots)
    outputs = (t(1, S, H, L), t(1, S, H), t(slots, R, L), t(slots, R))
    return inputs, outputs


def decode(problem: DecodeProblem, q, kv_cache, block_table, seq_lens, softmax_scale, output_scale, *,
           config: Sm90DecodeConfig | None = None, work=None):
    """Run the kernel; returns ``(out [B,S,H,512], lse [B,S,H] | None)``.

    ``config``: the kernel to run (None: :func:`select_config`); validated against ``problem``.
    ``work``: the schedule's ``(cta, req)`` arrays (:func:`schedule_of`), computed once per decode step and shared by
    every layer; None computes them here from ``seq_lens``."""
    from tokenspeed_jax import ffi

    why = supports(problem)
    if why:
        raise ValueError(why)
    if config is None:
        config = select_config(problem)
    check_config(problem, config)
    plan = plan_for_config(problem, config)
    spec = schedule_spec(problem, plan)
    key = kernel_key(problem, config, plan)
    B, S, H = problem.batch, problem.q_len, problem.num_heads
    if work is None:
        sched_cta, sched_req = decode_schedule(seq_lens, spec, cuda_kernel=True)
    else:
        sched_cta, sched_req = work
        if tuple(sched_cta.shape) != (spec.num_ctas, 8) or tuple(sched_req.shape) != (B, 2):
            raise ValueError(f"work: expected the schedule of this call, arrays of shapes {(spec.num_ctas, 8)} and "
                             f"{(B, 2)}, got {tuple(sched_cta.shape)} and {tuple(sched_req.shape)}")
    outputs = [jax.ShapeDtypeStruct((B, S, H, problem.kv_lora_rank), jnp.dtype(problem.out_dtype)),
               jax.ShapeDtypeStruct((B, S, H), jnp.float32),
               jax.ShapeDtypeStruct((spec.slots(B), S * H, problem.kv_lora_rank), jnp.float32),
               jax.ShapeDtypeStruct((spec.slots(B), S * H), jnp.float32)]
    constexprs = {f.name: getattr(key, f.name) for f in dataclasses.fields(key) if f.name != "config"}
    input_specs, output_specs = operand_specs(problem, spec)
    # the kernel modules are imported only when CuTe DSL compiles the kernel (not on a compile-cache hit)
    launch = ffi.LaunchRef("tokenspeed_jax.kernels.sm90.decode", "launch_decode")
    call = ffi.custom_call(TARGET, launch, outputs=outputs, compile_key=key, input_specs=input_specs,
                           output_specs=output_specs, dynamic_shapes=True, loop=config.loop, producer=config.producer,
                           prefetch=config.prefetch, **constexprs)
    res = call(q, kv_cache, block_table.astype(jnp.int32), seq_lens.astype(jnp.int32),
               ffi.scalar_operand(softmax_scale), ffi.scalar_operand(output_scale), sched_cta.astype(jnp.int32),
               sched_req.astype(jnp.int32))
    out, lse = res[0], res[1]
    return out, (lse if problem.return_lse else None)
