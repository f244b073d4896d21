"""The custom-call wrapper: :func:`custom_call` (see the package docstring: *Operand order*, *Runtime
scalars are operands*, *Architecture*, *Transformations*), :class:`LaunchRef` and :func:`scalar_operand`."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .compile_cache import _BASE_VERSIONS, CompileKey, _file_digest, _install_disk_cache, _version
from .names import register_target, target_name

__all__ = ["LaunchRef", "custom_call", "scalar_operand"]


def scalar_operand(x: Any, dtype: Any = jnp.float32) -> jax.Array:
    """A runtime scalar as the shape-``(1,)`` device array a kernel reads with ``device.load_scalar``.

    Accepts a Python number, a 0-d or 1-element array; casts to ``dtype``.
    """
    a = jnp.asarray(x, dtype=dtype)
    if a.size != 1:
        raise ValueError(f"scalar_operand: expected one element, got shape {a.shape}")
    return a.reshape((1,))


@dataclasses.dataclass(frozen=True)
class LaunchRef:
    """A ``@cute.jit`` launch function named by its import path: ``LaunchRef("pkg.kernels", "launch")``.

    :func:`custom_call` accepts it in place of the function.  The compile key names the function as
    ``module.name`` and digests the module's source file, located with ``importlib.util.find_spec`` (which
    imports the parent packages, not the module), exactly as for the function itself; so the key, and
    with it the in-memory and on-disk compile caches, are the same.  The module is imported only when
    CuTe DSL compiles the call (a cache miss), which calls the reference like the function: a process
    whose kernels are all cached never imports the kernel modules, nor what they import (FlashAttention-4
    and torch for the Hopper prefill).
    """

    module: str
    name: str

    @property
    def launch_id(self) -> str:
        """``module.qualname`` of the function, as :func:`custom_call` names a function passed directly."""
        return f"{self.module}.{self.name}"

    def source_file(self) -> str | None:
        """The module's source file, without importing the module."""
        return _module_file(self.module)

    def resolve(self) -> Callable[..., None]:
        """The function (imports its module)."""
        return getattr(importlib.import_module(self.module), self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return self.resolve()(*args, **kwargs)


@functools.cache
def _module_file(module: str) -> str | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


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

    ``launch``: a ``@cute.jit`` function ``launch(stream, *inputs, *outputs, **constexprs)``, or a
    :class:`LaunchRef` naming one (imported only when CuTe DSL compiles the call, not on a cache hit).
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
    if isinstance(launch, LaunchRef):
        launch_id, src = launch.launch_id, launch.source_file()
    else:
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
