"""CPU check of ``benchmarks/decode.py``'s timing path (``_bench_one``): every contender of a shape is timed
interleaved on the same inputs and lands in the report with its bytes and FLOPs (no GPU: the ``sm90``
contenders are pointed at the ``xla`` backend, FlashMLA is absent)."""

from __future__ import annotations

import os

import numpy as np

from benchmarks import decode as bd
from benchmarks.harness import Report


def test_bench_one_times_every_contender(monkeypatch):
    real = bd.decode_fn
    monkeypatch.setattr(bd, "decode_fn", lambda c, backend, config=None: real(c, "xla"))
    c = bd.bench_case(64, 128, 64, 32, 1)  # B=64, H=32: the shape that also times plain XLA
    report = Report("decode bench (cpu)")
    bd._bench_one(report, None, c, with_xla=True, configs=("seesaw",), rounds=3)
    rows = {r["contender"]: r for r in report.rows}
    assert list(rows) == ["ours bf16", "ours bf16 seesaw", "ours fp8", "plain XLA"]  # (the FP8 seesaw: 16-token pages)
    for r in rows.values():
        assert r["case"] == c.name and r["us"] > 0 and len(r["samples_us"]) == 3
        assert "interleaved" in r["note"]
    assert rows["ours fp8"]["bytes"] < rows["ours bf16"]["bytes"]  # FP8 rows carry the FP8 bytes
    assert np.isclose(rows["ours fp8"]["flops"], rows["ours bf16"]["flops"])


def test_bench_one_sustained_report(monkeypatch):
    """``--sustain``: every contender but plain XLA also lands in the second report, timed back to back
    (``harness.sustained``: two rounds, the second half of each window), with the polled clock fields (None without
    ``nvidia-smi``)."""
    real = bd.decode_fn
    monkeypatch.setattr(bd, "decode_fn", lambda c, backend, config=None: real(c, "xla"))
    c = bd.bench_case(64, 128, 64, 32, 1)
    report, rep_s = Report("decode bench (cpu)"), Report("decode bench (cpu), sustained")
    bd._bench_one(report, None, c, with_xla=True, rounds=2, sustain=0.2, report_sustained=rep_s)
    rows = {r["contender"]: r for r in rep_s.rows}
    assert list(rows) == ["ours bf16", "ours fp8"]  # (plain XLA is left out)
    for r in rows.values():
        assert r["us"] > 0 and len(r["samples_us"]) == 2 and "sustained" in r["note"]
        assert {"sm_mhz", "power_w", "throttle_reasons"} <= set(r)


def test_bench_one_calls_per_dispatch(monkeypatch):
    """``--calls N``: each of ours runs N calls per dispatch in one executable (N distinct q buffers, so XLA can
    neither merge nor drop one) and the rows are per call; the FlashMLA side falls back to plain calls where a CUDA
    graph cannot be captured, and says so."""
    real = bd.decode_fn
    monkeypatch.setattr(bd, "decode_fn", lambda c, backend, config=None: real(c, "xla"))
    c = bd.bench_case(2, 128, 64, 16, 1)
    f = real(c, "xla")
    q, kv, bt, sl, scale = bd.bench_inputs(c)
    g = bd._jax_calls(f, (q, kv, bt, sl, scale), 3)
    outs = g()
    assert len(outs) == 3 and all(np.array_equal(np.asarray(o[0]), np.asarray(f(q, kv, bt, sl, scale)[0]))
                                  for o in outs)
    report = Report("decode bench (cpu)")
    bd._bench_one(report, None, c, with_xla=False, rounds=2, calls=4)
    rows = {r["contender"]: r for r in report.rows}
    assert list(rows) == ["ours bf16", "ours fp8"]
    for r in rows.values():
        assert r["us"] > 0 and "4 calls per dispatch (one executable)" in r["note"]
    assert bd._per_call({"median_us": 40.0, "min_us": 8.0, "max_us": 80.0, "samples_us": [40.0, 8.0]}, 4) == {
        "median_us": 10.0, "min_us": 2.0, "max_us": 20.0, "samples_us": [10.0, 2.0]}
    torch = __import__("pytest").importorskip("torch")
    if not torch.cuda.is_available():  # (the CPU machines: capture fails, plain calls, said in the note)
        n_runs, notes = [], {}
        plain = bd._torch_calls(lambda: n_runs.append(1), 5, notes, "FlashMLA bf16")
        plain()
        assert len(n_runs) == 5 and "plain calls" in notes["FlashMLA bf16"]


def test_sustained_rotates_and_times_the_second_half(monkeypatch):
    import time

    from benchmarks import harness

    order = []

    def make(name, dt):
        def fn():
            if not order or order[-1] != name:
                order.append(name)
            time.sleep(dt)

        return fn

    monkeypatch.setattr(harness.GpuPoller, "QUERY", "no.such.field")  # (nvidia-smi, if any, answers nothing usable)
    res = harness.sustained({"a": make("a", 0.002), "b": make("b", 0.004)}, 0.15, rounds=2)
    assert order == ["a", "b", "a"]  # round 0: a b, round 1 rotated: b a (one run of b)
    assert 1500 < res["a"]["median_us"] < 3000 and 3500 < res["b"]["median_us"] < 5500
    assert len(res["a"]["samples_us"]) == 2 and res["a"]["sm_mhz"] is None


