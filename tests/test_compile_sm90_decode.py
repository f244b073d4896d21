"""CPU checks of the sm90 MLA decode kernels: every config :func:`select_config` picks, compiled for sm_90a, its
PTX and SASS read (MMA instruction counts, no local-memory spills beyond the known bounds, ptxas did not serialize the
wgmmas), the public op lowered for CUDA, and the addressing models of the FP8 operand paths.

The compile runs in a subprocess (``CUTE_DSL_ARCH`` must be set before cutlass is imported, one arch per process).
SASS checks run when ``nvdisasm`` is available (the test extra installs ``nvidia-cuda-nvdisasm``); otherwise the PTX is
checked.  Each kernel is built by ``build_decode_kernel``, the factory of the backend's one launch entry.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (loop, producer, dtype, H, S, page, B): each loop the table selects, in the page sizes that change its code
# (boxes per chunk, the staged epilogue's passes); every build has the persistent grid, both epilogues (the direct
# output and fp32 partials) and the combine kernel (a grid of row blocks x CTAs, whatever B)
CASES = {
    "seesaw16_prod": ("seesaw", True, "float16", 32, 2, 32, 3),  # 64 rows, 2 boxes per chunk
    "seesaw16_h128": ("seesaw", True, "bfloat16", 128, 1, 64, 1),  # 2 row blocks
    "seesaw16_page16": ("seesaw", False, "bfloat16", 16, 1, 16, 16),  # padded rows, 4 boxes
    "seesaw16_page16_s2": ("seesaw", False, "bfloat16", 16, 2, 16, 4),  # the same, causal MTP (hidden keys)
    "seesaw8_page16": ("seesaw", False, "float8_e4m3fn", 32, 4, 16, 3),  # FP8, 4 boxes per chunk
    "transposed16": ("transposed", True, "bfloat16", 16, 1, 64, 2),  # pv_n 16
    "transposed32": ("transposed", True, "float16", 16, 2, 32, 1),  # pv_n 32
    "fp8_pv64": ("fp8_transposed_pv", True, "float8_e4m3fn", 32, 4, 64, 8),  # two 64-row blocks
    "fp8_t32": ("fp8_transposed", True, "float8_e4m3fn", 32, 1, 64, 3),  # 32 rows
    "fp8_t16": ("fp8_transposed", True, "float8_e4m3fn", 16, 1, 64, 1),  # 16 rows
    "fp8_t32_s2": ("fp8_transposed", True, "float8_e4m3fn", 16, 2, 64, 2),  # 32 rows, causal MTP (hidden keys)
}
# the prefetch builds (Sm90DecodeConfig.prefetch, select_config's choice for these loops), as (loop, producer, dtype,
# H, S, page, B, prefetch), compared with the build without prefetch of the case named first
PREFETCH_CASES = {
    "transposed32_prefetch": ("transposed32", ("transposed", True, "float16", 16, 2, 32, 1, True)),
    "seesaw16_h128_prefetch": ("seesaw16_h128", ("seesaw", True, "bfloat16", 128, 1, 64, 1, True)),
    "fp8_pv64_prefetch": ("fp8_pv64", ("fp8_transposed_pv", True, "float8_e4m3fn", 32, 4, 64, 8, True)),
}
NUM_CTAS, MAX_SLOTS = 66, 130  # (any: the grid and the workspace are launch parameters of the same code)
INV_CHUNK = 4096  # the batch-invariant builds' piece length (any multiple of 128: a constant of the walk)

_SCRIPT = textwrap.dedent(
    r"""
    import glob, json, os, re, sys
    import cutlass, cutlass.cute as cute, cutlass.cute.runtime as rt
    from tokenspeed_jax.kernels.sm90.decode import build_decode_kernel
    CASES = json.loads(sys.argv[1])
    res = {}
    d = os.environ["CUTE_DSL_DUMP_DIR"]
    import struct, time
    def kernel_regs(before):  # {kernel: registers a thread} of the cubins written since ``before`` (EIATTR_REGCOUNT)
        out = {}
        for p in sorted(glob.glob(d + "/*.cubin")):
            if os.path.getmtime(p) < before:
                continue
            b = open(p, "rb").read()
            shoff, = struct.unpack_from("<Q", b, 0x28)
            esz, n, stri = struct.unpack_from("<HHH", b, 0x3a)
            sec = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * esz) for i in range(n)]
            name = lambda s, o: b[sec[s][4] + o: b.index(b"\0", sec[s][4] + o)].decode()
            secs = {name(stri, h[0]): h for h in sec}
            sym = secs[".symtab"]
            syms = [name(sym[6], struct.unpack_from("<I", b, sym[4] + 24 * i)[0]) for i in range(sym[5] // 24)]
            info = secs[".nv.info"]
            body, i = b[info[4]: info[4] + info[5]], 0
            while i + 4 <= len(body):
                if body[i] == 4:  # EIFMT_SVAL: a 16-bit size, then the value
                    size, = struct.unpack_from("<H", body, i + 2)
                    if body[i + 1] == 0x2F:  # EIATTR_REGCOUNT: (symbol index, registers)
                        k_, r_ = struct.unpack_from("<II", body, i + 4)
                        out[syms[k_]] = r_
                    i += 4 + size
                else:
                    i += 4
        return out
    own = lambda before, ext: "".join(  # text of the dump files a compile wrote since time ``before`` (the
        open(p).read() for p in sorted(glob.glob(d + "/*"))  # batch-invariant build rewrites its default's names)
        if p.endswith(ext) and os.path.getmtime(p) >= before)
    PTX = dict(
        wgmma=r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+)",
        tma=r"cp\.async\.bulk\.tensor\.3d\.shared::\w+\.global\.tile\.mbarrier",
        maxnreg=r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(?:240|24);",
        bar160=r"bar\.(?:sync|arrive)\s+(?:10|11|12|13|%r\d+),\s*160;",
        expect=r"mbarrier\.arrive\.expect_tx", waits=r"mbarrier\.try_wait",
        ldsm=r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16",
        stsm=r"stmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16",
        sts32=r"begin inline asm\n\s*st\.shared\.b32", lds32=r"begin inline asm\n\s*ld\.shared\.b32",
        clock=r"%clock64", local=r"\.local", cpasync=r"cp\.async\.ca|cp\.async\.cg",
        l2pf=r"cp\.async\.bulk\.prefetch", gdc_wait=r"griddepcontrol\.wait",
        gdc_launch=r"griddepcontrol\.launch_dependents",
        # the masks of helpers.clear_nan_e4m3x4 / clear_nonfinite_16x2 (0x7F7F7F7F, 0x7F807F80, 0x7C007C00)
        clean=r"\b(?:2139062143|2139127680|2080406528)\b"
              r"|0[xX]7[fF]7[fF]7[fF]7[fF]|0[xX]7[fF]807[fF]80|0[xX]7[cC]007[cC]00")
    SASS = dict(hgmma=r"HGMMA\.64x(?!8x16\.F16)", hgmma_r=r"HGMMA\.\w+\.F32(?:\.BF16)? R\d+, R\d+", qgmma=r"QGMMA\.",
                qgmma_r=r"QGMMA\.\w+\.F32\.E4M3\.E4M3 R\d+, R\d+", spill=r"\b(STL|LDL)\b",
                depbar=r"WARPGROUP\.DEPBAR", stg128=r"STG\.E\.128")

    def fake_args(k, S, H, page, B, pages=50, table=24):
        # the launch arguments of kernel ``k`` as fake tensors: q, cache, table, lengths, scales, the schedule's
        # cta / req tables, out, lse, the fp32 partials
        f = rt.make_fake_compact_tensor
        dt, ot, R = k.dtype, k.out_dtype, H * S
        return [rt.make_fake_stream(), f(dt, (B, S, H, 576), assumed_align=16),
                f(dt, (pages, page, 576), assumed_align=16), f(cutlass.Int32, (B, table)), f(cutlass.Int32, (B,)),
                f(cutlass.Float32, (1,)), f(cutlass.Float32, (1,)), f(cutlass.Int32, (NUM_CTAS, 8)),
                f(cutlass.Int32, (B, 2)), f(ot, (B, S, H, 512), assumed_align=16), f(cutlass.Float32, (B, S, H)),
                f(cutlass.Float32, (MAX_SLOTS, R, 512), assumed_align=16), f(cutlass.Float32, (MAX_SLOTS, R))]

    NUM_CTAS, MAX_SLOTS = NCTAS, NSLOTS
    # every case twice: the length-balanced schedule's build and the batch-invariant one's (chunk > 0; ``name@inv``)
    # (and the prefetch cases, 8 fields: the default schedule's build only)
    for (name, (loop, producer, dtype, H, S, page, B, *pf)), chunk in [(c, 0) for c in CASES.items()] + [
            ((n + "@inv", c), INV_CHUNK) for n, c in CASES.items() if len(c) == 7]:
        before = time.time() - 0.001
        k = build_decode_kernel(loop=loop, producer=producer, dtype=dtype, num_heads=H, q_len=S, page_size=page,
                                causal=True, num_ctas=NUM_CTAS, max_slots=1 if chunk else MAX_SLOTS, chunk=chunk,
                                prefetch=bool(pf and pf[0]))
        cute.compile(k, *fake_args(k, S, H, page, B))
        ptx, sass = own(before, ".ptx"), own(before, ".sass")
        main = ptx[:ptx.index(".entry kernel_cutlass_combine")]
        x = {n: len(re.findall(p, main)) for n, p in PTX.items() if n != "wgmma"}
        shapes = re.findall(PTX["wgmma"], main)
        x["wgmma"] = {s: shapes.count(s) for s in sorted(set(shapes))}
        main_sass = "".join(part for part in re.split(r"(?m)^//-+ \.text\.", sass)
                            if not part.startswith("kernel_cutlass_combine"))  # (the main kernel's sections)
        x.update({n: len(re.findall(p, main_sass)) for n, p in SASS.items()})
        x["sass"] = bool(sass)
        x["entries"] = sorted(set(re.findall(r"\.entry\s+(\w+)", ptx)))
        x["tiles"] = [k.block_m, k.num_m_blocks, getattr(k, "pv_n", 64), k.cta_threads]
        comb = ptx[ptx.index(".entry kernel_cutlass_combine"):]
        comb_sass = "".join(part for part in re.split(r"(?m)^//-+ \.text\.", sass)
                            if part.startswith("kernel_cutlass_combine"))
        x["comb"] = dict(cp16=len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*, 16;", comb)),
                         spill=len(re.findall(SASS["spill"], comb_sass)) if sass else None,
                         wait=len(re.findall(r"griddepcontrol\.wait", comb)),
                         regs=max(r for n_, r in kernel_regs(before).items() if "combine" in n_),
                         nb=k.COMBINE_SLOTS_IN_FLIGHT, ctas_per_sm=k.COMBINE_CTAS_PER_SM)
        if hasattr(k, "pv_mma_repr"):
            x["pv_tv"] = k.pv_mma_repr
        res[name] = x
    # the public op lowered for CUDA on this CPU machine: the custom call of the selected config
    import jax, jax.numpy as jnp
    from tokenspeed_jax import mla_decode
    from tokenspeed_jax.runtime import target_override
    sd = jax.ShapeDtypeStruct
    f = lambda q, kv, bt, sl, s, o: mla_decode(q, kv, bt, sl, softmax_scale=s, output_scale=o, backend="sm90",
                                              return_lse=True)
    with target_override("sm_90a"):
        txt = jax.jit(f).trace(sd((3, 2, 16, 576), jnp.bfloat16), sd((200, 64, 576), jnp.bfloat16),
                               sd((3, 40), jnp.int32), sd((3,), jnp.int32), sd((), jnp.float32),
                               sd((), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    res["targets"] = sorted(set(re.findall(r"custom_call @(\w+)", txt)))
    # the same call for other batch sizes, cache sizes and table widths: the compiled object lowered above, reused
    import hashlib
    from tokenspeed_jax.ffi.compile_cache import cache_stats
    def embedded(txt):  # digests of the objects and keys embedded in the decode and schedule custom calls
        out = []
        for target in ("mla_decode_sm90", "decode_schedule_sm90"):
            line = [l for l in txt.splitlines() if "custom_call @tokenspeed_" + target in l]
            assert len(line) == 1, (target, len(line))
            out.append(" ".join(hashlib.sha256(re.search(a + r' = "((?:[^"\\]|\\.)*)"', line[0]).group(1).encode())
                                .hexdigest() for a in ("module", "key")))
        return out
    res["invariance"] = [embedded(txt) + [cache_stats()["misses"]]]
    for B, pages, width in ((1, 9, 7), (64, 2000, 300), (5, 200, 40)):
        with target_override("sm_90a"):
            t = jax.jit(f).trace(sd((B, 2, 16, 576), jnp.bfloat16), sd((pages, 64, 576), jnp.bfloat16),
                                 sd((B, width), jnp.int32), sd((B,), jnp.int32), sd((), jnp.float32),
                                 sd((), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
        res["invariance"].append(embedded(t) + [cache_stats()["misses"]])
    # the batch-invariant mode: one more object (its own key), then none for other batch sizes and tables
    fi = lambda q, kv, bt, sl, s, o: mla_decode(q, kv, bt, sl, softmax_scale=s, output_scale=o, backend="sm90",
                                               return_lse=True, batch_invariant=True)
    res["invariance_inv"] = []
    for B, pages, width in ((3, 200, 40), (1, 9, 7), (64, 2000, 300), (5, 200, 40)):
        with target_override("sm_90a"):
            t = jax.jit(fi).trace(sd((B, 2, 16, 576), jnp.bfloat16), sd((pages, 64, 576), jnp.bfloat16),
                                  sd((B, width), jnp.int32), sd((B,), jnp.int32), sd((), jnp.float32),
                                  sd((), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
        res["invariance_inv"].append(embedded(t) + [cache_stats()["misses"]])
    print("RESULT " + json.dumps(res))
    """
)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The compile script's result: per case of :data:`CASES`, counts from its PTX / SASS dump."""
    pytest.importorskip("cutlass")
    tmp = tmp_path_factory.mktemp("sm90_decode_dump")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_DUMP_DIR=str(tmp), TOKENSPEED_JAX_DISK_CACHE="0",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    have_nvdisasm = shutil.which("nvdisasm") is not None or _nvdisasm_wheel()
    env["CUTE_DSL_KEEP"] = "ptx,sass,cubin" if have_nvdisasm else "ptx,cubin"
    script = _SCRIPT.replace("NCTAS", str(NUM_CTAS)).replace("NSLOTS", str(MAX_SLOTS)).replace("INV_CHUNK",
                                                                                             str(INV_CHUNK))
    cases = dict(CASES, **{n: c for n, (_, c) in PREFETCH_CASES.items()})
    p = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], env=env, capture_output=True, text=True,
                       timeout=1200, cwd=ROOT, check=False)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and line, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(line[0][7:])
    with open(os.path.join(str(tmp), "result.json"), "w") as fh:  # (for a re-check without recompiling)
        json.dump(r, fh)
    return r


# name -> the expected counts: wgmma shapes (PTX, main kernel), TMA copies, the producer's setmaxnreg (2 or 0), its
# 160-thread barriers, HGMMA / QGMMA (SASS) with those from registers, and the bound on spill instructions (the
# persistent piece loop's values spill and are reloaded once per piece, outside the main loops: 2-28 per build as
# compiled on 2026-12-04; seesaw16_h128's 14 since the wgmma operands are built at their issue (fresh_smem): the piece
# setup, the producer's entry, the epilogue's LSE and the piece's end, none in a main loop)
EXPECT = {
    # 16-bit seesaw: 2 x 36 QK (first tile) + 36 per warpgroup loop (m64n64k16), 4 PVs of 4 k16 steps (m64n256k16),
    # 2 of them with P from registers; 4 column-group refills in the prologue + 2 per warpgroup loop, 18 + 18 chunks x
    # boxes per chunk; the producer's 4 loop syncs + 4 arrive sites; P by 2 x 4 stmatrix
    "seesaw16_prod": dict(wgmma={"m64n256k16": 16, "m64n64k16": 144}, tma=72, maxnreg=2, bar160=8, mma=160,
                          mma_r=8, stsm=8, spill=28),
    "seesaw16_h128": dict(wgmma={"m64n256k16": 16, "m64n64k16": 144}, tma=36, maxnreg=2, bar160=8, mma=160,
                          mma_r=8, stsm=8, spill=14),
    "seesaw16_page16": dict(wgmma={"m64n256k16": 16, "m64n64k16": 144}, tma=144, maxnreg=0, bar160=0, mma=160,
                            mma_r=8, stsm=8, spill=0),
    # FP8 seesaw (16-token pages): QK on FP8 tensor cores (4 x 18 m64n64k32), each PV one m64n256k32 per k32 step
    # (4 PVs x 2), V^T built by 2 chunks x 2 halves of ldmatrix.x4.trans / stmatrix.x4 per loop iteration at 4 sites
    "seesaw16_page16_s2": dict(wgmma={"m64n256k16": 16, "m64n64k16": 144}, tma=144, maxnreg=0, bar160=0, mma=160,
                               mma_r=8, stsm=8, spill=0),
    # (S 4: the transpose twice, with and without the cleaning of a causal tail's V: 32 ldmatrix / stmatrix)
    "seesaw8_page16": dict(wgmma={"m64n256k32": 8, "m64n64k32": 72}, tma=144, maxnreg=0, bar160=0, mma=80, mma_r=0,
                           stsm=32, ldsm=32, spill=0),
    # transposed 16-bit: only m64nNk16 (N = the rows rounded up to 16 / 32): 36 per QK (2 prologue sites, 2 loop
    # sites), 16 per PV (4 m-blocks x 4 k16 steps, 4 sites); the seesaw's TMA copies, refill barriers and mbarriers
    "transposed16": dict(wgmma={"m64n16k16": 208}, tma=36, maxnreg=2, bar160=8, mma=208, mma_r=0, expect=8, waits=8,
                         spill=0),
    "transposed32": dict(wgmma={"m64n32k16": 208}, tma=72, maxnreg=2, bar160=8, mma=208, mma_r=0, expect=8, waits=8,
                         spill=14),
    # FP8 O^T on 64-row blocks: 54 QK + 32 PV m64n64k32 (the PVs with V^T from registers, 8 ldmatrix.x4.trans per
    # PV); P as 8 32-bit shared stores per store site and warpgroup 0's rescale of P0 from its words (8 + 8); the TMA
    # of 4 tiles in the prologue and 2 per pair in the producer's loop x 9 chunks; at most a few loop-invariant reloads
    # (S 4: each V^T load twice, with and without the cleaning of a causal tail's V: 64 ldmatrix)
    "fp8_pv64": dict(wgmma={"m64n64k32": 86}, tma=54, maxnreg=2, bar160=4, mma=86, mma_r=32, ldsm=64, sts32=24,
                     lds32=8, spill=11),
    # FP8 transposed, each warpgroup its own tiles over all 512 features: the first QK and the loop's next QK (18 each)
    # and the PV over 8 m-blocks x 2 k32 steps with V^T from registers, all N = the rows; one SLOT*_FREE arrive site
    # (its id depends on the warpgroup) and the producer's 2 syncs; spills at 32 rows only outside the loop (the
    # prologue and the epilogue's merge)
    "fp8_t32": dict(wgmma={"m64n32k32": 52}, tma=54, maxnreg=2, bar160=3, mma=52, mma_r=16, ldsm=16, spill=10),
    "fp8_t16": dict(wgmma={"m64n16k32": 52}, tma=54, maxnreg=2, bar160=3, mma=52, mma_r=16, ldsm=16, spill=4),
    "fp8_t32_s2": dict(wgmma={"m64n32k32": 52}, tma=54, maxnreg=2, bar160=3, mma=52, mma_r=16, ldsm=16, spill=10),
}


@pytest.mark.compile
@pytest.mark.parametrize("name", list(CASES))
def test_selected_config_compiles(compiled, name):
    """Per config: the MMA instructions, TMA copies and barriers it is built from, no serialized wgmma (ptxas C7520 /
    C7512 put a WARPGROUP.DEPBAR after every one), spills within the known bound, no debug mark, no cp.async."""
    x, want = compiled[name], EXPECT[name]
    assert x["wgmma"] == want["wgmma"], (name, x)
    for key in ("tma", "maxnreg", "bar160", "stsm", "ldsm", "sts32", "lds32", "expect", "waits"):
        if key in want:
            assert x[key] == want[key], (name, key, x)
    fp8 = CASES[name][2] == "float8_e4m3fn"
    # (16-bit: the Q tile's cp.async, 2 rows x 9 chunks of 16 bytes a thread; the KV is TMA only)
    assert x["clock"] == 0 and x["local"] == 0 and x["cpasync"] == (0 if fp8 else 18) and x["l2pf"] == 0, (name, x)
    # PDL: the main kernel lets the combine launch early (split partials only); nothing waits before it
    assert x["gdc_launch"] == 1 and x["gdc_wait"] == 0, (name, x)
    assert all("MlaDecode" in e for e in x["entries"]), x["entries"]  # (compute-sanitizer's kernel filter)
    if x["sass"]:  # (ptxas adds one HGMMA.64x8x16.F16 to the 16-bit builds, not counted)
        assert x["qgmma" if fp8 else "hgmma"] == want["mma"], (name, x)
        assert x["qgmma_r" if fp8 else "hgmma_r"] == want["mma_r"], (name, x)
        assert x["depbar"] <= 12 and x["spill"] <= want["spill"], (name, x)


@pytest.mark.compile
@pytest.mark.parametrize("name", list(CASES))
def test_causal_hidden_keys_cleaned(compiled, name):
    """A causal build with S > 1 cleans the V of the keys its later query tokens add (``MlaDecodeSm90.hidden_keys``:
    the masks of ``helpers.clear_nonfinite_16x2`` / ``clear_nan_e4m3x4`` are in its main kernel); an S = 1 build has
    none of that code, in both schedules' builds."""
    S = CASES[name][4]
    for n in (name, name + "@inv"):
        assert (compiled[n]["clean"] > 0) == (S > 1), (n, compiled[n]["clean"])


def test_nonfinite_cleaning_expressions():
    """The word expressions the loops clean the hidden keys' V with, run here on numpy int32 (the DSL's Int32 has the
    same wrapping + / - and arithmetic >>) over every 16-bit half in both positions and every byte in every position:
    exactly the non-finite values (bf16 / fp16 Inf and NaN, e4m3fn NaN) become +0, every other bit stays."""
    pytest.importorskip("cutlass")
    import ml_dtypes
    import numpy as np

    from tokenspeed_jax.kernels.sm90.helpers import clear_nan_e4m3x4, clear_nonfinite_16x2

    rng = np.random.default_rng(0)
    halves = np.arange(1 << 16, dtype=np.uint32)
    for exp_mask, dt in ((0x7F80, ml_dtypes.bfloat16), (0x7C00, np.float16)):
        for other in [int(x) for x in rng.integers(0, 1 << 16, 4)] + [0x7F80, 0xFFFF, 0x7C01, 0x8000]:
            for pos in (0, 1):
                words = (halves << (16 * pos)) | np.uint32(other << (16 * (1 - pos)))
                with np.errstate(over="ignore"):
                    got = clear_nonfinite_16x2(words.view(np.int32), exp_mask).view(np.uint32)
                h16 = words.view(np.uint16).reshape(-1, 2)
                want = np.where(np.isfinite(h16.view(dt).astype(np.float32)), h16, 0).astype(np.uint16)
                np.testing.assert_array_equal(got, want.reshape(-1).view(np.uint32))
    byte = np.arange(256, dtype=np.uint32)
    for other in [int(x) for x in rng.integers(0, 1 << 32, 6, dtype=np.uint64)] + [0x7F7F7F7F, 0xFFFFFFFF, 0]:
        for pos in range(4):
            words = (np.uint32(other) & np.uint32(~(0xFF << (8 * pos)) & 0xFFFFFFFF)) | (byte << (8 * pos))
            with np.errstate(over="ignore"):
                got = clear_nan_e4m3x4(words.view(np.int32)).view(np.uint32)
            b8 = words.view(np.uint8).reshape(-1, 4)
            want = np.where(np.isnan(b8.view(ml_dtypes.float8_e4m3fn).astype(np.float32)), 0, b8).astype(np.uint8)
            np.testing.assert_array_equal(got, want.reshape(-1).view(np.uint32))


@pytest.mark.compile
@pytest.mark.parametrize("name", list(PREFETCH_CASES))
def test_prefetch_build_compiles(compiled, name):
    """The prefetch build against the same loop's build without prefetch: the same main loops (MMA shapes and counts,
    register operands, the producer's setmaxnreg and 160-thread barriers, no serialized wgmma), the first KV tiles'
    TMA copies issued from two places (before the walk and at each epilogue barrier) and, in the 16-bit transposed
    loop, the Q tile's cp.async too; spills within the build without prefetch's bound plus the walk's few extra values."""
    base = PREFETCH_CASES[name][0]
    x, d = compiled[name], compiled[base]
    for key in ("wgmma", "maxnreg", "bar160", "stsm", "ldsm", "sts32", "lds32", "clock", "local", "l2pf",
                "gdc_launch", "gdc_wait", "tiles"):
        assert x[key] == d[key], (name, key, x[key], d[key])
    # the prologue's copies twice: seesaw / transposed pair 0 (2 tiles x 9 chunks x boxes), fp8_pv64 pairs 0 and 1
    boxes = 64 // min(64, CASES[base][5])
    first = (4 if CASES[base][0] == "fp8_transposed_pv" else 2) * 9 * boxes
    assert x["tma"] == d["tma"] + first, (name, x["tma"], d["tma"])
    assert x["cpasync"] == 2 * d["cpasync"] if CASES[base][0] == "transposed" else x["cpasync"] == d["cpasync"], x
    if x["sass"]:
        fp8 = CASES[base][2] == "float8_e4m3fn"
        for key in ("qgmma", "qgmma_r") if fp8 else ("hgmma", "hgmma_r"):
            assert x[key] == d[key], (name, key, x, d)
        assert x["depbar"] <= 12 and x["spill"] <= EXPECT[base]["spill"] + 4, (name, x["spill"])


@pytest.mark.compile
def test_staged_epilogue_and_combine(compiled):
    """The seesaw's staged epilogue: O through the Q tile's shared memory in 16-byte chunks, 16 rows per thread and
    pass, both versions built (each piece picks one at run time): one pass of 16-bit output plus two of fp32
    partials through the 72 KB 16-bit Q tile, two of bf16 plus four of fp32 through the 36 KB e4m3 one; the combine
    kernel: after griddepcontrol.wait, a warp item's slot partials copied by 16-byte cp.async, COMBINE_SLOTS_IN_FLIGHT
    at a time, and few enough registers for its one-wave grid (COMBINE_CTAS_PER_SM CTAs of 128 threads on every SM),
    with at most one spilled value."""
    if compiled["seesaw16_prod"]["sass"]:
        # both epilogues are built (the direct output and the fp32 partials are chosen per piece at run time)
        for name in ("seesaw16_prod", "seesaw16_h128", "seesaw8_page16"):
            assert compiled[name]["stg128"] == 16 + 2 * 16, compiled[name]
    for name in CASES:
        check_combine(name, compiled[name]["comb"])


def check_combine(name, comb, invariant=False):
    """The combine kernel of build ``name`` as the compile script read it (:func:`test_staged_epilogue_and_combine`);
    ``invariant``: the batch-invariant build (quarters only, no spill)."""
    # (the default build issues one round of slot copies before it reads the slot LSEs, the others in the slot loop)
    assert comb["wait"] == 1 and comb["cp16"] == (1 if invariant else 2) * comb["nb"], (name, comb)
    assert comb["regs"] * 128 * comb["ctas_per_sm"] <= 65536, (name, comb)
    # (the launch caps the registers at the one-wave grid's; the default build spills one value, its item's request,
    # outside the slot loop: stored where it is set (before the grid-dependency wait, for the first item, and in the
    # item loop, each in both item widths' copies of the code) and loaded once for the output's address)
    assert comb["spill"] is None or comb["spill"] <= (0 if invariant else 5), (name, comb)


@pytest.mark.compile
def test_tiles_and_lowering(compiled):
    """Row tiles and threads per config, the O^T loops' register-A / accumulator layouts as traced, and the public op's
    lowering to the decode custom call."""
    assert compiled["fp8_pv64"]["tiles"] == [64, 2, 64, 384]
    assert compiled["fp8_t32"]["tiles"] == [32, 1, 32, 384] and compiled["fp8_t16"]["tiles"] == [32, 1, 16, 384]
    assert compiled["transposed16"]["tiles"] == [64, 1, 16, 384]
    assert compiled["seesaw16_prod"]["tiles"] == [64, 1, 64, 384]
    assert compiled["seesaw16_page16"]["tiles"] == [64, 1, 64, 256]
    tv = compiled["fp8_t32"]["pv_tv"]
    assert f"TV Layout A:     {OT_TV_A}" in tv and f"TV Layout C:     {OT_TV_C}" in tv, tv
    assert compiled["targets"] == ["tokenspeed_decode_schedule_sm90", "tokenspeed_mla_decode_sm90"], \
        compiled["targets"]


@pytest.mark.compile
def test_new_batch_size_or_table_width_costs_no_compile(compiled):
    """The public op lowered for other batch sizes, cache sizes and table widths embeds the very objects (and keys) of
    the first lowering, the decode's and the schedule kernel's, with no further CuTe DSL compile (``ffi`` cache
    misses stay at 2): their operand extents are read at run time (``sm90_decode.operand_specs``; the schedule's
    capacity and per-request cut are an operand too)."""
    inv = compiled["invariance"]
    assert len(inv) == 4
    assert {tuple(x[:2]) for x in inv} == {tuple(inv[0][:2])}, inv
    assert [x[2] for x in inv] == [inv[0][2]] * 4 and inv[0][2] >= 2, inv
    assert inv[0][0] != inv[0][1], inv


@pytest.mark.compile
@pytest.mark.parametrize("name", list(CASES))
def test_batch_invariant_build_compiles(compiled, name):
    """The batch-invariant build of every config (``chunk`` > 0: the walk runs a range chunk by chunk, the combine
    takes any number of slots): the same main loops (MMA, TMA, barrier counts) as the default build, no serialized
    wgmma, spills within the default build's bound plus the walk's few extra values, PDL, and a combine that waits
    for the main grid and loads the partials 16 bytes at a time."""
    x, d, want = compiled[name + "@inv"], compiled[name], EXPECT[name]
    for key in ("wgmma", "tma", "maxnreg", "bar160", "stsm", "ldsm", "sts32", "lds32", "expect", "waits", "clock",
                "local", "cpasync", "l2pf", "gdc_launch", "gdc_wait", "tiles"):
        assert x[key] == d[key], (name, key, x[key], d[key])
    if x["sass"]:
        fp8 = CASES[name][2] == "float8_e4m3fn"
        for key in ("qgmma", "qgmma_r") if fp8 else ("hgmma", "hgmma_r"):
            assert x[key] == d[key], (name, key, x, d)
        assert x["depbar"] <= 12 and x["spill"] <= INV_SPILL.get(name, want["spill"] + 4), (name, x["spill"])
    check_combine(name, x["comb"], invariant=True)


# the batch-invariant builds' spill bound where it differs from the default build's bound + 4: the FP8 O^T loop's walk
# and epilogue reload a few more values per piece (its two main loops have none, against 6 in the default build)
INV_SPILL = {"fp8_pv64": 30}


@pytest.mark.compile
def test_batch_invariant_new_batch_size_costs_no_compile(compiled):
    """``batch_invariant=True``: one object of its own (another key than the default mode's), embedded unchanged
    for other batch sizes, cache sizes and table widths with no further compile (its workspace extent, ``B *
    ceil(capacity / chunk)`` slots, is read at run time too)."""
    inv, base = compiled["invariance_inv"], compiled["invariance"]
    assert {tuple(x[:2]) for x in inv} == {tuple(inv[0][:2])}, inv
    assert inv[0][:2] != base[0][:2]
    assert inv[0][0] != base[0][0] and inv[0][1] != base[0][1]  # (the schedule kernel's own chunk: its own key)
    assert [x[2] for x in inv] == [base[-1][2] + 2] * 4, (inv, base)


@pytest.mark.compile
def test_traced_build_lowers(tmp_path):
    """The debug builds behind benchmarks/trace_decode.py (clock64 marks, an extra int64 output) lower as the decode
    custom call with the trace output, for a traced config of each dtype."""
    pytest.importorskip("cutlass")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", TOKENSPEED_JAX_DISK_CACHE="0", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _TRACE_SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                       cwd=ROOT, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "TARGETS ['tokenspeed_decode_schedule_sm90', 'tokenspeed_mla_decode_sm90']" in p.stdout, p.stdout[-2000:]
    assert "TRACE_OUT True" in p.stdout and "TRACE_OUT16 True" in p.stdout, p.stdout[-2000:]


_TRACE_SCRIPT = textwrap.dedent(
    r"""
    import dataclasses, re, jax, jax.numpy as jnp
    from benchmarks.decode import bench_case
    from benchmarks.trace_decode import traced_decode
    from tokenspeed_jax.kernels.sm90.decode_trace import TRACE_EVENTS
    from tokenspeed_jax.runtime import target_override
    sd = jax.ShapeDtypeStruct
    f8 = jnp.float8_e4m3fn
    c = dataclasses.replace(bench_case(2, 4096, 64, 32, 2), dtype="float8_e4m3fn")  # fp8_transposed_pv (64 rows)
    with target_override("sm_90a", num_sms=132):
        txt = traced_decode(c, 4, 3).trace(
            sd((2, 2, 32, 576), f8), sd((c.num_pages, 64, 576), f8), sd((2, c.max_pages), jnp.int32),
            sd((2,), jnp.int32), sd((), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    print("TARGETS", sorted(set(re.findall(r"custom_call @(\w+)", txt))))
    print("TRACE_OUT", bool(re.search(r"tensor<3x2x4x%dxi64>" % len(TRACE_EVENTS), txt)))
    c = bench_case(2, 4096, 64, 32, 2)  # bf16, 64 rows: the seesaw loop
    with target_override("sm_90a", num_sms=132):
        txt = traced_decode(c, 5, 2).trace(
            sd((2, 2, 32, 576), jnp.bfloat16), sd((c.num_pages, 64, 576), jnp.bfloat16),
            sd((2, c.max_pages), jnp.int32), sd((2,), jnp.int32), sd((), jnp.float32)).lower(
            lowering_platforms=("cuda",)).as_text()
    print("TRACE_OUT16", bool(re.search(r"tensor<2x2x5x%dxi64>" % len(TRACE_EVENTS), txt)))
    """
)


@pytest.mark.compile
def test_piece_traced_build_lowers():
    """The debug build behind benchmarks/piece_timeline.py (each CTA's pieces recorded: clock64 and globaltimer, an
    extra int64 output) compiles and lowers for each of the four loops, with the prefetch across pieces where the
    table uses it; a piece trace with the loop trace or the batch-invariant walk is refused."""
    pytest.importorskip("cutlass")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", TOKENSPEED_JAX_DISK_CACHE="0", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _PIECE_TRACE_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=900, cwd=ROOT, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for cfg in ("transposed", "seesaw", "fp8_transposed_pv", "fp8_transposed"):
        assert f"PIECES {cfg} True" in p.stdout, p.stdout[-2000:]
    assert p.stdout.count("REFUSED piece_trace") == 2, p.stdout[-2000:]


_PIECE_TRACE_SCRIPT = textwrap.dedent(
    r"""
    import re, jax, jax.numpy as jnp
    from benchmarks.piece_timeline import traced_decode
    from tokenspeed_jax.backends import sm90_decode
    from tokenspeed_jax.decode import _decode_problem
    from tokenspeed_jax.kernels.sm90.decode import build_decode_kernel
    from tokenspeed_jax.kernels.sm90.decode_trace import PIECE_FIELDS
    from tokenspeed_jax.runtime import target_override
    sd = jax.ShapeDtypeStruct
    for dt, H, name in (("bfloat16", 32, "transposed"), ("bfloat16", 128, "seesaw"),
                        ("float8_e4m3fn", 128, "fp8_transposed_pv"), ("float8_e4m3fn", 32, "fp8_transposed")):
        B, pages, dtype = 3, 16, jnp.dtype(dt)
        args = (sd((B, 1, H, 576), dtype), sd((B * pages + 1, 64, 576), dtype), sd((B, pages), jnp.int32),
                sd((B,), jnp.int32))
        with target_override("sm_90a", num_sms=132):
            prob = _decode_problem(*args, True, 512, True)
            cfg = sm90_decode.CONFIGS[name]
            plan = sm90_decode.plan_for_config(prob, cfg)
            G = sm90_decode.schedule_spec(prob, plan).num_ctas
            txt = traced_decode(prob, cfg, 5).trace(*args, sd((), jnp.float32), (
                sd((G, 8), jnp.int32), sd((B, 2), jnp.int32))).lower(lowering_platforms=("cuda",)).as_text()
        ok = bool(re.search(r"tensor<%dx5x%dxi64>" % (G * plan.num_m_blocks, len(PIECE_FIELDS)), txt))
        print("PIECES", name, ok, flush=True)
    kw = dict(loop="seesaw", producer=True, dtype="bfloat16", num_heads=128, q_len=1, page_size=64, causal=True,
              num_ctas=66, max_slots=130, piece_trace=4)
    for bad in ({"trace": 2}, {"chunk": 4096}):
        try:
            build_decode_kernel(**kw, **bad)
        except ValueError as e:
            print("REFUSED", str(e).split(":")[0])
    """
)


def _nvdisasm_wheel() -> bool:
    """Whether the ``nvidia-cuda-nvdisasm`` wheel (a test dependency) ships an ``nvdisasm`` binary: where the CuTe DSL
    looks for it (the distribution's file list; the binary moved between wheel versions, to ``nvidia/cu13/bin`` in
    13.x, so a module path would miss it and leave every SASS check of this file silently skipped)."""
    from importlib import metadata

    try:
        files = metadata.distribution("nvidia-cuda-nvdisasm").files or []
    except metadata.PackageNotFoundError:
        return False
    return any(f.name == "nvdisasm" and os.path.isfile(str(f.locate())) for f in files)


def _prmt(a: int, b: int, sel: int) -> int:
    """``prmt.b32`` (default mode) on Python ints: byte j of the result is byte ``sel[4j+3:4j] & 7`` of {b, a}."""
    src = (b << 32) | a
    return sum(((src >> (8 * ((sel >> (4 * j)) & 7))) & 0xFF) << (8 * j) for j in range(4))


def test_fp8_v_transpose_packed_mapping():
    """The packed FP8 P V transpose (``transpose_v`` with ``vt_packed``: ``ldmatrix.x4.trans``, 4 ``prmt``,
    ``stmatrix.x4`` per 16 tokens x 32 features) on a model of those instructions and of shared memory, with the
    kernel's own addressing (``ldsm_row_offset``, ``stsm_row_offset``, ``p8_selectors``): every ``V^T`` byte of
    the 8 chunks is written once with the right staging byte, tokens in ``P8_TOKEN_ORDER`` inside each 16-token
    group (the order the kernel writes P in), rows of tokens at or past the split read from the zero row, and
    the 8 rows of every matrix of every ``ldmatrix`` / ``stmatrix`` fall in 8 distinct 16-byte bank groups."""
    pytest.importorskip("cutlass")
    import numpy as np

    from tokenspeed_jax.kernels.sm90.fp8_operands import (
        P8_TOKEN_ORDER,
        ldsm_row_offset,
        p8_selectors,
        stsm_row_offset,
        sw64,
    )

    rng = np.random.default_rng(1)
    staging = rng.integers(1, 256, (8, 64, 64), dtype=np.uint8)  # chunk, token, feature (logical)
    first = 37  # tokens >= first are past the split
    stage_mem = np.zeros((8, 4096), np.uint8)
    for t in range(64):
        for x in range(64):
            stage_mem[:, sw64(t * 64 + x)] = staging[:, t, x]
    zero_row = np.zeros(16, np.uint8)
    vt_mem = np.full((8, 4096), -1, np.int32)
    for warp in range(4):
        for c in range(8):
            for hb in range(2):
                rows, ld_groups, st_groups = {}, {}, {}
                for lane in range(32):  # ldmatrix: lane gives the address of row lane % 8 of matrix lane // 8
                    t = 16 * warp + lane % 8 + 8 * ((lane >> 3) & 1)
                    off = ldsm_row_offset(lane, warp, hb)
                    assert off % 16 == 0
                    rows[lane] = zero_row if t >= first else stage_mem[c, off:off + 16]
                    if t < first:
                        ld_groups.setdefault(lane // 8, []).append(off // 16 % 8)
                regs = {}
                for i in range(32):  # .trans: thread i, matrix m: b16 (row 2(i%4), col i//4), (row 2(i%4)+1, ...)
                    sel = p8_selectors(i)
                    r = []
                    for m in range(4):
                        lo, hi = rows[8 * m + 2 * (i % 4)], rows[8 * m + 2 * (i % 4) + 1]
                        b = [lo[2 * (i // 4)], lo[2 * (i // 4) + 1], hi[2 * (i // 4)], hi[2 * (i // 4) + 1]]
                        r.append(int.from_bytes(bytes(int(x) for x in b), "little"))
                    regs[i] = [_prmt(r[0], r[1], sel[0]), _prmt(r[0], r[1], sel[1]),
                               _prmt(r[2], r[3], sel[0]), _prmt(r[2], r[3], sel[1])]
                for lane in range(32):  # stmatrix: row lane % 8 of matrix lane // 8 <- register m of threads 4r..4r+3
                    m, r = lane // 8, lane % 8
                    off = stsm_row_offset(lane, warp, hb)
                    assert off % 16 == 0
                    st_groups.setdefault(m, []).append(off // 16 % 8)
                    data = b"".join(regs[4 * r + q][m].to_bytes(4, "little") for q in range(4))
                    assert (vt_mem[c, off:off + 16] == -1).all()
                    vt_mem[c, off:off + 16] = list(data)
                for what, groups in (("ldmatrix", ld_groups), ("stmatrix", st_groups)):
                    for m, g in groups.items():
                        assert len(set(g)) == len(g), (what, warp, c, hb, m, g)
    assert (vt_mem >= 0).all()
    order = np.array([16 * (p // 16) + P8_TOKEN_ORDER[p % 16] for p in range(64)])
    tok = staging[:, order, :].transpose(0, 2, 1)  # chunk, feature, position
    want = np.where(order[None, None, :] < first, tok, 0)
    got = np.empty_like(want)
    for f in range(64):
        for p in range(64):
            got[:, f, p] = vt_mem[:, sw64(f * 64 + p)]
    np.testing.assert_array_equal(got, want)


def test_trace_summary():
    """benchmarks.trace_decode.summarize: phase lengths between consecutive events (events not reached are
    skipped, the time carried to the next reached one), per warpgroup, warm-up iterations dropped."""
    pytest.importorskip("cutlass")
    import numpy as np

    from benchmarks.trace_decode import summarize
    from tokenspeed_jax.kernels.sm90.decode_trace import TRACE_EVENTS

    ne = len(TRACE_EVENTS)
    tr = np.zeros((2, 2, 5, ne), np.int64)
    for cta in range(2):
        for wg in range(2):
            for j in range(5):
                base = 1000 + 10000 * j + 7 * cta
                tr[cta, wg, j] = base + 100 * np.arange(ne) * (1 + wg)
    tr[:, 1, :, ne - 1] = 0  # WG1 has no last event ("-")
    tr[:, 0, 4, ne - 3:] = 0  # the last iteration stops early
    s = summarize(tr, skip=2)
    assert s["wg0"]["iteration_median"] == 10000 and s["wg1"]["iteration_median"] == 10000
    p0 = {r["phase"]: r for r in s["wg0"]["phases"]}
    assert p0[TRACE_EVENTS[1][0]]["median"] == 100 and p0[TRACE_EVENTS[1][0]]["n"] == 6
    assert p0[TRACE_EVENTS[ne - 1][0]]["n"] == 4  # iterations 2, 3 of 2 CTAs (the 5th stopped early)
    p1 = {r["phase"]: r for r in s["wg1"]["phases"]}
    assert p1[TRACE_EVENTS[1][1]]["median"] == 200 and "-" not in p1
    assert p1["(to the next iteration's top)"]["median"] == 10000 - 200 * (ne - 2)


# The QGMMA m64n32k32 register-A / accumulator layouts (thread, value) -> (m, k) / (m, n) that the O^T schedule's
# addressing assumes (MlaDecodeFp8TransposedPvSm90.load_vt, scale_ot, epilogue_ot); the compile test checks that CuTe's tiled
# MMA prints exactly these.
OT_TV_A = "((4,8,4),(4,2,2)):((256,1,16),(64,8,1024))"
OT_TV_C = "((4,8,4),(2,2,4)):((128,1,16),(64,8,512))"  # N = 32 rows (16 rows: (2,2,2))


def _tv(layout: str, t: int, v: int, vshape, vstride) -> int:
    """Offset of (thread t, value v) in a TV layout ``((4,8,4),vshape):((ts...),vstride)`` (thread modes first)."""
    tshape, tstride = (4, 8, 4), [int(x) for x in layout.split(":")[1][2:].split(")")[0].split(",")]
    off, r = 0, t
    for s, d in zip(tshape, tstride):
        off, r = off + (r % s) * d, r // s
    r = v
    for s, d in zip(vshape, vstride):
        off, r = off + (r % s) * d, r // s
    return off


def test_fp8_ot_vt_fragment_mapping():
    """The O^T schedule's ``V^T`` A fragments (``MlaDecodeFp8TransposedPvSm90.load_vt``: ``ldmatrix.x4.trans`` at
    ``vt_a_row_offset``, ``prmt`` with ``VT_A_SELECTORS``) on a model of those instructions, of the swizzled e4m3
    staging and of the QGMMA's register-A layout: every A element of both warpgroups is the staging byte of feature
    ``ot_feature(...)`` and token ``P8_TOKEN_ORDER`` (the order P is stored in, i.e. the B operand's k), zero for
    tokens at or past the split; the 8 rows of every ldmatrix matrix fall in 8 distinct 16-byte bank groups."""
    pytest.importorskip("cutlass")
    import numpy as np

    from tokenspeed_jax.kernels.sm90.fp8_operands import P8_TOKEN_ORDER, sw64
    from tokenspeed_jax.kernels.sm90.fp8_transposed_pv import VT_A_SELECTORS, ot_feature, vt_a_row_offset

    rng = np.random.default_rng(2)
    v = rng.integers(1, 256, (64, 576), dtype=np.uint8)  # token, feature (logical)
    stg = np.zeros(9 * 4096, np.uint8)
    for t in range(64):
        for f in range(576):
            stg[4096 * (f // 64) + sw64(t * 64 + f % 64)] = v[t, f]
    first = 45  # tokens >= first are past the split

    def a_off(t, val):  # (thread, value) -> m + 64 k
        return _tv(OT_TV_A, t, val, (4, 2, 2), (64, 8, 1024))

    seen = np.zeros((512, 64), bool)
    for wg in range(2):
        for warp in range(4):
            words = {}  # lane -> 32 words
            for kb in range(2):
                for mb in range(4):
                    rows, groups = {}, {}
                    for lane in range(32):
                        tok = 32 * kb + lane
                        off = vt_a_row_offset(lane, warp, kb) + 4096 * (4 * wg + mb)
                        assert off % 16 == 0
                        rows[lane] = np.zeros(16, np.uint8) if tok >= first else stg[off:off + 16]
                        groups.setdefault(lane // 8, []).append(off // 16 % 8)
                    for g in groups.values():
                        assert len(set(g)) == 8, (wg, warp, kb, mb, g)
                    for i in range(32):  # .trans: thread i, matrix m: (row 2(i%4), b16 col i//4), (row 2(i%4)+1, ..)
                        r = []
                        for m in range(4):
                            lo, hi = rows[8 * m + 2 * (i % 4)], rows[8 * m + 2 * (i % 4) + 1]
                            b = [lo[2 * (i // 4)], lo[2 * (i // 4) + 1], hi[2 * (i // 4)], hi[2 * (i // 4) + 1]]
                            r.append(int.from_bytes(bytes(int(x) for x in b), "little"))
                        w = words.setdefault(i, [0] * 32)
                        base = 4 * mb + 16 * kb
                        w[base:base + 4] = [_prmt(r[0], r[1], VT_A_SELECTORS[0]), _prmt(r[0], r[1], VT_A_SELECTORS[1]),
                                            _prmt(r[2], r[3], VT_A_SELECTORS[0]), _prmt(r[2], r[3], VT_A_SELECTORS[1])]
            for lane in range(32):
                t = 32 * warp + lane
                for kb in range(2):
                    for mb in range(4):
                        for val in range(16):  # value (v0, v1, v2): byte v0 of register v1 + 2 v2
                            off = a_off(t, val)
                            m, k = off % 64, off // 64
                            reg = (val // 4) % 2 + 2 * (val // 8)
                            byte = (words[lane][4 * mb + 16 * kb + reg] >> (8 * (val % 4))) & 0xFF
                            assert m // 16 == warp
                            f = ot_feature(wg, mb, warp, m % 16)
                            tok = 32 * kb + 16 * (k // 16) + P8_TOKEN_ORDER[k % 16]
                            want = v[tok, f] if tok < first else 0
                            assert byte == want, (wg, warp, lane, kb, mb, val, f, tok)
                            seen[f, 32 * kb + k] = True
    assert seen.all()  # every (feature, token position) of the tile reached exactly the A operand


def test_fp8_ot_p_word_mapping():
    """The O^T loop's P stores on 64-row blocks (``MlaDecodeFp8TransposedPvSm90.store_p_tile`` without ``qk_t``, and
    ``rescale_p_tile``): on a model of the QGMMA m64n64 accumulator layout, of the thread's e4m3 words and of
    ``prmt``, word ``(h, g)`` at ``p8_word_offset`` holds exactly the bytes the store view (``p_views``: rows of 64
    bytes, tokens in ``P8_TOKEN_ORDER``, the 64-byte swizzle) puts there, and the 8 words of the 128 threads cover
    the 4 KB P tile once; each warp's 32 stores of one word index hit 32 distinct banks."""
    pytest.importorskip("cutlass")
    import numpy as np

    from tokenspeed_jax.kernels.sm90.fp8_operands import P8_TOKEN_ORDER, sw64
    from tokenspeed_jax.kernels.sm90.fp8_transposed_pv import P8_WORD_SELECTORS, p8_word_elements, p8_word_offset

    def prmt(a, b, sel):  # byte j of the result: byte (sel >> 4 j) & 7 of {b, a}
        src = a | (b << 32)
        return sum(((src >> (8 * ((sel >> (4 * j)) & 7))) & 0xFF) << (8 * j) for j in range(4))

    rng = np.random.default_rng(5)
    p = rng.integers(0, 256, (64, 64))  # P (rows, tokens) as e4m3 bytes
    want = np.full(64 * 64, -1)
    for r in range(64):
        for t in range(64):
            want[sw64(r * 64 + 16 * (t // 16) + P8_TOKEN_ORDER.index(t % 16))] = p[r, t]
    got = np.full(64 * 64, -1)
    for warp in range(4):
        for h in range(2):
            for g in range(4):
                banks = set()
                for lane in range(32):
                    q, c = lane // 4, lane % 4
                    # the accumulator element e = v0 + 2 v1 + 4 v2: row 16 warp + q + 8 v1, column 8 v2 + 2 c + v0
                    elem = [p[16 * warp + q + 8 * ((e // 2) % 2), 8 * (e // 4) + 2 * c + e % 2] for e in range(32)]
                    words = [sum(elem[4 * i + j] << (8 * j) for j in range(4)) for i in range(8)]
                    word = prmt(words[2 * g], words[2 * g + 1], P8_WORD_SELECTORS[h])
                    assert [(word >> (8 * j)) & 0xFF for j in range(4)] == [elem[e] for e in p8_word_elements(h, g)]
                    off = p8_word_offset(lane, warp, h, g)
                    assert off % 4 == 0 and (got[off:off + 4] == -1).all(), (warp, lane, h, g)
                    got[off:off + 4] = [(word >> (8 * j)) & 0xFF for j in range(4)]
                    banks.add((off // 4) % 32)
                assert len(banks) == 32, (warp, h, g)
    assert (got == want).all()


def test_staged_pass_features():
    """The staged epilogue's passes: one (bf16) or two (fp32) through the 16-bit Q tile (72 KB), two or four through
    the e4m3 one (36 KB); every choice fits both warpgroups' padded tiles; too little shared memory is refused."""
    pytest.importorskip("cutlass")
    from tokenspeed_jax.kernels.sm90.decode_common import staged_pass_features

    q16, q8 = 64 * 576 * 2, 64 * 576
    assert [staged_pass_features(eb, q) for q in (q16, q8) for eb in (2, 4)] == [256, 128, 128, 64]
    for q in (q16, q8):
        for eb in (2, 4):
            cw = staged_pass_features(eb, q)
            assert 2 * 64 * (cw + 8) * eb <= q and (cw + 8) * eb % 16 == 0  # (16-byte aligned rows)
            assert ((cw + 8) * eb // 4) % 32 == 2 * eb  # a row shifts the banks by one pair store's width x 4 lanes
    with pytest.raises(ValueError, match="too few"):
        staged_pass_features(4, 30000)
