"""Dump and compare the SASS the sm90 decode backend generates, on the CPU (no GPU needed).

Every case lowers the public ``mla_decode(..., backend="sm90")`` for CUDA under ``target_override("sm_90a")``, so
the kernels are compiled exactly as the backend's default path builds them (CuTe DSL with ``CUTE_DSL_ARCH=sm_90a``,
one process for the whole run, the on-disk compile cache off), and the SASS of the compile (main kernel + combine
kernel when the plan splits KV) is disassembled with ``nvdisasm`` through ``CUTE_DSL_KEEP=sass``.  Kernel symbol
names (which carry class and module names) are normalised away, so two source trees that generate the same
instructions give identical files.

    # SASS of the current tree
    python scripts/sass_diff.py dump /tmp/sass_new
    # SASS of another tree (e.g. an exported tag: git archive sm90-decode-experiments | tar -x -C /tmp/base)
    python scripts/sass_diff.py dump /tmp/sass_base --src /tmp/base
    python scripts/sass_diff.py diff /tmp/sass_base /tmp/sass_new
    # the main loops of both, side by side (instructions, spills, R2UR)
    python scripts/sass_diff.py loops /tmp/sass_base /tmp/sass_new

``--case dtype:H:S:page[:B[:pages[:config]]]`` (repeatable) replaces the default cases; ``--only SUBSTR`` filters
them.  ``config``: a name of the backend's ``CONFIGS`` (forced in place of ``select_config``'s choice; e.g.
``seesaw_noproducer`` with 64-token pages, which the table never picks); ``--configs`` adds a case for every config
the default cases' selection does not reach (each of ``CONFIGS`` in every dtype and S x H it runs).
"""

from __future__ import annotations

import argparse
import difflib
import glob
import json
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# dtype, H, S, page, batch, table pages[, config]: S x H of 16 / 32 / 128 / 128-over-S4, page 64 (TMA, producer) and
# 16; B 4 with long tables (split KV, combine kernel) and B 64 with short ones (one split, the direct epilogue)
DEFAULT_CASES = [
    (dt, H, S, page, B, pages)
    for dt in ("bfloat16", "float8_e4m3fn")
    for (H, S, page, B, pages) in (
        (16, 1, 64, 4, 64), (32, 1, 64, 4, 64), (128, 1, 64, 4, 64), (32, 4, 64, 4, 64), (128, 1, 64, 64, 8),
        (16, 1, 16, 4, 256), (128, 1, 16, 4, 256), (32, 4, 16, 4, 256),
    )
]
# --configs: the CONFIGS entries select_config picks for none of the default cases, forced, small and large S x H
# (seesaw with and without the producer on 16-bit 64-token pages: the table picks the transposed loop for S x H <= 32
# and never the seesaw without its producer there)
CONFIG_CASES = [
    ("bfloat16", H, S, 64, B, pages, cfg)
    for cfg in ("seesaw", "seesaw_noproducer")
    for (H, S, B, pages) in ((16, 1, 4, 64), (32, 1, 4, 64), (128, 1, 4, 64), (32, 4, 4, 64), (128, 1, 64, 8))
    if cfg == "seesaw_noproducer" or H * S <= 32
]

_WORKER = r"""
import glob, json, os, re, sys
sys.path.insert(0, SRC)
import jax, jax.numpy as jnp
from tokenspeed_jax import mla_decode
from tokenspeed_jax.runtime import target_override
from tokenspeed_jax.backends import sm90_decode
d = os.environ["CUTE_DSL_DUMP_DIR"]
sd = jax.ShapeDtypeStruct
select = sm90_decode.select_config
for (dt, H, S, page, B, pages, *cfg) in CASES:
    name = f"{dt}_H{H}_S{S}_p{page}_B{B}_t{pages}" + "".join("_" + c for c in cfg)
    # a forced config: the backend's choice replaced (decode() looks select_config up at call time)
    sm90_decode.select_config = (lambda p, c=cfg[0]: sm90_decode.CONFIGS[c]) if cfg else select
    f = lambda q, kv, bt, sl, s, o: mla_decode(q, kv, bt, sl, softmax_scale=s, output_scale=o, backend="sm90",
                                              return_lse=True)
    dtype = jnp.dtype(dt)
    with target_override("sm_90a"):
        jax.jit(f).trace(sd((B, S, H, 576), dtype), sd((B * pages + 1, page, 576), dtype), sd((B, pages), jnp.int32),
                         sd((B,), jnp.int32), sd((), jnp.float32), sd((), jnp.float32)
                         ).lower(lowering_platforms=("cuda",))
    # the compile's dump files, moved out of the way: a later case of the same arguments (a forced config) writes the
    # same file names
    sub = os.path.join(d, name)
    os.makedirs(sub, exist_ok=True)
    files = []
    for p in sorted(glob.glob(d + "/*")):
        if os.path.isfile(p):
            os.replace(p, os.path.join(sub, os.path.basename(p)))
            if p.endswith(".sass"):
                files.append(os.path.join(sub, os.path.basename(p)))
    print("CASE", json.dumps([name, files]), flush=True)
"""


