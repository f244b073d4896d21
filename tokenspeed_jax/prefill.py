"""``mla_prefill``: ragged (varlen) attention forward for MLA prefill, e.g. Dqk 192 / Dv 128.

Contract (normative)
    q ``[Tq, Hq, Dqk]``, k ``[Tk, Hk, Dqk]``, v ``[Tk, Hk, Dv]`` hold the requests back to back without
    padding: request ``b`` owns q rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and k/v rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``.  ``Hq`` is a multiple of ``Hk``; query head ``h`` uses KV head
    ``h // (Hq / Hk)``.  With ``causal=True`` the mask is bottom-right aligned: query ``i`` of a request with
    ``Lq`` queries and ``Lk`` keys sees keys ``j <= i + Lk - Lq``.  Scores are ``softmax_scale * q.k`` in
    fp32 (one past float32's range is +-inf; a visible +inf score makes its row NaN).  Output
    ``[Tq, Hq, Dv]`` (bf16 for fp8 input, else the input dtype); LSE ``[Tq, Hq]`` float32 natural log.  A
    row that sees no key, and any q row outside every request (past ``cu_seqlens_q[-1]``), gives 0 output
    and LSE ``-inf``.

    K/V rows past the last request (``cu_seqlens_k[-1] <= row < Tk``; padding the caller may leave as
    garbage, NaN included): the ``xla`` backend never reads them; the ``sm90`` backend's kernel reads
    up to 127 rows past ``cu_seqlens_k[-1]``, and the backend zeroes those V rows before the call, so any
    content is safe on both.  The ``sm100``
    backend loads whole key tiles of at most 128 rows and multiplies the v rows past the last request by
    probabilities that are exactly 0; ``0 * NaN`` is NaN, so **there k/v rows in
    ``[cu_seqlens_k[-1], cu_seqlens_k[-1] + 127)`` must hold finite values** (zeros, stale data, any finite
    garbage), or the last request's output may become NaN.  The safe spellings everywhere: pass k/v with
    exactly ``cu_seqlens_k[-1]`` rows, or zero their padding where k/v are produced.

    Non-finite values inside the requests: on the ``xla`` backend a NaN or Inf in a v row reaches exactly
    the output rows that see that key (its own request's rows allowed by the mask), never another request
    and never a row outside every request.  On kernel backends a non-finite v row may reach every output row
    whose key tile covers it, also where its probability is 0 (a causally masked key of its own request, or
    request ``b + 1``'s first rows, up to 127, for request ``b``).

    Runtime data safety: ``cu_seqlens_q`` / ``cu_seqlens_k`` are clamped to ``[0, Tq]`` / ``[0, Tk]`` in
    their own integer dtype before the conversion to int32 (as ``mla_decode``'s lengths: uint32 or int64
    values never wrap); offsets that decrease or do not start at 0 give an unspecified but memory-safe
    result, and ``validate=True`` reports them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from tokenspeed_jax import _checks as C
from tokenspeed_jax.backends import defer_to_lowering_platform, select_backend, trace_switches
from tokenspeed_jax.problems import ALL_DTYPES, PrefillProblem
from tokenspeed_jax.runtime import current_target


def mla_prefill(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    *,
    softmax_scale: float | jax.Array,
    causal: bool = True,
    return_lse: bool = False,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    backend: str = "auto",
    validate: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Ragged varlen attention forward (module docstring has the contract).

    Args:
      q: ``[Tq, Hq, Dqk]``; k: ``[Tk, Hk, Dqk]``; v: ``[Tk, Hk, Dv]``; all bf16, fp16 or float8_e4m3fn
        (float32 on the xla backend), one dtype.  Rows past ``cu_seqlens_k[-1]``: the sm100 backend reads
        up to 127 of them, which must be finite there (module docstring); exactly-sized or zero-padded k/v
        are safe everywhere.
      cu_seqlens_q, cu_seqlens_k: int32 ``[B + 1]`` request boundaries (non-decreasing, starting at 0).
      softmax_scale: runtime float32 scalar.
      causal: bottom-right aligned causal mask.
      return_lse: also return the LSE ``[Tq, Hq]`` float32 (natural log).
      max_seqlen_q, max_seqlen_k: optional static upper bounds of the per-request lengths, used by
        kernels to size their grids; results are correct without them (a hint smaller than a real
        length is a caller error that kernels do not read past, but may truncate).
      backend: ``"auto"`` or a registered backend name.
      validate: check the runtime offsets with ``jax.experimental.checkify`` (as ``mla_decode``): each
        cu_seqlens starts at 0, never decreases and ends within its rows (Tq / Tk); eager calls raise,
        jitted calls must be wrapped in ``checkify.checkify``.

    Returns:
      ``out [Tq, Hq, Dv]`` or ``(out, lse)``.
    """
    problem = _prefill_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, return_lse, max_seqlen_q,
                               max_seqlen_k)
    if not isinstance(validate, bool):
        raise TypeError(f"validate: expected a Python bool, got {validate!r}")
    ss = C.f32_scalar(softmax_scale, "softmax_scale")
    impl = select_backend("prefill", problem, backend)
    with jax.named_scope("tokenspeed_mla_prefill"):
        if validate:
            check_prefill_inputs(cu_seqlens_q, cu_seqlens_k, num_q_tokens=problem.num_q_tokens,
                                 num_k_tokens=problem.num_k_tokens)
        # The clamp of the module docstring, in the offsets' own dtype; backends get int32 in range.
        cu_q = C.clamp_index(cu_seqlens_q, 0, problem.num_q_tokens)
        cu_k = C.clamp_index(cu_seqlens_k, 0, problem.num_k_tokens)
        if impl.name == "xla":  # pure JAX: vmap batches it natively
            out, lse = defer_to_lowering_platform(
                "prefill", problem, backend, functools.partial(impl.prefill, problem), q, k, v, cu_q, cu_k, ss)
        else:
            p = problem
            call = _sequential_under_vmap(impl.name, p.causal, p.return_lse, p.max_seqlen_q, p.max_seqlen_k,
                                          p.target, trace_switches(impl))
            out, lse = call(q, k, v, cu_q, cu_k, ss)
    return (out, lse) if return_lse else out


