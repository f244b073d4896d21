"""``plan_mla_decode``: the pure-Python planner of the decode kernels.

A plan is a function of static shapes and device facts only (batch, query tokens, heads, the block
table's capacity, page size, dtype, arch, SM count): it fixes the tile shape, how query tokens and heads
are packed into MMA rows, the split-KV count and the exact workspace the kernels need.  Kernel wrappers
allocate exactly ``plan.workspace`` as XLA-owned buffers of the call (extra outputs of the custom call),
never a global that grows, and CPU tests check plans for any shape.

Each GPU generation has its own planning function (``_PLANNERS[family]``) because the kernels differ;
they share :class:`DecodePlan`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from tokenspeed_jax.kernels.sm100 import plan as P
from tokenspeed_jax.problems import FP8_DTYPE, KERNEL_DTYPES


@dataclasses.dataclass(frozen=True)
class WorkspaceBuffer:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * {"float32": 4, "int32": 4, "bfloat16": 2, "float16": 2}[self.dtype]


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """How one decode call is cut into CTAs.

    rows: ``q_len * num_heads`` query rows that share each request's KV stream.
    fold: query tokens folded into the MMA M dimension per tile (all S tokens share one KV read).
    block_m / block_n: MMA rows per tile / KV tokens per main-loop step.
    num_m_blocks: row tiles per request (``ceil(rows / block_m)``).
    num_splits: KV splits per request of the static per-request cut (sm90: the cut its device schedule keeps for
      full-length batches; 1 = the main kernel writes the output directly).
    tokens_per_split: KV tokens each split covers (a multiple of block_n); split ``s`` covers
      ``[s * tokens_per_split, (s + 1) * tokens_per_split)`` clipped to the request's length.
    grid: launch grid of the main kernel.
    workspace: the buffers the call needs beyond its outputs (exact shapes).
    """

    arch: str
    num_sms: int
    batch: int
    q_len: int
    num_heads: int
    rows: int
    fold: int
    block_m: int
    block_n: int
    num_m_blocks: int
    num_splits: int
    tokens_per_split: int
    grid: tuple[int, int, int]
    workspace: tuple[WorkspaceBuffer, ...]
    extra: tuple[tuple[str, object], ...] = ()

    @property
    def workspace_bytes(self) -> int:
        return sum(w.nbytes for w in self.workspace)


def _family(arch: str) -> str:
    sm = int("".join(c for c in arch.removeprefix("sm_") if c.isdigit()))
    if sm // 10 == 9:
        return "sm90"
    if sm // 10 in (10, 11):
        return "sm100"
    raise ValueError(f"arch: no decode planner for {arch!r} (planners: {sorted(_PLANNERS)})")


def schedule_slots(num_ctas: int) -> int:
    """fp32 partial slots any length-balanced schedule over ``num_ctas`` CTAs can use: each interior cut splits at
    most one request in two, so ``2 (num_ctas - 1)``, at least 1 (:mod:`tokenspeed_jax.decode_schedule`)."""
    return max(1, 2 * (num_ctas - 1))


def _plan_sm90(*, batch, q_len, num_heads, max_kv_len, page_size, dtype, kv_lora_rank, rope_dim, arch,
               num_sms, block_m=64) -> DecodePlan:
    """Hopper (kernels: ``tokenspeed_jax.kernels.sm90``): 64-row wgmma tiles over rows = S*H
    (tokens and heads packed, heads fastest), 64-token KV steps, one CTA per SM (225 KB of smem), and a
    persistent grid of ``num_sms // m_blocks`` CTAs per row block (``grid = (m_blocks, num_ctas, 1)``) that walk the
    length-balanced schedule computed on the device from the actual lengths (:mod:`tokenspeed_jax.decode_schedule`).
    ``num_splits`` / ``tokens_per_split`` are the per-request cut that schedule keeps when it is within a few percent
    of the balanced one (a full-length batch): among ``splits <= ceil(num_sms / (batch * m_blocks))`` with at least
    two 64-token blocks per split, the one that maximises ``ctas / (waves * num_sms)`` (``ctas = batch * m_blocks *
    splits``), the smallest on near-ties.  Partial outputs go to fp32 workspace ``o_accum [slots, rows,
    kv_lora_rank]`` and ``lse_accum [slots, rows]``, ``slots = 2 (num_ctas - 1)``: its size depends on neither the
    batch size nor the lengths.

    ``block_m`` 32: the row tiles of the FP8 loop with both matmuls transposed (the ``fp8_transposed`` config of
    ``tokenspeed_jax.backends.sm90_decode``, S x H <= 32), which computes 32 query rows per CTA."""
    if block_m not in (32, 64):
        raise ValueError(f"block_m: expected 32 or 64, got {block_m!r}")
    block_n = 64
    rows = q_len * num_heads
    m_blocks = -(-rows // block_m)
    n_blocks = max(1, -(-max_kv_len // block_n))
    base = batch * m_blocks
    max_splits = n_blocks // 2 if n_blocks >= 4 else 1
    max_splits = min(max_splits, -(-num_sms // base))  # never more than one wave's worth
    best, best_score = 1, -1.0
    for s in range(1, max_splits + 1):
        ctas = base * s
        score = ctas / (-(-ctas // num_sms) * num_sms) - 0.002 * s
        if score > best_score + 1e-9:
            best, best_score = s, score
    blocks_per_split = -(-n_blocks // best)
    splits = -(-n_blocks // blocks_per_split)  # no empty trailing split
    # Kernel KV step (``extra["kv_step"]``): 64 tokens (docs/sm90_decode_rejected.md: the 32-token step)
    kv_step = 64
    num_ctas = max(1, num_sms // m_blocks)
    slots = schedule_slots(num_ctas)
    ws = (
        WorkspaceBuffer("o_accum", (slots, rows, kv_lora_rank), "float32"),
        WorkspaceBuffer("lse_accum", (slots, rows), "float32"),
    )
    return DecodePlan(
        arch=arch, num_sms=num_sms, batch=batch, q_len=q_len, num_heads=num_heads, rows=rows,
        fold=q_len, block_m=block_m, block_n=block_n, num_m_blocks=m_blocks, num_splits=splits,
        tokens_per_split=blocks_per_split * block_n, grid=(m_blocks, num_ctas, 1), workspace=ws,
        extra=(("kv_step", kv_step),),
    )


_PLANNERS: dict[str, Callable[..., DecodePlan]] = {"sm90": _plan_sm90}


SM100_MAX_HEADS = 128


# ------------------------------------------------------------------------------------ sm100 (TokenSpeed)
def plan_sm100(*, batch, q_len, num_heads, max_kv_len, page_size, dtype, kv_lora_rank, rope_dim, arch,
               num_sms) -> DecodePlan:
    """Plan a TokenSpeed decode call (see :mod:`tokenspeed_jax.kernels.sm100.plan` for the policy).

    ``fold`` is TokenSpeed's fold factor (query tokens folded into the heads of one M tile; 1 when the
    rows are packed), ``num_m_blocks`` the M tiles per request (``S_eff``), ``block_m`` the MMA M (64 or
    128), ``block_n`` 128, ``grid`` the split-KV kernel's grid ``(cluster_m, B * S_eff, splits)``, and
    ``tokens_per_split`` the split width at full capacity (the kernel re-divides each request's runtime
    length).  ``extra`` records the packing, ``heads_eff``, ``cluster_m``, ``max_active_clusters`` and the
    FP8 reducer settings.  Workspace: one float32 buffer ``o_lse_accum`` of
    ``B * S_eff * H_eff * splits * (kv_lora_rank + 1)`` elements when ``splits > 1``.
    """
    if kv_lora_rank != P.LATENT_DIM or rope_dim != P.ROPE_DIM:
        raise ValueError(
            f"kv_lora_rank/rope_dim: the sm100 kernels need {P.LATENT_DIM}/{P.ROPE_DIM}, got "
            f"{kv_lora_rank}/{rope_dim}"
        )
    if num_heads > SM100_MAX_HEADS:
        raise ValueError(f"num_heads: expected <= {SM100_MAX_HEADS}, got {num_heads}")
    fp8 = dtype == FP8_DTYPE
    lay = P.query_layout(num_heads=num_heads, q_len=q_len, fp8=fp8, arch=arch)
    splits = P.num_splits(batch=batch, layout=lay, max_kv_len=max_kv_len, fp8=fp8, num_sms=num_sms)
    elems = P.workspace_elems(batch=batch, layout=lay, splits=splits, kv_lora_rank=kv_lora_rank)
    ws = (WorkspaceBuffer("o_lse_accum", (elems,), "float32"),) if elems else ()
    k_tiles = P.ceil_div(max_kv_len, P.BLOCK_N)
    d_tiles = P.reducer_d_tiles(batch=batch, q_len=q_len, num_heads=num_heads, num_sms=num_sms, splits=splits)
    return DecodePlan(
        arch=arch, num_sms=num_sms, batch=batch, q_len=q_len, num_heads=num_heads, rows=q_len * num_heads,
        fold=lay.fold, block_m=lay.m_tile, block_n=P.BLOCK_N, num_m_blocks=lay.q_len_eff, num_splits=splits,
        tokens_per_split=P.ceil_div(k_tiles, splits) * P.BLOCK_N,
        grid=(lay.cluster_m, batch * lay.q_len_eff, splits), workspace=ws,
        extra=(
            ("packing", "pack" if lay.pack_q else ("fold" if lay.fold > 1 else "none")),
            ("pack_q", lay.pack_q),
            ("heads_eff", lay.heads_eff),
            ("cluster_m", lay.cluster_m),
            ("max_active_clusters", max(1, num_sms // lay.cluster_m)),
            ("reducer_d_tiles", d_tiles if fp8 else 1),
            ("reducer_max_splits", P.reducer_max_splits(splits) if fp8 else 256),
        ),
    )




_PLANNERS["sm100"] = plan_sm100


def register_planner(family: str, fn: Callable[..., DecodePlan]) -> None:
    """Install the planning function of a GPU family (``"sm90"``, ``"sm100"``)."""
    _PLANNERS[family] = fn


def plan_mla_decode(
    *,
    batch: int,
    q_len: int,
    num_heads: int,
    max_kv_len: int,
    page_size: int,
    dtype: str = "bfloat16",
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    arch: str = "sm_90a",
    num_sms: int | None = None,
    block_m: int | None = None,
) -> DecodePlan:
    """Plan one decode call for ``arch`` (see the module docstring).

    ``max_kv_len`` is the static capacity of a request (``max_pages * page_size``); runtime lengths may be
    shorter, and kernels skip the empty part of each split.  ``block_m`` (sm90 only; default: the family's) sets
    the rows per CTA where a kernel variant needs other than the default.
    """
    for n, v in (("batch", batch), ("q_len", q_len), ("num_heads", num_heads), ("max_kv_len", max_kv_len),
                 ("page_size", page_size), ("kv_lora_rank", kv_lora_rank), ("rope_dim", rope_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{n}: expected a positive int, got {v!r}")
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"dtype: expected one of {KERNEL_DTYPES}, got {dtype!r}")
    family = _family(arch)
    if family not in _PLANNERS:
        raise ValueError(f"arch: no decode planner registered for {arch!r} (family {family!r}; "
                         f"planners: {sorted(_PLANNERS)})")
    if num_sms is None:
        from tokenspeed_jax.runtime import _DEFAULT_SMS

        num_sms = _DEFAULT_SMS.get(arch, 132)
    if block_m is not None and family != "sm90":
        raise ValueError(f"block_m: only the sm90 planner takes it, got arch {arch!r}")
    return _PLANNERS[family](
        batch=batch, q_len=q_len, num_heads=num_heads, max_kv_len=max_kv_len, page_size=page_size,
        dtype=dtype, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, arch=arch, num_sms=num_sms,
        **({"block_m": block_m} if block_m is not None else {}),
    )


def plan_for_problem(problem, block_m: int | None = None) -> DecodePlan:
    """The plan of a :class:`~tokenspeed_jax.problems.DecodeProblem` on its target (``block_m``: as
    :func:`plan_mla_decode`)."""
    t = problem.target
    return plan_mla_decode(
        batch=problem.batch, q_len=problem.q_len, num_heads=problem.num_heads,
        max_kv_len=problem.max_kv_len, page_size=problem.page_size, dtype=problem.dtype,
        kv_lora_rank=problem.kv_lora_rank, rope_dim=problem.rope_dim, arch=t.arch or "sm_90a",
        num_sms=t.num_sms, block_m=block_m,
    )


__all__ = ["DecodePlan", "WorkspaceBuffer", "plan_mla_decode", "plan_for_problem", "plan_sm100",
           "register_planner", "FP8_DTYPE"]
