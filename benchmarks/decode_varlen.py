"""MLA decode on serving-shaped batches: varied request lengths, ours vs FlashMLA (BF16) and its FP8 fork.

    CUTE_DSL_ARCH=sm_90a python -m benchmarks.decode_varlen --prewarm 12 --out $OUT/varlen.json --png $OUT/varlen.png
    python -m benchmarks.decode_varlen --replot varlen.json --png varlen.png      # the plot again, from the JSON

Every contender runs on the same inputs in one process, interleaved (``benchmarks.harness.interleaved``).  A case
is ``(distribution, B, capacity, H, S)`` with page 64; its lengths are drawn once per case from a seeded generator:

* ``full``: every request at the capacity (the static benchmark matrix's shape);
* ``uniform``: uniform in ``[256, capacity]``;
* ``tail``: a long tail: 90% of the requests uniform in ``[64, 2048]``, 10% at the capacity.

``--config NAME`` (repeatable; a name of ``tokenspeed_jax.backends.sm90_decode.CONFIGS``, e.g.
``seesaw``, or one with ``/noprefetch``: ``benchmarks.decode.named_config``): that kernel config's kernels on a
shared schedule, ``ours {dt} kernel NAME``, timed in the
same rounds as the selected config's ``ours {dt} kernel`` where it applies (an A/B of configs on varied lengths).

Bytes are those actually read: the sum of the lengths times 576 elements (2 bytes, 1 for FP8) plus q and the
output, so ``roofline_fraction`` is the fraction of the measured copy bandwidth on the real work.  Each row also
records the largest difference to FlashMLA's output (the same data through dlpack).  JSON + PNG via
``benchmarks.harness.Report``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.decode import Case, _jax_calls, config_applies, decode_fn, named_config, prewarm

DISTS = ("full", "uniform", "tail")
DEFAULT = ([("uniform", 64, 81920, H, S) for H in (16, 32, 128) for S in (1, 4)]
           + [("tail", 64, 81920, 32, 1), ("tail", 64, 81920, 128, 1), ("uniform", 128, 32768, 16, 2),
              ("uniform", 256, 4096, 32, 1), ("uniform", 8, 131072, 128, 1), ("uniform", 1, 131072, 16, 1),
              ("full", 64, 81920, 32, 1), ("full", 64, 81920, 128, 1), ("full", 64, 81920, 16, 4)])


def lengths(dist: str, B: int, cap: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dist == "full":
        return np.full(B, cap, np.int64)
    if dist == "uniform":
        return rng.integers(min(256, cap), cap + 1, B)
    if dist == "tail":
        return np.where(rng.random(B) < 0.1, cap, rng.integers(64, min(2048, cap) + 1, B))
    raise ValueError(f"dist: expected one of {DISTS}, got {dist!r}")


def case_of(dist, B, cap, H, S, dtype="bfloat16", page=64) -> Case:
    return Case(f"{dist}_B{B}_K{cap}_H{H}_S{S}", dtype, B, S, H, page, cap // page)


def inputs(c: Case, lens: np.ndarray, seed: int):
    """q, cache (random, every page owned by one request, pages permuted), table, lengths, scale."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    perm = rng.permutation(c.num_pages)
    bt = perm[: c.B * c.max_pages].reshape(c.B, c.max_pages)
    kv = jax.random.normal(jax.random.PRNGKey(seed), (c.num_pages, c.page, 576), jnp.bfloat16)
    q = jax.random.normal(jax.random.PRNGKey(seed + 1), (c.B, c.S, c.H, 576), jnp.bfloat16)
    return q, kv, jnp.asarray(bt, jnp.int32), jnp.asarray(lens, jnp.int32), jnp.float32(576 ** -0.5)


def read_bytes(lens: np.ndarray, S: int, H: int, elt: int) -> float:
    """KV bytes of the actual lengths, plus q (elt bytes) and the bf16 output."""
    return float(np.sum(lens)) * 576 * elt + len(lens) * S * H * (576 * elt + 512 * 2)


def flops_of(lens: np.ndarray, S: int, H: int) -> float:
    return float(np.sum(lens)) * S * H * 2 * (576 + 512)