def test_fp8_p_rounding_tolerance(rng):
    """The check's FP8 P V tolerance (``FP8_P_ROUND`` x ``p_round_spread``) against the arithmetic it bounds, on
    the CPU: ``p_round_spread`` equals ``sqrt(sum p^2 v^2) / l`` computed directly in float64, and an output
    whose P is rounded as the kernel rounds it (``e4m3(2^8 p)``, the row sum over the unrounded P) stays inside
    the bound everywhere, while the bound is not vacuous (the largest error reaches a tenth of it)."""
    import jax.numpy as jnp
    import ml_dtypes

    from tokenspeed_jax.backends.xla import decode_probs
    from tokenspeed_jax.decode import _decode_problem

    c = bd.Case("t", "float8_e4m3fn", 3, 2, 16, 16, 40, (1, 37, 600))
    q, kv, bt, sl = bd.make_inputs(c, int(rng.integers(0, 2**31 - 1)))
    scale = jnp.float32(576 ** -0.5)
    spread = bd.p_round_spread(c, q, kv, bt, sl, scale)
    f32 = jnp.float32
    prob = _decode_problem(q.astype(f32), kv.astype(f32), bt, sl, c.causal, 512, True)
    p, l, _, v = (np.asarray(x, np.float64) for x in decode_probs(prob, q.astype(f32), kv.astype(f32), bt, sl,
                                                                  scale))
    has = l > 0
    want = np.sqrt(np.einsum("bshk,bkl->bshl", p * p, v * v)) / np.where(has, l, 1.0)[..., None]
    np.testing.assert_allclose(spread[has], want[has], rtol=1e-4)
    exact = np.einsum("bshk,bkl->bshl", p, v) / np.where(has, l, 1.0)[..., None]
    p8 = (256 * p).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    rounded = np.einsum("bshk,bkl->bshl", p8, v) / np.where(has, 256 * l, 1.0)[..., None]
    err = np.abs(rounded - exact)[has]
    bound = bd.FP8_P_ROUND * spread[has]
    ratio = np.divide(err, bound, out=np.zeros_like(err), where=bound > 0)  # (bound 0: a column of zero v)
    assert np.all(err <= bound + 1e-7), float(np.max(ratio))
    assert float(np.max(ratio)) > 0.1


def test_fixed_cost_fit_recovers_intercept_and_slope(tmp_path):
    """scripts/fixed_cost.py: a straight line through a K sweep gives back its intercept (the cost per call that does
    not grow with K) and slope per contender; single-K groups and rows without a time are left out."""
    import importlib.util
    import json
    import pathlib

    spec = importlib.util.spec_from_file_location(
        "fixed_cost", pathlib.Path(__file__).resolve().parents[1] / "scripts" / "fixed_cost.py")
    fc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fc)
    rows = [{"case": f"B128_K{k}_H16_S1", "contender": who, "us": a + b * k / 1024}
            for who, a, b in (("ours bf16", 15.0, 2.5), ("FlashMLA bf16", 9.0, 2.4)) for k in (1024, 2048, 4096)]
    rows += [{"case": "B64_K81920_H16_S1", "contender": "ours bf16", "us": 1500.0},
             {"case": "B128_K8192_H16_S1", "contender": "FlashMLA fp8", "us": None}]
    fits = {f["contender"]: f for f in fc.fixed_costs(rows)}
    assert set(fits) == {"ours bf16", "FlashMLA bf16"}
    assert abs(fits["ours bf16"]["intercept_us"] - 15.0) < 1e-6 and abs(fits["ours bf16"]["us_per_1k_tokens"] - 2.5) < 1e-6
    assert abs(fits["FlashMLA bf16"]["intercept_us"] - 9.0) < 1e-6 and fits["FlashMLA bf16"]["max_rel_residual"] < 1e-9
    src = tmp_path / "sweep.json"
    src.write_text(json.dumps({"command": "x", "date": "d", "rows": rows}))
    assert fc.main([str(src), "--out", str(tmp_path / "fits.json")]) == 0
    assert len(json.loads((tmp_path / "fits.json").read_text())["fits"]) == 2


def test_shapes_option_rejects_bad_shapes(capsys):
    import pytest

    with pytest.raises(SystemExit):
        bd.main(["--bench", "--shapes", "1,100,64,16,1"])
    assert "--shapes" in capsys.readouterr().err


