"""The custom-call boundary of tokenspeed-jax: named XLA FFI custom calls that run CuTe DSL kernels.

Every GPU kernel of the package reaches XLA through :func:`custom_call`, a thin layer over
``cutlass.jax.cutlass_call`` (nvidia-cutlass-dsl >= 4.8.1): cutlass.jax compiles the ``@cute.jit`` launch
function to a host object + cubin, embeds it in the HLO instruction as attributes (``module``, ``key``)
and executes it through the CuTe DSL runtime's FFI handler. This module adds what the package needs on
top of that, and nothing else (no runtime of its own):

Target names
    ``custom_call("mla_decode_sm90", ...)`` emits ``stablehlo.custom_call @tokenspeed_mla_decode_sm90``
    (:func:`target_name`), so profiler traces, HLO dumps and ``jax.export`` artifacts name our kernels.
    Each name is registered for the CUDA platform with the *same* handler symbols as cutlass.jax's own
    target (``CuteDSLRT_NvJaxCutlassCall_v{1,2}``; v2 on JAX >= 0.9.1), so the ABI is cutlass.jax's.
    Names are ``tokenspeed_`` + ``[a-z0-9_]+``; calls that opt out of CUDA graphs get the suffix
    ``_nograph`` (a different handler, see below).

Operand order (the ABI every kernel wrapper follows)
    The launch function is called as ``launch(stream, *inputs, *outputs, **constexprs)``: the inputs in
    the order the op passes them, then the outputs in the order of ``outputs=``, then the workspace
    buffers, which are simply trailing outputs sized by the planner (the op drops them). Arrays arrive
    as ``cute.Tensor`` with the JAX shape (row-major unless ``input_specs``/``output_specs`` say
    otherwise); 0-d arrays are not supported by cutlass.jax, so pass scalars as shape-``(1,)`` arrays
    (:func:`scalar_operand`).

Runtime scalars are operands
    Anything that may change between calls without changing the compiled code (softmax scale, FP8
    scales, sequence lengths, tables) is a device array operand, never a constexpr: a new value then
    does not recompile, and the call stays capturable in a CUDA graph. A kernel reads such a scalar with
    ``tokenspeed_jax.ffi.device.load_scalar(t)`` (a ``@cute.jit`` helper: element 0 of a 1-element
    tensor, loaded once per thread). ``**constexprs`` are compile-time constants (Python ints, bools,
    floats, strings, enums, frozen dataclasses, kernel classes' static configuration); passing a JAX
    array as a constexpr is a TypeError.

Compilation and caching
    One compile per static configuration: the key is ``(target, compile_key, constexprs, input/output
    shapes/dtypes/specs, arch, library versions, the launch function's source file)``. ``compile_key``
    must be a hashable frozen dataclass (or tuple of plain values) that identifies everything the
    generated code depends on that is not an operand shape/dtype. Operand extents are part of the key
    unless ``dynamic_shapes=True`` (the kernel reads extents at run time and the specs carry explicit
    divisibility hints; then one object serves every extent, e.g. every token count). Two caches:

    * in memory: cutlass.jax's compile cache (a hit skips even tracing the CuTe DSL function);
    * on disk: the compiled object (cubin + host launcher) under :func:`cache_dir`
      (``$TOKENSPEED_JAX_CACHE_DIR``, default ``$XDG_CACHE_HOME/tokenspeed_jax/ffi`` or
      ``~/.cache/tokenspeed_jax/ffi``; ``TOKENSPEED_JAX_DISK_CACHE=0`` disables it), keyed by a
      SHA-256 of the stable textual form of the key above plus the ``CUTE_DSL_*`` environment (less
    ``CUTE_DSL_ARCH``, already in the key, so an object cross-compiled on CPU serves the GPU), written
      atomically. A second process lowering the same configuration loads the object instead of tracing
      and compiling it. Keys whose text contains a memory address (``at 0x``) are not stable across
      processes and are cached in memory only.

    CuTe DSL keeps its own file cache of compiled MLIR (``CUTE_DSL_CACHE_DIR``); it still requires
    tracing the kernel, which our cache skips.

Architecture
    Kernels are compiled for ``tokenspeed_jax.runtime.current_target().arch`` (``--gpu-arch``), so a
    CPU-only machine lowers for CUDA under ``target_override("sm_90a")``; set ``CUTE_DSL_ARCH`` to the
    same arch there, since CuTe DSL otherwise assumes the machine runs sm_100.

CUDA graphs
    ``allow_cuda_graph=True`` (the default) binds the name to the runtime's command-buffer-compatible
    execute handler, so XLA may capture the call in a CUDA graph; every kernel must therefore take all
    varying values from operands (above) and allocate nothing. ``allow_cuda_graph=False`` selects the
    ``_nograph`` target.

Transformations
    ``jax.jit`` and ``jax.export`` work (:func:`export_disabled_safety_checks` lists the targets to allow:
    ``jax.export.export(jax.jit(f), disabled_checks=export_disabled_safety_checks())``). ``vmap`` is
    rejected with a ``NotImplementedError`` naming the target: the public ops handle batching
    themselves (decode folds a vmapped axis into its batch). No autodiff.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import inspect
import logging
import os
import re
import tempfile
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "TARGET_PREFIX",
    "CompileKey",
    "cache_dir",
    "cache_stats",
    "custom_call",
    "export_disabled_safety_checks",
    "is_available",
    "register_target",
    "registered_targets",
    "scalar_operand",
    "target_name",
]

logger = logging.getLogger(__name__)

TARGET_PREFIX = "tokenspeed_"
_NOGRAPH_SUFFIX = "_nograph"
_TARGET_RE = re.compile(r"^[a-z0-9][a-z0-9_]*$")
# The CuTe DSL compiler ships in per-CUDA "libs" wheels; an object is reused only with the same build.
_BASE_VERSIONS = (
    "nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-cu12",
    "nvidia-cutlass-dsl-libs-cu13",
    "tokenspeed-jax",
)

_lock = threading.Lock()
_registered: set[str] = set()


# --------------------------------------------------------------------------------------------- names
def is_available() -> bool:
    """True when nvidia-cutlass-dsl with its JAX extension (``cutlass.jax``) can be imported."""
    try:
        import cutlass.jax as cjax
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return bool(cjax.is_available())


def target_name(target: str, *, allow_cuda_graph: bool = True) -> str:
    """The HLO custom-call target of ``target``: ``"mla_decode_sm90" -> "tokenspeed_mla_decode_sm90"``."""
    if not isinstance(target, str):
        raise TypeError(f"target: expected a str, got {type(target).__name__}")
    if target.startswith(TARGET_PREFIX):
        raise ValueError(f"target: give the name without the {TARGET_PREFIX!r} prefix, got {target!r}")
    if not _TARGET_RE.match(target):
        raise ValueError(f"target: expected lowercase letters, digits and '_' ([a-z0-9_]+), got {target!r}")
    return TARGET_PREFIX + target + ("" if allow_cuda_graph else _NOGRAPH_SUFFIX)


def registered_targets() -> frozenset[str]:
    """The ``tokenspeed_*`` targets registered with JAX in this process so far."""
    with _lock:
        return frozenset(_registered)


def export_disabled_safety_checks(targets: Iterable[str] | None = None) -> tuple[Any, ...]:
    """``jax.export`` safety checks to disable for our custom calls.

    ``targets``: full ``tokenspeed_*`` names (default: every target registered in this process, i.e.
    every op traced so far). Also includes cutlass.jax's own targets. Use as
    ``jax.export.export(jax.jit(f), disabled_checks=export_disabled_safety_checks())``; deserialising
    the artifact needs this package imported (it registers the names when an op is traced) or
    :func:`register_target` called for each name.
    """
    import jax.export

    names = sorted(registered_targets() if targets is None else set(targets))
    checks = [jax.export.DisabledSafetyCheck.custom_call(n) for n in names]
    try:
        import cutlass.jax as cjax

        checks.extend(cjax.get_export_disabled_safety_checks())
    except Exception:  # cutlass.jax missing: only our names
        logger.debug("cutlass.jax unavailable; exporting tokenspeed targets only", exc_info=True)
    return tuple(checks)


def _handler_symbols(allow_cuda_graph: bool) -> tuple[int, dict[str, str]]:
    """FFI version and handler symbols of cutlass.jax's default target for this JAX."""
    from cutlass.jax import ffi as cffi

    version = cffi.get_cutlass_call_ffi_version()
    builtin = cffi.get_cutlass_call_ffi_name(allow_cuda_graph, version)
    table = getattr(cffi, "_CUTLASS_CALL_TARGETS", None)
    if table is not None and builtin in table.get(version, {}):
        return version, dict(table[version][builtin])
    # Fallback: the symbol naming scheme of nvidia-cutlass-dsl 4.8.
    execute = "Execute" if allow_cuda_graph else "ExecuteNoCudaGraph"
    syms = {
        "prepare": f"CuteDSLRT_NvJaxCutlassCallPrepare_v{version}",
        "execute": f"CuteDSLRT_NvJaxCutlassCall{execute}_v{version}",
    }
    if version >= 2:
        syms["instantiate"] = f"CuteDSLRT_NvJaxCutlassCallInstantiate_v{version}"
    return version, syms


