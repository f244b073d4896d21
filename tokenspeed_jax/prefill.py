"""``mla_prefill``: ragged (varlen) attention forward for MLA prefill, e.g. Dqk 192 / Dv 128.

Contract (normative)
    q ``[Tq, Hq, Dqk]``, k ``[Tk, Hk, Dqk]``, v ``[Tk, Hk, Dv]`` hold the requests back to back without
    padding: request ``b`` owns q rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and k/v rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``.  ``Hq`` is a multiple of ``Hk``; query head ``h`` uses KV head
    ``h // (Hq / Hk)``.  With ``causal=True`` the mask is bottom-right aligned: query ``i`` of a request with
    ``Lq`` queries and ``Lk`` keys sees keys ``j <= i + Lk - Lq``.  Scores are ``softmax_scale * q.k`` in
    fp32.  Output ``[Tq, Hq, Dv]`` (bf16 for fp8 input, else the input dtype); LSE ``[Tq, Hq]`` float32 natural
    log.  A row that sees no key, and any q row outside every request (past ``cu_seqlens_q[-1]``), gives 0
    output and LSE ``-inf``.

    K/V rows past the last request (``cu_seqlens_k[-1] <= row < Tk``; padding the caller may leave as
    garbage): the ``xla`` backend never reads them.  Kernel backends (``sm90``, ``sm100``) load whole key
    tiles of at most 128 rows, so they read up to 127 rows past ``cu_seqlens_k[-1]`` and multiply those v
    rows by probabilities that are exactly 0; ``0 * NaN`` is NaN, so **k/v rows in
    ``[cu_seqlens_k[-1], cu_seqlens_k[-1] + 127)`` must hold finite values** (zeros, stale data, any finite
    garbage), or the last request's output may become NaN.  Rows from ``cu_seqlens_k[-1] + 127`` on are
    never read and may hold anything.  The safe spellings: pass k/v with exactly ``cu_seqlens_k[-1]`` rows,
    or zero their padding where k/v are produced (fused into the producer it is nearly free; a separate
    pass over v is not, which is why the kernels do not do it).  The same holds inside the requests: on kernel
    backends a non-finite v row may reach every output row whose key tile covers it, also where its
    probability is 0 (a causally masked key of its own request, or request ``b + 1``'s first rows for
    request ``b``); the ``xla`` backend confines it to the rows that see it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
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
        (float32 on the xla backend), one dtype.  Rows past ``cu_seqlens_k[-1]``: kernel backends read
        up to 127 of them, which must be finite (module docstring); exactly-sized or zero-padded k/v
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
        if impl.name == "xla":  # pure JAX: vmap batches it natively
            out, lse = defer_to_lowering_platform(
                "prefill", problem, backend, functools.partial(impl.prefill, problem),
                q, k, v, cu_seqlens_q, cu_seqlens_k, ss)
        else:
            out, lse = _sequential_under_vmap(impl.name, problem, trace_switches(impl))(
                q, k, v, cu_seqlens_q, cu_seqlens_k, ss)
    return (out, lse) if return_lse else out


def check_prefill_inputs(cu_seqlens_q, cu_seqlens_k, *, num_q_tokens: int, num_k_tokens: int) -> None:
    """checkify checks of the runtime prefill offsets (see ``mla_prefill(validate=True)``)."""
    for cu, name, rows in ((cu_seqlens_q, "cu_seqlens_q", num_q_tokens),
                           (cu_seqlens_k, "cu_seqlens_k", num_k_tokens)):
        c = jnp.asarray(cu).astype(jnp.int32)
        checkify.check(c[0] == 0, f"{name}: expected the first offset to be 0, got a nonzero one")
        checkify.check(jnp.all(c[1:] >= c[:-1]), f"{name}: expected non-decreasing offsets, got a decrease")
        checkify.check(c[-1] <= rows, f"{name}: expected the last offset <= {rows} (rows of the array)")


@functools.lru_cache(maxsize=None)
def _sequential_under_vmap(backend_name: str, problem: PrefillProblem, switches: tuple = ()):
    """Kernel backends take one ragged batch per call; under ``jax.vmap`` the mapped calls run one after
    another (``lax.map``).  Folding would need re-offsetting cu_seqlens into one larger ragged batch;
    a caller who wants that concatenates the requests itself, which is what ragged layouts are for.
    Cached per (backend, problem, ``switches``): the backend's trace-time switches (``Backend.trace_env``),
    as in ``tokenspeed_jax.decode._vmappable_decode``."""
    from tokenspeed_jax.backends import get_backend

    impl = get_backend(backend_name)

    @jax.custom_batching.custom_vmap
    def call(q, k, v, cu_q, cu_k, ss):
        out, lse = impl.prefill(problem, q, k, v, cu_q, cu_k, ss)
        return out, (jnp.zeros((), jnp.float32) if lse is None else lse)

    @call.def_vmap
    def rule(axis_size, in_batched, *args):
        args = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape) for a, b in zip(args, in_batched)]
        return jax.lax.map(lambda a: call(*a), tuple(args)), (True, True)

    return call


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
