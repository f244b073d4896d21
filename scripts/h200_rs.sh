#!/usr/bin/env bash
# The H200 runs behind the row-split FP8 loop (TOKENSPEED_SM90_DECODE_FP8_PV=8, kernels/sm90/mla_decode_rs.py), one
# device call (carry [".device"]; ~2 min warm):
#   source .device/bootstrap.sh && bash scripts/h200_rs.sh
# 1. interleaved A/B of its KV ring (TOKENSPEED_SM90_DECODE_RS_STAGES over $STAGES, default "2 4 5") on the FP8 shapes
#    of the issue matrix with 64 or more query rows ($CASES), FP8_PV=8;  2. ncu (speed of light, pipes, memory,
#    stalls) of mode 4 and mode 8 at B64/K16384 H32/S4 (NCU= turns it off).  Files: ab_stages.{log,json},
#    ncu_4.csv, ncu_8.csv.  (Its correctness and the A/B against the default: M=8 AB="6 8" NCU= bash
#    scripts/h200_fp8pv.sh check; the results of 2026-12-01 are in docs/sm90_decode.md, "Row-split loop".)
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/h200_lib.sh"
CASES=${CASES:-64,81920,64,16,4 64,81920,64,32,4 64,81920,64,128,1 8,16384,64,128,2}
export TOKENSPEED_SM90_DECODE_FP8_PV=8
gpu_line
stamp "A/B RS_STAGES ${STAGES:-2 4 5}"
timeout 200 python scripts/decode_ab.py TOKENSPEED_SM90_DECODE_RS_STAGES ${STAGES:-2 4 5} --dtype float8_e4m3fn \
  --cases $CASES --prewarm 14 --out "$OUT/ab_stages.json" > "$OUT/ab_stages.log" 2>&1; echo "ab rc=$?"
grep '^{"case"' "$OUT/ab_stages.log" | python -c "
import sys, json
for l in sys.stdin:
    x = json.loads(l); print(x['case'], {k: round(v, 1) for k, v in x.items() if k.startswith('us_')}, x.get('max_abs_diff'))"
if [ -n "${NCU-1}" ]; then
  for v in 4 8; do
    stamp "ncu FP8_PV=$v"
    timeout 150 env TOKENSPEED_SM90_DECODE_FP8_PV=$v ncu --kernel-name regex:'seesaw_kernel|rs_kernel' --launch-skip 1 \
      --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section WarpStateStats --csv --page details python -m benchmarks.profile_decode --dtype float8_e4m3fn \
      --cases 64,16384,64,32,4 --no-flashmla > "$OUT/ncu_$v.csv" 2>&1; echo "ncu rc=$?"
    grep -E '"(Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Issue Slots Busy|Executed Ipc Active)' \
      "$OUT/ncu_$v.csv" | cut -d, -f12- | head -n 12
  done
fi
stamp "done"
