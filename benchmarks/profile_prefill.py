"""Run our sm90 prefill (FA4's Hopper kernel through ``jax.jit``) and FA4 called from torch on the same
inputs, three times each, for ``ncu`` to compare the kernels themselves (duration at ncu's locked clock,
grid, registers, DRAM bytes):

    ncu --kernel-name regex:'(?i)sm90' --clock-control base --csv --metrics \\
        gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread,dram__bytes.sum \\
        python -m benchmarks.profile_prefill --seqlen 8192 --heads 16

Launch order per mode (causal, then non-causal): ours x3, FA4 x3; the first of each compiles or loads.
Prints progress only: the numbers come from ncu.
"""

from __future__ import annotations

import argparse
import math
import os


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    args = ap.parse_args(argv)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import jax
    import jax.numpy as jnp

    from benchmarks.prefill import setup_torch_dlpack
    from tokenspeed_jax import mla_prefill

    torch = setup_torch_dlpack()
    from flash_attn.cute import interface as fa4

    T, H = args.seqlen, args.heads
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(kq, (T, H, 192), jnp.bfloat16)
    k = jax.random.normal(kk, (T, H, 192), jnp.bfloat16)
    v = jax.random.normal(kv, (T, H, 128), jnp.bfloat16)
    cu = jnp.asarray([0, T], jnp.int32)
    scale = 1.0 / math.sqrt(192)
    tq, tk, tv, tcu = (torch.from_dlpack(x) for x in (q, k, v, cu))
    for causal in (True, False):
        f = jax.jit(lambda q, k, v, c, s, causal=causal: mla_prefill(
            q, k, v, c, c, softmax_scale=s, causal=causal, return_lse=True, max_seqlen_q=T, max_seqlen_k=T,
            backend="sm90"))
        for _ in range(3):
            jax.block_until_ready(f(q, k, v, cu, jnp.float32(scale)))
        print(f"causal={causal}: ours done", flush=True)
        for _ in range(3):
            fa4.flash_attn_varlen_func(tq, tk, tv, cu_seqlens_q=tcu, cu_seqlens_k=tcu, max_seqlen_q=T,
                                       max_seqlen_k=T, softmax_scale=scale, causal=causal, return_lse=True)
        torch.cuda.synchronize()
        print(f"causal={causal}: FA4 done", flush=True)


if __name__ == "__main__":
    main()
