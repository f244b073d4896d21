"""What the GPU-figure benchmarks (``deepseek_r1_h200``, ``generation``, ``mtp_speedup``) record, and how
they spend a time budget.

* :class:`Results`: the run's JSON document, rewritten (atomically: a temporary file, then ``os.replace``)
  after every measured point, so a run stopped by ``timeout`` still leaves every point it finished.  It
  holds the provenance (command, UTC date, device, jax version, commit, a hash of the source tree), the
  status (``running`` / ``complete`` / ``killed (SIGTERM)`` / ``failed: ...``), the points, the points
  skipped with the reason, notes, the compile time spent so far and the attention backends that ran.
* :class:`BackendLog`: which backend each ``mla_decode`` / ``mla_prefill`` call was traced with (a
  :func:`tokenspeed_jax.backends.add_selection_listener`: the backend the compiled program runs), with
  the reasons the registry gives for the backends not chosen, and whether FlashAttention-4 (the sm90
  prefill) is importable here.  On an H200 without FA4, ``backend="auto"`` runs the sm90 decode kernel
  and the xla prefill reference: the JSON's ``attention_backends`` says so.
* :class:`CompileClock`: seconds JAX spends tracing, lowering (the CuTe DSL kernels compile during
  lowering) and compiling (``jax.monitoring`` duration events), in total and per measured point.
* :class:`Budget`: seconds left of ``--budget-s`` counted from the process start (``/proc``), so a point
  whose estimated cost does not fit is skipped with a note instead of being cut off by the caller's
  ``timeout``.

The commit: ``--commit`` / ``$TOKENSPEED_JAX_COMMIT`` where given (the caller knows which tree it sent: a copy of
the working tree on a GPU machine may carry a ``.git`` whose HEAD is another commit, as on 2026-12-05 when a branch's
tree reported main's HEAD), else ``git rev-parse HEAD`` (``+dirty`` with uncommitted changes to tracked files) where
the checkout has ``.git``; ``tree_sha1`` (a SHA-1 over the ``.py`` / ``.sh`` files of ``tokenspeed_jax``,
``models``, ``benchmarks`` and ``scripts``) identifies the sources too: ``python -m benchmarks.runinfo
tree-hash`` at a commit gives the same value.  ``python -m benchmarks.runinfo summary FILE.json`` prints a
result file's status, skipped points, backends and rows (the driver ``scripts/gpu_figures.sh`` does after
each script).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Any


def _process_age() -> float:
    """Seconds since this process started (``/proc``; 0 where it cannot be read)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = float(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
        return age if 0 <= age < 86400 else 0.0
    except (OSError, ValueError, IndexError):
        return 0.0


T0 = time.monotonic() - _process_age()  # the process start: budgets count interpreter and jax start-up too
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TREE_DIRS = ("tokenspeed_jax", "models", "benchmarks", "scripts")
PACKAGE_DIRS = ("tokenspeed_jax", "ffi", "models")  # a package tree: what an A/B of trees carries


# ----------------------------------------------------------------------------------------- provenance
def tree_sha1(root: str = ROOT, tops: tuple[str, ...] = _TREE_DIRS) -> str:
    """SHA-1 over the relative paths and contents of the ``.py`` / ``.sh`` files under ``tops`` of ``root``."""
    h = hashlib.sha1()
    for top in tops:
        for d, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__" and not x.startswith("."))
            for f in sorted(files):
                if f.endswith((".py", ".sh")):
                    p = os.path.join(d, f)
                    h.update(os.path.relpath(p, root).encode() + b"\0")
                    with open(p, "rb") as fh:
                        h.update(fh.read())
                    h.update(b"\0")
    return h.hexdigest()


def source_commit(given: str | None = None) -> str | None:
    """``given``, else ``$TOKENSPEED_JAX_COMMIT``, else ``git rev-parse HEAD`` (+ ``+dirty``) of this checkout."""
    if given or os.environ.get("TOKENSPEED_JAX_COMMIT"):
        return given or os.environ.get("TOKENSPEED_JAX_COMMIT")
    try:

        def git(*a: str) -> str:
            return subprocess.run(
                ["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False
            ).stdout.strip()

        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no") if head else ""
    except (OSError, subprocess.SubprocessError):
        head, dirty = "", ""
    return head + ("+dirty" if dirty else "") if head else None


def package_source() -> dict:
    """Where this process's ``tokenspeed_jax`` came from: ``package_dir`` (the imported package's directory) and
    ``package_sha1`` (:func:`tree_sha1` over :data:`PACKAGE_DIRS` beside it, the code a measurement ran).
    ``tree_sha1`` hashes the checkout holding ``benchmarks`` instead, so in an A/B of package trees these two
    fields tell the trees apart, and show it when a tree was not the one imported: ``python -m``
    and ``python -c`` put the working directory first on ``sys.path``, ahead of ``PYTHONPATH``, so a tree named on
    ``PYTHONPATH`` is only imported when the command runs from a directory without a ``tokenspeed_jax``
    (``cd <tree> && PYTHONPATH=<tree>:<checkout> python -m benchmarks...``) or runs a script by path (2026-12-06:
    three "trees" timed from the checkout's root all ran the checkout's package)."""
    import tokenspeed_jax

    pkg = os.path.dirname(os.path.abspath(tokenspeed_jax.__file__))
    return {"package_dir": pkg, "package_sha1": tree_sha1(os.path.dirname(pkg), PACKAGE_DIRS)}


def provenance(commit: str | None = None) -> dict:
    """Command, UTC date, device, jax version, commit, source-tree hash and imported package
    (:func:`package_source`) of this process."""
    import jax

    d = jax.devices()[0]
    return {
        "command": " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable), *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": f"{d.platform}:{getattr(d, 'device_kind', '?')}",
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "python": sys.version.split()[0],
        "commit": source_commit(commit),
        "tree_sha1": tree_sha1(),
        **package_source(),
    }


# ------------------------------------------------------------------------------------------- backends
def fa4_importable() -> bool:
    """Whether FlashAttention-4's CuTe DSL package (``flash_attn.cute``, the sm90 prefill) is importable
    (found without importing it)."""
    try:
        return (
            importlib.util.find_spec("flash_attn") is not None
            and importlib.util.find_spec("flash_attn.cute") is not None
        )
    except (ImportError, ValueError):
        return False


_PACKAGES = ("flash-attn-4", "nvidia-cutlass-dsl", "jax", "jaxlib", "flax", "torch")
_VERSIONS: dict[str, str | None] = {}


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages the attention backends depend on (None: not installed)."""
    if not _VERSIONS:
        import importlib.metadata

        for name in _PACKAGES:
            try:
                _VERSIONS[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                _VERSIONS[name] = None
    return dict(_VERSIONS)


def _problem_dict(problem) -> dict:
    out = {}
    for f in dataclasses.fields(problem):
        v = getattr(problem, f.name)
        out[f.name] = v if isinstance(v, bool | int | float | str | type(None)) else str(v)
    return out


class BackendLog:
    """Records the backend of every tokenspeed attention op traced while installed (:meth:`install`).

    ``snapshot()`` -> ``{"decode": {"ran": [names], "traces": {name: count}, "not_chosen": {name: reason},
    "problems": [...]}, "prefill": {...}, "fa4_importable": bool}``; an op that was never traced is absent
    from ``ran`` (``[]``).  ``not_chosen`` holds the registry's reason for each backend that did not run
    the op's first traced call (e.g. sm90 prefill: "flash-attn-4 is not installed: ...")."""

    MAX_PROBLEMS = 8

    def __init__(self):
        self.ops: dict[str, dict] = {
            op: {"ran": [], "traces": {}, "not_chosen": {}, "problems": []} for op in ("decode", "prefill")
        }
        self._remove = None

    def install(self) -> BackendLog:
        from tokenspeed_jax.backends import add_selection_listener

        if self._remove is None:
            self._remove = add_selection_listener(self._on_select)
        return self

    def uninstall(self) -> None:
        if self._remove is not None:
            self._remove()
            self._remove = None

    def _on_select(self, op: str, problem, name: str) -> None:
        try:
            from tokenspeed_jax.backends import backend_reasons

            rec = self.ops.setdefault(op, {"ran": [], "traces": {}, "not_chosen": {}, "problems": []})
            if name not in rec["ran"]:
                rec["ran"].append(name)
                for other, why in backend_reasons(op, problem).items():
                    if why is not None and other != name:
                        rec["not_chosen"].setdefault(other, why)
            rec["traces"][name] = rec["traces"].get(name, 0) + 1
            p = {"backend": name, **_problem_dict(problem)}
            if len(rec["problems"]) < self.MAX_PROBLEMS and p not in rec["problems"]:
                rec["problems"].append(p)
        except Exception as e:  # noqa: BLE001  (a report must never break the traced program)
            self.ops.setdefault("errors", []).append(f"{type(e).__name__}: {e}")  # type: ignore[arg-type]

    def snapshot(self) -> dict:
        out = json.loads(json.dumps(self.ops, default=str))
        out["fa4_importable"] = fa4_importable()
        out["packages"] = package_versions()
        return out

    def line(self) -> str:
        """``decode: sm90; prefill: xla (sm90: flash-attn-4 is not installed ...)``."""
        parts = []
        for op in ("decode", "prefill"):
            rec = self.ops.get(op) or {}
            ran = ",".join(rec.get("ran") or []) or "-"
            why = "; ".join(
                f"{n}: {r.splitlines()[0][:90]}"
                for n, r in (rec.get("not_chosen") or {}).items()
                if n not in ("xla",)
            )
            parts.append(f"{op}: {ran}" + (f" (not chosen: {why})" if why else ""))
        return "; ".join(parts)


# ------------------------------------------------------------------------------------------- compile
from tokenspeed_jax.models.deepseek.compile_cache import CompileClock  # noqa: E402  (re-exported)


# -------------------------------------------------------------------------------------------- budget
class Budget:
    """``seconds`` (None: unlimited) counted from :data:`T0`."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.monotonic() - T0

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - self.elapsed()

    def allows(self, estimate_s: float) -> bool:
        return self.left() >= estimate_s


# ------------------------------------------------------------------------------------------- results
class Results:
    """The run's JSON document at ``path`` (None: kept in memory), rewritten after every change."""

    def __init__(
        self,
        path: str | None,
        name: str,
        settings: dict,
        budget: Budget,
        *,
        commit: str | None = None,
        backends: BackendLog | None = None,
        clock: CompileClock | None = None,
    ):
        self.path = path
        self.budget = budget
        self._lock = threading.RLock()
        self.backends = backends or BackendLog().install()
        self.clock = clock or CompileClock().install()
        self.doc: dict[str, Any] = {
            "name": name,
            **provenance(commit),
            "status": "running",
            "budget_s": budget.seconds,
            "settings": settings,
            "points": [],
            "skipped": [],
            "notes": [],
            "current": None,
        }
        self.flush()

    def set(self, key: str, value) -> None:
        self.doc[key] = value
        self.flush()

    def note(self, text: str) -> None:
        print(f"note: {text}", flush=True)
        self.doc["notes"].append(text)
        self.flush()

    def add(self, section: str, row: dict) -> dict:
        row = {"section": section, **row, "at_s": round(self.budget.elapsed(), 1)}
        with self._lock:
            self.doc["points"].append(row)
            self.doc["current"] = None
            self.flush()
        return row

    def skip(self, section: str, what: str, reason: str) -> None:
        print(f"skipped {section} {what}: {reason}", flush=True)
        self.doc["skipped"].append({"section": section, "what": what, "reason": reason})
        self.flush()

    def fits(self, section: str, what: str, estimate_s: float) -> bool:
        """True when ``estimate_s`` fits the budget; else record the point as skipped and return False."""
        if self.budget.allows(estimate_s):
            self.doc["current"] = {
                "section": section,
                "what": what,
                "since_s": round(self.budget.elapsed(), 1),
                "estimate_s": round(estimate_s, 1),
            }
            return True
        self.skip(
            section,
            what,
            f"budget: {self.budget.left():.0f} s left of {self.budget.seconds:.0f} s, "
            f"the point needs about {estimate_s:.0f} s",
        )
        return False

    def flush(self) -> None:
        with self._lock:
            self.doc["elapsed_s"] = round(self.budget.elapsed(), 1)
            self.doc["attention_backends"] = self.backends.snapshot()
            self.doc["compile"] = self.clock.snapshot()
            if not self.path:
                return
            d = os.path.dirname(os.path.abspath(self.path))
            os.makedirs(d, exist_ok=True)
            tmp = f"{self.path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(self.doc, f, indent=1, default=_json_default)
            os.replace(tmp, self.path)

    def heartbeat(self, period_s: float = 15.0) -> None:
        """Rewrite the JSON every ``period_s`` seconds from a daemon thread (elapsed time, compile seconds and
        the point in progress: a run cut off inside a long point still says where it was)."""

        def beat():
            while self.doc["status"] == "running":
                time.sleep(period_s)
                # (an error: the main thread changed the document meanwhile; the next beat writes it)
                with contextlib.suppress(Exception):
                    if self.doc["status"] == "running":
                        self.flush()

        threading.Thread(target=beat, daemon=True, name="results-heartbeat").start()

    def finish(self, status: str = "complete") -> None:
        with self._lock:
            self.doc["status"] = status
            if status == "complete":
                self.doc["current"] = None
            self.flush()

    def on_sigterm(self) -> None:
        """On SIGTERM (``timeout``'s signal) mark the document ``killed (SIGTERM)`` and exit 124."""

        def handler(signum, frame):
            self.finish("killed (SIGTERM)")
            print(
                f"\nkilled (SIGTERM) after {self.budget.elapsed():.0f} s; {self.path} holds the points so far",
                flush=True,
            )
            os._exit(124)

        signal.signal(signal.SIGTERM, handler)

    @contextlib.contextmanager
    def running(self):
        """``with results.running():`` -> status ``complete``, or ``failed: <error>`` (re-raised)."""
        self.on_sigterm()
        self.heartbeat()
        try:
            yield self
        except BaseException as e:
            self.finish(f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            raise
        self.finish("complete")


def parse_with_smoke(parser, smoke: dict, argv=None):
    """``parser.parse_args(argv)``; with ``--smoke``, again with ``smoke`` as the defaults (explicit arguments win)."""
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**smoke)
        args = parser.parse_args(argv)
    return args


def _json_default(o):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:
        pass
    return str(o)


# ------------------------------------------------------------------------------------------- summary
def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict | list):
        return "…"
    v = str(v)
    return v if len(v) <= 48 else v[:47] + "…"


def table(rows: list[dict], columns: list[str]) -> str:
    """A fixed-width text table of ``rows`` (missing values ``-``)."""
    cells = [[_fmt(r.get(c, "-")) if r.get(c) is not None else "-" for c in columns] for r in rows]
    widths = [max([len(c)] + [len(x[i]) for x in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def summary(doc: dict) -> str:
    """Status, provenance, backends, skipped points and a table per section of a result document."""
    head = f"{doc.get('name')}: {doc.get('status')} after {doc.get('elapsed_s')} s (budget {doc.get('budget_s')})"
    where = f"{doc.get('device')}, jax {doc.get('jax')}, commit {doc.get('commit')}, tree {str(doc.get('tree_sha1'))[:12]}"
    out = [f"{head}; {where}"]
    ab = doc.get("attention_backends") or {}
    out.append(
        "attention backends: "
        + "; ".join(
            f"{op}: {','.join((ab.get(op) or {}).get('ran') or []) or '-'}" for op in ("decode", "prefill")
        )
        + f"; fa4 importable: {ab.get('fa4_importable')}"
    )
    cur = doc.get("current")
    if cur:
        out.append(
            f"in progress at the end: {cur.get('section')} {cur.get('what')} (since {cur.get('since_s')} s, "
            f"estimated {cur.get('estimate_s')} s)"
        )
    comp = doc.get("compile") or {}
    out.append(f"compile: {comp.get('seconds')} ({comp.get('backend_compiles')} XLA compiles)")
    sections: dict[str, list[dict]] = {}
    for r in doc.get("points", []):
        sections.setdefault(r.get("section", "?"), []).append(r)
    for sec, rows in sections.items():
        cols = [k for k in rows[0] if k != "section" and not isinstance(rows[0][k], dict | list)]
        for r in rows[1:]:
            cols += [k for k in r if k not in cols and k != "section" and not isinstance(r[k], dict | list)]
        out.append(f"\n[{sec}]\n" + table(rows, cols))
    for s in doc.get("skipped", []):
        out.append(f"skipped {s['section']} {s['what']}: {s['reason']}")
    for n in doc.get("notes", []):
        out.append(f"note: {n}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["tree-hash"]:
        print(tree_sha1())
        return 0
    if argv[:1] == ["summary"] and len(argv) >= 2:
        rc = 0
        for path in argv[1:]:
            try:
                with open(path) as f:
                    print(summary(json.load(f)))
            except (OSError, ValueError) as e:
                print(f"{path}: no result ({type(e).__name__}: {e})")
                rc = 1
        return rc
    print("usage: python -m benchmarks.runinfo tree-hash | summary FILE.json [...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
