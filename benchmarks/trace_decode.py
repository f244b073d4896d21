"""Per-warpgroup timeline of the sm90 decode loop (seesaw; FP8: the default O^T loop, or mode 4's packed slots).

16-bit: the seesaw loop, which the backend runs for S x H > 32 or pages < 32; for S x H <= 32 (pages >= 32) the
default is the transposed loop (``TOKENSPEED_SM90_DECODE_T16``), which has no traced build, so the normal build
checked against and run under ``--sustain`` is then the seesaw loop (``T16=0``), with the padding of
``TOKENSPEED_SM90_DECODE_PAD_ROWS``.

    source .device/bootstrap.sh && python -m benchmarks.trace_decode --cases 64,16384,64,16,1 64,16384,64,32,4
    source .device/bootstrap.sh && python -m benchmarks.trace_decode --dtype bfloat16 --cases 64,16384,64,32,4
    source .device/bootstrap.sh && TOKENSPEED_SM90_DECODE_FP8_PV=4 python -m benchmarks.trace_decode --cases ...
    source .device/bootstrap.sh && python -m benchmarks.trace_decode --dtype bfloat16 --sustain 3 --cases 64,81920,64,16,1

``--sustain S`` runs the normal build back to back for S seconds and queues the traced run right behind it, so its
timeline is taken at the clocks of sustained load (memory-bound shapes sit at the H200's 700 W power cap there, about
1.41 GHz; docs/sm90_decode.md, "The BF16 memory-bound gap"), to compare with the one-launch timeline.

With ``TOKENSPEED_SM90_DECODE_FP8_PV`` 5, 6, 7 or 10 (the default) the FP8 build is the O^T loop's
(``launch_mla_decode_ot_traced``, its events ``TRACE_EVENTS_OT``), for the cases that mode runs it on (pages >= 32;
modes 5 and 6: S x H <= 32; mode 10: mode 6's loop for S x H <= 32, the 64-row blocks without the transposed QK
above); mode 4's loop otherwise (``TOKENSPEED_SM90_DECODE_FP8_PV=4``).

Runs a debug build of the kernel (``launch_mla_decode_seesaw_traced``) in which thread 0 of each warpgroup writes
``clock64`` at the ``TRACE_EVENTS`` points of its first ``--iters`` loop iterations, for the first ``--ctas`` CTAs,
into an extra int64 output of the custom call.  The normal builds carry none of this (their PTX is unchanged).
Prints, per warpgroup, the median and the 10th / 90th percentiles over CTAs and iterations (the first two
iterations skipped: warm-up) of the cycles spent between consecutive events, i.e. what each phase of an
iteration costs and where a warpgroup waits for the other; and writes all raw timestamps to ``--out`` (JSON).

Checks the traced output against the normal build's on the same inputs (the debug build must compute the same
result: bitwise, since the marks only add stores of their own), so a timeline is never read from a broken build.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time


def traced_decode(c, trace_iters: int, ctas: int, producer: bool = False, ot: str | None = None):
    """jitted ``(q, kv, bt, sl, scale) -> (out, lse, trace)`` of the debug build, for the case ``c``; ``producer``:
    with the producer warpgroup (FP8: mode 4 of ``TOKENSPEED_SM90_DECODE_FP8_PV``, else mode 3; 16-bit:
    ``TOKENSPEED_SM90_DECODE_PRODUCER16=1``); ``ot`` "5", "6" or "7": the O^T loop of that FP8 P V mode instead."""
    import jax
    import jax.numpy as jnp

    from tokenspeed_jax import ffi
    from tokenspeed_jax.backends import sm90_decode
    from tokenspeed_jax.decode import _decode_problem
    from tokenspeed_jax.kernels.sm90.mla_decode_ot import launch_mla_decode_ot_traced
    from tokenspeed_jax.kernels.sm90.mla_decode_ot_own import launch_mla_decode_ot_own_traced
    from tokenspeed_jax.kernels.sm90.mla_decode_seesaw import TRACE_EVENTS, launch_mla_decode_seesaw_traced
    from tokenspeed_jax.planner import plan_for_problem

    def g(q, kv, bt, sl, scale):
        prob = _decode_problem(q, kv, bt, sl, True, 512, True)
        why = sm90_decode.supports(prob)
        if why:
            raise ValueError(why)
        if prob.page_size < (32 if prob.dtype == "float8_e4m3fn" else 16):
            raise ValueError("the traced build is the TMA seesaw (FP8 with early refills): page_size >= 16, FP8 >= 32")
        plan = plan_for_problem(prob, block_m=32 if ot in ("6", "7") else None)  # (the transposed QK: 32-row tiles)
        B, S, H = prob.batch, prob.q_len, prob.num_heads
        out_dt = jnp.bfloat16 if prob.dtype == "float8_e4m3fn" else jnp.dtype(prob.dtype)
        outputs = [jax.ShapeDtypeStruct((B, S, H, 512), out_dt), jax.ShapeDtypeStruct((B, S, H), jnp.float32),
                   jax.ShapeDtypeStruct((ctas, 2, trace_iters, len(TRACE_EVENTS)), jnp.int64)]
        outputs += [jax.ShapeDtypeStruct(w.shape, jnp.dtype(w.dtype)) for w in plan.workspace]
        # the 16-bit loop's cross-PV order and the KV loads' eviction hint as the backend would run them
        cross_first = prob.dtype != "float8_e4m3fn" and sm90_decode.resolve_cross_first()
        kv_evict = sm90_decode.resolve_kv_evict()
        pad_rows = sm90_decode.resolve_pad_rows() if not ot and S * H % 64 else "copy"
        b16 = not ot and prob.dtype != "float8_e4m3fn"  # the 16-bit loop's P and O stores
        p_stsm, o_staged = b16 and sm90_decode.resolve_p_stsm(), b16 and sm90_decode.resolve_epilogue() == "staged"
        colmax = sm90_decode.resolve_colmax() if ot in ("6", "7") else "shfl"  # (the transposed QK's column maxima)
        # (the O^T loop's switches as the backend resolves them: where P0 is stored, when warpgroup 0 issues its QK,
        # where the P0 rescale fences, where the softmax publishes its fold and waits)
        ot_loop = sm90_decode.resolve_ot_loop(ot == "5" and S * H > 32, ot in ("6", "7") or (ot == "5" and S * H <= 32),
                                              ot != "5")
        key = ("mla_decode_sm90_traced.v10", prob.dtype, H, S, prob.page_size, plan.num_splits, plan.tokens_per_split,
               trace_iters, ctas, producer, ot, cross_first, kv_evict, pad_rows, p_stsm, o_staged, colmax, *ot_loop)
        common = {"outputs": outputs, "compile_key": key, "dtype": prob.dtype, "num_heads": H, "q_len": S,
                  "page_size": prob.page_size, "causal": True, "num_splits": plan.num_splits,
                  "tokens_per_split": plan.tokens_per_split, "trace": trace_iters}
        if ot_loop.loop32 != "shared":  # ($..._OT32_LOOP "own": each warpgroup on its own tiles)
            call = ffi.custom_call(sm90_decode.TARGET, launch_mla_decode_ot_own_traced, qk_t=True, colmax=colmax,
                                   loop32=ot_loop.loop32, **common)
        elif ot:
            call = ffi.custom_call(sm90_decode.TARGET, launch_mla_decode_ot_traced, qk_t=ot != "5", colmax=colmax,
                                   **{k: v for k, v in ot_loop._asdict().items() if k != "loop32"}, **common)
        else:
            call = ffi.custom_call(sm90_decode.TARGET, launch_mla_decode_seesaw_traced, tma_producer=producer,
                                   cross_first=cross_first, kv_evict=kv_evict, pad_rows=pad_rows, p_stsm=p_stsm,
                                   o_staged=o_staged, **common)
        res = call(q, kv, bt, sl, ffi.scalar_operand(scale), ffi.scalar_operand(jnp.float32(1.0)))
        return res[0], res[1], res[2]

    return jax.jit(g)


def summarize(tr, skip: int = 2, events=None) -> dict:
    """``tr``: int64 ``(ctas, 2, iters, events)`` timestamps -> per warpgroup and phase (the interval ending at
    each event), median / p10 / p90 cycles over CTAs and iterations ``>= skip``; intervals with a missing end
    (0: the event was not reached, e.g. the last iteration's refill) are left out.  ``events``: the names (default
    the seesaw loop's ``TRACE_EVENTS``)."""
    import numpy as np

    from tokenspeed_jax.kernels.sm90.mla_decode_seesaw import TRACE_EVENTS

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
    ap.add_argument("--sustain", type=float, default=0.0,
                    help="seconds of back-to-back normal calls right before the traced run (the clocks of sustained "
                         "load, e.g. the 700 W power cap of memory-bound shapes; 0: one traced launch alone)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "decode_trace.json"))
    a = ap.parse_args(argv)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import jax
    import numpy as np

    from benchmarks.decode import bench_case, bench_inputs, decode_fn
    from benchmarks.harness import provenance, switches
    from tokenspeed_jax.backends import sm90_decode
    from tokenspeed_jax.kernels.sm90.mla_decode_ot import TRACE_EVENTS_OT
    from tokenspeed_jax.kernels.sm90.mla_decode_ot_own import TRACE_EVENTS_OWN
    from tokenspeed_jax.kernels.sm90.mla_decode_seesaw import TRACE_EVENTS

    mode = sm90_decode.resolve_fp8_pv() if a.dtype == "float8_e4m3fn" else None
    if mode not in (None, "3", "4", "5", "6", "7", "10"):
        raise SystemExit(f"{sm90_decode.FP8_PV_ENV}={mode}: the traced FP8 build is mode 3, 4, 5, 6, 7 or 10")
    ot = mode if mode in ("5", "6", "7", "10") else None
    events = TRACE_EVENTS_OT if ot else TRACE_EVENTS
    # the producer warpgroup itself is not traced (nor the empty refill phases it leaves)
    producer = mode in ("4", "5", "6", "7", "10") if mode else sm90_decode.resolve_producer16() == "1"
    report = {"name": f"per-warpgroup timeline of the sm90 decode loop, {a.dtype} (clock64 cycles)", **provenance(),
              "fp8_pv_mode": mode, "producer": producer, "sustain_s": a.sustain,
              "events": [list(e) for e in events], "cases": []}
    for spec in a.cases:
        B, K, page, H, S = (int(x) for x in spec.split(","))
        c = dataclasses.replace(bench_case(B, K, page, H, S), dtype=a.dtype)
        if ot and (page < 32 or (ot in ("5", "6") and H * S > 32)):
            raise SystemExit(f"{c.name}: mode {ot} runs the O^T loop on pages >= 32 (modes 5, 6: S x H <= 32 only; "
                             f"{sm90_decode.FP8_PV_ENV}=4 traces mode 4's loop)")
        # mode 10 (the default): mode 6's loop for S x H <= 32, the O^T loop on 64-row blocks (mode 5's) above
        case_ot = ("6" if H * S <= 32 else "5") if ot == "10" else ot
        q, kv, bt, sl, scale = bench_inputs(c)
        q, kv = q.astype(c.dtype), kv.astype(c.dtype)
        # the normal build of the traced loop: the 16-bit seesaw, not the transposed loop the backend runs by default
        # for S x H <= 32 (it has no traced build)
        with switches("-", "T16=0" if c.dtype != "float8_e4m3fn" else "-"):  # (read when traced: here)
            g = decode_fn(c, "sm90")
            ref = g(q, kv, bt, sl, scale)
        # (the backend's page rule for both loops)
        f = traced_decode(c, a.iters, a.ctas, producer and page >= 32, case_ot)
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
        own = case_ot in ("6", "7") and sm90_decode.resolve_ot_loop(False, True).loop32 != "shared"
        summary = summarize(tr, events=TRACE_EVENTS_OWN if own else events)
        report["cases"].append({"case": c.name, "bitwise_equal_to_normal_build": same, "summary": summary,
                                "trace": tr.tolist()})
        print(f"{c.name}: traced output bitwise equal to the normal build: {same}")
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
