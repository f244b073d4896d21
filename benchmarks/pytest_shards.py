"""Run GPU test files as N pytest processes side by side, under one deadline.

    python -m benchmarks.pytest_shards --shards 7 --seconds 330 --out DIR [-k EXPR] tests/gpu/test_sm90_decode.py ...

A device call has at most 10 minutes, and most of a GPU test's time is host work (CuTe DSL and XLA compiles,
inputs, the fp32 reference), so one pytest process leaves the GPU idle most of the time.  This collects the node ids
(``pytest --collect-only -q``), deals them round-robin to ``--shards`` processes (``pytest -v``, each with
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` so they share the GPU's memory; they share the kernels' disk cache), and at
``--seconds`` kills what still runs.  Correctness only: nothing is timed while shards share the GPU.  Run it from
the pytest rootdir (the repository root, as ``benchmarks.device`` does): node ids are relative to it.

Writes ``DIR/shard_<i>.log`` and ``DIR/gpu_tests.json``: each node id's outcome (``PASSED``, ``FAILED``, ``ERROR``,
``SKIPPED``, ...), the counts, the node ids not reached before the deadline, the failures whose log reports a CUDA /
XLA out-of-memory (the shards' sum overfilling the GPU, not the kernels) and the skip reasons with their counts.
Exit status 0 only when every collected test ran and none failed or errored. On 2026-12-05 (H100), 7 shards ran 42
decode tests in 330 s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

OUTCOME = re.compile(r"(\S+::\S+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
SUMMARY = re.compile(r"^(FAILED|ERROR) (\S+::\S+)")
SKIP_REASON = re.compile(r"^SKIPPED \[(\d+)\] \S+?:\d+: (.*)$")
SECTION = re.compile(r"^_{3,} (\S+) _{3,}$")  # a failure's section in the log: "____ test_x[p] ____"
BANNER = re.compile(r"^=+ .* =+$")  # "==== short test summary info ====" and the like
OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "CUDA_ERROR_OUT_OF_MEMORY", "out of memory")


def collect(files: list[str], k: str | None) -> list[str]:
    """The node ids pytest selects from ``files`` (and ``-k``)."""
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
    if k:
        argv += ["-k", k]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300).stdout
    return [line.strip() for line in out.splitlines() if "::" in line and not line.startswith(" ")]


def deal(ids: list[str], shards: int) -> list[list[str]]:
    """Round-robin: neighbouring (similar, similarly slow) parametrisations go to different shards."""
    return [ids[i::shards] for i in range(shards) if ids[i::shards]]


def outcomes(text: str) -> dict[str, str]:
    """Node id -> outcome from a ``pytest -v`` log (the short summary's FAILED / ERROR lines win)."""
    res: dict[str, str] = {}
    for line in text.splitlines():
        m = SUMMARY.match(line)
        if m:
            res[m.group(2)] = m.group(1)
            continue
        m = OUTCOME.search(line)
        if m and res.get(m.group(1)) not in ("FAILED", "ERROR"):
            res[m.group(1)] = m.group(2)
    return res


def skip_reasons(text: str) -> dict[str, int]:
    """Reason -> number of tests, from a ``pytest -rs`` log's short summary (an optional package the GPU tests need
    shows here: a whole file skipped is not a pass)."""
    res: dict[str, int] = {}
    for line in text.splitlines():
        m = SKIP_REASON.match(line)
        if m:
            res[m.group(2)] = res.get(m.group(2), 0) + int(m.group(1))
    return res


def out_of_memory(text: str) -> set[str]:
    """The tests (``name[params]``, as their failure sections title them) whose failure in a ``pytest -v`` log reports
    a CUDA / XLA out-of-memory: shards that together overfill the GPU fail tests the kernels do not."""
    names: set[str] = set()
    cur, buf = None, []
    for line in [*text.splitlines(), "=== end ==="]:
        m = SECTION.match(line)
        if m or BANNER.match(line):
            if cur and any(k in "\n".join(buf) for k in OUT_OF_MEMORY):
                names.add(cur)
            cur, buf = (m.group(1) if m else None), []
        elif cur:
            buf.append(line)
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("-k", default=None)
    ap.add_argument("--shards", type=int, default=7)
    ap.add_argument("--seconds", type=int, default=330, help="deadline for the whole run (collection included)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.shards < 1:
        ap.error(f"--shards: expected a positive number, got {a.shards}")
    t0 = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ids = collect(a.files, a.k)
    groups = deal(ids, a.shards)
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    procs = []
    for i, g in enumerate(groups):
        log = open(out / f"shard_{i}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", *g],
                                       stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True), log))
    killed = False
    while any(p.poll() is None for p, _ in procs):
        if time.monotonic() - t0 > a.seconds:
            for p, _ in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)  # the shard and anything it started
                    killed = True
            break
        time.sleep(1)
    res: dict[str, str] = {}
    skips: dict[str, int] = {}
    oom: set[str] = set()
    for i, (p, log) in enumerate(procs):
        p.wait()
        log.close()
        text = (out / f"shard_{i}.log").read_text(errors="replace")
        res.update(outcomes(text))
        for r, n in skip_reasons(text).items():
            skips[r] = skips.get(r, 0) + n
        oom |= out_of_memory(text)
    counts: dict[str, int] = {}
    for v in res.values():
        counts[v] = counts.get(v, 0) + 1
    missing = [n for n in ids if n not in res]
    doc = {"files": a.files, "k": a.k, "shards": len(groups), "seconds": round(time.monotonic() - t0, 1),
           "killed_at_deadline": killed, "collected": len(ids), "counts": counts, "not_reached": missing,
           "failed_out_of_memory": [n for n, v in res.items()
                                    if v in ("FAILED", "ERROR") and n.split("::")[-1] in oom],
           "skip_reasons": skips, "results": res}
    (out / "gpu_tests.json").write_text(json.dumps(doc, indent=1))
    print(f"{len(ids)} collected, {counts}, {len(missing)} not reached"
          + (f" (killed at {a.seconds} s)" if killed else ""))
    for n, v in res.items():
        if v in ("FAILED", "ERROR"):
            print(v, n, "(out of memory)" if n in doc["failed_out_of_memory"] else "")
    for r, n in skips.items():
        print(f"SKIPPED {n}: {r}")
    return 0 if not missing and not any(v in ("FAILED", "ERROR") for v in res.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
