"""Shared benchmark harness: every contender on the same inputs in one process.

Timing: :func:`tokenspeed_jax.timing.bench` (re-exported here): median over rounds of back-to-back
asynchronous launches, JAX and torch contenders alike, every kernel of a call inside the timed region.
:func:`interleaved` times several contenders against each other in alternating rounds (the decode and
prefill benchmarks use it).  Its rounds are bursts of 20-50 ms; :func:`sustained` instead runs each contender back to
back for seconds and times the second half, where the H200 sits at its 700 W power cap and lowers the SM clock by
how much power a kernel draws (docs/notes/sm90_decode_journal.md, "Power"): the regime of a serving loop, and one where two kernels
of equal burst speed can differ by 10%.  :class:`GpuPoller` reads the SM clock and the power meanwhile
(``nvidia-smi``, read only).

Ceilings: :func:`measure_ceilings` measures the copy bandwidth (read + write of a large device-to-device
copy) and the bf16 (and fp8 where supported) matmul rate on random data, once per process.  A result's
``roofline_fraction`` is ``max(bytes / copy_bw, flops / matmul_rate) / time``: 1.0 is at the measured limit.

Output: :class:`Report` collects rows and writes JSON (with the command line, date, device and
ceilings) plus a PNG bar chart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokenspeed_jax.timing import bench  # noqa: F401  (re-exported for the benchmark scripts)

LARGE_US = 5000.0  # cases estimated above this many us per call are timed with fewer, longer rounds


def interleaved(fns: dict, est_us: float, *, rounds: int = 7, warmup: int = 1) -> dict:
    """Time the zero-argument callables ``fns`` (name -> fn) against each other, interleaved.

    Each contender is warmed up (``warmup`` calls), then one more call sizes its round (``iters``
    back-to-back launches, at least 20 ms, 50 ms for cases estimated above ``LARGE_US``, at most 1000).
    Then ``rounds`` rounds run; in each, every contender launches its ``iters`` calls and waits for the
    device (A-B-A-B...), the order rotated by one contender per round so that no contender always runs
    first or after the same neighbour (round-to-round spread on the H200 was up to 15%, 2026-11-29).
    Returns name -> {median_us, min_us, max_us, iters, samples_us}.
    """
    from tokenspeed_jax.timing import _sync

    min_round_s = 0.05 if est_us > LARGE_US else 0.02
    iters = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            _sync(fn())
        t0 = time.perf_counter()
        _sync(fn())
        dt = time.perf_counter() - t0
        iters[name] = max(1, min(1000, math.ceil(min_round_s / max(dt, 1e-6))))
    samples: dict = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn, n = fns[name], iters[name]
            t0 = time.perf_counter()
            out = None
            for _ in range(n):
                out = fn()
            _sync(out)
            samples[name].append((time.perf_counter() - t0) / n * 1e6)
    return {
        name: {
            "median_us": statistics.median(s),
            "min_us": min(s),
            "max_us": max(s),
            "iters": iters[name],
            "samples_us": [round(x, 1) for x in s],
        }
        for name, s in samples.items()
    }


class GpuPoller:
    """Context manager polling ``nvidia-smi`` (SM clock, memory clock, power, temperature, clock-throttle reasons)
    every ``period`` seconds in a thread; never changes a setting.  ``summary(since)`` gives the medians (and the
    minimum SM clock) of the polls taken at or after ``time.perf_counter()`` value ``since``; all ``None`` where
    ``nvidia-smi`` is missing."""

    QUERY = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"

    def __init__(self, period: float = 0.1):
        self.period, self.rows = period, []  # (perf_counter, [fields])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                p = subprocess.run(["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True, check=False, timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                return
            if p.returncode == 0 and p.stdout.strip():
                fields = [x.strip() for x in p.stdout.strip().splitlines()[0].split(",")]
                self.rows.append((time.perf_counter(), fields))
            time.sleep(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def summary(self, since: float = 0.0) -> dict:
        rows = [r for t, r in self.rows if t >= since]

        def col(i):
            return [float(r[i]) for r in rows if len(r) > i and r[i].replace(".", "").isdigit()]

        sm, pw = col(0), col(2)
        return {"sm_mhz_median": statistics.median(sm) if sm else None, "sm_mhz_min": min(sm) if sm else None,
                "power_w_median": statistics.median(pw) if pw else None,
                "throttle_reasons": sorted({r[4] for r in rows if len(r) > 4}), "polls": len(self.rows)}


def sustained(fns: dict, secs: float = 2.0, *, rounds: int = 2) -> dict:
    """Time the zero-argument callables ``fns`` (name -> fn) in steady state: in each of ``rounds`` rounds (the order
    rotating, as :func:`interleaved`), every contender launches back to back for ``secs`` seconds, synchronising
    about every 10 ms, and its µs per call is taken over the second half only (after the power controller settled),
    while :class:`GpuPoller` records the SM clock and power.  Returns name -> {median_us, min_us, max_us, samples_us,
    sm_mhz and power_w (medians over the rounds of each round's second-half median), throttle_reasons}."""
    from tokenspeed_jax.timing import _sync

    names = list(fns)
    samples: dict = {n: [] for n in names}
    clocks: dict = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn = fns[name]
            t0 = time.perf_counter()
            _sync(fn())
            batch = max(1, min(1000, math.ceil(0.01 / max(time.perf_counter() - t0, 1e-6))))
            marks = []  # (seconds since start, calls so far), one per synchronised batch
            calls = 0
            with GpuPoller() as gp:
                start = time.perf_counter()
                while not marks or marks[-1][0] < secs:
                    out = None
                    for _ in range(batch):
                        out = fn()
                    _sync(out)
                    calls += batch
                    marks.append((time.perf_counter() - start, calls))
            half = next(m for m in marks if m[0] >= secs / 2)
            last = marks[-1]
            if last[1] > half[1]:
                samples[name].append((last[0] - half[0]) / (last[1] - half[1]) * 1e6)
            else:  # (one batch longer than half the window: the whole window)
                samples[name].append(last[0] / last[1] * 1e6)
            clocks[name].append(gp.summary(since=start + half[0]))
    res = {}
    for name, s in samples.items():
        sm = [c["sm_mhz_median"] for c in clocks[name] if c["sm_mhz_median"] is not None]
        pw = [c["power_w_median"] for c in clocks[name] if c["power_w_median"] is not None]
        res[name] = {"median_us": statistics.median(s), "min_us": min(s), "max_us": max(s),
                     "samples_us": [round(x, 1) for x in s], "sm_mhz": statistics.median(sm) if sm else None,
                     "power_w": statistics.median(pw) if pw else None,
                     "throttle_reasons": sorted({t for c in clocks[name] for t in c["throttle_reasons"]})}
    return res


@dataclasses.dataclass
class Ceilings:
    copy_gbps: float  # read + write bytes per second / 1e9
    bf16_tflops: float
    fp8_tflops: float | None

    def time_floor_us(self, nbytes: float, flops: float, *, fp8: bool = False) -> float:
        rate = (self.fp8_tflops if fp8 and self.fp8_tflops else self.bf16_tflops) * 1e12
        return max(nbytes / (self.copy_gbps * 1e9), flops / rate) * 1e6


_CEILINGS: Ceilings | None = None


def measure_ceilings(*, copy_mib: int = 2048, n: int = 8192) -> Ceilings:
    """Measure (once per process) the copy bandwidth and the matmul rates on random data."""
    global _CEILINGS
    if _CEILINGS is not None:
        return _CEILINGS
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (copy_mib * 1024 * 1024 // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0000001)  # one read + one write of every element
    t = bench(lambda: copy(x))["median_us"]
    copy_gbps = 2 * x.nbytes / (t * 1e-6) / 1e9
    a = jax.random.normal(key, (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16)
    # Two spellings of one bf16 GEMM (bf16 out; fp32 accumulate then cast); XLA may pick different
    # library kernels for them, so the ceiling is the faster of the two.
    rates = []
    for mm in (jax.jit(lambda a, b: jnp.dot(a, b)),
               jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))):
        t = bench(lambda mm=mm: mm(a, b))["median_us"]
        rates.append(2 * n**3 / (t * 1e-6) / 1e12)
    bf16 = max(rates)
    fp8 = None
    try:
        a8, b8 = a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn)
        mm8 = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                       preferred_element_type=jnp.float32))
        t = bench(lambda: mm8(a8, b8))["median_us"]
        fp8 = 2 * n**3 / (t * 1e-6) / 1e12
    except Exception:  # noqa: BLE001  (no fp8 dot on this platform)
        fp8 = None
    _CEILINGS = Ceilings(copy_gbps, bf16, fp8)
    return _CEILINGS


