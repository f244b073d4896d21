"""A/B of an sm90 decode switch read at trace time (e.g. ``TOKENSPEED_SM90_DECODE_PDL``), interleaved over 3
rounds in one process on the same inputs (``benchmarks.harness.interleaved``); also says whether the outputs
are bitwise equal.

    source .device/bootstrap.sh && python scripts/decode_ab.py TOKENSPEED_SM90_DECODE_PDL 1 0
    python scripts/decode_ab.py TOKENSPEED_SM90_DECODE_PDL 1 0 --cases 1,81920,64,16,1 64,81920,64,16,1

With ``var`` ``-`` each value is a set of switches, ``NAME=VALUE[,NAME=VALUE...]`` with ``NAME`` after the
``TOKENSPEED_SM90_DECODE_`` prefix (``-`` alone: none set), so several switches and their combinations run in one
interleaved A/B:

    python scripts/decode_ab.py - - CROSS_FIRST=1 KV_EVICT=first CROSS_FIRST=1,KV_EVICT=first --cases matrix

Cases are ``B,K,page,H,S`` (``--dtype``, default bfloat16, every request at full length; default: 4 shapes
with split-KV or not; ``matrix`` among them: the 13 shapes of ``benchmarks.decode.BENCH``).  ``--prewarm N``
first compiles every (case, value) configuration in N CPU worker processes (``benchmarks.decode.prewarm``;
each value's workers see the switch in their environment), so the timed process only loads cached objects.
``--calls N`` (default 1) makes N calls per dispatch, as ``benchmarks/decode.py --calls`` does (one executable
over N distinct q buffers, traced under each value's switches), and gives the times per call: a short shape (B1)
is then timed by the device, not by the host's dispatch, which set its time with one call (2026-12-02,
docs/sm90_decode.md, "L2 prefetch off, calls per dispatch").
Writes ``--out`` (default ``$OUT/decode_ab.json``).  ``lowering_equal: true`` means the switch did not reach
the kernel (the A/B compared a kernel with itself: docs/sm90_decode.md, the withdrawn PDL A/B of
2026-11-30).
"""
import argparse
import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np

from benchmarks.decode import (
    BENCH,
    _jax_calls,
    _per_call,
    bench_case,
    bench_inputs,
    decode_fn,
    est_us,
    prewarm,
)
from benchmarks.harness import interleaved, provenance, switches


def ab(var: str, values: list[str], cases: list, *, rounds: int = 3, calls: int = 1) -> list[dict]:
    """The interleaved A/B of ``values`` of ``var`` on each of ``cases`` (:class:`benchmarks.decode.Case`, their
    dtype), one row per case: µs per call of each value, whether the outputs are bitwise equal, whether the
    lowerings are."""
    res = []
    for c in cases:
        q, kv, bt, sl, scale = bench_inputs(c)
        q, kv = q.astype(c.dtype), kv.astype(c.dtype)
        args = (q, kv, bt, sl, scale)
        fns, outs, hlo = {}, {}, {}
        for v in values:
            with switches(var, v):
                f = decode_fn(c, "sm90")
                outs[v] = np.asarray(f(*args)[0].astype(jnp.float32))  # traced here, with the switch
                hlo[v] = f.lower(*args).as_text()
                fns[v] = _jax_calls(f, args, calls)
                fns[v]()  # (with calls > 1 the n-call executable is traced here too, with the switch)
        t = interleaved(fns, est_us(c) * calls, rounds=rounds)
        first = values[0]
        r = {"case": c.name, "dtype": c.dtype, "var": var, "calls": calls,
             **{f"us_{v}": _per_call(t[v], calls)["median_us"] for v in fns},
             "bitwise_equal": all(np.array_equal(outs[v], outs[first]) for v in fns),
             "max_abs_diff": max(float(np.max(np.abs(outs[v] - outs[first]))) for v in fns),
             # the switch reached the kernel: its compile key (hence the custom call's config) differs
             "lowering_equal": all(hlo[v] == hlo[first] for v in fns)}
        print(json.dumps(r), flush=True)
        res.append(r)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("var")
    ap.add_argument("values", nargs="+")
    ap.add_argument("--cases", nargs="+", default=["1,81920,64,16,1", "8,16384,64,128,2", "64,81920,64,16,1",
                                                   "128,4096,64,16,1"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=1, help="calls per dispatch (times per call)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float8_e4m3fn"))
    ap.add_argument("--prewarm", type=int, default=0, help="CPU worker processes compiling every config first")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "decode_ab.json"))
    a = ap.parse_args()
    if a.calls < 1:
        ap.error(f"--calls: expected a positive number of calls per dispatch, got {a.calls}")
    specs = [spec for s in a.cases for spec in (BENCH if s == "matrix" else [tuple(int(x) for x in s.split(","))])]
    cases = [dataclasses.replace(bench_case(*s), dtype=a.dtype) for s in specs]
    if a.prewarm:
        for v in a.values:
            with switches(a.var, v):
                prewarm(cases, a.prewarm)
    res = ab(a.var, a.values, cases, rounds=a.rounds, calls=a.calls)
    with open(a.out, "w") as fh:
        json.dump({**provenance(), "var": a.var, "rows": res}, fh, indent=1)


if __name__ == "__main__":  # (the prewarm workers are spawned: they re-import this file)
    main()
