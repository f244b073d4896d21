"""The device runner's CPU-side behaviour (python -m benchmarks.device): argument parsing, the steps each
subcommand runs, the dry run, and the manifest / commit stamping (with a stand-in command)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import device as D

ROOT = Path(__file__).resolve().parents[1]


def _steps(*argv):
    return D.steps_for(D.parse(list(argv)))


def _cmd(step):
    return " ".join(step.argv[1:]) if step.argv[0] == sys.executable else " ".join(step.argv)


def test_tests_and_check_and_memcheck_steps(tmp_path):
    s = _steps("tests", "--out", str(tmp_path))
    assert [x.name for x in s] == ["prewarm_prefill", "prewarm_decode", "prewarm_hostile", "gpu_tests"]
    assert "tests/gpu" in s[-1].argv and "not memcheck" in s[-1].argv
    s = _steps("tests", "--files", "tests/gpu/test_hostile_sm90.py", "--out", str(tmp_path))
    assert [x.name for x in s] == ["prewarm_hostile", "gpu_tests"]
    # the decode file: the named configs are precompiled too where -k may select the config test
    for k, cfg in (("prefetch", True), ("graph or schedule_kernel", False)):
        s = _steps("tests", "--files", "tests/gpu/test_sm90_decode.py", "-k", k, "--out", str(tmp_path))
        assert [x.name for x in s] == ["prewarm_decode", "gpu_tests"]
        assert ("configs=tuple(CONFIGS)" in _cmd(s[0])) == cfg, _cmd(s[0])
    s = _steps("tests", "--files", "tests/gpu/test_vllm_adapter.py", "-k", "fp8", "--out", str(tmp_path))
    assert [x.name for x in s] == ["gpu_tests"] and "fp8" in s[0].argv
    s = _steps("tests", "--shards", "7", "--budget", "345", "--out", str(tmp_path))  # no prewarm: one sharded step
    assert [x.name for x in s] == ["gpu_tests"] and "-m benchmarks.pytest_shards --shards 7 --seconds 330" in _cmd(s[0])
    assert s[0].timeout == 345 and "not memcheck" in s[0].argv and "tests/gpu" in s[0].argv
    s = _steps("check", "--op", "decode", "--cases", "s1h16p64", "--out", str(tmp_path))
    assert [x.name for x in s] == ["check_decode"]
    assert "-m benchmarks.decode" in _cmd(s[0]) and "--check" in s[0].argv and "s1h16p64" in s[0].argv
    assert [x.name for x in _steps("check", "--out", str(tmp_path))] == [
        "check_decode", "prewarm_prefill", "check_prefill"]
    m = _steps("memcheck", "--out", str(tmp_path))
    assert dict(m[0].env)["TOKENSPEED_SANITIZER"] == "1" and "memcheck" in m[0].argv


def test_bench_ab_profile_steps(tmp_path):
    s = _steps("bench", "--op", "decode", "--out", str(tmp_path), "--", "--quick")
    assert "--quick" in s[0].argv and str(tmp_path / "decode.png") in s[0].argv
    assert [x.name for x in _steps("bench", "--out", str(tmp_path))] == [
        "bench_decode", "bench_decode_varlen", "bench_prefill"]
    assert "benchmarks.decode_varlen" in _cmd(s[1]) and "--quick" not in s[1].argv
    ab = _steps("ab", "--out", str(tmp_path), "--", "--config", "A", "--config", "B", "--quick")
    assert ab[0].argv[1:] == ("-m", "benchmarks.decode", "--config", "A", "--config", "B", "--quick",
                              "--out", str(tmp_path / "ab.json"))
    with pytest.raises(SystemExit, match="--config"):
        _steps("ab", "--", "--quick")
    p = _steps("profile", "--ncu", "--out", str(tmp_path), "--", "--cases", "64,16384,64,32,4")
    assert [x.name for x in p] == ["trace", "ncu_decode"] and p[1].argv[0] == "ncu"
    assert "--profile" in p[0].argv


def test_pieces_steps(tmp_path):
    s = _steps("pieces", "--out", str(tmp_path), "--", "--piece-heads", "32,128")
    assert [x.name for x in s] == ["piece_cost", "piece_timeline"]
    assert "-m benchmarks.decode_diag --parts 6 --config transposed/noprefetch --piece-heads 32,128" in _cmd(s[0])
    assert _cmd(s[0]).endswith(f"--out {tmp_path / 'piece_cost.json'}") and "benchmarks.piece_timeline" in _cmd(s[1])
    assert sum(x.timeout for x in s) <= 575  # inside the default budget of one call


def test_bad_arguments_exit():
    with pytest.raises(SystemExit):
        D.parse(["frobnicate"])
    with pytest.raises(SystemExit):
        D.parse(["check", "--op", "attention"])


def test_dry_run_prints_the_commands_and_runs_nothing(tmp_path):
    out = tmp_path / "o"
    p = subprocess.run([sys.executable, "-m", "benchmarks.device", "check", "--op", "decode", "--dry-run",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "CUTE_DSL_ARCH=sm_90a" in p.stdout and "benchmarks.decode" in p.stdout and "--check" in p.stdout
    assert not out.exists()


def test_run_writes_manifest_logs_and_stamps_the_commit(tmp_path, monkeypatch):
    script = ("import json, sys; json.dump({'command': 'x', 'date': 'd', 'device': 'cpu'}, "
              f"open({str(tmp_path / 'r.json')!r}, 'w')); print('hello')")
    monkeypatch.setattr(D, "steps_for", lambda a: [D.Step("one", (sys.executable, "-c", script), 60)])
    monkeypatch.setattr(D, "_device", lambda: "test-device")
    rc = D.main(["memcheck", "--out", str(tmp_path), "--commit", "abc"])
    assert rc == 0
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert man["device"] == "test-device" and man["steps"][0]["rc"] == 0 and man["commit"]
    assert "hello" in (tmp_path / "one.log").read_text()
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["commit"] == man["commit"] and r["command"] == "x"


def test_no_h200_shell_scripts_remain():
    assert not list((ROOT / "scripts").glob("h200_*"))


def test_pytest_shards_outcomes_and_deadline(tmp_path, monkeypatch):
    """``benchmarks.pytest_shards`` on a throwaway test file: each test's outcome from the shards' logs, a failure
    reported as such (an out-of-memory one named apart), skip reasons counted, and a test still running at the deadline
    killed and listed as not reached."""
    import json

    from benchmarks import pytest_shards

    f = tmp_path / "test_throwaway.py"
    f.write_text("import time, pytest\n"
                 "@pytest.mark.parametrize('i', range(4))\n"
                 "def test_ok(i):\n    assert i >= 0\n"
                 "def test_bad():\n    assert 1 == 2\n"
                 "def test_skip():\n    pytest.skip('no')\n"
                 "def test_oom():\n    raise RuntimeError('RESOURCE_EXHAUSTED: Out of memory allocating 1GiB')\n"
                 "def test_slow():\n    time.sleep(600)\n")
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)  # (run from the rootdir: node ids are relative to it)
    rc = pytest_shards.main([f.name, "--shards", "3", "--seconds", "25", "--out", str(out)])
    doc = json.loads((out / "gpu_tests.json").read_text())
    assert rc == 1 and doc["collected"] == 8 and doc["shards"] == 3 and doc["killed_at_deadline"]
    res = {k.split("::")[1]: v for k, v in doc["results"].items()}
    assert res == {**{f"test_ok[{i}]": "PASSED" for i in range(4)}, "test_bad": "FAILED", "test_skip": "SKIPPED",
                   "test_oom": "FAILED"}
    assert [n.split("::")[1] for n in doc["failed_out_of_memory"]] == ["test_oom"]  # (test_bad: a real failure)
    assert doc["skip_reasons"] == {"no": 1}
    assert [n.split("::")[1] for n in doc["not_reached"]] == ["test_slow"]
    assert pytest_shards.outcomes("FAILED a.py::t - assert\na.py::t PASSED") == {"a.py::t": "FAILED"}
    log = ("___ t_a ___\nE   assert 1 == 2\n___ t_b[x] ___\n========= Program hit CUDA_ERROR_OUT_OF_MEMORY (error 2)\n"
           "E   AssertionError\n=== short test summary info ===\nE out of memory\n")
    assert pytest_shards.out_of_memory(log) == {"t_b[x]"}  # (a sanitizer's '=====' line does not end a section)
