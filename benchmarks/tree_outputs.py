"""Bitwise comparison of two source trees' ``mla_decode(backend="sm90")`` on the decode check matrix.

    PYTHONPATH=<tree A>:$PYTHONPATH python benchmarks/tree_outputs.py save DIR      # A's outputs -> DIR/*.npz
    python benchmarks/tree_outputs.py compare DIR --out cmp.json                    # this tree's against them

(Run as a file, not with ``-m``: ``-m`` puts the working directory, and so its ``tokenspeed_jax``, ahead of
``PYTHONPATH``; each run prints the ``tokenspeed_jax`` it imported.  The project root must be on ``PYTHONPATH``
for ``benchmarks``, as the GPU kit's bootstrap puts it.)

Both runs take their inputs from ``benchmarks.decode.make_inputs`` with the same seed, so they see the same data
(NaN in unowned pages, garbage tables where the case says so) and call only the public ``mla_decode``: the tree
under test may be the tag ``sm90-decode-experiments`` (the static split plan) or any later commit.  ``compare``
writes one row per case: whether output and LSE are bitwise equal, the largest output difference, and that
difference over the 16-bit check's tolerance (``2 x`` the output dtype's rounding error ``+ 1e-3``; FP8 inputs add
the check's P-rounding term, not computed here, so their ratio may pass 1 where both trees pass the check).
Outputs of two kernels that cut a request's keys at different points differ by the split-KV merge's rounding, so
bitwise equality is expected only where both trees cut every request the same way.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def _outputs(c, seed: int, backend: str):
    import jax.numpy as jnp

    from benchmarks.decode import decode_fn, make_inputs

    q, kv, bt, sl = make_inputs(c, seed)
    out, lse = decode_fn(c, backend)(q, kv, bt, sl, jnp.float32(576 ** -0.5))
    return np.asarray(out.astype(jnp.float32)), np.asarray(lse)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cmd", choices=("save", "compare"))
    ap.add_argument("dir")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--cases", default="", help="comma-separated CHECK case names (default: all)")
    ap.add_argument("--out", default=None, help="compare: the JSON to write")
    ap.add_argument("--backend", default="sm90", help="mla_decode's backend (xla: a CPU check of this script)")
    a = ap.parse_args(argv)
    import tokenspeed_jax

    print("tokenspeed_jax from", tokenspeed_jax.__file__, flush=True)
    from benchmarks.decode import CHECK

    cases = [c for c in CHECK if not a.cases or c.name in a.cases.split(",")]
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    for c in cases:
        t0 = time.time()
        try:
            out, lse = _outputs(c, a.seed, a.backend)
        except Exception as e:  # noqa: BLE001  (a case one tree rejects is reported, not fatal)
            rows.append({"case": c.name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(json.dumps(rows[-1]), flush=True)
            continue
        if a.cmd == "save":
            np.savez(d / f"{c.name}.npz", out=out, lse=lse)
            print("saved", c.name, f"{time.time() - t0:.1f}s", flush=True)
            continue
        if not (d / f"{c.name}.npz").exists():
            rows.append({"case": c.name, "error": "no saved output of the other tree"})
            continue
        ref = np.load(d / f"{c.name}.npz")
        o2, l2 = ref["out"], ref["lse"]
        # the check's output tolerance: 2 x the rounding to the output dtype (at most 2^-8 relative for bf16/fp16
        # outputs of |o| <= max |o|) + 1e-3; here taken on the larger of the two outputs' magnitudes
        tol = 2 * 2.0 ** -8 * np.maximum(np.abs(out), np.abs(o2)) + 1e-3
        diff = np.abs(out - o2)
        fin = np.isfinite(diff)
        both_inf = np.isneginf(lse) & np.isneginf(l2)  # (empty rows: equal, and no inf - inf below)
        lse, l2 = np.where(both_inf, 0.0, lse), np.where(both_inf, 0.0, l2)
        row = {"case": c.name, "dtype": c.dtype,
               "bitwise_out": bool(np.array_equal(out, o2, equal_nan=True)),
               "bitwise_lse": bool(np.array_equal(lse, l2, equal_nan=True)),
               "max_diff": float(diff[fin].max(initial=0.0)),
               "max_diff_over_tol": float((diff[fin] / tol[fin]).max(initial=0.0)),
               "nonfinite_mismatch": int(np.sum(~fin & ~(np.isnan(out) & np.isnan(o2)))),
               "lse_max_diff": float(np.nanmax(np.abs(lse - l2))),
               "secs": round(time.time() - t0, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.cmd == "compare":
        from benchmarks.runinfo import provenance

        ok = [r for r in rows if "error" not in r]
        doc = {**provenance(), "seed": a.seed, "tree": tokenspeed_jax.__file__, "reference_dir": str(d),
               "rows": rows, "cases": len(rows),
               "bitwise_cases": sum(r["bitwise_out"] and r["bitwise_lse"] for r in ok),
               "within_tolerance": sum(r["max_diff_over_tol"] <= 1.0 and not r["nonfinite_mismatch"] for r in ok)}
        print(f"bitwise {doc['bitwise_cases']}/{len(rows)}, within tolerance {doc['within_tolerance']}/{len(rows)}")
        if a.out:
            Path(a.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
