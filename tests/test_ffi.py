"""CPU tests of the FFI layer (tokenspeed_jax.ffi): names, validation, lowering for CUDA, caches, export.

Lowering for CUDA compiles a real (tiny) CuTe DSL kernel for sm_90a, which needs ``CUTE_DSL_ARCH`` set
before CuTe DSL is imported, so those checks run in fresh subprocesses (``compile`` marker).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from tokenspeed_jax import ffi

ROOT = Path(__file__).resolve().parents[1]
needs_cute = pytest.mark.skipif(
    not ffi.is_available(), reason="nvidia-cutlass-dsl (cutlass.jax) not installed"
)

# A real kernel: out[i] = x[i] * scale, with scale a runtime operand read on the device.
_KERNEL = textwrap.dedent(
    """
    import dataclasses, json, os, sys
    import jax, jax.numpy as jnp
    import cutlass, cutlass.cute as cute
    from tokenspeed_jax import ffi
    from tokenspeed_jax.ffi.device import load_scalar
    from tokenspeed_jax.runtime import target_override

    @cute.kernel
    def scale_kernel(x: cute.Tensor, s: cute.Tensor, out: cute.Tensor, ws: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * 128 + tidx
        if i < x.shape[0]:
            out[i] = x[i] * load_scalar(s)
            ws[i] = x[i]

    @cute.jit
    def launch(stream, x: cute.Tensor, s: cute.Tensor, out: cute.Tensor, ws: cute.Tensor,
               block: cutlass.Constexpr = 128):
        scale_kernel(x, s, out, ws).launch(grid=((x.shape[0] + block - 1) // block, 1, 1),
                                           block=(block, 1, 1), stream=stream)

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        variant: int

    def make(graph=True, variant=0):
        def f(x, s):
            out, ws = ffi.custom_call(
                "ffi_selftest", launch, compile_key=Cfg(variant), allow_cuda_graph=graph, block=128,
                outputs=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype)])(x, s)
            return out
        return f

    def make_dynamic():
        from cutlass.jax import TensorSpec

        sp = TensorSpec(divisibility=(1,))

        def f(x, s):
            out, ws = ffi.custom_call(
                "ffi_selftest_dyn", launch, compile_key=Cfg(7), dynamic_shapes=True, block=128,
                input_specs=(sp, sp), output_specs=(sp, sp),
                outputs=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype)])(x, s)
            return out
        return f

    def lower(f, *args, arch="sm_90a"):
        with target_override(arch):
            return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    x = jnp.zeros((300,), jnp.float32)
    s = ffi.scalar_operand(0.5)
    """
)


def _run(body: str, env: dict[str, str | None], workdir: Path) -> dict:
    """Run the kernel prelude + ``body`` in a fresh Python (CuTe DSL needs the source in a file)."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("XLA_FLAGS", None)
    e["JAX_PLATFORMS"] = "cpu"
    for k, v in env.items():
        if v is None:
            e.pop(k, None)
        else:
            e[k] = v
    code = _KERNEL + textwrap.dedent(body)
    script = workdir / "ffi_selftest_script.py"
    script.write_text(code)
    p = subprocess.run(
        [sys.executable, str(script)], check=False, env=e, capture_output=True, text=True, timeout=300
    )
    if p.returncode != 0:
        raise AssertionError(f"subprocess failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    assert "warning" not in p.stderr.lower(), p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------- pure CPU
def test_target_names():
    assert ffi.target_name("mla_decode_sm90") == "tokenspeed_mla_decode_sm90"
    assert ffi.target_name("mla_decode_sm90", allow_cuda_graph=False) == "tokenspeed_mla_decode_sm90_nograph"
    for bad in ("", "MLA", "a-b", "tokenspeed_x", "x y", "_x"):
        with pytest.raises(ValueError, match="target"):
            ffi.target_name(bad)
    with pytest.raises(TypeError, match="target"):
        ffi.target_name(3)


def test_scalar_operand():
    s = ffi.scalar_operand(2)
    assert s.shape == (1,) and s.dtype == jnp.float32 and float(s[0]) == 2.0
    assert ffi.scalar_operand(jnp.ones((1, 1), jnp.bfloat16)).shape == (1,)
    with pytest.raises(ValueError, match="one element"):
        ffi.scalar_operand(jnp.ones((2,)))


@dataclasses.dataclass(frozen=True)
class _Cfg:
    a: int


def _dummy_launch(*args, **kwargs):  # never traced by these tests
    raise AssertionError("not reached")


@needs_cute
def test_argument_errors():
    out = [jax.ShapeDtypeStruct((4,), jnp.float32)]
    with pytest.raises(TypeError, match="compile_key"):
        ffi.custom_call("t", _dummy_launch, outputs=out, compile_key=None)
    with pytest.raises(TypeError, match="compile_key"):
        ffi.custom_call("t", _dummy_launch, outputs=out, compile_key=[1, 2])
    with pytest.raises(TypeError, match="outputs"):
        ffi.custom_call("t", _dummy_launch, outputs=out[0], compile_key=_Cfg(1))
    with pytest.raises(TypeError, match=r"outputs\[0\]"):
        ffi.custom_call("t", _dummy_launch, outputs=[(4,)], compile_key=_Cfg(1))
    with pytest.raises(ValueError, match=r"outputs\[0\]"):
        ffi.custom_call(
            "t", _dummy_launch, outputs=[jax.ShapeDtypeStruct((), jnp.float32)], compile_key=_Cfg(1)
        )
    with pytest.raises(TypeError, match="scale.*operand"):
        ffi.custom_call("t", _dummy_launch, outputs=out, compile_key=_Cfg(1), scale=jnp.ones((1,)))
    with pytest.raises(TypeError, match="lst"):
        ffi.custom_call("t", _dummy_launch, outputs=out, compile_key=_Cfg(1), lst=[1])
    with pytest.raises(TypeError, match="launch"):
        ffi.custom_call("t", 3, outputs=out, compile_key=_Cfg(1))
    call = ffi.custom_call("t", _dummy_launch, outputs=out, compile_key=_Cfg(1))
    with pytest.raises(ValueError, match="0-d"):
        call(jnp.float32(1.0))


@needs_cute
def test_dynamic_shapes_needs_explicit_specs():
    out = [jax.ShapeDtypeStruct((4,), jnp.float32)]
    with pytest.raises(ValueError, match="dynamic_shapes"):
        ffi.custom_call("t", _dummy_launch, outputs=out, compile_key=_Cfg(1), dynamic_shapes=True)


@needs_cute
def test_vmap_rejected_with_target_name():
    call = ffi.custom_call(
        "vmap_probe", _dummy_launch, outputs=[jax.ShapeDtypeStruct((4,), jnp.float32)], compile_key=_Cfg(1)
    )
    with pytest.raises(NotImplementedError, match="tokenspeed_vmap_probe.*vmap"):
        jax.vmap(lambda x: call(x)[0])(jnp.ones((3, 4)))


def test_compile_key_stability_and_cache_dir(monkeypatch, tmp_path):
    k = ffi.CompileKey("tokenspeed_x", _Cfg(1), "sm_90a", (("jax", "1"),), "m.f", "abc")
    assert (
        k.stable_text()
        == ffi.CompileKey("tokenspeed_x", _Cfg(1), "sm_90a", (("jax", "1"),), "m.f", "abc").stable_text()
    )
    assert (
        k.stable_text()
        != ffi.CompileKey("tokenspeed_x", _Cfg(2), "sm_90a", (("jax", "1"),), "m.f", "abc").stable_text()
    )
    assert ffi.CompileKey("tokenspeed_x", object(), "sm_90a", (), "m.f", "abc").stable_text() is None
    monkeypatch.setenv("TOKENSPEED_JAX_CACHE_DIR", str(tmp_path))
    assert ffi.cache_dir() == tmp_path
    monkeypatch.setenv("TOKENSPEED_JAX_DISK_CACHE", "0")
    assert ffi.cache_dir() is None


def test_launch_ref_names_without_importing(monkeypatch, tmp_path):
    """A LaunchRef locates its module's source without importing it; calling it imports and forwards."""
    (tmp_path / "ffi_ref_probe.py").write_text("CALLS = []\ndef launch(*a, **k):\n    CALLS.append((a, k))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ffi_ref_probe", raising=False)
    ref = ffi.LaunchRef("ffi_ref_probe", "launch")
    same = ffi.LaunchRef("ffi_ref_probe", "launch")
    assert ref == same and hash(ref) == hash(same)
    assert ref.launch_id == "ffi_ref_probe.launch"
    assert Path(ref.source_file()) == tmp_path / "ffi_ref_probe.py"
    assert "ffi_ref_probe" not in sys.modules
    ref(1, block=2)
    assert sys.modules["ffi_ref_probe"].CALLS == [((1,), {"block": 2})]
    assert ref.resolve() is sys.modules["ffi_ref_probe"].launch
    assert ffi.LaunchRef("ffi_ref_probe_missing", "launch").source_file() is None


@needs_cute
def test_launch_ref_keys_like_the_function(monkeypatch, tmp_path):
    """custom_call with a LaunchRef hands cutlass.jax the compile key of the function itself (so both hit the
    same in-memory and on-disk entries), and tracing the call does not import the function's module."""
    import cutlass.jax as cjax

    (tmp_path / "ffi_key_probe.py").write_text("def launch(*a, **k):\n    raise AssertionError('compiled')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ffi_key_probe", raising=False)
    seen = []

    def fake_cutlass_call(fn, *, output_shape_dtype, compile_key, **kw):
        seen.append((fn, compile_key))
        return lambda *args: [jnp.zeros(o.shape, o.dtype) for o in output_shape_dtype]

    monkeypatch.setattr(cjax, "cutlass_call", fake_cutlass_call)
    out = [jax.ShapeDtypeStruct((4,), jnp.float32)]
    x = jnp.zeros((4,), jnp.float32)
    ref = ffi.LaunchRef("ffi_key_probe", "launch")
    jax.jit(ffi.custom_call("key_probe", ref, outputs=out, compile_key=_Cfg(1))).trace(x)
    assert "ffi_key_probe" not in sys.modules
    import ffi_key_probe

    ffi.custom_call("key_probe", ffi_key_probe.launch, outputs=out, compile_key=_Cfg(1))(x)
    (fn_ref, key_ref), (fn, key) = seen
    assert fn_ref is ref and fn is ffi_key_probe.launch
    assert key_ref == key and key.launch == "ffi_key_probe.launch" and key.launch_source != "none"


# ------------------------------------------------------------------------- subprocess, real kernel
@needs_cute
@pytest.mark.compile
def test_lowering_names_target_and_disk_cache(tmp_path):
    body = """
    txt = lower(make(), x, s)
    txt_ng = lower(make(graph=False), x, s)
    txt_v1 = lower(make(variant=1), x, s)
    before = dict(ffi.cache_stats())
    lower(make_dynamic(), x, s)
    lower(make_dynamic(), jnp.zeros((1000,), jnp.float32), s)  # another extent: same object
    dyn = {k: ffi.cache_stats()[k] - before[k] for k in before}
    import jax.export
    with target_override("sm_90a"):
        exp = jax.export.export(jax.jit(make()), platforms=("cuda",),
                                disabled_checks=ffi.export_disabled_safety_checks())(x, s)
    print(json.dumps({
        "named": "stablehlo.custom_call @tokenspeed_ffi_selftest(" in txt,
        "nograph": "@tokenspeed_ffi_selftest_nograph(" in txt_ng,
        "cutlass_name_absent": "CuteDSLRT" not in txt,
        "has_module": "module = " in txt,
        "export": "@tokenspeed_ffi_selftest(" in exp.mlir_module(),
        "registered": sorted(ffi.registered_targets()),
        "stats": ffi.cache_stats(),
        "dyn": dyn,
        "files": sorted(p.name.split("-")[0] for p in ffi.cache_dir().iterdir()),
    }))
    """
    env = {
        "CUTE_DSL_ARCH": "sm_90a",
        "TOKENSPEED_JAX_CACHE_DIR": str(tmp_path),
        "TOKENSPEED_JAX_DISK_CACHE": None,
    }
    cache = tmp_path / "cache"
    env["TOKENSPEED_JAX_CACHE_DIR"] = str(cache)
    first = _run(body, env, tmp_path)
    assert first["named"] and first["nograph"] and first["cutlass_name_absent"] and first["has_module"]
    assert first["export"]
    assert first["registered"] == [
        "tokenspeed_ffi_selftest",
        "tokenspeed_ffi_selftest_dyn",
        "tokenspeed_ffi_selftest_nograph",
    ]
    # dynamic_shapes: the second extent reuses the first compile (in memory), nothing recompiled
    assert first["dyn"]["disk_writes"] == 1 and first["dyn"]["shape_reuses"] == 1, first["dyn"]
    # four static configs (graph, nograph, variant 1, dynamic) -> four compiles, each written once;
    # the export re-lowers the first config from memory.
    assert first["stats"]["disk_writes"] == 4 and first["stats"]["disk_hits"] == 0
    assert first["files"] == [
        "tokenspeed_ffi_selftest",
        "tokenspeed_ffi_selftest",
        "tokenspeed_ffi_selftest_dyn",
        "tokenspeed_ffi_selftest_nograph",
    ]
    second = _run(body, env, tmp_path)  # a new process: everything comes from disk, nothing is compiled
    assert second["stats"]["disk_writes"] == 0 and second["stats"]["disk_hits"] == 4
    assert second["named"] and second["export"]


@needs_cute
@pytest.mark.compile
def test_launch_ref_compiles_on_a_miss_and_is_not_imported_on_a_disk_hit(tmp_path):
    """The kernel of a LaunchRef compiles in the first process (importing its module) and is loaded from
    the disk cache in the second, which never imports the module."""
    (tmp_path / "ffi_lazy_kernel.py").write_text(
        _KERNEL.split("@dataclasses.dataclass(frozen=True)")[0]  # the kernel and its launch function
    )
    body = """
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    ref = ffi.LaunchRef("ffi_lazy_kernel", "launch")

    def f(x, s):
        return ffi.custom_call("ffi_lazy", ref, compile_key=Cfg(0), block=128,
                               outputs=[jax.ShapeDtypeStruct(x.shape, x.dtype)] * 2)(x, s)[0]

    txt = lower(f, x, s)
    print(json.dumps({"named": "@tokenspeed_ffi_lazy(" in txt, "stats": ffi.cache_stats(),
                      "imported": "ffi_lazy_kernel" in sys.modules}))
    """
    env = {"CUTE_DSL_ARCH": "sm_90a", "TOKENSPEED_JAX_CACHE_DIR": str(tmp_path / "c"),
           "TOKENSPEED_JAX_DISK_CACHE": None}
    first = _run(body, env, tmp_path)
    assert first["named"] and first["imported"] and first["stats"]["disk_writes"] == 1, first
    second = _run(body, env, tmp_path)
    assert second["named"] and not second["imported"], second
    assert second["stats"]["disk_hits"] == 1 and second["stats"]["disk_writes"] == 0, second


@needs_cute
@pytest.mark.compile
def test_arch_mismatch_is_explained(tmp_path):
    body = """
    try:
        lower(make(), x, s, arch="sm_90a")
        print(json.dumps({"raised": None}))
    except RuntimeError as e:
        print(json.dumps({"raised": str(e)}))
    """
    out = _run(body, {"CUTE_DSL_ARCH": "sm_100a", "TOKENSPEED_JAX_CACHE_DIR": str(tmp_path / "c")}, tmp_path)
    assert out["raised"] and "CUTE_DSL_ARCH=sm_90a" in out["raised"]
