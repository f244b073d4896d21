"""The guard around the patch of cutlass.jax's private compile-cache dict (tokenspeed_jax.ffi.compile_cache):
a changed layout fails loudly with a clear message, unless the on-disk cache is switched off."""

from __future__ import annotations

import dataclasses
import types

import pytest

from tokenspeed_jax import ffi
from tokenspeed_jax.ffi import compile_cache as cc


@dataclasses.dataclass
class CompileResult:
    module: bytes
    fingerprint: bytes
    spec: object


@dataclasses.dataclass(frozen=True)
class CompileCacheKey:
    compile_key: object
    spec: object
    environment: str


def get_or_compile_kernel(fn, spec, *, compile_key=None):  # the shape of cutlass.jax 4.8's function
    cached = _CUTLASS_COMPILE_CACHE.get(compile_key)  # noqa: F821
    _CUTLASS_COMPILE_CACHE[compile_key] = cached  # noqa: F821


def _fake(**changes):
    m = types.SimpleNamespace(_CUTLASS_COMPILE_CACHE={}, CompileResult=CompileResult,
                              CompileCacheKey=CompileCacheKey, get_or_compile_kernel=get_or_compile_kernel)
    for k, v in changes.items():
        setattr(m, k, v)
    return m


@dataclasses.dataclass
class RenamedResult:
    binary: bytes
    fingerprint: bytes
    spec: object


def _other_kernel(fn, spec):
    return _CACHE.lookup(spec)  # noqa: F821


@pytest.mark.parametrize("changes,what", [
    ({"_CUTLASS_COMPILE_CACHE": None}, "expected a dict"),
    ({"CompileResult": RenamedResult}, "CompileResult has fields"),
    ({"CompileCacheKey": None}, "CompileCacheKey is missing"),
    ({"get_or_compile_kernel": _other_kernel}, "no longer reads and fills"),
])
def test_changed_layout_fails_loudly(changes, what, monkeypatch, tmp_path):
    fake = _fake(**changes)
    assert what in cc.cutlass_cache_layout_problem(fake)
    monkeypatch.setenv("TOKENSPEED_JAX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TOKENSPEED_JAX_DISK_CACHE", raising=False)
    with pytest.raises(RuntimeError, match="TOKENSPEED_JAX_DISK_CACHE=0") as e:
        ffi.install_disk_cache(fake)
    assert "cutlass.jax" in str(e.value) and what in str(e.value)
    # the documented way out: no on-disk cache, cutlass.jax's own cache left alone
    monkeypatch.setenv("TOKENSPEED_JAX_DISK_CACHE", "0")
    assert ffi.install_disk_cache(fake) is False
    kept = changes.get("_CUTLASS_COMPILE_CACHE", fake._CUTLASS_COMPILE_CACHE)
    assert getattr(fake, "_CUTLASS_COMPILE_CACHE", None) is kept


def test_expected_layout_is_patched_once_keeping_entries():
    fake = _fake(_CUTLASS_COMPILE_CACHE={"k": 1})
    assert cc.cutlass_cache_layout_problem(fake) is None
    assert ffi.install_disk_cache(fake) is True
    patched = fake._CUTLASS_COMPILE_CACHE
    assert isinstance(patched, cc._DiskBackedCompileCache) and patched["k"] == 1
    assert ffi.install_disk_cache(fake) is True and fake._CUTLASS_COMPILE_CACHE is patched


def test_installed_cutlass_jax_has_the_expected_layout():
    ccompile = pytest.importorskip("cutlass.jax.compile")
    assert cc.cutlass_cache_layout_problem(ccompile) is None