def flashmla_calls(fm, q, kv, bt, sl):
    """Zero-argument FlashMLA calls on the same data (dlpack): ``(bf16, fp8 fork)``; the FP8 one casts the bf16 q
    and cache once, with unit descales."""
    import torch

    tq, tk = torch.from_dlpack(q), torch.from_dlpack(kv).view(kv.shape[0], kv.shape[1], 1, 576)
    tbt, tsl = torch.from_dlpack(bt), torch.from_dlpack(sl)
    sched, _ = fm.get_mla_metadata()
    tq8, tk8 = tq.to(torch.float8_e4m3fn), tk.to(torch.float8_e4m3fn)
    one = torch.ones(1, dtype=torch.float32, device=tq.device)

    def run():
        return fm.flash_mla_with_kvcache(tq, tk, tbt, tsl, 512, sched, None, softmax_scale=576 ** -0.5, causal=True)

    def run8():
        return fm.flash_mla_fp8_dense(tq8, tk8, tbt, tsl, 576 ** -0.5, True, one, one)

    return run, run8


def our_contenders(q, kv, q8, kv8, bt, sl, scale, c: Case | None = None, configs: tuple[str, ...] = ()) -> dict:
    """Our contenders on one case's inputs: name -> ``(jitted f, args, fp8)``.

    * ``ours {dt}``: ``mla_decode`` computing its schedule in the call;
    * ``ours {dt} kernel``: the kernels alone on a schedule computed once outside (``mla_decode_work``, as a model
      step shares it across its layers, and as FlashMLA's metadata is timed);
    * ``ours {dt} invariant``: the same with ``batch_invariant=True`` (its own shared work): the cost of batch
      invariance is its time over ``ours {dt} kernel``'s;
    * ``schedule {dt}``: the schedule alone (``mla_decode_work``);
    * ``ours {dt} kernel NAME``: the kernels of config ``NAME`` of ``configs`` (where it runs case ``c``) on its
      schedule computed once outside (``sm90_decode.schedule_of``)."""
    import dataclasses

    import jax

    import tokenspeed_jax as tj
    from tokenspeed_jax.backends import sm90_decode
    from tokenspeed_jax.decode import _decode_problem

    out = {}
    for dt, qq, kk, fp8 in (("bf16", q, kv, False), ("fp8", q8, kv8, True)):
        plain = jax.jit(lambda q_, kv_, bt_, sl_, s_: tj.mla_decode(q_, kv_, bt_, sl_, softmax_scale=s_,
                                                                    return_lse=True, backend="sm90"))
        out[f"ours {dt}"] = (plain, (qq, kk, bt, sl, scale), fp8)
        for suffix, inv in (("kernel", False), ("invariant", True)):
            sched_f = jax.jit(lambda q_, kv_, bt_, sl_, inv=inv: tj.mla_decode_work(q_, kv_, bt_, sl_, backend="sm90",
                                                                                  batch_invariant=inv))
            work = tj.mla_decode_work(qq, kk, bt, sl, backend="sm90", batch_invariant=inv)  # (shapes of q, kv)
            kf = jax.jit(lambda q_, kv_, bt_, sl_, s_, w_, inv=inv: tj.mla_decode(
                q_, kv_, bt_, sl_, softmax_scale=s_, return_lse=True, backend="sm90", work=w_, batch_invariant=inv))
            out[f"ours {dt} {suffix}"] = (kf, (qq, kk, bt, sl, scale, work), fp8)
            if not inv:
                out[f"schedule {dt}"] = (sched_f, (qq, kk, bt, sl), False)
        for name in configs:
            cdt = dataclasses.replace(c, dtype="float8_e4m3fn" if fp8 else "bfloat16")
            if not config_applies(cdt, name):
                continue
            cfg = named_config(name)
            work = jax.jit(lambda q_, kv_, bt_, sl_, cfg=cfg: sm90_decode.schedule_of(
                _decode_problem(q_, kv_, bt_, sl_, True, 512, True), sl_, cfg))(qq, kk, bt, sl)
            out[f"ours {dt} kernel {name}"] = (decode_fn(cdt, "sm90", name),
                                               (qq, kk, bt, sl, scale, work), fp8)
    return out


