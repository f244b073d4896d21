"""MLA prefill (Dqk 192 / Dv 128, bf16, LSE on) on Hopper: ours (``mla_prefill(backend="sm90")`` through
jax.jit) vs FlashAttention-4 and FlashAttention-3 called directly from torch on the same device buffers,
cuDNN through JAX and plain XLA where it fits, all in one process with the shared harness
(``benchmarks/harness.py``).

    FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache \
    python -m benchmarks.prefill [--quick] [--prewarm N] [--fp8] --out $OUT/prefill.json --png $OUT/prefill.png

``--prewarm N`` compiles our kernels (CPU worker processes, FFI disk cache) and, with FA4's persistent
cache enabled as above, FA4's (GPU worker processes) in N parallel processes before anything is timed;
``--prewarm-only`` stops there (``--with-test-configs`` adds the GPU tests' configurations), so a device
script can compile everything once, run the GPU tests, then time.

Contenders (a column is absent, with the reason printed, when its package does not import):
  ours (jax.jit)   ``mla_prefill(backend="sm90")``
  FA4 (torch)      ``flash_attn.cute.interface.flash_attn_varlen_func`` (pip flash-attn-4)
  FA3 (torch)      ``fa3.flash_attn_varlen`` (the GPU kit's vLLM build; ``bash .device-fa3/unpack.sh``
                   in the device call just before this one makes ``import fa3`` work)
  cuDNN (jax)      ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` (dense cases only)
  XLA              ``mla_prefill(backend="xla")`` (small cases only)

Timing is interleaved (:func:`benchmarks.harness.interleaved`): after warm-up, every round times each contender once
(ours, FA4, FA3, cuDNN, then again ours, FA4, ...) and a contender's time is the median of its rounds,
so GPU clock / power drift during a long case hits every contender alike instead of whichever ran last.
Each row's ``speedup`` (and the note and the PNG's lower panel) is the other contender's time over
ours: 1.0 is parity, the issue's targets are >= 0.97 vs FA4, >= 1.0 vs FA3, >= 1.2 vs cuDNN.

Numerical cross-checks on every case: ours vs FA4 bit for bit (same kernel, same tiles, same inputs, so
a timing difference is overhead, not different work), ours vs FA3 as max |d out| and max |d LSE|.
``--fp8`` adds ours on e4m3 inputs (upcast to bf16 before the kernel) to measure that upcast.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time

OURS = "ours (jax.jit)"
FA4 = "FA4 (torch)"
FA3 = "FA3 (torch)"
CUDNN = "cuDNN (jax)"
XLA = "XLA"
SHORT = {FA4: "FA4", FA3: "FA3", CUDNN: "cuDNN", XLA: "XLA"}
# Issue 7's targets: ours' speed over the contender's (contender time / our time) at least this much.
TARGETS = {"FA4": 0.97, "FA3": 1.0, "cuDNN": 1.2}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    lens: tuple[int, ...]  # self-attention prefill: Lq = Lk per request
    heads: int
    causal: bool

    @property
    def dense(self) -> bool:  # equal lengths: cuDNN's BTNH layout fits without padding
        return len(set(self.lens)) == 1

    @property
    def tokens(self) -> int:
        return sum(self.lens)

    @property
    def max_len(self) -> int:
        return max(self.lens)

    @property
    def xla_fits(self) -> bool:  # the plain XLA reference is slow: only the smallest cases
        return self.tokens <= 8192 and self.heads <= 16


def cases(quick: bool) -> list[Case]:
    """Issue 7's benchmark cases, each causal and non-causal (``quick``: S=8k H16 and S=32k H32 only)."""
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


