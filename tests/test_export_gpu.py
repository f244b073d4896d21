"""JAX-facing behaviour of GPU export from a CPU host: ``backend="auto"`` never exports the reference for
CUDA silently, :func:`tokenspeed_jax.explain` takes the op's arguments, and the README recipe
(:func:`tokenspeed_jax.export_for_gpu`) produces a module with the ``tokenspeed_*`` custom calls."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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
    msg = ("Cannot serialize ... stablehlo.custom_call @tokenspeed_mla_decode_sm90(%a) "
           f'{{module = "{blob}", key = "{blob[:300]}"}}')
    s = summarize_module_error(msg)
    assert len(s) < 2100 and "tokenspeed_mla_decode_sm90" in s and "bytes elided" in s


# The README recipe, run as written in a fresh process (CuTe DSL reads CUTE_DSL_ARCH once, at import).
def _readme_recipe() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    recipe = [b for b in blocks if "export_for_gpu(" in b]
    assert len(recipe) == 1, "README.md: expected one python block with the export_for_gpu recipe"
    return recipe[0]


# The same export by hand, as docs/jax.md describes it: TOKENSPEED_JAX_TARGET instead of the helper (the
# recipe above already set CUTE_DSL_ARCH and compiled the kernel, which the cache then serves).
_BY_HAND = """
import os
from tokenspeed_jax import ffi
os.environ["TOKENSPEED_JAX_TARGET"] = "sm_90a"
exp = jax.export.export(jax.jit(decode), platforms=("cuda",), disabled_checks=ffi.export_disabled_safety_checks())(
    q, kv_cache, block_table, seq_lens)
print("BY_HAND", sorted(set(re.findall(r"custom_call @(tokenspeed_\\w+)", exp.mlir_module()))))
"""


@pytest.mark.compile
def test_export_recipe_decode_and_prefill_for_cuda_on_cpu(tmp_path):
    pytest.importorskip("cutlass")
    pytest.importorskip("flash_attn")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu", TOKENSPEED_JAX_CACHE_DIR=str(tmp_path / "cache"))
    for k in ("XLA_FLAGS", "CUTE_DSL_ARCH", "TOKENSPEED_JAX_TARGET"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-c", _readme_recipe() + _BY_HAND], env=env, cwd=tmp_path,
                       capture_output=True, text=True, check=False, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    by_hand = next(x for x in p.stdout.splitlines() if x.startswith("BY_HAND "))
    assert "tokenspeed_mla_decode_sm90" in by_hand, by_hand
    lines = [x for x in p.stdout.splitlines() if x.startswith("[")]
    assert len(lines) == 2, p.stdout[-3000:]
    assert "'tokenspeed_mla_decode_sm90'" in lines[0] and "'tokenspeed_mla_prefill_sm90'" in lines[1], lines
    assert all(int(x.rsplit(" ", 1)[1]) > 0 for x in lines), lines  # serialized bytes
