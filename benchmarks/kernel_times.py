"""Each kernel of one ``mla_decode(backend="sm90")`` call, timed alone by Nsight Compute: the tree on ``sys.path``.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-count 400 \\
        python benchmarks/kernel_times.py > main.csv
    PYTHONPATH=<other tree>:$PYTHONPATH ncu ... python benchmarks/kernel_times.py > other.csv
    python benchmarks/kernel_times.py --parse main.csv other.csv

Full-length batches (B 64, 81920 tokens each, page 64, causal; BF16 H32 S1 / H128 S1 / H16 S4, FP8 H32 S1 / H16
S4), each called three times under ``jax.jit``.  ``--parse`` splits ncu's CSV into the cases (each starts with its
KV cache's random fill, the one kernel over 1 ms) and prints each case's median duration per kernel kind: ``main``
(the decode kernel), ``combine``, ``schedule`` and the XLA clamp fusions of ``seq_lens`` / ``block_table``, so two
trees' per-call kernels compare side by side (``benchmarks/results/decode_sm90_ab_tag_h100.json``).  Run it as a
file, not with ``-m`` (``-m`` puts the working directory's ``tokenspeed_jax`` ahead of ``PYTHONPATH``).  ncu is
told to leave the GPU clocks alone; it still serializes the kernels, so launch gaps and overlap are not counted.
"""

from __future__ import annotations

import collections
import csv
import sys

CASES = [(32, 1, "bfloat16"), (128, 1, "bfloat16"), (16, 4, "bfloat16"), (32, 1, "float8_e4m3fn"),
         (16, 4, "float8_e4m3fn")]


def run() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import tokenspeed_jax as tj

    print("tree", tj.__file__, flush=True)
    B, cap, page = 64, 81920, 64
    mp = cap // page
    bt = jnp.asarray(np.arange(B * mp).reshape(B, mp), jnp.int32)
    sl = jnp.full((B,), cap, jnp.int32)
    f = jax.jit(lambda q_, kv_, bt_, sl_: tj.mla_decode(q_, kv_, bt_, sl_, softmax_scale=576 ** -0.5,
                                                        backend="sm90"))
    for H, S, dt in CASES:
        kv = jax.random.normal(jax.random.PRNGKey(3), (B * mp + 8, page, 576), jnp.bfloat16).astype(dt)
        q = jax.random.normal(jax.random.PRNGKey(4), (B, S, H, 576), jnp.bfloat16).astype(dt)
        for _ in range(3):
            jax.block_until_ready(f(q, kv, bt, sl))
        print("CASE", H, S, dt, flush=True)
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
    names = [f"{'bf16' if dt == 'bfloat16' else 'fp8'} H{H} S{S}" for H, S, dt in CASES]
    seg, per = -1, collections.defaultdict(lambda: collections.defaultdict(list))
    for r in rows:
        us = float(r["Metric Value"].replace(",", "")) / 1000
        if r["Kernel Name"] == "loop_multiply_fusion" and us > 1000:  # (a case's random KV cache)
            seg += 1
            continue
        k = kind(r["Kernel Name"], r["Grid Size"])
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
