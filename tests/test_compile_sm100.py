"""Compile-and-lower tests of the ``sm100`` backend on a CPU machine (no Blackwell GPU needed).

One subprocess per target arch (``CUTE_DSL_ARCH=sm_100a`` and ``sm_103a``, run concurrently) traces
jitted ``mla_decode`` / ``mla_prefill`` calls with ``backend="sm100"`` under
``runtime.target_override(arch)`` and lowers them for CUDA.  Lowering goes through the whole stack:
our ``@cute.jit`` launch wrappers drive the TokenSpeed kernel classes, CuTe DSL compiles them to a
cubin for the arch, and :func:`tokenspeed_jax.ffi.custom_call` embeds the result as the named custom
call, which must appear in the HLO with the plan's workspace as an extra result (the first decode
case also round-trips through ``jax.export``).  Any warning (Python
``warnings``, a WARNING log record, or "warning" on stderr, e.g. from ptxas) fails the test.

The matrix (per arch, each entry one kernel build; ~20-30 s each on one CPU core) covers BF16 H16/H128
and FP8 H16/H96, S in {1, 4, 8}, causal and not, with and without LSE, every query layout (plain,
folded, packed, FP8 M64 on SM100), split-KV with and without workspace, the local_visible_lens and
FP16 fix-up paths of causal MTP, and prefill 192/128 (BF16 causal + LSE on both archs, FP8 non-causal
without LSE on sm_103a).  It is trimmed from the full cross product (48 decode builds per arch would
take ~20 minutes) to 7 builds per arch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("sm_100a", "sm_103a")

pytestmark = [
    pytest.mark.compile,
    pytest.mark.skipif(
        importlib.util.find_spec("tokenspeed_mla") is None or importlib.util.find_spec("cutlass") is None,
        reason="needs tokenspeed-mla and nvidia-cutlass-dsl (pip install 'tokenspeed-jax[sm100]')",
    ),
]

# name, op, dtype, B, S, H, causal, lse, page_size, max_pages, archs
DECODE_CASES = [
    ("bf16_h128_s1_split", "bfloat16", 2, 1, 128, False, True, 64, 16, ARCHS),
    ("bf16_h16_s4_fold_causal", "bfloat16", 4, 4, 16, True, False, 32, 20, ARCHS),
    ("bf16_h128_s8_nosplit_causal", "bfloat16", 64, 8, 128, True, True, 64, 8, ARCHS),
    ("fp8_h16_s4_causal", "float8_e4m3fn", 4, 4, 16, True, True, 64, 16, ARCHS),
    ("fp8_h96_s8_packed", "float8_e4m3fn", 2, 8, 96, False, False, 128, 9, ARCHS),
    ("fp16_h16_s4_causal_fixup", "float16", 2, 4, 16, True, True, 16, 40, ("sm_100a",)),
]
# name, dtype, Tq, Tk, B, Hq, Hk, causal, lse, archs
PREFILL_CASES = [
    ("bf16_causal_lse", "bfloat16", 300, 520, 3, 16, 16, True, True, ARCHS),
    ("fp8_noncausal", "float8_e4m3fn", 256, 256, 2, 16, 16, False, False, ("sm_103a",)),
]


def _worker(arch: str) -> int:  # runs in the subprocess
    import logging
    import re
    import warnings

    records: list[str] = []

    class _Grab(logging.Handler):
        def emit(self, record):
            records.append(f"{record.name}: {record.getMessage()}")

    logging.getLogger().addHandler(_Grab(level=logging.WARNING))
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        import jax
        import jax.numpy as jnp

        import tokenspeed_jax as tj
        from tokenspeed_jax import ffi
        from tokenspeed_jax.backends import sm100
        from tokenspeed_jax.decode import _decode_problem
        from tokenspeed_jax.runtime import target_override

        def sds(shape, dtype):
            return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))

        def report(name, t0, txt, target, extra_shapes=()):
            found = sorted(set(re.findall(r"custom_call @(\w+)", txt)))
            ok = f"tokenspeed_{target}" in found and all(s in txt for s in extra_shapes)
            print(json.dumps({"arch": arch, "case": name, "ok": ok, "seconds": round(time.time() - t0, 1),
                              "targets": found, "expect_shapes": list(extra_shapes)}), flush=True)

        for name, dtype, B, S, H, causal, lse, ps, mp, archs in DECODE_CASES:
            if arch not in archs:
                continue
            t0 = time.time()
            args = (sds((B, S, H, 576), dtype), sds((B * mp + 3, ps, 576), dtype), sds((B, mp), "int32"),
                    sds((B,), "int32"), sds((), "float32"), sds((), "float32"))

            def f(q, kv, bt, sl, ss, os_, causal=causal, lse=lse):
                return tj.mla_decode(q, kv, bt, sl, softmax_scale=ss, output_scale=os_, causal=causal,
                                     return_lse=lse, backend="sm100")

            with target_override(arch):
                plan = sm100._decode_plan(_decode_problem(*args[:4], causal, 512, lse))
                txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
                if name == DECODE_CASES[0][0]:  # jax.export round trip (kernel already compiled)
                    exp = jax.export.export(jax.jit(f), platforms=("cuda",),
                                            disabled_checks=ffi.export_disabled_safety_checks())(*args)
                    txt += jax.export.deserialize(exp.serialize()).mlir_module()
            ws = [f"tensor<{w.shape[0]}xf32>" for w in plan.workspace]
            report(name, t0, txt, "mla_decode_sm100", ws)

        for name, dtype, Tq, Tk, B, Hq, Hk, causal, lse, archs in PREFILL_CASES:
            if arch not in archs:
                continue
            t0 = time.time()
            args = (sds((Tq, Hq, 192), dtype), sds((Tk, Hk, 192), dtype), sds((Tk, Hk, 128), dtype),
                    sds((B + 1,), "int32"), sds((B + 1,), "int32"), sds((), "float32"))

            def g(q, k, v, cq, ck, ss, causal=causal, lse=lse):
                return tj.mla_prefill(q, k, v, cq, ck, softmax_scale=ss, causal=causal, return_lse=lse,
                                      max_seqlen_q=128, max_seqlen_k=256, backend="sm100")

            with target_override(arch):
                txt = jax.jit(g).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            report("prefill_" + name, t0, txt, "mla_prefill_sm100")

    bad = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught] + records
    print(json.dumps({"arch": arch, "warnings": bad}), flush=True)
    return 0


@pytest.fixture(scope="module")
def workers():
    """Start one worker per arch at once (they run concurrently on the CI's cores)."""
    procs = {}
    for arch in ARCHS:
        env = dict(os.environ)
        env.update(
            CUTE_DSL_ARCH=arch, TOKENSPEED_JAX_DISK_CACHE="0", CUTE_DSL_DISABLE_FILE_CACHING="1",
            CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu",
            PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
        )
        procs[arch] = subprocess.Popen(
            [sys.executable, "-m", "tests.test_compile_sm100", arch], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()


@pytest.mark.parametrize("arch", ARCHS)
def test_compile_and_lower(workers, arch):
    try:
        out, err = workers[arch].communicate(timeout=1200)
    except subprocess.TimeoutExpired:
        workers[arch].kill()
        pytest.fail(f"{arch}: compile worker timed out")
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    cases = [r for r in lines if "case" in r]
    for r in cases:
        print(f"{arch} {r['case']}: {r['seconds']} s, targets {r['targets']}")
    assert workers[arch].returncode == 0, f"{arch}: worker failed\n{out}\n{err[-5000:]}"
    n = sum(arch in c[-1] for c in DECODE_CASES) + sum(arch in c[-1] for c in PREFILL_CASES)
    assert len(cases) == n, f"{arch}: {len(cases)}/{n} cases reported\n{out}\n{err[-5000:]}"
    failed = [r for r in cases if not r["ok"]]
    assert not failed, f"{arch}: named custom call or workspace result missing: {failed}"
    warned = [line for line in err.splitlines() if "warn" in line.lower()]
    summary = [r for r in lines if "warnings" in r]
    assert summary and not summary[0]["warnings"] and not warned, (
        f"{arch}: CuTe DSL / compiler warnings:\n{summary}\n" + "\n".join(warned)
    )


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1]))
