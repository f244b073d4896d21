"""CPU checks of ``benchmarks/prefill.py``'s own logic: the case table, argument handling, the
interleaved timer, the speed ratios and the plot (no GPU, no FA3/FA4 needed)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from benchmarks import prefill as bp
from tests.gpu.precompile_sm90_prefill import BENCH_CONFIGS


def test_case_table_matches_issue_7():
    full = bp.cases(False)
    assert len(full) == 14 and len({c.name for c in full}) == 14
    assert [c.causal for c in full[:2]] == [True, False]
    by = {c.name: c for c in full}
    assert by["S8k_H16_causal"].lens == (8192,) and by["S8k_H16_causal"].heads == 16
    assert by["S8k_H128_full"].heads == 128
    assert by["S128k_H16_full"].tokens == 131072
    assert by["4x16k_H32_causal"].lens == (16384,) * 4 and by["4x16k_H32_causal"].dense
    mixed = by["32k+64x512_H32_full"]
    assert mixed.tokens == 32768 + 64 * 512 and mixed.max_len == 32768 and not mixed.dense
    assert [c.name for c in full if c.xla_fits] == ["S8k_H16_causal", "S8k_H16_full"]
    quick = bp.cases(True)
    assert [c.name for c in quick] == ["S8k_H16_causal", "S8k_H16_full", "S32k_H32_causal", "S32k_H32_full"]


def test_bench_kernel_configs_are_precompiled():
    # every configuration the benchmark times is in the precompile list, so its first call is a cache load
    assert set(bp.kernel_configs(bp.cases(False))) <= set(BENCH_CONFIGS)


def test_parse_args_and_case_filter():
    a = bp.parse_args(["--prewarm", "4", "--prewarm-only", "--with-test-configs", "--cases", "S8k,4x16k"])
    assert a.prewarm == 4 and a.prewarm_only and a.with_test_configs and a.rounds == 7
    assert [c.name for c in bp.select_cases(a)] == [
        "S8k_H16_causal",
        "S8k_H16_full",
        "S8k_H128_causal",
        "S8k_H128_full",
        "4x16k_H32_causal",
        "4x16k_H32_full",
    ]
    assert len(bp.select_cases(bp.parse_args([]))) == 14
    for bad in (["--rounds", "0"], ["--prewarm", "-1"], ["--prewarm-only"]):
        with pytest.raises(SystemExit):
            bp.parse_args(bad)


def test_interleaved_times_every_contender_in_rounds():
    calls = []
    x = jnp.ones((64, 64))

    def make(name):
        def fn():
            calls.append(name)
            return x @ x

        return fn

    from benchmarks.harness import interleaved

    res = interleaved({"a": make("a"), "b": make("b")}, 10.0, rounds=3, warmup=1)
    assert set(res) == {"a", "b"}
    for r in res.values():
        assert len(r["samples_us"]) == 3 and r["min_us"] <= r["median_us"] <= r["max_us"] and r["iters"] >= 1
    # after warm-up and sizing (a a b b), rounds alternate, the order rotating: a b, b a, a b
    timed = calls[4:]
    A, B_ = ["a"] * res["a"]["iters"], ["b"] * res["b"]["iters"]
    assert timed == A + B_ + B_ + A + A + B_


def test_speedups_and_verdicts():
    t = {bp.OURS: 100.0, bp.FA4: 98.0, bp.FA3: 110.0, bp.CUDNN: None}
    s = bp.speedups(t)
    assert s == pytest.approx({"FA4": 0.98, "FA3": 1.1})
    v = bp.verdicts(s)
    assert "vs FA4 0.980x (target 0.97: met)" in v and "vs FA3 1.100x (target 1.0: met)" in v
    assert "MISSED" in bp.verdicts({"cuDNN": 1.1})
    assert bp.speedups({bp.FA4: 1.0}) == {}


def test_load_fa3_never_raises(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "fa3", None)  # import fa3 -> ImportError
    mod, why = bp.load_fa3()
    assert mod is None and "Error" in why and "fa3" in why


def test_load_fa3_library_load_failure(tmp_path, monkeypatch):
    import sys

    (tmp_path / "fa3.py").write_text("raise OSError('cannot open shared object _vllm_fa3_C.abi3.so')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fa3", raising=False)
    mod, why = bp.load_fa3()
    assert mod is None and why.startswith("OSError") and "_vllm_fa3_C" in why


def test_plot_prefill_writes_png(tmp_path):
    rows = []
    for case in ("S8k_H16_causal", "S8k_H16_full"):
        rows.append(
            {
                "case": case,
                "contender": bp.OURS,
                "us": 100.0,
                "tflops": 600.0,
                "speedup": {"FA4": 0.99, "FA3": 1.05, "cuDNN": 1.3},
            }
        )
        rows.append({"case": case, "contender": bp.FA4, "us": 99.0, "tflops": 606.0})
        rows.append({"case": case, "contender": bp.FA3, "us": None, "note": "failed"})
    doc = {
        "name": "t",
        "device": "cpu",
        "date": "today",
        "command": "python -m benchmarks.prefill",
        "ceilings": {"bf16_tflops": 700.0},
        "rows": rows,
    }
    png = tmp_path / "p.png"
    bp.plot_prefill(json.loads(json.dumps(doc)), str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_main_end_to_end_on_cpu(tmp_path, monkeypatch):
    """The whole script on CPU with ``ours`` routed to the xla backend and tiny cases (flow, JSON, PNG)."""
    import tokenspeed_jax
    from benchmarks import harness

    real = tokenspeed_jax.mla_prefill
    monkeypatch.setattr(tokenspeed_jax, "mla_prefill", lambda *a, **kw: real(*a, **{**kw, "backend": "xla"}))
    monkeypatch.setattr(
        bp,
        "cases",
        lambda quick: [bp.Case("tiny_causal", (64,), 2, True), bp.Case("mixed_full", (48, 16), 2, False)],
    )
    monkeypatch.setattr(harness, "measure_ceilings", lambda: harness.Ceilings(100.0, 1.0, None))
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    bp.main(["--no-fa4", "--no-fa3", "--no-cudnn", "--rounds", "2", "--out", str(out), "--png", str(png)])
    doc = json.loads(out.read_text())
    ours = [r for r in doc["rows"] if r["contender"] == bp.OURS]
    assert [r["case"] for r in ours] == ["tiny_causal", "mixed_full"]
    assert all(len(r["samples_us"]) == 2 and r["us"] > 0 for r in ours)
    assert set(ours[0]["speedup"]) == {"XLA"}  # the tiny cases fit the XLA column
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_precompile_covers_gpu_test_matrix():
    """Every head configuration of the GPU test matrix is precompiled (else a test compiles for ~20 s)."""
    from tests.gpu import test_sm90_prefill as gt
    from tests.gpu.precompile_sm90_prefill import TEST_CONFIGS

    need = {("bfloat16", 192, 128, hq, hk, c, True) for hq, hk in gt.HEADS for c in (True, False)}
    need |= {("bfloat16", 192, 128, 32, 8, c, True) for c in (True, False)}  # fp8 runs as bf16
    need |= {("float16", 192, 128, 32, 8, c, True) for c in (True, False)}
    need |= {("bfloat16", d, d, 16, 4, True, True) for d in (128, 64, 256)}
    need.add(("bfloat16", 192, 128, 16, 16, True, False))  # without LSE, CUDA-graph test
    assert need <= set(TEST_CONFIGS)
