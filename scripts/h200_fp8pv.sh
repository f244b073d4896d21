#!/usr/bin/env bash
# The H200 runs behind the FP8 P V on FP8 tensor cores (TOKENSPEED_SM90_DECODE_FP8_PV), two device calls back to back
# (carry [".device"]):
#   source .device/bootstrap.sh && bash scripts/h200_fp8pv.sh check   # ~9 min
#   source .device/bootstrap.sh && bash scripts/h200_fp8pv.sh bench   # ~6 min
# check: in the background the compute-sanitizer memcheck test with FP8_PV=1 while the configurations compile on
#   the CPU; the FP8 cases of the check matrix (and two BF16 ones) with FP8_PV=1 against the fp32 reference
#   (benchmarks.decode.check, the FP8_P_ROUND tolerance); the interleaved A/B FP8_PV 0 / 1 over the 13 shapes of
#   the issue matrix in FP8.  Files: memcheck.log, check.log, check.json, ab.log, ab_fp8pv.json
# bench: the decode benchmark against FlashMLA BF16 / FP8 with FP8_PV=1 (decode.json, decode.png, bench.log).
set -uo pipefail
export CUTE_DSL_ARCH=sm_90a TOKENSPEED_JAX_CACHE_DIR=${TOKENSPEED_JAX_CACHE_DIR:-/tmp/tsj_cache} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
V=TOKENSPEED_SM90_DECODE_FP8_PV
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
if [ "${1:-check}" = check ]; then
  (
    timeout 170 env $V=1 TOKENSPEED_SANITIZER=1 python -m pytest -q -s -rfEx -p no:cacheprovider -k memcheck \
      tests/gpu/test_sm90_decode.py > "$OUT/memcheck.log" 2>&1
    echo "memcheck rc=$?" >> "$OUT/memcheck.log"
  ) &
  BG=$!
  stamp "prewarm (CPU)"
  timeout 220 python -c "
import dataclasses
from benchmarks.decode import BENCH, CHECK, bench_case, prewarm
from benchmarks.harness import scoped_env
cases = [dataclasses.replace(bench_case(*s), dtype='float8_e4m3fn') for s in BENCH]
with scoped_env('$V', '1'):
    prewarm(cases + [c for c in CHECK if c.dtype == 'float8_e4m3fn'], 14)
with scoped_env('$V', '0'):
    prewarm(cases, 14)
" > "$OUT/ab.log" 2>&1; echo "prewarm rc=$?" | tee -a "$OUT/ab.log"
  stamp "check FP8_PV=1"
  timeout 150 env $V=1 python -c "
import json, os
from benchmarks.decode import CHECK, check
names = [c.name for c in CHECK if c.dtype == 'float8_e4m3fn'] + ['s2h32p64_garbage', 'b1s1h16p64_short']
r = check([c for c in CHECK if c.name in names], int.from_bytes(os.urandom(3), 'little'))
json.dump(r, open('$OUT/check.json', 'w'), indent=1)
print('CHECK', sum(x['ok'] for x in r), '/', len(r))
" > "$OUT/check.log" 2>&1; echo "check rc=$?"
  grep -E '^CHECK|"ok": false|Error|error' "$OUT/check.log" | head -n 12
  while kill -0 $BG 2>/dev/null; do sleep 2; done; stamp "memcheck done"
  grep -E "memcheck rc|ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -n 4
  stamp "A/B $V 0 1 (FP8)"
  timeout 170 python scripts/decode_ab.py $V 0 1 --dtype float8_e4m3fn --cases matrix --out "$OUT/ab_fp8pv.json" \
    >> "$OUT/ab.log" 2>&1; echo "ab rc=$?"
  grep '^{"case"' "$OUT/ab.log" | python -c "
import sys, json, math
r = [json.loads(l) for l in sys.stdin]
for x in r: print(x['case'], round(x['us_0'], 1), round(x['us_1'], 1), round(x['us_0'] / x['us_1'], 3))
if r: print('geomean 0/1', round(math.exp(sum(math.log(x['us_0'] / x['us_1']) for x in r) / len(r)), 4))
"
else
  stamp "benchmark vs FlashMLA ($V=1)"
  timeout 420 env $V=1 python -m benchmarks.decode --prewarm 16 --bench --no-xla --png "$OUT/decode.png" \
    --out "$OUT/decode.json" > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
  grep -v "^prewarm\|^{\|max |ours" "$OUT/bench.log" | tail -n 30
fi
stamp "done"
