"""Wall-clock timing of asynchronous device work, shared by the demo and ``benchmarks/``.

A contender is a zero-argument callable that launches its work and returns what it produced (JAX arrays
or torch tensors).  :func:`bench` warms it up, then runs ``repeats`` rounds; each round launches it
``iters`` times back to back (asynchronous dispatch keeps the device queue full, so launch overhead hides
behind kernel time wherever kernels are longer than a dispatch) and waits for the device; the round's
wall time divided by ``iters`` is one sample and the median sample is reported.  JAX and torch
contenders are timed the same way, every kernel of a call inside the timed region.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def _sync(result: Any) -> None:
    leaves = jax.tree_util.tree_leaves(result)
    torch_seen = False
    for x in leaves:
        if isinstance(x, jax.Array):
            x.block_until_ready()
        elif type(x).__module__.startswith("torch"):
            torch_seen = True
    if torch_seen:
        import torch

        torch.cuda.synchronize()


def bench(fn: Callable[[], Any], *, warmup: int = 3, iters: int = 10, repeats: int = 7,
          min_round_s: float = 0.02) -> dict:
    """Median per-call time of ``fn`` in microseconds (see the module docstring for the method)."""
    for _ in range(warmup):
        _sync(fn())
    # Grow iters until a round lasts long enough to dwarf the host's wait/sync cost.
    while True:
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn()
        _sync(out)
        dt = time.perf_counter() - t0
        if dt >= min_round_s or iters >= 1000:
            break
        iters = min(1000, max(iters * 2, int(iters * min_round_s / max(dt, 1e-6)) + 1))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn()
        _sync(out)
        samples.append((time.perf_counter() - t0) / iters * 1e6)
    return {"median_us": statistics.median(samples), "min_us": min(samples), "max_us": max(samples),
            "iters": iters, "repeats": repeats}
