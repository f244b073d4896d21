"""The compile cache of the tokenspeed custom calls (see the package docstring: *Compilation and caching*).

cutlass.jax keeps compiled kernels in a private module-level dict (``cutlass.jax.compile.
_CUTLASS_COMPILE_CACHE``) that ``get_or_compile_kernel`` reads with ``.get(key)`` and fills with
``[key] = CompileResult(module, fingerprint, spec)``.  :func:`install_disk_cache` replaces that dict with
:class:`_DiskBackedCompileCache` (same contents, plus the on-disk store and the extent-free lookup of
``dynamic_shapes`` calls).  Because it depends on private names, :func:`cutlass_cache_layout_problem`
checks the layout first, and a changed layout is an error naming the installed nvidia-cutlass-dsl and the
way out (``TOKENSPEED_JAX_DISK_CACHE=0``), never a silent fallback.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import inspect
import logging
import os
import tempfile
from collections.abc import Hashable
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

__all__ = ["CompileKey", "cache_dir", "cache_stats", "cutlass_cache_layout_problem", "install_disk_cache"]

logger = logging.getLogger("tokenspeed_jax.ffi")

# The CuTe DSL compiler ships in per-CUDA "libs" wheels; an object is reused only with the same build.
_BASE_VERSIONS = (
    "nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-cu12",
    "nvidia-cutlass-dsl-libs-cu13",
    "tokenspeed-jax",
)


def cache_dir() -> Path | None:
    """Directory of the on-disk compile cache, or None when disabled (see the module docstring)."""
    if os.environ.get("TOKENSPEED_JAX_DISK_CACHE", "1").lower() in ("0", "false", "no", "off"):
        return None
    env = os.environ.get("TOKENSPEED_JAX_CACHE_DIR")
    if env is not None:
        return Path(env) if env else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tokenspeed_jax" / "ffi"


@functools.cache
def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "none"


@functools.cache
def _file_digest(path: str | None) -> str:
    if not path:
        return "none"
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    except OSError:
        return "none"


@dataclasses.dataclass(frozen=True)
class CompileKey:
    """The full compile identity handed to cutlass.jax (``compile_key=``) for one custom call."""

    target: str  # full HLO target name
    user_key: Hashable  # the op's frozen static config
    arch: str  # e.g. "sm_90a"
    versions: tuple[tuple[str, str], ...]  # (distribution, version)
    launch: str  # module.qualname of the launch function
    launch_source: str  # digest of the file defining it (stale-binary guard while developing)
    dynamic_shapes: bool = False  # one object for every extent (see custom_call)

    def stable_text(self) -> str | None:
        """Process-independent text of this key, or None when some part prints a memory address."""
        text = repr(self)
        return None if " at 0x" in text else text


def _erase_extents(spec: Any) -> Any:
    """``spec`` with every operand extent replaced by None (ranks, dtypes and TensorSpecs kept)."""

    def erase(args: Any) -> Any:
        return tuple(dataclasses.replace(a, shape=(None,) * len(a.shape)) for a in args)

    return dataclasses.replace(spec, in_args=erase(spec.in_args), out_args=erase(spec.out_args))


def _spec_text(spec: Any) -> str | None:
    text = repr(spec)
    return None if " at 0x" in text else text


def _env_text() -> str:
    # CUTE_DSL_ARCH is in the key as CompileKey.arch (set on CPU to cross-compile, detected on a GPU).
    skip = {
        "CUTE_DSL_CACHE_DIR",
        "CUTE_DSL_LOG_LEVEL",
        "CUTE_DSL_LOG_TO_CONSOLE",
        "CUTE_DSL_LOG_TO_FILE",
        "CUTE_DSL_ARCH",
    }
    return repr(sorted((k, v) for k, v in os.environ.items() if k.startswith("CUTE_DSL_") and k not in skip))


class _DiskBackedCompileCache(dict):
    """cutlass.jax's in-memory compile cache, extended for keys made by :func:`custom_call`.

    cutlass.jax looks compiled kernels up with ``cache.get(CompileCacheKey(compile_key, spec, env))``
    and stores them with ``cache[key] = CompileResult(module, fingerprint, spec)``. For entries whose
    ``compile_key`` is a :class:`CompileKey`:

    * with ``dynamic_shapes``, the lookup ignores operand extents (the compiled object reads them at
      run time; only its exported symbol name mentions the extents it was traced with), so one object
      serves every token count;
    * entries are read from / written to :func:`cache_dir`.

    Other cutlass.jax users are unaffected.
    """

    stats: ClassVar[dict[str, int]] = {"disk_hits": 0, "disk_writes": 0, "misses": 0, "shape_reuses": 0}

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._erased: dict[Any, tuple[bytes, bytes]] = {}

    @staticmethod
    def _ours(key: Any) -> CompileKey | None:
        ck = getattr(key, "compile_key", None)
        return ck if isinstance(ck, CompileKey) else None

    @staticmethod
    def _lookup_spec(key: Any, ck: CompileKey) -> Any:
        spec = getattr(key, "spec", None)
        return _erase_extents(spec) if ck.dynamic_shapes else spec

    def _path(self, key: Any, ck: CompileKey) -> Path | None:
        root = cache_dir()
        if root is None:
            return None
        kt, st = ck.stable_text(), _spec_text(self._lookup_spec(key, ck))
        if kt is None or st is None:
            return None
        digest = hashlib.sha256(f"{kt}\n{st}\n{_env_text()}".encode()).hexdigest()
        return root / f"{ck.target}-{digest[:40]}.o"

    def _result(self, key: Any, module: bytes) -> Any:
        from cutlass.jax.compile import CompileResult

        return CompileResult(module=module, fingerprint=hashlib.sha256(module).digest(), spec=key.spec)

    def get(self, key: Any, default: Any = None) -> Any:
        hit = super().get(key)
        if hit is not None:
            return hit
        ck = self._ours(key)
        if ck is None:
            return default
        erased = (
            (ck, self._lookup_spec(key, ck), getattr(key, "environment", None)) if ck.dynamic_shapes else None
        )
        if erased is not None and erased in self._erased:
            result = self._result(key, self._erased[erased][0])
            type(self).stats["shape_reuses"] += 1
            super().__setitem__(key, result)
            return result
        path = self._path(key, ck)
        if path is None or not path.is_file():
            type(self).stats["misses"] += 1
            return default
        try:
            result = self._result(key, path.read_bytes())
        except Exception:
            logger.warning("tokenspeed_jax.ffi: ignoring unreadable cache entry %s", path, exc_info=True)
            return default
        type(self).stats["disk_hits"] += 1
        logger.debug("tokenspeed_jax.ffi: disk cache hit %s", path)
        super().__setitem__(key, result)
        if erased is not None:
            self._erased[erased] = (result.module, result.fingerprint)
        return result

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        ck = self._ours(key)
        module = getattr(value, "module", None)
        if ck is None or not isinstance(module, (bytes, bytearray)):
            return
        if ck.dynamic_shapes:
            self._erased[(ck, self._lookup_spec(key, ck), getattr(key, "environment", None))] = (
                module,
                value.fingerprint,
            )
        path = self._path(key, ck)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(module)
            os.replace(tmp, path)
            type(self).stats["disk_writes"] += 1
        except OSError:
            logger.warning("tokenspeed_jax.ffi: could not write cache entry %s", path, exc_info=True)

    def clear(self) -> None:
        super().clear()
        self._erased.clear()


_EXPECTED_FIELDS = {
    "CompileResult": ("module", "fingerprint", "spec"),
    "CompileCacheKey": ("compile_key", "spec", "environment"),
}


def cutlass_cache_layout_problem(ccompile: ModuleType | Any) -> str | None:
    """None when ``ccompile`` (``cutlass.jax.compile``) has the private layout that
    :class:`_DiskBackedCompileCache` relies on, else what differs: the ``_CUTLASS_COMPILE_CACHE`` dict,
    the fields of ``CompileResult`` and ``CompileCacheKey``, and ``get_or_compile_kernel`` reading and
    filling that module global."""
    cache = getattr(ccompile, "_CUTLASS_COMPILE_CACHE", None)
    if not isinstance(cache, dict):
        return f"_CUTLASS_COMPILE_CACHE is {type(cache).__name__}, expected a dict"
    for cls_name, fields in _EXPECTED_FIELDS.items():
        cls = getattr(ccompile, cls_name, None)
        if cls is None or not dataclasses.is_dataclass(cls):
            return f"{cls_name} is missing or not a dataclass"
        have = tuple(f.name for f in dataclasses.fields(cls))
        if sorted(have) != sorted(fields):
            return f"{cls_name} has fields {have}, expected {fields}"
    fn = getattr(ccompile, "get_or_compile_kernel", None)
    try:
        text = inspect.getsource(fn) if fn is not None else ""
    except (OSError, TypeError):
        text = ""
    if "_CUTLASS_COMPILE_CACHE.get(" not in text or "_CUTLASS_COMPILE_CACHE[" not in text:
        return "get_or_compile_kernel no longer reads and fills _CUTLASS_COMPILE_CACHE"
    return None


def install_disk_cache(ccompile: ModuleType | Any | None = None) -> bool:
    """Back cutlass.jax's compile cache with :class:`_DiskBackedCompileCache` (idempotent).

    ``ccompile`` defaults to ``cutlass.jax.compile``.  Returns False when cutlass.jax is not importable.
    Raises ``RuntimeError`` when its private layout changed (:func:`cutlass_cache_layout_problem`), unless
    the on-disk cache is switched off (``TOKENSPEED_JAX_DISK_CACHE=0``): then it logs a warning and leaves
    cutlass.jax's own cache alone (kernels still compile; ``dynamic_shapes`` calls compile per extent).
    """
    if ccompile is None:
        try:
            from cutlass.jax import compile as ccompile
        except Exception:  # noqa: BLE001 - cutlass.jax not installed: nothing to back
            return False
    problem = cutlass_cache_layout_problem(ccompile)
    if problem is not None:
        version = _version("nvidia-cutlass-dsl")
        msg = (f"tokenspeed_jax.ffi: cutlass.jax's private compile cache changed in nvidia-cutlass-dsl "
               f"{version} ({problem}); the tokenspeed on-disk compile cache depends on it. Install the "
               "nvidia-cutlass-dsl version pinned by tokenspeed-jax, or set TOKENSPEED_JAX_DISK_CACHE=0 to "
               "run on cutlass.jax's own in-memory cache.")
        if cache_dir() is None:
            logger.warning(msg)
            return False
        raise RuntimeError(msg)
    current = ccompile._CUTLASS_COMPILE_CACHE
    if not isinstance(current, _DiskBackedCompileCache):
        ccompile._CUTLASS_COMPILE_CACHE = _DiskBackedCompileCache(current)
    return True


@functools.cache
def _install_disk_cache() -> bool:
    """:func:`install_disk_cache` once per process (custom_call calls it)."""
    return install_disk_cache()


def cache_stats() -> dict[str, int]:
    """Counters of the on-disk cache in this process (``disk_hits``, ``disk_writes``, ``misses``)."""
    return dict(_DiskBackedCompileCache.stats)
