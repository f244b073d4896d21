"""The H200 benchmark script runs on CPU with its tiny setting (so it does not rot between GPU sessions)."""

import json


def test_r1_h200_benchmark_tiny(tmp_path):
    from benchmarks.deepseek_r1_h200 import main

    out = tmp_path / "bench.json"
    argv = ["--tiny", "--backend", "xla", "--batches", "2", "--contexts", "32", "--profile-dir", str(tmp_path / "p"),
            "--json", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["config"]["fp8_weights"] and res["commit"] is not None and res["device"]
    (row,) = res["results"]
    assert row["prefill_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0
    assert row["roofline"]["weight_bytes_per_step"] > 0 and row["roofline"]["kv_bytes_per_step"] > 0
    assert set(row["decode_breakdown_ms_per_step"]) == {"attention", "moe", "dense_mlp", "rest"}
