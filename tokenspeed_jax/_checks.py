"""Trace-time argument checks shared by the public ops.

Every failure is a ``TypeError`` (wrong kind / dtype) or ``ValueError`` (wrong shape or value) whose
message starts with the argument name and says what was expected and what was given.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from tokenspeed_jax.problems import ALL_DTYPES


def array(x, name: str):
    """Accept jax arrays, tracers, numpy arrays; reject anything without shape/dtype."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    return x


def rank(x, name: str, n: int, layout: str) -> None:
    if x.ndim != n:
        raise ValueError(f"{name}: expected rank {n} {layout}, got shape {tuple(x.shape)}")


def int_dtype(x, name: str) -> None:
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name}: expected an int32 array, got dtype {jnp.dtype(x.dtype).name}")


def float_dtype(x, name: str, allowed=ALL_DTYPES) -> str:
    d = jnp.dtype(x.dtype).name
    if d not in allowed:
        raise TypeError(f"{name}: expected dtype in {list(allowed)}, got {d}")
    return d


def same_dtype(a, an: str, b, bn: str) -> None:
    if jnp.dtype(a.dtype) != jnp.dtype(b.dtype):
        raise TypeError(
            f"{bn}: expected the same dtype as {an} ({jnp.dtype(a.dtype).name}), got {jnp.dtype(b.dtype).name}"
        )


def dim(name: str, what: str, got: int, expected: int) -> None:
    if got != expected:
        raise ValueError(f"{name}: expected {what} = {expected}, got {got}")


def static_bool(v, name: str) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a Python bool, got {type(v).__name__} {v!r}")
    return bool(v)


def static_pos_int(v, name: str, *, allow_none: bool = False) -> int | None:
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (numbers.Integral,)):
        raise TypeError(f"{name}: expected a positive Python int{' or None' if allow_none else ''}, got {v!r}")
    if v <= 0:
        raise ValueError(f"{name}: expected a positive int, got {v}")
    return int(v)


def f32_scalar(v, name: str):
    """A runtime float32 scalar operand from a Python number or a 0-d (or size-1) array / tracer."""
    if isinstance(v, bool):
        raise TypeError(f"{name}: expected a float or a float32 scalar array, got bool")
    if isinstance(v, numbers.Real):
        return jnp.asarray(v, jnp.float32)
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        if int(np.prod(v.shape)) != 1:
            raise ValueError(f"{name}: expected a scalar, got shape {tuple(v.shape)}")
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(f"{name}: expected a floating scalar, got dtype {jnp.dtype(v.dtype).name}")
        return jnp.reshape(v, ()).astype(jnp.float32)
    raise TypeError(f"{name}: expected a float or a float32 scalar array, got {type(v).__name__}")


def is_concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)
