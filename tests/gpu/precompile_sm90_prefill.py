"""Compile the sm90 prefill kernel configurations used by the GPU tests / benchmark in parallel processes
into the FFI disk cache (no GPU needed: each worker lowers for sm_90a on the CPU platform).

    python -m tests.gpu.precompile_sm90_prefill [--jobs N] [--bench]

Then ``pytest tests/gpu`` and ``benchmarks/prefill.py`` load the kernels instead of compiling them one
after another. Measured on the 2-core CPU machine (2026-11-29, ``CUTE_DSL_ARCH=sm_90a``): one
configuration takes ~19 s in a fresh worker (about half of it process start and imports of jax, torch
and flash_attn), a disk-cache hit ~10 s in a fresh worker; inside one running process a hit costs well
under a second. ``TEST_CONFIGS`` must list every configuration ``tests/gpu/test_sm90_prefill.py`` uses
(``tests/test_prefill_benchmark.py`` checks the matrix part); ``benchmarks.prefill --prewarm N
--prewarm-only --with-test-configs`` compiles these and the benchmark's (and FA4's) in one pool.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (dtype, Dqk, Dv, Hq, Hk, causal, return_lse)
TEST_CONFIGS = (
    [
        ("bfloat16", 192, 128, hq, hk, c, True)
        for hq, hk in ((8, 8), (16, 16), (128, 128), (32, 8))
        for c in (True, False)
    ]
    + [("float16", 192, 128, 32, 8, c, True) for c in (True, False)]
    + [("bfloat16", d, d, 16, 4, True, True) for d in (128, 64, 256)]
    + [("bfloat16", 192, 128, 16, 16, True, False)]
)
BENCH_CONFIGS = [("bfloat16", 192, 128, h, h, c, True) for h in (16, 32, 128) for c in (True, False)]

_WORKER = """
import sys, jax, jax.numpy as jnp
from tokenspeed_jax import mla_prefill
from tokenspeed_jax.runtime import target_override
dtype, dqk, dv, hq, hk, causal, lse = sys.argv[1], *map(int, sys.argv[2:5]), int(sys.argv[5]), sys.argv[6] == "True", sys.argv[7] == "True"
q = jnp.zeros((64, hq, dqk), dtype); k = jnp.zeros((64, hk, dqk), dtype); v = jnp.zeros((64, hk, dv), dtype)
cu = jnp.array([0, 64], jnp.int32)
f = lambda q, k, v, cu, s: mla_prefill(q, k, v, cu, cu, softmax_scale=s, causal=causal, return_lse=lse, backend="sm90")
with target_override("sm_90a"):
    jax.jit(f).trace(q, k, v, cu, jnp.float32(1.0)).lower(lowering_platforms=("cuda",))
"""


def compile_one(cfg) -> tuple[tuple, float, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", CUTE_DSL_ARCH="sm_90a")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    t = time.time()
    p = subprocess.run(
        [sys.executable, "-c", _WORKER, *map(str, cfg)], env=env, capture_output=True, text=True, check=False
    )
    return cfg, time.time() - t, ("ok" if p.returncode == 0 else p.stderr[-2000:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--bench", action="store_true", help="also the benchmark configurations")
    args = ap.parse_args()
    cfgs = list(dict.fromkeys(TEST_CONFIGS + (BENCH_CONFIGS if args.bench else [])))
    t = time.time()
    with ThreadPoolExecutor(args.jobs) as ex:
        for cfg, dt, status in ex.map(compile_one, cfgs):
            print(f"precompile {cfg}: {dt:.1f} s {status}", flush=True)
    print(f"precompiled {len(cfgs)} configurations in {time.time() - t:.1f} s")


if __name__ == "__main__":
    main()
