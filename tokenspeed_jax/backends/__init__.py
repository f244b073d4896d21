"""Backend registry for the MLA ops.

A backend is an object with

* ``name`` (str) and ``priority`` (int, higher is preferred by ``backend="auto"``),
* ``supports_decode(problem: DecodeProblem) -> str | None`` and
  ``supports_prefill(problem: PrefillProblem) -> str | None``: ``None`` when it can run the call,
  otherwise a precise reason (arch, dtype, page size, head dims, missing package with the install
  command, ...),
* ``decode(problem, q, kv_cache, block_table, seq_lens, softmax_scale, output_scale) -> (out, lse|None)``
* ``prefill(problem, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale) -> (out, lse|None)``
* optionally ``decode_work_key(problem) -> hashable`` and ``decode_work(problem, seq_lens) -> tuple of arrays``:
  a backend whose decode derives data from the lengths alone (``sm90``: its split-KV schedule) computes it in
  ``decode_work``, and then takes it as ``decode(..., work=arrays)`` (``work=None``: computed inside the call).
  ``mla_decode_work`` calls it once per decode step and every layer's ``mla_decode(..., work=)`` shares the
  result; the key is what the arrays depend on (two problems with equal keys share them) and is how
  ``mla_decode`` tells a ``work`` built for another call.  Backends without these methods have no per-step work
  (their ``mla_decode_work`` is empty).
* optionally ``decode_batch_invariant = True``: the backend takes ``problem.batch_invariant``
  (``mla_decode(batch_invariant=True)``: ``sm90`` runs its batch-invariant schedule, ``xla`` accepts it unchanged);
  ``mla_decode`` refuses the flag on the others.
* optionally ``decode_clamps_indices = True``: the backend's decode clamps every ``seq_lens`` and ``block_table``
  entry it reads to ``mla_decode``'s documented bounds itself, so ``mla_decode`` passes int32 arrays unchanged
  (other integer dtypes are still clamped in their own dtype and converted).

where the scales are float32 scalar arrays (runtime operands).  ``supports_*`` must be cheap and must not
import torch or compile anything; availability checks that need an import are cached.

Built-in backends: ``xla`` (pure JAX, exact fp32 reference, every platform), ``sm90`` (Hopper: our CuTe DSL
decode kernel, FlashAttention-4's forward for prefill) and ``sm100`` (Blackwell: the TokenSpeed MLA
kernels).  ``backend="auto"`` picks the highest-priority backend that supports the call; a named backend
that cannot run it raises ``ValueError`` listing every backend's reason.  Nothing falls back silently
when a backend is named.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any, Protocol

import jax

from tokenspeed_jax.problems import DecodeProblem, PrefillProblem


class Backend(Protocol):
    """A backend.  Optional attribute ``trace_env: tuple[str, ...]``: names of environment variables its
    ``decode`` / ``prefill`` read at trace time (kernel switches for A/B timing); ``mla_decode`` and
    ``mla_prefill`` key their per-problem trace caches on their values (:func:`trace_switches`), so changing
    one between two traces takes effect in the same process."""

    name: str
    priority: int

    def supports_decode(self, problem: DecodeProblem) -> str | None: ...

    def supports_prefill(self, problem: PrefillProblem) -> str | None: ...

    def decode(self, problem, q, kv_cache, block_table, seq_lens, softmax_scale, output_scale): ...

    def prefill(self, problem, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale): ...


def has_decode_work(impl) -> bool:
    """Whether backend ``impl`` has per-step decode work (``decode_work`` / ``decode_work_key``, module docstring)."""
    return callable(getattr(impl, "decode_work", None)) and callable(getattr(impl, "decode_work_key", None))


_REGISTRY: dict[str, Backend] = {}
# Built-in backends, imported on first use so that importing tokenspeed_jax never imports cutlass/torch.
_BUILTIN = {
    "xla": "tokenspeed_jax.backends.xla",
    "sm90": "tokenspeed_jax.backends.sm90",
    "sm100": "tokenspeed_jax.backends.sm100",
}


def trace_switches(impl) -> tuple:
    """``(name, value)`` of each trace-time environment switch of backend ``impl`` (``Backend.trace_env``):
    part of the op wrappers' trace-cache keys."""
    return tuple((k, os.environ.get(k)) for k in getattr(impl, "trace_env", ()))

