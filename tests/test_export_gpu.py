"""JAX-facing behaviour of GPU export from a CPU host: ``backend="auto"`` never exports the reference for
CUDA silently, :func:`tokenspeed_jax.explain` takes the op's arguments, and the README recipe
(:func:`tokenspeed_jax.export_for_gpu`) produces a module with the ``tokenspeed_*`` custom calls."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import tokenspeed_jax as tj
from tokenspeed_jax.gpu_export import summarize_module_error

ROOT = Path(__file__).resolve().parents[1]


def _decode_args():
    q = jnp.zeros((2, 1, 16, 576), jnp.bfloat16)
    kv = jnp.zeros((8, 64, 576), jnp.bfloat16)
    return q, kv, jnp.zeros((2, 4), jnp.int32), jnp.full((2,), 100, jnp.int32)


def _prefill_args():
    q = jnp.zeros((10, 4, 192), jnp.bfloat16)
    v = jnp.zeros((10, 4, 128), jnp.bfloat16)
    return q, q, v, jnp.array([0, 10], jnp.int32)


def _decode(q, kv, bt, sl):
    return tj.mla_decode(q, kv, bt, sl, softmax_scale=0.1)


def _prefill(q, k, v, cu):
    return tj.mla_prefill(q, k, v, cu, cu, softmax_scale=0.1)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU-host behaviour")
@pytest.mark.parametrize("fn,args", [(_decode, _decode_args), (_prefill, _prefill_args)])
def test_auto_export_for_cuda_on_cpu_raises_with_the_fix(fn, args, monkeypatch):
    monkeypatch.delenv("TOKENSPEED_JAX_TARGET", raising=False)
    a = args()
    jax.jit(fn)(*a)  # runs on CPU (the reference), unchanged
    cpu = jax.jit(fn).trace(*a).lower(lowering_platforms=("cpu",)).as_text()
    assert "tokenspeed_unresolved" not in cpu
    with pytest.raises(ValueError, match="target_override") as e:
        jax.export.export(jax.jit(fn), platforms=("cuda",))(*a)
    assert "TOKENSPEED_JAX_TARGET" in str(e.value) and len(str(e.value)) < 2000
    # backend="xla" exports the reference on purpose
    ref = jax.export.export(jax.jit(lambda *x: tj.mla_decode(*x, softmax_scale=0.1, backend="xla")
                                    if fn is _decode else
                                    tj.mla_prefill(x[0], x[1], x[2], x[3], x[3], softmax_scale=0.1,
                                                   backend="xla")),
                            platforms=("cuda",))(*a)
    assert "custom_call @tokenspeed" not in ref.mlir_module()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU-host behaviour")
def test_auto_under_vmap_and_named_backend_error_names_the_override(monkeypatch):
    monkeypatch.delenv("TOKENSPEED_JAX_TARGET", raising=False)
    q, kv, bt, sl = _decode_args()
    out = jax.vmap(_decode, in_axes=(0, None, 0, 0))(q[None], kv, bt[None], sl[None])
    assert out.shape == (1, 2, 1, 16, 512)
    with pytest.raises(ValueError, match="target_override") as e:
        tj.mla_decode(q, kv, bt, sl, softmax_scale=0.1, backend="sm90")
    assert "TOKENSPEED_JAX_TARGET" in str(e.value)
    assert "None" not in str(e.value).split("Reasons:")[1]


def test_explain_takes_the_ops_arguments(monkeypatch):
    monkeypatch.delenv("TOKENSPEED_JAX_TARGET", raising=False)
    q, kv, bt, sl = _decode_args()
    r = tj.explain("decode", q, kv, bt, sl, softmax_scale=0.1)
    assert list(r) == [b.name for b in tj.backends.all_backends()]
    assert all(isinstance(v, str) for k, v in r.items() if k != "xla")
    assert r == tj.explain(tj.mla_decode, q, kv, bt, sl, softmax_scale=0.1)
    with tj.target_override("sm_90a"):
        r90 = tj.explain("decode", jax.ShapeDtypeStruct(q.shape, q.dtype), kv, bt, sl, softmax_scale=0.1)
    assert r90["sm90"] is None or "install" in r90["sm90"].lower() or "cutlass" in r90["sm90"].lower()
    p = tj.explain("prefill", *_prefill_args(), _prefill_args()[3], softmax_scale=0.1)
    assert p["xla"] is None and "targets cpu" in p["sm90"]
    for reason in list(r.values()) + list(p.values()):
        assert reason is None or not re.search(r"\bNone\b|cpu cpu", reason), reason
    with pytest.raises(ValueError, match="op"):
        tj.explain("attention", q)
    with pytest.raises(TypeError, match="mla_decode"):
        tj.explain("decode", q, kv, softmax_scale=0.1)
    with pytest.raises(ValueError, match="q"):
        tj.explain("decode", q[0], kv, bt, sl, softmax_scale=0.1)


def test_errors_never_print_kernel_binaries():
    blob = "\\7FELF" + "\\00\\01" * 100000
    msg = f'Cannot serialize ... stablehlo.custom_call @tokenspeed_mla_decode_sm90(%a) {{module = "{blob}", key = "{blob[:300]}"}}'
    s = summarize_module_error(msg)
    assert len(s) < 2100 and "tokenspeed_mla_decode_sm90" in s and "bytes elided" in s


# The README recipe, in a fresh process (CuTe DSL reads CUTE_DSL_ARCH once, at import).
_RECIPE = textwrap.dedent(
    """
    import json, re
    import jax, jax.numpy as jnp
    import tokenspeed_jax

    q = jnp.zeros((2, 1, 16, 576), jnp.bfloat16)          # [B, S, H, D]
    kv_cache = jnp.zeros((8, 64, 576), jnp.bfloat16)       # [num_pages, page_size, D]
    block_table = jnp.zeros((2, 4), jnp.int32)
    seq_lens = jnp.full((2,), 100, jnp.int32)

    @jax.jit
    def decode(q, kv_cache, block_table, seq_lens):
        return tokenspeed_jax.mla_decode(q, kv_cache, block_table, seq_lens, softmax_scale=576**-0.5)

    @jax.jit
    def prefill(q, k, v, cu_seqlens):
        return tokenspeed_jax.mla_prefill(q, k, v, cu_seqlens, cu_seqlens, softmax_scale=192**-0.5,
                                          max_seqlen_q=64, max_seqlen_k=64)

    exp = tokenspeed_jax.export_for_gpu(decode, q, kv_cache, block_table, seq_lens, arch="sm_90a")
    qp = jnp.zeros((64, 16, 192), jnp.bfloat16)
    vp = jnp.zeros((64, 16, 128), jnp.bfloat16)
    exp2 = tokenspeed_jax.export_for_gpu(prefill, qp, qp, vp, jnp.array([0, 64], jnp.int32), arch="sm_90a")
    names = lambda e: sorted(set(re.findall(r"custom_call @(\\w+)", e.mlir_module())))
    print("RESULT " + json.dumps({"decode": names(exp), "prefill": names(exp2),
                                  "platforms": list(exp.platforms), "bytes": len(exp.serialize())}))
    """
)


@pytest.mark.compile
def test_export_recipe_decode_and_prefill_for_cuda_on_cpu(tmp_path):
    pytest.importorskip("cutlass")
    pytest.importorskip("flash_attn")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu", TOKENSPEED_JAX_CACHE_DIR=str(tmp_path / "cache"))
    for k in ("XLA_FLAGS", "CUTE_DSL_ARCH", "TOKENSPEED_JAX_TARGET"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-c", _RECIPE], env=env, cwd=tmp_path, capture_output=True,
                       text=True, check=False, timeout=900)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(line[len("RESULT "):])
    assert "tokenspeed_mla_decode_sm90" in res["decode"], res
    assert "tokenspeed_mla_prefill_sm90" in res["prefill"], res
    assert res["platforms"] == ["cuda"] and res["bytes"] > 0
