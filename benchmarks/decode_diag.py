"""Diagnostics of the sm90 decode schedule on varied lengths: per-kernel profile, per-piece cost, cost-model sweep.

    source .device/bootstrap.sh && python -m benchmarks.decode_diag --out $OUT/diag.json

Parts: (1) per-kernel device time of one decode call (schedule fusions, main kernel, combine) from a
profiler trace; (2) per-piece overhead: full-length batches of the same total tokens as 1..32 whole requests per
CTA (H 32 and 128), ours (and each ``--config``, e.g. ``seesaw``) vs FlashMLA; (4) the schedule alone
per B (device time per call, many calls in one executable); (5) the schedule's fixed cost per piece (``--fixed-costs`` in
``choose`` mode, ``--balanced-costs`` in ``balanced`` mode) swept on the varied and full-length cases of ``--cases`` (kernels on a shared
schedule, FlashMLA interleaved; the earlier sweeps of mode, ``prefer`` and unit, 2026-12-04 and 12-05, are in
``docs/notes/sm90_decode_journal.md``); (6) the cost of a piece by its kind (:func:`piece_cases`,
:func:`fit_piece_cost`): ``k`` pieces of ``n`` tiles per CTA, whole requests or every CTA one half of a split request,
lengths a whole number of tiles or half a tile short, ours (and each ``--config``, e.g. ``transposed/noprefetch``)
and FlashMLA; run it alone with ``--parts 6``."""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import time
from collections import defaultdict

import numpy as np

from benchmarks.decode import named_config
from benchmarks.decode_varlen import case_of, flashmla_calls, inputs, lengths, read_bytes


def kernel_times(trace_dir: str, calls: int) -> dict[str, float]:
    """µs per call of each GPU kernel name in the trace."""
    from jax.profiler import ProfileData

    tot: dict[str, float] = defaultdict(float)
    for f in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        for plane in ProfileData.from_file(f).planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                if "Stream" not in line.name and "stream" not in line.name:
                    continue
                for ev in line.events:
                    tot[ev.name[:70]] += ev.duration_ns / 1e3 / calls
    return dict(sorted(tot.items(), key=lambda kv: -kv[1]))


def _ints(arg: str | None, default: list[int]) -> list[int]:
    """A comma-separated option's integers, or ``default`` where it was not given."""
    return [int(x) for x in arg.split(",") if x] if arg is not None else default


PIECE_TILES = (4, 16, 64)  # part 6: tiles per piece (short requests of the long tail, up to a 4096-token request)
PIECE_PER_CTA = (1, 2, 4)  # part 6: direct pieces per CTA (48 batches for both dtypes at one H: ~4-5 min on a GPU)