def bench_case(report, fm, spec, seed: int, rounds: int, calls: int, configs: tuple[str, ...] = ()) -> None:
    import jax
    import jax.numpy as jnp

    from benchmarks.harness import interleaved

    dist, B, cap, H, S = spec
    lens = lengths(dist, B, cap, seed)
    c = case_of(dist, B, cap, H, S)
    q, kv, bt, sl, scale = inputs(c, lens, seed)
    q8, kv8 = q.astype(jnp.float8_e4m3fn), kv.astype(jnp.float8_e4m3fn)
    nb, nb8, fl = read_bytes(lens, S, H, 2), read_bytes(lens, S, H, 1), flops_of(lens, S, H)
    fns = {}
    contenders = our_contenders(q, kv, q8, kv8, bt, sl, scale, c, configs)
    for name, (f, args, fp8) in contenders.items():
        fns[name] = ((lambda f=f, args=args: f(*args)) if name.startswith("schedule") else _jax_calls(f, args, calls),
                     0.0 if name.startswith("schedule") else (nb8 if fp8 else nb), fp8)
    diffs = {}
    if fm is not None:
        run, run8 = flashmla_calls(fm, q, kv, bt, sl)
        fns["FlashMLA bf16"] = (run, nb, False)
        ref = np.asarray(jax.dlpack.from_dlpack(run()[0]).astype(jnp.float32))

        def out_of(name):
            f, args, _ = contenders[name]
            return np.asarray(f(*args)[0].astype(jnp.float32))

        for name in ("ours bf16", "ours bf16 invariant", *(f"ours bf16 kernel {n}" for n in configs)):
            if name in contenders:
                diffs[name] = float(np.max(np.abs(out_of(name) - ref)))
        try:
            ref8 = np.asarray(jax.dlpack.from_dlpack(run8()[0]).astype(jnp.float32))
            fns["FlashMLA fp8"] = (run8, nb8, True)
            for name in ("ours fp8", "ours fp8 invariant", *(f"ours fp8 kernel {n}" for n in configs)):
                if name in contenders:
                    diffs[name] = float(np.max(np.abs(out_of(name) - ref8)))
        except Exception as e:  # noqa: BLE001
            print(f"{c.name}: FlashMLA fp8 failed: {str(e)[:100]}", flush=True)
    est = max(nb / 4e12, fl / 6e14) * 1e6 * calls
    res = interleaved({n: f for n, (f, _, _) in fns.items()}, est, rounds=rounds)
    for n, (_, b, fp8) in fns.items():
        r = res[n]
        us = r["median_us"] / (calls if n.startswith("ours") else 1)
        sched = n.startswith("schedule")  # (the schedule alone reads a few bytes and does no attention FLOPs)
        report.add(c.name, n, us, nbytes=b, flops=0.0 if sched else fl, fp8=fp8,
                   note=f"interleaved median of {rounds} rounds",
                   dist=dist, B=B, capacity=cap, H=H, S=S, mean_len=float(np.mean(lens)),
                   max_diff_flashmla=diffs.get(n))
    print("\n".join(report.table().splitlines()[-len(fns):]), flush=True)


