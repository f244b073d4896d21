#!/usr/bin/env bash
# One H200 call (carry [".device"]) for the 16-bit loop's producer warpgroup (TOKENSPEED_SM90_DECODE_PRODUCER16)
# and the GPU tests of the defaults (2026-12-01: ~8 min, warm machine):
#   source .device/bootstrap.sh && bash scripts/h200_producer.sh
# 1. prewarm (CPU, 14 processes): the check matrix with the defaults, its 16-bit cases with PRODUCER16=1, the 13
#    BF16 shapes of the issue matrix with PRODUCER16 0 and 1;
# 2. the compute-sanitizer memcheck test with PRODUCER16=1 (background) and the check's 16-bit cases with
#    PRODUCER16=1 against the fp32 reference (check16.json);
# 3. the interleaved A/B of PRODUCER16 0 / 1 on the 13 BF16 shapes (ab16.json);
# 4. tests/gpu/test_sm90_decode.py and tests/gpu/test_vllm_adapter.py with the defaults, memcheck excluded.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/h200_lib.sh"
V=TOKENSPEED_SM90_DECODE_PRODUCER16
gpu_line
stamp "prewarm (CPU)"
timeout 200 python -c "
from benchmarks.decode import BENCH, CHECK, bench_case, prewarm
from benchmarks.harness import scoped_env
prewarm(CHECK, 14)
with scoped_env('$V', '1'):
    prewarm([c for c in CHECK if c.dtype != 'float8_e4m3fn'], 14)
for v in ('0', '1'):
    with scoped_env('$V', v):
        prewarm([bench_case(*s) for s in BENCH], 14)
" > "$OUT/prewarm.log" 2>&1; echo "prewarm rc=$?"
(
  timeout 170 env $V=1 TOKENSPEED_SANITIZER=1 python -m pytest -q -s -rfEx -p no:cacheprovider -k memcheck \
    tests/gpu/test_sm90_decode.py > "$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$?" >> "$OUT/memcheck.log"
) &
BG=$!
stamp "check $V=1 (16-bit cases)"
check_cases 150 $V 1 "c.dtype != 'float8_e4m3fn'" check16
while kill -0 $BG 2>/dev/null; do sleep 2; done; stamp "memcheck done"
grep -E "memcheck rc|ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -n 4
stamp "A/B $V 0 1 (bfloat16)"
timeout 150 python scripts/decode_ab.py $V 0 1 --dtype bfloat16 --cases matrix --out "$OUT/ab16.json" \
  > "$OUT/ab16.log" 2>&1; echo "ab rc=$?"
grep '^{"case"' "$OUT/ab16.log" | python -c "
import sys, json, math
r = [json.loads(l) for l in sys.stdin]
for x in r: print(x['case'], round(x['us_0'], 1), round(x['us_1'], 1), round(x['us_0'] / x['us_1'], 3), x['max_abs_diff'])
if r: print('geomean 0 / 1', round(math.exp(sum(math.log(x['us_0'] / x['us_1']) for x in r) / len(r)), 4))
"
stamp "GPU tests (defaults)"
timeout $((575 - ($(date +%s) - t0))) python -m pytest -q -rfEx -p no:cacheprovider -k "not memcheck" \
  tests/gpu/test_sm90_decode.py tests/gpu/test_vllm_adapter.py > "$OUT/gpu_tests.log" 2>&1; echo "tests rc=$?"
tail -n 6 "$OUT/gpu_tests.log"
stamp done
