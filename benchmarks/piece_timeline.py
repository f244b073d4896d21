"""Per-piece timeline of the sm90 decode kernel on varied lengths: a debug build that records each CTA's pieces.

    source .device/bootstrap.sh && python -m benchmarks.piece_timeline --out $OUT/pieces.json
    source .device/bootstrap.sh && python -m benchmarks.piece_timeline --cases tail,64,81920,32,1 --fixed-costs 2,16 \\
        --config transposed/noprefetch

For each case (``dist,B,capacity,H,S`` of ``benchmarks.decode_varlen``, its seed-0 lengths, as ``decode_diag``
parts 5 and 6) and each schedule fixed cost, the jnp schedule of the backend's spec with that fixed cost; the normal
build of the config (``select_config``'s, or ``--config``: a name of ``benchmarks.decode.named_config``) and its
piece-traced build (``tokenspeed_jax.kernels.sm90.decode.launch_decode_piece_traced``: thread 0 of each CTA stores
``clock64`` at a piece's start, after its Q barrier, at its epilogue barrier and after its last barrier, and the
``globaltimer`` at its start and end) run on that schedule, and the traced output must equal the normal one bit for
bit (the marks add stores only), else the run stops.  The traced build is the real kernel, prefetch across pieces
included.  It runs once, after two warm-up launches.

Printed and written (``--out``, JSON; :func:`summarize`): per piece kind (direct / split) the median start, loop,
epilogue and gap (from the CTA's previous piece) in µs; per kind and whether the CTA runs another piece after it
(``direct_next``, ``split_last``, ...) the loop's µs a tile and the epilogue's steps (its barrier, the next Q tile's
copies in the loop that prefetches it, the stores, the wait at the piece's last barrier); a least-squares fit of a
piece's time on its tiles with a constant per kind (what a piece costs beyond its tiles); the kernel's span and the
CTAs that finish last, with their pieces and tiles (what paces the kernel).  The question it answers: why CTAs
holding several short pieces finish after CTAs holding more tiles in one piece (docs/notes/sm90_decode_journal.md,
2026-12-06 "midday").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import numpy as np

DEFAULT_CASES = ("tail,64,81920,32,1", "uniform,256,4096,32,1", "uniform,64,81920,32,1", "full,64,81920,32,1")


def summarize(trace: np.ndarray, block_n: int = 64, latest: int = 8) -> dict:
    """``trace``: int64 ``(ctas, pieces, len(PIECE_FIELDS))`` of a piece-traced run -> the timeline's summary (module
    docstring).  Records with ``clk_end == 0`` (no piece, or one not reached) are left out; cycles are converted to
    µs at the SM clock measured from the pieces themselves (clock64 over globaltimer, the median over pieces of >= 20
    µs, else >= 5 µs)."""
    from tokenspeed_jax.kernels.sm90.decode_trace import PIECE_FIELDS

    f = {name: i for i, name in enumerate(PIECE_FIELDS)}
    tr = np.asarray(trace, np.int64)
    ok = tr[..., f["clk_end"]] > 0
    ns = (tr[..., f["ns_end"]] - tr[..., f["ns_start"]]).astype(np.float64)
    clk = (tr[..., f["clk_end"]] - tr[..., f["clk_start"]]).astype(np.float64)
    # (globaltimer may tick only every microsecond: the longest pieces give the clock; >= 20 µs where there are any)
    long_ = ok & (ns >= 20000) if (ok & (ns >= 20000)).any() else ok & (ns >= 5000)
    ghz = float(np.median(clk[long_] / ns[long_])) if long_.any() else float("nan")

    def us(cycles):
        return cycles / ghz / 1e3

    def step(r, a, b):  # the epilogue step from field a to field b, where the loop records both
        return us(r[f[b]] - r[f[a]]) if r[f[a]] > 0 and r[f[b]] > 0 else None

    pieces = []
    for cta in range(tr.shape[0]):
        prev_end = None
        recs = np.flatnonzero(ok[cta])
        for i, j in enumerate(recs):
            r = tr[cta, j]
            tiles = -(-(int(r[f["end"]]) - int(r[f["start"]])) // block_n)
            loop = us(r[f["clk_epilogue"]] - r[f["clk_q"]])
            stores_from = "clk_q_issued" if r[f["clk_q_issued"]] > 0 else "clk_epi_pass"  # (the Q prefetch's loop)
            pieces.append({
                "cta": cta, "b": int(r[f["b"]]), "tiles": tiles, "kind": "split" if r[f["slot"]] >= 0 else "direct",
                "next": bool(i + 1 < len(recs)),  # the CTA runs another piece after this one
                "start_us": us(r[f["clk_q"]] - r[f["clk_start"]]),
                "loop_us": loop, "loop_us_per_tile": loop / max(tiles, 1),
                "epilogue_us": us(r[f["clk_end"]] - r[f["clk_epilogue"]]),
                "epi_barrier_us": step(r, "clk_epilogue", "clk_epi_pass"),
                "epi_q_issue_us": step(r, "clk_epi_pass", "clk_q_issued"),
                "epi_store_us": step(r, stores_from, "clk_stored"),
                "epi_end_wait_us": step(r, "clk_stored", "clk_end"),
                "total_us": us(r[f["clk_end"]] - r[f["clk_start"]]),
                "gap_us": None if prev_end is None else us(r[f["clk_start"]] - prev_end),
                "ns_start": int(r[f["ns_start"]]), "ns_end": int(r[f["ns_end"]])})
            prev_end = r[f["clk_end"]]

    def medians(ps, keys):
        return {k: float(np.median([p[k] for p in ps if p[k] is not None] or [np.nan])) for k in keys}

    out: dict = {"clock_ghz": ghz, "pieces": len(pieces), "by_kind": {}, "by_kind_and_next": {}}
    for kind in ("direct", "split"):
        ps = [p for p in pieces if p["kind"] == kind]
        if ps:
            out["by_kind"][kind] = {"n": len(ps), "tiles_median": float(np.median([p["tiles"] for p in ps])),
                                    **medians(ps, ("start_us", "loop_us", "epilogue_us", "total_us", "gap_us"))}
        for nxt in (True, False):  # a piece the CTA follows with another, or its last (the epilogue's steps)
            qs = [p for p in ps if p["next"] == nxt]
            if qs:
                out["by_kind_and_next"][f"{kind}_{'next' if nxt else 'last'}"] = {
                    "n": len(qs), **medians(qs, ("loop_us_per_tile", "epilogue_us", "epi_barrier_us", "epi_q_issue_us",
                                                 "epi_store_us", "epi_end_wait_us"))}
    if len(pieces) >= 3:  # total = a tiles + beta_direct [direct] + beta_split [split]
        A = np.array([[p["tiles"], p["kind"] == "direct", p["kind"] == "split"] for p in pieces], np.float64)
        y = np.array([p["total_us"] for p in pieces])
        keep = A.any(axis=0)
        coef = np.zeros(3)
        coef[keep] = np.linalg.lstsq(A[:, keep], y, rcond=None)[0]
        out["fit"] = {"us_per_tile": float(coef[0]), "beta_direct_us": float(coef[1]) if keep[1] else None,
                      "beta_split_us": float(coef[2]) if keep[2] else None,
                      "rms_us": float(np.sqrt(np.mean((A[:, keep] @ coef[keep] - y) ** 2)))}
    if pieces:
        t0 = min(p["ns_start"] for p in pieces)
        ctas = {}
        for p in pieces:
            c = ctas.setdefault(p["cta"], {"cta": p["cta"], "first_start_us": np.inf, "finish_us": 0.0, "pieces": 0,
                                           "tiles": 0, "split_pieces": 0})
            c["first_start_us"] = min(c["first_start_us"], (p["ns_start"] - t0) / 1e3)
            c["finish_us"] = max(c["finish_us"], (p["ns_end"] - t0) / 1e3)
            c["pieces"] += 1
            c["tiles"] += p["tiles"]
            c["split_pieces"] += p["kind"] == "split"
        fin = np.array([c["finish_us"] for c in ctas.values()])
        out["span_us"] = float(fin.max())
        out["finish_us"] = {"min": float(fin.min()), "median": float(np.median(fin)), "max": float(fin.max())}
        out["latest_ctas"] = sorted(ctas.values(), key=lambda c: -c["finish_us"])[:latest]
        by_n: dict = {}
        for c in ctas.values():
            by_n.setdefault(c["pieces"], []).append(c)
        out["by_pieces_per_cta"] = {n: {"ctas": len(cs), "tiles_mean": float(np.mean([c["tiles"] for c in cs])),
                                        "finish_us_mean": float(np.mean([c["finish_us"] for c in cs])),
                                        "finish_us_max": float(max(c["finish_us"] for c in cs))}
                                    for n, cs in sorted(by_n.items())}
    return out


def traced_decode(prob, cfg, pieces: int):
    """jitted ``(q, kv, bt, sl, scale, work) -> (out, lse, trace)``: the piece-traced build of ``cfg`` for ``prob``
    on the schedule ``work = (cta, req)``."""
    import jax
    import jax.numpy as jnp
    from cutlass.jax import TensorSpec

    from tokenspeed_jax import ffi
    from tokenspeed_jax.backends import sm90_decode
    from tokenspeed_jax.kernels.sm90.decode import launch_decode_piece_traced
    from tokenspeed_jax.kernels.sm90.decode_trace import PIECE_FIELDS

    plan = sm90_decode.plan_for_config(prob, cfg)
    key = sm90_decode.kernel_key(prob, cfg, plan)
    ctas = key.num_ctas * plan.num_m_blocks
    B, S, H = prob.batch, prob.q_len, prob.num_heads
    outputs = [jax.ShapeDtypeStruct((B, S, H, 512), jnp.dtype(prob.out_dtype)),
               jax.ShapeDtypeStruct((B, S, H), jnp.float32),
               jax.ShapeDtypeStruct((ctas, pieces, len(PIECE_FIELDS)), jnp.int64)]
    outputs += [jax.ShapeDtypeStruct(w.shape, jnp.dtype(w.dtype)) for w in plan.workspace]
    statics = {f.name: getattr(key, f.name) for f in dataclasses.fields(key) if f.name not in ("config", "chunk")}
    # (extents read at run time, as the normal build's: one compile serves every batch size of the key)
    ins, outs = sm90_decode.operand_specs(prob, sm90_decode.schedule_spec(prob, plan))
    trace_spec = TensorSpec(divisibility=(ctas, pieces, len(PIECE_FIELDS)))
    call = ffi.custom_call(sm90_decode.TARGET, launch_decode_piece_traced, outputs=outputs,
                           compile_key=("piece_traced", key, pieces), input_specs=ins,
                           output_specs=(outs[0], outs[1], trace_spec, *outs[2:]), dynamic_shapes=True,
                           loop=cfg.loop, producer=cfg.producer, prefetch=cfg.prefetch, piece_trace=pieces, **statics)

    def g(q, kv, bt, sl, scale, work):
        res = call(q, kv, bt, sl, ffi.scalar_operand(scale), ffi.scalar_operand(jnp.float32(1.0)), *work)
        return res[0], res[1], res[2]

    return jax.jit(g)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), metavar="DIST,B,CAP,H,S")
    ap.add_argument("--fixed-costs", default="2,16", help="schedule fixed costs, comma separated (64-token tiles)")
    ap.add_argument("--pieces", type=int, default=16, help="pieces recorded per CTA")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float8_e4m3fn"))
    ap.add_argument("--config", default=None, help="benchmarks.decode.named_config name (default: select_config's)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "piece_timeline.json"))
    a = ap.parse_args(argv)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import jax
    import jax.numpy as jnp

    from benchmarks.decode import named_config
    from benchmarks.decode_varlen import case_of, inputs, lengths
    from benchmarks.runinfo import provenance
    from tokenspeed_jax.backends import sm90_decode
    from tokenspeed_jax.decode import _decode_problem
    from tokenspeed_jax.decode_schedule import decode_schedule, reference_pieces

    report = {"name": f"per-piece timeline of the sm90 decode kernel, {a.dtype}", **provenance(), "cases": []}
    for spec_s in a.cases:
        dist, B, cap, H, S = (int(x) if i else x for i, x in enumerate(spec_s.split(",")))
        c = case_of(dist, B, cap, H, S)
        lens = lengths(dist, B, cap, 0)
        q, kv, bt, sl, scale = inputs(c, lens, 0)
        q, kv = q.astype(a.dtype), kv.astype(a.dtype)
        prob = _decode_problem(q, kv, bt, sl, True, 512, True)
        cfg = named_config(a.config) if a.config else sm90_decode.select_config(prob)
        plan = sm90_decode.plan_for_config(prob, cfg)
        normal = jax.jit(lambda q_, kv_, bt_, sl_, s_, w_, cfg=cfg, prob=prob: sm90_decode.decode(
            prob, q_, kv_, bt_, sl_, s_, jnp.float32(1.0), config=cfg, work=w_))
        traced = traced_decode(prob, cfg, a.pieces)
        base = sm90_decode.schedule_spec(prob, plan)
        for fc in (int(x) for x in a.fixed_costs.split(",")):
            spec = dataclasses.replace(base, fixed_cost=fc)
            work = jax.jit(lambda s_, spec=spec: decode_schedule(s_, spec))(sl)
            per_cta = np.bincount([p[0] for p in reference_pieces(*map(np.asarray, work), lens, spec.capacity)],
                                  minlength=spec.num_ctas)
            ref = jax.block_until_ready(normal(q, kv, bt, sl, scale, work))
            for _ in range(3):  # the last launch's records (the first compiles, the second warms the caches)
                out, lse, tr = jax.block_until_ready(traced(q, kv, bt, sl, scale, work))
            same = bool(np.array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(ref[0].astype(jnp.float32)),
                                       equal_nan=True) and np.array_equal(np.asarray(lse), np.asarray(ref[1]),
                                                                          equal_nan=True))
            s = summarize(np.asarray(tr))
            s["pieces_not_recorded"] = int(np.maximum(per_cta - a.pieces, 0).sum()) * plan.num_m_blocks
            report["cases"].append({"case": c.name, "fixed_cost": fc, "config": dataclasses.asdict(cfg),
                                    "bitwise_equal_to_normal_build": same, "summary": s,
                                    "trace": np.asarray(tr).tolist()})
            print(f"{c.name} fc {fc} ({cfg.loop}, prefetch {cfg.prefetch}): traced output bitwise equal: {same}; "
                  f"{s.get('pieces')} pieces, span {s.get('span_us', 0):.1f} µs, clock {s['clock_ghz']:.2f} GHz")
            print("  fit:", json.dumps({k: (round(v, 2) if isinstance(v, float) else v)
                                        for k, v in s.get("fit", {}).items()}))
            for kind, d in {**s["by_kind"], **s["by_kind_and_next"]}.items():
                print(f"  {kind}:", json.dumps({k: round(v, 2) for k, v in d.items()}))
            for n, d in s.get("by_pieces_per_cta", {}).items():
                print(f"  {n} pieces/CTA:", json.dumps({k: round(v, 1) for k, v in d.items()}))
            with open(a.out, "w") as fh:
                json.dump(report, fh)
            if not same:
                raise SystemExit("the traced build's output differs from the normal build's: the timeline is void")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
