"""Fixed cost per call of each decode contender: a straight-line fit ``us = a + b * K`` over a K sweep.

The short shapes of the issue matrix (B128/K4096, B8/K16384) lose more against FlashMLA than the long ones with the
same per-CTA loop (B64/K81920).  At a fixed grid (the planner's split count does not change over the sweep: check the
``ctas`` column) a call's time is a cost per KV token times K plus what does not grow with K: launch, the CTAs' ramp
(Q and the first tiles), the last tiles and epilogue, the combine.  The intercept ``a`` measures the latter per
contender; ``b`` the steady-state cost per 1024 tokens.

    python -m benchmarks.decode --prewarm 15 --bench --no-xla --out $OUT/sweep.json \\
        --shapes 128,1024,64,16,1 128,2048,64,16,1 128,4096,64,16,1 128,8192,64,16,1
    python scripts/fixed_cost.py $OUT/sweep.json --out $OUT/fixed_cost.json

Reads a ``benchmarks.decode --bench`` report (case names ``B{B}_K{K}_H{H}_S{S}``); writes the fits as JSON and prints
them.  Needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict

import numpy as np

CASE = re.compile(r"B(\d+)_K(\d+)_H(\d+)_S(\d+)$")


def fit(points):
    """Least squares ``us = a + b * K`` over ``points`` [(K, us)]: (a, b per 1024 tokens, max |relative residual|)."""
    k = np.array([p[0] for p in points], float)
    t = np.array([p[1] for p in points], float)
    b, a = np.polyfit(k, t, 1)
    res = np.max(np.abs((a + b * k) - t) / t)
    return float(a), float(b * 1024), float(res)


def fixed_costs(rows) -> list[dict]:
    """Group a report's rows by (B, H, S, contender) and fit each group with two or more K values."""
    groups = defaultdict(list)
    for r in rows:
        m = CASE.match(r["case"])
        if m and r.get("us"):
            B, K, H, S = map(int, m.groups())
            groups[(B, H, S, r["contender"])].append((K, r["us"]))
    out = []
    for (B, H, S, who), pts in sorted(groups.items()):
        if len({k for k, _ in pts}) < 2:
            continue
        a, b, res = fit(sorted(pts))
        out.append({"B": B, "H": H, "S": S, "contender": who, "intercept_us": round(a, 2),
                    "us_per_1k_tokens": round(b, 3), "max_rel_residual": round(res, 4), "points": sorted(pts)})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", help="a benchmarks.decode --bench JSON")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    with open(a.report) as fh:
        doc = json.load(fh)
    fits = fixed_costs(doc["rows"])
    for f in fits:
        print(f"B{f['B']:<4} H{f['H']:<4} S{f['S']:<2} {f['contender']:16s} fixed {f['intercept_us']:8.1f} us  "
              f"{f['us_per_1k_tokens']:8.2f} us per 1k tokens  (max residual {100 * f['max_rel_residual']:.1f}%)")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"source": a.report, "command": doc.get("command"), "date": doc.get("date"), "fits": fits}, fh,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
