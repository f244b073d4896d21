"""The CLI end to end on the tiny preset (CPU, xla): runs, reports, and writes a profiler trace in which
the tokenspeed ops are visible by name."""

import json

from tokenspeed_jax.models.deepseek.cli import main


def test_cli_tiny_with_profile(tmp_path, capsys):
    prof = tmp_path / "trace"
    out_json = tmp_path / "res.json"
    rc = main(
        [
            "--preset",
            "tiny",
            "--batch",
            "2",
            "--prompt-len",
            "12",
            "--max-new-tokens",
            "4",
            "--page-size",
            "16",
            "--num-speculative-tokens",
            "1",
            "--backend",
            "xla",
            "--profile",
            str(prof),
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    for s in ("prefill:", "decode:", "tokens/s", "MTP acceptance rate", "attention backend (decode): xla"):
        assert s in text
    res = json.loads(out_json.read_text())
    assert res["trace_names"]["tokenspeed_mla_prefill"] and res["trace_names"]["tokenspeed_mla_decode"]
    assert res["trace_names"]["tokenspeed_concat_and_cache_mla"]
    assert res["prefill_tokens_per_s"] > 0 and res["decode_tokens_per_s"] > 0
    assert 0.0 <= res["mtp_acceptance_rate"] <= 1.0
    assert res["mtp_tokens_equal_plain"] is True and res["plain_decode_tokens_per_s"] > 0


def test_cli_plan_r1_fits_and_refuses(tmp_path, capsys):
    """--plan: DeepSeek-R1 (FP8, MTP) on 8 H200s with DP attention fits; TP-only at the same batch and
    context does not (replicated latent cache) and the refusal names what to change."""
    out_json = tmp_path / "plan.json"
    argv = ["--plan", "--preset", "deepseek-r1", "--batch", "64", "--context", "32768", "--prefill-tokens", "2048"]
    assert main(argv + ["--mesh", "data=8", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "fits, headroom" in text
    res = json.loads(out_json.read_text())
    assert res["fits"] and res["bytes_per_device"]["headroom"] > 0 and res["mesh"]["data"] == 8
    assert main(argv + ["--mesh", "tensor=8"]) == 2
    cap = capsys.readouterr()
    assert "DOES NOT FIT" in cap.out and "refused: lower --batch (64) or --context (32768)" in cap.err


def test_cli_mesh_json(tmp_path):
    """--mesh on the tiny preset (8 virtual CPU devices): JSON keeps first_tokens, gains mesh and bytes."""
    import jax
    import pytest

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (virtual) devices")
    out_json = tmp_path / "res.json"
    argv = ["--preset", "tiny", "--batch", "2", "--prompt-len", "8", "--max-new-tokens", "2", "--page-size", "16",
            "--num-speculative-tokens", "0", "--backend", "xla", "--mesh", "expert=8", "--json", str(out_json)]
    assert main(argv) == 0
    res = json.loads(out_json.read_text())
    assert res["mesh"] == {"data": 1, "tensor": 1, "expert": 8}
    assert len(res["first_tokens"]) == 2 and res["bytes_per_device"]["weights"] > 0
    assert res["bytes_per_device"]["kv_cache"] > 0