def register_target(name: str) -> None:
    """Register the full target ``name`` (``tokenspeed_*``) for CUDA with the CuTe DSL runtime handler.

    Idempotent; :func:`custom_call` calls it. Works without a GPU (JAX keeps CUDA registrations until a
    CUDA backend loads), so CPU-only machines can lower and export for CUDA.
    """
    if not name.startswith(TARGET_PREFIX):
        raise ValueError(f"name: expected a {TARGET_PREFIX}* target, got {name!r}")
    with _lock:
        if name in _registered:
            return
        import ctypes

        import cutlass.jax as cjax

        allow_graph = not name.endswith(_NOGRAPH_SUFFIX)
        version, symbols = _handler_symbols(allow_graph)
        cjax.register_ffi(version)  # the runtime's FFI state types (v2) and its own targets
        lib_path = cjax.find_cute_dsl_runtime_library()
        if not lib_path:
            raise RuntimeError(
                "tokenspeed_jax.ffi: the CuTe DSL runtime library (libcute_dsl_runtime.so) was not found; "
                "reinstall nvidia-cutlass-dsl>=4.8.1"
            )
        lib = ctypes.CDLL(lib_path)
        handler = {}
        for stage, sym in symbols.items():
            fn = getattr(lib, sym)
            fn.restype = ctypes.c_void_p
            handler[stage] = jax.ffi.pycapsule(fn)
        jax.ffi.register_ffi_target(name, handler, platform="CUDA")
        _registered.add(name)