def test_tree_outputs_bitwise_compare(tmp_path, capsys):
    """``benchmarks/tree_outputs.py`` (the bitwise check of two trees) on the xla backend: a tree against itself
    is bitwise equal; one ulp changed in a saved output is caught and measured against the tolerance."""
    import json

    import numpy as np

    from benchmarks import tree_outputs

    cases = "s1h16p64,s2h32p64_garbage"
    assert tree_outputs.main(["save", str(tmp_path), "--backend", "xla", "--cases", cases]) == 0
    out = tmp_path / "cmp.json"
    tree_outputs.main(["compare", str(tmp_path), "--backend", "xla", "--cases", cases, "--out", str(out)])
    doc = json.loads(out.read_text())
    assert (doc["bitwise_cases"], doc["within_tolerance"], doc["cases"]) == (2, 2, 2)
    f = tmp_path / "s1h16p64.npz"
    saved = dict(np.load(f))
    i = np.unravel_index(np.argmax(np.abs(saved["out"])), saved["out"].shape)
    saved["out"][i] = np.nextafter(saved["out"][i], np.float32(np.inf))
    np.savez(f, **saved)
    tree_outputs.main(["compare", str(tmp_path), "--backend", "xla", "--cases", cases, "--out", str(out)])
    doc = json.loads(out.read_text())
    row = doc["rows"][0]
    assert (doc["bitwise_cases"], row["bitwise_out"], row["bitwise_lse"]) == (1, False, True)
    assert 0 < row["max_diff"] and row["max_diff_over_tol"] < 1e-3 and doc["within_tolerance"] == 2


def test_report_json_carries_provenance(tmp_path):
    """A report's JSON names the command, date, device and the commit and source-tree hash it measured."""
    import json

    from benchmarks.runinfo import tree_sha1

    report = Report("provenance (cpu)")
    report.add("case", "ours", 10.0, nbytes=1e6, flops=1e9)
    written = report.write(str(tmp_path / "r.json"), summary={"x": 1})
    doc = json.loads((tmp_path / "r.json").read_text())
    assert {"command", "date", "device", "commit", "tree_sha1"} <= set(doc)
    assert doc == json.loads(json.dumps(written)) and doc["summary"] == {"x": 1}
    assert doc["tree_sha1"] == tree_sha1() and np.isclose(doc["rows"][0]["gbps"], 100.0)


def test_decode_varlen_summary_and_plot(tmp_path):
    """``benchmarks.decode_varlen``: the speed-up geomeans per dtype and distribution (per call and on a shared
    schedule) and the invariant mode's cost from a report's rows, and the two-panel PNG (``--replot``) from its JSON."""
    import json

    from benchmarks import decode_varlen as dv

    rows = []
    for case, ours, kern, inv, fm in (("full_B2_K128_H16_S1", 110.0, 100.0, 105.0, 100.0),
                                      ("uniform_B2_K128_H16_S1", 50.0, 40.0, 48.0, 44.0)):
        for name, us in (("ours bf16", ours), ("ours bf16 kernel", kern), ("ours bf16 invariant", inv),
                         ("FlashMLA bf16", fm), ("schedule bf16", 5.0)):
            rows.append({"case": case, "contender": name, "us": us, "roofline_fraction": 0.5})
    s = dv.summary(rows)
    assert np.isclose(s["bf16_all"]["geomean_speedup"], np.sqrt(100 / 110 * 44 / 50))
    assert np.isclose(s["bf16_uniform_shared"]["geomean_speedup"], 44 / 40) and s["bf16_full_shared"]["n"] == 1
    assert np.isclose(s["bf16_all_invariant_cost"]["max"], 1.2)
    doc = {"name": "varlen (cpu)", "device": "cpu", "date": "today", "command": "test", "rows": rows, "summary": s}
    (tmp_path / "v.json").write_text(json.dumps(doc))
    dv.main(["--replot", str(tmp_path / "v.json"), "--png", str(tmp_path / "v.png")])
    assert (tmp_path / "v.png").stat().st_size > 10_000


