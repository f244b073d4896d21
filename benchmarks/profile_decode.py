"""Run our sm90 decode kernel and FlashMLA once each on a few shapes, for ``ncu`` to profile.

    ncu --kernel-name regex:'MlaDecode|flash|mla' --launch-skip 2 --launch-count 6 --set full \\
        python -m benchmarks.profile_decode --cases 64,16384,64,32,4 64,16384,64,16,1

Each contender runs three times per shape (the first run compiles), so ``--launch-skip`` /
``--launch-count`` pick steady-state launches.  Prints nothing but timing-free progress: numbers come
from ncu.
"""

from __future__ import annotations

import argparse
import dataclasses
import os


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["64,16384,64,32,4"], help="B,K,page,H,S")
    ap.add_argument("--schedule", default=None)
    ap.add_argument("--no-flashmla", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float8_e4m3fn"),
                    help="float8_e4m3fn: our FP8 path and FlashMLA's FP8 fork (flash_mla_fp8_dense)")
    args = ap.parse_args(argv)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import jax

    from benchmarks.decode import bench_case, bench_inputs, decode_fn

    for spec in args.cases:
        B, K, page, H, S = (int(x) for x in spec.split(","))
        c = bench_case(B, K, page, H, S)
        q, kv, bt, sl, scale = bench_inputs(c)
        f = decode_fn(dataclasses.replace(c, dtype=args.dtype), "sm90", args.schedule)
        q8, kv8 = q.astype(args.dtype), kv.astype(args.dtype)
        for _ in range(3):
            jax.block_until_ready(f(q8, kv8, bt, sl, scale))
        print(f"{c.name}: ours done", flush=True)
        if args.no_flashmla:
            continue
        import flash_mla as fm
        import torch

        tq, tk = torch.from_dlpack(q), torch.from_dlpack(kv).view(c.num_pages, page, 1, 576)
        tbt, tsl = torch.from_dlpack(bt), torch.from_dlpack(sl)
        if args.dtype == "float8_e4m3fn":
            one = torch.ones(1, dtype=torch.float32, device=tq.device)
            tq8, tk8 = tq.to(torch.float8_e4m3fn), tk.to(torch.float8_e4m3fn)
            for _ in range(3):
                fm.flash_mla_fp8_dense(tq8, tk8, tbt, tsl, 576 ** -0.5, True, one, one)
            torch.cuda.synchronize()
            print(f"{c.name}: FlashMLA fp8 done", flush=True)
            continue
        for _ in range(3):
            sched, _ = fm.get_mla_metadata()
            fm.flash_mla_with_kvcache(tq, tk, tbt, tsl, 512, sched, None, softmax_scale=576 ** -0.5, causal=True)
        torch.cuda.synchronize()
        print(f"{c.name}: FlashMLA done", flush=True)


if __name__ == "__main__":
    main()
