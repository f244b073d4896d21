"""CPU check of ``benchmarks/decode.py``'s timing path (``_bench_one``): every contender of a shape is timed
interleaved on the same inputs and lands in the report with its bytes and FLOPs (no GPU: the ``sm90``
contenders are pointed at the ``xla`` backend, FlashMLA is absent)."""

from __future__ import annotations

import numpy as np

from benchmarks import decode as bd
from benchmarks.harness import Report


def test_bench_one_times_every_contender(monkeypatch):
    real = bd.decode_fn
    monkeypatch.setattr(bd, "decode_fn", lambda c, backend, schedule=None: real(c, "xla"))
    c = bd.bench_case(64, 128, 64, 32, 1)  # B=64, H=32: the shape that also times plain XLA
    report = Report("decode bench (cpu)")
    bd._bench_one(report, None, c, with_xla=True, schedule="lockstep", rounds=3)
    rows = {r["contender"]: r for r in report.rows}
    assert list(rows) == ["ours bf16", "ours bf16 lockstep", "ours fp8", "ours fp8 lockstep", "plain XLA"]
    for r in rows.values():
        assert r["case"] == c.name and r["us"] > 0 and len(r["samples_us"]) == 3
        assert "interleaved" in r["note"]
    assert rows["ours fp8"]["bytes"] < rows["ours bf16"]["bytes"]  # FP8 rows carry the FP8 bytes
    assert np.isclose(rows["ours fp8"]["flops"], rows["ours bf16"]["flops"])
