"""MLA prefill (Dqk 192 / Dv 128, bf16, LSE on) on Hopper: ours (``mla_prefill(backend="sm90")`` through
jax.jit) vs FlashAttention-4 called directly from torch on the same device buffers, cuDNN through JAX and
plain XLA where it fits, all in one process with the shared harness (``benchmarks/harness.py``).

    FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache \
    python -m benchmarks.prefill [--quick] [--prewarm N] [--fp8] --out $OUT/prefill.json --png $OUT/prefill.png

``--prewarm N`` compiles our kernels (CPU worker processes, FFI disk cache) and, with FA4's persistent
cache enabled as above, FA4's (GPU worker processes) in parallel before anything is timed.

For every case the script also checks that our output equals FA4's bit for bit (same kernel, same tiles,
same inputs), so a timing difference is overhead, not different work. ``--fp8`` adds ours on e4m3 inputs
(upcast to bf16 before the kernel) to measure that upcast.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    lens: tuple[int, ...]  # self-attention prefill: Lq = Lk per request
    heads: int
    causal: bool

    @property
    def dense(self) -> bool:  # equal lengths: cuDNN's BTNH layout fits without padding
        return len(set(self.lens)) == 1


def cases(quick: bool) -> list[Case]:
    shapes = [
        ("S8k_H16", (8192,), 16),
        ("S8k_H128", (8192,), 128),
        ("S32k_H32", (32768,), 32),
        ("S64k_H32", (65536,), 32),
        ("S128k_H16", (131072,), 16),
        ("4x16k_H32", (16384,) * 4, 32),
        ("32k+64x512_H32", (32768,) + (512,) * 64, 32),
    ]
    if quick:
        shapes = [shapes[0], shapes[2]]
    return [
        Case(f"{n}_{'causal' if c else 'full'}", lens, h, c) for n, lens, h in shapes for c in (True, False)
    ]


def setup_torch_dlpack():
    """FA4 passes torch tensors through tvm-ffi; disable its JIT-built DLPack add-on when torch lacks the
    exchange API (the GPU image has no compiler for it)."""
    import torch

    if not (
        hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
        or hasattr(torch.Tensor, "__c_dlpack_exchange_api__")
    ):
        try:
            import torch_c_dlpack_ext  # noqa: F401
        except Exception:  # noqa: BLE001
            os.environ["TVM_FFI_DISABLE_TORCH_C_DLPACK"] = "1"
    return torch


_FA4_WARM = """
import math, os, sys, torch
H, causal, max_s = int(sys.argv[1]), sys.argv[2] == "True", int(sys.argv[3])
if not (hasattr(torch.Tensor, "__dlpack_c_exchange_api__") or hasattr(torch.Tensor, "__c_dlpack_exchange_api__")):
    os.environ["TVM_FFI_DISABLE_TORCH_C_DLPACK"] = "1"
from flash_attn.cute import interface as fa4
q = torch.randn(256, H, 192, device="cuda", dtype=torch.bfloat16)
k = torch.randn(256, H, 192, device="cuda", dtype=torch.bfloat16)
v = torch.randn(256, H, 128, device="cuda", dtype=torch.bfloat16)
cu = torch.tensor([0, 256], device="cuda", dtype=torch.int32)
fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_s, max_seqlen_k=max_s,
                           softmax_scale=1 / math.sqrt(192), causal=causal, return_lse=True)
torch.cuda.synchronize()
"""


def prewarm(all_cases, jobs: int, *, fa4: bool) -> None:
    """Compile our kernels (CPU workers, FFI disk cache) and, with FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1,
    FA4's own (GPU workers, FA4's persistent cache) in parallel processes before timing anything."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from tests.gpu.precompile_sm90_prefill import compile_one

    def fa4_one(cfg):
        t = time.time()
        p = subprocess.run(
            [sys.executable, "-c", _FA4_WARM, *map(str, cfg)], capture_output=True, text=True, check=False
        )
        return ("fa4", *cfg), time.time() - t, "ok" if p.returncode == 0 else p.stderr[-300:]

    ours = sorted({("bfloat16", 192, 128, c.heads, c.heads, c.causal, True) for c in all_cases})
    jobs_list = [(compile_one, cfg) for cfg in ours]
    if fa4 and os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") == "1":
        jobs_list += [(fa4_one, cfg) for cfg in sorted({(c.heads, c.causal, max(c.lens)) for c in all_cases})]
    t = time.time()
    with ThreadPoolExecutor(jobs) as ex:
        for cfg, dt, status in ex.map(lambda j: j[0](j[1]), jobs_list):
            print(f"prewarm {cfg}: {dt:.1f}s {status[:300]}", flush=True)
    print(f"prewarm {len(jobs_list)} compiles in {time.time() - t:.0f}s", flush=True)