# --------------------------------------------------------------------------------------- operands
def scalar_operand(x: Any, dtype: Any = jnp.float32) -> jax.Array:
    """A runtime scalar as the shape-``(1,)`` device array a kernel reads with ``device.load_scalar``.

    Accepts a Python number, a 0-d or 1-element array; casts to ``dtype``.
    """
    a = jnp.asarray(x, dtype=dtype)
    if a.size != 1:
        raise ValueError(f"scalar_operand: expected one element, got shape {a.shape}")
    return a.reshape((1,))


# ------------------------------------------------------------------------------------------ caching
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


@functools.cache
def _install_disk_cache() -> bool:
    """Back cutlass.jax's compile cache with ours (once per process). False if its layout changed."""
    try:
        from cutlass.jax import compile as ccompile
    except Exception:  # noqa: BLE001
        return False
    current = getattr(ccompile, "_CUTLASS_COMPILE_CACHE", None)
    if not isinstance(current, dict) or not hasattr(ccompile, "CompileResult"):
        logger.warning("tokenspeed_jax.ffi: cutlass.jax internals changed; on-disk compile cache disabled")
        return False
    if not isinstance(current, _DiskBackedCompileCache):
        ccompile._CUTLASS_COMPILE_CACHE = _DiskBackedCompileCache(current)
    return True


def cache_stats() -> dict[str, int]:
    """Counters of the on-disk cache in this process (``disk_hits``, ``disk_writes``, ``misses``)."""
    return dict(_DiskBackedCompileCache.stats)


