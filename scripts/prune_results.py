"""Keep ``benchmarks/results/`` to the latest JSON + PNG of each benchmark; git keeps the history.

    python scripts/prune_results.py            # list what would go
    python scripts/prune_results.py --delete   # git rm it

A result file stays when it is the current result of a benchmark (:data:`LATEST`; a new run of
``python -m benchmarks.device bench`` adds its files and updates that table) or when a tracked document or
source file names it, with or without its extension (``name.json``, ``name.{json,png}``, ``name.*``: the
docs cite the measurement behind a decision); every other file is removed.  After a document stops citing
a dated result, run this again.  ``tests/test_docs_snippets.py`` checks that every results path the
README and docs/ name exists and that no file here is neither latest nor cited.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# benchmark -> its current result files (each JSON records commit, command, date and device)
LATEST = {
    "mla_decode sm90 (benchmarks/decode.py --bench)": (
        "decode_sm90_own_bench_20261203.json", "decode_sm90_own_bench_20261203.png",
        "decode_sm90_own_bench_sustained_20261203.json", "decode_sm90_own_bench_sustained_20261203.png"),
    "mla_decode sm90, varied lengths (benchmarks/decode_varlen.py)": (
        "decode_sm90_varlen_h200.json", "decode_sm90_varlen_h200.png"),
    "mla_prefill sm90 (benchmarks/prefill.py)": ("prefill_sm90.json", "prefill_sm90.png"),
    "DeepSeek model CLI (python -m tokenspeed_jax.models.deepseek --json)": ("deepseek_small_h200.json",),
}


def _tracked_text() -> str:
    files = subprocess.run(["git", "ls-files", "*.md", "*.py", "*.sh", "*.toml"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    # (dated journals in docs/notes/ cite results by name as history: those files stay in git's history, at the
    # tag sm90-decode-experiments for the decode ones, not in the tree)
    return "\n".join((ROOT / f).read_text(errors="replace") for f in files
                     if not f.startswith(("benchmarks/results/", "docs/notes/")) and (ROOT / f).is_file())


def _cited(stem: str, text: str) -> bool:
    """``stem`` (a file name without its extension) named as a whole word in ``text``."""
    return re.search(rf"(?<![\w]){re.escape(stem)}(?![\w])", text) is not None


def to_remove() -> list[Path]:
    """Result files that are neither the latest of a benchmark nor cited by a tracked file."""
    keep = {n for names in LATEST.values() for n in names}
    text = _tracked_text()
    return sorted(p for p in RESULTS.iterdir()
                  if p.is_file() and p.name not in keep and not _cited(p.name.rsplit(".", 1)[0], text))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--delete", action="store_true", help="git rm the files (default: list them)")
    args = ap.parse_args(argv)
    files = to_remove()
    for p in files:
        print(p.relative_to(ROOT))
    if args.delete and files:
        subprocess.run(["git", "rm", "-q", *map(str, files)], cwd=ROOT, check=True)
    left = sum(1 for p in RESULTS.iterdir() if p.is_file()) - (0 if args.delete else len(files))
    print(f"{len(files)} file(s) {'removed' if args.delete else 'to remove'}; {left} remain", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