def _normalise(text: str) -> list[str]:
    """The functions of one SASS file, symbol names replaced (they carry class and module names), each a string."""
    text = re.sub(r"kernel_cutlass_\w+", "KERNEL", text)
    text = re.sub(r"__unnamed_\d+", "UNNAMED", text)
    return re.split(r"(?m)^(?=//-+ \.text\.)", text)[1:]


def dump(out: str, src: str, cases, only: str | None) -> int:
    os.makedirs(out, exist_ok=True)
    dump_dir = os.path.join(out, "_dump")
    shutil.rmtree(dump_dir, ignore_errors=True)  # (a file of an earlier run would hide a compile's)
    os.makedirs(dump_dir)
    if only:
        cases = [c for c in cases if only in "_".join(map(str, c))]
    cases = [tuple(c) for c in cases]
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_DUMP_DIR=dump_dir, CUTE_DSL_KEEP="sass",
               TOKENSPEED_JAX_DISK_CACHE="0", JAX_PLATFORMS="cpu", PYTHONPATH=src)
    code = f"SRC = {src!r}\nCASES = {cases!r}\n" + _WORKER
    p = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=src, stdout=subprocess.PIPE, text=True)
    n = 0
    for line in p.stdout:
        if not line.startswith("CASE "):
            sys.stdout.write(line)
            continue
        name, files = json.loads(line[5:])
        texts = []  # (functions sorted: their order in the ELF follows their names)
        for fpath in files:
            with open(fpath) as fh:
                texts += _normalise(fh.read())
        with open(os.path.join(out, name + ".sass"), "w") as fh:
            fh.write("\n".join(sorted(texts)))
        print(f"{name}: {len(files)} sass file(s)", flush=True)
        n += 1
    return p.wait() or (0 if n == len(cases) else 1)


def diff(a: str, b: str) -> int:
    names = sorted({os.path.basename(p) for p in glob.glob(a + "/*.sass")} |
                   {os.path.basename(p) for p in glob.glob(b + "/*.sass")})
    bad = 0
    for name in names:
        pa, pb = os.path.join(a, name), os.path.join(b, name)
        if not (os.path.exists(pa) and os.path.exists(pb)):
            print(f"{name}: only in {a if os.path.exists(pa) else b}")
            bad += 1
            continue
        ta, tb = open(pa).read().splitlines(), open(pb).read().splitlines()
        if ta == tb:
            print(f"{name}: identical ({len(ta)} lines)")
            continue
        bad += 1
        d = list(difflib.unified_diff(ta, tb, pa, pb, n=1, lineterm=""))
        print(f"{name}: DIFFERENT ({sum(1 for x in d if x[:1] in '+-') - 2} changed lines)")
        print("\n".join(d[:40]))
    return 1 if bad else 0


# constants of the causal-tail cleaning (kernels/sm90/helpers.py): a basic block holding one is cleaning code, which
# runs on a piece's last tiles only
_CLEAN = ("0x7f7f7f7f", "0x7f807f80", "0x7c007c00")


