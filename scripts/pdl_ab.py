"""A/B of the sm90 decode's split-KV combine launched with and without PDL ($TOKENSPEED_SM90_DECODE_PDL),
interleaved over 3 rounds in one process on the same inputs; also checks the outputs are bitwise equal.
On the H200 (carry [".device"]): ``source .device/bootstrap.sh && python scripts/pdl_ab.py``; writes
``$OUT/pdl_ab.json`` (2026-11-30: ``benchmarks/results/decode_sm90_pdl_ab_20261130.json``)."""
import json
import os

import jax.numpy as jnp
import numpy as np

from benchmarks.decode import bench_case, bench_inputs, decode_fn
from benchmarks.harness import bench as timeit
from tokenspeed_jax.backends.sm90_decode import PDL_ENV

res = []
for spec in [(1, 81920, 64, 16, 1), (8, 16384, 64, 128, 2), (64, 81920, 64, 16, 1), (128, 4096, 64, 16, 1)]:
    c = bench_case(*spec)
    q, kv, bt, sl, scale = bench_inputs(c)
    fns, outs = {}, {}
    for pdl in ("1", "0"):
        os.environ[PDL_ENV] = pdl
        f = decode_fn(c, "sm90")
        outs[pdl] = np.asarray(f(q, kv, bt, sl, scale)[0].astype(jnp.float32))
        fns[pdl] = f
    t = {p: [] for p in fns}
    for _ in range(3):
        for p, f in fns.items():
            t[p].append(timeit(lambda f=f, args=(q, kv, bt, sl, scale): f(*args))["median_us"])
    r = {"case": c.name, "us_pdl": float(np.median(t["1"])), "us_nopdl": float(np.median(t["0"])),
             "bitwise_equal": bool(np.array_equal(outs["1"], outs["0"]))}
    print(json.dumps(r), flush=True)
    res.append(r)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "pdl_ab.json"), "w") as fh:
    json.dump(res, fh, indent=1)
