"""Issue rate of the Hopper FP8 wgmma (QGMMA ``m64nNk32``) shapes our decode loops use, alone on the tensor cores.

The FP8 decode loops issue QGMMAs of N = 16 / 32 (the O^T and row-split loops: the query rows as N), 64 (mode 4's
QK) and 256 (mode 4's PV), with A from shared memory (SS) or registers (RS), and load shared memory with
``ldmatrix`` beside them.  This kernel issues nothing else: each warpgroup of a 132-CTA grid (one CTA per SM) runs
``--iters`` groups of 32 back-to-back QGMMAs on the same shared-memory tiles (K = 256, 8 k32 steps, cycled) into one
accumulator, optionally with 1 or 2 ``ldmatrix.x4.trans`` per QGMMA, then waits.  It prints, per configuration, the
achieved TFLOP/s and cycles per instruction per SM (at ``--clock-ghz``, default 1.98, the H200's clock in these
runs), so a decode loop's measured time can be set against what its QGMMAs and loads alone would take
(docs/notes/sm90_decode_journal.md, "Row-split loop").

    source .device/bootstrap.sh && python -m benchmarks.qgmma_rate --out $OUT/qgmma_rate.json

GPU only (torch for the buffers and the timing, CUDA events); not part of the tests.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, cute
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from tokenspeed_jax.kernels.sm90.fp8_operands import _ldsm4t

_F8 = cutlass.Float8E4M3FN
_K = 256  # the shared-memory tiles' K (8 k32 steps, cycled)
_BURST = 32  # QGMMAs per commit group


class QgmmaRate:
    """``wgs`` warpgroups per CTA each issue ``iters`` x 32 QGMMA ``m64{n}k32`` (A from registers if ``rs``), with
    ``ldsm`` ``ldmatrix.x4.trans`` (512 bytes a warp) beside each QGMMA: the shared-memory reads that would feed an RS
    QGMMA's A operand (one per QGMMA) or the O^T loops' ``V^T`` loads, whose results are folded into one register."""

    def __init__(self, n: int, rs: bool, wgs: int, iters: int, ldsm: int = 0):
        self.n, self.rs, self.wgs, self.iters, self.ldsm = n, rs, wgs, iters, ldsm

    @cute.jit
    def __call__(self, out: cute.Tensor, stream):
        K = warpgroup.OperandMajorMode.K
        a_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (64, self.n, _K), _F8, 1)
        b_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (64, self.n, _K), _F8, 1)
        src = warpgroup.OperandSource.RMEM if cutlass.const_expr(self.rs) else warpgroup.OperandSource.SMEM
        mma = sm90_utils.make_trivial_tiled_mma(_F8, _F8, K, K, Float32, (1, 1, 1), (64, self.n), a_source=src)

        @cute.struct
        class Storage:
            sA: cute.struct.Align[cute.struct.MemRange[_F8, cute.cosize(a_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[_F8, cute.cosize(b_layout)], 1024]

        self.kernel(mma, out, a_layout, b_layout, Storage).launch(
            grid=(132, 1, 1), block=(128 * self.wgs, 1, 1), smem=Storage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, mma: cute.TiledMma, out: cute.Tensor, a_layout: cute.ComposedLayout,
               b_layout: cute.ComposedLayout, Storage: cutlass.Constexpr):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        wtid = tid % 128
        st = cutlass.utils.SmemAllocator().allocate(Storage)
        sA = st.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sB = st.sB.get_tensor(b_layout.outer, swizzle=b_layout.inner)
        for i in cutlass.range(tid, cute.cosize(a_layout), 128 * self.wgs, unroll=1):  # zeros: finite operands
            sA[i] = _F8(0.0)
        for i in cutlass.range(tid, cute.cosize(b_layout), 128 * self.wgs, unroll=1):
            sB[i] = _F8(0.0)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier()
        thr = mma.get_slice(wtid)
        tB = thr.make_fragment_B(thr.partition_B(sB[None, None, 0]))
        acc = thr.make_fragment_C(thr.partition_shape_C((64, self.n)))
        acc.fill(0.0)
        mma.set(warpgroup.Field.ACCUMULATE, True)
        if cutlass.const_expr(self.rs):
            a_layout_r = thr.make_fragment_A(thr.partition_shape_A((64, _K))).layout
            a_regs = cute.make_rmem_tensor((cute.cosize(a_layout_r) // 4,), Int32)
            a_regs.fill(0)
            tA = cute.make_tensor(cute.recast_ptr(a_regs.iterator, dtype=_F8), a_layout_r)
        else:
            tA = thr.make_fragment_A(thr.partition_A(sA[None, None, 0]))
        sink = Int32(0)
        base = st.sA.data_ptr().toint()
        for it in cutlass.range(self.iters, unroll=1):
            warpgroup.fence()
            for j in cutlass.range_constexpr(_BURST):
                k = j % (_K // 32)
                cute.gemm(mma, acc, tA[None, None, k], tB[None, None, k], acc)
                for x in cutlass.range_constexpr(self.ldsm):  # 32 consecutive 16-byte rows: no bank conflict; a
                    # block that moves with the iteration, so no two loads of a burst are the same (ptxas merges those)
                    r = _ldsm4t(base + ((it + self.ldsm * j + x) % 32) * 512 + (wtid % 32) * 16)
                    sink = sink ^ r[0] ^ r[1] ^ r[2] ^ r[3]
            warpgroup.commit_group()
            warpgroup.wait_group(0)
        if wtid == 0:
            out[bid * self.wgs + tid // 128] = acc[0] + Float32(sink & 1)


def main(argv=None):
    import cuda.bindings.driver as cuda
    import torch
    from cutlass.cute.runtime import from_dlpack

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--clock-ghz", type=float, default=1.98, help="SM clock for cycles per instruction")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "qgmma_rate.json"))
    a = ap.parse_args(argv)
    rows = []
    # (RS with N = 256 is left out: 128 accumulators + 64 A registers made ptxas serialize its QGMMAs)
    # ldsm 1 / 2 beside RS N = 32: an RS QK with A through ldmatrix (+ the V^T loads); beside SS N = 32 / 64: whether
    # the SS operand reads and ldmatrix share one limit
    for n, rs, wgs, ldsm in [(16, False, 2, 0), (32, False, 2, 0), (64, False, 2, 0), (128, False, 2, 0),
                             (256, False, 2, 0), (16, True, 2, 0), (32, True, 2, 0), (64, True, 2, 0), (128, True, 2, 0),
                             (32, False, 1, 0), (32, True, 1, 0), (64, False, 1, 0), (32, False, 3, 0), (32, True, 3, 0),
                             (32, True, 2, 1), (32, True, 2, 2), (32, False, 2, 1), (64, False, 2, 1), (256, False, 2, 1)]:
        out = torch.zeros(132 * wgs, dtype=torch.float32, device="cuda")
        stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        k = QgmmaRate(n, rs, wgs, a.iters, ldsm)
        f = cute.compile(k, from_dlpack(out), stream)
        f(from_dlpack(out), stream)
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ms = []
        for _ in range(5):
            t0.record()
            f(from_dlpack(out), stream)
            t1.record()
            torch.cuda.synchronize()
            ms.append(t0.elapsed_time(t1))
        ms = sorted(ms)[2]
        inst = a.iters * _BURST * wgs  # per SM
        flops = 2.0 * 64 * n * 32 * inst * 132
        r = {"n": n, "a": "rs" if rs else "ss", "warpgroups": wgs, "ldmatrix_per_qgmma": ldsm, "us": ms * 1e3, "tflops": flops / (ms * 1e-3) / 1e12,
             "cycles_per_qgmma_per_sm": ms * 1e-3 * a.clock_ghz * 1e9 / inst}
        rows.append(r)
        print(json.dumps({k2: round(v, 2) if isinstance(v, float) else v for k2, v in r.items()}), flush=True)
    head = {"command": " ".join(["python", "-m", "benchmarks.qgmma_rate", *(argv or sys.argv[1:])]),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "device": torch.cuda.get_device_name()}
    with open(a.out, "w") as fh:
        json.dump({**head, "iters": a.iters, "clock_ghz": a.clock_ghz, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
