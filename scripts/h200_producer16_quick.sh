#!/usr/bin/env bash
# Short H200 call (carry [".device"]) for TOKENSPEED_SM90_DECODE_PRODUCER16=1 (the 16-bit producer warpgroup):
#   source .device/bootstrap.sh && bash scripts/h200_producer16_quick.sh
# prewarm (CPU) of 3 check cases with PRODUCER16=1 and 5 BF16 shapes of the issue matrix with 0 and 1; the 3 check
# cases against the fp32 reference (check16.json); the interleaved A/B of PRODUCER16 0 / 1 on the 5 shapes (ab16.json).
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/h200_lib.sh"
V=TOKENSPEED_SM90_DECODE_PRODUCER16
N="('s2h128p64', 's4h32p32', 's2h32p64_garbage')"
C="64,81920,64,16,1 64,81920,64,32,4 64,81920,64,128,1 128,4096,64,16,1 8,16384,64,128,2"
timeout 150 python -c "
from benchmarks.decode import CHECK, bench_case, prewarm
from benchmarks.harness import scoped_env
with scoped_env('$V', '1'):
    prewarm([c for c in CHECK if c.name in $N], 15)
for v in ('0', '1'):
    with scoped_env('$V', v):
        prewarm([bench_case(*(int(v) for v in s.split(','))) for s in '$C'.split()], 15)
" > "$OUT/prewarm.log" 2>&1; echo "prewarm rc=$?"
stamp "check $V=1"
check_cases 90 $V 1 "c.name in $N" check16
stamp "A/B $V 0 1 (bfloat16)"
timeout 100 python scripts/decode_ab.py $V 0 1 --dtype bfloat16 --cases $C --out "$OUT/ab16.json" \
  > "$OUT/ab16.log" 2>&1; echo "ab rc=$?"
grep '^{"case"' "$OUT/ab16.log" | python -c "
import sys, json, math
r = [json.loads(l) for l in sys.stdin]
for x in r: print(x['case'], round(x['us_0'], 1), round(x['us_1'], 1), round(x['us_0'] / x['us_1'], 3), x['max_abs_diff'])
if r: print('geomean 0 / 1', round(math.exp(sum(math.log(x['us_0'] / x['us_1']) for x in r) / len(r)), 4))
"
stamp done