# ------------------------------------------------------------------------------------- custom_call
def _check_hashable(name: str, value: Any) -> None:
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"{name}: expected a hashable static value (frozen dataclass, tuple, int, str, ...), "
            f"got unhashable {type(value).__name__}"
        ) from None


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.core.Tracer))


def _compile_arch() -> str:
    from tokenspeed_jax.runtime import current_target

    t = current_target()
    if t.platform != "cuda" or not t.arch:
        # Lowering for CUDA from a CPU process without an override: let CuTe DSL decide (CUTE_DSL_ARCH
        # or the detected device).
        return os.environ.get("CUTE_DSL_ARCH", "")
    dsl_arch = _dsl_arch()
    if dsl_arch and dsl_arch != t.arch:
        raise RuntimeError(
            f"tokenspeed_jax.ffi: the call targets {t.arch} but CuTe DSL compiles for {dsl_arch} "
            f"(CUTE_DSL_ARCH={os.environ.get('CUTE_DSL_ARCH')!r} or the detected GPU); set "
            f"CUTE_DSL_ARCH={t.arch} in the environment before starting Python to cross-compile"
        )
    return t.arch


def _dsl_arch() -> str | None:
    """The arch CuTe DSL's runtime assumes (``CUTE_DSL_ARCH`` or the detected device), if known."""
    try:
        from cutlass.cutlass_dsl.cutlass import CuTeDSL

        return str(CuTeDSL._get_dsl().envar.arch)
    except Exception:  # noqa: BLE001 - internals moved: skip the check
        return os.environ.get("CUTE_DSL_ARCH")


