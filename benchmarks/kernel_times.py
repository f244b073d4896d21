"""Each kernel of one ``mla_decode(backend="sm90")`` call, timed alone by Nsight Compute: the tree on ``sys.path``.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-count 400 \\
        python benchmarks/kernel_times.py > main.csv
    PYTHONPATH=<other tree>:$PYTHONPATH ncu ... python benchmarks/kernel_times.py > other.csv
    python benchmarks/kernel_times.py --parse main.csv other.csv

:data:`CASES`: full-length batches (B 64, 81920 tokens each; BF16 H32 S1 / H128 S1 / H16 S4, FP8 H32 S1 / H16 S4)
and varied ones (``benchmarks.decode_varlen.lengths``: a long tail, 256 short requests, one long request, uniform
H128), page 64, causal, each called three times under ``jax.jit``.  ``--parse`` splits ncu's CSV into the cases (each
starts with its KV cache's random fill, at least 16384 pages: the one kernel over 1 ms) and prints each case's median
duration per kernel kind: ``main`` (the decode kernel), ``combine``, ``schedule`` and, in trees before commit 4ec2353,
the XLA clamp fusions of ``seq_lens`` / ``block_table``, so two trees' per-call kernels compare side by side
(``benchmarks/results/decode_sm90_kernel_times_h200.json``).  Run it as a
file, not with ``-m`` (``-m`` puts the working directory's ``tokenspeed_jax`` ahead of ``PYTHONPATH``).  ncu is
told to leave the GPU clocks alone; it still serializes the kernels, so launch gaps and overlap are not counted.
"""

from __future__ import annotations

import collections
import csv
import sys
from pathlib import Path

CASES = [("full", 64, 81920, 32, 1, "bfloat16"), ("full", 64, 81920, 128, 1, "bfloat16"),
         ("full", 64, 81920, 16, 4, "bfloat16"), ("full", 64, 81920, 32, 1, "float8_e4m3fn"),
         ("full", 64, 81920, 16, 4, "float8_e4m3fn"), ("tail", 64, 81920, 32, 1, "bfloat16"),
         ("uniform", 256, 4096, 32, 1, "bfloat16"), ("uniform", 1, 131072, 16, 1, "bfloat16"),
         ("uniform", 64, 81920, 128, 1, "bfloat16"), ("tail", 64, 81920, 32, 1, "float8_e4m3fn")]
PAGE, MIN_PAGES = 64, 16384


def case_name(dist: str, B: int, cap: int, H: int, S: int, dtype: str) -> str:
    return f"{'bf16' if dtype == 'bfloat16' else 'fp8'} {dist} B{B} K{cap} H{H} S{S}"


def run() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import tokenspeed_jax as tj

    print("tree", tj.__file__, flush=True)
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # (last: the tree under test stays first)
    from benchmarks.decode_varlen import lengths

    f = jax.jit(lambda q_, kv_, bt_, sl_: tj.mla_decode(q_, kv_, bt_, sl_, softmax_scale=576 ** -0.5,
                                                        backend="sm90"))
    for dist, B, cap, H, S, dt in CASES:
        mp = cap // PAGE
        bt = jnp.asarray(np.arange(B * mp).reshape(B, mp), jnp.int32)
        sl = jnp.asarray(lengths(dist, B, cap, 1234), jnp.int32)
        pages = max(B * mp, MIN_PAGES) + 8
        kv = jax.random.normal(jax.random.PRNGKey(3), (pages, PAGE, 576), jnp.bfloat16).astype(dt)
        q = jax.random.normal(jax.random.PRNGKey(4), (B, S, H, 576), jnp.bfloat16).astype(dt)
        for _ in range(3):
            jax.block_until_ready(f(q, kv, bt, sl))
        print("CASE", case_name(dist, B, cap, H, S, dt), flush=True)
        del kv


def kind(name: str, grid: str) -> str | None:
    if "DecodeSchedule" in name:
        return "schedule"
    if "combine_kernel" in name:
        return "combine"
    if "clamp" in name:
        return "xla_clamp_seq_lens" if grid.startswith("(1,") else "xla_clamp_block_table"
    if "MlaDecode" in name:
        return "main"
    return None


def parse(path: str) -> dict:
    """``{case: {kind: median us}}`` from one ncu CSV of :func:`run`."""
    with open(path) as fh:
        rows = list(csv.DictReader(line for line in fh if line.startswith('"')))
    names = [case_name(*c) for c in CASES]
    seg, per = -1, collections.defaultdict(lambda: collections.defaultdict(list))
    for r in rows:
        us = float(r["Metric Value"].replace(",", "")) / 1000
        k = kind(r["Kernel Name"], r["Grid Size"])
        if k is None and us > 1000:  # a case's random KV cache (one or two XLA kernels: fill, FP8 conversion)
            if seg < 0 or (seg < len(names) and per[names[seg]]):
                seg += 1
            continue
        if 0 <= seg < len(names) and k:
            per[names[seg]][k].append(us)
    out = {}
    for c, d in per.items():
        out[c] = {k: round(sorted(v)[len(v) // 2], 1) for k, v in d.items()}
        out[c]["total"] = round(sum(out[c].values()), 1)
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--parse"]:
        for p in sys.argv[2:]:
            print(p)
            for c, d in parse(p).items():
                print(f"  {c}: {d}")
    else:
        run()
