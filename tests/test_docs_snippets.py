"""Every ```python block of README.md and docs/*.md runs as written, on CPU (the xla backend).

The blocks of one file run in order in one namespace, as a reader would paste them.  A block whose first
line is ``# skip-test: <reason>`` is not run (it needs a GPU, a real checkpoint or a GPU toolchain; keep
those few, and test them elsewhere where possible: the README's export recipe runs in
tests/test_export_gpu.py).  The test also checks that every ``benchmarks/results/`` path the README and docs
name exists, and that ``benchmarks/results/`` holds nothing that is neither a benchmark's latest result nor
cited (scripts/prune_results.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = "# skip-test:"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path: Path) -> list[str]:
    return _BLOCK.findall(path.read_text())


def test_skip_markers_are_few_and_give_a_reason():
    skipped = [(p.name, b.splitlines()[0]) for p in doc_files() for b in python_blocks(p)
               if b.startswith(SKIP)]
    assert len(skipped) <= 4, skipped
    assert all(len(line) > len(SKIP) + 10 for _, line in skipped), skipped


def _runnable(p: Path) -> bool:
    return any(not b.startswith(SKIP) for b in python_blocks(p))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the snippets' printed backends assume a CPU")
@pytest.mark.parametrize("path", [p for p in doc_files() if _runnable(p)], ids=lambda p: p.name)
def test_python_snippets_run(path, monkeypatch):
    monkeypatch.delenv("TOKENSPEED_JAX_TARGET", raising=False)
    ns: dict = {"__name__": f"snippets_{path.stem}"}
    ran = 0
    for i, block in enumerate(python_blocks(path)):
        if block.startswith(SKIP):
            continue
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                exec(compile(block, f"{path.name}[python block {i}]", "exec"), ns)
            except Exception as e:  # noqa: BLE001 - report which block
                raise AssertionError(f"{path.name} python block {i} failed: {type(e).__name__}: {e}\n{block}")
        ran += 1
    assert ran


def test_results_links_exist_and_results_are_pruned():
    cited = set()
    for p in doc_files():  # (the dated journals in docs/notes/ cite results kept in git's history, not the tree)
        cited |= set(re.findall(r"benchmarks/results/([\w.\-]+\.(?:json|png))", p.read_text()))
    missing = sorted(n for n in cited if not (ROOT / "benchmarks" / "results" / n).is_file())
    assert not missing, f"README/docs cite result files that do not exist: {missing}"
    spec = importlib.util.spec_from_file_location("prune_results", ROOT / "scripts" / "prune_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for names in mod.LATEST.values():
        for n in names:
            assert (ROOT / "benchmarks" / "results" / n).is_file(), n
    extra = mod.to_remove()
    assert not extra, f"neither latest nor cited; run python scripts/prune_results.py --delete: {extra[:10]}"
