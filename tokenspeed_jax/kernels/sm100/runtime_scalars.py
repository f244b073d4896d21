"""Runtime (device-resident) float scalars for the TokenSpeed kernel classes (CuTe DSL only).

The TokenSpeed MLA classes take ``softmax_scale`` / ``output_scale`` (and the FMHA class its three
scales) as ``cutlass.Float32`` *host* values: their ``@cute.jit __call__`` multiplies the softmax scale by
``log2(e)`` on the host and passes the results to its ``@cute.kernel`` methods as kernel parameters.  Behind
an XLA custom call the scales are device buffers (operands of the call, so a new value never recompiles
and the call stays CUDA-graph capturable); the host launcher cannot read them.

:class:`DeviceScalar` bridges the two without touching TokenSpeed's source: it stands in for the
``Float32`` argument of ``__call__``, absorbs host-side multiplications by Python constants (``x * LOG2_E``)
into a compile-time factor, travels into the kernel as the pointer of the shape-``(1,)`` operand, and
:func:`with_device_scalars` derives a subclass of a kernel class whose named ``@cute.kernel`` methods load
the value from global memory (times the factor) on entry and then run the parent's unchanged kernel body
with an ordinary ``Float32``.  The parent's body is re-decorated as a ``@cute.jit`` helper from its
original (un-preprocessed) code object, i.e. it is the same Python function, traced inline.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import types

import cutlass
from cutlass import cute


class DeviceScalar:
    """A float32 scalar in device memory, optionally times a compile-time factor.

    Host side (inside a ``@cute.jit`` launcher) it only supports multiplication by Python numbers, which
    folds into :attr:`factor`.  Passed to a kernel derived with :func:`with_device_scalars` it becomes the
    ``Float32`` ``tensor[0] * factor`` inside the kernel.
    """

    def __init__(self, tensor: cute.Tensor, factor: float = 1.0):
        self.tensor = tensor
        self.factor = float(factor)

    # host-side algebra: only constant factors, which stay compile-time ---------------------------
    def __mul__(self, other):
        if isinstance(other, numbers.Real) and not isinstance(other, bool):
            return DeviceScalar(self.tensor, self.factor * float(other))
        raise TypeError(
            f"DeviceScalar: only multiplication by a Python number is supported on the host, got "
            f"{type(other).__name__}"
        )

    __rmul__ = __mul__

    # DSL value protocol: the kernel parameter is the tensor (pointer + layout) --------------------
    def __extract_mlir_values__(self):
        return cutlass.extract_mlir_values(self.tensor)

    def __new_from_mlir_values__(self, values):
        return DeviceScalar(cutlass.new_from_mlir_values(self.tensor, values), self.factor)

    def load(self) -> cutlass.Float32:
        """Inside a kernel: the value, as ``Float32`` (one global load)."""
        v = self.tensor[0].to(cutlass.Float32)
        if self.factor != 1.0:
            v = v * cutlass.Float32(self.factor)
        return v


def _fresh_copy(fn):
    """A new function object with ``fn``'s original code (before any DSL preprocessing)."""
    code = getattr(fn, "_original_code", fn.__code__)
    g = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    g.__kwdefaults__ = fn.__kwdefaults__
    g.__qualname__ = fn.__qualname__
    g.__module__ = fn.__module__
    g.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    g.__doc__ = fn.__doc__
    return g


def _loading_kernel(parent_kernel, scalar_params: tuple[str, ...]):
    """A ``@cute.kernel`` with ``parent_kernel``'s signature that loads ``scalar_params`` on entry."""
    orig = parent_kernel.__wrapped__
    sig = inspect.signature(orig)
    names = list(sig.parameters)
    missing = [p for p in scalar_params if p not in names]
    if missing:
        raise TypeError(f"{orig.__qualname__}: no parameter(s) {missing}; parameters are {names}")
    positions = {names.index(p) - 1: p for p in scalar_params}  # index into *args after self
    body = cute.jit(_fresh_copy(orig))

    def kernel(self, *args, **kwargs):
        args = [a.load() if (i in positions and isinstance(a, DeviceScalar)) else a for i, a in enumerate(args)]
        kwargs = {
            k: (v.load() if (k in scalar_params and isinstance(v, DeviceScalar)) else v) for k, v in kwargs.items()
        }
        body(self, *args, **kwargs)

    params = [
        p.replace(annotation=inspect.Parameter.empty) if p.name in scalar_params else p
        for p in sig.parameters.values()
    ]
    kernel.__signature__ = sig.replace(parameters=params)
    kernel.__name__ = orig.__name__
    kernel.__qualname__ = orig.__qualname__
    return cute.kernel(preprocess=False)(kernel)


@functools.cache
def with_device_scalars(cls: type, kernels: tuple[tuple[str, tuple[str, ...]], ...]) -> type:
    """Subclass of ``cls`` whose ``@cute.kernel`` methods ``name`` load the parameters ``params`` (given
    as :class:`DeviceScalar`) from device memory, for each ``(name, params)`` in ``kernels``.

    Everything else (constructor, ``__call__``, device code) is the parent's.
    """
    ns = {name: _loading_kernel(getattr(cls, name), tuple(params)) for name, params in kernels}
    ns["__doc__"] = f"{cls.__name__} reading {dict(kernels)} from device memory (tokenspeed_jax)."
    ns["__module__"] = __name__
    return type(f"{cls.__name__}DeviceScalars", (cls,), ns)