def test_kernel_times_parse(tmp_path):
    """benchmarks/kernel_times.py --parse: ncu's CSV split into cases at each KV fill, medians per kernel kind."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "kernel_times", Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_times.py")
    kt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kt)
    head = '"ID","Kernel Name","Grid Size","Metric Name","Metric Unit","Metric Value"\n'
    row = lambda name, grid, ns: f'"0","{name}","{grid}","gpu__time_duration.sum","ns","{ns:,}"\n'
    body = ["==PROF== noise\n", row("loop_clamp_fusion_1", "(1, 1, 1)", 2000)]  # (before the first case: ignored)
    for case in range(2):
        body.append(row("loop_multiply_fusion", "(5898816, 1, 1)", 16_000_000))
        for call in range(3):
            body += [row("loop_clamp_fusion_1", "(1, 1, 1)", 2700),
                     row("kernel_MlaDecodeScheduleKernel_x", "(1, 1, 1)", 8600),
                     row("loop_clamp_fusion", "(640, 1, 1)", 3000),
                     row("kernel_seesaw_kernel_MlaDecodeSeesaw_x", "(1, 132, 1)", 2_000_000 + 1000 * call + case),
                     row("kernel_cutlass_combine_kernel_x", "(16, 132, 1)", 14_400)]
    p = tmp_path / "ncu.csv"
    p.write_text(head + "".join(body))
    out = kt.parse(str(p))
    assert list(out) == ["bf16 full B64 K81920 H32 S1", "bf16 full B64 K81920 H128 S1"]
    assert out["bf16 full B64 K81920 H32 S1"] == {"xla_clamp_seq_lens": 2.7, "schedule": 8.6,
                                                  "xla_clamp_block_table": 3.0, "main": 2001.0, "combine": 14.4,
                                                  "total": 2029.7}


def test_source_commit_prefers_the_named_commit(monkeypatch):
    """benchmarks.runinfo.source_commit: ``--commit`` first, then ``$TOKENSPEED_JAX_COMMIT``, then git (a GPU copy's
    ``.git`` may name another commit than the tree that was sent)."""
    from benchmarks import runinfo

    monkeypatch.setenv("TOKENSPEED_JAX_COMMIT", "abc1234")
    assert runinfo.source_commit("def5678") == "def5678"
    assert runinfo.source_commit() == "abc1234"
    monkeypatch.delenv("TOKENSPEED_JAX_COMMIT")
    got = runinfo.source_commit()
    assert got is None or got.split("+")[0].isalnum()


def test_timeline_summary_counts_gaps_and_overlap_once():
    """benchmarks.timeline.summarize: the span per call, each kind's median, and the idle time between kernels, with
    an overlapping (PDL-launched) kernel counted once."""
    from benchmarks import timeline as tl

    ks = []
    for call in range(2):  # schedule 8 us, gap 2, main 100, combine overlapping main's last 3 us, then a gap of 5
        t = call * 125.0
        ks += [(t, 8.0, "kernel_MlaDecodeScheduleKernel_x"), (t + 10, 100.0, "kernel_MlaDecodeSeesaw_x"),
               (t + 107, 13.0, "kernel_cutlass_combine_kernel_x")]
    s = tl.summarize(sorted(ks), 2)
    assert s["kernels"] == 6 and s["us_per_call"] == (125 + 120) / 2
    assert s["gap_us"] == (2 + 5 + 2) / 2
    assert s["kinds"] == {"schedule": {"median_us": 8.0, "per_call": 1.0},
                          "main": {"median_us": 100.0, "per_call": 1.0},
                          "combine": {"median_us": 13.0, "per_call": 1.0}}
    assert tl.kind("flash_fwd_splitkv_mla_kernel<...>").startswith("flash") and tl.kind("loop_fusion") == "other"
    assert tl.summarize([], 3) == {"kernels": 0}


def _package_tree(tree):
    """A copy of this checkout's ``tokenspeed_jax``, ``ffi`` and ``models`` at ``tree`` (a path), one file changed so
    that its ``package_sha1`` differs: another package tree, as an A/B carries it."""
    import shutil

    from benchmarks.runinfo import PACKAGE_DIRS, ROOT

    for top in PACKAGE_DIRS:
        shutil.copytree(os.path.join(ROOT, top), tree / top, ignore=shutil.ignore_patterns("__pycache__"))
    with open(tree / "tokenspeed_jax" / "_version.py", "a") as f:
        f.write("# another tree\n")
    return tree


def test_provenance_names_the_imported_package_tree(tmp_path):
    """An A/B of package trees: the JSON's ``package_dir`` / ``package_sha1`` name the tree a process imported.  Run
    from the tree's own directory, the tree is imported; ``python -c`` (or ``-m``) from the checkout's root imports
    the checkout's package whatever ``PYTHONPATH`` says first (the trap ``benchmarks.runinfo.package_source``
    documents)."""
    import json
    import subprocess
    import sys

    from benchmarks.runinfo import PACKAGE_DIRS, ROOT, package_source, tree_sha1

    tree = _package_tree(tmp_path / "tree")
    probe = "import json; from benchmarks.runinfo import package_source; print(json.dumps(package_source()))"

    def run(cwd):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), ROOT]), JAX_PLATFORMS="cpu")
        out = subprocess.run([sys.executable, "-c", probe], cwd=cwd, env=env, capture_output=True, text=True,
                             timeout=300, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    here = package_source()
    assert here["package_sha1"] == tree_sha1(ROOT, PACKAGE_DIRS)
    theirs = run(str(tree))
    assert theirs["package_dir"] == str(tree / "tokenspeed_jax")
    assert theirs["package_sha1"] == tree_sha1(str(tree), PACKAGE_DIRS) != here["package_sha1"]
    assert run(ROOT) == here  # (from the root: the root's package, although the tree is first on PYTHONPATH)


def test_ab_alternates_trees_and_checks_the_imported_package(tmp_path, monkeypatch):
    """``benchmarks.ab`` runs a benchmark module once per tree per round from the tree's directory, trees alternating,
    summarizes each (case, contender) per tree, and stops when a run did not import its tree's package."""
    import json

    import pytest

    from benchmarks import ab
    from benchmarks.runinfo import ROOT

    tree = _package_tree(tmp_path / "tree")
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "ab_probe.py").write_text(  # a "benchmark": 20 us in the copied tree, 10 in the checkout
        "import argparse, json, os, time\n"
        "from benchmarks.runinfo import package_source\n"
        "ap = argparse.ArgumentParser(); ap.add_argument('--out'); ap.add_argument('--case')\n"
        "a = ap.parse_args(); src = package_source()\n"
        "if os.environ.get('PROBE_LIE'): src['package_dir'] = '/elsewhere'\n"
        "us = 20.0 if src['package_dir'].startswith(%r) else 10.0\n"
        "json.dump({**src, 't': time.time(), 'rows': [{'case': a.case, 'contender': 'ours', 'us': us}]},"
        " open(a.out, 'w'))\n" % str(tree))
    monkeypatch.setenv("PYTHONPATH", str(probe))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    out = tmp_path / "ab.json"
    ab.main(["--tree", f"main={ROOT}", "--tree", f"copy={tree}", "--rounds", "2", "--out", str(out),
             "--cache", str(tmp_path / "cache"), "--", "ab_probe", "--case", "c1"])
    doc = json.loads(out.read_text())
    runs = sorted((r["t"], n) for n, t in doc["trees"].items() for r in t["runs"])
    assert [n for _, n in runs] == ["main", "copy", "copy", "main"]  # (round 1 rotated)
    assert doc["trees"]["copy"]["runs"][0]["package_dir"] == str(tree / "tokenspeed_jax")
    assert doc["trees"]["main"]["package_sha1"] == doc["trees"]["main"]["runs"][0]["package_sha1"]
    (row,) = doc["summary"]
    assert (row["case"], row["key"], row["main"]["values"], row["copy"]["median"]) == ("c1", "us", [10.0, 10.0], 20.0)
    assert row["ratio"] == {"copy": 2.0}
    monkeypatch.setenv("PROBE_LIE", "1")
    with pytest.raises(RuntimeError, match="imported '/elsewhere'"):
        ab.main(["--tree", f"main={ROOT}", "--tree", f"copy={tree}", "--rounds", "1", "--out", str(out), "--",
                 "ab_probe", "--case", "c1"])


