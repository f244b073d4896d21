"""JAX's persistent compilation cache for the engine and the CLI (warm start)."""

from __future__ import annotations

import os

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