def summary(rows: list[dict]) -> dict:
    """Geometric means of ours / FlashMLA time ratios (speed-ups) per dtype and distribution: ``{dt}_{dist}`` with
    the schedule computed in every call (``mla_decode`` without ``work``), ``{dt}_{dist}_shared`` with it computed
    once per step and shared by the layers (the kernels alone, as FlashMLA's metadata is timed: computed once);
    ``{dt}_{dist}_invariant_cost``: the batch-invariant kernels' time over the default ones' (both on a shared
    work), geometric mean, the largest, and per case."""
    out: dict = {}
    by = {}
    for r in rows:
        if r.get("us"):
            by[(r["case"], r["contender"])] = r["us"]
    for dt in ("bf16", "fp8"):
        for dist in (*DISTS, "all"):
            for suffix, ours in (("", f"ours {dt}"), ("_shared", f"ours {dt} kernel")):
                xs = [by[(case, f"FlashMLA {dt}")] / by[(case, ours)] for (case, cont) in by
                      if cont == ours and (case, f"FlashMLA {dt}") in by and (dist == "all" or
                                                                              case.startswith(dist + "_"))]
                if xs:
                    out[f"{dt}_{dist}{suffix}"] = {"geomean_speedup": float(np.exp(np.mean(np.log(xs)))),
                                                   "min": float(min(xs)), "n": len(xs)}
            # the cost of batch invariance: the invariant kernels' time over the default kernels' (shared works)
            xs = {case: by[(case, f"ours {dt} invariant")] / by[(case, f"ours {dt} kernel")] for (case, cont) in by
                  if cont == f"ours {dt} invariant" and (case, f"ours {dt} kernel") in by
                  and (dist == "all" or case.startswith(dist + "_"))}
            if xs:
                v = list(xs.values())
                out[f"{dt}_{dist}_invariant_cost"] = {"geomean_time_ratio": float(np.exp(np.mean(np.log(v)))),
                                                      "max": float(max(v)), "n": len(v), "per_case": xs}
        # --config: each config's speed-up over the selected config's kernels (both on a shared schedule)
        pre = f"ours {dt} kernel "
        for name in sorted({cont[len(pre):] for (_, cont) in by if cont.startswith(pre)}):
            xs = {case: by[(case, pre.strip())] / by[(case, cont)] for (case, cont) in by
                  if cont == pre + name and (case, pre.strip()) in by}
            v = list(xs.values())
            out[f"{dt}_config_{name}_speedup"] = {"geomean": float(np.exp(np.mean(np.log(v)))), "min": float(min(v)),
                                                  "n": len(v), "per_case": xs}
    return out


