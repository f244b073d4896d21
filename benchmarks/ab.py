"""A/B of package trees on one machine: a benchmark module run once per tree per round, the trees alternating.

    python -m benchmarks.ab --tree new=. --tree base=.ab_base --rounds 3 --out $OUT/ab.json -- \\
        benchmarks.timeline --cases tail,64,81920,32,1 uniform,64,81920,128,1 --calls 40

A tree is a directory holding ``tokenspeed_jax`` (and ``ffi``, ``models`` beside it: ``git archive REV
tokenspeed_jax ffi models | tar -x -C .ab_base``); ``benchmarks`` always comes from this checkout.  Round ``r``
runs every tree once, in an order rotated by one tree per round (A B, B A, ...), so no tree always runs first or
after the same neighbour.  Each run is ``python -m MODULE ARGS --out FILE`` started **from the tree's directory**
(``python -m`` puts the working directory first on ``sys.path``, ahead of ``PYTHONPATH``: started from the checkout's
root, every process imports the checkout's package whatever tree ``PYTHONPATH`` names, which is how the three-tree
A/B of 2026-12-06 timed main three times), with ``PYTHONPATH=TREE:CHECKOUT:...``, its own kernel cache
(``TOKENSPEED_JAX_CACHE_DIR=CACHE/NAME``: the cache keys do not hash every kernel source) and
``TOKENSPEED_JAX_COMMIT=NAME``.  Each run's JSON must name the tree's package (``package_dir``, written by
``benchmarks.runinfo.provenance``); a run that imported another one stops the A/B with an error.

``--out`` gets ``{"trees": {name: {"dir", "package_sha1", "runs": [each run's JSON]}}, "summary": ...}``: per
``(case, contender)`` each tree's values over its runs and their median: ``us`` of a ``benchmarks.harness.Report``
row, or a ``benchmarks.timeline`` entry's ``us_per_call``, ``gap_us`` and each kernel kind's median (keys
``us_per_call``, ``gap_us``, ``kind:NAME``), or a ``benchmarks.piece_timeline`` entry's span and per kind of piece
its epilogue and loop time a tile (:func:`measurements`; the stored runs drop the raw traces); and ``ratio`` (each
tree's median over the first tree's).  A piece timeline of each tree:
``python -m benchmarks.ab --tree main=. --tree cand=DIR --rounds 1 --out $OUT/pt_ab.json -- benchmarks.piece_timeline
--cases tail,64,81920,32,1``."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.runinfo import ROOT


def is_piece_timeline(doc: dict) -> bool:
    """A ``benchmarks.piece_timeline`` run: its ``cases`` a list, one entry per (case, fixed cost)."""
    return isinstance(doc.get("cases"), list)


def measurements(doc: dict) -> dict:
    """``{(case, contender, key): value}`` of one run's JSON (a Report's rows, a timeline's cases, or a piece
    timeline's: per case and fixed cost, contender ``pieces`` key ``span_us``, and per kind of piece and successor,
    contender e.g. ``split_next``, keys ``epilogue_us`` and ``loop_us_per_tile``)."""
    out = {}
    for row in doc.get("rows", []):
        if "us" in row and row["us"] is not None:
            out[(row["case"], row["contender"], "us")] = float(row["us"])
    if is_piece_timeline(doc):
        for entry in doc["cases"]:
            case, s = f"{entry['case']} fc{entry['fixed_cost']}", entry["summary"]
            if s.get("span_us") is not None:
                out[(case, "pieces", "span_us")] = float(s["span_us"])
            for kind, v in s.get("by_kind_and_next", {}).items():
                for key in ("epilogue_us", "loop_us_per_tile"):
                    if v.get(key) is not None and v[key] == v[key]:  # (NaN: no such piece)
                        out[(case, kind, key)] = float(v[key])
        return out
    for case, res in doc.get("cases", {}).items():
        for contender, r in res.items():
            for key in ("us_per_call", "gap_us"):
                if key in r:
                    out[(case, contender, key)] = float(r[key])
            for kind, v in r.get("kinds", {}).items():
                out[(case, contender, f"kind:{kind}")] = float(v["median_us"])
    return out


def summarize(trees: dict) -> list[dict]:
    """One row per measured ``(case, contender, key)``: each tree's values and median, and the medians' ratio to the
    first tree's."""
    names = list(trees)
    per = {n: [measurements(run) for run in trees[n]["runs"]] for n in names}
    keys = sorted({k for n in names for m in per[n] for k in m})
    rows = []
    for case, contender, key in keys:
        row = {"case": case, "contender": contender, "key": key}
        for n in names:
            vals = [m[(case, contender, key)] for m in per[n] if (case, contender, key) in m]
            med = round(statistics.median(vals), 2) if vals else None
            row[n] = {"values": [round(v, 2) for v in vals], "median": med}
        first = row[names[0]]["median"]
        row["ratio"] = {n: round(row[n]["median"] / first, 4) for n in names[1:]
                        if row[n]["median"] is not None and first}
        rows.append(row)
    return rows


