"""Device-side helpers for kernels launched through :func:`tokenspeed_jax.ffi.custom_call` (CuTe DSL only).

Runtime scalars (softmax scale, FP8 scales) arrive as shape-``(1,)`` tensors (see the ffi module
docstring). Read them with :func:`load_scalar` inside a ``@cute.kernel``; it is a plain global load of
element 0, converted to the requested type, so the compiled code is independent of the value.
"""

from __future__ import annotations

import cutlass
from cutlass import cute


@cute.jit
def load_scalar(t: cute.Tensor, dtype: cutlass.Constexpr = cutlass.Float32):
    """Element 0 of the 1-element tensor ``t`` (a runtime scalar operand), as ``dtype``."""
    return t[0].to(dtype)
