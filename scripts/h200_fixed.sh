#!/usr/bin/env bash
# One H200 call (carry [".device"]): where the short shapes lose against FlashMLA, ~6 min on a fresh machine.
#   source .device/bootstrap.sh && bash scripts/h200_fixed.sh
# 1. a K sweep of B128/H16/S1, B128/H128/S1, B8/H128/S2 and B64/H16/S1 (the planner's grid is the same at every K of
#    a sweep), every contender interleaved as in the benchmark (sweep.json / .png), and the straight-line fits
#    us = a + b * K per contender (scripts/fixed_cost.py: fixed_cost.json): a is the cost per call that does not
#    grow with K (launch, ramp, last tiles and epilogue, combine);
# 2. the timeline of FP8 mode 6 (the O^T loop) at B64/K81920 H16/S1 against H32/S1 (trace_fp8_ot.json): why the
#    second reaches 81% of the bandwidth roofline and the first 94% (docs/sm90_decode.md, "Power").
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/h200_lib.sh"
gpu_line
SHAPES="128,512,64,16,1 128,1024,64,16,1 128,2048,64,16,1 128,4096,64,16,1 128,8192,64,16,1 128,16384,64,16,1
128,512,64,128,1 128,1024,64,128,1 128,2048,64,128,1 128,4096,64,128,1 128,8192,64,128,1
8,4096,64,128,2 8,8192,64,128,2 8,16384,64,128,2 8,32768,64,128,2 64,4096,64,16,1 64,16384,64,16,1 64,81920,64,16,1"
stamp "sweep (prewarm on the CPU first)"
# shellcheck disable=SC2086
timeout 420 python -m benchmarks.decode --prewarm 15 --bench --no-xla --shapes $SHAPES --out "$OUT/sweep.json" \
  --png "$OUT/sweep.png" > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
grep -E "Error|error" "$OUT/sweep.log" | head -n 5
python scripts/fixed_cost.py "$OUT/sweep.json" --out "$OUT/fixed_cost.json"
stamp "FP8 mode 6 timeline"
timeout $((570 - ($(date +%s) - t0))) env TOKENSPEED_SM90_DECODE_FP8_PV=6 python -m benchmarks.trace_decode \
  --cases 64,81920,64,16,1 64,81920,64,32,1 --out "$OUT/trace_fp8_ot.json" > "$OUT/trace.log" 2>&1
echo "trace rc=$?"; tail -n 50 "$OUT/trace.log"
stamp done
