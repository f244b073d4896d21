"""The custom-call boundary of tokenspeed-jax: named XLA FFI custom calls that run CuTe DSL kernels.

Every GPU kernel of the package reaches XLA through :func:`custom_call`, a thin layer over
``cutlass.jax.cutlass_call`` (nvidia-cutlass-dsl >= 4.8.1): cutlass.jax compiles the ``@cute.jit`` launch
function to a host object + cubin, embeds it in the HLO instruction as attributes (``module``, ``key``)
and executes it through the CuTe DSL runtime's FFI handler. This module adds what the package needs on
top of that, and nothing else (no runtime of its own). One module per concern, all re-exported here:
:mod:`.names` (target names, registration, export checks), :mod:`.compile_cache` (compile keys, the
on-disk cache and the guarded patch of cutlass.jax's private cache), :mod:`.call` (:func:`custom_call`,
:func:`scalar_operand`) and :mod:`.device` (device-side helpers, imports CuTe DSL).

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
      and compiling it; with the launch function passed as a :class:`LaunchRef` it does not import the
      kernel's module either (the key names the function and digests its source file without importing
      it). Keys whose text contains a memory address (``at 0x``) are not stable across
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

from typing import Any

from .call import LaunchRef, custom_call, scalar_operand
from .compile_cache import (
    CompileKey,
    cache_dir,
    cache_stats,
    cutlass_cache_layout_problem,
    install_disk_cache,
)
from .names import (
    TARGET_PREFIX,
    export_disabled_safety_checks,
    is_available,
    register_target,
    registered_targets,
    target_name,
)

__all__ = [
    "TARGET_PREFIX",
    "CompileKey",
    "LaunchRef",
    "cache_dir",
    "cache_stats",
    "custom_call",
    "cutlass_cache_layout_problem",
    "export_disabled_safety_checks",
    "install_disk_cache",
    "is_available",
    "register_target",
    "registered_targets",
    "scalar_operand",
    "target_name",
]


# Make ``tokenspeed_jax.ffi.device`` importable lazily (it imports CuTe DSL).
def __getattr__(attr: str) -> Any:
    if attr == "device":
        import importlib

        return importlib.import_module(__name__ + ".device")
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
