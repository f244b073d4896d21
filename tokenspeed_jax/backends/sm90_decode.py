"""Decode half of the ``sm90`` backend: our CuTe DSL MLA decode kernel for Hopper.

Kernel: :mod:`tokenspeed_jax.kernels.sm90.mla_decode` (design, masking, clamping and split-KV in its
docstring; contract in :mod:`tokenspeed_jax.decode`).  Planning: ``_plan_sm90`` in
:mod:`tokenspeed_jax.planner` (64-row tiles over ``rows = S*H``, 64-token KV steps, static split count);
the split-KV partials are XLA-owned extra outputs of the custom call, sized exactly by the plan.

FP8 (``float8_e4m3fn`` q and cache, scales folded into ``softmax_scale`` / ``output_scale`` as the decode
contract says) reads half the bytes.  In the seesaw loop (page sizes >= 16) QK^T runs on FP8 tensor cores
(QGMMA) straight from the landed e4m3 tiles, and so does P V (``TOKENSPEED_SM90_DECODE_FP8_PV``, default ``10``,
its modes at :data:`FP8_PV_ENV`): P is rounded to e4m3, and the O^T loop (``kernels/sm90/mla_decode_ot.py``) takes
``V^T`` as a register operand straight from the staging, with no ``V^T`` copy in shared memory: for 32 or fewer
query rows with the QK transposed too (1.06-1.52x mode 4 there), for more on whole 64-row blocks (1.12-1.34x mode 4,
H200 2026-12-02).  Mode ``4`` transposes V in shared memory instead (``ldmatrix.trans`` / ``stmatrix`` into a packed
slot, one QGMMA m64n256k32 per PV k-step); 16-token pages run its mode-``1`` fallback.  Output errors 7-13x the
bf16 output rounding, within the bound the check states (``docs/sm90_decode.md``).  ``=0`` keeps P V exact on
fp16 operands (V upcast in shared memory); ``TOKENSPEED_SM90_DECODE_FP8_QK=0`` also runs the QK on fp16 operands.
The lockstep loop (page 8) upcasts to bf16 in shared memory.  bf16 output.

Custom calls: ``tokenspeed_mla_decode_sm90`` (main kernel, plus the combine kernel launched from the same
launch function when the plan splits KV).  ``softmax_scale`` / ``output_scale`` are (1,)-shaped float32
operands, so a new value never recompiles.

Schedules (compile-time main loops; details in the kernel modules and ``docs/sm90_decode.md``):

* ``"seesaw"`` (:mod:`tokenspeed_jax.kernels.sm90.mla_decode_seesaw`, the default for 16-bit inputs): the
  two warpgroups own alternate 64-token tiles for QK^T and work out of phase, so one warpgroup's softmax
  runs under the other's matmuls; KV refills per column group through mbarriers, by TMA for page sizes
  >= 16 (cp.async for page 8).  ``"seesaw-cpasync"`` is the same loop with cp.async refills for every
  page size (opt-in, for comparison: bitwise equal results, 0.5-7% slower on the H200).
* ``"lockstep"`` (:class:`~tokenspeed_jax.kernels.sm90.mla_decode.MlaDecodeSm90`, FP8 with 8-token pages):
  both warpgroups on the same tile, three CTA-wide barriers per tile.
* ``"overlap"``: lockstep with PV(i-1) issued ahead of QK(i) (opt-in, measured no faster).

The seesaw loop with TMA refills can also prefetch the KV tile pair after the next into L2
(``TOKENSPEED_SM90_DECODE_L2_PREFETCH`` = ``"off"`` (default since 2026-12-02), ``"late"`` (the default before) or
``"early"``; measured in ``docs/sm90_decode.md``, sections "L2 prefetch" and "L2 prefetch off").

Opt-in switches measured on 2026-12-02 and left off (``docs/sm90_decode.md``, "The BF16 memory-bound gap"):
``TOKENSPEED_SM90_DECODE_KV_EVICT`` (evict-first L2 hint on the KV loads), ``TOKENSPEED_SM90_DECODE_CROSS_FIRST``
(16-bit: warpgroup 1's cross PV first) and ``TOKENSPEED_SM90_DECODE_PDL_MAIN`` (the main kernel launched with PDL too).
Two switches of the same day are on by default, because they draw less power per tile and so hold a higher SM clock
under sustained load (docs, "Power"): ``TOKENSPEED_SM90_DECODE_T16`` (16-bit with S x H <= 32 and pages >= 32: the
transposed loop of ``kernels/sm90/mla_decode_ot16.py``; ``0`` for the seesaw loop) and
``TOKENSPEED_SM90_DECODE_PAD_ROWS`` (``"zero"``: a row block's rows past S x H are zeros with every key masked;
``"copy"``: copies of the last row).
Two switches of the 16-bit seesaw loop's stores (2026-12-02, bitwise the same results): ``TOKENSPEED_SM90_DECODE_P_STSM``
(``1``: P to shared memory by ``stmatrix``) and ``TOKENSPEED_SM90_DECODE_EPILOGUE`` (``"staged"``: O through shared
memory, out in 16-byte chunks; ``"direct"``: each thread's elements straight to global memory);
``TOKENSPEED_SM90_DECODE_EPILOGUE_FP8`` does the same for FP8 mode 4 (``"staged"`` by default since its H200 check
and A/B of 2026-12-02, 08:16 UTC device clock; ``"direct"``: the old stores).
``TOKENSPEED_SM90_DECODE_T16_PT=q`` (opt-in: correct on the H200 and within 1% of the default, 2026-12-02): the
transposed 16-bit loop keeps P^T in the Q tile's unused rows, so each slot's rope chunk is refilled earlier
(``"rope"``, the default: in the slot); ``TOKENSPEED_SM90_DECODE_T16_BARS=chunk`` (the same): its QKs wait per
64-column chunk (``"group"``: per refill group).

``"auto"`` picks seesaw; FP8 with 8-token pages (no TMA refills) or ``"seesaw-cpasync"`` runs lockstep.
Chosen by ``decode(..., schedule=...)`` or, when that is None, by the environment variable
``TOKENSPEED_SM90_DECODE_SCHEDULE`` (read when the call is traced; a jitted function keeps the schedule it
was traced with).
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tokenspeed_jax.planner import plan_for_problem
from tokenspeed_jax.problems import KERNEL_DTYPES, DecodeProblem

TARGET = "mla_decode_sm90"
SCHEDULE_ENV = "TOKENSPEED_SM90_DECODE_SCHEDULE"
# "0" launches the split-KV combine kernel without programmatic dependent launch (PDL; default "1"), for
# A/B timing (scripts/decode_ab.py; docs/sm90_decode.md). Read at trace time; part of the compile key.
PDL_ENV = "TOKENSPEED_SM90_DECODE_PDL"
# "0" runs the FP8 seesaw QK on fp16 operands (the whole KV slot upcast before the QK) instead of FP8
# tensor cores (default "1"; docs/sm90_decode.md), for A/B timing.  Read at trace time; part of the compile key.
FP8_QK_ENV = "TOKENSPEED_SM90_DECODE_FP8_QK"
# The FP8 seesaw's P V: "2" on FP8 tensor cores (P rounded to e4m3, V transposed in smem) with each warpgroup
# refilling its whole KV slot right after building V^T (a pair earlier; pages >= 32, 16-token pages run "1"); "1" the
# same without the early refills; "0" on fp16 operands, V upcast exactly (P in fp16: the exact choice;
# docs/sm90_decode.md, "FP8 P V on FP8 tensor cores"); "3" is "2" with each KV slot packed as [V^T | P | staging] (PVs
# as QGMMA m64n256k32, the transpose on ldmatrix.trans / stmatrix; 16-token pages run "1" packed), 10.3% faster than
# "2" on the H200; "4" (the default since 2026-12-01 evening, 10.8% faster than "3") is "3" with a third, producer
# warpgroup that issues the TMA refills (docs/sm90_decode.md, "Producer warpgroup"; 16-token pages run "1" packed).
# "5" is "4" except for S x H <= 32 query rows with pages >= 32: there the O^T = V^T P^T loop runs, V^T the register A
# operand loaded straight from the e4m3 staging (no V^T copy in shared memory, 4 staging buffers;
# kernels/sm90/mla_decode_ot.py, docs/sm90_decode.md, "O^T schedule").  "6" (the default from 2026-12-01 21:50 UTC to
# 2026-12-02 16:00 UTC) is "5" with the QK transposed too, S^T = K Q^T with the query rows as N: 1.06-1.52x mode 4 on
# the 4 shapes of the issue matrix it runs (S x H <= 32), the others run "4".  "7" runs that loop for every S x H on
# 32-row tiles (its own plan): 0.64-0.79x mode 4 where S x H >= 64 (H200, 2026-12-01), kept opt-in.  Needs the QGMMA
# QK.  "8" runs the row-split loop for every S x H with pages >= 32 (each computing warpgroup 32 query rows and all
# 512 features, O^T = V^T P^T and S^T = K Q^T, a ring of KV buffers; one computing warpgroup for S x H <= 32;
# kernels/sm90/mla_decode_rs.py, docs/sm90_decode.md, "Row-split loop"): 0.81-0.94x mode 4 with more than 32 rows,
# 0.94-1.03x mode 6 with fewer (H200, 2026-12-02).  "9" runs it for S x H <= 32 and mode 4 for more rows.  "10" is "6"
# with the O^T loop (no transposed QK) on whole 64-row blocks where S x H > 32 instead of mode 4 (its registers fit
# since 2026-12-02: P stored and rescaled as e4m3 words, one V^T fragment set; docs/sm90_decode.md, "64-row O^T
# loop"): 1.12x mode 6 over the issue matrix's 13 FP8 shapes and 1.12-1.34x on its 9 with 64 or more rows (H200,
# 2026-12-02 16:00 UTC), the default since.  Read at trace time; part of the compile key.
FP8_PV_ENV = "TOKENSPEED_SM90_DECODE_FP8_PV"
FP8_PV_MODES = ("0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10")
FP8_PV_DEFAULT = "10"
# "1" (default since 2026-12-01 evening: 1.055x on 5 BF16 shapes of the issue matrix, bitwise equal) gives the 16-bit
# seesaw loop (pages >= 32, TMA refills) a producer warpgroup that issues its four column-group refills
# (docs/sm90_decode.md, "Producer warpgroup"), like FP8 mode "4"; "0" without.  Read at trace time; part of the
# compile key.
PRODUCER16_ENV = "TOKENSPEED_SM90_DECODE_PRODUCER16"
PRODUCER16_DEFAULT = "1"
# The seesaw loop's L2 prefetch of the KV tile pair after the next (cp.async.bulk.prefetch): "off", "late"
# or "early" (docs/sm90_decode.md, "L2 prefetch").  Read at trace time; part of the compile key.  "off" is the
# default since the H200 A/B of 2026-12-02 12:12 UTC (docs, "L2 prefetch off"): with today's loops the prefetch
# cost 6-14% on the memory-bound 16-bit shapes (transposed loop) and 2.5% (BF16) / 4% (FP8) in the geometric
# means over 12 shapes, with outputs bitwise equal.
L2_PREFETCH_ENV = "TOKENSPEED_SM90_DECODE_L2_PREFETCH"
L2_PREFETCH_MODES = ("off", "late", "early")  # the kernel's (no cutlass import here)
L2_PREFETCH_DEFAULT = "off"
# The environment switches this module reads at trace time: ``mla_decode`` keys its per-problem trace cache
# on their values (``Backend.trace_env``), so a switch changed between two traces takes effect.
# KV ring buffers of the row-split loop (FP8 P V mode "8"): 2..5, default 4.  Read at trace time; part of the compile
# key.
RS_STAGES_ENV = "TOKENSPEED_SM90_DECODE_RS_STAGES"
RS_STAGES_DEFAULT = "4"
# The L2 eviction hint of the seesaw-family loops' KV TMA loads: "normal" (no hint) or "first" (evict-first, as
# FlashMLA's loads do).  Measured 1.009x BF16 / 1.005x FP8 (geometric means, H200 2026-12-02; docs/sm90_decode.md,
# "The BF16 memory-bound gap", item 1), so off.  Read at trace time; part of the compile key.
KV_EVICT_ENV = "TOKENSPEED_SM90_DECODE_KV_EVICT"
KV_EVICT_CHOICES = ("normal", "first")  # the kernel's KV_EVICT_MODES (no cutlass import here)
KV_EVICT_DEFAULT = "normal"
# "1": the 16-bit seesaw loop's warpgroup 1 issues its cross PV before its own PV and publishes its P at once, so the
# slot-0 refill warpgroup 0's next QK waits for goes out one PV earlier; "0": own PV first.  Measured 0.993x (item 2
# of the same section), so off.  Read at trace time; part of the compile key.
CROSS_FIRST_ENV = "TOKENSPEED_SM90_DECODE_CROSS_FIRST"
CROSS_FIRST_DEFAULT = "0"
# "1": 16-bit inputs with S x H <= 32 query rows (pages >= 32, TMA refills, the producer warpgroup) run the seesaw loop
# with both matmuls transposed, S^T = K Q^T and O^T = V^T P^T on the real rows instead of 64 padded ones
# (kernels/sm90/mla_decode_ot16.py; docs/sm90_decode.md, "Transposed 16-bit loop"); "0": the seesaw loop.  Measured
# 0.98-1.02x in 20-50 ms bursts (item 3) but 1.08-1.10x in sustained runs, where it draws less power per tile and
# holds an SM clock of 1.85-1.97 GHz instead of 1.38-1.49 (docs, "Power"), so on since 2026-12-02.  Read at trace
# time; part of the compile key.
T16_ENV = "TOKENSPEED_SM90_DECODE_T16"
T16_DEFAULT = "1"
# Where the transposed 16-bit loop keeps P^T: "rope" (the slot's rope columns, as the seesaw loop keeps P) or "q" (rows
# 32..63 of the Q tile, which that loop never reads, so each slot's rope chunk is refilled with its owner's early
# group and the groups refilled after a cross PV shrink from 40 to 32 KB: kernels/sm90/mla_decode_ot16.py).  Opt-in:
# correct on the H200 and within 1% of "rope" (2026-12-02).  Read at trace time; part of the compile key.
T16_PT_ENV = "TOKENSPEED_SM90_DECODE_T16_PT"
T16_PT_CHOICES = ("rope", "q")
T16_PT_DEFAULT = "rope"
# How the transposed 16-bit loop's QKs wait for their KV: "group" (one mbarrier per column group of a slot, the
# seesaw loop's) or "chunk" (one per 64-column chunk, 9 per slot, so a QK starts on the first chunk to land, as
# FlashMLA's does; the seesaw loop measured +2% on memory-bound shapes with it on 2026-11-29 and lost on compute-bound
# ones, which this loop does not run).  Opt-in: correct on the H200 and within 1% of "group" (2026-12-02).  Read at
# trace time; part of the compile key.
T16_BARS_ENV = "TOKENSPEED_SM90_DECODE_T16_BARS"
T16_BARS_CHOICES = ("group", "chunk")
T16_BARS_DEFAULT = "group"
# "1": the main decode kernel is launched with programmatic dependent launch as well (its CTAs take SMs while the
# previous kernel of the stream drains, then wait for it before reading anything; the main and combine kernels let
# the next kernel launch at their start).  "0": only the combine kernel is.  Measured BF16 1.023x, FP8 0.998x with one
# shape at 0.86x (item 4), so off.  Read at trace time; part of the compile key.
PDL_MAIN_ENV = "TOKENSPEED_SM90_DECODE_PDL_MAIN"
PDL_MAIN_DEFAULT = "0"
# What the query rows past S x H of a 64-row block hold in the seesaw loop (16-bit and FP8 mode 4): "copy" (row
# S x H - 1, its scores computed and never stored) or "zero" (zeros with every key masked: both matmuls' padded A rows
# are zeros, the same results with less tensor-core switching).  Measured 0.98-1.08x in bursts and 1.04-1.06x in
# sustained runs (SM clock 1.49-1.83 GHz instead of 1.38-1.49; docs/sm90_decode.md, "Power"), so "zero" since
# 2026-12-02.  Read at trace time; part of the compile key.
PAD_ROWS_ENV = "TOKENSPEED_SM90_DECODE_PAD_ROWS"
PAD_ROWS_CHOICES = ("copy", "zero")  # the kernel's PAD_ROWS (no cutlass import here)
PAD_ROWS_DEFAULT = "zero"
# The 16-bit seesaw loop's stores: P by stmatrix ("1") instead of 32-bit element stores, and O through shared memory
# ("staged": the Q tile's smem, 16-byte chunks, coalesced rows) instead of 2- or 4-byte element stores straight to
# global memory, 8 rows per warp instruction ("direct").  Read at trace time; part of the compile key.
P_STSM_ENV = "TOKENSPEED_SM90_DECODE_P_STSM"
P_STSM_DEFAULT = "1"
EPILOGUE_ENV = "TOKENSPEED_SM90_DECODE_EPILOGUE"
EPILOGUE_CHOICES = ("direct", "staged")
EPILOGUE_DEFAULT = "staged"
# ... the same staged epilogue for FP8 mode 4 (the seesaw loop with 64-row tiles; its 36 KB e4m3 Q tile takes O in
# passes of 128 bf16 / 64 fp32 features).  The default since the H200 run of 2026-12-02 (`DT=fp8 bash
# scripts/h200_stores.sh`, 08:16 UTC device clock): the check matrix's 9 FP8 cases passed, memcheck 0 errors, and
# an A/B bitwise equal to "direct", 1.14x at B128/K4096/H128, 1.37x at B128/K1024/H128, 1.07x at B8/K16384/H128/S2,
# within 1% on the long shapes.  Read at trace time; part of the compile key.
EPILOGUE_FP8_ENV = "TOKENSPEED_SM90_DECODE_EPILOGUE_FP8"
EPILOGUE_FP8_DEFAULT = "staged"
# How the transposed loops (FP8 modes 6 / 7 and the 16-bit T16 loop; S^T = K Q^T, a query row's keys in all 4 warps)
# reduce each warp's column maxima: "shfl" (3 butterfly shuffles per column, 24 a thread at 32 rows) or "xpose" (a
# transposed butterfly: the 8 lanes of a column group halve their columns each round, 7 shuffles at 32 rows, every
# lane then holding one column's warp maximum; the 4 warps' values of a thread's columns read back as 16-byte loads).
# Maxima are exact, so the outputs are bitwise equal.  Why it was tried (the O^T loop's timeline, 2026-12-02 14:37
# UTC): at 32 rows warpgroup 1's column maxima took 881 cycles against warpgroup 0's 401 for the same code, running
# while warpgroup 0 stores P and loads V^T (kernels/sm90/mla_decode_ot.py, colmax_xpose).  Opt-in: bitwise equal on
# the H200 and slower at 32 rows (FP8 B64/K81920/H32/S1 0.89x, BF16 0.95x; within 2% at 16 rows; 14:58 UTC,
# docs/sm90_decode.md, "Afternoon run").  Read at trace time; part of the compile key.
COLMAX_ENV = "TOKENSPEED_SM90_DECODE_COLMAX"
COLMAX_CHOICES = ("shfl", "xpose")  # (the kernel module's COLMAX_MODES; no cutlass import here)
COLMAX_DEFAULT = "shfl"
# FP8 mode 10's O^T loop on 64-row blocks: "early" (the default) stores warpgroup 0's P0 before its own PV and rescales
# it in shared memory for warpgroup 1 after WG1's fold; "late" stores it once, after WG1's fold and already times
# scale1, and runs warpgroup 0's own PV after that, so that only the P store overlaps warpgroup 1's softmax
# (kernels/sm90/mla_decode_ot.py, p0_late; docs/sm90_decode.md, "64-row O^T loop": warpgroup 1's softmax took 2.2x
# warpgroup 0's for the same code while warpgroup 0 ran its own PV beside it).  Opt-in: it measured 0.90-0.96x "early"
# on the 64-row shapes (H200, 2026-12-02 17:29 UTC; docs/sm90_decode.md, "QK early").  Read at trace time; part of the
# compile key.
OT64_P0_ENV = "TOKENSPEED_SM90_DECODE_OT64_P0"
OT64_P0_CHOICES = ("early", "late")
OT64_P0_DEFAULT = "early"
# FP8 mode 10's O^T loop on 64-row blocks: when warpgroup 0 issues the QK of the next pair's tile: "wg0" (the default
# since 2026-12-02 17:45 UTC) right behind its own PV, so that it runs on the tensor cores during warpgroup 1's softmax;
# "after" once its cross PV retired, on the chain between warpgroup 1's cross PV and warpgroup 0's next softmax (the
# default before: "wg0" measured 1.01-1.14x faster on the B64/K81920 shapes with 64 or more rows, within 3% elsewhere,
# bitwise the same outputs; kernels/sm90/mla_decode_ot.py, qk_early; docs/sm90_decode.md, "QK early").  "wg0s"
# (opt-in): "wg0", and warpgroup 0's next softmax runs while its cross PV still does; measured 0.999x "wg0" (0.96-0.98x
# on the heaviest shapes; 2026-12-02 20:14 UTC).  Read at trace time; part of the compile key.
OT64_QK_ENV = "TOKENSPEED_SM90_DECODE_OT64_QK"
OT64_QK_CHOICES = ("after", "wg0", "wg0s")  # (the kernel module's QK_EARLY_MODES; no cutlass import here)
OT64_QK_DEFAULT = "wg0"
# The O^T loops' 32- and 16-row tiles (FP8 modes 5 / 6 with S x H <= 32, mode 7): "wg0" issues warpgroup 0's next QK
# right after it stored the rescaled P0, so that it runs while warpgroup 0 waits for P1_READY, instead of behind its
# cross PV (kernels/sm90/mla_decode_ot.py, qk_early).  The default since 2026-12-02 20:30 UTC: bitwise the same outputs
# as "after", 1.03x at B64/K81920/H32/S1 (the memory-bound point furthest from its roofline), 1.05x at B1, within 1%
# on the other two shapes with S x H <= 32 (H200, 2026-12-02 20:16 UTC; the check cases, memcheck and the decode GPU
# test file passed with it; docs/sm90_decode.md, "Softmax order").  "wg01" (opt-in, 2026-12-03): "wg0", and warpgroup
# 1's next QK behind its own PV; measured 0.98x "wg0" (docs/sm90_decode.md, "P1 early").  Read at trace time; part of
# the compile key.
OT32_QK_ENV = "TOKENSPEED_SM90_DECODE_OT32_QK"
OT32_QK_CHOICES = ("after", "wg0", "wg01")
OT32_QK_DEFAULT = "wg0"
# Mode 10's 64-row P0 rescale: where warpgroup 0 fences its shared-memory writes for warpgroup 1's cross PV, "always"
# (after the rescale branch, every iteration) or "rescaled" (inside it, only the warps that rewrote P0; opt-in: measured
# 0.999x "always" on the H200, 2026-12-02 20:54 UTC; kernels/sm90/mla_decode_ot.py, p0_fence).  Read at trace time;
# part of the compile key.
OT64_FENCE_ENV = "TOKENSPEED_SM90_DECODE_OT64_FENCE"
OT64_FENCE_CHOICES = ("always", "rescaled")  # (the kernel module's P0_FENCE_MODES; no cutlass import here)
OT64_FENCE_DEFAULT = "always"
# The O^T loop (every tile size): where the warpgroups publish their fold of the shared max (SCALE0 / SCALE1), "exp"
# (as built before: ptxas places both arrives after the exp), "fold" (right after the fold, the exp kept after the
# arrive), "max" ("fold", and warpgroup 1 computes its tile max, with the transposed QK its column maxima' exchange,
# before it waits for SCALE0); "auto" (the default since 2026-12-02 night): "max" on the 32- and 16-row tiles, "exp" on
# the 64-row blocks.  Bitwise the same outputs; measured on the H200 (2026-12-02 20:53 UTC): "max" 1.05x at
# B64/K81920/H32/S1 and 1.01-1.02x on the other S x H <= 32 shapes, but 0.96-0.98x on the 64-row blocks, where
# "fold" and "max" build the same SASS (ptxas moves warpgroup 1's tile max above its SCALE0 wait already) with 3x the
# spill reloads (kernels/sm90/mla_decode_ot.py, softmax; docs/sm90_decode.md, "Softmax order").  Read at trace time;
# part of the compile key.
OT_SOFTMAX_ENV = "TOKENSPEED_SM90_DECODE_OT_SOFTMAX"
OT_SOFTMAX_CHOICES = ("auto", "exp", "fold", "max")  # (past "auto": the kernel module's SOFTMAX_ORDERS)
OT_SOFTMAX_DEFAULT = "auto"
# The O^T loop (every tile size): where warpgroup 1 releases its P1 to warpgroup 0's cross PV (P1_READY): "store" (the
# default since 2026-12-03: right after its P1 store and O^T *= scales, so warpgroup 0's cross PV, and with it its next
# softmax, need not wait for warpgroup 1's own PV, cross V^T loads and P0_READY) or "cross" (as built before: behind
# warpgroup 1's cross PV's issue).  Bitwise the same outputs; two interleaved A/Bs on the H200 (2026-12-03): "store"
# 1.017x and 1.021x "cross" over the 13 shapes (kernels/sm90/mla_decode_ot.py, p1_ready; docs/sm90_decode.md, "P1
# early").  Read at trace time; part of the compile key.
OT_P1_ENV = "TOKENSPEED_SM90_DECODE_OT_P1"
OT_P1_CHOICES = ("cross", "store")  # (the kernel module's P1_READY_MODES; no cutlass import here)
OT_P1_DEFAULT = "store"
# The O^T loop's 32- and 16-row tiles (FP8 S x H <= 32, mode 7): "own" (the default since 2026-12-03: each warpgroup
# its own tiles over all 512 features, its own running max, row sums and O^T, merged once in the epilogue, so no barrier
# between the warpgroups in the loop; kernels/sm90/mla_decode_ot_own.py) or "shared" (as before: both warpgroups on
# every tile, 256 features each, one running max chained through both, SCALE0 / SCALE1 / P0_READY / P1_READY; the
# switches OT32_QK, OT_SOFTMAX and OT_P1 act on it).  "own" measured 1.07x "shared" at B64/K81920/H32/S1 (822.8 ->
# 770.7 µs), 1.13x at B128/K4096/H16, 1.21x at B1, 0.96x at B64/K81920/H16/S1 (H200, 2026-12-03, docs/sm90_decode.md,
# "Own tiles").  Outputs differ from "shared" by rounding (the sums accumulate in another order).  Read at trace time;
# part of the compile key.
OT32_LOOP_ENV = "TOKENSPEED_SM90_DECODE_OT32_LOOP"
OT32_LOOP_CHOICES = ("shared", "own")  # (the kernel module's LOOP32_MODES; no cutlass import here)
OT32_LOOP_DEFAULT = "own"
TRACE_ENV = (SCHEDULE_ENV, PDL_ENV, FP8_QK_ENV, FP8_PV_ENV, L2_PREFETCH_ENV, PRODUCER16_ENV, RS_STAGES_ENV,
             KV_EVICT_ENV, CROSS_FIRST_ENV, T16_ENV, PDL_MAIN_ENV, PAD_ROWS_ENV, P_STSM_ENV, EPILOGUE_ENV,
             EPILOGUE_FP8_ENV, T16_PT_ENV, T16_BARS_ENV, COLMAX_ENV, OT64_P0_ENV, OT64_QK_ENV,
             OT32_QK_ENV, OT64_FENCE_ENV, OT_SOFTMAX_ENV, OT_P1_ENV, OT32_LOOP_ENV)
SCHEDULES = ("auto", "seesaw", "seesaw-cpasync", "lockstep", "overlap")  # module docstring (no cutlass import here)
_MIN_PAGE = 8
_MIN_FP8_SEESAW_PAGE = 16  # the FP8 seesaw needs TMA refills (the kernel's _MIN_TMA_PAGE; no cutlass import here)
_MIN_EARLY_REFILL_PAGE = 32  # FP8 P V mode 2 (whole-slot refills): smaller pages run mode 1 (no spills)
_MAX_OT_ROWS = 32  # FP8 P V mode 5: query rows S x H of the O^T loop (the kernel's _MAX_ROWS; no cutlass import here)


@dataclasses.dataclass(frozen=True)
class DecodeKernelKey:
    """Everything the generated code depends on beyond operand shapes/dtypes."""

    kernel: str
    dtype: str
    num_heads: int
    q_len: int
    page_size: int
    causal: bool
    num_splits: int
    tokens_per_split: int
    block_n: int
    schedule: str = "seesaw"
    pdl: bool = True  # combine kernel launched with programmatic dependent launch ($TOKENSPEED_SM90_DECODE_PDL)
    qk_fp8: bool = True  # FP8 seesaw: QK on FP8 tensor cores ($TOKENSPEED_SM90_DECODE_FP8_QK)
    l2_prefetch: str = "off"  # seesaw: L2 prefetch mode ($TOKENSPEED_SM90_DECODE_L2_PREFETCH)
    pv_fp8: bool = False  # FP8 seesaw: P V on FP8 tensor cores ($TOKENSPEED_SM90_DECODE_FP8_PV 1, 2 or 3)
    early_refill: bool = False  # ... whole-slot refills after the V transpose ($TOKENSPEED_SM90_DECODE_FP8_PV 2, 3)
    vt_packed: bool = False  # ... with packed slots ($TOKENSPEED_SM90_DECODE_FP8_PV 3, 4)
    tma_producer: bool = False  # a producer warpgroup ($TOKENSPEED_SM90_DECODE_FP8_PV 4; 16-bit: ..._PRODUCER16)
    pv_ot: bool = False  # FP8: the O^T = V^T P^T loop ($TOKENSPEED_SM90_DECODE_FP8_PV 5, 6, 7)
    qk_t: bool = False  # ... with the transposed QK S^T = K Q^T ($TOKENSPEED_SM90_DECODE_FP8_PV 6, 7)
    rs_stages: int = 0  # FP8: the row-split loop with this many KV buffers ($TOKENSPEED_SM90_DECODE_FP8_PV 8); 0: not
    kv_evict: str = "normal"  # seesaw family: L2 eviction hint of the KV loads ($TOKENSPEED_SM90_DECODE_KV_EVICT)
    cross_first: bool = False  # 16-bit seesaw: warpgroup 1's cross PV first ($TOKENSPEED_SM90_DECODE_CROSS_FIRST)
    t16: bool = False  # 16-bit, S x H <= 32: the transposed loop ($TOKENSPEED_SM90_DECODE_T16)
    pdl_main: bool = False  # the main kernel launched with PDL too ($TOKENSPEED_SM90_DECODE_PDL_MAIN)
    pad_rows: str = "copy"  # the rows past S x H of a row block ($TOKENSPEED_SM90_DECODE_PAD_ROWS; "copy" if none)
    p_stsm: bool = False  # 16-bit seesaw: P stored by stmatrix ($TOKENSPEED_SM90_DECODE_P_STSM)
    o_staged: bool = False  # seesaw: O staged through smem ($TOKENSPEED_SM90_DECODE_EPILOGUE, FP8: ..._EPILOGUE_FP8)
    t16_pt_q: bool = False  # the transposed loop: P^T in the Q tile ($TOKENSPEED_SM90_DECODE_T16_PT)
    t16_chunk_bars: bool = False  # the transposed loop: per-chunk mbarriers ($TOKENSPEED_SM90_DECODE_T16_BARS)
    colmax: str = "shfl"  # the transposed loops' column maxima ($TOKENSPEED_SM90_DECODE_COLMAX)
    p0_late: bool = False  # mode 10's 64-row O^T loop: P0 stored once, after WG1's fold ($..._OT64_P0 "late")
    qk_early: str = "after"  # the O^T loop: when warpgroup 0 issues its next QK ($..._OT64_QK, $..._OT32_QK)
    p0_fence: str = "always"  # mode 10's 64-row P0 rescale: where it fences its writes ($..._OT64_FENCE)
    softmax: str = "exp"  # the O^T loop: where the softmax publishes its fold and waits ($..._OT_SOFTMAX)
    p1_ready: str = "cross"  # the O^T loop: where warpgroup 1 releases P1 to warpgroup 0 ($..._OT_P1)
    loop32: str = "shared"  # the O^T loop's 32- / 16-row tiles: shared or own tiles per warpgroup ($..._OT32_LOOP)


def supports(problem: DecodeProblem) -> str | None:
    """None when the sm90 decode kernel runs ``problem``, else why not."""
    t = problem.target
    if t.platform != "cuda" or t.sm is None or t.sm // 10 != 9:
        return f"sm90 decode needs a CUDA sm_90 target, the call targets {t}"
    if problem.dtype not in KERNEL_DTYPES:
        return f"sm90 decode kernel supports dtypes {KERNEL_DTYPES}, got {problem.dtype}"
    if problem.kv_lora_rank != 512 or problem.head_dim != 576:
        return (f"sm90 decode kernel needs kv_lora_rank 512 and head_dim 576 (DeepSeek MLA), got "
                f"{problem.kv_lora_rank} and {problem.head_dim}")
    if problem.page_size < _MIN_PAGE:
        return f"sm90 decode kernel needs page_size >= {_MIN_PAGE}, got {problem.page_size}"
    if not 1 <= problem.num_heads <= 128 or not 1 <= problem.q_len <= 16:
        return f"sm90 decode kernel needs H in 1..128 and S in 1..16, got H={problem.num_heads} S={problem.q_len}"
    try:
        import cutlass  # noqa: F401
    except ImportError:
        return "sm90 decode needs nvidia-cutlass-dsl>=4.8.1: pip install 'tokenspeed-jax[cute]'"
    return None


def _choice(value: str, choices: tuple[str, ...], source: str) -> str:
    if value not in choices:
        raise ValueError(f"{source}: expected one of {choices}, got {value!r}")
    return value


def _env(env: str, default: str, choices: tuple[str, ...] = ("0", "1")) -> str:
    """The switch ``$env`` (unset or empty: ``default``), validated against ``choices`` with the variable named."""
    return _choice(os.environ.get(env, "") or default, choices, env)


def resolve_schedule(schedule: str | None = None) -> str:
    """``schedule`` if given, else ``$TOKENSPEED_SM90_DECODE_SCHEDULE``, else ``"auto"``; validated."""
    if schedule is not None:
        return _choice(schedule, SCHEDULES, "schedule")
    return _env(SCHEDULE_ENV, "auto", SCHEDULES)


def resolve_l2_prefetch() -> str:
    """``$TOKENSPEED_SM90_DECODE_L2_PREFETCH`` (the seesaw loop's L2 prefetch mode), validated."""
    return _env(L2_PREFETCH_ENV, L2_PREFETCH_DEFAULT, L2_PREFETCH_MODES)


def resolve_fp8_pv() -> str:
    """``$TOKENSPEED_SM90_DECODE_FP8_PV`` (one of :data:`FP8_PV_MODES`, default :data:`FP8_PV_DEFAULT`), validated."""
    return _env(FP8_PV_ENV, FP8_PV_DEFAULT, FP8_PV_MODES)


def resolve_producer16() -> str:
    """``$TOKENSPEED_SM90_DECODE_PRODUCER16`` ("0" or "1", default :data:`PRODUCER16_DEFAULT`), validated."""
    return _env(PRODUCER16_ENV, PRODUCER16_DEFAULT)


def resolve_rs_stages() -> int:
    """``$TOKENSPEED_SM90_DECODE_RS_STAGES`` (the row-split loop's KV buffers, "2".."5", default "4"), validated."""
    return int(_env(RS_STAGES_ENV, RS_STAGES_DEFAULT, ("2", "3", "4", "5")))


def resolve_kv_evict() -> str:
    """``$TOKENSPEED_SM90_DECODE_KV_EVICT`` (one of :data:`KV_EVICT_CHOICES`, default :data:`KV_EVICT_DEFAULT`)."""
    return _env(KV_EVICT_ENV, KV_EVICT_DEFAULT, KV_EVICT_CHOICES)


def resolve_cross_first() -> bool:
    """``$TOKENSPEED_SM90_DECODE_CROSS_FIRST`` ("0" or "1", default :data:`CROSS_FIRST_DEFAULT`), validated."""
    return _env(CROSS_FIRST_ENV, CROSS_FIRST_DEFAULT) == "1"


def resolve_t16() -> bool:
    """``$TOKENSPEED_SM90_DECODE_T16`` ("0" or "1", default :data:`T16_DEFAULT`), validated."""
    return _env(T16_ENV, T16_DEFAULT) == "1"


def resolve_t16_pt() -> str:
    """``$TOKENSPEED_SM90_DECODE_T16_PT`` (one of :data:`T16_PT_CHOICES`, default :data:`T16_PT_DEFAULT`)."""
    return _env(T16_PT_ENV, T16_PT_DEFAULT, T16_PT_CHOICES)


class OtLoop(NamedTuple):
    """The O^T loop's switches as one call runs them (:func:`resolve_ot_loop`)."""

    p0_late: bool = False  # $..._OT64_P0 "late"
    qk_early: str = "after"  # $..._OT64_QK on 64-row blocks, $..._OT32_QK on 32- / 16-row tiles
    p0_fence: str = "always"  # $..._OT64_FENCE
    softmax: str = "exp"  # $..._OT_SOFTMAX
    p1_ready: str = "cross"  # $..._OT_P1
    loop32: str = "shared"  # $..._OT32_LOOP (32- / 16-row tiles; with "own" the fields above keep their defaults)


def resolve_ot_loop(blocks64: bool, tiles32: bool, qk_t: bool = True) -> OtLoop:
    """The O^T loop's switches for a call: ``blocks64``, the call runs its 64-row blocks (FP8 mode 10's loop without
    the transposed QK for S x H > 32; ``$..._OT64_P0``, ``$..._OT64_QK``, ``$..._OT64_FENCE``); ``tiles32``, its 32- or
    16-row tiles (``$..._OT32_QK``, ``$..._OT32_LOOP``: its "own" loop, with the transposed QK only (``qk_t``; FP8 P V
    mode 5 runs those tiles without it), has no cross-warpgroup chain, so the other switches keep their defaults
    there); ``$..._OT_SOFTMAX`` and ``$..._OT_P1`` on both; neither: the defaults of
    :class:`OtLoop` (no O^T loop).  All seven switches are validated wherever they apply or not.  ``OT64_P0=late`` alone
    runs the QK "after" (as it was measured; the late P0 store needs the S registers an early QK would hold); with
    ``OT64_QK`` set to an early mode as well, refused with both variables named; it has no P0 rescale, so no fence to
    place.  (The backend and benchmarks/trace_decode.py share this rule.)"""
    p0 = _env(OT64_P0_ENV, OT64_P0_DEFAULT, OT64_P0_CHOICES)
    qk = _env(OT64_QK_ENV, OT64_QK_DEFAULT, OT64_QK_CHOICES)
    qk32 = _env(OT32_QK_ENV, OT32_QK_DEFAULT, OT32_QK_CHOICES)
    fence = _env(OT64_FENCE_ENV, OT64_FENCE_DEFAULT, OT64_FENCE_CHOICES)
    softmax = _env(OT_SOFTMAX_ENV, OT_SOFTMAX_DEFAULT, OT_SOFTMAX_CHOICES)
    p1 = _env(OT_P1_ENV, OT_P1_DEFAULT, OT_P1_CHOICES)
    loop32 = _env(OT32_LOOP_ENV, OT32_LOOP_DEFAULT, OT32_LOOP_CHOICES)
    if tiles32 and qk_t and loop32 != "shared":
        return OtLoop(loop32=loop32)
    if tiles32:
        return OtLoop(qk_early=qk32, softmax="max" if softmax == "auto" else softmax, p1_ready=p1)
    if not blocks64:
        return OtLoop()
    if p0 == "late" and qk != "after":
        if os.environ.get(OT64_QK_ENV):
            raise ValueError(f"{OT64_P0_ENV}=late and {OT64_QK_ENV}={qk} do not combine (the late P0 store needs the "
                             f"S registers of the early QK); unset one of them")
        qk = "after"
    return OtLoop(p0 == "late", qk, "always" if p0 == "late" else fence, "exp" if softmax == "auto" else softmax, p1)


def resolve_colmax() -> str:
    """``$TOKENSPEED_SM90_DECODE_COLMAX`` (one of :data:`COLMAX_CHOICES`, default :data:`COLMAX_DEFAULT`)."""
    return _env(COLMAX_ENV, COLMAX_DEFAULT, COLMAX_CHOICES)


def resolve_t16_bars() -> str:
    """``$TOKENSPEED_SM90_DECODE_T16_BARS`` (one of :data:`T16_BARS_CHOICES`, default :data:`T16_BARS_DEFAULT`)."""
    return _env(T16_BARS_ENV, T16_BARS_DEFAULT, T16_BARS_CHOICES)


def resolve_pdl_main() -> bool:
    """``$TOKENSPEED_SM90_DECODE_PDL_MAIN`` ("0" or "1", default :data:`PDL_MAIN_DEFAULT`), validated."""
    return _env(PDL_MAIN_ENV, PDL_MAIN_DEFAULT) == "1"


def resolve_p_stsm() -> bool:
    """``$TOKENSPEED_SM90_DECODE_P_STSM`` ("0" or "1", default :data:`P_STSM_DEFAULT`), validated."""
    return _env(P_STSM_ENV, P_STSM_DEFAULT) == "1"


def resolve_epilogue() -> str:
    """``$TOKENSPEED_SM90_DECODE_EPILOGUE`` (one of :data:`EPILOGUE_CHOICES`, default :data:`EPILOGUE_DEFAULT`)."""
    return _env(EPILOGUE_ENV, EPILOGUE_DEFAULT, EPILOGUE_CHOICES)


def resolve_epilogue_fp8() -> str:
    """``$TOKENSPEED_SM90_DECODE_EPILOGUE_FP8`` (one of :data:`EPILOGUE_CHOICES`, default :data:`EPILOGUE_FP8_DEFAULT`)."""
    return _env(EPILOGUE_FP8_ENV, EPILOGUE_FP8_DEFAULT, EPILOGUE_CHOICES)


def resolve_pad_rows() -> str:
    """``$TOKENSPEED_SM90_DECODE_PAD_ROWS`` (one of :data:`PAD_ROWS_CHOICES`, default :data:`PAD_ROWS_DEFAULT`)."""
    return _env(PAD_ROWS_ENV, PAD_ROWS_DEFAULT, PAD_ROWS_CHOICES)


def decode(problem: DecodeProblem, q, kv_cache, block_table, seq_lens, softmax_scale, output_scale, *,
           kv_step: int | None = None, schedule: str | None = None):
    """Run the kernel; returns ``(out [B,S,H,512], lse [B,S,H] | None)``.

    ``kv_step`` (32 or 64) overrides the planner's kernel KV step (benchmarks compare the two).
    ``schedule`` (one of :data:`SCHEDULES`; None: ``$TOKENSPEED_SM90_DECODE_SCHEDULE`` or "auto") selects
    the main loop (module docstring); "seesaw" and "overlap" need the 64-token KV step."""
    from tokenspeed_jax import ffi
    from tokenspeed_jax.kernels.sm90.mla_decode import launch_mla_decode
    from tokenspeed_jax.kernels.sm90.mla_decode_ot import launch_mla_decode_ot
    from tokenspeed_jax.kernels.sm90.mla_decode_ot16 import launch_mla_decode_ot16
    from tokenspeed_jax.kernels.sm90.mla_decode_ot_own import launch_mla_decode_ot_own
    from tokenspeed_jax.kernels.sm90.mla_decode_rs import launch_mla_decode_rs
    from tokenspeed_jax.kernels.sm90.mla_decode_seesaw import launch_mla_decode_seesaw

    why = supports(problem)
    if why:
        raise ValueError(why)
    plan = plan_for_problem(problem)
    B, S, H = problem.batch, problem.q_len, problem.num_heads
    block_n = kv_step or dict(plan.extra).get("kv_step", plan.block_n)
    if block_n not in (32, 64):
        raise ValueError(f"kv_step: expected 32 or 64, got {kv_step!r}")
    schedule = resolve_schedule(schedule)
    if schedule == "auto":
        schedule = "seesaw" if block_n == 64 else "lockstep"
    seesaw = schedule in ("seesaw", "seesaw-cpasync")
    no_tma = schedule == "seesaw-cpasync" or problem.page_size < _MIN_FP8_SEESAW_PAGE
    if seesaw and problem.dtype == "float8_e4m3fn" and no_tma:
        schedule, seesaw = "lockstep", False  # FP8 seesaw: TMA refills only (module docstring)
    if (seesaw or schedule == "overlap") and block_n != 64:
        raise ValueError(f"schedule: {schedule!r} needs kv_step 64, got kv_step {block_n}")
    launch = launch_mla_decode_seesaw if seesaw else launch_mla_decode
    pdl = os.environ.get(PDL_ENV, "1") != "0"
    fp8_seesaw = seesaw and problem.dtype == "float8_e4m3fn"
    qk_fp8 = fp8_seesaw and os.environ.get(FP8_QK_ENV, "1") != "0"
    fp8_pv = resolve_fp8_pv() if qk_fp8 else "0"
    # mode 2 with 16-token pages (4 TMA boxes per chunk) spills about 200 bytes (CPU compile, 2026-12-01):
    # those run mode 1
    pv_fp8 = fp8_pv != "0"
    early_refill = fp8_pv not in ("0", "1") and problem.page_size >= _MIN_EARLY_REFILL_PAGE
    vt_packed = fp8_pv not in ("0", "1", "2")
    # modes 5 and 6 (the O^T loop; 6 with the transposed QK) for S x H <= 32 rows with pages >= 32, otherwise mode 4
    # (mode 6's 32-row tiles were slower there); mode 7 runs mode 6's loop for any S x H, on 32-row tiles (its own
    # plan: block_m 32); mode 10 (the default) is mode 6, with mode 5's loop on the default plan's 64-row blocks
    # instead of mode 4 for more than 32 rows
    # mode 8: the row-split loop (the default plan's 64-row blocks; one computing warpgroup for S x H <= 32) for every
    # S x H; mode 9: that loop for S x H <= 32, mode 4 for more rows
    small = S * H <= _MAX_OT_ROWS
    rs_stages = resolve_rs_stages() if early_refill and (fp8_pv == "8" or (fp8_pv == "9" and small)) else 0
    qk_t = early_refill and (fp8_pv == "7" or (fp8_pv in ("6", "10") and small))
    pv_ot = qk_t or (early_refill and ((fp8_pv == "5" and small) or (fp8_pv == "10" and not small)))
    if qk_t:
        plan = plan_for_problem(problem, block_m=_MAX_OT_ROWS)
    if pv_ot:
        launch = launch_mla_decode_ot
    if rs_stages:
        launch = launch_mla_decode_rs
    if fp8_seesaw:
        tma_producer = fp8_pv not in ("0", "1", "2", "3") and early_refill
    else:  # (with 16-token pages the producer's coordinates, 4 boxes per chunk, spill in its 24 registers)
        tma_producer = (seesaw and not no_tma and problem.page_size >= _MIN_EARLY_REFILL_PAGE
                        and resolve_producer16() == "1")
    l2_prefetch = resolve_l2_prefetch() if seesaw else "off"
    kv_evict = resolve_kv_evict() if seesaw and not no_tma else "normal"
    # the transposed 16-bit loop: S x H <= 32, where the seesaw loop would pad its matmuls to 64 rows (it has the
    # producer warpgroup's refills, so pages >= 32 and TMA, as the 16-bit producer itself)
    t16 = (tma_producer and not fp8_seesaw and S * H <= _MAX_OT_ROWS and resolve_t16())
    if t16:
        launch = launch_mla_decode_ot16
    t16_pt_q = resolve_t16_pt() == "q" and t16  # (both validated wherever they apply or not)
    t16_chunk_bars = resolve_t16_bars() == "chunk" and t16
    ot_loop = resolve_ot_loop(pv_ot and not qk_t and not small, pv_ot and (qk_t or small), qk_t)
    if ot_loop.loop32 != "shared":  # (each warpgroup on its own 32- / 16-row tiles)
        launch = launch_mla_decode_ot_own
    colmax = resolve_colmax()  # (validated wherever it applies or not)
    if not (qk_t or t16):  # the transposed loops only
        colmax = "shfl"
    cross_first = seesaw and problem.dtype != "float8_e4m3fn" and not t16 and resolve_cross_first()
    pdl_main = resolve_pdl_main()
    # (only the seesaw launcher takes it; the O^T and transposed loops run S x H <= 32 on N = S x H columns)
    seesaw_launch = seesaw and not pv_ot and not rs_stages and not t16
    pad_rows = resolve_pad_rows()  # (validated wherever it applies or not)
    if not (seesaw_launch and S * H % 64):
        pad_rows = "copy"
    # (all three validated wherever they apply or not)
    p_stsm, o_staged, o_staged8 = resolve_p_stsm(), resolve_epilogue() == "staged", resolve_epilogue_fp8() == "staged"
    if fp8_seesaw:  # FP8 mode 4: its own epilogue switch, no P_STSM (e4m3 P)
        p_stsm, o_staged = False, o_staged8
    if not seesaw_launch:  # the seesaw loops only
        p_stsm = o_staged = False
    key = DecodeKernelKey("mla_decode_sm90.v11", problem.dtype, H, S, problem.page_size, problem.causal,
                          plan.num_splits, plan.tokens_per_split, block_n, schedule, pdl, qk_fp8, l2_prefetch, pv_fp8,
                          early_refill, vt_packed, tma_producer, pv_ot, qk_t, rs_stages, kv_evict, cross_first, t16,
                          pdl_main, pad_rows, p_stsm, o_staged, t16_pt_q, t16_chunk_bars, colmax, *ot_loop)
    outputs = [jax.ShapeDtypeStruct((B, S, H, problem.kv_lora_rank), jnp.dtype(problem.out_dtype)),
               jax.ShapeDtypeStruct((B, S, H), jnp.float32)]
    outputs += [jax.ShapeDtypeStruct(w.shape, jnp.dtype(w.dtype)) for w in plan.workspace]
    call = ffi.custom_call(
        TARGET, launch, outputs=outputs, compile_key=key,
        dtype=problem.dtype, num_heads=H, q_len=S, page_size=problem.page_size, causal=problem.causal,
        num_splits=plan.num_splits, tokens_per_split=plan.tokens_per_split, block_n=block_n, schedule=schedule,
        pdl=pdl, **({"qk_fp8": qk_fp8, "pv_fp8": pv_fp8, "early_refill": early_refill, "vt_packed": vt_packed}
                    if fp8_seesaw and seesaw_launch else {}),
        **({"tma_producer": tma_producer} if seesaw_launch else {}),
        **({"l2_prefetch": l2_prefetch} if seesaw and not rs_stages else {}),
        **({"qk_t": qk_t} if pv_ot else {}),
        **({"stages": rs_stages} if rs_stages else {}),
        **({"kv_evict": kv_evict} if kv_evict != "normal" else {}),
        **({"cross_first": True} if cross_first else {}),
        **({"pdl_main": True} if pdl_main else {}),
        **({"pad_rows": pad_rows} if pad_rows != "copy" else {}),
        **({"p_stsm": True} if p_stsm else {}),
        **({"o_staged": True} if o_staged else {}),
        **({"pt_q": True} if t16_pt_q else {}),
        **({"chunk_bars": True} if t16_chunk_bars else {}),
        **({"colmax": colmax} if colmax != "shfl" else {}),
        **{k: v for k, v in ot_loop._asdict().items() if v != OtLoop._field_defaults[k]},
    )
    res = call(q, kv_cache, block_table.astype(jnp.int32), seq_lens.astype(jnp.int32),
               ffi.scalar_operand(softmax_scale), ffi.scalar_operand(output_scale))
    out, lse = res[0], res[1]
    return out, (lse if problem.return_lse else None)