def _loops(fn: str) -> list[tuple[int, int, int, int]]:
    """The main loops of one SASS function: the innermost loops (backward branches) whose body holds wgmmas
    (``(instructions, of them outside the cold code, spill instructions there, R2UR there)``).  Cold code runs on a
    piece's last tiles only: the causal-tail cleaning and the zeroing of the V rows past the split, found as the
    spans a conditional forward branch skips that hold the cleaning's constants or zero stores (``STS ... RZ``) and
    no wgmma."""
    insts, labels = [], {}
    for ln in fn.splitlines():
        m = re.match(r"^(\.L_x_\d+):", ln.strip())
        if m:
            labels[m.group(1)] = len(insts)
            insts.append(m.group(1) + ":")
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", ln)
        if m:
            insts.append(m.group(1))
    # (ptxas puts the retry loops of mbarrier waits after the function's first unpredicated EXIT, each branching back
    # to its wait: those back edges are not loops of the kernel)
    end = next((k for k, x in enumerate(insts) if re.match(r"EXIT\b", x)), len(insts))  # (unpredicated)
    spans = []
    for k, ins in enumerate(insts[:end]):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", ins)
        if m and m.group(1) in labels and labels[m.group(1)] <= k \
                and any("GMMA" in x for x in insts[labels[m.group(1)]:k + 1]):
            spans.append((labels[m.group(1)], k))
    out = []
    for lo, hi in spans:
        # innermost: no other wgmma loop inside this one (a persistent kernel's piece loop holds the main loops)
        if any((a, b) != (lo, hi) and lo <= a and b <= hi for a, b in spans):
            continue
        body = insts[lo:hi + 1]
        # cold code: the span a conditional forward branch skips, when it holds the cleaning's constants or zero
        # stores and no wgmma (the largest such spans)
        cold = [False] * len(body)
        pos = {x[:-1]: i for i, x in enumerate(body) if x.endswith(":")}
        for i, x in enumerate(body):
            m = re.match(r"@!?U?P\w+\s+BRA\s+`\((\.L_x_\d+)\)", x)
            if not (m and pos.get(m.group(1), -1) > i):
                continue
            span = body[i + 1:pos[m.group(1)]]
            if not any("GMMA" in y for y in span) and any(
                    any(c in y for c in _CLEAN) or re.search(r"\bSTS(\.\w+)* \[[^]]*\], RZ\b", y) for y in span):
                for j in range(i + 1, pos[m.group(1)]):
                    cold[j] = True
        hot = [x for x, c in zip(body, cold) if not c and not x.endswith(":")]
        out.append((sum(1 for x in body if not x.endswith(":")), len(hot),
                    sum(1 for x in hot if re.search(r"\b(STL|LDL)\b", x)), sum(1 for x in hot if "R2UR" in x)))
    return sorted(out, reverse=True)


def loops(dirs: list[str]) -> int:
    """Per case of the dumps in ``dirs`` (the first is the reference): each main loop's instruction count, the count
    outside the cold blocks, spill and R2UR instructions there, WARPGROUP.DEPBAR of the whole case."""
    for name in sorted({os.path.basename(p) for d in dirs for p in glob.glob(d + "/*.sass")}):
        for d in dirs:
            path = os.path.join(d, name)
            if not os.path.exists(path):
                continue
            text = open(path).read()
            fns = _normalise(text)
            main = max(fns, key=len) if fns else ""
            print(f"{name:45s} {d}: loops (insts, outside cold blocks, spills, R2UR) {_loops(main)}, "
                  f"depbar {text.count('WARPGROUP.DEPBAR')}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("--src", default=ROOT, help="source tree to import tokenspeed_jax from (default: this one)")
    d.add_argument("--case", action="append", default=[], help="dtype:H:S:page[:B[:pages[:config]]]")
    d.add_argument("--configs", action="store_true", help="add CONFIG_CASES (the configs the table does not pick)")
    d.add_argument("--only", default=None)
    c = sub.add_parser("diff")
    c.add_argument("a")
    c.add_argument("b")
    lp = sub.add_parser("loops", help="main-loop statistics of dumps (the first directory is the reference)")
    lp.add_argument("dirs", nargs="+")
    args = ap.parse_args()
    if args.cmd == "diff":
        return diff(args.a, args.b)
    if args.cmd == "loops":
        return loops(args.dirs)
    cases = DEFAULT_CASES
    if args.case:
        cases = []
        for s in args.case:
            f = s.split(":")
            dt, H, S, page = f[0], int(f[1]), int(f[2]), int(f[3])
            B = int(f[4]) if len(f) > 4 else 4
            pages = int(f[5]) if len(f) > 5 else 64
            cases.append((dt, H, S, page, B, pages) + tuple(f[6:7]))
    if args.configs:
        cases = cases + CONFIG_CASES
    return dump(args.out, os.path.abspath(args.src), cases, args.only)


if __name__ == "__main__":
    sys.exit(main())
