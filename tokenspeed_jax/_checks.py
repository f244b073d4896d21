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
    """Integer arrays only (bool and floats are refused); int32 is the native width, other widths and
    unsigned types are clamped in their own dtype (:func:`clamp_index`)."""
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
        try:
            return jnp.asarray(float(v), jnp.float32)  # float(): an int beyond a double raises here
        except OverflowError:
            raise ValueError(f"{name}: expected a float32 scalar, got a value too large for a float "
                             f"({type(v).__name__})") from None
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        if int(np.prod(v.shape)) != 1:
            raise ValueError(f"{name}: expected a scalar, got shape {tuple(v.shape)}")
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(f"{name}: expected a floating scalar, got dtype {jnp.dtype(v.dtype).name}")
        return jnp.reshape(v, ()).astype(jnp.float32)
    raise TypeError(f"{name}: expected a float or a float32 scalar array, got {type(v).__name__}")


def is_concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


INT32_MAX = 2**31 - 1


def clamp_index(x, lo: int, hi: int):
    """``x`` clamped to ``[lo, hi]`` **in its own dtype**, then as int32 (the ops' runtime-data clamp).

    Casting first would wrap: uint32 ``2**32 - 1`` or int64 ``2**31`` become -1 / ``-2**31`` in int32 and
    clamp to the wrong end.  A NumPy array (int64 by default) is clamped by NumPy before JAX sees it,
    since JAX without ``jax_enable_x64`` converts 64-bit arrays to 32 bits on entry (wrapping); a 64-bit
    NumPy array passed *into* a ``jax.jit`` is converted at the jit boundary, before this code runs
    (pass int32 there).  Bounds outside the dtype's range are dropped (no value can pass them)."""
    hi = min(hi, INT32_MAX)
    if isinstance(x, (np.ndarray, np.generic)):
        info = np.iinfo(x.dtype)
        return jnp.asarray(np.clip(x, max(lo, info.min), min(hi, info.max)).astype(np.int32))
    info = jnp.iinfo(x.dtype)
    lo_, hi_ = max(lo, info.min), min(hi, info.max)
    if lo_ > info.min:
        x = jnp.maximum(x, jnp.asarray(lo_, x.dtype))
    if hi_ < info.max:
        x = jnp.minimum(x, jnp.asarray(hi_, x.dtype))
    return x.astype(jnp.int32)


def index_in_range(x, lo: int | None, hi: int | None):
    """Boolean array: ``lo <= x <= hi`` (None: no bound) compared in ``x``'s own dtype (NumPy arrays by
    NumPy), for the ``validate=True`` checks: casting to int32 first would call uint32 ``2**32 - 1``
    negative and int64 ``2**32`` zero."""
    npy = isinstance(x, (np.ndarray, np.generic))
    xp, info = (np, np.iinfo(x.dtype)) if npy else (jnp, jnp.iinfo(x.dtype))
    ok = xp.ones(np.shape(x), bool)
    if lo is not None and lo > info.min:
        ok = ok & (x >= xp.asarray(lo, x.dtype)) if lo <= info.max else xp.zeros(np.shape(x), bool)
    if hi is not None and hi < info.max:
        ok = ok & (x <= xp.asarray(hi, x.dtype)) if hi >= info.min else xp.zeros(np.shape(x), bool)
    return jnp.asarray(ok)