def test_piece_cases_give_their_layout_on_the_real_schedule():
    """decode_diag part 6: every batch of ``piece_cases`` has, under the jnp schedule the part times with (balanced,
    fixed cost 0, the backend's grid), exactly ``k`` pieces in every CTA, all direct or all split as its kind says;
    a schedule of another layout is refused."""
    import jax.numpy as jnp
    import pytest

    from benchmarks.decode_diag import piece_cases, piece_layout
    from tokenspeed_jax.decode_schedule import ScheduleSpec, decode_schedule

    for G in (132, 66):
        cases = piece_cases(G, tiles=(4, 64), per_cta=(1, 3))
        assert {c[0] for c in cases} == {"direct", "split"} and {c[2] for c in cases} == {0, 32}
        for kind, n, short, k, B, L in cases:
            cap = -(-L // 64) * 64
            spec = ScheduleSpec(num_ctas=G, capacity=cap, split_units=max(1, cap // 64), fixed_cost=0,
                                mode="balanced", unit=64)
            lens = np.full(B, L)
            got = piece_layout(decode_schedule(jnp.asarray(lens, jnp.int32), spec), lens, cap, kind, k)
            assert got["pieces_per_cta"] == [k, k]
            assert got["split_pieces"] == (G if kind == "split" else 0)
    assert all(c[0] == "direct" for c in piece_cases(5))  # an odd grid cannot halve every request
    kind, _, _, k, B, L = piece_cases(132, tiles=(16,), per_cta=(2,))[0]
    spec = ScheduleSpec(num_ctas=132, capacity=L, split_units=1, fixed_cost=16, mode="balanced", unit=64)
    lens = np.full(B + 7, L)  # not the batch's shape: the check must refuse it
    with pytest.raises(ValueError, match="part 6"):
        piece_layout(decode_schedule(jnp.asarray(lens, jnp.int32), spec), lens, L, kind, k)


def test_fit_piece_cost_recovers_tile_and_piece_costs():
    """decode_diag part 6's fit: times made from known costs (µs per tile, per piece, per split piece, a constant per
    call) come back, per contender and per short-tile setting; a contender missing from a row is left out."""
    from benchmarks.decode_diag import fit_piece_cost, piece_cases

    cost = {"ours": (3.0, 20.0, 9.0, 12.0), "FlashMLA": (3.2, 6.0, 4.0, 8.0)}  # tile, piece, split extra, call
    rows = []
    for kind, n, short, k, B, L in piece_cases(132, tiles=(4, 16, 64)):
        row = {"dtype": "bfloat16", "H": 32, "kind": kind, "tiles": n, "short": short, "k": k}
        for name, (a, beta, sp, call) in cost.items():
            extra = 1.5 if short else 0.0  # a short last tile costs a little more per piece
            row[name] = call + k * (a * n + beta + extra) + (sp if kind == "split" else 0.0)
        rows.append(row)
    rows[0].pop("FlashMLA")
    fits = {(f["contender"], f["short"]): f for f in fit_piece_cost(rows, ["ours", "FlashMLA"])}
    assert set(fits) == {(c, s) for c in cost for s in (0, 32)}
    for (name, short), f in fits.items():
        a, beta, sp, _ = cost[name]
        assert abs(f["us_per_tile"] - a) < 1e-6
        assert abs(f["beta_us"] - beta - (1.5 if short else 0.0)) < 1e-6
        assert abs(f["beta_tiles"] - f["beta_us"] / a) < 1e-9
        assert all(abs(v - sp) < 1e-6 for v in f["split_extra_us"].values())
    assert 4 not in fits[("FlashMLA", 0)]["split_extra_us"]  # its k = 1 direct row lost FlashMLA's time


def test_named_config_and_its_noprefetch_variant():
    """benchmarks.decode.named_config: a CONFIGS name, or NAME/noprefetch (prefetch off, all else equal); others
    are refused with the names."""
    import dataclasses

    import pytest

    from tokenspeed_jax.backends.sm90_decode import CONFIGS

    assert bd.named_config("transposed") is CONFIGS["transposed"]
    off = bd.named_config("transposed/noprefetch")
    assert off.prefetch is False and dataclasses.replace(off, prefetch=True) == CONFIGS["transposed"]
    for bad in ("nope", "transposed/fast", "/noprefetch"):
        with pytest.raises(ValueError, match="CONFIGS"):
            bd.named_config(bad)


def test_decode_diag_part6_runs_its_batches(tmp_path, monkeypatch):
    """decode_diag --parts 6 end to end on the CPU up to the timing: the grid from the backend's spec for sm_90a,
    every batch built and its schedule checked (piece_layout), a row per batch and the fit in the JSON.  The kernels
    are not run here (the timing is replaced; no prewarm), so this is the part's control flow, not its numbers."""
    import json

    import benchmarks.decode as bdec
    from benchmarks import decode_diag, harness
    from tokenspeed_jax.runtime import target_override

    def fake_interleaved(fns, est_us, rounds=5):
        return {name: {"median_us": 10.0 + i} for i, name in enumerate(fns)}

    monkeypatch.setattr(harness, "interleaved", fake_interleaved)
    monkeypatch.setattr(bdec, "prewarm", lambda *a, **k: None)
    out = tmp_path / "diag6.json"
    with target_override("sm_90a", num_sms=132):
        decode_diag.main(["--parts", "6", "--piece-tiles", "4", "--piece-per-cta", "1,2", "--out", str(out),
                          "--config", "transposed/noprefetch"])
    res = json.loads(out.read_text())
    rows = res["piece_cost"]
    assert len(rows) == 2 * len(decode_diag.piece_cases(132, tiles=(4,), per_cta=(1, 2)))  # BF16 and FP8
    assert all(r["pieces_per_cta"] == [r["k"], r["k"]] for r in rows)
    bf16 = [r for r in rows if r["dtype"] == "bfloat16"]
    assert all("transposed/noprefetch" in r for r in bf16)  # the 16-bit H32 config: the variant applies
    assert not any("transposed/noprefetch" in r for r in rows if r["dtype"] != "bfloat16")
    assert {f["contender"] for f in res["piece_cost_fit"]} >= {"ours", "transposed/noprefetch"}


def test_piece_timeline_summary_recovers_costs_and_the_pacing_ctas():
    """benchmarks/piece_timeline.summarize on a synthetic trace made from known costs: the SM clock (clock64 over
    globaltimer), the per-tile and per-piece (direct / split) costs, each phase's median, the gaps between a CTA's
    pieces, and which CTAs finish last; records left at 0 (no piece) are skipped."""
    from benchmarks.piece_timeline import summarize
    from tokenspeed_jax.kernels.sm90.decode_trace import PIECE_FIELDS

    ghz, a, beta = 1.5, 3.0, {"direct": 4.0, "split": 9.0}  # GHz, µs per tile, µs per piece
    f = {n: i for i, n in enumerate(PIECE_FIELDS)}
    layout = {0: [(40, 0), (20, -1), (6, -1), (30, 3)], 1: [(96, 5)], 2: [(50, 7), (45, 8)]}  # (tiles, slot)
    tr = np.zeros((4, 6, len(PIECE_FIELDS)), np.int64)  # CTA 3 and the last records: no piece
    for cta, ps in layout.items():
        t_us = 1.0 + cta  # launch skew
        for j, (tiles, slot) in enumerate(ps):
            kind = "split" if slot >= 0 else "direct"
            start, epi, total = 0.5, 1.0, a * tiles + beta[kind]
            rec = tr[cta, j]
            rec[f["b"]], rec[f["start"]], rec[f["end"]], rec[f["slot"]] = j, 64, 64 + 64 * tiles - 10, slot
            clk0 = round(t_us * 1e3 * ghz)
            rec[f["clk_start"]] = clk0
            rec[f["clk_q"]] = clk0 + round(start * 1e3 * ghz)
            rec[f["clk_epilogue"]] = clk0 + round((total - epi) * 1e3 * ghz)
            rec[f["clk_end"]] = clk0 + round(total * 1e3 * ghz)
            if cta != 1:  # the epilogue's steps: barrier 0.2, the next Q's copies 0.3, stores 0.4, last wait 0.1 µs
                for k, dt in (("clk_epi_pass", 0.2), ("clk_q_issued", 0.5), ("clk_stored", 0.9)):
                    rec[f[k]] = rec[f["clk_epilogue"]] + round(dt * 1e3 * ghz)
            rec[f["ns_start"]], rec[f["ns_end"]] = round(t_us * 1e3), round((t_us + total) * 1e3)
            t_us += total + 0.25  # the gap to the next piece
    s = summarize(tr)
    assert abs(s["clock_ghz"] - ghz) < 1e-3 and s["pieces"] == 7
    assert abs(s["fit"]["us_per_tile"] - a) < 1e-3 and s["fit"]["rms_us"] < 1e-2
    assert abs(s["fit"]["beta_direct_us"] - 4.0) < 0.05 and abs(s["fit"]["beta_split_us"] - 9.0) < 0.05
    d = s["by_kind"]["direct"]
    assert d["n"] == 2 and abs(d["start_us"] - 0.5) < 1e-2 and abs(d["epilogue_us"] - 1.0) < 1e-2
    assert abs(d["gap_us"] - 0.25) < 1e-2
    kn = s["by_kind_and_next"]  # CTA 0: split, direct, direct then split last; CTA 1 one split; CTA 2 two splits
    assert {k: v["n"] for k, v in kn.items()} == {"direct_next": 2, "split_next": 2, "split_last": 3}
    for k, want in (("epi_barrier_us", 0.2), ("epi_q_issue_us", 0.3), ("epi_store_us", 0.4), ("epi_end_wait_us", 0.1)):
        assert abs(kn["direct_next"][k] - want) < 1e-2, (k, kn["direct_next"])
    assert abs(kn["direct_next"]["loop_us_per_tile"] - np.median([(a * t + 4.0 - 1.5) / t for t in (20, 6)])) < 1e-2
    finish = {c: 1.0 + c + sum(a * t + beta["split" if sl >= 0 else "direct"] + 0.25 for t, sl in ps) - 0.25 - 1.0
              for c, ps in layout.items()}  # from the earliest start (CTA 0 at 1 µs)
    assert [c["cta"] for c in s["latest_ctas"]] == sorted(finish, key=lambda c: -finish[c])
    assert abs(s["span_us"] - max(finish.values())) < 1e-2
    assert s["by_pieces_per_cta"][4]["tiles_mean"] == 96 and s["by_pieces_per_cta"][1]["ctas"] == 1


def test_piece_timeline_main_runs_its_cases(tmp_path, monkeypatch):
    """benchmarks/piece_timeline.main on the CPU with the two GPU builds replaced (the normal build by zeros, the traced
    one by zeros and a trace written from the schedule's own pieces): every case x fixed cost is scheduled, compared
    bit for bit, summarized (every scheduled piece recorded) and written; a traced output that differs stops the run."""
    import json

    import jax.numpy as jnp
    import pytest

    from benchmarks import piece_timeline as pt
    from tokenspeed_jax.backends import sm90_decode
    from tokenspeed_jax.decode_schedule import reference_pieces
    from tokenspeed_jax.kernels.sm90.decode_trace import PIECE_FIELDS
    from tokenspeed_jax.runtime import target_override

    def fake_decode(prob, q, kv, bt, sl, ss, os_, config=None, work=None):
        return jnp.zeros(q.shape[:3] + (512,), jnp.bfloat16), jnp.zeros(q.shape[:3], jnp.float32)

    bad = {"on": False}

    def fake_traced(prob, cfg, pieces):
        def run(q, kv, bt, sl, scale, work):
            cta, req = (np.asarray(x) for x in work)
            G = cta.shape[0]
            tr = np.zeros((G, pieces, len(PIECE_FIELDS)), np.int64)
            cap = bt.shape[1] * kv.shape[1]
            t = np.ones(G, np.int64) * 1000
            seen = np.zeros(G, int)
            for g, b, s, e, slot in reference_pieces(cta, req, np.asarray(sl), cap):
                j = b - int(cta[g, 0])
                if j < pieces:
                    d = 2000 * (-(-(e - s) // 64)) + 5000
                    tr[g, j, :10] = [b, s, e, slot, t[g], t[g] + 500, t[g] + d - 800, t[g] + d, t[g], t[g] + d]
                    t[g] += d + 100
                    seen[g] += 1
            out, lse = fake_decode(prob, q, kv, bt, sl, None, None)
            return (out + 1 if bad["on"] else out), lse, jnp.asarray(tr)
        return run

    monkeypatch.setattr(sm90_decode, "decode", fake_decode)
    monkeypatch.setattr(pt, "traced_decode", fake_traced)
    out = tmp_path / "pieces.json"
    with target_override("sm_90a", num_sms=132):
        pt.main(["--cases", "tail,16,8192,32,1", "uniform,8,4096,128,1", "--fixed-costs", "2,16", "--out", str(out)])
    res = json.loads(out.read_text())
    assert [(c["case"], c["fixed_cost"]) for c in res["cases"]] == [
        ("tail_B16_K8192_H32_S1", 2), ("tail_B16_K8192_H32_S1", 16), ("uniform_B8_K4096_H128_S1", 2),
        ("uniform_B8_K4096_H128_S1", 16)]
    for c in res["cases"]:
        assert c["bitwise_equal_to_normal_build"] and c["summary"]["pieces_not_recorded"] == 0
        assert abs(c["summary"]["clock_ghz"] - 1.0) < 1e-9 and abs(c["summary"]["fit"]["us_per_tile"] - 2.0) < 1e-6
    bad["on"] = True
    with target_override("sm_90a", num_sms=132), pytest.raises(SystemExit, match="void"):
        pt.main(["--cases", "tail,16,8192,32,1", "--fixed-costs", "2", "--out", str(out)])


def test_schedule_model_evaluates_a_piece_cost_model():
    """scripts/schedule_model.py: times made by a known per-piece model are predicted exactly by that model (the
    per-case constant absorbed) and worse by another; ``cta_pieces`` covers every request's tiles exactly once."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(
        "schedule_model", pathlib.Path(__file__).resolve().parents[1] / "scripts" / "schedule_model.py")
    sm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sm)
    layouts = {  # variant -> per CTA (tiles, split) pieces
        "choose fc2": [[(40, True), (5, False), (5, False), (30, True)], [(90, False)]],
        "choose fc16": [[(40, True), (10, False)], [(20, True), (85, False)]],
        "balanced fc8": [[(70, False)], [(60, True), (4, False)]],
    }
    truth = (3.0, 5.0, 20.0)
    busiest = {v: max(sum(truth[0] * t + (truth[2] if sp else truth[1]) for t, sp in ps) for ps in cs)
               for v, cs in layouts.items()}
    rows = [{"case": "tail_B8_K4096_H32_S1", "dtype": "bfloat16", "FlashMLA": 1.0,
             **{v: b + 12.0 for v, b in busiest.items()}}]
    pieces_of = lambda case, dtype, v: layouts[v]  # noqa: E731
    table, rms, rms0 = sm.evaluate(rows, *truth, pieces_of=pieces_of)
    assert rms < 1e-12 and rms0 > 0.01 and abs(table[0]["constant_us"] - 12.0) < 1e-9
    assert sm.evaluate(rows, 3.0, 0.0, 0.0, pieces_of=pieces_of)[1] > 1e-3
    assert sm.evaluate(rows, 6.0, 10.0, 40.0, pieces_of=pieces_of, scale_per_case=True)[1] < 1e-9  # 2x the truth
    from benchmarks.decode_varlen import lengths

    cs = sm.cta_pieces("tail_B8_K4096_H32_S1", "bfloat16", "choose fc16")
    assert len(cs) == 132 and sum(t for ps in cs for t, _ in ps) == sum(-(-int(x) // 64) for x in lengths(
        "tail", 8, 4096, 0))


def test_ab_reads_piece_timelines():
    """``benchmarks.ab`` summarizes a ``benchmarks.piece_timeline`` run: per (case, fixed cost) the span, and per kind
    of piece its epilogue and loop time a tile; a kind without pieces (NaN) is left out."""
    from benchmarks import ab

    nan = float("nan")
    doc = {"cases": [{"case": "tail_B64", "fixed_cost": 16, "trace": [[1, 2]], "summary": {
        "span_us": 340.5,
        "by_kind_and_next": {"split_next": {"epilogue_us": 25.0, "loop_us_per_tile": 4.1},
                             "direct_last": {"epilogue_us": nan, "loop_us_per_tile": nan}}}}]}
    assert ab.measurements(doc) == {("tail_B64 fc16", "pieces", "span_us"): 340.5,
                                    ("tail_B64 fc16", "split_next", "epilogue_us"): 25.0,
                                    ("tail_B64 fc16", "split_next", "loop_us_per_tile"): 4.1}
    rows = ab.summarize({"a": {"runs": [doc]}, "b": {"runs": [doc, doc]}})
    assert (rows[0]["case"], rows[0]["contender"], rows[0]["key"], rows[0]["ratio"]) == (
        "tail_B64 fc16", "pieces", "span_us", {"b": 1.0})
    assert len(rows) == 3
