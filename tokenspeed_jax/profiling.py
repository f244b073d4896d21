"""Find the tokenspeed ops in a JAX profiler trace the way XProf's trace viewer sees them.

``jax.profiler.trace(dir)`` writes an XSpace protobuf (``*.xplane.pb``): planes (``/host:CPU``,
``/device:GPU:0``, ...) of lines of timed events, each event with a name and stats (``hlo_op``, ``tf_op``,
``long_name``, ...).  XProf's trace viewer shows exactly these events; the ``/host:metadata`` plane only
carries the compiled HLO modules, which mention every op name but show nothing in the viewer.
:func:`trace_names` parses the XSpace with :class:`jax.profiler.ProfileData` and counts the events whose
name or string stats contain each name; it never searches raw bytes (which would report the names stored
in the HLO metadata even when no event shows them).

What shows where
    On a GPU, the custom calls appear as device events: the ``tokenspeed_mla_decode_sm90`` /
    ``tokenspeed_mla_prefill_sm90`` (``..._sm100``) custom calls with the ops' named scopes
    (``tokenspeed_mla_decode`` / ``tokenspeed_mla_prefill``) in their ``tf_op`` stat, and the CUDA
    kernels under their CuTe DSL names.  On a CPU the ops run as the pure-JAX reference: XLA fuses it
    into ``fusion`` thunks, whose events carry HLO names only, so no tokenspeed name is expected there.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from collections.abc import Iterable

__all__ = ["TOKENSPEED_NAMES", "trace_names"]

TOKENSPEED_NAMES = ("tokenspeed_mla_decode", "tokenspeed_mla_prefill")
_SKIP_PLANES = ("/host:metadata",)


def _files(directory: str, suffixes: tuple[str, ...]) -> list[str]:
    return sorted(f for f in glob.glob(os.path.join(directory, "**", "*"), recursive=True)
                  if os.path.isfile(f) and f.endswith(suffixes))


def _xspace_events(path: str) -> Iterable[tuple[str, str, list[str]]]:
    """``(plane, event name, string stat values)`` of every event of one ``*.xplane.pb``."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    for plane in data.planes:
        if plane.name in _SKIP_PLANES:
            continue
        for line in plane.lines:
            for ev in line.events:
                yield plane.name, ev.name, [v for _, v in ev.stats if isinstance(v, str)]


def _trace_json_events(path: str) -> Iterable[tuple[str, str, list[str]]]:
    """The same from a Chrome trace (``*.trace.json.gz``), as XProf's legacy trace viewer reads it."""
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        data = json.load(f)
    for ev in data.get("traceEvents", []) if isinstance(data, dict) else data:
        if ev.get("ph") not in ("X", "B", "E", "i", "I"):
            continue
        args = ev.get("args") or {}
        stats = [v for v in args.values() if isinstance(v, str)]
        yield str(ev.get("pid", "")), str(ev.get("name", "")), stats


def trace_names(directory: str, names: Iterable[str] = TOKENSPEED_NAMES) -> dict[str, dict[str, int]]:
    """``{name: {plane: number of events showing name}}`` for a profiler output directory.

    Reads every ``*.xplane.pb`` under ``directory`` (or, when there is none, ``*.trace.json[.gz]``).
    An event shows a name when its own name or one of its string stats (``hlo_op``, ``tf_op``,
    ``long_name``, ...) contains it.  A name absent from every event maps to ``{}``.
    """
    names = tuple(names)
    found: dict[str, dict[str, int]] = {n: {} for n in names}
    files = _files(directory, (".xplane.pb",))
    events = _xspace_events if files else _trace_json_events
    for path in files or _files(directory, (".trace.json.gz", ".trace.json")):
        for plane, name, stats in events(path):
            for n in names:
                if n in name or any(n in s for s in stats):
                    found[n][plane] = found[n].get(plane, 0) + 1
    return found
