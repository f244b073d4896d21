"""The GPU-figure benchmark scripts run on CPU in their --smoke settings (so they do not rot between GPU
sessions), their JSON carries what the figures need, and their bookkeeping (incremental JSON, budget,
attention-backend log) works."""

import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _common(res):
    assert res["status"] == "complete", res["status"]
    for key in ("commit", "command", "date", "device", "jax", "tree_sha1"):
        assert res[key], key
    ab = res["attention_backends"]
    assert "fa4_importable" in ab
    return ab


def test_r1_h200_benchmark_smoke(tmp_path):
    from benchmarks.deepseek_r1_h200 import CLASSES, main

    out = tmp_path / "r1.json"
    argv = [
        "--smoke",
        "--batches",
        "2",
        "--contexts",
        "32",
        "--profile-dir",
        str(tmp_path / "p"),
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    ab = _common(res)
    # on a CPU the registry picks the xla reference for both ops, and says why not the GPU backends
    assert ab["decode"]["ran"] == ["xla"] and ab["prefill"]["ran"] == ["xla"]
    assert "sm90" in ab["prefill"]["not_chosen"]
    assert res["model"]["fp8_weights"] and res["model"]["layers"] == 3
    (dec,) = [p for p in res["points"] if p["section"] == "decode"]
    assert (
        dec["decode_tokens_per_s"] > 0 and dec["weight_bytes_per_step"] > 0 and dec["kv_bytes_per_step"] > 0
    )
    assert 0 < dec["fraction_of_roofline"]
    assert set(dec["breakdown"]["ms_per_step"]) == set(CLASSES)
    (pre,) = [p for p in res["points"] if p["section"] == "prefill"]
    assert pre["prefill_tokens_per_s"] > 0 and pre["batches"] == [2] and pre["group"] == 2
    assert not res["skipped"]


def test_generation_benchmark_smoke(tmp_path):
    from tokenspeed_jax.models.deepseek import cli

    from benchmarks import generation as G

    out = tmp_path / "gen.json"
    # 3 requests through 2 slots: admissions of 2 then 1, which the static run and the MTP batch (the first 2)
    # share, so few shapes compile
    sizes = ["--num-prompts", "3", "--max-slots", "2", "--prompt-lens", "4,12", "--output-lens", "2,5"]
    argv = ["--smoke", "--sections", "batching,mtp", *sizes, "--out", str(out)]  # fmt: skip
    assert G.main(argv) == 0
    res = json.loads(out.read_text())
    ab = _common(res)
    assert ab["decode"]["ran"] == ["xla"] and ab["prefill"]["ran"] == ["xla"]
    rows = {(p["section"], p.get("mode", p.get("k"))): p for p in res["points"]}
    assert set(rows) == {("batching", "continuous"), ("batching", "static"), ("mtp", 0), ("mtp", 1)}
    assert (
        rows["batching", "continuous"]["tokens_per_s"] > 0
        and rows["batching", "continuous"]["speedup_vs_static"]
    )
    assert rows["mtp", 1]["greedy_equal_plain_fraction"] == 1.0  # fp32 on the CPU: MTP greedy == plain greedy
    # the warm-start section's CLI command line parses (the section itself runs two CLI processes)
    args = G.parse(["--smoke"])
    cmd = G.warmstart_command(args, str(tmp_path / "w.json"))
    assert cmd[1:3] == ["-m", "tokenspeed_jax.models.deepseek"]
    cli._parser().parse_args(cmd[3:])


def test_mtp_speedup_smoke(tmp_path):
    from benchmarks.mtp_speedup import main

    out = tmp_path / "mtp.json"
    doc = main(["--smoke", "--batch", "2", "--loss-windows", "1", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res == json.loads(json.dumps(doc, default=str))
    ab = _common(res)
    assert ab["decode"]["ran"] == ["xla"] and ab["prefill"]["ran"] == ["xla"]
    assert 0 < res["heldout_loss"] < np.log(2048)
    dec = {p["k"]: p for p in res["points"] if p["section"] == "decode"}
    assert set(dec) == {0, 1} and dec[0]["tokens_per_s"] > 0 and dec[1]["draft_tokens"] > 0
    assert dec[1]["same_as_plain"] == 1.0  # fp32: greedy MTP == plain greedy


def test_results_budget_and_backend_log(tmp_path):
    """Budget skips are recorded, the JSON is rewritten after each point, and the backend log sees which
    backend mla_decode was traced with (and the registry's reasons for the others)."""
    import tokenspeed_jax as ts
    from benchmarks.runinfo import BackendLog, Budget, Results, summary

    path = tmp_path / "r.json"
    log = BackendLog().install()
    try:
        res = Results(str(path), "t", {"a": 1}, Budget(0.0), backends=log)
        assert json.loads(path.read_text())["status"] == "running"
        assert not res.fits("s", "p1", 1.0)
        res.add("s", {"x": 1.5})
        doc = json.loads(path.read_text())
        assert doc["skipped"][0]["what"] == "p1" and doc["points"][0]["x"] == 1.5
        q = jnp.zeros((1, 1, 2, 576), jnp.float32)
        kv = jnp.zeros((3, 16, 576), jnp.float32)
        jax.jit(
            lambda q, kv: ts.mla_decode(
                q,
                kv,
                jnp.zeros((1, 2), jnp.int32),
                jnp.ones((1,), jnp.int32),
                softmax_scale=0.1,
                backend="xla",
            )
        )(q, kv)
        res.finish()
        doc = json.loads(path.read_text())
        assert doc["status"] == "complete"
        assert doc["attention_backends"]["decode"]["ran"] == ["xla"]
        assert doc["attention_backends"]["decode"]["problems"][0]["num_heads"] == 2
        assert doc["attention_backends"]["prefill"]["ran"] == []
        assert "decode: xla" in summary(doc)
    finally:
        log.uninstall()


def test_gpu_figures_driver_usage():
    p = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu_figures.sh")], capture_output=True, text=True, check=False
    )
    assert p.returncode == 2 and "usage" in p.stderr
