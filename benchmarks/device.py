"""The one runner for GPU-machine work: tests, correctness checks, memcheck, benchmarks, A/B timing, profiles.

    python -m benchmarks.device tests    [--files tests/gpu/...] [-k EXPR] [--shards N]  # pytest of tests/gpu
    python -m benchmarks.device check    [--op decode|prefill|all]           # the check matrices
    python -m benchmarks.device memcheck                                      # compute-sanitizer, decode
    python -m benchmarks.device bench    [--op decode|prefill|all] [-- ARGS] # JSON + PNG per op
    python -m benchmarks.device ab       -- --config A --config B [...]      # benchmarks.decode ARGS
    python -m benchmarks.device pieces   [-- ARGS]                            # what a decode piece costs, and where
    python -m benchmarks.device profile  [--ncu]                              # XLA trace (+ Nsight Compute)

Every subcommand takes ``--out DIR`` (default ``$OUT``, else ``results/device``; the device tool returns the
files under ``$OUT``), ``--arch`` (``CUTE_DSL_ARCH``, default ``sm_90a``), ``--budget SECONDS`` (the whole
call; each step gets its own ``timeout`` inside it) and ``--dry-run`` (print the steps, run nothing). Each
step writes ``DIR/<step>.log``; ``DIR/manifest.json`` records the commit, the UTC date, the device
(``nvidia-smi``) and every step's command, return code and duration, and every JSON a step writes under
``DIR`` gains the commit (the benchmarks record their command, date and device themselves). The steps run
one at a time, so no two GPU jobs share the device. Kernels are compiled first in CPU worker processes
(``--prewarm``, the FFI disk cache under ``TOKENSPEED_JAX_CACHE_DIR``, default ``/tmp/tsj_cache``), so the
GPU steps only load them.

The commit is ``--commit`` / ``$TOKENSPEED_JAX_COMMIT`` where given, else ``git rev-parse HEAD``
(``benchmarks.runinfo.source_commit``; pass it on the GPU machine, whose copy of the tree may carry another HEAD).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


@dataclasses.dataclass(frozen=True)
class Step:
    """One command of a subcommand: ``name`` names its log, ``timeout`` its share of the budget (seconds)."""

    name: str
    argv: tuple[str, ...]
    timeout: int
    env: tuple[tuple[str, str], ...] = ()

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env)
        return (env + " " if env else "") + " ".join(shlex.quote(a) for a in self.argv)


def _pytest(files: Sequence[str], *extra: str) -> tuple[str, ...]:
    return (PY, "-m", "pytest", "-v", "-rfEx", "-p", "no:cacheprovider", "--durations=10", *extra, *files)


def steps_for(args: argparse.Namespace) -> list[Step]:
    """The steps of the parsed subcommand (pure: tested on CPU)."""
    out = Path(args.out)
    op = getattr(args, "op", "decode")
    ops = ("decode", "prefill") if op == "all" else (op,)
    jobs = str(args.jobs)
    s: list[Step] = []
    if args.cmd == "tests":
        files = args.files or ["tests/gpu"]
        prewarm = args.shards <= 1  # (shards compile what they need side by side: no serial prewarm first)
        if prewarm and any("sm90_prefill" in f or f.rstrip("/") == "tests/gpu" for f in files):
            s.append(Step("prewarm_prefill", (PY, "-m", "benchmarks.prefill", "--prewarm", jobs,
                                              "--prewarm-only", "--with-test-configs"), 120))
        if prewarm and any("sm90_decode" in f or f.rstrip("/") == "tests/gpu" for f in files):
            # (the named configs of the config test too, where -k may select it: every config that runs a case)
            cfg = not args.k or any(w in args.k for w in ("config", "prefetch", "seesaw", "transposed"))
            s.append(Step("prewarm_decode", (PY, "-c", "from benchmarks.decode import CHECK, prewarm; "
                                             "from tokenspeed_jax.backends.sm90_decode import CONFIGS; "
                                             f"prewarm(CHECK, {jobs}{', configs=tuple(CONFIGS)' if cfg else ''})"),
                          240 if cfg else 150))
        if prewarm and any("hostile_sm90" in f or f.rstrip("/") == "tests/gpu" for f in files):  # its kernels
            s.append(Step("prewarm_hostile", (PY, "-c", "from benchmarks.decode import Case, prewarm; "
                                              "from tests.gpu.test_hostile_sm90 import CONFIGS, HIDDEN_SH; "
                                              "prewarm([Case(f'hostile_{d}_p{p}_s{s}', d, 4, s, h, p, 16) "
                                              f"for p, d in CONFIGS for s, h in HIDDEN_SH], {jobs})"), 120))
        k = ("-k", args.k) if args.k else ("-k", "not memcheck")
        shards = (PY, "-m", "benchmarks.pytest_shards", "--shards", str(args.shards), "--seconds",
                  str(args.budget - 15), "--out", str(out), *k, *files)
        s.append(Step("gpu_tests", _pytest(files, *k) if prewarm else shards, args.budget))
    elif args.cmd == "check":
        if "decode" in ops:
            s.append(Step("check_decode", (PY, "-m", "benchmarks.decode", "--prewarm", jobs, "--check",
                                           *(("--cases", args.cases) if args.cases else ()),
                                           "--out", str(out / "decode.json")),  # -> decode_check.json, per case
                          args.budget if op == "decode" else 330))  # (the whole matrix ran > 330 s on 2026-12-04)
        if "prefill" in ops:
            s.append(Step("prewarm_prefill", (PY, "-m", "benchmarks.prefill", "--prewarm", jobs,
                                              "--prewarm-only", "--with-test-configs"), 120))
            s.append(Step("check_prefill", _pytest(["tests/gpu/test_sm90_prefill.py"]), 240))
    elif args.cmd == "memcheck":
        s.append(Step("memcheck", _pytest(["tests/gpu/test_sm90_decode.py"], "-s", "-k", "memcheck"), 200,
                      (("TOKENSPEED_SANITIZER", "1"),)))
    elif args.cmd == "bench":
        if "decode" in ops:
            s.append(Step("bench_decode", (PY, "-m", "benchmarks.decode", "--prewarm", jobs, "--bench",
                                           "--no-xla", *args.rest, "--out", str(out / "decode.json"),
                                           "--png", str(out / "decode.png")), 420))
            # serving-shaped batches (full / uniform / long-tail lengths, B 1-256, capacity 4k-128k): the
            # varied-length table the README shows; its own cases (the static matrix's ARGS do not apply)
            s.append(Step("bench_decode_varlen", (PY, "-m", "benchmarks.decode_varlen", "--prewarm", jobs,
                                                  "--out", str(out / "decode_varlen.json"),
                                                  "--png", str(out / "decode_varlen.png")), 600))
        if "prefill" in ops:
            s.append(Step("bench_prefill", (PY, "-m", "benchmarks.prefill", "--prewarm", jobs, "--fp8",
                                            *args.rest,
                                            "--out", str(out / "prefill.json"),
                                            "--png", str(out / "prefill.png")), 330))
    elif args.cmd == "ab":
        rest = list(args.rest)
        if not any(a == "--config" or a.startswith("--config=") for a in rest):
            raise SystemExit("ab: expected at least two '--config' arguments for benchmarks.decode, e.g. "
                             "python -m benchmarks.device ab -- --config A --config B")
        if "--out" not in rest and not any(a.startswith("--out=") for a in rest):
            rest += ["--out", str(out / "ab.json")]
        s.append(Step("ab", (PY, "-m", "benchmarks.decode", *rest), args.budget))
    elif args.cmd == "pieces":  # decode_diag part 6 (ARGS go to it), then the piece timeline of the varied cases
        s.append(Step("piece_cost", (PY, "-m", "benchmarks.decode_diag", "--parts", "6", "--config",
                                     "transposed/noprefetch", *args.rest, "--out", str(out / "piece_cost.json")),
                      330))
        s.append(Step("piece_timeline", (PY, "-m", "benchmarks.piece_timeline",
                                         "--out", str(out / "piece_timeline.json")), 240))
    elif args.cmd == "profile":
        s.append(Step("trace", (PY, "-m", "tokenspeed_jax.demo", "--large", "--no-check",
                                "--profile", str(out / "trace")), 300))
        if args.ncu:
            s.append(Step("ncu_decode", ("ncu", "--kernel-name", "regex:MlaDecode|splitkv",
                                         "--launch-count", "12",
                                         "--set", "full", "-o", str(out / "decode"), "-f",
                                         PY, "-m", "benchmarks.profile_decode", *args.rest), 240))
    else:  # pragma: no cover - argparse rejects it first
        raise SystemExit(f"unknown subcommand {args.cmd!r}")
    return s


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.device", description=__doc__.split("\n\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "results" / "device"),
                        help="logs, JSON, PNG and manifest.json (default: $OUT or results/device)")
    common.add_argument("--arch", default=os.environ.get("CUTE_DSL_ARCH", "sm_90a"), help="CUTE_DSL_ARCH")
    common.add_argument("--budget", type=int, default=575, help="seconds for the whole call")
    common.add_argument("--jobs", type=int, default=15, help="CPU processes compiling kernels first")
    common.add_argument("--commit", default=os.environ.get("TOKENSPEED_JAX_COMMIT", ""),
                        help="commit to record (ahead of git's HEAD)")
    common.add_argument("--dry-run", action="store_true",
                        help="print the steps and the environment, run nothing")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tests", parents=[common], help="pytest of the GPU tests (memcheck excluded)")
    t.add_argument("--files", nargs="+", default=None, help="test files (default: tests/gpu)")
    t.add_argument("-k", default=None, help="pytest -k expression (default: 'not memcheck')")
    t.add_argument("--shards", type=int, default=1,
                   help="run the tests as this many pytest processes side by side (benchmarks.pytest_shards; "
                        "no prewarm step; DIR/gpu_tests.json lists each test's outcome)")
    c = sub.add_parser("check", parents=[common], help="correctness matrices against the fp32 reference")
    c.add_argument("--op", choices=("decode", "prefill", "all"), default="all")
    c.add_argument("--cases", default="", help="decode: comma-separated CHECK case names")
    sub.add_parser("memcheck", parents=[common], help="compute-sanitizer memcheck of the decode kernels")
    b = sub.add_parser("bench", parents=[common], help="benchmarks: JSON + PNG per op")
    b.add_argument("--op", choices=("decode", "prefill", "all"), default="all")
    sub.add_parser("ab", parents=[common], help="A/B timing: python -m benchmarks.decode ARGS (after --)")
    sub.add_parser("pieces", parents=[common], help="the cost of a decode piece by kind (benchmarks.decode_diag "
                   "part 6, ARGS after --) and the piece timeline (benchmarks.piece_timeline)")
    p = sub.add_parser("profile", parents=[common], help="XLA profiler trace of the demo (+ --ncu)")
    p.add_argument("--ncu", action="store_true", help="also Nsight Compute on benchmarks.profile_decode")
    return ap


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    args = _parser().parse_args(argv)
    args.rest = rest
    return args


def _environment(args: argparse.Namespace) -> dict[str, str]:
    return {"CUTE_DSL_ARCH": args.arch,
            "TOKENSPEED_JAX_CACHE_DIR": os.environ.get("TOKENSPEED_JAX_CACHE_DIR", "/tmp/tsj_cache"),
            "PYTHONUNBUFFERED": "1"}


def _commit(given: str) -> str:
    from benchmarks.runinfo import source_commit

    return source_commit(given or None) or "unknown"


def _device() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,clocks.max.sm,memory.total,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "no nvidia-smi"


def _stamp_jsons(out: Path, since: float, commit: str) -> None:
    """Add the commit to every JSON object a step wrote under ``out`` (the benchmarks record the rest)."""
    for f in out.rglob("*.json"):
        if f.name == "manifest.json" or f.stat().st_mtime < since:
            continue
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "commit" not in data:
            f.write_text(json.dumps({"commit": commit, **data}, indent=1, default=str))


def run(args: argparse.Namespace) -> int:
    steps = steps_for(args)
    env = _environment(args)
    out = Path(args.out)
    if args.dry_run:
        print(f"# out: {out}\n# environment: " + " ".join(f"{k}={v}" for k, v in env.items()))
        for st in steps:
            print(f"[{st.name}] timeout {st.timeout}s: {st.shell()}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    commit = _commit(args.commit)
    manifest = {"commit": commit, "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                "device": _device(), "subcommand": " ".join(["device", *sys.argv[1:]]), "environment": env,
                "steps": []}
    t0 = time.monotonic()
    rc_all = 0
    for st in steps:
        left = args.budget - int(time.monotonic() - t0)
        if left < 10:
            manifest["steps"].append({"name": st.name, "command": st.shell(), "rc": None,
                                      "skipped": "budget spent"})
            print(f"[{st.name}] skipped: the budget is spent")
            rc_all = rc_all or 124
            continue
        limit = min(st.timeout, left)
        log = out / f"{st.name}.log"
        print(f"[{int(time.monotonic() - t0)}s] {st.name}: {st.shell()}", flush=True)
        start, wall = time.monotonic(), time.time()
        with open(log, "w") as fh:
            try:
                rc = subprocess.run(st.argv, cwd=ROOT, env={**os.environ, **env, **dict(st.env)}, stdout=fh,
                                    stderr=subprocess.STDOUT, timeout=limit).returncode
            except subprocess.TimeoutExpired:
                rc = 124
            except OSError as e:
                fh.write(f"could not start: {e}\n")
                rc = 127
        _stamp_jsons(out, wall, commit)
        secs = round(time.monotonic() - start, 1)
        manifest["steps"].append({"name": st.name, "command": st.shell(), "rc": rc, "seconds": secs,
                                  "timeout": limit, "log": log.name})
        tail = log.read_text(errors="replace").splitlines()[-3:]
        print(f"  rc={rc} in {secs}s; " + " | ".join(x[:160] for x in tail), flush=True)
        rc_all = rc_all or rc
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return rc_all


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse(argv))


if __name__ == "__main__":
    sys.exit(main())
