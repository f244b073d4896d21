"""Device facts: which platform / SM architecture a call targets, and the override used to compile and
lower for a GPU on a machine that has none.

The target of a call is, in order:

1. the innermost :func:`target_override` context, else
2. the ``TOKENSPEED_JAX_TARGET`` environment variable (``"sm_90a"``, ``"sm_100a:148"`` = arch and SM
   count, or ``"cpu"``), else
3. JAX's default backend; on CUDA, the first device's compute capability and multiprocessor count.

Overrides exist so that CPU-only CI can trace and lower a jitted call for CUDA
(``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``) through the real GPU backends; a
lowered module is compiled (to PTX/cubin) but never executed there.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import jax

from tokenspeed_jax.problems import Target

# SM counts of the parts we know, used when a target is forced without a device to query.
_DEFAULT_SMS = {"sm_90a": 132, "sm_100a": 148, "sm_103a": 148, "sm_110a": 148}

_override: contextvars.ContextVar[Target | None] = contextvars.ContextVar("tokenspeed_target", default=None)


def arch_from_capability(major: int, minor: int) -> str:
    """``(9, 0) -> "sm_90a"``; the ``a`` (arch-specific) suffix is what wgmma / tcgen05 need."""
    return f"sm_{major}{minor}a"


def _parse(spec: str) -> Target:
    spec = spec.strip()
    if spec in ("cpu", "tpu", "rocm"):
        return Target(spec)
    arch, _, sms = spec.partition(":")
    if not arch.startswith("sm_"):
        raise ValueError(f"TOKENSPEED_JAX_TARGET: expected 'cpu' or 'sm_XXa[:num_sms]', got {spec!r}")
    return Target("cuda", arch, int(sms) if sms else _DEFAULT_SMS.get(arch, 132))


@functools.lru_cache(maxsize=None)
def _device_target(platform: str) -> Target:
    if platform not in ("gpu", "cuda"):
        return Target(platform)
    dev = jax.devices(platform)[0]
    cc = getattr(dev, "compute_capability", None)
    if cc is None:  # ROCm or an unknown plugin
        return Target("rocm")
    major, minor = (int(x) for x in str(cc).split("."))
    return Target("cuda", arch_from_capability(major, minor), getattr(dev, "core_count", None))


def target_is_explicit() -> bool:
    """True when the target comes from :func:`target_override` or ``TOKENSPEED_JAX_TARGET``, not from JAX's
    default device (then ``backend="auto"`` defers the choice for CUDA to the lowering platform)."""
    return _override.get() is not None or bool(os.environ.get("TOKENSPEED_JAX_TARGET"))


def current_target() -> Target:
    """The target a call traced now will run on (see the module docstring for the order)."""
    t = _override.get()
    if t is not None:
        return t
    env = os.environ.get("TOKENSPEED_JAX_TARGET")
    if env:
        return _parse(env)
    return _device_target(jax.default_backend())


@contextlib.contextmanager
def target_override(arch: str | None = None, *, num_sms: int | None = None, platform: str = "cuda"):
    """Trace calls as if for ``arch`` (e.g. ``"sm_100a"``), without a device of that kind.

    >>> with target_override("sm_90a"):
    ...     lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    """
    t = Target("cpu") if arch is None and platform == "cpu" else Target(
        platform, arch, num_sms if num_sms is not None else _DEFAULT_SMS.get(arch or "", 132)
    )
    token = _override.set(t)
    try:
        yield t
    finally:
        _override.reset(token)
