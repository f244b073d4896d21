"""Where does our sm90 prefill lose time against FA4-from-torch? Times variants of our kernel instance next to
FA4's own, in one process on the same inputs (issue 7, non-causal S8k/H16: our instance 4% slower under ncu).

A SASS comparison on CPU (docs/sm90_prefill.md, 2026-11-30) found that our two overrides of FA4's kernel class
(the softmax scale read from device memory, the empty-row epilogue) make ptxas schedule FA4's main loop
differently, and that the plain class through our FFI path has FA4's loop instruction for instruction. The
variants separate those causes from the launch-side ones (the extra key-less request that grows the grid,
our LSE layout):

    ours           the shipped path: ``mla_prefill(backend="sm90")`` (default ``fixup`` mode: the device-scale
                   override only, then our small kernel for rows without keys; no padding request)
    ours_epilogue  ``mla_prefill`` with ``TOKENSPEED_SM90_PREFILL_EMPTY_ROWS=kernel``: both overrides (device
                   scale, empty-row epilogue) and the padding request (the path shipped until 2026-11-30)
    ours_nopad     the ``ours_epilogue`` kernel instance, cu_seqlens without the padding request
    plain          FA4's class unchanged, softmax scale a host constant (baked into this compile)
    scale_only     only the device-scale override (FA4's epilogue)
    epi_only       only the empty-row epilogue override (host-constant scale)
    epi_uniform    the device scale + a non-causal epilogue with one CTA-uniform ``seqlen_k <= 0`` branch
    fa4            ``flash_attn.cute.interface.flash_attn_varlen_func`` from torch

Diagnostic only: the variants other than ``ours``, ``ours_epilogue`` and ``fa4`` drop part of our contract
(runtime scale, exact empty rows) and are never used by the package. Run on the H200 (carry [".device"]):

    source .device/bootstrap.sh && python -m benchmarks.prefill_variants --out $OUT/variants.json

or under ncu for kernel times at a locked clock (``--ncu``: 3 launches per variant, no timing loop):

    ncu --kernel-name regex:'(?i)sm90' --clock-control base --csv \\
        --metrics gpu__time_duration.sum,launch__grid_size python -m benchmarks.prefill_variants --ncu
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

VARIANTS = ("ours", "ours_epilogue", "ours_nopad", "plain", "scale_only", "epi_only", "epi_uniform")


@dataclasses.dataclass(frozen=True)
class VariantKey:
    """Compile key of one diagnostic variant (kept apart from the package's keys by its target name)."""

    variant: str
    causal: bool
    scale: float  # the host-constant scale of "plain" / "epi_only" (0.0 where the scale is a device operand)


def _classes():
    """The kernel classes of the variants (imports flash_attn / torch on first use).  Their names end in
    ``Sm90`` so that ncu's ``--kernel-name regex:'(?i)sm90'`` (module docstring) matches their kernels too
    (the first ncu run, 2026-11-30, missed them)."""
    import cutlass
    from cutlass import Float32, const_expr, cute
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from quack import layout_utils

    from tokenspeed_jax.kernels.sm90.fa4_prefill import FA4PrefillSm90

    class ScaleOnlySm90(FA4PrefillSm90):
        epilogue = FlashAttentionForwardSm90.epilogue

    class EpiOnlySm90(FA4PrefillSm90):
        mma = FlashAttentionForwardSm90.mma

    class EpiUniformSm90(FA4PrefillSm90):
        @cute.jit
        def epilogue(self, acc_O, lse, mO, mLSE, sO, seqlen, gmem_tiled_copy_O, tma_atom_O, tiled_mma, tidx,
                     m_block, head_idx, batch_idx):
            if const_expr(self.is_causal):
                FA4PrefillSm90.epilogue(self, acc_O, lse, mO, mLSE, sO, seqlen, gmem_tiled_copy_O, tma_atom_O,
                                        tiled_mma, tidx, m_block, head_idx, batch_idx)
            else:
                acc_O_mn = layout_utils.reshape_acc_to_mn(acc_O)
                if seqlen.seqlen_k <= 0:
                    for m in cutlass.range(cute.size(acc_O_mn, mode=[0]), unroll_full=True):
                        lse[m] = -Float32.inf
                        for n in cutlass.range(cute.size(acc_O_mn, mode=[1]), unroll_full=True):
                            acc_O_mn[m, n] = Float32(0.0)
                FlashAttentionForwardSm90.epilogue(self, acc_O, lse, mO, mLSE, sO, seqlen, gmem_tiled_copy_O,
                                                   tma_atom_O, tiled_mma, tidx, m_block, head_idx, batch_idx)

    return {"ours": FA4PrefillSm90, "scale_only": ScaleOnlySm90, "epi_only": EpiOnlySm90, "epi_uniform": EpiUniformSm90,
            "plain": None}


def _launch():
    import cutlass
    from cutlass import Float32, const_expr, cute
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from flash_attn.cute.utils import AuxData

    from tokenspeed_jax.kernels.sm90.fa4_prefill import _DTYPES, _fa4_sm90_tiles

    classes = _classes()

    @cute.jit
    def variant_launch(stream, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, out, lse, *,
                       variant: cutlass.Constexpr, host_scale: cutlass.Constexpr, head_dim: cutlass.Constexpr,
                       head_dim_v: cutlass.Constexpr, causal: cutlass.Constexpr):
        if const_expr(variant == "plain"):
            tm, tn, rs, ov = _fa4_sm90_tiles(head_dim, head_dim_v, causal)
            kernel = FlashAttentionForwardSm90(
                _DTYPES["bfloat16"], head_dim, head_dim_v, 1, is_causal=causal, is_local=False, pack_gqa=False,
                tile_m=tm, tile_n=tn, num_stages=2, num_threads=384, Q_in_regs=False, intra_wg_overlap=ov,
                mma_pv_is_rs=rs)
        else:
            kernel = classes[variant]("bfloat16", head_dim, head_dim_v, 1, causal=causal)
        device_scale = variant in ("scale_only", "epi_uniform")
        lse_view = cute.make_tensor(lse.iterator, cute.select(lse.layout, mode=[1, 0]))
        kernel(q, k, v, out, lse_view, Float32(1.0) if const_expr(device_scale) else Float32(host_scale),
               cu_seqlens_q, cu_seqlens_k, None, None, None, None, None,
               softmax_scale if const_expr(device_scale) else None, None, AuxData(), None, None, stream)

    return variant_launch


def variant_fn(variant: str, T: int, H: int, causal: bool, scale: float):
    """A jitted ``f(q, k, v, cu_q, cu_k, scale[1]) -> (out, lse)`` running ``variant`` (bf16, 192/128)."""
    import jax
    import jax.numpy as jnp

    from tokenspeed_jax import ffi, mla_prefill
    from tokenspeed_jax.backends.sm90_prefill import _specs
    from tokenspeed_jax.prefill import _prefill_problem

    if variant in ("ours", "ours_epilogue"):
        from benchmarks.harness import scoped_env
        from tokenspeed_jax.backends.sm90_prefill import EMPTY_ROWS_ENV

        def g(q, k, v, cq, ck, s):  # the switch is read when this traces (first call)
            with scoped_env(EMPTY_ROWS_ENV, "kernel" if variant == "ours_epilogue" else "fixup"):
                return mla_prefill(q, k, v, cq, ck, softmax_scale=s[0], causal=causal, return_lse=True,
                                   max_seqlen_q=T, max_seqlen_k=T, backend="sm90")

        return jax.jit(g)

    def f(q, k, v, cq, ck, s):
        input_specs, output_specs = _specs(_prefill_problem(q, k, v, cq, ck, causal, True, None, None))
        common = {"outputs": [jax.ShapeDtypeStruct((T, H, 128), jnp.bfloat16),
                              jax.ShapeDtypeStruct((T, H), jnp.float32)],
                  "input_specs": input_specs, "output_specs": output_specs, "dynamic_shapes": True,
                  "library_versions": ("flash-attn-4", "quack-kernels"), "head_dim": 192, "head_dim_v": 128,
                  "causal": causal}
        if variant == "ours_nopad":  # the epilogue-mode kernel instance, cu_seqlens as given (no extra request)
            from tokenspeed_jax.kernels.sm90.fa4_prefill import fa4_prefill_launch

            call = ffi.custom_call("prefill_variant_ours", fa4_prefill_launch,
                                   compile_key=VariantKey(variant, causal, 0.0), dtype="bfloat16",
                                   qhead_per_kvhead=1, **common)
        else:
            host = variant in ("plain", "epi_only")
            call = ffi.custom_call("prefill_variant", _launch(),
                                   compile_key=VariantKey(variant, causal, scale if host else 0.0),
                                   variant=variant, host_scale=scale if host else 1.0, **common)
        return tuple(call(q, k, v, cq, ck, s))

    return jax.jit(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--modes", default="full,causal")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ncu", action="store_true", help="3 launches per variant, no timing (for ncu)")
    ap.add_argument("--out", default="/tmp/prefill_variants.json")
    a = ap.parse_args(argv)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.harness import interleaved, prefill_cost, provenance
    from tokenspeed_jax.timing import _sync as sync

    T, H = a.seqlen, a.heads
    scale = 1.0 / math.sqrt(192)
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(kq, (T, H, 192), jnp.bfloat16)
    k = jax.random.normal(kk, (T, H, 192), jnp.bfloat16)
    v = jax.random.normal(kv, (T, H, 128), jnp.bfloat16)
    cu = jnp.asarray([0, T], jnp.int32)
    s1 = jnp.full((1,), scale, jnp.float32)
    fa4 = None
    if jax.devices()[0].platform == "gpu":
        from benchmarks.prefill import setup_torch_dlpack

        torch = setup_torch_dlpack()
        from flash_attn.cute import interface as fa4

        tq, tk, tv, tcu = (torch.from_dlpack(x) for x in (q, k, v, cu))
    rows = []
    for mode in a.modes.split(","):
        causal = mode == "causal"
        fns = {}
        for name in a.variants.split(","):
            f = variant_fn(name, T, H, causal, scale)
            fns[name] = (lambda f=f: f(q, k, v, cu, cu, s1))
        if fa4 is not None:
            fns["fa4"] = lambda causal=causal: fa4.flash_attn_varlen_func(
                tq, tk, tv, cu_seqlens_q=tcu, cu_seqlens_k=tcu, max_seqlen_q=T, max_seqlen_k=T,
                softmax_scale=scale, causal=causal, return_lse=True)
        ref = np.asarray(jax.block_until_ready(fns["ours"]()[0]).astype(jnp.float32)) if "ours" in fns else None
        for name, fn in fns.items():  # compile / load, and check every variant against ours
            o = fn()[0]
            if name != "fa4":
                o = np.asarray(jax.block_until_ready(o).astype(jnp.float32))
                same = None if ref is None else bool(np.array_equal(o, ref))
                print(f"{mode} {name}: ready, bitwise equal to ours: {same}", flush=True)
        if a.ncu:
            for fn in fns.values():
                for _ in range(3):
                    sync(fn())
            continue
        _, flops = prefill_cost([T], [T], H, H, causal=causal)
        res = interleaved(fns, flops / 650e12 * 1e6, rounds=a.rounds)
        for name, r in res.items():
            ts = r["samples_us"]
            rows.append({"mode": mode, "variant": name, "us": r["median_us"], "rounds": ts})
            print(f"{mode:6s} {name:12s} {r['median_us']:9.1f} us  rounds {[f'{t:.0f}' for t in ts]}", flush=True)
    if not a.ncu:
        cmd = "python -m benchmarks.prefill_variants " + " ".join(sys.argv[1:] if argv is None else argv)
        doc = {"name": "sm90 prefill variants", **provenance(cmd), "T": T, "H": H, "rows": rows}
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