def check_prefill_inputs(cu_seqlens_q, cu_seqlens_k, *, num_q_tokens: int, num_k_tokens: int) -> None:
    """checkify checks of the runtime prefill offsets (see ``mla_prefill(validate=True)``)."""
    for cu, name, rows in ((cu_seqlens_q, "cu_seqlens_q", num_q_tokens),
                           (cu_seqlens_k, "cu_seqlens_k", num_k_tokens)):
        # Compared in the offsets' own dtype (NumPy arrays by NumPy): an int32 cast would wrap uint32 /
        # int64 values and report the wrong defect.
        xp = np if isinstance(cu, (np.ndarray, np.generic)) else jnp
        checkify.check(jnp.asarray(cu[0] == 0),
                       f"{name}: expected the first offset to be 0, got a nonzero one")
        checkify.check(jnp.asarray(xp.all(cu[1:] >= cu[:-1])),
                       f"{name}: expected non-decreasing offsets, got a decrease")
        checkify.check(C.index_in_range(cu[-1], None, rows),
                       f"{name}: expected the last offset <= {rows} (rows of the array)")


@functools.lru_cache(maxsize=64)
def _sequential_under_vmap(backend_name: str, causal: bool, return_lse: bool, max_seqlen_q, max_seqlen_k,
                           target, switches: tuple = ()):
    """Kernel backends take one ragged batch per call; under ``jax.vmap`` the mapped calls run one after
    another (``lax.map``).  Folding would need re-offsetting cu_seqlens into one larger ragged batch;
    a caller who wants that concatenates the requests itself, which is what ragged layouts are for.
    Cached, bounded, on the static flags and the backend's trace-time switches (``Backend.trace_env``), as
    ``tokenspeed_jax.decode._vmappable_decode``: token counts and batch sizes are read from the operands."""
    from tokenspeed_jax.backends import get_backend

    impl = get_backend(backend_name)

    @jax.custom_batching.custom_vmap
    def call(q, k, v, cu_q, cu_k, ss):
        problem = _prefill_problem(q, k, v, cu_q, cu_k, causal, return_lse, max_seqlen_q, max_seqlen_k)
        problem = PrefillProblem(**{**problem.__dict__, "target": target})
        out, lse = impl.prefill(problem, q, k, v, cu_q, cu_k, ss)
        return out, (jnp.zeros((), jnp.float32) if lse is None else lse)

    @call.def_vmap
    def rule(axis_size, in_batched, *args):
        args = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape) for a, b in zip(args, in_batched)]
        return jax.lax.map(lambda a: call(*a), tuple(args)), (True, True)

    return call


