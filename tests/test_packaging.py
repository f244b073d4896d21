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


def _pyproject() -> dict:
    return tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))


def test_single_source_version_license_and_typing_marker():
    import ast

    cfg = _pyproject()
    assert "version" not in cfg["project"] and "version" in cfg["project"]["dynamic"]
    attr = cfg["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "tokenspeed_jax._version.__version__"
    tree = ast.parse(open(os.path.join(ROOT, "tokenspeed_jax", "_version.py")).read())
    value = next(n.value.value for n in tree.body if isinstance(n, ast.Assign))
    import tokenspeed_jax

    assert tokenspeed_jax.__version__ == value
    assert "MIT License" in open(os.path.join(ROOT, "LICENSE")).read() and cfg["project"]["license"] == "MIT"
    assert os.path.isfile(os.path.join(ROOT, "tokenspeed_jax", "py.typed"))
    assert "py.typed" in cfg["tool"]["setuptools"]["package-data"]["tokenspeed_jax"]
    assert os.path.isfile(os.path.join(ROOT, "CHANGELOG.md"))


def _third_party_imports() -> set[str]:
    import ast

    mods = set()
    for top in ("tokenspeed_jax", "ffi", "models"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    for n in ast.walk(ast.parse(open(os.path.join(d, f)).read())):
                        if isinstance(n, ast.Import):
                            mods.update(a.name.split(".")[0] for a in n.names)
                        elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
                            mods.add(n.module.split(".")[0])
    return mods - set(sys.stdlib_module_names) - {"tokenspeed_jax"}


def test_base_dependencies_are_what_the_package_imports():
    import re

    cfg = _pyproject()["project"]
    base = {re.split(r"[<>=!~; \[]", d)[0].lower().replace("-", "_") for d in cfg["dependencies"]}
    # Imported only inside functions of the optional backends (extras) or guarded by ImportError.
    # (optax: models/deepseek/train.py, the shipped checkpoint's training recipe, needs the ``train`` extra)
    optional = {"cutlass", "flash_attn", "quack", "tokenspeed_mla", "torch", "tqdm", "cuda", "optax"}
    imported = _third_party_imports()
    assert imported - optional <= base | {"jaxlib"}, sorted(imported - optional - base)
    assert base - {"jaxlib"} <= imported, sorted(base - imported)
    extras = {re.split(r"[<>=!~; \[]", d)[0] for e in ("cute", "hopper", "sm100")
              for d in cfg["optional-dependencies"][e]}
    assert {"nvidia-cutlass-dsl", "flash-attn-4", "tokenspeed-mla"} <= extras


def test_checkout_maps_only_ffi_and_models():
    code = (
        "import importlib, tokenspeed_jax, tokenspeed_jax.ffi as f, tokenspeed_jax.models.deepseek as m\n"
        "import os; root = os.path.dirname(os.path.dirname(tokenspeed_jax.__file__))\n"
        "assert f.__file__.startswith(root) and m.__file__.startswith(root), (f.__file__, m.__file__)\n"
        "for name in ('tokenspeed_jax.tests', 'tokenspeed_jax.benchmarks', 'tokenspeed_jax.scripts'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError:\n"
        "        continue\n"
        "    raise AssertionError(name + ' is importable')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
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