def run_tree(name: str, tree: str, module: str, args: list[str], out: str, cache: str, timeout: float) -> dict:
    """One run of ``module`` with ``tree``'s package; its JSON, checked to name that package."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, ROOT, os.environ.get("PYTHONPATH", "")) if p)
    env["TOKENSPEED_JAX_CACHE_DIR"] = os.path.join(cache, name)
    env["TOKENSPEED_JAX_COMMIT"] = name
    proc = subprocess.run([sys.executable, "-m", module, *args, "--out", out], cwd=tree, env=env, timeout=timeout,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"tree {name}: {module} exited with {proc.returncode}")
    with open(out) as f:
        doc = json.load(f)
    want = os.path.join(tree, "tokenspeed_jax")
    if not doc.get("package_dir") or os.path.realpath(doc["package_dir"]) != os.path.realpath(want):
        raise RuntimeError(f"tree {name}: the run imported {doc.get('package_dir')!r}, not {want!r}")
    return doc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=DIR",
                    help="a tree (repeat; at least two): its name and the directory holding its tokenspeed_jax")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "tsj_ab_cache"),
                    help="kernel caches, one directory per tree below it")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- MODULE ARGS (without --out)")
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("the benchmark: -- MODULE ARGS")
    trees = {}
    for spec in a.tree:
        name, sep, d = spec.partition("=")
        d = os.path.abspath(d)
        if not sep or not name or not os.path.isfile(os.path.join(d, "tokenspeed_jax", "__init__.py")):
            ap.error(f"--tree {spec!r}: expected NAME=DIR with DIR/tokenspeed_jax/__init__.py")
        trees[name] = {"dir": d, "runs": []}
    if len(trees) < 2:
        ap.error("--tree: at least two trees")
    names = list(trees)
    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                doc = run_tree(name, trees[name]["dir"], cmd[0], cmd[1:], os.path.join(tmp, f"{name}_{r}.json"),
                               a.cache, a.timeout)
                trees[name]["package_sha1"] = doc.get("package_sha1")
                if is_piece_timeline(doc):  # (its summaries, not the raw traces)
                    doc["cases"] = [{k: v for k, v in c.items() if k != "trace"} for c in doc["cases"]]
                trees[name]["runs"].append(doc)
                summary = summarize(trees)
                result = {"name": f"A/B of package trees: {' '.join(cmd)}", "rounds": a.rounds,
                          "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.ab",
                                               *(argv if argv is not None else sys.argv[1:])]),
                          "trees": trees, "summary": summary}
                with open(a.out, "w") as f:  # (after every run: a cut call keeps what ran)
                    json.dump(result, f, indent=1)
                print(f"ab: round {r} tree {name} done", flush=True)
    for row in summary:
        if row["key"] in ("us", "us_per_call", "span_us", "epilogue_us"):
            print(row["case"], row["contender"], row["key"],
                  " ".join(f"{n}={row[n]['median']}" for n in names), row["ratio"], flush=True)


if __name__ == "__main__":
    main()