def piece_cases(num_ctas: int, tiles=PIECE_TILES, per_cta=PIECE_PER_CTA):
    """Part 6's batches for a grid of ``num_ctas`` CTAs: ``(kind, n, short, k, B, L)``, every request of length ``L``,
    ``n`` 64-token tiles per piece, the last tile ``short`` tokens short (0 or 32):

    * ``direct``: ``B = k * num_ctas`` requests of ``n`` tiles, so a balanced cut of fixed cost 0 gives every CTA ``k``
      whole requests (each direct: its output written by the main kernel);
    * ``split``: ``B = num_ctas / 2`` requests of ``2 n`` tiles, so every CTA gets one half of a request (an fp32
      partial each, merged by the combine); ``num_ctas`` even only.

    So a piece's cost beyond its tiles is the slope over ``k`` of the direct batches' time less ``n`` tiles, and a
    split piece's extra cost (partial, combine) the split batch's time less the direct batch's of ``k = 1``."""
    out = []
    for n in tiles:
        for short in (0, 32):
            out += [("direct", n, short, k, k * num_ctas, 64 * n - short) for k in per_cta]
            if num_ctas % 2 == 0:
                out.append(("split", n, short, 1, num_ctas // 2, 128 * n - short))
    return out


def piece_layout(work, lens, capacity: int, kind: str, k: int) -> dict:
    """``{"pieces_per_cta": [min, max], "split_pieces": count}`` of the schedule ``work = (cta, req)`` of a
    :func:`piece_cases` batch, or a ``ValueError`` if it is not the batch's layout (``k`` pieces in every CTA, all
    direct or all split as ``kind`` says)."""
    from tokenspeed_jax.decode_schedule import reference_pieces

    cta, req = (np.asarray(x) for x in work)
    pcs = reference_pieces(cta, req, lens, capacity)
    per = np.bincount([p[0] for p in pcs], minlength=cta.shape[0])
    got = {"pieces_per_cta": [int(per.min()), int(per.max())], "split_pieces": int(sum(p[4] >= 0 for p in pcs))}
    if got["pieces_per_cta"] != [k, k] or got["split_pieces"] != (len(pcs) if kind == "split" else 0):
        raise ValueError(f"part 6: a {kind} batch of {k} pieces per CTA, but its schedule gives {got}")
    return got


def fit_piece_cost(rows: list[dict], contenders: list[str]) -> list[dict]:
    """Part 6's fit, per ``(dtype, H, contender, short)``: the time of a direct piece of ``n`` tiles, ``p(n)``, is the
    least-squares slope over ``k`` of the median µs of ``k`` pieces per CTA; then ``p(n) = a n + beta`` over ``n``
    gives ``a`` (µs per tile) and ``beta`` (µs per piece beyond its tiles, also in tiles: ``beta / a``); ``split(n)``
    is a split batch's time less the direct batch's of ``k = 1`` at the same ``n`` (a split piece's partial and
    combine).  Rows missing a contender are skipped."""
    groups: dict = defaultdict(list)
    for r in rows:
        groups[(r["dtype"], r["H"], r["short"])].append(r)
    fits = []
    for (dt, H, short), rs in sorted(groups.items()):
        for name in contenders:
            per_piece, split = {}, {}
            for n in sorted({r["tiles"] for r in rs}):
                d = [(r["k"], r[name]) for r in rs if r["tiles"] == n and r["kind"] == "direct" and name in r]
                if len(d) >= 2:
                    k, t = np.array(d, np.float64).T
                    per_piece[n] = float(np.polyfit(k, t, 1)[0])
                one = [r[name] for r in rs if r["tiles"] == n and r["kind"] == "direct" and r["k"] == 1 and name in r]
                sp = [r[name] for r in rs if r["tiles"] == n and r["kind"] == "split" and name in r]
                if one and sp:
                    split[n] = sp[0] - one[0]
            fit = {"dtype": dt, "H": H, "short": short, "contender": name, "per_piece_us": per_piece,
                   "split_extra_us": split}
            if len(per_piece) >= 2:
                n_, p_ = np.array(sorted(per_piece.items()), np.float64).T
                a, beta = np.polyfit(n_, p_, 1)
                fit.update(us_per_tile=float(a), beta_us=float(beta), beta_tiles=float(beta / a) if a > 0 else None)
            fits.append(fit)
    return fits


def case_inputs(specs):
    """``(case, lengths, q, kv, table, seq_lens, dtype, q in dtype, kv in dtype)`` for each ``(dist, B, capacity, H,
    S)`` of ``specs`` and each dtype (BF16, FP8): the same random inputs for both dtypes (seed 0)."""
    for dist, B, cap, H, S in specs:
        lens = lengths(dist, B, cap, 0)
        c = case_of(dist, B, cap, H, S)
        q, kv, bt, sl, _ = inputs(c, lens, 0)
        for dt in ("bfloat16", "float8_e4m3fn"):
            yield c, lens, q, kv, bt, sl, dt, q.astype(dt), kv.astype(dt)


def main(argv=None):
    import jax
    import jax.numpy as jnp

    from benchmarks.harness import interleaved
    from tokenspeed_jax import mla_decode
    from tokenspeed_jax.backends import sm90_decode
    from tokenspeed_jax.decode import _decode_problem
    from tokenspeed_jax.decode_schedule import decode_schedule

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/diag.json")
    ap.add_argument("--parts", default="1245")
    ap.add_argument("--cases", nargs="*", default=None,
                    help="part 5: dist,B,capacity,H,S cases (default: the README's decode table and 3 more)")
    ap.add_argument("--config", action="append", default=[], metavar="NAME",
                    help="parts 2 and 6: also time this config of tokenspeed_jax.backends.sm90_decode.CONFIGS, or "
                         "NAME/noprefetch (benchmarks.decode.named_config; repeatable)")
    ap.add_argument("--fixed-costs", default=None, help="part 5: the choose mode's fixed costs, 64-token tiles, comma "
                    "separated (default: the backend's, then 8, 12, 24)")
    ap.add_argument("--balanced-costs", default=None, help="part 5: the balanced mode's fixed costs (default: the "
                    "backend's)")
    ap.add_argument("--piece-heads", default=None, help="part 6: H, comma separated (default 32)")
    ap.add_argument("--piece-tiles", default=None, help=f"part 6: tiles per piece (default {PIECE_TILES})")
    ap.add_argument("--piece-per-cta", default=None, help=f"part 6: direct pieces per CTA (default {PIECE_PER_CTA})")
    args = ap.parse_args(argv)
    from benchmarks.runinfo import provenance

    res: dict = {"name": f"sm90 decode diagnostics, parts {args.parts}", **provenance()}

    def dump():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    try:
        import flash_mla as fm
        import torch
    except Exception:  # noqa: BLE001
        fm = torch = None

    def fm_fn(q, kv, bt, sl, fp8):
        return flashmla_calls(fm, q, kv, bt, sl)[1 if fp8 else 0]

    def kernel_with(prob, spec_kw, config=None):
        base = sm90_decode.schedule_spec(prob, sm90_decode.plan_for_config(prob, config or
                                                                           sm90_decode.select_config(prob)))
        if "unit" in spec_kw and "split_units" not in spec_kw:  # the per-request cut in the new unit
            spec_kw = {**spec_kw, "split_units": max(1, base.split_units * base.unit // spec_kw["unit"])}
        spec = dataclasses.replace(base, **spec_kw)
        sched = jax.jit(lambda sl_: decode_schedule(sl_, spec))
        kf = jax.jit(lambda q_, kv_, bt_, sl_, w_: sm90_decode.decode(
            prob, q_, kv_, bt_, sl_, jnp.float32(576 ** -0.5), jnp.float32(1.0), config=config, work=w_))
        return sched, kf

    cases = [("uniform", 64, 81920, 32, 1), ("tail", 64, 81920, 32, 1), ("uniform", 256, 4096, 32, 1),
             ("uniform", 64, 81920, 128, 1), ("full", 64, 81920, 32, 1), ("uniform", 64, 81920, 16, 4)]
    from benchmarks.decode import prewarm

    sweep = ([tuple(int(x) if i else x for i, x in enumerate(a.split(","))) for a in args.cases] if args.cases
             else [("full", 64, 81920, 32, 1), ("uniform", 64, 81920, 32, 1), ("uniform", 64, 81920, 16, 1),
                   ("full", 64, 81920, 128, 1), ("uniform", 64, 81920, 128, 1), ("tail", 64, 81920, 32, 1),
                   ("uniform", 256, 4096, 32, 1), ("uniform", 64, 81920, 16, 4), ("uniform", 128, 32768, 16, 2),
                   ("tail", 64, 81920, 128, 1)])
    heads = _ints(args.piece_heads, [32])
    warm = (cases if set(args.parts) - {"5", "6"} else []) + (sweep if "5" in args.parts else []) + (
        [("full", 132, 4096, H, 1) for H in heads] if "6" in args.parts else [])
    prewarm([dataclasses.replace(case_of(*sp), dtype=dt) for sp in warm for dt in ("bfloat16", "float8_e4m3fn")
             if sp[0] != "tail" or "5" in args.parts], 15, configs=tuple(args.config))
    # ---- (1) per-kernel breakdown
    if "1" in args.parts:
        res["breakdown"] = {}
        for c, lens, q, kv, bt, sl, dt, qq, kk in case_inputs(cases):
            f = jax.jit(lambda q_, kv_, bt_, sl_: mla_decode(q_, kv_, bt_, sl_, softmax_scale=576 ** -0.5,
                                                             backend="sm90"))
            jax.block_until_ready(f(qq, kk, bt, sl))
            d = f"/tmp/diag_trace/{c.name}_{dt}"
            jax.profiler.start_trace(d)
            for _ in range(5):
                o = f(qq, kk, bt, sl)
            jax.block_until_ready(o)
            if fm is not None:
                r = fm_fn(q, kv, bt, sl, dt != "bfloat16")
                for _ in range(5):
                    r()
                torch.cuda.synchronize()
            jax.profiler.stop_trace()
            kt = kernel_times(d, 5)
            res["breakdown"][f"{c.name} {dt[:4]}"] = kt
            print(c.name, dt, json.dumps({k: round(v, 1) for k, v in list(kt.items())[:12]}), flush=True)
            dump()
    # ---- (2) per-piece overhead: same total tokens, 1..32 whole requests per CTA (full length; the schedule cuts
    #      at the request boundaries: no partials), the selected config and each --config on a shared schedule
    if "2" in args.parts:
        from benchmarks.decode import config_applies

        res["pieces"] = []
        for dt in ("bfloat16", "float8_e4m3fn"):
            for H, ppc in [(H, p) for H in (32, 128) for p in (1, 2, 4, 8, 16, 32)]:
                B, L = 132 * ppc, 16384 // ppc
                c = case_of("full", B, L, H, 1)
                q, kv, bt, sl, scale = inputs(c, lengths("full", B, L, 0), 0)
                qq, kk = q.astype(dt), kv.astype(dt)
                prob = _decode_problem(qq, kk, bt, sl, True, 512, True)
                fns = {}
                for name in ("ours", *(n for n in args.config
                                       if config_applies(dataclasses.replace(c, dtype=dt), n))):
                    sched, kf = kernel_with(prob, {}, None if name == "ours" else named_config(name))
                    w = sched(sl)
                    fns[name] = (lambda kf=kf, w=w: kf(qq, kk, bt, sl, w))
                if fm is not None:
                    fns["FlashMLA"] = fm_fn(q, kv, bt, sl, dt != "bfloat16")
                nb = read_bytes(np.full(B, L), 1, H, 2 if dt == "bfloat16" else 1)
                r = interleaved(fns, nb / 4e12 * 1e6, rounds=5)
                row = {"dtype": dt, "H": H, "pieces_per_cta": ppc, "B": B, "L": L,
                       **{k: v["median_us"] for k, v in r.items()}}
                res["pieces"].append(row)
                print(row, flush=True)
                dump()
    # ---- (4) the schedule alone
    if "4" in args.parts:
        res["schedule"] = []
        for B in (1, 64, 256, 1024):
            c = case_of("uniform", B, 32768, 32, 1)
            q, kv, bt, sl, scale = inputs(c, lengths("uniform", B, 32768, 0), 0)
            prob = _decode_problem(q, kv, bt, sl, True, 512, True)
            spec = sm90_decode.schedule_spec(prob, sm90_decode.plan_for_config(prob, sm90_decode.select_config(prob)))
            n = 10
            g = jax.jit(lambda s_: decode_schedule(s_, spec))
            jax.block_until_ready(g(sl))
            t = time.perf_counter()
            for _ in range(n):
                o = g(sl)
            jax.block_until_ready(o)
            per = (time.perf_counter() - t) / n * 1e6
            d = f"/tmp/diag_trace/sched_B{B}"
            jax.profiler.start_trace(d)
            for _ in range(n):
                o = g(sl)
            jax.block_until_ready(o)
            jax.profiler.stop_trace()
            kt = kernel_times(d, n)
            row = {"B": B, "us_per_schedule_wall": per, "kernel_names": len(kt), "device_us": sum(kt.values()),
                   "top": {k: round(v, 2) for k, v in list(kt.items())[:20]}}
            res["schedule"].append(row)
            print(row, flush=True)
            dump()
    # ---- (5) the schedule's policy: mode, fixed cost, prefer (kernels alone, schedule precomputed)
    if "5" in args.parts:
        res["policy"] = []
        own = sm90_decode._FIXED_COST
        variants = {f"choose fc{fc}": {"fixed_cost": fc} for fc in _ints(args.fixed_costs, [own, 8, 12, 24])}
        variants.update({f"balanced fc{fc}": {"mode": "balanced", "fixed_cost": fc}
                         for fc in _ints(args.balanced_costs, [own])})
        for c, lens, q, kv, bt, sl, dt, qq, kk in case_inputs(sweep):
            S, H = c.S, c.H
            prob = _decode_problem(qq, kk, bt, sl, True, 512, True)
            fns = {}
            _, kf = kernel_with(prob, {})  # one executable: the schedule is its operand
            for name, kw in variants.items():
                sched, _ = kernel_with(prob, kw)
                w = sched(sl)
                fns[name] = (lambda w=w: kf(qq, kk, bt, sl, w))
            if fm is not None:
                fns["FlashMLA"] = fm_fn(q, kv, bt, sl, dt != "bfloat16")
            nb = read_bytes(lens, S, H, 2 if dt == "bfloat16" else 1)
            r = interleaved(fns, nb / 4e12 * 1e6, rounds=5)
            row = {"case": c.name, "dtype": dt, **{k: v["median_us"] for k, v in r.items()}}
            res["policy"].append(row)
            print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}),
                  flush=True)
            dump()
    # ---- (6) the cost of a piece by its kind (piece_cases, fit_piece_cost): kernels on a precomputed balanced schedule
    #      of fixed cost 0 (every cut where piece_cases puts it, checked), FlashMLA on its own metadata
    if "6" in args.parts:
        from benchmarks.decode import config_applies, shapes

        res["piece_cost"] = []
        names = ["ours"]
        for dt in ("bfloat16", "float8_e4m3fn"):
            for H in heads:
                probe = _decode_problem(*shapes(dataclasses.replace(case_of("full", 2, 4096, H, 1), dtype=dt)), True,
                                        512, True)
                G = sm90_decode.work_key(probe)[1].num_ctas
                for kind, n, short, k, B, L in piece_cases(G, _ints(args.piece_tiles, list(PIECE_TILES)),
                                                                 _ints(args.piece_per_cta, list(PIECE_PER_CTA))):
                    cap = -(-L // 64) * 64
                    c = case_of("full", B, cap, H, 1)
                    lens = np.full(B, L, np.int64)
                    q, kv, bt, sl, _ = inputs(c, lens, 0)
                    qq, kk = q.astype(dt), kv.astype(dt)
                    prob = _decode_problem(qq, kk, bt, sl, True, 512, True)
                    fns, got = {}, None
                    for name in ("ours", *(x for x in args.config
                                           if config_applies(dataclasses.replace(c, dtype=dt), x))):
                        sched, kf = kernel_with(prob, {"mode": "balanced", "fixed_cost": 0},
                                                None if name == "ours" else named_config(name))
                        w = sched(sl)
                        if got is None:
                            got = piece_layout(w, lens, cap, kind, k)
                        fns[name] = (lambda kf=kf, w=w, a=(qq, kk, bt, sl): kf(*a, w))
                        names += [name] if name not in names else []
                    if fm is not None:
                        fns["FlashMLA"] = fm_fn(q, kv, bt, sl, dt != "bfloat16")
                        names += ["FlashMLA"] if "FlashMLA" not in names else []
                    nb = read_bytes(lens, 1, H, 2 if dt == "bfloat16" else 1)
                    r = interleaved(fns, nb / 4e12 * 1e6, rounds=5)
                    row = {"dtype": dt, "H": H, "kind": kind, "tiles": n, "short": short, "k": k, "B": B, "L": L,
                           **got, **{x: v["median_us"] for x, v in r.items()}}
                    res["piece_cost"].append(row)
                    print(json.dumps({x: (round(v, 1) if isinstance(v, float) else v) for x, v in row.items()}),
                          flush=True)
                    dump()
        res["piece_cost_fit"] = fit_piece_cost(res["piece_cost"], names)
        for f in res["piece_cost_fit"]:
            print(json.dumps({x: (round(v, 2) if isinstance(v, float) else v) for x, v in f.items()}), flush=True)
        dump()


if __name__ == "__main__":
    main()
