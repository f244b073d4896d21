"""The model's jitted engine steps lower for CUDA sm_90a on this CPU machine, through the sm90 kernels
(``backend="auto"`` under ``target_override``), so the H200 run needs no code path CI has not traced.

Runs in a subprocess: ``CUTE_DSL_ARCH`` must be set before cutlass is imported."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = textwrap.dedent(
    """
    import json, re
    import jax, jax.numpy as jnp, numpy as np
    from tokenspeed_jax.runtime import target_override
    from tokenspeed_jax.models.deepseek import DeepseekV3, DeepseekV3Config, Engine
    from tokenspeed_jax.models.deepseek import engine as E
    cfg = DeepseekV3Config.preset("tiny")
    eng = Engine(DeepseekV3.random(cfg, dtype=jnp.bfloat16), page_size=64, backend="auto")
    eng.reset([40, 30])
    z = lambda n, dt=jnp.int32: jnp.zeros((n,), dt)
    res = {}
    def lower(name, fn, *a, **kw):
        with target_override("sm_90a"):
            txt = fn.trace(*a, **kw).lower(lowering_platforms=("cuda",)).as_text()
        res[name] = sorted(set(re.findall(r"custom_call @(\\w+)", txt)))
    pos = jnp.asarray(np.array([[20, 21], [10, 11]], np.int32))
    lower("decode", E._decode_step, eng.graphdef, eng.state, eng.cache, jnp.zeros((2, 2), jnp.int32), pos,
          eng.block_table, backend="auto", page_size=64)
    for name, params in (("spec", E.GREEDY), ("spec_sampling", E.SamplingParams(0.8, 20, 0.95))):
        st = E.init_slot_state(2, eng.max_pages, 16, k=2, vocab=cfg.vocab_size, params=params)
        lower(name, E._decode_loop, eng.graphdef, eng.state, eng.cache, st, z(1), jnp.int32(8), jnp.int32(1),
              backend="auto", page_size=64, k=2, params=params)
    cu = jnp.asarray(np.array([0, 10, 20], np.int32))
    lower("prefill", E._prefill_step, eng.graphdef, eng.state, eng.cache, z(32), z(32), z(32), cu, z(32),
          z(32, bool), z(32), z(2), eng.block_table, z(2), jnp.zeros((2, 2), jnp.uint32), backend="auto",
          context_capacity=32, use_mtp=True, max_seqlen=16)
    print("RESULT " + json.dumps(res))
    """
)


@pytest.mark.compile
def test_engine_steps_lower_for_sm90():
    pytest.importorskip("cutlass")
    env = dict(
        os.environ, CUTE_DSL_ARCH="sm_90a", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    env.pop("XLA_FLAGS", None)
    p = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(line[len("RESULT ") :])
    assert "tokenspeed_mla_decode_sm90" in res["decode"]
    assert "tokenspeed_mla_decode_sm90" in res["spec"]
    assert "tokenspeed_mla_decode_sm90" in res["spec_sampling"]
    assert "tokenspeed_mla_prefill_sm90" in res["prefill"]


@pytest.mark.compile
def test_r1_sharded_steps_lower_for_sm90():
    """Full DeepSeek-R1 (FP8 weights, MTP), abstract weights on an 8-device mesh with DP attention: the
    prefill, decode and MTP-decode steps lower for CUDA sm_90a through the sm90 kernels, each within 120 s
    on this CPU (layers are scanned: the program holds one dense and one MoE layer), and the plan's bytes
    per device equal the sizes of the sharded parameter and cache arrays."""
    pytest.importorskip("cutlass")
    env = dict(
        os.environ,
        CUTE_DSL_ARCH="sm_90a",
        TOKENSPEED_JAX_TARGET="sm_90a",
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    script = os.path.join(ROOT, "tests", "models", "lower_r1_sharded.py")
    p = subprocess.run(
        [sys.executable, script, "data=8"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(line[len("RESULT ") :])
    assert res["bytes_per_device"] == res["plan_bytes_per_device"]
    assert "tokenspeed_mla_prefill_sm90" in res["prefill"]["custom_calls"]
    assert "tokenspeed_mla_decode_sm90" in res["decode"]["custom_calls"]
    assert "tokenspeed_mla_decode_sm90" in res["mtp_decode"]["custom_calls"]
    for step in ("prefill", "decode", "mtp_decode"):
        assert res[step]["seconds"] < 120, res