def plot(doc: dict, png_path: str) -> None:
    """Two panels per case: the speed-up over FlashMLA / the FP8 fork (BF16 and FP8; the schedule shared by the layers
    and computed in the call), and the fraction of the measured roofline (copy bandwidth, tensor peak) on the bytes
    actually read (ours on a shared schedule, FlashMLA, both dtypes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    us = {(r["case"], r["contender"]): r for r in doc["rows"] if r.get("us")}
    cases = list(dict.fromkeys(r["case"] for r in doc["rows"]))
    x = np.arange(len(cases))
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(max(8.0, 0.9 * len(cases) + 3), 7), sharex=True)
    bars1 = [(f"{dt} {lab}", f"ours {dt}{suf}", f"FlashMLA {dt}") for dt in ("bf16", "fp8")
             for lab, suf in (("shared schedule", " kernel"), ("per call", ""))]
    bars2 = [(f"{who} {dt}", f"ours {dt} kernel" if who == "ours" else f"FlashMLA {dt}")
             for dt in ("bf16", "fp8") for who in ("ours", "FlashMLA")]
    w = 0.8 / len(bars1)
    for i, (lab, ours, ref) in enumerate(bars1):
        v = [us[(c, ref)]["us"] / us[(c, ours)]["us"] if (c, ref) in us and (c, ours) in us else np.nan for c in cases]
        a1.bar(x + i * w, v, w, label=lab)
    a1.axhline(1.0, color="k", lw=0.8)
    a1.set_ylabel("speed-up over FlashMLA / fork")
    a1.legend(fontsize=7, ncol=4)
    for i, (lab, name) in enumerate(bars2):
        a2.bar(x + i * w, [us[(c, name)].get("roofline_fraction", np.nan) if (c, name) in us else np.nan
                           for c in cases], w, label=lab)
    a2.axhline(1.0, color="k", lw=0.8)
    a2.set_ylabel("fraction of measured roofline\n(bytes actually read)")
    a2.legend(fontsize=7, ncol=4)
    a2.set_xticks(x + 0.4 - w / 2)
    a2.set_xticklabels(cases, rotation=30, ha="right", fontsize=7)
    a1.set_title(f"{doc['name']} on {doc['device']} ({doc['date']}, commit {doc.get('commit')})", fontsize=9)
    fig.text(0.01, 0.005, doc["command"][:200], fontsize=5)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def smoke(specs, seed: int, configs: tuple[str, ...] = ()) -> None:
    """``--smoke``: each case's contenders of :func:`our_contenders` lowered for sm_90a on this machine (the CuTe DSL
    kernels compiled), on shape-only inputs; nothing runs."""
    import jax
    import jax.numpy as jnp

    from tokenspeed_jax.runtime import target_override

    sd = jax.ShapeDtypeStruct
    t = time.time()
    for i, spec in enumerate(specs):
        dist, B, cap, H, S = spec
        c = case_of(dist, B, cap, H, S)
        lens = lengths(dist, B, cap, seed + i)
        bt = jnp.zeros((B, c.max_pages), jnp.int32)
        sl = jnp.asarray(lens, jnp.int32)
        with target_override("sm_90a", num_sms=132):
            q, kv = sd((B, S, H, 576), jnp.bfloat16), sd((c.num_pages, c.page, 576), jnp.bfloat16)
            q8, kv8 = sd(q.shape, jnp.float8_e4m3fn), sd(kv.shape, jnp.float8_e4m3fn)
            # (the works are computed here on the CPU: the schedule is jnp)
            for name, (f, args, _) in our_contenders(q, kv, q8, kv8, bt, sl, jnp.float32(576 ** -0.5), c,
                                                     configs).items():
                args = tuple(sd(a.shape, a.dtype) if isinstance(a, jax.Array) and a.ndim == 4 else a for a in args)
                f.trace(*args).lower(lowering_platforms=("cuda",))
                print(f"smoke {c.name} {name}: lowered", flush=True)
    print(f"smoke: {len(specs)} cases in {time.time() - t:.0f}s")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=None, metavar="DIST,B,CAP,H,S")
    ap.add_argument("--prewarm", type=int, default=0, help="CPU worker processes compiling every config first")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-flashmla", action="store_true")
    ap.add_argument("--out", default="/tmp/decode_varlen.json")
    ap.add_argument("--png", default=None)
    ap.add_argument("--config", action="append", default=[], metavar="NAME",
                    help="also time this kernel config of tokenspeed_jax.backends.sm90_decode.CONFIGS (or "
                         "NAME/noprefetch) on a shared schedule (repeatable)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU: lower every one of our contenders (default, shared work, batch-invariant; BF16 and FP8) "
                         "of the cases for sm_90a, compiling the kernels, and time nothing")
    ap.add_argument("--replot", default=None, metavar="JSON", help="draw --png from a result JSON of this script; "
                    "run nothing")
    from benchmarks.runinfo import parse_with_smoke

    a = parse_with_smoke(ap, {"cases": ["uniform,4,4096,16,1"], "no_flashmla": True}, argv)
    if a.replot:
        import json

        if not a.png:
            ap.error("--replot: expected --png PATH")
        with open(a.replot) as f:
            plot(json.load(f), a.png)
        return
    specs = DEFAULT if not a.cases else [
        (d, int(b), int(k), int(h), int(s)) for d, b, k, h, s in (x.split(",") for x in a.cases)]
    for s in specs:
        if s[0] not in DISTS:
            ap.error(f"--cases: distribution must be one of {DISTS}, got {s[0]!r}")
    for n in a.config:
        try:
            named_config(n)
        except ValueError as e:
            ap.error(f"--{e}")
    if a.smoke:
        smoke(specs, a.seed, tuple(a.config))
        return
    from benchmarks.harness import Report, measure_ceilings

    if a.prewarm:
        cs = [case_of(*s, dtype=dt) for s in specs for dt in ("bfloat16", "float8_e4m3fn")]
        prewarm(cs, a.prewarm, configs=tuple(a.config), invariant=True)
    fm = None
    if not a.no_flashmla:
        try:
            import flash_mla as fm
        except Exception as e:  # noqa: BLE001
            print("flash_mla unavailable:", e)
    report = Report("MLA decode, varied lengths (page 64, causal)", measure_ceilings())
    t = time.time()
    for i, s in enumerate(specs):
        bench_case(report, fm, s, a.seed + i, a.rounds, a.calls, tuple(a.config))
        if i + 1 < len(specs):
            report.write(a.out, None)  # the cases so far (a call cut short keeps them)
    doc = report.write(a.out, None, summary=summary(report.rows))
    if a.png:
        plot(doc, a.png)
    import json

    print(json.dumps(doc["summary"], indent=1))
    print(f"{len(specs)} cases in {time.time() - t:.0f}s")


if __name__ == "__main__":
    main()