def kernel_configs(all_cases) -> list[tuple]:
    """Our compile keys for the cases: (dtype, Dqk, Dv, Hq, Hk, causal, return_lse)."""
    return sorted({("bfloat16", 192, 128, c.heads, c.heads, c.causal, True) for c in all_cases})


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two shapes only")
    ap.add_argument("--fp8", action="store_true", help="also ours on e4m3 inputs and the upcast alone")
    ap.add_argument("--no-fa4", action="store_true")
    ap.add_argument("--no-fa3", action="store_true")
    ap.add_argument("--no-cudnn", action="store_true")
    ap.add_argument("--no-xla", action="store_true")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds per contender")
    ap.add_argument(
        "--prewarm", type=int, default=0, help="compile our kernels (and FA4's) in N processes first"
    )
    ap.add_argument("--prewarm-only", action="store_true", help="stop after --prewarm")
    ap.add_argument(
        "--with-test-configs", action="store_true", help="prewarm also tests/gpu's configurations"
    )
    ap.add_argument("--cases", default="", help="comma-separated substrings: run only matching cases")
    ap.add_argument("--out", default="prefill.json")
    ap.add_argument("--png", default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds: expected >= 1, got {args.rounds}")
    if args.prewarm < 0:
        ap.error(f"--prewarm: expected >= 0, got {args.prewarm}")
    if args.prewarm_only and not args.prewarm:
        ap.error("--prewarm-only needs --prewarm N")
    return args


def select_cases(args) -> list[Case]:
    all_cases = cases(args.quick)
    if args.cases:
        keys = [s for s in args.cases.split(",") if s]
        all_cases = [c for c in all_cases if any(k in c.name for k in keys)]
    return all_cases


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


def load_fa3():
    """(the ``fa3`` module, None) or (None, why not); never raises."""
    try:
        import fa3  # the GPU kit's module, on PYTHONPATH after .device-fa3/unpack.sh

        if not callable(getattr(fa3, "flash_attn_varlen", None)):
            return None, "module fa3 has no flash_attn_varlen"
        return fa3, None
    except Exception as e:  # noqa: BLE001  (ImportError, or the .so failing to load)
        return None, f"{type(e).__name__}: {e}"[:300]


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


def prewarm(all_cases, jobs: int, *, fa4: bool, test_configs: bool = False) -> None:
    """Compile our kernels (CPU workers, FFI disk cache) and, with FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1,
    FA4's own (GPU workers, FA4's persistent cache) in parallel processes before timing anything."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from tests.gpu.precompile_sm90_prefill import TEST_CONFIGS, compile_one

    def fa4_one(cfg):
        t = time.time()
        p = subprocess.run(
            [sys.executable, "-c", _FA4_WARM, *map(str, cfg)], capture_output=True, text=True, check=False
        )
        return ("fa4", *cfg), time.time() - t, "ok" if p.returncode == 0 else p.stderr[-300:]

    ours = kernel_configs(all_cases)
    if test_configs:
        ours = list(dict.fromkeys(list(TEST_CONFIGS) + ours))
    jobs_list = [(compile_one, cfg) for cfg in ours]
    if fa4 and os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") == "1":
        # FA4 compiles interleaved with ours so the GPU-side workers do not all start at once
        fa4_jobs = [(fa4_one, cfg) for cfg in sorted({(c.heads, c.causal, c.max_len) for c in all_cases})]
        merged = []
        for i in range(max(len(jobs_list), len(fa4_jobs))):
            merged += jobs_list[i : i + 1] + fa4_jobs[i : i + 1]
        jobs_list = merged
    t = time.time()
    with ThreadPoolExecutor(jobs) as ex:
        for cfg, dt, status in ex.map(lambda j: j[0](j[1]), jobs_list):
            print(f"prewarm {cfg}: {dt:.1f}s {status[:300]}", flush=True)
    print(f"prewarm {len(jobs_list)} compiles in {time.time() - t:.0f}s", flush=True)


def speedups(times: dict) -> dict:
    """Ours' speed relative to each other contender: ``{short name: their us / our us}`` (>1: ours faster)."""
    ours = times.get(OURS)
    if not ours:
        return {}
    return {SHORT.get(n, n): t / ours for n, t in times.items() if n != OURS and t}


def verdicts(speed: dict) -> str:
    """'vs FA4 1.002x (target 0.97: met), ...' for the note."""
    parts = []
    for k, x in speed.items():
        tgt = TARGETS.get(k)
        parts.append(
            f"vs {k} {x:.3f}x"
            + ("" if tgt is None else f" (target {tgt}: {'met' if x >= tgt else 'MISSED'})")
        )
    return ", ".join(parts)


def timed(fn, est_us: float) -> dict:
    """bench() with round sizes that keep long cases (hundreds of ms per call) affordable."""
    from benchmarks.harness import LARGE_US, bench

    if est_us > LARGE_US:
        return bench(fn, warmup=1, iters=max(1, int(60000 / est_us)), repeats=5)
    return bench(fn)


def plot_prefill(doc: dict, png_path: str) -> None:
    """Two panels: TFLOP/s per case and contender; ours' speed over FA4 / FA3 / cuDNN with the targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [r for r in doc["rows"] if r.get("us")]
    case_names = list(dict.fromkeys(r["case"] for r in rows))
    conts = list(dict.fromkeys(r["contender"] for r in rows))
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(max(9, 0.9 * len(case_names) * max(2, len(conts)) / 2), 8))
    w = 0.8 / max(1, len(conts))
    x = np.arange(len(case_names))
    for i, c in enumerate(conts):
        vals = [
            next((r["tflops"] for r in rows if r["case"] == k and r["contender"] == c), math.nan)
            for k in case_names
        ]
        ax.bar(x + i * w, vals, w, label=c)
    ax.set_xticks(x + 0.4 - w / 2)
    ax.set_xticklabels(case_names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ceil = (doc.get("ceilings") or {}).get("bf16_tflops")
    if ceil:
        ax.axhline(ceil, color="k", lw=0.8, ls=":", label=f"bf16 matmul {ceil:.0f}")
    ax.legend(fontsize=7, ncol=3)
    ax.set_title(f"{doc['name']} on {doc['device']} ({doc['date']})", fontsize=9)

    speed = {r["case"]: r.get("speedup") or {} for r in doc["rows"] if r["contender"] == OURS}
    keys = [k for k in ("FA4", "FA3", "cuDNN") if any(k in s for s in speed.values())]
    wb = 0.8 / max(1, len(keys))
    for i, k in enumerate(keys):
        vals = [speed.get(c, {}).get(k, math.nan) for c in case_names]
        bars = bx.bar(x + i * wb, vals, wb, label=f"ours vs {k} (target {TARGETS[k]})", color=f"C{i}")
        bx.axhline(TARGETS[k], color=f"C{i}", lw=0.8, ls="--")
        for b, v in zip(bars, vals):
            if not math.isnan(v):
                bx.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom", fontsize=5)
    bx.set_xticks(x + 0.4 - wb / 2)
    bx.set_xticklabels(case_names, rotation=30, ha="right", fontsize=7)
    bx.set_ylabel("their time / our time")
    shown = [s.get(k) for s in speed.values() for k in keys if s.get(k) is not None]
    bx.set_ylim(min([0.8] + shown) * 0.95, min(5.0, max([1.4] + shown)) + 0.05)
    if keys:
        bx.legend(fontsize=7, ncol=3)
    fig.text(0.01, 0.005, doc["command"][:200], fontsize=6)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    all_cases = select_cases(args)
    if args.prewarm:
        prewarm(all_cases, args.prewarm, fa4=not args.no_fa4, test_configs=args.with_test_configs)
        if args.prewarm_only:
            return

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.harness import Report, interleaved, measure_ceilings, prefill_cost
    from tokenspeed_jax import mla_prefill

    ceilings = measure_ceilings()
    report = Report("mla_prefill sm90 (Dqk 192 / Dv 128, bf16, LSE)", ceilings)
    torch = fa4 = fa3 = None
    if not (args.no_fa4 and args.no_fa3):
        try:
            torch = setup_torch_dlpack()
        except Exception as e:  # noqa: BLE001
            print("torch unavailable: FA4 and FA3 columns absent:", e, flush=True)
    if torch is not None and not args.no_fa4:
        try:
            from flash_attn.cute import interface as fa4
        except Exception as e:  # noqa: BLE001
            print("FA4 column absent: flash_attn.cute does not import:", e, flush=True)
            fa4 = None
    if torch is not None and not args.no_fa3:
        fa3, why = load_fa3()
        if fa3 is None:
            print(
                f"FA3 column absent: import fa3 failed ({why}); on the GPU kit run "
                "'bash .device-fa3/unpack.sh' in the device call just before this one",
                flush=True,
            )

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

    t_start = time.time()
    for ci, c in enumerate(all_cases):
        H, T, max_s = c.heads, c.tokens, c.max_len
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(c.lens)]), jnp.int32)
        kq, kk, kv = jax.random.split(jax.random.PRNGKey(ci), 3)
        q = jax.random.normal(kq, (T, H, 192), jnp.bfloat16)
        k = jax.random.normal(kk, (T, H, 192), jnp.bfloat16)
        v = jax.random.normal(kv, (T, H, 128), jnp.bfloat16)
        scale = 1.0 / math.sqrt(192)
        ss = jnp.float32(scale)
        nbytes, flops = prefill_cost(list(c.lens), list(c.lens), H, H, causal=c.causal)
        est = flops / 650e12 * 1e6  # rough expected us, only to size timing rounds
        t0 = time.time()

        # First call of every contender (compile / cache load) and its numerical check, outside timing.
        f = ours_fn(c.causal, max_s)
        ours_out = f(q, k, v, cu, cu, ss)
        jax.block_until_ready(ours_out)
        contenders = {OURS: functools.partial(f, q, k, v, cu, cu, ss)}
        notes: dict = {}
        failed: dict = {}
        if torch is not None and (fa4 is not None or fa3 is not None):
            tq, tk, tv, tcu = (torch.from_dlpack(x) for x in (q, k, v, cu))
            t_out = torch.from_dlpack(ours_out[0])
            t_lse = torch.from_dlpack(ours_out[1])  # [Tq, Hq]
        if fa4 is not None:
            try:
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
                o_fa, lse_fa = fa4_call()[:2]  # lse [Hq, Tq]
                same = bool(torch.equal(t_out, o_fa))
                d_out = float((t_out.float() - o_fa.float()).abs().max())
                d_lse = float((t_lse.T - lse_fa).abs().max())
                notes[FA4] = f"ours==FA4 bitwise: {same}, max|dO| {d_out:.2e}, max|dLSE| {d_lse:.2e}"
                contenders[FA4] = fa4_call
                del o_fa, lse_fa
            except Exception as e:  # noqa: BLE001
                failed[FA4] = f"failed: {e}"[:200]
                print("  FA4 failed:", repr(e)[:300], flush=True)
        if fa3 is not None:
            try:
                fa3_call = functools.partial(
                    fa3.flash_attn_varlen, tq, tk, tv, tcu, tcu, max_s, max_s, scale, c.causal
                )
                o3, lse3 = fa3_call()[:2]  # out [Tq, Hq, Dv], lse [Hq, Tq]
                d_out = float((t_out.float() - o3.float()).abs().max())
                d_lse = float((t_lse.T - lse3.float()).abs().max())
                notes[FA3] = f"ours vs FA3: max|dO| {d_out:.2e}, max|dLSE| {d_lse:.2e}"
                contenders[FA3] = fa3_call
                del o3, lse3
            except Exception as e:  # noqa: BLE001
                failed[FA3] = f"failed: {e}"[:200]
                print("  FA3 failed:", repr(e)[:300], flush=True)
        if not args.no_cudnn and c.dense:
            B, S = len(c.lens), c.lens[0]
            try:
                g = cudnn_fn(c.causal, scale)
                q4, k4, v4 = (x.reshape(B, S, H, x.shape[-1]) for x in (q, k, v))
                jax.block_until_ready(g(q4, k4, v4))
                contenders[CUDNN] = functools.partial(g, q4, k4, v4)
            except Exception as e:  # noqa: BLE001
                failed[CUDNN] = f"failed: {e}"[:200]
                print("  cuDNN failed:", repr(e)[:300], flush=True)
        t_first = time.time() - t0

        res = interleaved(contenders, est, rounds=args.rounds)
        times = {n: r["median_us"] for n, r in res.items()}
        speed = speedups(times)
        order = " -> ".join(SHORT.get(n, "ours") for n in contenders)
        r = report.add(
            c.name,
            OURS,
            res[OURS],
            nbytes=nbytes,
            flops=flops,
            note=f"interleaved medians over {args.rounds} rounds ({order}); " + verdicts(speed),
            speedup=speed,
            samples_us=res[OURS]["samples_us"],
        )
        for n in contenders:
            if n != OURS:
                report.add(
                    c.name,
                    n,
                    res[n],
                    nbytes=nbytes,
                    flops=flops,
                    note=notes.get(n, ""),
                    samples_us=res[n]["samples_us"],
                )
        for n, why in failed.items():
            report.add(c.name, n, None, nbytes=nbytes, flops=flops, note=why)
        print(
            f"{c.name}: ours {r['us']:.0f} us {r['tflops']:.0f} TFLOP/s; "
            + "; ".join([verdicts(speed)] + list(notes.values()))
            + f" (first calls {t_first:.0f}s, case {time.time() - t0:.0f}s)",
            flush=True,
        )

        if not args.no_xla and c.xla_fits:
            x = xla_fn(c.causal)
            tx = timed(functools.partial(x, q, k, v, cu, cu, ss), 20 * est)
            report.add(c.name, XLA, tx, nbytes=nbytes, flops=flops)
            r.setdefault("speedup", {})["XLA"] = tx["median_us"] / r["us"]

        if args.fp8 and T <= 32768:
            q8, k8, v8 = (a.astype(jnp.float8_e4m3fn) for a in (q, k, v))
            report.add(
                c.name,
                "ours fp8 in (upcast)",
                timed(functools.partial(f, q8, k8, v8, cu, cu, ss), est),
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
        report.write(args.out)  # after every case, so a cut-off run still leaves its numbers
        del q, k, v, ours_out, contenders
        if torch is not None and (fa4 is not None or fa3 is not None):
            del tq, tk, tv, tcu, t_out, t_lse

    print(report.table(), flush=True)
    print(f"{'case':32s} " + " ".join(f"{'vs ' + k:>9s}" for k in ("FA4", "FA3", "cuDNN", "XLA")), flush=True)
    for row in report.rows:
        if row["contender"] == OURS:
            s = row.get("speedup") or {}
            print(
                f"{row['case']:32s} "
                + " ".join(
                    f"{s[k]:9.3f}" if k in s else f"{'-':>9s}" for k in ("FA4", "FA3", "cuDNN", "XLA")
                ),
                flush=True,
            )
    report.write(args.out)
    if args.png:
        import json

        with open(args.out) as fh:
            plot_prefill(json.load(fh), args.png)
    print(f"wrote {args.out} {args.png or ''} in {time.time() - t_start:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