def custom_call(
    target: str,
    launch: Callable[..., None],
    *,
    outputs: Sequence[Any],
    compile_key: Hashable,
    input_specs: Any = None,
    output_specs: Any = None,
    allow_cuda_graph: bool = True,
    input_output_aliases: Mapping[int, int] | None = None,
    library_versions: Sequence[str] = (),
    dynamic_shapes: bool = False,
    **constexprs: Any,
) -> Callable[..., tuple[jax.Array, ...]]:
    """Return ``call(*inputs) -> tuple(outputs)`` running ``launch`` as custom call ``tokenspeed_{target}``.

    ``launch``: a ``@cute.jit`` function ``launch(stream, *inputs, *outputs, **constexprs)``.
    ``outputs``: sequence of ``jax.ShapeDtypeStruct`` (workspace buffers are extra trailing outputs).
    ``compile_key``: hashable static config (frozen dataclass) identifying the generated code beyond
    operand shapes/dtypes and ``constexprs``; with arch + library versions it keys the compile caches.
    ``input_specs`` / ``output_specs``: optional ``cutlass.jax.TensorSpec`` per operand (layout, mode,
    divisibility, static); ``None`` = row-major with defaults.
    ``allow_cuda_graph``: False selects the ``tokenspeed_{target}_nograph`` target.
    ``input_output_aliases``: ``{input_index: output_index}`` buffers to donate.
    ``library_versions``: extra pip distributions whose versions join the key (e.g. ``"flash-attn-4"``).
    ``dynamic_shapes``: the launch reads every operand extent at run time (no ``static`` TensorSpec) and
    ``input_specs``/``output_specs`` give every operand explicit divisibility hints that hold for all
    extents; then one compiled object serves all extents (e.g. every token count) instead of one per
    shape. Without it, cutlass.jax infers each extent as a divisibility hint and compiles per shape.
    ``constexprs``: compile-time keyword arguments of ``launch``; runtime scalars must be operands.

    The returned callable works inside ``jax.jit``; it must be lowered for CUDA (on a GPU, or on CPU with
    ``lowering_platforms=("cuda",)`` under ``runtime.target_override``). See the module docstring.
    """
    name = target_name(target, allow_cuda_graph=allow_cuda_graph)
    if not callable(launch):
        raise TypeError(f"launch: expected a @cute.jit function, got {type(launch).__name__}")
    if compile_key is None:
        raise TypeError("compile_key: expected a hashable static config (frozen dataclass), got None")
    _check_hashable("compile_key", compile_key)
    if isinstance(outputs, (jax.ShapeDtypeStruct,)) or not isinstance(outputs, Sequence) or not outputs:
        raise TypeError(
            f"outputs: expected a non-empty sequence of jax.ShapeDtypeStruct, got {type(outputs).__name__}"
        )
    outs = []
    for i, o in enumerate(outputs):
        if not (hasattr(o, "shape") and hasattr(o, "dtype")):
            raise TypeError(f"outputs[{i}]: expected a jax.ShapeDtypeStruct, got {type(o).__name__}")
        if len(o.shape) == 0:
            raise ValueError(f"outputs[{i}]: 0-d outputs are not supported; use shape (1,)")
        outs.append(jax.ShapeDtypeStruct(tuple(int(d) for d in o.shape), jnp.dtype(o.dtype)))
    for k, v in constexprs.items():
        if _is_array(v):
            raise TypeError(
                f"{k}: got an array as a compile-time constant; runtime values (scales, lengths) must be "
                "operands (pass a shape-(1,) array as an input, see scalar_operand)"
            )
        _check_hashable(k, v)
    if dynamic_shapes and (input_specs is None or output_specs is None):
        raise ValueError(
            "dynamic_shapes: needs explicit input_specs and output_specs (TensorSpec divisibility hints "
            "valid for every extent); got None"
        )
    for d in library_versions:
        if not isinstance(d, str):
            raise TypeError(f"library_versions: expected distribution names, got {d!r}")

    import cutlass.jax as cjax

    register_target(name)
    _install_disk_cache()
    # The compiled object depends on CuTe DSL, the FFI ABI version cutlass.jax picks for this JAX, and the
    # libraries named by the op; not on the exact jax/jaxlib release.
    from cutlass.jax import get_cutlass_call_ffi_version

    versions = (
        *((d, _version(d)) for d in (*_BASE_VERSIONS, *library_versions)),
        ("cutlass_call_ffi", str(get_cutlass_call_ffi_version())),
    )
    fn = inspect.unwrap(getattr(launch, "__wrapped__", launch))
    launch_id = f"{getattr(launch, '__module__', '?')}.{getattr(launch, '__qualname__', repr(launch))}"
    try:
        src = inspect.getsourcefile(fn)
    except TypeError:
        src = None

    def call(*inputs: Any) -> tuple[jax.Array, ...]:
        for i, x in enumerate(inputs):
            if x is not None and getattr(x, "ndim", None) == 0:
                raise ValueError(
                    f"{name}: input {i} is 0-d; pass runtime scalars as shape-(1,) arrays "
                    "(tokenspeed_jax.ffi.scalar_operand)"
                )
        arch = _compile_arch()
        key = CompileKey(
            name, compile_key, arch, versions, launch_id, _file_digest(src), bool(dynamic_shapes)
        )
        inner = cjax.cutlass_call(
            launch,
            output_shape_dtype=tuple(outs),
            input_spec=input_specs,
            output_spec=output_specs,
            input_output_aliases=dict(input_output_aliases or {}),
            allow_cuda_graph=allow_cuda_graph,
            ffi_call_target=name,
            compile_options=f"--gpu-arch {arch}" if arch else None,
            compile_key=key,
            **constexprs,
        )

        @jax.custom_batching.custom_vmap
        def run(*args: Any) -> tuple[jax.Array, ...]:
            return tuple(inner(*args))

        @run.def_vmap
        def _no_vmap(axis_size, in_batched, *args):
            raise NotImplementedError(
                f"{name}: jax.vmap is not supported at the FFI layer; the public op handles batching "
                "(e.g. mla_decode folds a vmapped axis into its batch)"
            )

        return run(*inputs)

    call.__name__ = name
    call.__qualname__ = name
    return call


# Make ``tokenspeed_jax.ffi.device`` importable lazily (it imports CuTe DSL).
def __getattr__(attr: str) -> Any:
    if attr == "device":
        import importlib

        return importlib.import_module(__name__ + ".device")
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