def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Add a backend to the registry (``replace=True`` to override one of the same name)."""
    if backend.name in _REGISTRY and not replace:
        raise ValueError(f"backend {backend.name!r} is already registered")
    _REGISTRY[backend.name] = backend
    return backend


def _load_builtins() -> None:
    for name, module in _BUILTIN.items():
        if name not in _REGISTRY:
            try:
                mod = importlib.import_module(module)
            except ModuleNotFoundError as e:  # a backend module not present in this build
                if e.name != module:
                    raise
                continue
            if name not in _REGISTRY:
                register_backend(mod.BACKEND)


def all_backends() -> list[Backend]:
    """Every registered backend, most preferred first."""
    _load_builtins()
    return sorted(_REGISTRY.values(), key=lambda b: -b.priority)


def get_backend(name: str) -> Backend:
    _load_builtins()
    if name not in _REGISTRY:
        raise ValueError(f"backend: unknown backend {name!r}; known backends: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def _supports(b: Backend, op: str, problem: Any) -> str | None:
    return b.supports_decode(problem) if op == "decode" else b.supports_prefill(problem)


def backend_reasons(op: str, problem: DecodeProblem | PrefillProblem) -> dict[str, str | None]:
    """``{backend name: None if it can run this call else the reason}`` for ``op`` in decode/prefill."""
    if op not in ("decode", "prefill"):
        raise ValueError(f"op: expected 'decode' or 'prefill', got {op!r}")
    return {b.name: _supports(b, op, problem) for b in all_backends()}


def available_backends(op: str, problem: DecodeProblem | PrefillProblem) -> list[str]:
    """Names of the backends that can run this call, most preferred first."""
    return [n for n, r in backend_reasons(op, problem).items() if r is None]


_SELECTION_LISTENERS: list[Callable[[str, Any, str], None]] = []


def add_selection_listener(fn: Callable[[str, Any, str], None]) -> Callable[[], None]:
    """Call ``fn(op, problem, backend_name)`` whenever :func:`select_backend` resolves a call (at trace time,
    so once per traced shape: the backend the compiled program runs).  Returns a function that removes the
    listener.  For reports (the benchmarks record which backend ran each op); a listener must not raise."""
    _SELECTION_LISTENERS.append(fn)

    def remove() -> None:
        if fn in _SELECTION_LISTENERS:
            _SELECTION_LISTENERS.remove(fn)

    return remove


def select_backend(op: str, problem: DecodeProblem | PrefillProblem, backend: str) -> Backend:
    """Resolve ``backend`` ("auto" or a name) for one call, or raise ValueError with every reason."""
    chosen = _select_backend(op, problem, backend)
    for fn in _SELECTION_LISTENERS:
        fn(op, problem, chosen.name)
    return chosen


def _select_backend(op: str, problem: DecodeProblem | PrefillProblem, backend: str) -> Backend:
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a backend name or 'auto', got {type(backend).__name__}")
    if backend == "auto":
        for b in all_backends():
            if _supports(b, op, problem) is None:
                return b
        chosen = None
    else:
        chosen = get_backend(backend)
        reason = _supports(chosen, op, problem)
        if reason is None:
            return chosen
    lines = "\n".join(f"  {n}: {r or 'ok'}" for n, r in backend_reasons(op, problem).items())
    what = "no backend can" if chosen is None else f"backend {backend!r} cannot"
    hint = ""
    if problem.target.platform != "cuda":
        hint = (f"\nThe call targets {problem.target} (JAX's default device). To trace or export for a GPU "
                "from this host, wrap the trace in tokenspeed_jax.target_override('sm_90a') (or 'sm_100a'), "
                "set TOKENSPEED_JAX_TARGET=sm_90a, or use tokenspeed_jax.export_for_gpu.")
    raise ValueError(f"backend: expected a backend that can run this call; {what} run this mla_{op} call "
                     f"({problem}).\nReasons:\n{lines}{hint}")


# ------------------------------------------------------------------ choosing by the lowering platform
def _unresolved_abstract_eval(*, shape, dtype, message):
    del message
    return jax.core.ShapedArray(shape, dtype)


def _unresolved_lowering(ctx, *, shape, dtype, message):
    raise ValueError(message)


def _make_unresolved_primitive():
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    p = Primitive("tokenspeed_unresolved_target")
    p.def_abstract_eval(_unresolved_abstract_eval)
    mlir.register_lowering(p, _unresolved_lowering)
    return p


_UNRESOLVED = None


def defer_to_lowering_platform(op: str, problem: Any, backend: str, run: Callable[..., Any],
                               *operands: Any) -> Any:
    """``run(*operands)``, the call of the backend chosen for ``problem``; where that choice came from JAX's
    default device rather than from the lowering platform, a lowering for CUDA fails clearly.

    With ``backend="auto"`` and no explicit target (:func:`tokenspeed_jax.target_override` or
    ``TOKENSPEED_JAX_TARGET``), a call traced on a host whose default device is not a CUDA GPU picks the
    ``xla`` reference.  That is right when the module runs on that host, and wrong when it is lowered for
    CUDA (``jax.export(..., platforms=("cuda",))`` from a CPU machine): the GPU architecture is unknown
    there, so instead of exporting the slow reference silently, the call is wrapped in
    ``jax.lax.platform_dependent``: every platform but CUDA lowers ``run``; CUDA lowers a placeholder
    whose lowering raises a ``ValueError`` naming ``target_override`` and ``TOKENSPEED_JAX_TARGET``.
    The CUDA branch is never lowered for CPU, so ordinary CPU use is unchanged.
    """
    global _UNRESOLVED
    from tokenspeed_jax.runtime import target_is_explicit

    if backend != "auto" or problem.target.platform == "cuda" or target_is_explicit():
        return run(*operands)
    if _UNRESOLVED is None:
        _UNRESOLVED = _make_unresolved_primitive()
    message = (
        f"mla_{op}: lowering for CUDA a call traced with backend='auto' on a host whose default JAX device "
        f"is {problem.target}: the GPU architecture is unknown here, so no GPU kernel was traced (only the "
        "XLA reference, which this error keeps out of a CUDA module). Trace under "
        "tokenspeed_jax.target_override('sm_90a') (or 'sm_100a'), or set TOKENSPEED_JAX_TARGET=sm_90a "
        "(and CUTE_DSL_ARCH=sm_90a) before starting Python, or use tokenspeed_jax.export_for_gpu(fn, *args, "
        "arch='sm_90a'); pass backend='xla' to export the reference on purpose."
    )
    shapes = jax.eval_shape(run, *operands)

    def unresolved(*_):
        return jax.tree.map(
            lambda s: _UNRESOLVED.bind(shape=tuple(s.shape), dtype=s.dtype, message=message), shapes)

    return jax.lax.platform_dependent(*operands, default=run, cuda=unresolved)
