"""The sm90 prefill backend on a CPU machine: ``supports`` reasons, and compiling FA4's Hopper forward for
sm_90a through our kernel subclass and the FFI layer (subprocess with ``CUTE_DSL_ARCH=sm_90a``), lowering
a jitted ``mla_prefill(backend="sm90")`` for CUDA and finding the named custom call."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tokenspeed_jax.backends import sm90_prefill
from tokenspeed_jax.problems import PrefillProblem, Target

ROOT = Path(__file__).resolve().parents[1]


def _problem(**kw) -> PrefillProblem:
    base = {
        "batch": 2,
        "num_q_tokens": 300,
        "num_k_tokens": 400,
        "num_q_heads": 16,
        "num_kv_heads": 16,
        "head_dim_qk": 192,
        "head_dim_v": 128,
        "dtype": "bfloat16",
        "causal": True,
        "return_lse": True,
        "max_seqlen_q": None,
        "max_seqlen_k": None,
        "target": Target("cuda", "sm_90a", 132),
    }
    base.update(kw)
    return PrefillProblem(**base)


def test_supports_reasons(monkeypatch):
    assert "sm_90a" in sm90_prefill.supports(_problem(target=Target("cpu")))
    assert "sm_90a" in sm90_prefill.supports(_problem(target=Target("cuda", "sm_100a", 148)))
    assert "float32" in sm90_prefill.supports(_problem(dtype="float32"))
    assert "(576, 512)" in sm90_prefill.supports(_problem(head_dim_qk=576, head_dim_v=512))
    monkeypatch.setattr(sm90_prefill, "_missing_packages", lambda: "flash-attn-4")
    reason = sm90_prefill.supports(_problem())
    assert "flash-attn-4" in reason and "pip install 'tokenspeed-jax[hopper]'" in reason


def test_auto_falls_back_to_xla_on_cpu():
    import jax.numpy as jnp

    import tokenspeed_jax as tj

    q = jnp.ones((4, 2, 192), jnp.bfloat16)
    k = jnp.ones((4, 2, 192), jnp.bfloat16)
    v = jnp.ones((4, 2, 128), jnp.bfloat16)
    cu = jnp.array([0, 4], jnp.int32)
    out = tj.mla_prefill(q, k, v, cu, cu, softmax_scale=0.1)
    assert out.shape == (4, 2, 128)


_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import jax, jax.numpy as jnp
    from tokenspeed_jax import ffi, mla_prefill
    from tokenspeed_jax.runtime import target_override

    CONFIGS = [  # dtype, Dqk, Dv, Hq, Hk, causal, return_lse
        ("bfloat16", 192, 128, 16, 16, True, True),
        ("float8_e4m3fn", 192, 128, 32, 8, False, False),
        ("float16", 128, 128, 8, 2, True, True),
    ]
    res = []
    for dtype, dqk, dv, hq, hk, causal, lse in CONFIGS:
        q = jnp.zeros((300, hq, dqk), dtype)
        k = jnp.zeros((400, hk, dqk), dtype)
        v = jnp.zeros((400, hk, dv), dtype)
        cq = jnp.array([0, 100, 100, 300], jnp.int32)
        ck = jnp.array([0, 150, 150, 400], jnp.int32)
        f = lambda q, k, v, cq, ck, s: mla_prefill(q, k, v, cq, ck, softmax_scale=s, causal=causal,
                                                    return_lse=lse, backend="sm90")
        t = time.time()
        with target_override("sm_90a"):
            txt = jax.jit(f).trace(q, k, v, cq, ck, jnp.float32(0.1)).lower(lowering_platforms=("cuda",)).as_text()
        line = [l for l in txt.splitlines() if "stablehlo.custom_call @tokenspeed_mla_prefill_sm90(" in l]
        res.append({"cfg": [dtype, dqk, dv, hq, hk, causal, lse], "found": len(line), "s": time.time() - t,
                    "results": (2 if ":2 = stablehlo.custom_call" in line[0] else 1) if line else 0})
    # a second token count / batch size reuses the first configuration's object (dynamic extents)
    q = jnp.zeros((1000, 16, 192), jnp.bfloat16); k = jnp.zeros((50, 16, 192), jnp.bfloat16)
    v = jnp.zeros((50, 16, 128), jnp.bfloat16); cq = jnp.array([0, 1000], jnp.int32); ck = jnp.array([0, 50], jnp.int32)
    f = lambda q, k, v, cq, ck, s: mla_prefill(q, k, v, cq, ck, softmax_scale=s, return_lse=True, backend="sm90")
    with target_override("sm_90a"):
        jax.jit(f).trace(q, k, v, cq, ck, jnp.float32(0.1)).lower(lowering_platforms=("cuda",))
    # rows without keys: FA4's epilogue unchanged plus our rows_without_keys kernel in the same custom call,
    # cu_seqlens as given (no padding request)
    f = lambda q, k, v, cq, ck, s: mla_prefill(q, k, v, cq, ck, softmax_scale=s, return_lse=True, backend="sm90")
    with target_override("sm_90a"):  # (a new function: jax.jit caches the previous one's trace)
        txt = jax.jit(f).trace(q, k, v, cq, ck, jnp.float32(0.1)).lower(lowering_platforms=("cuda",)).as_text()
    mode = {"calls": txt.count("stablehlo.custom_call @tokenspeed_mla_prefill_sm90("),
            "padding_request": "stablehlo.concatenate" in txt}
    print(json.dumps({"configs": res, "stats": ffi.cache_stats(), "mode": mode}))
    """
)


@pytest.mark.compile
@pytest.mark.skipif(
    sm90_prefill._missing_packages() is not None, reason="flash-attn-4 / CuTe DSL not installed"
)
def test_compile_and_lower_for_sm90(tmp_path):
    script = tmp_path / "compile_sm90_prefill.py"
    script.write_text(_SCRIPT)
    env = dict(
        os.environ, CUTE_DSL_ARCH="sm_90a", JAX_PLATFORMS="cpu", TOKENSPEED_JAX_CACHE_DIR=str(tmp_path / "c")
    )
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("XLA_FLAGS", None)
    p = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert p.returncode == 0, p.stderr[-6000:]
    dsl_warnings = [line for line in p.stderr.splitlines() if "warn" in line.lower()]
    assert not dsl_warnings, "\n".join(dsl_warnings[:20])
    doc = json.loads(p.stdout.strip().splitlines()[-1])
    for c in doc["configs"]:
        assert c["found"] == 1, c
    # out + lse results for return_lse, out only otherwise
    assert [c["results"] for c in doc["configs"]] == [2, 1, 2]
    # 3 configurations (the second shape, and the rows-without-keys check, reuse the first one's object)
    assert doc["stats"]["disk_writes"] == 3 and doc["stats"]["misses"] == 3, doc["stats"]
    assert doc["stats"]["shape_reuses"] >= 1, doc["stats"]
    assert doc["mode"] == {"calls": 1, "padding_request": False}, doc["mode"]


def test_kernel_config_is_a_stable_key():
    from tokenspeed_jax import ffi

    cfg = sm90_prefill.PrefillKernelConfig("fa4_sm90", "bfloat16", 192, 128, 16, 16, True, True)
    key = ffi.CompileKey("tokenspeed_mla_prefill_sm90", cfg, "sm_90a", (), "m.f", "x", True)
    assert key.stable_text() is not None
    assert dataclasses.replace(cfg, causal=False) != cfg
