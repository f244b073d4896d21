"""How well a per-piece cost model explains a measured schedule sweep (CPU): the kernel's time as its busiest CTA.

    python scripts/schedule_model.py --sweep benchmarks/results/decode_sm90_fixed_cost_h100.json \\
        --us-per-tile 3.12 --beta-direct 2 --beta-split 6
    python scripts/schedule_model.py --sweep ... --fit $OUT/piece_cost.json   # decode_diag part 6's fit

For every row of the sweep (``decode_diag --parts 5``: a case, a dtype, each schedule variant's median µs) the exact
schedule of each variant (the backend's spec for the case with the variant's mode and fixed cost, the sweep's seed-0
lengths, :func:`tokenspeed_jax.decode_schedule.reference_pieces`) is priced piece by piece: ``us_per_tile * tiles +
beta`` (``beta_direct`` or ``beta_split`` by the piece's kind); a CTA costs the sum of its pieces and the kernel its
busiest CTA plus a constant per case (least squares: the combine, the launch).  Printed: per case the measured and
predicted times of each variant, and over all the root-mean-square log error against that of predicting every
variant at the case's mean (no model).  A model that explains the sweep is one the schedule's cost model can
balance; docs/notes/sm90_decode_journal.md (2026-12-06 "midday") found that a constant per piece does not.

``--fit`` takes ``us_per_tile`` / ``beta_direct_us`` / ``beta_split_us`` from a part-6 result (the first fit of the
dtype, contender ``ours``, short ``32``; the split extra is the median of its ``split_extra_us`` added to
``beta_direct``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_case(name: str):
    """``'tail_B64_K81920_H32_S1'`` -> ``('tail', 64, 81920, 32, 1)``."""
    dist, b, k, h, s = name.split("_")
    return dist, int(b[1:]), int(k[1:]), int(h[1:]), int(s[1:])


def cta_pieces(case: str, dtype: str, variant: str):
    """Per CTA row of the schedule of ``variant`` (``'choose fc16'``, ``'balanced fc12'``) for the case: a list of
    ``(tiles, split)`` pieces per CTA."""
    import jax.numpy as jnp

    from benchmarks.decode import shapes
    from benchmarks.decode_varlen import case_of, lengths
    from tokenspeed_jax.backends import sm90_decode
    from tokenspeed_jax.decode import _decode_problem
    from tokenspeed_jax.decode_schedule import decode_schedule, reference_pieces
    from tokenspeed_jax.runtime import target_override

    dist, B, cap, H, S = parse_case(case)
    lens = lengths(dist, B, cap, 0)
    mode, fc = variant.split()
    with target_override("sm_90a", num_sms=132):
        prob = _decode_problem(*shapes(case_of(dist, B, cap, H, S, dtype=dtype)), True, 512, True)
        base = sm90_decode.work_key(prob)[1]
    spec = dataclasses.replace(base, mode=mode, fixed_cost=int(fc[2:]))
    cta, req = (np.asarray(x) for x in decode_schedule(jnp.asarray(lens, jnp.int32), spec))
    out: list[list[tuple[int, bool]]] = [[] for _ in range(spec.num_ctas)]
    for g, _, s, e, slot in reference_pieces(cta, req, lens, spec.capacity):
        out[g].append((-(-(e - s) // 64), slot >= 0))
    return out


def evaluate(rows: list[dict], us_per_tile: float, beta_direct: float, beta_split: float, pieces_of=cta_pieces,
             scale_per_case: bool = False):
    """``(per-case table, rms log error of the model, rms log error of no model)`` over the sweep's ``rows``
    (module docstring); ``pieces_of(case, dtype, variant)`` gives each CTA's ``(tiles, split)`` pieces.
    ``scale_per_case``: each case's prediction is ``a * busiest + c`` with its own ``a`` and ``c`` (least squares;
    for cases whose µs per tile differs from the model's, e.g. another H: only the ratio of the piece costs to the
    tile cost is then tested)."""
    table, err, base = [], [], []
    for r in rows:
        variants = [k for k in r if k.split()[0] in ("choose", "balanced") and len(k.split()) == 2]
        if len(variants) < 2:
            continue
        meas = np.array([r[v] for v in variants], np.float64)
        busiest = np.array([max((sum(us_per_tile * t + (beta_split if sp else beta_direct) for t, sp in ps)
                                 for ps in pieces_of(r["case"], r["dtype"], v)), default=0.0) for v in variants])
        if scale_per_case and np.ptp(busiest) > 0:
            A = np.stack([busiest, np.ones_like(busiest)], 1)
            (k, c), *_ = np.linalg.lstsq(A, meas, rcond=None)
            c = float(c)
            pred = k * busiest + c
        else:
            c = float(np.mean(meas - busiest))  # the constant per case (least squares)
            pred = busiest + c
        err += list(np.log(meas / pred))
        base += list(np.log(meas / meas.mean()))
        table.append({"case": r["case"], "dtype": r["dtype"], "constant_us": c,
                      "variants": {v: {"measured_us": float(m), "predicted_us": float(p)}
                                   for v, m, p in zip(variants, meas, pred, strict=True)}})
    rms = float(np.sqrt(np.mean(np.square(err)))) if err else float("nan")
    rms0 = float(np.sqrt(np.mean(np.square(base)))) if base else float("nan")
    return table, rms, rms0


def _from_fit(path: str, dtype: str) -> tuple[float, float, float]:
    with open(path) as f:
        fits = json.load(f)["piece_cost_fit"]
    f = next(x for x in fits if x["dtype"] == dtype and x["contender"] == "ours" and x["short"] == 32)
    split = float(np.median(list(f["split_extra_us"].values()))) if f["split_extra_us"] else 0.0
    return f["us_per_tile"], f["beta_us"], f["beta_us"] + split


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", required=True, help="a decode_diag --parts 5 result (its runs' 'policy' rows)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--us-per-tile", type=float, default=None)
    ap.add_argument("--beta-direct", type=float, default=0.0, help="µs a direct piece costs beyond its tiles")
    ap.add_argument("--beta-split", type=float, default=0.0, help="µs a split piece costs beyond its tiles")
    ap.add_argument("--fit", default=None, help="take the three from a decode_diag --parts 6 result")
    ap.add_argument("--heads", type=int, default=None, help="only the sweep's cases of this H (the fit's)")
    ap.add_argument("--scale-per-case", action="store_true", help="each case its own µs per model µs (another H)")
    a = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    with open(a.sweep) as f:
        doc = json.load(f)
    rows = [r for run in doc.get("runs", [doc]) for r in run.get("policy", []) if r["dtype"] == a.dtype
            and (a.heads is None or parse_case(r["case"])[3] == a.heads)]
    if a.fit:
        tile, bd, bs = _from_fit(a.fit, a.dtype)
    elif a.us_per_tile is None:
        ap.error("expected --us-per-tile (and --beta-direct / --beta-split) or --fit")
    else:
        tile, bd, bs = a.us_per_tile, a.beta_direct, a.beta_split
    table, rms, rms0 = evaluate(rows, tile, bd, bs, scale_per_case=a.scale_per_case)
    for t in table:
        print(t["case"], t["dtype"], f"constant {t['constant_us']:.1f} µs")
        for v, d in t["variants"].items():
            print(f"  {v:<14s} measured {d['measured_us']:8.1f}  predicted {d['predicted_us']:8.1f}")
    print(f"model: {tile:.3f} µs/tile, {bd:.2f} µs a direct piece, {bs:.2f} µs a split piece: rms log error "
          f"{rms:.4f} (no model: {rms0:.4f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
