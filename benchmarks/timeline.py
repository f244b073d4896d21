"""The GPU timeline of back-to-back decode calls: each kernel's duration and the gaps between them, under load.

    source .device/bootstrap.sh && python -m benchmarks.timeline --cases tail,64,81920,32,1 uniform,256,4096,32,1 \\
        --out $OUT/timeline.json

For each case (``benchmarks.decode_varlen``'s ``DIST,B,CAP,H,S``, page 64, the same inputs as its table) it runs
``--calls`` calls of each contender back to back, as the table's rounds do, and records the kernels the GPU ran
through CUPTI (``torch.profiler``, which traces every kernel of the process, JAX's included). Contenders: ``ours
{dt}`` (the schedule computed in the call), ``ours {dt} kernel`` (on a schedule shared by the calls, as a model's
layers share it), ``FlashMLA bf16`` and ``FlashMLA fp8`` (the fork). Per contender: the span from the first
kernel's start to the last one's end divided by the calls (``us_per_call``: what the table's interleaved rounds
time, without the host's last sync), each kernel kind's median duration (``schedule``, ``main``, ``combine``,
FlashMLA's own kernel names, ``other`` for XLA's) and the idle time per call (``gap_us``: the span minus the time
some kernel ran). Where ``us_per_call`` of ``ours {dt}`` exceeds ``ours {dt} kernel`` by more than the schedule
kernel's duration, the rest is launch gaps, which ``gap_us`` shows.  Our combine is launched by PDL while the main
grid runs and waits for it, so its duration is about the main kernel's: what it adds is ``us_per_call - gap_us -
main - schedule``.  ``--contenders NAME ...`` times only those (FlashMLA is set up only when named); ``--config
NAME`` adds that kernel config (``sm90_decode.CONFIGS``, or ``NAME/noprefetch``: ``benchmarks.decode.named_config``)
per call and shared, e.g. ``--config transposed/noprefetch`` to time the config built without ``prefetch`` per call
(docs/sm90_decode_schedule.md, "The schedule's cost when not shared").

Unlike ``benchmarks/kernel_times.py`` (Nsight Compute: each kernel alone, serialized, caches flushed), this is the
timeline of the sustained run whose totals the README's table reports: it splits a call's time into kernels and
launch gaps (what it found: ``docs/sm90_decode_schedule.md``, "Not done yet"; H100, 2026-12-06:
``benchmarks/results/decode_sm90_timeline_h100.json``). Its
parsing and accounting are tested on the CPU
(``tests/test_decode_benchmark.py::test_timeline_summary_counts_gaps_and_overlap_once``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import tempfile


def kind(name: str) -> str:
    """Our kernels as ``benchmarks/kernel_times.py`` names them, FlashMLA's by their own name, XLA's ``other``."""
    from benchmarks.kernel_times import kind as our_kind

    ours = our_kind(name, "")
    if ours is not None:
        return ours
    if "flash" in name.lower() or "mla" in name.lower():
        return name[:60]
    return "other"


def kernels(fn, calls: int) -> list[tuple[float, float, str]]:
    """``(start us, duration us, name)`` of every kernel the GPU ran during ``calls`` calls of ``fn``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tokenspeed_jax.timing import _sync

    for _ in range(3):
        _sync(fn())
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = None
        for _ in range(calls):
            out = fn()
        _sync(out)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    return sorted((float(e["ts"]), float(e["dur"]), e["name"]) for e in trace.get("traceEvents", [])
                  if e.get("cat") == "kernel" and "dur" in e)


def summarize(ks: list[tuple[float, float, str]], calls: int) -> dict:
    if not ks:
        return {"kernels": 0}
    span = max(t + d for t, d, _ in ks) - ks[0][0]
    busy, end = 0.0, ks[0][0]
    for t, d, _ in ks:  # union of the kernels' intervals (PDL-launched kernels may overlap their predecessor)
        busy += max(0.0, t + d - max(t, end))
        end = max(end, t + d)
    by = collections.defaultdict(list)
    for _, d, n in ks:
        by[kind(n)].append(d)
    return {"kernels": len(ks), "us_per_call": span / calls, "gap_us": (span - busy) / calls,
            "kinds": {k: {"median_us": statistics.median(v), "per_call": len(v) / calls} for k, v in by.items()}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", required=True, metavar="DIST,B,CAP,H,S")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default="/tmp/decode_timeline.json")
    ap.add_argument("--contenders", nargs="+", metavar="NAME",
                    help="only these contenders (names as in the JSON, e.g. 'ours bf16 kernel'); default: all")
    ap.add_argument("--config", action="append", default=[], metavar="NAME",
                    help="also kernel config NAME of sm90_decode.CONFIGS (or NAME/noprefetch) where it runs the "
                         "case: 'ours {dt} NAME' "
                         "(its schedule in the call) and 'ours {dt} kernel NAME' (shared); repeatable")
    a = ap.parse_args(argv)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import jax.numpy as jnp

    from benchmarks.decode import config_applies, decode_fn
    from benchmarks.decode_varlen import case_of, flashmla_calls, inputs, lengths, our_contenders
    from benchmarks.runinfo import provenance

    try:
        import flash_mla as fm
    except Exception as e:  # noqa: BLE001
        print("flash_mla unavailable:", e)
        fm = None

    doc = {"name": "decode timeline (CUPTI via torch.profiler)", **provenance(), "calls": a.calls, "cases": {}}
    for i, spec in enumerate(a.cases):
        dist, B, cap, H, S = spec.split(",")
        B, cap, H, S = int(B), int(cap), int(H), int(S)
        c = case_of(dist, B, cap, H, S)
        q, kv, bt, sl, scale = inputs(c, lengths(dist, B, cap, a.seed + i), a.seed + i)
        q8, kv8 = q.astype(jnp.float8_e4m3fn), kv.astype(jnp.float8_e4m3fn)
        ours = our_contenders(q, kv, q8, kv8, bt, sl, scale, c, tuple(a.config))
        keep = {"ours bf16", "ours bf16 kernel", "ours fp8", "ours fp8 kernel"}
        keep |= {f"ours {dt} kernel {name}" for dt in ("bf16", "fp8") for name in a.config}
        fns = {n: (lambda f=f, args=args: f(*args)) for n, (f, args, _) in ours.items() if n in keep}
        for name in a.config:  # (the config's schedule computed in the call, as mla_decode does)
            for dt, qq, kk in (("bf16", q, kv), ("fp8", q8, kv8)):
                cdt = dataclasses.replace(c, dtype="float8_e4m3fn" if dt == "fp8" else "bfloat16")
                if config_applies(cdt, name):
                    fns[f"ours {dt} {name}"] = (lambda f=decode_fn(cdt, "sm90", name), args=(qq, kk, bt, sl, scale):
                                                f(*args))
        if fm is not None and (not a.contenders or any(n.startswith("FlashMLA") for n in a.contenders)):
            run, run8 = flashmla_calls(fm, q, kv, bt, sl)
            fns["FlashMLA bf16"], fns["FlashMLA fp8"] = run, run8
        if a.contenders:
            fns = {n: fn for n, fn in fns.items() if n in a.contenders}
        res = {}
        for n, fn in fns.items():
            try:
                res[n] = summarize(kernels(fn, a.calls), a.calls)
            except Exception as e:  # noqa: BLE001
                res[n] = {"error": str(e)[:200]}
            print(c.name, n, json.dumps(res[n]), flush=True)
        doc["cases"][c.name] = res
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
        del kv, kv8


if __name__ == "__main__":
    main()