def contract_reason(problem: PrefillProblem) -> str | None:
    """None if ``problem`` is inside ``mla_prefill``'s static limits, else the reason (as
    :func:`tokenspeed_jax.decode.contract_reason`)."""
    p = problem
    if p.num_q_heads < 1 or p.num_kv_heads < 1 or p.num_q_heads % p.num_kv_heads:
        return f"{p.num_q_heads} query heads is not a positive multiple of {p.num_kv_heads} KV heads"
    if p.head_dim_qk < 1 or p.head_dim_v < 1:
        return f"head dims (Dqk, Dv) = ({p.head_dim_qk}, {p.head_dim_v}) are not positive"
    if p.dtype not in ALL_DTYPES:
        return f"dtype {p.dtype} (mla_prefill takes {list(ALL_DTYPES)})"
    if p.batch < 1:
        return "an empty batch"
    return None


def _prefill_problem(q, k, v, cu_q, cu_k, causal, return_lse, max_seqlen_q, max_seqlen_k) -> PrefillProblem:
    for x, n in ((q, "q"), (k, "k"), (v, "v"), (cu_q, "cu_seqlens_q"), (cu_k, "cu_seqlens_k")):
        C.array(x, n)
    C.rank(q, "q", 3, "[Tq, Hq, Dqk]")
    C.rank(k, "k", 3, "[Tk, Hk, Dqk]")
    C.rank(v, "v", 3, "[Tk, Hk, Dv]")
    C.rank(cu_q, "cu_seqlens_q", 1, "[B + 1]")
    C.rank(cu_k, "cu_seqlens_k", 1, "[B + 1]")
    dtype = C.float_dtype(q, "q", ALL_DTYPES)
    C.same_dtype(q, "q", k, "k")
    C.same_dtype(q, "q", v, "v")
    C.int_dtype(cu_q, "cu_seqlens_q")
    C.int_dtype(cu_k, "cu_seqlens_k")
    causal = C.static_bool(causal, "causal")
    return_lse = C.static_bool(return_lse, "return_lse")
    max_seqlen_q = C.static_pos_int(max_seqlen_q, "max_seqlen_q", allow_none=True)
    max_seqlen_k = C.static_pos_int(max_seqlen_k, "max_seqlen_k", allow_none=True)
    Tq, Hq, Dqk = q.shape
    Tk, Hk, Dk = k.shape
    Tv, Hv, Dv = v.shape
    C.dim("k", "head dim (axis 2) equal to q's Dqk", Dk, Dqk)
    C.dim("v", "tokens (axis 0) equal to k's Tk", Tv, Tk)
    C.dim("v", "heads (axis 1) equal to k's Hk", Hv, Hk)
    if Hq < 1 or Hk < 1 or Hq % Hk:
        raise ValueError(f"q: expected Hq (axis 1) a positive multiple of k's Hk = {Hk}, got Hq = {Hq}")
    if Dqk < 1 or Dv < 1:
        raise ValueError(f"q: expected positive head dims, got Dqk = {Dqk}, Dv = {Dv}")
    if cu_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q: expected shape [B + 1] with B >= 1, got {tuple(cu_q.shape)}")
    C.dim("cu_seqlens_k", "length equal to cu_seqlens_q's (B + 1)", cu_k.shape[0], cu_q.shape[0])
    return PrefillProblem(
        batch=cu_q.shape[0] - 1, num_q_tokens=Tq, num_k_tokens=Tk, num_q_heads=Hq, num_kv_heads=Hk,
        head_dim_qk=Dqk, head_dim_v=Dv, dtype=dtype, causal=causal, return_lse=return_lse,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, target=current_target(),
    )
