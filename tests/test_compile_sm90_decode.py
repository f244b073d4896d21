"""CPU checks of the sm90 MLA decode kernel: compile for sm_90a, read PTX/SASS, lower mla_decode for CUDA.

The compile runs in a subprocess (``CUTE_DSL_ARCH`` must be set before cutlass is imported, one arch per
process).  SASS checks (HGMMA, no local-memory spills) run when ``nvdisasm`` is available (the test extra installs
``nvidia-cuda-nvdisasm``); otherwise the PTX is checked (wgmma, no ``.local``).
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tokenspeed_jax.backends import sm90_decode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = textwrap.dedent(
    """
    import json, re, sys, glob, os
    import cutlass, cutlass.cute as cute, cutlass.cute.runtime as rt
    from tokenspeed_jax.kernels.sm90.mla_decode import MlaDecodeSm90
    res = {}
    d = os.environ["CUTE_DSL_DUMP_DIR"]
    own = lambda before, ext: "".join(  # text of the dump files a compile added since ``before``
        open(p).read() for p in sorted(set(glob.glob(d + "/*")) - before) if p.endswith(ext))

    def fake_args(k, S, H, page, splits, pages=50, table=24, B=2):
        # the launch arguments of kernel ``k`` as fake tensors: q, cache, table, lengths, scales, out, lse (+ partials)
        f = rt.make_fake_compact_tensor
        dt, ot, R = k.dtype, k.out_dtype, H * S
        a = [rt.make_fake_stream(), f(dt, (B, S, H, 576), assumed_align=16), f(dt, (pages, page, 576), assumed_align=16),
             f(cutlass.Int32, (B, table)), f(cutlass.Int32, (B,)), f(cutlass.Float32, (1,)), f(cutlass.Float32, (1,)),
             f(ot, (B, S, H, 512), assumed_align=16), f(cutlass.Float32, (B, S, H))]
        if splits > 1:
            a += [f(cutlass.Float32, (B, splits, R, 512), assumed_align=16), f(cutlass.Float32, (B, splits, R))]
        return a

    # the O^T and row-split compiles' counts: name -> (pattern, "ptx" or "sass")
    PATS = dict(
        n32=(r"wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3", "ptx"),
        n64=(r"wgmma.mma_async.sync.aligned.m64n64k32", "ptx"),
        n16=(r"wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3", "ptx"),
        qgmma_any=(r"QGMMA\\.64x(?:16|32)x32\\.F32\\.E4M3\\.E4M3", "sass"),
        qgmma_any_r=(r"QGMMA\\.64x(?:16|32)x32\\.F32\\.E4M3\\.E4M3 R\\d+, R\\d+", "sass"),
        qk8=(r"wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3", "ptx"),
        not32=(r"wgmma.mma_async.sync.aligned.m64n(?!32k32)", "ptx"),
        qgmma32=(r"QGMMA\\.64x32x32\\.F32\\.E4M3\\.E4M3", "sass"),
        qgmma32_r=(r"QGMMA\\.64x32x32\\.F32\\.E4M3\\.E4M3 R\\d+, R\\d+", "sass"),
        qgmma64=(r"QGMMA\\.64x64x32\\.F32\\.E4M3\\.E4M3", "sass"),
        ldsm=(r"ldmatrix\\.sync\\.aligned\\.m8n8\\.x4\\.trans\\.shared\\.b16", "ptx"),
        stsm=(r"stmatrix", "ptx"), prmt=(r"prmt\\.b32", "ptx"),
        tma=(r"cp\\.async\\.bulk\\.tensor\\.3d\\.shared::\\w+\\.global\\.tile\\.mbarrier", "ptx"),
        tma_any=(r"cp\\.async\\.bulk\\.tensor", "ptx"),
        maxnreg=(r"setmaxnreg\\.(?:inc|dec)\\.sync\\.aligned\\.u32\\s+(?:240|24);", "ptx"),
        setmaxnreg=(r"setmaxnreg", "ptx"),
        slot_free=(r"bar\\.(?:sync|arrive)\\s+(?:12|13),\\s*160;", "ptx"),
        l2pf=(r"cp\\.async\\.bulk\\.prefetch\\.L2\\.global", "ptx"),
        empty=(r"mbarrier\\.arrive(?!\\.expect_tx)[\\w.:]*\\s", "ptx"),
        spill=(r"\\b(STL|LDL)\\b", "sass"), depbar=(r"WARPGROUP\\.DEPBAR", "sass"),
        shfl=(r"shfl\\.sync\\.bfly", "ptx"), lds4=(r"ld\\.shared\\.v4\\.f32", "ptx"),
        qgmma64_r=(r"QGMMA\\.64x64x32\\.F32\\.E4M3\\.E4M3 R\\d+, R\\d+", "sass"),
        # (the inline-asm word stores / loads of the O^T loop's P; the compiler's own b32 accesses are not counted)
        sts32=(r"begin inline asm\\n\\s*st\\.shared\\.b32", "ptx"),
        lds32=(r"begin inline asm\\n\\s*ld\\.shared\\.b32", "ptx"),
        sts8=(r"st\\.shared\\.u8", "ptx"),
        # (a proxy fence that ends a branch: the P0 rescale's with p0_fence "rescaled"; with "always" it follows the
        # branch's end label)
        fence_end=(r"fence\\.proxy\\.async\\.shared::cta;\\n\\$L__BB", "ptx"),
        fence_all=(r"fence\\.proxy\\.async\\.shared::cta;", "ptx"))

    def ex2_after(sass):
        # MUFU.EX2 between warpgroup 0's SCALE0 arrive (BAR.ARV 0x6), and warpgroup 1's SCALE1 arrive (0x7), and the
        # next named barrier instruction: the exp that runs after the arrive (the O^T loop's softmax "fold" / "max");
        # [-1, -1] without SASS
        res = []
        for bar in ("BAR.ARV 0x6,", "BAR.ARV 0x7,"):
            i = sass.find(bar)
            j = min([k for k in (sass.find("BAR.SYNC", i + 1), sass.find("BAR.ARV", i + 1)) if k > 0] + [len(sass)])
            res.append(sass[i:j].count("MUFU.EX2") if i >= 0 else -1)
        return res

    def dump_counts(ptx, sass, **names):
        # {result key: number of matches of pattern PATS[name]} in a compile's dump, plus whether it has SASS
        return dict({k: len(re.findall(PATS[n][0], ptx if PATS[n][1] == "ptx" else sass)) for k, n in names.items()},
                    sass=bool(sass))

    from tokenspeed_jax.kernels.sm90.mla_decode_seesaw import MlaDecodeSeesawSm90
    cfgs = [("bfloat16", 16, 1, 64, 1, 4096, 64, "lockstep"), ("float16", 32, 4, 32, 3, 256, 64, "lockstep"),
            ("float8_e4m3fn", 128, 2, 128, 2, 512, 64, "lockstep"), ("bfloat16", 32, 2, 32, 3, 256, 64, "overlap"),
            ("float16", 32, 4, 16, 3, 320, 64, "seesaw"), ("bfloat16", 128, 1, 64, 1, 1536, 64, "seesaw"),
            ("bfloat16", 16, 2, 8, 2, 256, 64, "seesaw"), ("bfloat16", 16, 1, 32, 16, 64, 64, "lockstep"),
            ("float8_e4m3fn", 32, 2, 32, 2, 256, 64, "seesaw"), ("float8_e4m3fn", 16, 1, 64, 2, 256, 64, "seesaw16"),
            ("float8_e4m3fn", 16, 4, 32, 3, 256, 64, "seesaw8"),  # (dump names differ early: q shape)
            ("float8_e4m3fn", 8, 8, 32, 3, 256, 64, "seesaw8e"), ("float8_e4m3fn", 4, 16, 32, 3, 256, 64, "seesaw8p"),
            ("float8_e4m3fn", 2, 16, 16, 3, 256, 64, "seesaw8q"), ("float8_e4m3fn", 2, 16, 32, 3, 256, 64, "seesaw8r"),
            ("bfloat16", 32, 2, 32, 3, 256, 64, "seesawp"), ("bfloat16", 16, 4, 32, 3, 256, 64, "seesawq")]
    for (dtype, H, S, page, splits, tps, bn, sched) in cfgs:
        before = set(glob.glob(d + "/*"))
        if sched.startswith("seesaw"):  # seesaw16: an FP8 QK on fp16 operands; seesaw8: FP8 P V on QGMMA too
            k = MlaDecodeSeesawSm90(dtype=dtype, num_heads=H, q_len=S, page_size=page, causal=True,
                                    num_splits=splits, tokens_per_split=tps, block_n=bn,
                                    qk_fp8=sched != "seesaw16", pv_fp8=sched.startswith("seesaw8"),
                                    early_refill=sched in ("seesaw8e", "seesaw8p", "seesaw8r"),
                                    vt_packed=sched in ("seesaw8p", "seesaw8q", "seesaw8r"),
                                    tma_producer=sched in ("seesaw8r", "seesawp", "seesawq"),
                                    cross_first=sched == "seesawq", kv_evict="first" if sched == "seesawq" else "normal",
                                    pdl_main=sched == "seesawq",
                                    # the stores of the backend's 16-bit defaults: 64 rows, one split (the direct
                                    # output) and 3 splits (fp32 partials)
                                    p_stsm=sched == "seesawp" or (dtype == "bfloat16" and H == 128),
                                    o_staged=sched in ("seesawp", "seesaw8r") or (dtype == "bfloat16" and H == 128))
        else:
            k = MlaDecodeSm90(dtype=dtype, num_heads=H, q_len=S, page_size=page, causal=True, num_splits=splits,
                              tokens_per_split=tps, block_n=bn, schedule=sched)
        cute.compile(k, *fake_args(k, S, H, page, splits))
        if splits == 16:  # combine kernel with 8 column chunks x 8 split groups, PDL after the main kernel
            cptx = own(before, ".ptx")
            comb = cptx[cptx.index(".entry kernel_cutlass_combine"):]
            res["comb"] = dict(v4=len(re.findall(r"ld\\.global\\.v4\\.[bf]32", comb)),
                               wait=len(re.findall(r"griddepcontrol\\.wait", comb)),
                               trigger=len(re.findall(r"griddepcontrol\\.launch_dependents", cptx)))
        if sched == "overlap":  # this compile's own dump files
            optx, osass = own(before, ".ptx"), own(before, ".sass")
            res["ov_ptx_wgmma"] = len(re.findall(r"wgmma.mma_async", optx))
            res["ov_ptx_wait1"] = len(re.findall(r"wgmma.wait_group.sync.aligned\\s+1;", optx))
            res["ov_sass"] = bool(osass)
            res["ov_sass_hgmma"] = len(re.findall(r"HGMMA\\.64x(?:32|256)x16", osass))
            res["ov_sass_depbar"] = len(re.findall(r"WARPGROUP\\.DEPBAR", osass))
            res["ov_sass_spill"] = len(re.findall(r"\\b(STL|LDL)\\b", osass))
        if sched.startswith("seesaw"):  # page 16: TMA, 4 boxes per chunk; 64: TMA, 1 box; 8: cp.async
            sptx, ssass = own(before, ".ptx"), own(before, ".sass")
            counts = {  # name: (pattern, "ptx" or "sass") -> number of matches in this compile's dump
                "qk": (r"wgmma.mma_async.sync.aligned.m64n64k16", "ptx"),
                "qk8": (r"wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3", "ptx"),
                "qgmma": (r"QGMMA\\.64x64x32\\.F32\\.E4M3\\.E4M3", "sass"),
                "pv": (r"wgmma.mma_async.sync.aligned.m64n256k16", "ptx"),
                "mbar_cp": (r"cp.async.mbarrier.arrive.noinc", "ptx"),
                "tma": (r"cp\\.async\\.bulk\\.tensor\\.3d\\.shared::\\w+\\.global\\.tile\\.mbarrier", "ptx"),
                "rs": (r"HGMMA\\.64x256x16\\.F32(?:\\.BF16)? R\\d+, R\\d+", "sass"),  # (fp16: no type suffix)
                "cvt": (r"cvt\\.rn\\.f16x2\\.e4m3x2", "ptx"),
                "cvt8": (r"cvt\\.rn\\.satfinite\\.e4m3x2\\.f32", "ptx"),
                "prmt": (r"prmt\\.b32", "ptx"),
                "pv8n256": (r"wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3", "ptx"),
                "qgmma256": (r"QGMMA\\.64x256x32\\.F32\\.E4M3\\.E4M3", "sass"),
                "ldsm": (r"ldmatrix\\.sync\\.aligned\\.m8n8\\.x4\\.trans\\.shared\\.b16", "ptx"),
                "stsm": (r"stmatrix\\.sync\\.aligned\\.m8n8\\.x4\\.shared\\.b16", "ptx"),
                "spill": (r"\\b(STL|LDL)\\b", "sass"),
                "depbar": (r"WARPGROUP\\.DEPBAR", "sass"),
                "clock": (r"%clock64", "ptx"),
                "maxnreg": (r"setmaxnreg\\.(?:inc|dec)\\.sync\\.aligned\\.u32\\s+(?:240|24);", "ptx"),
                "slot_free": (r"bar\\.(?:sync|arrive)\\s+(?:12|13|%r\\d+),\\s*160;", "ptx"),
                "refill160": (r"bar\\.(?:sync|arrive)\\s+(?:10|11|12|13),\\s*160;", "ptx"),
                "evict_first": (str(0x12F0000000000000), "ptx"),  # the TMA loads' cache-policy operand
                "gdc_wait": (r"griddepcontrol\\.wait", "ptx"),
                "gdc_launch": (r"griddepcontrol\\.launch_dependents", "ptx"),
                "stg128": (r"STG\\.E\\.128", "sass"),  # 16-byte global stores
                "stg_elem": (r"STG\\.E(?:\\.U16)?\\s", "sass"),  # 2- and 4-byte global stores
            }
            x = {n: len(re.findall(pat, sptx if src == "ptx" else ssass)) for n, (pat, src) in counts.items()}
            x["pv8"] = x["qk8"] - 4 * 18  # e4m3 m64n64k32 wgmmas beyond the 4 x 18 of the QKs
            res.setdefault("ss", {})[str(page) + ("_" + sched[6:] if sched[6:] else "")] = dict(
                x, use_tma=k.use_tma, sass=bool(ssass))
    # FP8 P V mode 5, the O^T schedule (S x H = 32 rows, page 32: 2 boxes per chunk, 3 splits)
    from tokenspeed_jax.kernels.sm90.mla_decode_ot import MlaDecodeOtSm90
    before = set(glob.glob(d + "/*"))
    k = MlaDecodeOtSm90(dtype="float8_e4m3fn", num_heads=32, q_len=1, page_size=32, causal=True, num_splits=3,
                        tokens_per_split=256, block_n=64, l2_prefetch="late")
    cute.compile(k, *fake_args(k, 1, 32, 32, 3))
    optx, osass = own(before, ".ptx"), own(before, ".sass")
    res["ot_pre"] = (optx, osass)  # (this compile's dump, counted below)
    # ... on whole 64-row blocks (FP8 P V mode 10 with S x H > 32: 128 rows over S = 4, page 64, 2 splits)
    before = set(glob.glob(d + "/*"))
    #     (warpgroup 0's next QK behind its own PV: qk_early "wg0", the backend's default)
    k64 = MlaDecodeOtSm90(dtype="float8_e4m3fn", num_heads=32, q_len=4, page_size=64, causal=True, num_splits=2,
                          tokens_per_split=4096, block_n=64, qk_early="wg0")
    cute.compile(k64, *fake_args(k64, 4, 32, 64, 2))
    qsass = own(before, ".sass")
    res["ot64"] = dict(dump_counts(own(before, ".ptx"), qsass, n64="n64", n32="n32", qgmma="qgmma64",
                                   qgmma_r="qgmma64_r", ldsm="ldsm", sts32="sts32", lds32="lds32", sts8="sts8",
                                   spill="spill", depbar="depbar", fence_end="fence_end", fence_all="fence_all"),
                       tiles=[k64.block_m, k64.num_m_blocks, k64.pv_n], ex2=ex2_after(qsass))
    # ... with the QK once the cross PV retired (TOKENSPEED_SM90_DECODE_OT64_QK=after), and with the next softmax
    #     under the cross PV too (=wg0s, opt-in); B 4 and 5: the dumps' names differ from the compiles around them
    #     (and "wg0" with the P0 rescale's fence inside its branch, TOKENSPEED_SM90_DECODE_OT64_FENCE=rescaled, opt-in)
    #     (and "wg0" with both softmaxes' arrives before their exp, TOKENSPEED_SM90_DECODE_OT_SOFTMAX=fold, opt-in)
    for name, mode, fence, order, nb in (("ot64a", "after", "always", "exp", 4), ("ot64s", "wg0s", "always", "exp", 5),
                                         ("ot64f", "wg0", "rescaled", "exp", 7), ("ot64e", "wg0", "always", "fold", 8)):
        before = set(glob.glob(d + "/*"))
        kq = MlaDecodeOtSm90(dtype="float8_e4m3fn", num_heads=32, q_len=4, page_size=64, causal=True, num_splits=2,
                             tokens_per_split=4096, block_n=64, qk_early=mode, p0_fence=fence, softmax=order)
        cute.compile(kq, *fake_args(kq, 4, 32, 64, 2, B=nb))
        qsass = own(before, ".sass")
        res[name] = dict(dump_counts(own(before, ".ptx"), qsass, n64="n64", qgmma="qgmma64", qgmma_r="qgmma64_r",
                                     sts32="sts32", lds32="lds32", spill="spill", depbar="depbar",
                                     fence_end="fence_end", fence_all="fence_all"), ex2=ex2_after(qsass))
    for name, kw in (("ot64q_32", dict(q_len=1, qk_early="wg0s")), ("ot64q_late", dict(q_len=4, p0_late=True)),
                     ("ot64q_bad", dict(q_len=4, qk_early="both")), ("ot64f_32", dict(q_len=1, p0_fence="rescaled")),
                     ("ot64f_late", dict(q_len=4, qk_early="after", p0_late=True, p0_fence="rescaled")),
                     ("ot64f_bad", dict(q_len=4, p0_fence="never"))):
        try:
            MlaDecodeOtSm90(dtype="float8_e4m3fn", num_heads=32, page_size=64, causal=True, num_splits=1,
                            tokens_per_split=4096, block_n=64, **{"qk_early": "wg0", **kw})
            res[name] = "accepted"
        except ValueError as e:
            res[name] = str(e)
    # ... with warpgroup 0's P0 stored once, after warpgroup 1's fold (TOKENSPEED_SM90_DECODE_OT64_P0=late)
    before = set(glob.glob(d + "/*"))
    kl = MlaDecodeOtSm90(dtype="float8_e4m3fn", num_heads=32, q_len=4, page_size=64, causal=True, num_splits=2,
                         tokens_per_split=4096, block_n=64, p0_late=True)
    cute.compile(kl, *fake_args(kl, 4, 32, 64, 2, B=3))  # (B 3: the dump's name differs from the compile above)
    res["ot64l"] = dump_counts(own(before, ".ptx"), own(before, ".sass"), n64="n64", qgmma="qgmma64",
                               qgmma_r="qgmma64_r", sts32="sts32", lds32="lds32", spill="spill", depbar="depbar")
    try:
        MlaDecodeOtSm90(dtype="float8_e4m3fn", num_heads=32, q_len=1, page_size=64, causal=True, num_splits=1,
                        tokens_per_split=4096, block_n=64, p0_late=True)
        res["ot64l_32"] = "accepted"
    except ValueError as e:
        res["ot64l_32"] = str(e)
    # ... mode 6, the QK transposed too (64 rows, S = 2: two 32-row tiles; page 64, one split: the direct epilogue)
    before = set(glob.glob(d + "/*"))
    kt = MlaDecodeOtSm90(dtype="float8_e4m3fn", num_heads=32, q_len=2, page_size=64, causal=True, num_splits=1,
                         tokens_per_split=4096, block_n=64, l2_prefetch="late", qk_t=True)
    cute.compile(kt, *fake_args(kt, 2, 32, 64, 1))
    tptx, tsass = own(before, ".ptx"), own(before, ".sass")
    res["ot_t"] = dict(dump_counts(tptx, tsass, n32="n32", n64="n64", qgmma_r="qgmma32_r", qgmma="qgmma32",
                                   ldsm="ldsm", spill="spill", depbar="depbar", shfl="shfl", lds4="lds4"),
                       tiles=[kt.block_m, kt.num_m_blocks, kt.pv_n])
    # ... with warpgroup 0's next QK right after its P0 store (TOKENSPEED_SM90_DECODE_OT32_QK=wg0, the backend's
    #     default), and with that and the softmax order "max" (..._OT_SOFTMAX's "auto", the default, runs it on
    #     these tiles: both arrives before the exps, warpgroup 1's column maxima before its SCALE0 wait); B 6 and 7:
    #     the dumps' names differ from the compile above
    for name, order, nb in (("ot_tq", "exp", 6), ("ot_te", "max", 7)):
        before = set(glob.glob(d + "/*"))
        kq = MlaDecodeOtSm90(dtype="float8_e4m3fn", num_heads=32, q_len=2, page_size=64, causal=True, num_splits=1,
                             tokens_per_split=4096, block_n=64, l2_prefetch="late", qk_t=True, qk_early="wg0",
                             softmax=order)
        cute.compile(kq, *fake_args(kq, 2, 32, 64, 1, B=nb))
        qsass = own(before, ".sass")
        res[name] = dict(dump_counts(own(before, ".ptx"), qsass, n32="n32", qgmma_r="qgmma32_r", qgmma="qgmma32",
                                     spill="spill", depbar="depbar"), ex2=ex2_after(qsass))
    # ... the same with the transposed-butterfly column maxima (TOKENSPEED_SM90_DECODE_COLMAX=xpose)
    before = set(glob.glob(d + "/*"))
    kx = MlaDecodeOtSm90(dtype="float8_e4m3fn", num_heads=32, q_len=2, page_size=64, causal=True, num_splits=1,
                         tokens_per_split=4096, block_n=64, l2_prefetch="late", qk_t=True, colmax="xpose")
    cute.compile(kx, *fake_args(kx, 2, 32, 64, 1, B=3))  # (B 3: the dump's name differs from the compile above)
    res["ot_x"] = dump_counts(own(before, ".ptx"), own(before, ".sass"), n32="n32", qgmma="qgmma32", spill="spill",
                              depbar="depbar", shfl="shfl", lds4="lds4")
    # ... each warpgroup on its own tiles (TOKENSPEED_SM90_DECODE_OT32_LOOP=own, the backend's default on the 32- and
    #     16-row tiles): 32 rows with 3 splits (split partials), 16 rows with one (the direct epilogue); B 8 and 9: the
    #     dumps' names differ from the compiles above
    from tokenspeed_jax.kernels.sm90.mla_decode_ot_own import MlaDecodeOtOwnSm90
    for name, H, splits, nb in (("own32", 32, 3, 8), ("own16", 16, 1, 9)):
        before = set(glob.glob(d + "/*"))
        ko = MlaDecodeOtOwnSm90(dtype="float8_e4m3fn", num_heads=H, q_len=1, page_size=64, causal=True,
                                num_splits=splits, tokens_per_split=4096, block_n=64, qk_t=True)
        cute.compile(ko, *fake_args(ko, 1, H, 64, splits, B=nb))
        res[name] = dict(dump_counts(own(before, ".ptx"), own(before, ".sass"), n32="n32", n16="n16", n64="n64",
                                     qgmma="qgmma_any", qgmma_r="qgmma_any_r", ldsm="ldsm", spill="spill",
                                     depbar="depbar"), tiles=[ko.block_m, ko.num_m_blocks, ko.pv_n])
    for name, kw in (("own_noqkt", dict(qk_t=False)), ("own_qk", dict(qk_t=True, qk_early="wg0")),
                     ("own_bad", dict(qk_t=True, loop32="shared"))):
        try:
            MlaDecodeOtOwnSm90(dtype="float8_e4m3fn", num_heads=32, q_len=1, page_size=64, causal=True, num_splits=1,
                               tokens_per_split=4096, block_n=64, **kw)
            res[name] = "accepted"
        except ValueError as e:
            res[name] = str(e)
    # FP8 P V mode 8, the row-split loop (S x H = 128: two 64-row blocks; page 32: 2 boxes per chunk; 3 splits)
    from tokenspeed_jax.kernels.sm90.mla_decode_rs import MlaDecodeRsSm90
    before = set(glob.glob(d + "/*"))
    kr = MlaDecodeRsSm90(dtype="float8_e4m3fn", num_heads=32, q_len=4, page_size=32, causal=True, num_splits=3,
                         tokens_per_split=256, block_n=64)
    cute.compile(kr, *fake_args(kr, 4, 32, 32, 3))
    rptx, rsass = own(before, ".ptx"), own(before, ".sass")
    res["rs"] = dict(dump_counts(rptx, rsass, n32="n32", other="not32", qgmma="qgmma32", qgmma_r="qgmma32_r",
                                 ldsm="ldsm", tma="tma", maxnreg="maxnreg", empty="empty", spill="spill",
                                 depbar="depbar"),
                     tiles=[kr.block_m, kr.num_m_blocks, kr.pv_n, kr.stages])
    # ... with S x H <= 32: one computing warpgroup and the producer (256 threads, no setmaxnreg), 5 buffers
    before = set(glob.glob(d + "/*"))
    k1 = MlaDecodeRsSm90(dtype="float8_e4m3fn", num_heads=16, q_len=1, page_size=64, causal=True, num_splits=2,
                         tokens_per_split=512, block_n=64, stages=5)
    cute.compile(k1, *fake_args(k1, 1, 16, 64, 2))
    rptx, rsass = own(before, ".ptx"), own(before, ".sass")
    res["rs1"] = dict(dump_counts(rptx, rsass, n32="n32", maxnreg="setmaxnreg", tma="tma_any", spill="spill",
                                  depbar="depbar"), threads=k1.cta_threads)
    try:
        MlaDecodeRsSm90(dtype="float8_e4m3fn", num_heads=32, q_len=4, page_size=32, causal=True, num_splits=1,
                        tokens_per_split=256, block_n=64, stages=6)
        res["rs_stages6"] = "accepted"
    except ValueError as e:
        res["rs_stages6"] = str(e)
    optx, osass = res.pop("ot_pre")
    res["ot"] = dump_counts(optx, osass, qk8="qk8", pv8="n32", qgmma="qgmma64", qgmma_r="qgmma32_r", ldsm="ldsm",
                            stsm="stsm", prmt="prmt", tma="tma", maxnreg="maxnreg", slot_free="slot_free", l2pf="l2pf",
                            spill="spill", depbar="depbar")
    res["ot_tv"] = k.pv_mma_repr  # the register-A QGMMA of the O^T PV, as traced
    # L2 prefetch one tile pair ahead (page 64, a table long enough that no prefetch is provably past the
    # split): pair 1 in the prologue, then one pair per iteration of WG0's loop, one bulk prefetch per tile
    before = set(glob.glob(d + "/*"))
    k = MlaDecodeSeesawSm90(dtype="bfloat16", num_heads=16, q_len=1, page_size=64, causal=True, num_splits=2,
                            tokens_per_split=4096, block_n=64, l2_prefetch="late")
    cute.compile(k, *fake_args(k, 1, 16, 64, 2, pages=500, table=400))
    pptx, psass = own(before, ".ptx"), own(before, ".sass")
    from tokenspeed_jax.kernels.sm90.mla_decode_seesaw import L2_PREFETCH_MODES
    res["l2pf_modes"] = list(L2_PREFETCH_MODES)
    res["l2pf"] = dict(ptx=len(re.findall(r"cp\\.async\\.bulk\\.prefetch\\.L2\\.global", pptx)),
                       sass=bool(psass), spill=len(re.findall(r"\\b(STL|LDL)\\b", psass)))
    kw = dict(dtype="bfloat16", num_heads=16, q_len=1, causal=True, num_splits=1, tokens_per_split=64, block_n=64)
    try:
        MlaDecodeSeesawSm90(page_size=8, kv_load="tma", **kw)
        res["tma_page8"] = "accepted"
    except ValueError as e:
        res["tma_page8"] = str(e)
    res["forced_cp_uses_tma"] = MlaDecodeSeesawSm90(page_size=64, kv_load="cp.async", **kw).use_tma
    try:
        MlaDecodeSeesawSm90(page_size=8, **dict(kw, dtype="float8_e4m3fn"))
        res["fp8_cp"] = "accepted"
    except ValueError as e:
        res["fp8_cp"] = str(e)
    ptx = "".join(open(p).read() for p in glob.glob(d + "/*.ptx"))
    sass = "".join(open(p).read() for p in glob.glob(d + "/*.sass"))
    res["ptx_wgmma"] = len(re.findall(r"wgmma.mma_async", ptx))
    res["ptx_local"] = len(re.findall(r"\\.local", ptx))
    res["entries"] = sorted(set(re.findall(r"\\.entry\\s+(\\w+)", ptx)))
    res["sass"] = bool(sass)
    res["sass_hgmma"] = len(re.findall(r"HGMMA", sass))
    res["sass_spill"] = len(re.findall(r"\\b(STL|LDL)\\b", sass))
    # lowering of the public op for CUDA, on this CPU machine
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
    res["targets"] = sorted(set(re.findall(r"custom_call @(\\w+)", txt)))
    # the opt-in schedule through the public op, selected by the environment variable
    from tokenspeed_jax.backends.sm90_decode import SCHEDULE_ENV
    os.environ[SCHEDULE_ENV] = "overlap"
    with target_override("sm_90a"):
        txt = jax.jit(f).trace(sd((2, 1, 16, 576), jnp.bfloat16), sd((100, 64, 576), jnp.bfloat16),
                               sd((2, 40), jnp.int32), sd((2,), jnp.int32), sd((), jnp.float32),
                               sd((), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    res["ov_targets"] = sorted(set(re.findall(r"custom_call @(\\w+)", txt)))
    # FP8 P V modes 5 and 8 through the public op: 16 query rows run the O^T kernel, 64 (mode 8) the row-split
    # kernel (each kernel's entry in its lowering's PTX)
    from tokenspeed_jax.backends.sm90_decode import FP8_PV_ENV
    del os.environ[SCHEDULE_ENV]
    f8 = jnp.float8_e4m3fn
    for mode, S, H, name, entry in (("5", 1, 16, "ot_lower", "ot_kernel\\w*MlaDecodeOtSm90"),
                                    ("8", 2, 32, "rs_lower", "rs_kernel\\w*MlaDecodeRsSm90")):
        os.environ[FP8_PV_ENV] = mode
        before = set(glob.glob(d + "/*"))
        with target_override("sm_90a"):
            txt = jax.jit(f).trace(sd((3, S, H, 576), f8), sd((200, 64, 576), f8), sd((3, 40), jnp.int32),
                                   sd((3,), jnp.int32), sd((), jnp.float32),
                                   sd((), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
        res[name] = dict(targets=sorted(set(re.findall(r"custom_call @(\\w+)", txt))),
                         entry=bool(re.search(r"\\.entry kernel_cutlass_" + entry, own(before, ".ptx"))))
    del os.environ[FP8_PV_ENV]
    # the transposed 16-bit loop (TOKENSPEED_SM90_DECODE_T16): bf16 with 16 rows (pv_n 16), page 64, 2 splits; fp16 with
    # 32 rows over S = 2 (pv_n 32), page 32 (2 boxes per chunk), one split (the direct epilogue); its refusals; and
    # through the public op with the switch set
    from tokenspeed_jax.kernels.sm90.mla_decode_ot16 import MlaDecodeOt16Sm90
    # (t16q: P^T in the Q tile and per-chunk mbarriers, TOKENSPEED_SM90_DECODE_T16_PT=q and _T16_BARS=chunk; H32, a
    # shape of its own, since the dump files are named by the argument shapes)
    for name, dt, H, S, page, splits in (("t16", "bfloat16", 16, 1, 64, 2), ("t16b", "float16", 16, 2, 32, 1),
                                         ("t16q", "bfloat16", 32, 1, 64, 2)):
        before = set(glob.glob(d + "/*"))
        kt = MlaDecodeOt16Sm90(dtype=dt, num_heads=H, q_len=S, page_size=page, causal=True, num_splits=splits,
                               tokens_per_split=256, block_n=64, l2_prefetch="late", pt_q=name == "t16q",
                               chunk_bars=name == "t16q")
        cute.compile(kt, *fake_args(kt, S, H, page, splits))
        tptx, tsass = own(before, ".ptx"), own(before, ".sass")
        n = kt.pv_n
        res[name] = dict(dump_counts(tptx, tsass, tma="tma", maxnreg="maxnreg", l2pf="l2pf", spill="spill",
                                     depbar="depbar"), n=n,
                         wg=len(re.findall(r"wgmma\\.mma_async\\.sync\\.aligned\\.m64n%dk16\\.f32" % n, tptx)),
                         other=len(re.findall(r"wgmma\\.mma_async\\.sync\\.aligned\\.m64n(?!%dk16)" % n, tptx)),
                         hgmma=len(re.findall(r"HGMMA\\.64x%dx16\\.F32" % n, tsass)),
                         refill160=len(re.findall(r"bar\\.(?:sync|arrive)\\s+(?:10|11|12|13),\\s*160;", tptx)),
                         expect=len(re.findall(r"mbarrier\\.arrive\\.expect_tx", tptx)),
                         waits=len(re.findall(r"mbarrier\\.try_wait", tptx)))
    refused = []
    for kw in (dict(dtype="bfloat16", num_heads=64, q_len=1, page_size=64), dict(dtype="bfloat16", num_heads=16,
               q_len=1, page_size=16), dict(dtype="float8_e4m3fn", num_heads=16, q_len=1, page_size=64)):
        try:
            MlaDecodeOt16Sm90(causal=True, num_splits=1, tokens_per_split=256, block_n=64, **kw)
            refused.append("accepted")
        except ValueError as e:
            refused.append(str(e))
    res["t16_refused"] = refused
    from tokenspeed_jax.backends.sm90_decode import T16_ENV
    os.environ[T16_ENV] = "1"
    before = set(glob.glob(d + "/*"))
    with target_override("sm_90a"):
        txt = jax.jit(f).trace(sd((3, 1, 16, 576), jnp.bfloat16), sd((200, 64, 576), jnp.bfloat16),
                               sd((3, 40), jnp.int32), sd((3,), jnp.int32), sd((), jnp.float32),
                               sd((), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    res["t16_lower"] = dict(targets=sorted(set(re.findall(r"custom_call @(\\w+)", txt))), entry=bool(re.search(
        r"\\.entry kernel_cutlass_seesaw_kernel\\w*MlaDecodeOt16Sm90", own(before, ".ptx"))))
    del os.environ[T16_ENV]
    print("RESULT " + json.dumps(res))
    """
)


@pytest.mark.compile
def test_sm90_decode_compiles_for_sm90a(tmp_path):
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_DUMP_DIR=str(tmp_path), TOKENSPEED_JAX_DISK_CACHE="0",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    have_nvdisasm = shutil.which("nvdisasm") is not None or _nvdisasm_wheel()
    env["CUTE_DSL_KEEP"] = "ptx,sass" if have_nvdisasm else "ptx"
    p = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                       cwd=ROOT, check=False)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and line, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(line[0][7:])
    with open(os.path.join(str(tmp_path), "result.json"), "w") as fh:  # (for a re-check without recompiling)
        json.dump(r, fh)
    check_compile_result(r)


def check_compile_result(r: dict) -> None:
    """The assertions of :func:`test_sm90_decode_compiles_for_sm90a` on its compile script's result (a dict of
    counts from the dumps; the test also leaves it in ``result.json`` of its tmp dir)."""
    assert r["ptx_wgmma"] >= 3 * 40, r  # 36 QK (64x32x16) + 4 PV (64x256x16) per kernel
    assert r["ptx_local"] == 0, r
    # the compute-sanitizer run of tests/gpu/test_sm90_decode.py filters kernels by this name substring
    assert len(r["entries"]) >= 5 and all("MlaDecode" in e for e in r["entries"]), r["entries"]
    if r["sass"]:
        assert r["sass_hgmma"] >= 3 * 40, r
        # the only spill of all these builds: FP8 mode 4 with 32-token pages keeps one value in local memory (4
        # bytes, stored in the prologue, reloaded at the computing warpgroups' start and in the epilogue, never in
        # the loop; with 64-token pages, the benchmark's, none); below
        # and mode 10's 64-row O^T loop: 16 bytes of loop-invariant reloads (below)
        assert r["sass_spill"] == (r["ss"]["32_8r"]["spill"] + r["ot64"]["spill"] + r["ot64a"]["spill"]
                                   + r["ot64s"]["spill"] + r["ot64l"]["spill"] + r["ot64f"]["spill"]
                                   + r["ot64e"]["spill"] + r["ot_te"]["spill"] + r["own32"]["spill"]
                                   + r["own16"]["spill"]), r
    assert "tokenspeed_mla_decode_sm90" in r["targets"], r
    # combine over 16 splits: each of a thread's 2 splits (16 / 8 groups) is one 16-byte load; PDL
    assert r["comb"] == {"v4": 2, "wait": 1, "trigger": 1}, r["comb"]
    # schedule "overlap": 36 QK + 4 PV in the loop + 4 PV after it; PV(i-1) retired by wait_group(1) while
    # QK(i) stays async; ptxas must not serialize the wgmmas (that shows as a WARPGROUP.DEPBAR per HGMMA)
    assert r["ov_ptx_wgmma"] >= 44 and r["ov_ptx_wait1"] >= 1, r
    if r["ov_sass"]:
        assert r["ov_sass_hgmma"] >= 44 and r["ov_sass_depbar"] <= 4 and r["ov_sass_spill"] == 0, r
    assert "tokenspeed_mla_decode_sm90" in r["ov_targets"], r
    # schedule "seesaw": 2 x 36 QK (prologue) + 36 per warpgroup loop, 4 PVs of 4 k-steps (2 with P from
    # registers); 4 column-group refills in the prologue + 2 per warpgroup loop completing mbarriers, by TMA
    # (18 + 18 chunks, times the boxes per chunk) for pages >= 16, else by cp.async
    ss = r["ss"]
    for page, boxes in (("16", 4), ("64", 1), ("8", 0)):
        x = ss[page]
        assert x["qk"] == 4 * 36 and x["pv"] == 16, (page, x)
        assert x["use_tma"] == (boxes > 0), (page, x)
        if boxes:
            assert x["tma"] == 36 * boxes and x["mbar_cp"] == 0, (page, x)
        else:
            assert x["tma"] == 0 and x["mbar_cp"] >= 8, (page, x)
        if x["sass"]:
            assert x["rs"] == 8 and x["spill"] == 0, (page, x)
    # FP8 seesaw (page 32: 2 boxes per chunk): QK on FP8 tensor cores straight from the e4m3 q tile and
    # the landed e4m3 boxes (4 QKs x 9 chunks x 2 k32 steps), only V upcast in place to fp16 after the QK:
    # 16 cvt.e4m3x2 per thread and chunk, 4 x 8 chunks; no q upcast
    x = ss["32"]
    assert x["use_tma"] and x["qk"] == 0 and x["qk8"] == 4 * 18 and x["pv"] == 16 and x["tma"] == 72, x
    assert x["mbar_cp"] == 0 and x["cvt"] == 32 * 16, x
    if x["sass"]:
        assert x["qgmma"] == 4 * 18 and x["spill"] == 0, x
    # the same with qk_fp8=False (page 64): the whole slot upcast before a 16-bit QK: 36 chunks + q (2 rows x
    # 9 x 4)
    x = ss["64_16"]
    assert x["use_tma"] and x["qk"] == 4 * 36 and x["qk8"] == 0 and x["tma"] == 36 and x["cvt"] == 36 * 16 + 72, x
    if x["sass"]:
        assert x["spill"] == 0, x
    # FP8 P V on FP8 tensor cores too (pv_fp8, page 32): the same 72 QK QGMMAs plus 4 PVs x 4 chunks x 2 k32
    # steps, no 16-bit wgmma; no upcast: V transposed in smem (4 sites, each a loop over 4 batches of 4 blocks x
    # 12 byte permutes per thread), P cast to e4m3 at 3 sites (16 cvt of 2 values each)
    x = ss["32_8"]
    assert x["use_tma"] and x["qk"] == 0 and x["qk8"] == 4 * 18 + 32 and x["pv8"] == 32 and x["pv"] == 0, x
    assert x["cvt"] == 0 and x["prmt"] == 4 * 4 * 12 and x["cvt8"] == 3 * 16 and x["tma"] == 72, x
    if x["sass"]:
        assert x["qgmma"] == 4 * 18 + 32 and x["rs"] == 0 and x["spill"] == 0, x
    # ... with whole-slot refills right after the transpose (early_refill): 9 chunks x 2 boxes per refill, 2 in
    # the prologue, 2 after the first transposes, 1 per warpgroup loop
    x = ss["32_8e"]
    assert x["qk8"] == 4 * 18 + 32 and x["pv8"] == 32 and x["pv"] == 0 and x["tma"] == 3 * 36, x
    if x["sass"]:
        assert x["qgmma"] == 4 * 18 + 32 and x["spill"] == 0, x
    # packed slots (vt_packed, page 32, early refills): each PV one QGMMA m64n256k32 per k32 step (4 PVs x 2), the
    # transpose 2 chunks x 2 halves of (ldmatrix.x4.trans, 4 prmt, stmatrix.x4) per loop iteration at 4 sites
    x = ss["32_8p"]
    assert x["qk8"] == 4 * 18 and x["pv8"] == 0 and x["pv8n256"] == 8 and x["pv"] == 0 and x["tma"] == 3 * 36, x
    assert x["ldsm"] == 4 * 4 and x["stsm"] == 4 * 4 and x["prmt"] == 4 * 16 and x["cvt8"] == 3 * 16, x
    if x["sass"]:
        assert x["qgmma"] == 4 * 18 and x["qgmma256"] == 8 and x["spill"] == 0, x
    # ... page 16 (4 boxes per chunk), without the early refills (the backend's mode "3" there)
    x = ss["16_8q"]
    assert x["qk8"] == 4 * 18 and x["pv8n256"] == 8 and x["tma"] == 2 * 72 and x["ldsm"] == 16, x
    if x["sass"]:
        assert x["qgmma256"] == 8 and x["spill"] == 0, x
    # ... page 32 with the producer warpgroup (tma_producer, the backend's mode "4"): it issues the 2 prologue refills
    # and the 2 of its loop (one per slot, after the owner's SLOT*_FREE: 2 arrive sites of the owners, 2 syncs);
    # 24 registers for it, 240 for the computing warpgroups (no spill); the loop's transposes and PVs unchanged
    x = ss["32_8r"]
    assert x["qk8"] == 4 * 18 and x["pv8n256"] == 8 and x["tma"] == 2 * 36 and x["ldsm"] == 16, x
    assert x["maxnreg"] == 2 and x["slot_free"] >= 3 and x["clock"] == 0, x
    for key, y in ss.items():
        assert key in ("32_8r", "32_p", "32_q") or y["maxnreg"] == 0, (key, y)
    if x["sass"]:  # (the spill: one value, 1 store and 4 loads outside the loop; see the total above)
        assert x["qgmma256"] == 8 and x["spill"] <= 5, x
        # ... with the staged epilogue (TOKENSPEED_SM90_DECODE_EPILOGUE_FP8=staged, the default; 3 splits: fp32
        # partials through the 36 KB e4m3 Q tile, 4 passes of 64 features, 8 rows per thread and pass)
        assert x["stg128"] == 4 * 8 and x["stg_elem"] < 8, x
    # the 16-bit loop with the producer warpgroup (page 32, TOKENSPEED_SM90_DECODE_PRODUCER16=1): the same wgmmas and
    # TMA copies as without it; its four column-group refills of the prologue and the loop are the producer's, each
    # loop site's warpgroup arrives on the site's REFILL_* barrier (4 arrive sites, 4 syncs of the producer, 160
    # threads); no spill
    x = ss["32_p"]
    assert x["qk"] == 4 * 36 and x["pv"] == 16 and x["tma"] == 36 * 2 and x["maxnreg"] == 2, x
    assert x["refill160"] == 8, x
    if x["sass"]:
        assert x["rs"] == 8 and x["spill"] == 0, x
    # the 16-bit defaults' stores (TOKENSPEED_SM90_DECODE_P_STSM=1, _EPILOGUE=staged): P by 4 stmatrix.x4 at each of
    # the 2 sites (no 32-bit element stores); O through shared memory in 16-byte chunks: 16 rows per thread and pass,
    # 2 passes of fp32 partials here (3 splits), 1 pass of bf16 with one split (page 64, H128); the other 16-bit
    # builds store P by elements and O straight from the accumulators (2 or 4 bytes, 128 per thread)
    assert x["stsm"] == 2 * 4 and ss["64"]["stsm"] == 2 * 4, (x, ss["64"])
    assert ss["16"]["stsm"] == 0 and ss["32_q"]["stsm"] == 0, ss
    if x["sass"]:
        assert x["stg128"] == 2 * 16 and ss["64"]["stg128"] == 16 and x["stg_elem"] < 8, (x, ss["64"])
        assert ss["32_q"]["stg128"] == 0 and ss["32_q"]["stg_elem"] >= 128, ss["32_q"]
    # ... with warpgroup 1's cross PV first and the evict-first hint on the KV loads (page 32, 64 rows): the same
    # wgmmas and copies; each of the producer's 4 warps syncs on one REFILL_* barrier (4 sites) and the computing
    # warpgroups arrive at 4; the hint's policy operand set (the other builds pass none of it)
    x = ss["32_q"]
    assert x["qk"] == 4 * 36 and x["pv"] == 16 and x["tma"] == 36 * 2 and x["maxnreg"] == 2, x
    assert x["refill160"] == 8 and x["evict_first"] >= 1, x
    assert all(y["evict_first"] == 0 for key, y in ss.items() if key != "32_q"), ss
    # ... and launched with PDL (pdl_main): the main kernel waits for the previous grid (griddepcontrol.wait, beside
    # the combine kernel's) and the combine lets the next grid launch (launch_dependents, beside the main kernel's)
    assert x["gdc_wait"] == ss["32_p"]["gdc_wait"] + 1 and x["gdc_launch"] == ss["32_p"]["gdc_launch"] + 1, (x, ss)
    if x["sass"]:
        assert x["rs"] == 8 and x["spill"] == 0 and x["depbar"] <= 8, x
    # FP8 P V mode 5 (the O^T schedule, 32 rows, page 32): 18 QK QGMMAs (m64n64k32) for the first tile and 18 per
    # warpgroup loop; the PVs m64n32k32 (N = the 32 rows), 4 sites x 2 k32 steps x 4 m-blocks, V^T from registers (8
    # ldmatrix.x4.trans + 32 prmt per PV, no stmatrix); TMA: 4 tiles in the prologue and 2 per pair in the producer's
    # loop x 9 chunks x 2 boxes; 2 SLOT*_FREE arrive sites + 2 producer syncs; one L2 prefetch per tile, prologue and
    # loop; the TV layouts test_fp8_ot_vt_fragment_mapping models; no spill
    x = r["ot"]
    assert x["qk8"] == 18 * 3 and x["pv8"] == 32 and x["ldsm"] == 32 and x["prmt"] >= 128 and x["stsm"] == 0, x
    assert x["tma"] == (4 + 2) * 18 and x["maxnreg"] == 2 and x["slot_free"] == 4 and x["l2pf"] == 4, x
    assert f"TV Layout A:     {OT_TV_A}" in r["ot_tv"] and f"TV Layout C:     {OT_TV_C}" in r["ot_tv"], r["ot_tv"]
    assert r["ot_lower"] == {"targets": ["tokenspeed_mla_decode_sm90"], "entry": True}, r["ot_lower"]
    if x["sass"]:  # the QK's 54 QGMMA m64n64k32 and the PVs' 32 m64n32k32 with V^T from registers; no spill
        assert x["qgmma"] == 18 * 3 and x["qgmma_r"] == 32 and x["depbar"] <= 12 and x["spill"] == 0, x
    # mode 10's O^T loop on 64-row blocks: 54 QK + 32 PV QGMMAs m64n64k32 (the PVs with V^T from registers); P as 8
    # 32-bit shared stores per store site (one per warpgroup) and warpgroup 0's rescale of P0 from its words (8 loads,
    # 8 stores), no byte stores; no serialized wgmma (ptxas C7512 "insufficient register resources" put a
    # WARPGROUP.DEPBAR after all 86 when P was kept in fp32 across the own PV and both V^T fragment sets were live;
    # C7520 "WG.AR in divergent path" after all of them when qk_early's QK sat inside the dynamic `if`); at most a few
    # reloads (2026-12-02, qk_early "wg0": 10 STL, 36 LDL; "after": 4 STL, 29 LDL)
    x = r["ot64"]
    assert x["n64"] == 18 * 3 + 32 and x["n32"] == 0 and x["ldsm"] == 32 and x["tiles"] == [64, 2, 64], x
    assert x["sts32"] == 8 * 2 + 8 and x["lds32"] == 8 and x["sts8"] == 0, x
    if x["sass"]:
        assert x["qgmma"] == 86 and x["qgmma_r"] == 32 and x["depbar"] <= 12 and x["spill"] <= 56, x
    y = r["ot64a"]
    assert y["n64"] == x["n64"] and y["sts32"] == x["sts32"] and y["lds32"] == x["lds32"], y
    if y["sass"]:
        assert y["qgmma"] == 86 and y["qgmma_r"] == 32 and y["depbar"] <= 12 and y["spill"] <= 40, y
    y = r["ot64s"]  # (2026-12-02: 35 STL, 62 LDL)
    assert y["n64"] == x["n64"] and y["sts32"] == x["sts32"] and y["lds32"] == x["lds32"], y
    if y["sass"]:
        assert y["qgmma"] == 86 and y["qgmma_r"] == 32 and y["depbar"] <= 12 and y["spill"] <= 110, y
    # qk_early "wg0" only on the 64-row blocks, not with p0_late; an unknown mode named
    assert "qk_early='wg0s': not with p0_late, and 'wg0s' only on the 64-row blocks of the" in r["ot64q_32"], r
    assert "p0_late=True" in r["ot64q_late"], r["ot64q_late"]
    assert "qk_early must be one of ('after', 'wg0', 'wg0s', 'wg01')" in r["ot64q_bad"], r["ot64q_bad"]
    # ... p0_fence "rescaled": the P0 rescale's fence moves into its branch (the default's follows the branch's end
    # label: none ends a branch), the other fences and everything else as "wg0" (2026-12-02: the same SASS length and
    # spills); only on the 64-row blocks without p0_late, an unknown mode named
    y = r["ot64f"]
    assert x["fence_end"] == 0 and y["fence_end"] == 1 and y["fence_all"] == x["fence_all"], (x, y)
    assert y["n64"] == x["n64"] and y["sts32"] == x["sts32"] and y["lds32"] == x["lds32"], y
    if y["sass"]:
        assert y["qgmma"] == 86 and y["qgmma_r"] == 32 and y["depbar"] <= 12 and y["spill"] <= 56, y
    assert "p0_fence='rescaled': only the 64-row blocks" in r["ot64f_32"], r["ot64f_32"]
    assert "p0_late=True" in r["ot64f_late"], r["ot64f_late"]
    assert "p0_fence must be one of ('always', 'rescaled')" in r["ot64f_bad"], r["ot64f_bad"]
    # ... softmax "fold": each exp's 32 MUFU.EX2 a thread after its warpgroup's SCALE0 / SCALE1 arrive (with "exp",
    # ptxas puts both arrives after all of them); the same QGMMAs, no serialized wgmma (2026-12-02: 34 STL / 76 LDL,
    # "exp" 10 / 36)
    y = r["ot64e"]  # (two more word loads: the zero word that orders each exp after its arrive, publish)
    assert y["n64"] == x["n64"] and y["sts32"] == x["sts32"] and y["lds32"] == x["lds32"] + 2, y
    if y["sass"]:
        assert x["ex2"] == [0, 0] and y["ex2"] == [32, 32], (x["ex2"], y["ex2"])
        assert y["qgmma"] == 86 and y["qgmma_r"] == 32 and y["depbar"] <= 12 and y["spill"] <= 130, y
    # ... p0_late: the same QGMMAs; P stored once per warpgroup and tile (2 sites of 8 words), no rescale loads; 32 rows
    # refused (only the 64-row blocks)
    y = r["ot64l"]
    assert y["n64"] == x["n64"] and y["sts32"] == 8 * 2 and y["lds32"] == 0, y
    if y["sass"]:
        assert y["qgmma"] == 86 and y["qgmma_r"] == 32 and y["depbar"] <= 12 and y["spill"] <= 40, y
    assert "p0_late" in r["ot64l_32"], r["ot64l_32"]
    # mode 6 (the QK transposed too; 64 rows in two 32-row tiles): all 54 + 32 QGMMAs m64n32k32 (S^T = K Q^T with
    # the rows as N, and the PVs), the PVs' with V^T from registers; no spill
    x = r["ot_t"]
    assert x["n32"] == 18 * 3 + 32 and x["n64"] == 0 and x["ldsm"] == 32 and x["tiles"] == [32, 2, 32], x
    if x["sass"]:
        assert x["qgmma"] == 18 * 3 + 32 and x["qgmma_r"] == 32 and x["depbar"] <= 12 and x["spill"] == 0, x
    # ... with OT32_QK=wg0: the same QGMMAs, no serialized wgmma (the QK issued unconditionally), no spill
    y = r["ot_tq"]
    assert y["n32"] == x["n32"], y
    if y["sass"]:
        assert y["qgmma"] == x["qgmma"] and y["qgmma_r"] == 32 and y["depbar"] <= 12 and y["spill"] == 0, y
    # ... and softmax "max": each exp's 16 MUFU.EX2 a thread after its arrive (with "exp" at most 2 there), a few
    # reloads (2026-12-02: 1 STL / 4 LDL)
    z = r["ot_te"]
    assert z["n32"] == x["n32"], z
    if z["sass"]:
        assert max(y["ex2"]) <= 2 and z["ex2"] == [16, 16], (y["ex2"], z["ex2"])
        assert z["qgmma"] == x["qgmma"] and z["qgmma_r"] == 32 and z["depbar"] <= 12 and z["spill"] <= 8, z
    # ... with colmax "xpose": the same QGMMAs; per fold site (one per warpgroup) 7 shuffles instead of 3 x 8 and the 4
    # warps' maxima as 8 16-byte loads instead of 32 scalar ones; no spill
    y = r["ot_x"]
    assert y["n32"] == x["n32"] and x["shfl"] - y["shfl"] == 2 * (24 - 7) and y["lds4"] - x["lds4"] == 2 * 8, (x, y)
    if y["sass"]:
        assert y["qgmma"] == x["qgmma"] and y["depbar"] <= 12 and y["spill"] == 0, y
    # the "own" loop (each warpgroup its own tiles over all 512 features): the first QK and the loop's next QK (18 each)
    # and the PV over 8 m-blocks x 2 k32 steps with V^T from registers (16 ldmatrix.x4.trans), all N = the rows; no
    # serialized wgmma; spills at 32 rows only outside the loop (2026-12-03, 3 splits: 10 STL / 35 LDL, all in the
    # prologue and the epilogue's merge; 2 splits: 2 / 2; with the next QK beside the PV, 40 / 79 in the loop), none at
    # 16 rows
    for name, n in (("own32", "n32"), ("own16", "n16")):
        y = r[name]
        assert y[n] == 18 * 2 + 16 and y["n64"] == 0 and y["ldsm"] == 16, (name, y)
        assert y["tiles"] == [32, 1, 32 if name == "own32" else 16], (name, y)
        if y["sass"]:
            assert y["qgmma"] == 52 and y["qgmma_r"] == 16 and y["depbar"] <= 6, (name, y)
            assert y["spill"] <= (48 if name == "own32" else 0), (name, y)
    assert "only the O^T loop's 32- / 16-row tiles (qk_t" in r["own_noqkt"], r["own_noqkt"]
    assert "qk_early, softmax and p1_ready keep their defaults" in r["own_qk"], r["own_qk"]
    assert "loop32 must be 'own' here" in r["own_bad"], r["own_bad"]
    # mode 8 (the row-split loop; 128 rows, page 32, 3 splits): only m64n32k32 QGMMAs: the QK (S^T = K Q_w^T, the
    # warpgroup's 32 rows as N) of the first tile and of the loop's next tile, 18 each, and the PV in 4 sets of 2
    # m-blocks x 2 k32 steps with V^T from registers (2 ldmatrix.x4.trans per set and k32 step); TMA: the ring's 4
    # tiles in the prologue and 1 per tile in the producer's loop, x 9 chunks x 2 boxes; each warp releases a buffer
    # on its empty mbarrier (1 arrive site); the producer's setmaxnreg; no spill, and no serialized wgmma (a few
    # explicit waits: the prologue, the step's 2, the PV's 2, after the loop)
    x = r["rs"]
    assert x["n32"] == 18 * 2 + 16 and x["other"] == 0 and x["ldsm"] == 16 and x["tma"] == (4 + 1) * 18, x
    assert x["maxnreg"] == 2 and x["empty"] == 1 and x["tiles"] == [64, 2, 32, 4], x
    if x["sass"]:
        assert x["qgmma"] == 52 and x["qgmma_r"] == 16 and x["spill"] == 0 and x["depbar"] <= 8, x
    x = r["rs1"]  # one computing warpgroup (16 rows): the same QGMMAs, 5 + 1 tile loads, 256 threads, no setmaxnreg
    assert x["n32"] == 52 and x["maxnreg"] == 0 and x["threads"] == 256 and x["tma"] == 6 * 9, x
    if x["sass"]:
        assert x["spill"] == 0 and x["depbar"] <= 8, x
    assert "stages" in r["rs_stages6"], r["rs_stages6"]
    assert r["rs_lower"] == {"targets": ["tokenspeed_mla_decode_sm90"], "entry": True}, r["rs_lower"]
    # the transposed 16-bit loop: only m64nNk16 wgmmas (N = 16 / 32, the rows rounded up), 36 per QK (2 prologue sites,
    # 2 loop sites) and 16 per PV (4 m-blocks x 4 k16 steps, 4 sites); the seesaw loop's TMA copies (18 chunk loads per
    # tile pair in the prologue and in the producer's loop, x 1 or 2 boxes), refill barriers (4 arrive sites + the
    # producer's 4 syncs) and setmaxnreg; no spill, no serialized wgmma; 64 rows, 16-token pages and FP8 refused.  With
    # P^T in the Q tile (t16q) the rope chunk changes group, not the counts; the refills arm (expect-tx) and the QKs
    # wait on the 4 group mbarriers at 8 sites each (prologue, loop), or with per-chunk mbarriers (t16q) on 9 per slot
    # at 36
    for name, n, boxes in (("t16", 16, 1), ("t16b", 32, 2), ("t16q", 32, 1)):
        x = r[name]
        assert x["n"] == n and x["wg"] == 4 * 36 + 4 * 16 and x["other"] == 0 and x["tma"] == 36 * boxes, (name, x)
        assert x["expect"] == x["waits"] == (36 if name == "t16q" else 8), (name, x)
        assert x["maxnreg"] == 2 and x["refill160"] == 8, (name, x)
        if x["sass"]:
            assert x["hgmma"] == 208 and x["spill"] == 0 and x["depbar"] <= 8, (name, x)
    assert [("S x H" in m, "page_size" in m, "bfloat16" in m) for m in r["t16_refused"]] == [
        (True, False, False), (False, True, False), (False, False, True)], r["t16_refused"]
    assert r["t16_lower"] == {"targets": ["tokenspeed_mla_decode_sm90"], "entry": True}, r["t16_lower"]
    # ptxas must not serialize the wgmmas (C7520 "wgmma.mma_async instructions are serialized": a
    # WARPGROUP.DEPBAR after every one, 105 in the FP8 P V kernel of commit e9c62ec, measured on the H200 in that
    # state); the loops wait explicitly at about 7 places
    for key, x in ss.items():
        assert x["clock"] == 0, (key, x)  # the debug traces' clock64 marks (trace_decode) never in a normal build
        if x["sass"]:
            assert x["depbar"] <= 12, (key, x)
    assert "page_size" in r["tma_page8"] and r["forced_cp_uses_tma"] is False, r
    assert "TMA" in r["fp8_cp"], r
    # L2 prefetch (TOKENSPEED_SM90_DECODE_L2_PREFETCH=late): one bulk prefetch per tile of pair 1 in the prologue
    # and of the pair ahead in the loop
    assert r["l2pf"]["ptx"] == 4, r["l2pf"]
    assert tuple(r["l2pf_modes"]) == sm90_decode.L2_PREFETCH_MODES  # the backend's copy (no cutlass import)
    if r["l2pf"]["sass"]:
        assert r["l2pf"]["spill"] == 0, r["l2pf"]


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


def test_fp8_v_transpose_mapping():
    """The FP8 P V transpose (``MlaDecodeSeesawSm90.transpose_v``) run on a model of shared memory, with the
    kernel's own addressing (``vt_word_offsets``) and its per-lane rotations: every V^T byte of the 8 chunks
    is written exactly once with the right staging byte (the QGMMA K-major layout: feature rows of 64 token
    bytes, 64-byte swizzle), tokens at or past the split become zeros, and every word load and store of a
    warp hits 32 distinct banks."""
    pytest.importorskip("cutlass")
    import numpy as np

    from tokenspeed_jax.kernels.sm90.fp8_operands import sw64, vt_word_offsets

    rng = np.random.default_rng(0)
    staging = rng.integers(0, 256, (8, 64, 64), dtype=np.uint8)  # chunk, token, feature (logical)
    first = 61  # tokens >= first are past the split
    stage_mem = np.zeros((8, 4096), np.uint8)  # the upper halves, swizzled as the TMA boxes land
    for t in range(64):
        for x in range(64):
            stage_mem[:, sw64(t * 64 + x)] = staging[:, t, x]
    vt_mem = np.full((8, 4096), -1, np.int32)  # the lower halves, -1 = never written
    word = lambda mem, c, off: int.from_bytes(mem[c, off:off + 4].astype(np.uint8).tobytes(), "little")
    for warp in range(4):
        loads, stores = {}, {}
        for lane in range(32):
            tg = warp * 4 + lane // 8
            rot_r, rot_w = (lane >> 4) & 1, (lane >> 1) & 3
            sel_f = 0x4105 if rot_r else 0x5410
            for c in range(8):
                for h in range(2):
                    fw = lane % 8 + 8 * h
                    regs = []
                    for s in range(4):
                        k = (s + rot_r) & 3
                        rd, _ = vt_word_offsets(tg, fw, k, 0)
                        assert rd % 4 == 0
                        loads.setdefault((c, h, s), []).append(rd // 4 % 32)
                        regs.append(0 if 4 * tg + k >= first else word(stage_mem, c, rd))
                    for s in range(4):
                        i = (s + rot_w) & 3
                        sel = i | ((i + 4) << 4)
                        out = _prmt(_prmt(regs[0], regs[1], sel), _prmt(regs[2], regs[3], sel), sel_f)
                        _, wr = vt_word_offsets(tg, fw, 0, i)
                        stores.setdefault((c, h, s), []).append(wr // 4 % 32)
                        assert (vt_mem[c, wr:wr + 4] == -1).all()
                        vt_mem[c, wr:wr + 4] = list(out.to_bytes(4, "little"))
        for what, banks in (("load", loads), ("store", stores)):
            for key, b in banks.items():
                assert sorted(b) == list(range(32)), (what, warp, key, b)
    assert (vt_mem >= 0).all()
    want = np.where(np.arange(64)[None, None, :] < first, staging.transpose(0, 2, 1), 0)  # chunk, feature, token
    got = np.empty_like(want)
    for f in range(64):
        for t in range(64):
            got[:, f, t] = vt_mem[:, sw64(f * 64 + t)]
    np.testing.assert_array_equal(got, want)


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


_TRACE_SCRIPT = textwrap.dedent(
    """
    import dataclasses, re, jax, jax.numpy as jnp
    from benchmarks.decode import bench_case
    from benchmarks.trace_decode import traced_decode
    from tokenspeed_jax.kernels.sm90.mla_decode_seesaw import TRACE_EVENTS
    from tokenspeed_jax.runtime import target_override
    c = dataclasses.replace(bench_case(2, 4096, 64, 16, 1), dtype="float8_e4m3fn")
    sd = jax.ShapeDtypeStruct
    f8 = jnp.float8_e4m3fn
    with target_override("sm_90a", num_sms=132):
        txt = traced_decode(c, 4, 3, True).trace(
            sd((2, 1, 16, 576), f8), sd((c.num_pages, 64, 576), f8), sd((2, c.max_pages), jnp.int32),
            sd((2,), jnp.int32), sd((), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    print("TARGETS", sorted(set(re.findall(r"custom_call @(\\w+)", txt))))
    print("TRACE_OUT", bool(re.search(r"tensor<3x2x4x%dxi64>" % len(TRACE_EVENTS), txt)))
    c = bench_case(2, 4096, 64, 32, 2)  # bf16: the 16-bit loop
    with target_override("sm_90a", num_sms=132):
        txt = traced_decode(c, 5, 2).trace(
            sd((2, 2, 32, 576), jnp.bfloat16), sd((c.num_pages, 64, 576), jnp.bfloat16),
            sd((2, c.max_pages), jnp.int32), sd((2,), jnp.int32), sd((), jnp.float32)).lower(
            lowering_platforms=("cuda",)).as_text()
    print("TRACE_OUT16", bool(re.search(r"tensor<2x2x5x%dxi64>" % len(TRACE_EVENTS), txt)))
    c = dataclasses.replace(bench_case(2, 4096, 64, 32, 2), dtype="float8_e4m3fn")  # the O^T loop, mode 7
    with target_override("sm_90a", num_sms=132):
        txt = traced_decode(c, 4, 3, True, "7").trace(
            sd((2, 2, 32, 576), f8), sd((c.num_pages, 64, 576), f8), sd((2, c.max_pages), jnp.int32),
            sd((2,), jnp.int32), sd((), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    print("TRACE_OUT_OT", bool(re.search(r"tensor<3x2x4x%dxi64>" % len(TRACE_EVENTS), txt)))
    # the same 64 rows on one 64-row block (mode 10's loop above 32 rows)
    with target_override("sm_90a", num_sms=132):
        txt = traced_decode(c, 4, 3, True, "5").trace(
            sd((2, 2, 32, 576), f8), sd((c.num_pages, 64, 576), f8), sd((2, c.max_pages), jnp.int32),
            sd((2,), jnp.int32), sd((), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    print("TRACE_OUT_OT64", bool(re.search(r"tensor<3x2x4x%dxi64>" % len(TRACE_EVENTS), txt)))
    """
)


@pytest.mark.compile
def test_traced_build_lowers(tmp_path):
    """The debug builds behind benchmarks/trace_decode.py (clock64 marks, an extra int64 output), FP8, BF16 and the
    FP8 O^T loop (mode 7's 32-row tiles, and mode 10's 64-row blocks), compile for sm_90a and lower as the decode
    custom call with the trace output.  (That a normal build carries no mark, its code unchanged, was checked by
    diffing the PTX (seesaw) and the SASS (O^T loop) on 2026-12-01: the marks are compile-time.)"""
    pytest.importorskip("cutlass")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", TOKENSPEED_JAX_DISK_CACHE="0", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _TRACE_SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                       cwd=ROOT, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "TARGETS ['tokenspeed_mla_decode_sm90']" in p.stdout, p.stdout[-2000:]
    assert "TRACE_OUT True" in p.stdout and "TRACE_OUT16 True" in p.stdout, p.stdout[-2000:]
    assert "TRACE_OUT_OT True" in p.stdout and "TRACE_OUT_OT64 True" in p.stdout, p.stdout[-2000:]


def test_colmax_xpose_mapping():
    """``colmax="xpose"`` (``MlaDecodeOtSm90.colmax_xpose`` and the 16-byte reads in ``fold_t``) on a model of the
    shuffles: for 16 and 32 rows, every lane ends with the maximum over the 8 lanes of its column group of the column
    ``colmax_xpose_column`` names, the 4 warps' stores fill exactly the slots the readers load, and each thread's
    two 16-byte loads per column pair give, for every column of its own, the 4 warps' maxima: so ``fold_t`` sees the
    column maxima of the 3-shuffle reduction, bitwise."""
    pytest.importorskip("cutlass")
    import numpy as np

    from tokenspeed_jax.backends.sm90_decode import COLMAX_CHOICES
    from tokenspeed_jax.kernels.sm90.mla_decode_ot import (
        COLMAX_MODES,
        colmax_xpose_column,
        colmax_xpose_index,
    )

    assert COLMAX_MODES == COLMAX_CHOICES  # (the backend keeps its own copy: it imports no cutlass)
    rng = np.random.default_rng(7)
    for pv_n in (16, 32):
        nc = pv_n // 4
        col = [8 * (i // 2) + 2 * (lane % 4) + i % 2 for lane in range(32) for i in range(nc)]  # col_n
        col = np.array(col).reshape(32, nc)
        red = np.full(2 * 4 * 32, np.nan)
        warp_max = {}
        for wg in range(2):
            for w in range(4):
                mx = rng.standard_normal((32, nc))  # each lane's maxima over its own 2 tokens, per column
                for n in range(pv_n):
                    warp_max[wg, w, n] = mx[col == n].max()
                vals = [mx[:, i].copy() for i in range(nc)]  # vals[k][lane]
                own = np.zeros(32, int)
                for r in range(3):
                    h = len(vals) // 2
                    partner = np.arange(32) ^ (4 << r)
                    if h == 0:
                        vals[0] = np.maximum(vals[0], vals[0][partner])
                        continue
                    up = (np.arange(32) >> (2 + r)) & 1 == 1
                    send = [np.where(up, vals[k], vals[h + k]) for k in range(h)]
                    keep = [np.where(up, vals[h + k], vals[k]) for k in range(h)]
                    vals = [np.maximum(keep[k], send[k][partner]) for k in range(h)]
                    own = own + np.where(up, h, 0)
                for lane in range(32):
                    i = colmax_xpose_column(lane, pv_n)
                    assert own[lane] == i
                    n = col[lane, i]
                    assert vals[0][lane] == warp_max[wg, w, n], (pv_n, wg, w, lane)
                    red[colmax_xpose_index(wg, w, lane % 4, i)] = vals[0][lane]
        for wg in range(2):
            for lane in range(32):
                c = lane % 4
                for k in range(nc // 2):
                    a0 = colmax_xpose_index(wg, 0, c, 2 * k)
                    b0 = colmax_xpose_index(wg, 2, c, 2 * k)
                    assert a0 % 4 == 0 and b0 == a0 + 4  # 16-byte aligned slots (the struct field is too)
                    a, b = red[a0:a0 + 4], red[b0:b0 + 4]
                    for p in range(2):
                        n = col[lane, 2 * k + p]
                        want = [warp_max[wg, w, n] for w in range(4)]
                        assert [a[p], a[2 + p], b[p], b[2 + p]] == want, (pv_n, wg, lane, k, p)


def test_trace_summary():
    """benchmarks.trace_decode.summarize: phase lengths between consecutive events (events not reached are
    skipped, the time carried to the next reached one), per warpgroup, warm-up iterations dropped."""
    pytest.importorskip("cutlass")
    import numpy as np

    from benchmarks.trace_decode import summarize
    from tokenspeed_jax.kernels.sm90.mla_decode_seesaw import TRACE_EVENTS

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
# addressing assumes (MlaDecodeOtSm90.load_vt, scale_ot, epilogue_ot); the compile test checks that CuTe's tiled
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
    """The O^T schedule's ``V^T`` A fragments (``MlaDecodeOtSm90.load_vt``: ``ldmatrix.x4.trans`` at
    ``vt_a_row_offset``, ``prmt`` with ``VT_A_SELECTORS``) on a model of those instructions, of the swizzled e4m3
    staging and of the QGMMA's register-A layout: every A element of both warpgroups is the staging byte of feature
    ``ot_feature(...)`` and token ``P8_TOKEN_ORDER`` (the order P is stored in, i.e. the B operand's k), zero for
    tokens at or past the split; the 8 rows of every ldmatrix matrix fall in 8 distinct 16-byte bank groups."""
    pytest.importorskip("cutlass")
    import numpy as np

    from tokenspeed_jax.kernels.sm90.fp8_operands import P8_TOKEN_ORDER, sw64
    from tokenspeed_jax.kernels.sm90.mla_decode_ot import VT_A_SELECTORS, ot_feature, vt_a_row_offset

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
    """The O^T loop's P stores on 64-row blocks (``MlaDecodeOtSm90.store_p_tile`` without ``qk_t``, and
    ``rescale_p_tile``): on a model of the QGMMA m64n64 accumulator layout, of the thread's e4m3 words and of
    ``prmt``, word ``(h, g)`` at ``p8_word_offset`` holds exactly the bytes the store view (``p_views``: rows of 64
    bytes, tokens in ``P8_TOKEN_ORDER``, the 64-byte swizzle) puts there, and the 8 words of the 128 threads cover
    the 4 KB P tile once; each warp's 32 stores of one word index hit 32 distinct banks."""
    pytest.importorskip("cutlass")
    import numpy as np

    from tokenspeed_jax.kernels.sm90.fp8_operands import P8_TOKEN_ORDER, sw64
    from tokenspeed_jax.kernels.sm90.mla_decode_ot import P8_WORD_SELECTORS, p8_word_elements, p8_word_offset

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
    from tokenspeed_jax.kernels.sm90.mla_decode import staged_pass_features

    q16, q8 = 64 * 576 * 2, 64 * 576
    assert [staged_pass_features(eb, q) for q in (q16, q8) for eb in (2, 4)] == [256, 128, 128, 64]
    for q in (q16, q8):
        for eb in (2, 4):
            cw = staged_pass_features(eb, q)
            assert 2 * 64 * (cw + 8) * eb <= q and (cw + 8) * eb % 16 == 0  # (16-byte aligned rows)
            assert ((cw + 8) * eb // 4) % 32 == 2 * eb  # a row shifts the banks by one pair store's width x 4 lanes
    with pytest.raises(ValueError, match="too few"):
        staged_pass_features(4, 30000)