def timed(fn, est_us: float) -> dict:
    """bench() with round sizes that keep long cases (hundreds of ms per call) affordable."""
    from benchmarks.harness import bench

    if est_us > 5000:
        return bench(fn, warmup=1, iters=max(1, int(60000 / est_us)), repeats=5)
    return bench(fn)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--no-fa4", action="store_true")
    ap.add_argument("--no-cudnn", action="store_true")
    ap.add_argument("--prewarm", type=int, default=0, help="compile our kernels in N processes first")
    ap.add_argument("--out", default="prefill.json")
    ap.add_argument("--png", default=None)
    args = ap.parse_args()

    all_cases = cases(args.quick)
    if args.prewarm:
        prewarm(all_cases, args.prewarm, fa4=not args.no_fa4)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.harness import Report, measure_ceilings, prefill_cost
    from tokenspeed_jax import mla_prefill

    ceilings = measure_ceilings()
    report = Report("mla_prefill sm90 (Dqk 192 / Dv 128, bf16, LSE)", ceilings)
    fa4 = None
    torch = None
    if not args.no_fa4:
        try:
            torch = setup_torch_dlpack()
            from flash_attn.cute import interface as fa4
        except Exception as e:  # noqa: BLE001
            print("FA4 from torch unavailable:", e, flush=True)
            fa4 = None

    fns: dict = {}

    def ours_fn(causal, max_s):
        key = ("ours", causal, max_s)
        if key not in fns:
            fns[key] = jax.jit(
                lambda q, k, v, cq, ck, s: mla_prefill(
                    q,
                    k,
                    v,
                    cq,
                    ck,
                    softmax_scale=s,
                    causal=causal,
                    return_lse=True,
                    max_seqlen_q=max_s,
                    max_seqlen_k=max_s,
                    backend="sm90",
                )
            )
        return fns[key]

    def xla_fn(causal):
        key = ("xla", causal)
        if key not in fns:
            fns[key] = jax.jit(
                lambda q, k, v, cq, ck, s: mla_prefill(
                    q, k, v, cq, ck, softmax_scale=s, causal=causal, return_lse=True, backend="xla"
                )
            )
        return fns[key]

    def cudnn_fn(causal, scale):
        from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

        mt = MaskType.CAUSAL if causal else MaskType.NO_MASK
        return jax.jit(lambda q, k, v: dot_product_attention(q, k, v, scale=scale, mask_type=mt))

    for c in all_cases:
        H, T = c.heads, sum(c.lens)
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(c.lens)]), jnp.int32)
        key = jax.random.PRNGKey(len(report.rows))
        kq, kk, kv = jax.random.split(key, 3)
        q = jax.random.normal(kq, (T, H, 192), jnp.bfloat16)
        k = jax.random.normal(kk, (T, H, 192), jnp.bfloat16)
        v = jax.random.normal(kv, (T, H, 128), jnp.bfloat16)
        scale = 1.0 / math.sqrt(192)
        ss = jnp.float32(scale)
        nbytes, flops = prefill_cost(list(c.lens), list(c.lens), H, H, causal=c.causal)
        max_s = max(c.lens)
        est = flops / 650e12 * 1e6  # rough expected us, only to size timing rounds
        t0 = time.time()

        # A-B-A: ours, FA4, ours again; ours' row is the mean of its two medians, which cancels slow
        # drift of the GPU clock / power state between back-to-back long runs.
        f = ours_fn(c.causal, max_s)
        ours_out = f(q, k, v, cu, cu, ss)
        ours_call = functools.partial(f, q, k, v, cu, cu, ss)
        t_ours = [timed(ours_call, est)["median_us"]]
        print(f"{c.name}: ours {t_ours[0]:.0f} us (compile+run {time.time() - t0:.0f}s)", flush=True)
        fa4_row = None
        if fa4 is not None:
            try:
                tq, tk, tv, tcu = (torch.from_dlpack(x) for x in (q, k, v, cu))
                fa4_call = functools.partial(
                    fa4.flash_attn_varlen_func,
                    tq,
                    tk,
                    tv,
                    cu_seqlens_q=tcu,
                    cu_seqlens_k=tcu,
                    max_seqlen_q=max_s,
                    max_seqlen_k=max_s,
                    softmax_scale=scale,
                    causal=c.causal,
                    return_lse=True,
                )
                o_fa, lse_fa = fa4_call()[:2]
                same = bool(torch.equal(torch.from_dlpack(ours_out[0]), o_fa))
                lse_diff = float((torch.from_dlpack(ours_out[1]).T - lse_fa).abs().max())
                fa4_row = (timed(fa4_call, est), f"ours==FA4 bitwise: {same}, max|dLSE| {lse_diff:.2e}")
                t_ours.append(timed(ours_call, est)["median_us"])
            except Exception as e:  # noqa: BLE001
                fa4_row = (None, f"failed: {e}"[:200])
                print("  FA4 failed:", repr(e)[:300], flush=True)
        r = report.add(
            c.name,
            "ours (jax.jit)",
            sum(t_ours) / len(t_ours),
            nbytes=nbytes,
            flops=flops,
            note="A-B-A medians " + " / ".join(f"{t:.0f}" for t in t_ours),
        )
        if fa4_row is not None:
            rf = report.add(c.name, "FA4 (torch)", fa4_row[0], nbytes=nbytes, flops=flops, note=fa4_row[1])
            if rf["us"]:
                print(
                    f"  ours {r['us']:.0f} us ({t_ours}), FA4 {rf['us']:.0f} us; FA4/ours {rf['us'] / r['us']:.3f}; "
                    f"{fa4_row[1]}",
                    flush=True,
                )

        if not args.no_cudnn and c.dense:
            B, S = len(c.lens), c.lens[0]
            try:
                g = cudnn_fn(c.causal, scale)
                q4, k4, v4 = (x.reshape(B, S, H, x.shape[-1]) for x in (q, k, v))
                report.add(
                    c.name,
                    "cuDNN (jax)",
                    timed(functools.partial(g, q4, k4, v4), 2 * est),
                    nbytes=nbytes,
                    flops=flops,
                )
            except Exception as e:  # noqa: BLE001
                report.add(c.name, "cuDNN (jax)", None, nbytes=nbytes, flops=flops, note=f"failed: {e}"[:200])
                print("  cuDNN failed:", repr(e)[:300], flush=True)

        if T <= 8192 and H <= 16:
            x = xla_fn(c.causal)
            report.add(
                c.name,
                "XLA",
                timed(functools.partial(x, q, k, v, cu, cu, ss), 20 * est),
                nbytes=nbytes,
                flops=flops,
            )

        report.write(args.out)  # after every case, so a cut-off run still leaves its numbers
        if args.fp8 and (T <= 32768):
            q8, k8, v8 = (a.astype(jnp.float8_e4m3fn) for a in (q, k, v))
            f8 = ours_fn(c.causal, max_s)
            report.add(
                c.name,
                "ours fp8 in (upcast)",
                timed(functools.partial(f8, q8, k8, v8, cu, cu, ss), est),
                nbytes=nbytes,
                flops=flops,
            )
            up = jax.jit(lambda a, b, c_: tuple(t.astype(jnp.bfloat16) for t in (a, b, c_)))
            numel = q.size + k.size + v.size  # read 1 byte, write 2 bytes per element
            report.add(
                c.name,
                "fp8->bf16 upcast only",
                timed(functools.partial(up, q8, k8, v8), 100),
                nbytes=3.0 * numel,
                flops=0.0,
            )

    print(report.table(), flush=True)
    report.write(args.out, args.png)
    print("wrote", args.out, args.png, file=sys.stderr)


if __name__ == "__main__":
    main()
