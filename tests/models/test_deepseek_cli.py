"""The CLI end to end on the tiny preset (CPU, xla): runs, reports, and writes a profiler trace that it
reads back (which tokenspeed names its events show)."""

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
    # The trace is read as XProf's trace viewer reads it (events, not raw bytes): on a CPU the ops run as
    # fused XLA reference code whose events carry HLO names only, so the names are reported, not found.
    names = res["trace_names"]
    expected = {"tokenspeed_mla_prefill", "tokenspeed_mla_decode", "tokenspeed_concat_and_cache_mla"}
    assert expected <= set(names)
    assert all(isinstance(v, bool) for v in names.values())
    assert "tokenspeed ops in the trace:" in text
    assert res["prefill_tokens_per_s"] > 0 and res["decode_tokens_per_s"] > 0
    assert 0.0 <= res["mtp_acceptance_rate"] <= 1.0
    assert res["mtp_tokens_equal_plain"] is True and res["plain_decode_tokens_per_s"] > 0
