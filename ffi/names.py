"""Target names of the tokenspeed custom calls and their registration with JAX (see the package docstring:
*Target names*, *CUDA graphs*, *Transformations*)."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable
from typing import Any

import jax

__all__ = [
    "TARGET_PREFIX",
    "export_disabled_safety_checks",
    "is_available",
    "register_target",
    "registered_targets",
    "target_name",
]

logger = logging.getLogger("tokenspeed_jax.ffi")

TARGET_PREFIX = "tokenspeed_"
_NOGRAPH_SUFFIX = "_nograph"
_TARGET_RE = re.compile(r"^[a-z0-9][a-z0-9_]*$")

_lock = threading.Lock()
_registered: set[str] = set()


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
