"""Per-warpgroup timeline of the sm90 decode loops: a debug build with ``clock64`` marks.

    source .device/bootstrap.sh && python -m benchmarks.trace_decode --cases 64,16384,64,16,1 64,16384,64,32,4
    source .device/bootstrap.sh && python -m benchmarks.trace_decode --dtype bfloat16 --cases 64,16384,64,32,4
    source .device/bootstrap.sh && python -m benchmarks.trace_decode --config seesaw --dtype bfloat16 --cases ...
    source .device/bootstrap.sh && python -m benchmarks.trace_decode --dtype bfloat16 --sustain 3 --cases 64,81920,64,16,1

The traced kernel is the config ``select_config`` picks for the case (``tokenspeed_jax.backends.sm90_decode``), or
``--config NAME`` (a name of ``sm90_decode.CONFIGS``).  The transposed 16-bit loop has no traced build: where the
table picks it (16-bit, S x H <= 32, pages >= 32) the seesaw loop with the producer warpgroup is traced instead, and
the normal build it is checked against is that config too.

``--sustain S`` runs the normal build back to back for S seconds and queues the traced run right behind it, so its
timeline is taken at the clocks of sustained load (memory-bound shapes sit at the H200's 700 W power cap there), to
compare with the one-launch timeline.

Runs a debug build of the kernel (``tokenspeed_jax.kernels.sm90.decode.launch_decode_traced``) in which thread 0 of
each warpgroup writes ``clock64`` at the trace points of its first ``--iters`` loop iterations (the loop's events:
``TRACE_EVENTS``, ``TRACE_EVENTS_OT``, ``TRACE_EVENTS_OWN``), for the first ``--ctas`` CTAs, into an extra int64 output
of the custom call.  The normal builds carry none of this.  Prints, per warpgroup, the median and the 10th / 90th
percentiles over CTAs and iterations (the first two iterations skipped: warm-up) of the cycles spent between
consecutive events, i.e. what each phase of an iteration costs and where a warpgroup waits for the other; and writes
all raw timestamps to ``--out`` (JSON).

Checks the traced output against the normal build's on the same inputs (the debug build must compute the same
result: bitwise, since the marks only add stores of their own), so a timeline is never read from a broken build.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time


def traced_config(prob, name: str | None = None):
    """The config a trace runs for ``prob``: ``name`` (``sm90_decode.CONFIGS``) or :func:`select_config`'s pick, the
    transposed 16-bit loop (no traced build) replaced by the seesaw loop with the producer warpgroup, without prefetch
    (the debug builds time one piece's loop; ``build_decode_kernel`` refuses prefetch with ``trace``)."""
    from tokenspeed_jax.backends import sm90_decode

    cfg = sm90_decode.CONFIGS[name] if name else sm90_decode.select_config(prob)
    if cfg.loop == "transposed":
        cfg = sm90_decode.CONFIGS["seesaw"]
    cfg = dataclasses.replace(cfg, prefetch=False)
    sm90_decode.check_config(prob, cfg)
    return cfg


def trace_events(cfg):
    """The event names of ``cfg``'s loop (its ``TRACE_EVENTS`` table)."""
    from tokenspeed_jax.kernels.sm90.decode_trace import TRACE_EVENTS
    from tokenspeed_jax.kernels.sm90.fp8_transposed_pv import TRACE_EVENTS_OT
    from tokenspeed_jax.kernels.sm90.fp8_transposed import TRACE_EVENTS_OWN

    return {"fp8_transposed_pv": TRACE_EVENTS_OT, "fp8_transposed": TRACE_EVENTS_OWN}.get(cfg.loop, TRACE_EVENTS)


def traced_decode(c, trace_iters: int, ctas: int, config: str | None = None):
    """jitted ``(q, kv, bt, sl, scale) -> (out, lse, trace)`` of the debug build of :func:`traced_config` for the case
    ``c``."""
    import jax
    import jax.numpy as jnp

    from tokenspeed_jax import ffi
    from tokenspeed_jax.backends import sm90_decode
    from tokenspeed_jax.decode import _decode_problem
    from tokenspeed_jax.kernels.sm90.decode import launch_decode_traced
    from tokenspeed_jax.kernels.sm90.decode_trace import TRACE_EVENTS

    def g(q, kv, bt, sl, scale):
        prob = _decode_problem(q, kv, bt, sl, True, 512, True)
        why = sm90_decode.supports(prob)
        if why:
            raise ValueError(why)
        cfg = traced_config(prob, config)
        plan = sm90_decode.plan_for_config(prob, cfg)
        key = sm90_decode.kernel_key(prob, cfg, plan)
        B, S, H = prob.batch, prob.q_len, prob.num_heads
        outputs = [jax.ShapeDtypeStruct((B, S, H, 512), jnp.dtype(prob.out_dtype)),
                   jax.ShapeDtypeStruct((B, S, H), jnp.float32),
                   jax.ShapeDtypeStruct((ctas, 2, trace_iters, len(TRACE_EVENTS)), jnp.int64)]
        outputs += [jax.ShapeDtypeStruct(w.shape, jnp.dtype(w.dtype)) for w in plan.workspace]
        statics = {f.name: getattr(key, f.name) for f in dataclasses.fields(key) if f.name != "config"}
        call = ffi.custom_call(sm90_decode.TARGET, launch_decode_traced, outputs=outputs,
                               compile_key=("traced", key, trace_iters, ctas), loop=cfg.loop, producer=cfg.producer,
                               trace=trace_iters, **statics)
        cta, req = sm90_decode.schedule_of(prob, sl, cfg)
        res = call(q, kv, bt, sl, ffi.scalar_operand(scale), ffi.scalar_operand(jnp.float32(1.0)), cta, req)
        return res[0], res[1], res[2]

    return jax.jit(g)


def summarize(tr, skip: int = 2, events=None) -> dict:
    """``tr``: int64 ``(ctas, 2, iters, events)`` timestamps -> per warpgroup and phase (the interval ending at
    each event), median / p10 / p90 cycles over CTAs and iterations ``>= skip``; intervals with a missing end
    (0: the event was not reached, e.g. the last iteration's refill) are left out.  ``events``: the names (default
    the seesaw loop's ``TRACE_EVENTS``)."""
    import numpy as np

    from tokenspeed_jax.kernels.sm90.decode_trace import TRACE_EVENTS

    events = events or TRACE_EVENTS

    out = {}
    for wg in range(2):
        t = tr[:, wg, skip:, :].astype(np.float64)  # ctas, iters, events
        nxt = np.concatenate([t[:, 1:, :1], np.zeros_like(t[:, :1, :1])], axis=1)  # next iteration's top
        rows = []
        prev = t[..., 0]
        for e in range(1, len(events) + 1):
            cur = t[..., e] if e < len(events) else nxt[..., 0]
            name = events[e][wg] if e < len(events) else "(to the next iteration's top)"
            ok = (cur > 0) & (prev > 0)
            d = (cur - prev)[ok]
            if d.size and name != "-":
                rows.append({"phase": name, "median": float(np.median(d)), "p10": float(np.percentile(d, 10)),
                             "p90": float(np.percentile(d, 90)), "n": int(d.size)})
            prev = np.where(cur > 0, cur, prev)
        top = t[..., 0]
        it = np.diff(top, axis=1)[(top[:, 1:] > 0) & (top[:, :-1] > 0)]
        out[f"wg{wg}"] = {"iteration_median": float(np.median(it)) if it.size else None, "phases": rows}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["64,16384,64,16,1", "64,16384,64,32,4"], help="B,K,page,H,S")
    ap.add_argument("--iters", type=int, default=24, help="loop iterations traced per CTA")
    ap.add_argument("--ctas", type=int, default=16, help="CTAs traced (the first, in (b, split, row block) order)")
    ap.add_argument("--dtype", default="float8_e4m3fn", choices=("float8_e4m3fn", "bfloat16", "float16"))
    ap.add_argument("--config", default=None, help="a name of sm90_decode.CONFIGS (default: select_config's pick)")
    ap.add_argument("--sustain", type=float, default=0.0,
                    help="seconds of back-to-back normal calls right before the traced run (the clocks of sustained "
                         "load, e.g. the 700 W power cap of memory-bound shapes; 0: one traced launch alone)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "decode_trace.json"))
    a = ap.parse_args(argv)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import jax
    import numpy as np

    from benchmarks.decode import bench_case, bench_inputs, decode_fn
    from benchmarks.runinfo import provenance
    from tokenspeed_jax.backends.sm90_decode import CONFIGS
    from tokenspeed_jax.decode import _decode_problem

    report = {"name": f"per-warpgroup timeline of the sm90 decode loop, {a.dtype} (clock64 cycles)", **provenance(),
              "sustain_s": a.sustain, "cases": []}
    for spec in a.cases:
        B, K, page, H, S = (int(x) for x in spec.split(","))
        c = dataclasses.replace(bench_case(B, K, page, H, S), dtype=a.dtype)
        q, kv, bt, sl, scale = bench_inputs(c)
        q, kv = q.astype(c.dtype), kv.astype(c.dtype)
        cfg = traced_config(_decode_problem(q, kv, bt, sl, True, 512, True), a.config)
        name = next(n for n, v in CONFIGS.items() if v == cfg)
        g = decode_fn(c, "sm90", name)  # the normal build of the traced config
        ref = g(q, kv, bt, sl, scale)
        f = traced_decode(c, a.iters, a.ctas, name)
        for _ in range(3):  # the last run's timestamps (the first compiles and warms the caches)
            out, lse, tr = jax.block_until_ready(f(q, kv, bt, sl, scale))
        if a.sustain > 0:  # the normal build back to back first, the traced run queued right behind it
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < a.sustain:
                for _ in range(10):
                    g(q, kv, bt, sl, scale)
            out, lse, tr = jax.block_until_ready(f(q, kv, bt, sl, scale))
        same = bool(np.array_equal(np.asarray(out.astype(np.float32)), np.asarray(ref[0].astype(np.float32)))
                    and np.array_equal(np.asarray(lse), np.asarray(ref[1])))
        tr = np.asarray(tr)
        events = trace_events(cfg)
        summary = summarize(tr, events=events)
        report["cases"].append({"case": c.name, "config": name, "events": [list(e) for e in events],
                                "bitwise_equal_to_normal_build": same, "summary": summary, "trace": tr.tolist()})
        print(f"{c.name} ({name}): traced output bitwise equal to the normal build: {same}")
        for wg, s in summary.items():
            print(f"  {wg}: iteration {s['iteration_median']} cycles (median)")
            for r in s["phases"]:
                print(f"    {r['phase']:<40s} {r['median']:8.0f}  [{r['p10']:.0f} .. {r['p90']:.0f}]")
        if not same:
            raise SystemExit("the traced build's output differs from the normal build's: the timeline is void")
    with open(a.out, "w") as fh:
        json.dump(report, fh)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
