"""Export GPU code from a machine without a GPU: :func:`export_for_gpu`.

``jax.export`` of a jitted function that calls the tokenspeed ops for CUDA needs three things that a plain
``jax.export.export(jax.jit(f), platforms=("cuda",))`` on a CPU host does not give it:

1. the GPU architecture, which JAX cannot query without a device: the trace runs under
   :func:`tokenspeed_jax.target_override` (without it, ``backend="auto"`` raises at lowering rather than
   export the XLA reference, see :func:`tokenspeed_jax.backends.defer_to_lowering_platform`);
2. CuTe DSL compiling for that architecture: ``CUTE_DSL_ARCH`` must name it before ``cutlass`` is first
   imported (this helper sets it when ``cutlass`` is not imported yet, and the FFI layer raises a clear
   error when an imported CuTe DSL targets another arch);
3. the ``tokenspeed_*`` custom calls allowed in the artifact (``disabled_checks``): they carry their compiled
   kernel inside the module and have no JAX compatibility guarantee.

Errors that would quote the module (with its embedded kernel binaries) are shortened to the custom-call
names.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax

__all__ = ["export_for_gpu", "summarize_module_error"]

_BINARY_ATTR = re.compile(r'(module|key) = "(?:[^"\\]|\\.){64,}"')
_MAX_ERROR_CHARS = 2000


def summarize_module_error(text: str, limit: int = _MAX_ERROR_CHARS) -> str:
    """``text`` with every embedded kernel binary (``module = "..."`` / ``key = "..."`` attributes of our
    custom calls) replaced by its length, then cut to ``limit`` characters."""
    text = _BINARY_ATTR.sub(lambda m: f'{m.group(1)} = <{len(m.group(0))} bytes elided>', text)
    if len(text) > limit:
        text = text[:limit] + f" ... [{len(text) - limit} more characters elided]"
    return text


def export_for_gpu(
    fun: Callable[..., Any],
    *args: Any,
    arch: str = "sm_90a",
    num_sms: int | None = None,
    platforms: Sequence[str] = ("cuda",),
    disabled_checks: Sequence[Any] = (),
    **kwargs: Any,
) -> jax.export.Exported:
    """``jax.export`` ``fun(*args, **kwargs)`` for a CUDA GPU of ``arch``, on any host (a CPU is enough).

    ``fun``: a function or a ``jax.jit``-wrapped one whose trace has not been cached for another target
    (a jitted function already traced on this CPU keeps that trace; pass the plain function).
    ``args``: arrays or ``jax.ShapeDtypeStruct`` (symbolic shapes work where the ops allow them).
    ``arch``: ``"sm_90a"`` (Hopper) or ``"sm_100a"`` / ``"sm_103a"`` (Blackwell); ``num_sms`` defaults to
    the part's (132 / 148). ``disabled_checks`` adds to the custom-call checks this helper disables.

    Returns the ``jax.export.Exported``; ``exp.mlir_module()`` names the ``tokenspeed_*`` custom calls and
    ``exp.serialize()`` gives the bytes to ship. Deserialising needs ``tokenspeed_jax`` imported and its
    targets registered (:func:`tokenspeed_jax.ffi.register_target`, done by tracing any op).
    """
    import tokenspeed_jax.ffi as ffi
    from tokenspeed_jax.runtime import target_override

    if "cutlass" not in sys.modules and not os.environ.get("CUTE_DSL_ARCH"):
        os.environ["CUTE_DSL_ARCH"] = arch  # read once, when CuTe DSL is first imported
    jitted = fun if hasattr(fun, "trace") else jax.jit(fun)
    with target_override(arch, num_sms=num_sms):
        jitted.trace(*args, **kwargs)  # registers the tokenspeed_* targets this call uses
        checks = (*(ffi.export_disabled_safety_checks() if ffi.is_available() else ()), *disabled_checks)
        try:
            return jax.export.export(jitted, platforms=tuple(platforms), disabled_checks=checks)(
                *args, **kwargs)
        except ValueError as e:
            msg = str(e)
            if len(msg) <= _MAX_ERROR_CHARS:
                raise
            raise ValueError(summarize_module_error(msg)) from None
