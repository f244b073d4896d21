#!/usr/bin/env bash
# The H200 runs behind the FP8 P V on FP8 tensor cores (TOKENSPEED_SM90_DECODE_FP8_PV), one device call each
# (carry [".device"]; 2026-12-01 wall times, warm machine):
#   source .device/bootstrap.sh && M=4 AB="3 4" NCU= bash scripts/h200_fp8pv.sh check   # ~3 min (ncu off)
#   source .device/bootstrap.sh && M=6 EXTRA=5 AB="4 5 6" NCU= bash scripts/h200_fp8pv.sh check   # modes 5 and 6
#   source .device/bootstrap.sh && M=4 bash scripts/h200_fp8pv.sh profile               # ~5 min
#   source .device/bootstrap.sh && M=4 bash scripts/h200_fp8pv.sh bench                 # ~1.5-6 min
#   source .device/bootstrap.sh && M=4 AB="0 1" W=<switch> DT=float8_e4m3fn bash scripts/h200_fp8pv.sh ab   # ~1 min
# check: the configurations compile on the CPU; then in the background the compute-sanitizer memcheck test with
#   FP8_PV=$M; the FP8 cases of the check matrix (and two BF16 ones) with FP8_PV=$M against the fp32 reference
#   (benchmarks.decode.check, the FP8_P_ROUND tolerance), and the FP8 cases with each mode of $EXTRA (check_<mode>.json);
#   the interleaved A/B of FP8_PV over the values $AB on the
#   13 shapes of the issue matrix in FP8.  Files: memcheck.log, check.log, check.json, ab.log, ab_fp8pv.json
# profile: the memcheck test alone with FP8_PV=$M; ncu (raw metrics of 4 sections: stall reasons, pipes, issue) of
#   our kernel at B64/K16384 H32/S4 and H16/S1, FP8 with FP8_PV 0 and $M, and BF16 next to FlashMLA BF16
#   (its FP8 fork segfaulted under ncu on 2026-12-01).  Files: memcheck.log, ncu_fp8_0.csv, ncu_fp8_$M.csv, ncu_bf16_0.csv
# ab: the interleaved A/B of the switch $W (default TOKENSPEED_SM90_DECODE_L2_PREFETCH) over the values $AB on the
#   13 shapes, for each dtype of $DT (default FP8 and BF16), with FP8_PV=$M.  Files: ab_<switch>_<dtype>.{log,json}
#   (<switch>: $W without TOKENSPEED_SM90_DECODE_, so that two A/Bs chained in one call keep both; before 2026-12-02
#   evening: ab_<dtype>); ab_<switch>_$TAG_<dtype> with TAG set (two A/Bs of one switch in one call, e.g. under
#   different values of another switch)
# bench: the decode benchmark against FlashMLA BF16 / FP8 with FP8_PV=$M (decode.json, decode.png, bench.log).
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/h200_lib.sh"
V=TOKENSPEED_SM90_DECODE_FP8_PV
M=${M:-4}; AB=${AB:-3 4}
ab_table() {  # the rows of a decode_ab.py log: µs per value, ratios to the first value, max |diff|; geometric means
  grep '^{"case"' "$1" | python -c "
import sys, json, math
r = [json.loads(l) for l in sys.stdin]
vs = '$AB'.split()
for x in r: print(x['case'], *[round(x['us_' + v], 1) for v in vs], *[round(x['us_' + vs[0]] / x['us_' + v], 3) for v in vs[1:]], round(x['max_abs_diff'], 4))
for v in vs[1:]:
    if r: print('geomean', vs[0], '/', v, round(math.exp(sum(math.log(x['us_' + vs[0]] / x['us_' + v]) for x in r) / len(r)), 4))
"
}
gpu_line
if [ "${1:-check}" = check ]; then
  stamp "prewarm (CPU)"
  timeout 220 python -c "
import dataclasses
from benchmarks.decode import BENCH, CHECK, bench_case, prewarm
from benchmarks.harness import scoped_env
cases = [dataclasses.replace(bench_case(*s), dtype='float8_e4m3fn') for s in BENCH]
for m in '$M ${EXTRA:-}'.split():
    with scoped_env('$V', m):
        prewarm([c for c in CHECK if c.dtype == 'float8_e4m3fn'], 14)
