"""Where two builds of the sm90 decode differ on the same inputs (one device call, carry [".device"]):

    source .device/bootstrap.sh && python scripts/decode_diff.py --cases 64,16384,64,16,1 --sets - - seesaw

Each ``--sets`` entry is a kernel config, a name of ``tokenspeed_jax.backends.sm90_decode.CONFIGS`` (``-``: the one
``select_config`` picks; a repeated entry is a second call of the same build, i.e. run-to-run determinism).  For every
entry after the first, prints and writes (``--out``) how many output and LSE elements differ from the first entry's,
the largest difference, and the requests and heads they lie in.
"""
import argparse
import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np

from benchmarks.decode import bench_case, bench_inputs, decode_fn
from benchmarks.harness import provenance


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["64,16384,64,16,1"])
    ap.add_argument("--sets", nargs="+", default=["-", "-", "seesaw"])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float8_e4m3fn"))
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "decode_diff.json"))
    a = ap.parse_args()
    rows = []
    for spec in a.cases:
        c = dataclasses.replace(bench_case(*(int(x) for x in spec.split(","))), dtype=a.dtype)
        q, kv, bt, sl, scale = bench_inputs(c)
        q, kv = q.astype(a.dtype), kv.astype(a.dtype)
        res = []
        for sw in a.sets:
            o, lse = decode_fn(c, "sm90", None if sw == "-" else sw)(q, kv, bt, sl, scale)
            res.append((np.asarray(o.astype(jnp.float32)), np.asarray(lse)))
        o0, l0 = res[0]
        for sw, (o, lse) in zip(a.sets[1:], res[1:]):
            d = o != o0  # [B, S, H, 512]
            dl = lse != l0
            bad = np.argwhere(d.any(-1))  # (b, s, h) rows with a differing output
            r = {"case": c.name, "dtype": a.dtype, "set": sw, "vs": a.sets[0], "out_diff": int(d.sum()),
                 "out_max_abs": float(np.max(np.abs(o - o0))), "lse_diff": int(dl.sum()),
                 "rows_diff": len(bad), "rows": int(np.prod(d.shape[:3])),
                 "requests": sorted({int(x[0]) for x in bad})[:16], "heads": sorted({int(x[2]) for x in bad}),
                 "q_tokens": sorted({int(x[1]) for x in bad})}
            print(json.dumps(r), flush=True)
            rows.append(r)
    with open(a.out, "w") as fh:
        json.dump({**provenance(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
