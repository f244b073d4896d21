"""The trace reader (tokenspeed_jax.profiling) reads events as XProf does: names from events and their
string stats, never from the HLO metadata plane or raw bytes."""

from __future__ import annotations

import gzip
import json

import jax
import jax.numpy as jnp

import tokenspeed_jax as tj
from tokenspeed_jax.profiling import trace_names


def test_cpu_trace_has_no_tokenspeed_events_although_the_bytes_mention_them(tmp_path):
    q = jnp.ones((2, 1, 4, 576), jnp.float32)
    kv = jnp.ones((8, 16, 576), jnp.float32)
    bt = jnp.zeros((2, 4), jnp.int32)
    sl = jnp.full((2,), 30, jnp.int32)
    f = jax.jit(lambda *a: tj.mla_decode(*a, softmax_scale=0.1))
    f(q, kv, bt, sl).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        f(q, kv, bt, sl).block_until_ready()
    found = trace_names(str(tmp_path))
    assert set(found) == {"tokenspeed_mla_decode", "tokenspeed_mla_prefill"}
    if jax.default_backend() == "cpu":
        assert found["tokenspeed_mla_decode"] == {}
        raw = b"".join(p.read_bytes() for p in tmp_path.rglob("*.xplane.pb"))
        assert b"tokenspeed_mla_decode" in raw  # the HLO metadata: what a byte search wrongly reported


def test_trace_json_events_and_stats(tmp_path):
    events = [
        {"ph": "X", "pid": 1, "name": "tokenspeed_mla_decode_sm90", "args": {}},
        {"ph": "X", "pid": 1, "name": "fusion.3", "args": {"tf_op": "jit(f)/tokenspeed_mla_prefill/x"}},
        {"ph": "M", "pid": 1, "name": "tokenspeed_mla_prefill"},  # metadata record: not an event
    ]
    with gzip.open(tmp_path / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    found = trace_names(str(tmp_path))
    assert found == {"tokenspeed_mla_decode": {"1": 1}, "tokenspeed_mla_prefill": {"1": 1}}
