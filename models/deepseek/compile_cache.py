"""JAX's persistent compilation cache for the engine and the CLI (warm start)."""

from __future__ import annotations

import contextlib
import os
from typing import ClassVar

import jax


def default_compilation_cache_dir() -> str:
    """``$TOKENSPEED_JAX_CACHE_DIR/xla`` if set, else ``$XDG_CACHE_HOME`` (or ``~/.cache``)
    ``/tokenspeed_jax/xla``: next to the CuTe kernels' disk cache (``.../tokenspeed_jax/ffi``)."""
    env = os.environ.get("TOKENSPEED_JAX_CACHE_DIR")
    if env:
        return os.path.join(env, "xla")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tokenspeed_jax", "xla")


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache (warm start: a second process loads the compiled
    executables instead of recompiling them).

    A directory already configured (``jax_compilation_cache_dir``, e.g. through JAX's own
    ``JAX_COMPILATION_CACHE_DIR``) is kept; otherwise ``path`` or :func:`default_compilation_cache_dir`
    is used.  Every compilation is cached (``jax_persistent_cache_min_compile_time_secs = 0``): the
    engine compiles many sub-second steps whose sum is the warm-up.  Returns the directory in use (None
    if JAX's cache is disabled by ``jax_enable_compilation_cache``)."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    current = jax.config.jax_compilation_cache_dir
    if not current:
        current = path or default_compilation_cache_dir()
        os.makedirs(current, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", current)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return current


class CompileClock:
    """Seconds JAX spends tracing, lowering and compiling (``jax.monitoring`` duration events)."""

    EVENTS: ClassVar[dict[str, str]] = {
        "/jax/core/compile/jaxpr_trace_duration": "trace",
        "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
        "/jax/core/compile/backend_compile_duration": "compile",
    }

    def __init__(self):
        self.seconds = {"trace": 0.0, "lower": 0.0, "compile": 0.0}
        self.compiles = 0
        self.cache_hits = 0
        self.by_function: dict[str, list] = {}  # XLA compiles: function name -> [count, seconds]
        self._installed = False

    def install(self) -> CompileClock:
        import jax

        if not self._installed:
            jax.monitoring.register_event_duration_secs_listener(self._on_event)
            jax.monitoring.register_event_listener(self._on_count)
            self._installed = True
        return self

    def _on_event(self, event: str, duration: float, **kw) -> None:
        kind = self.EVENTS.get(event)
        if kind is not None:
            self.seconds[kind] += float(duration)
            if kind == "compile":
                self.compiles += 1
                f = self.by_function.setdefault(str(kw.get("fun_name", "?")), [0, 0.0])
                f[0] += 1
                f[1] += float(duration)

    def _on_count(self, event: str, **_kw) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.cache_hits += 1

    def total(self) -> float:
        return sum(self.seconds.values())

    @contextlib.contextmanager
    def span(self):
        """``with clock.span() as s:`` -> ``s["seconds"]`` (trace + lower + compile inside the block) and
        ``s["compiles"]`` once the block ends."""
        t, n = self.total(), self.compiles
        s: dict[str, float] = {}
        try:
            yield s
        finally:
            s["seconds"] = round(self.total() - t, 3)
            s["compiles"] = self.compiles - n

    def snapshot(self) -> dict:
        top = sorted(self.by_function.items(), key=lambda kv: -kv[1][1])[:15]
        return {
            "seconds": {k: round(v, 2) for k, v in self.seconds.items()},
            "backend_compiles": self.compiles,
            "persistent_cache_hits": self.cache_hits,
            "by_function": {n: {"count": c, "seconds": round(t, 2)} for n, (c, t) in top},
        }