@contextlib.contextmanager
def scoped_env(name: str, value: str):
    """Set environment variable ``name`` to ``value`` inside the block, then restore its previous state (a
    setting inherited by spawned workers)."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


class Report:
    """Rows of (case, contender, time, bytes, flops) -> JSON + PNG with the command that produced them."""

    def __init__(self, name: str, ceilings: Ceilings | None = None):
        self.name = name
        self.ceilings = ceilings
        self.rows: list[dict] = []
        from benchmarks.runinfo import provenance  # (command, date, device, jax, commit, source-tree hash)

        self.provenance = provenance()

    def add(self, case: str, contender: str, timing: dict | float | None, *, nbytes: float, flops: float,
            fp8: bool = False, note: str = "", **extra) -> dict:
        us = timing["median_us"] if isinstance(timing, dict) else timing
        row: dict[str, Any] = {"case": case, "contender": contender, "us": us, "bytes": nbytes,
                               "flops": flops, "note": note, **extra}
        if us:
            row["gbps"] = nbytes / (us * 1e-6) / 1e9
            row["tflops"] = flops / (us * 1e-6) / 1e12
            if self.ceilings:
                row["roofline_fraction"] = self.ceilings.time_floor_us(nbytes, flops, fp8=fp8) / us
        self.rows.append(row)
        return row

    def table(self) -> str:
        lines = [f"{'case':42s} {'contender':18s} {'us':>10s} {'GB/s':>8s} {'TFLOP/s':>8s} {'roof':>6s}"]
        for r in self.rows:
            if r["us"]:
                lines.append(f"{r['case']:42s} {r['contender']:18s} {r['us']:10.1f} {r['gbps']:8.0f} "
                             f"{r['tflops']:8.1f} {r.get('roofline_fraction', float('nan')):6.2f}")
            else:
                lines.append(f"{r['case']:42s} {r['contender']:18s} {'-':>10s}  {r['note']}")
        return "\n".join(lines)

    def write(self, json_path: str, png_path: str | None = None, **extra) -> dict:
        """The JSON (provenance, ceilings, rows and ``extra`` top-level fields) and, with ``png_path``, the plot;
        returns the document written."""
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        doc = {"name": self.name, **self.provenance,
               "ceilings": dataclasses.asdict(self.ceilings) if self.ceilings else None, "rows": self.rows, **extra}
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1, default=float)
        if png_path:
            plot(doc, png_path)
        return doc


def plot(doc: dict, png_path: str) -> None:
    """Grouped bars: one group per case, one bar per contender, height = roofline fraction (or TFLOP/s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if r.get("us")]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    conts = list(dict.fromkeys(r["contender"] for r in rows))
    metric = "roofline_fraction" if all("roofline_fraction" in r for r in rows) else "tflops"
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(cases) * max(1, len(conts)) / 2), 5))
    w = 0.8 / max(1, len(conts))
    for i, c in enumerate(conts):
        vals = [next((r[metric] for r in rows if r["case"] == k and r["contender"] == c), math.nan)
                for k in cases]
        ax.bar(np.arange(len(cases)) + i * w, vals, w, label=c)
    ax.set_xticks(np.arange(len(cases)) + 0.4 - w / 2)
    ax.set_xticklabels(cases, rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("fraction of measured roofline" if metric == "roofline_fraction" else "TFLOP/s")
    ax.set_title(f"{doc['name']} on {doc['device']} ({doc['date']})", fontsize=9)
    ax.legend(fontsize=7)
    fig.text(0.01, 0.01, doc["command"][:160], fontsize=6)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def decode_cost(batch: int, q_len: int, heads: int, kv_len: int, *, d: int = 576, dv: int = 512,
                elt_bytes: int = 2, out_bytes: int = 2) -> tuple[float, float]:
    """(bytes, flops) of one absorbed MLA decode: KV read once per request, q read, out written."""
    nbytes = batch * (kv_len * d * elt_bytes + q_len * heads * (d * elt_bytes + dv * out_bytes))
    flops = 2.0 * batch * q_len * heads * kv_len * (d + dv)
    return float(nbytes), flops


def prefill_cost(lens_q: list[int], lens_k: list[int], hq: int, hk: int, *, dqk: int = 192, dv: int = 128,
                 causal: bool, elt_bytes: int = 2) -> tuple[float, float]:
    """(bytes, flops) of a ragged prefill; causal counts only the visible (bottom-right) scores."""
    flops = 0.0
    nbytes = 0.0
    for lq, lk in zip(lens_q, lens_k):
        if causal:
            vis = sum(max(0, min(lk, i + lk - lq + 1)) for i in range(lq)) if lq < 4096 else (
                lq * lk - lq * (lq - 1) / 2 if lk >= lq else lk * (lk + 1) / 2)
        else:
            vis = lq * lk
        flops += 2.0 * hq * vis * (dqk + dv)
        nbytes += elt_bytes * (lq * hq * (dqk + dv) + lk * hk * (dqk + dv))
    return nbytes, flops
