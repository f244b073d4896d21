"""Packaging and import hygiene: the pyproject package list covers the tree, and the core package and the
xla backend never import torch or cutlass."""

import os
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tree_packages() -> set[str]:
    cfg = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["setuptools"]
    dirs = {v: k for k, v in cfg["package-dir"].items()}
    found = set()
    for top in ("tokenspeed_jax", "ffi", "models"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            if "__init__.py" not in files or "__pycache__" in d:
                continue
            rel = os.path.relpath(d, ROOT)
            base = max((p for p in dirs if rel == p or rel.startswith(p + os.sep)), key=len)
            found.add(dirs[base] + rel[len(base):].replace(os.sep, "."))
    return found


def test_every_package_directory_is_listed_in_pyproject():
    cfg = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["setuptools"]
    missing = _tree_packages() - set(cfg["packages"])
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


def test_core_and_xla_backend_never_import_torch_or_cutlass():
    code = (
        "import sys, numpy as np, jax.numpy as jnp, tokenspeed_jax as tj\n"
        "q = jnp.ones((1, 1, 2, 80), jnp.bfloat16); kv = jnp.ones((2, 16, 80), jnp.bfloat16)\n"
        "bt = jnp.zeros((1, 2), jnp.int32); sl = jnp.array([5], jnp.int32)\n"
        "tj.mla_decode(q, kv, bt, sl, softmax_scale=0.1, kv_lora_rank=64, backend='xla').block_until_ready()\n"
        "tj.backends.all_backends()\n"
        "bad = [m for m in ('torch', 'cutlass', 'flash_attn', 'tokenspeed_mla') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = dict(os.environ, TOKENSPEED_JAX_TARGET="cpu")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def test_shipped_checkpoints_are_package_data():
    import fnmatch

    cfg = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["setuptools"]
    globs = cfg.get("package-data", {}).get("tokenspeed_jax.models.deepseek.checkpoints", [])
    top = os.path.join(ROOT, "models", "deepseek", "checkpoints")
    files = [
        os.path.relpath(os.path.join(d, f), top).replace(os.sep, "/")
        for d, _, fs in os.walk(top)
        if d != top and "__pycache__" not in d
        for f in fs
    ]
    assert files, "no shipped checkpoint under models/deepseek/checkpoints"
    missing = [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)]
    assert not missing, f"add to [tool.setuptools.package-data] in pyproject.toml: {missing}"