for v in '$AB'.split():
    with scoped_env('$V', v):
        prewarm(cases, 14)
" > "$OUT/ab.log" 2>&1; echo "prewarm rc=$?" | tee -a "$OUT/ab.log"
  memcheck_start 170 $V=$M
  stamp "check FP8_PV=$M"
  check_cases 150 $V $M "c.dtype == 'float8_e4m3fn' or c.name in ('s2h32p64_garbage', 'b1s1h16p64_short')" check
  for m in ${EXTRA:-}; do  # more modes, on the FP8 cases (e.g. EXTRA=5 with M=6: the O^T loop's two variants)
    stamp "check FP8_PV=$m"
    check_cases 120 $V $m "c.dtype == 'float8_e4m3fn'" "check_$m"
  done
  memcheck_wait
  stamp "A/B $V $AB (FP8)"
  timeout 200 python scripts/decode_ab.py $V $AB --dtype float8_e4m3fn --cases matrix --out "$OUT/ab_fp8pv.json" \
    >> "$OUT/ab.log" 2>&1; echo "ab rc=$?"
  ab_table "$OUT/ab.log"
  if [ -n "${NCU-1}" ]; then  # (NCU= turns it off) where the FP8 time goes: ours (FP8_PV 0 and $M) next to FlashMLA's FP8 fork
    stamp "ncu"
    for v in 0 $M; do
      timeout 120 env $V=$v ncu --kernel-name regex:'seesaw_kernel|flash' --launch-skip 0 --launch-count 20 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats \
        --section MemoryWorkloadAnalysis --csv --page details python -m benchmarks.profile_decode --dtype float8_e4m3fn \
        --cases 64,16384,64,32,4 64,16384,64,16,1 $([ $v = 0 ] || echo --no-flashmla) > "$OUT/ncu_$v.csv" 2>&1
      echo "ncu $v rc=$?"
    done
    grep -c '"Duration"' "$OUT"/ncu_*.csv
  fi
elif [ "$1" = profile ]; then  # memcheck with FP8_PV=$M alone; ncu stall reasons (raw metrics), FP8 0 / $M and BF16
  timeout 200 env $V=$M TOKENSPEED_SANITIZER=1 python -m pytest -q -s -rfEx -p no:cacheprovider -k memcheck \
    tests/gpu/test_sm90_decode.py > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?" | tee -a "$OUT/memcheck.log"
  grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -n 3
  S="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats"
  C="--cases 64,16384,64,32,4 64,16384,64,16,1"
  for run in fp8:0 fp8:$M bf16:0; do
    d=${run%%:*}; v=${run#*:}
    stamp "ncu $d FP8_PV=$v"
    timeout 150 env $V=$v ncu --kernel-name regex:'seesaw_kernel|flash' --launch-count 20 $S --csv --page raw \
      python -m benchmarks.profile_decode $C $([ $d = fp8 ] && echo --dtype float8_e4m3fn --no-flashmla) \
      > "$OUT/ncu_${d}_$v.csv" 2>&1; echo "ncu rc=$?"; grep -c '^"[0-9]' "$OUT/ncu_${d}_$v.csv"
  done
elif [ "$1" = ab ]; then  # interleaved A/B of the switch $W over the values $AB, for each dtype of $DT (FP8_PV=$M)
  W=${W:-TOKENSPEED_SM90_DECODE_L2_PREFETCH}
  for d in ${DT:-float8_e4m3fn bfloat16}; do
    stamp "A/B $W $AB ($d)"
    f="$OUT/ab_${W#TOKENSPEED_SM90_DECODE_}${TAG:+_$TAG}_$d"
    timeout 280 env $V=$M python scripts/decode_ab.py $W $AB --dtype $d --cases matrix --prewarm 14 \
      --out "$f.json" > "$f.log" 2>&1; echo "ab rc=$?"
    ab_table "$f.log"
  done
else
  stamp "benchmark vs FlashMLA ($V=$M)"
  timeout 420 env $V=$M python -m benchmarks.decode --prewarm 16 --bench --no-xla --png "$OUT/decode.png" \
    --out "$OUT/decode.json" > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
  grep -v "^prewarm\|^{\|max |ours" "$OUT/bench.log" | tail -n 30
fi
stamp "done"
