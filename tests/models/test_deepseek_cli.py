"""The CLI end to end on the tiny preset (CPU, xla): runs, reports, and writes a profiler trace that it reads back
(which tokenspeed names its events show); bad flags end in one-line parser errors; text in and out through a
checkpoint's tokenizer.json."""

import json

import pytest
from tokenspeed_jax.models.deepseek import DeepseekV3Config
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
            "--no-compilation-cache",
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


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--page-size", "24"], "--page-size"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "1.5"], "--top-p"),
        (["--top-k", "-2"], "--top-k"),
        (["--num-speculative-tokens", "16"], "--num-speculative-tokens"),
        (["--batch", "0"], "--batch"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--preset", "tiny", "--prompt", "hello"], "--prompt"),
        (["--preset", "nope"], "--preset"),
        (["--backend", "cuda"], "--backend"),
        (["--checkpoint", "/nonexistent/dir"], "--checkpoint"),
        (["--prompts-file", "/nonexistent/file"], "--prompts-file"),
        (["--preset", "tiny", "--mesh", "model=2"], "--mesh"),
        (["--preset", "tiny", "--mesh", "data=2", "--max-slots", "3"], "--max-slots"),
        (["--preset", "tiny", "--mesh", "data=3,tensor=3"], "--mesh"),  # 9 devices, 8 (or 1) available
        (["--preset", "tiny", "--mesh", "tensor=2,tensor=2"], "--mesh"),
        (["--preset", "tiny", "--mesh", "tensor=4"], "--mesh"),  # tiny has 2 heads
        (["--plan", "--preset", "deepseek-r1", "--mesh", "data=3,tensor=2"], "--mesh"),  # 256 experts / 6
        (["--prompt", "a", "--prompts-file", __file__], "--prompts-file"),
        (["--preset", "tiny", "--seed", "-1"], "--seed"),
        (["--temperature", "inf"], "--temperature"),
        (["--plan", "--context", "0"], "--context"),
        (["--plan", "--prefill-tokens", "-1"], "--prefill-tokens"),
        (["--plan", "--device-memory-gib", "-1"], "--device-memory-gib"),
    ],
)
def test_cli_bad_flags_end_in_one_line_errors(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("tokenspeed-deepseek: error:") and flag in last, last


def test_cli_help_shows_choices_and_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for s in (
        "{16,32,64,128,256}",
        "(default: 64)",
        "{auto,xla,sm90,sm100}",
        "--no-compilation-cache",
        "--prompt TEXT",
    ):
        assert s in text, s
    for flag, default in (("--max-new-tokens", 32), ("--seed", 0), ("--page-size", 64), ("--batch", 4)):
        assert text.split(flag, 2)[2].split("--", 1)[0].rstrip().endswith(f"(default: {default})"), flag


def test_cli_prompt_longer_than_the_context(tmp_path, capsys):
    """A prompt that does not fit the model's context (max_position_embeddings) is a parser error naming the
    flag, before anything compiles; --plan without --preset plans the default (shipped) checkpoint."""
    import jax.numpy as jnp
    from tokenspeed_jax.models.deepseek import DeepseekV3, save_checkpoint

    ckpt = tmp_path / "ctx16"
    save_checkpoint(DeepseekV3.random(DeepseekV3Config.preset("tiny").replace(max_position_embeddings=16)), ckpt)
    with pytest.raises(SystemExit) as e:
        main(["--checkpoint", str(ckpt), "--prompt-len", "20", "--backend", "xla", "--no-compilation-cache"])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("tokenspeed-deepseek: error: --prompt-len: a prompt of 20 tokens does not fit"), last
    out_json = tmp_path / "plan.json"
    assert main(["--plan", "--json", str(out_json)]) == 0
    assert "model: pystdlib-tiny" in capsys.readouterr().out
    assert json.loads(out_json.read_text())["model"] == "pystdlib-tiny"


def test_cli_text_in_and_out(tmp_path, capsys):
    """A checkpoint directory with tokenizer.json: --prompt text in, generated text out (and in --json)."""
    import jax.numpy as jnp
    from tokenspeed_jax.models.deepseek import DeepseekV3, load_tokenizer, save_checkpoint

    from tests.models.test_deepseek_generation import CFG, make_tokenizer

    ckpt = tmp_path / "tiny-text"
    save_checkpoint(DeepseekV3.random(CFG, dtype=jnp.float32, seed=3), ckpt)
    make_tokenizer(ckpt / "tokenizer.json")
    out_json = tmp_path / "res.json"
    argv = ["--checkpoint", str(ckpt), "--prompt", "hello world", "--prompt", "the fox", "--max-new-tokens", "8",
            "--page-size", "16", "--max-slots", "2", "--num-speculative-tokens", "0", "--backend", "xla",
            "--no-compilation-cache", "--json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "warm-up: compiling" in captured.err  # the progress line
    res = json.loads(out_json.read_text())
    assert res["model"] == "tiny-text"
    tok = load_tokenizer(ckpt)
    assert len(res["texts"]) == 2 and all(isinstance(t, str) for t in res["texts"])
    assert res["texts"] == [tok.decode(t) for t in res["first_tokens"]]  # <= 8 tokens: first_tokens is all
    assert "'hello world' ->" in captured.out
    assert res["attention_backend"]["decode"]["name"] == "xla"
    assert isinstance(res["attention_backend"]["decode"]["not_chosen"], dict)


def test_compilation_cache_dir_default(monkeypatch, tmp_path):
    from tokenspeed_jax.models.deepseek.compile_cache import default_compilation_cache_dir

    monkeypatch.delenv("TOKENSPEED_JAX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_compilation_cache_dir() == str(tmp_path / "tokenspeed_jax" / "xla")
    monkeypatch.setenv("TOKENSPEED_JAX_CACHE_DIR", str(tmp_path / "c"))
    assert default_compilation_cache_dir() == str(tmp_path / "c" / "xla")

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
    """--mesh on the tiny preset (8 virtual CPU devices) with DP attention (data = 2, experts over all 8):
    JSON keeps first_tokens, gains mesh and bytes; each device holds half the cache (its rank's pages)."""
    import jax
    import pytest

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (virtual) devices")
    out_json = tmp_path / "res.json"
    argv = ["--preset", "tiny", "--batch", "2", "--prompt-len", "8", "--max-new-tokens", "2", "--page-size", "16",
            "--num-speculative-tokens", "0", "--backend", "xla", "--mesh", "data=2,expert=4", "--json",
            str(out_json)]
    assert main(argv) == 0
    res = json.loads(out_json.read_text())
    assert res["mesh"] == {"data": 2, "tensor": 1, "expert": 4}
    assert len(res["first_tokens"]) == 2 and res["bytes_per_device"]["weights"] > 0
    cfg = DeepseekV3Config.preset("tiny")
    page = (cfg.num_hidden_layers + cfg.num_nextn_predict_layers) * 16 * cfg.kv_cache_dim * 4
    assert res["bytes_per_device"]["kv_cache"] == 2 * page  # one request's page + the spare, per rank
