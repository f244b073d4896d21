#!/usr/bin/env bash
# Short H200 call (carry [".device"]) for TOKENSPEED_SM90_DECODE_PRODUCER16=1 (the 16-bit producer warpgroup):
#   source .device/bootstrap.sh && bash scripts/h200_producer16_quick.sh
# prewarm (CPU) of 3 check cases with PRODUCER16=1 and 5 BF16 shapes of the issue matrix with 0 and 1; the 3 check
# cases against the fp32 reference (check16.json); the interleaved A/B of PRODUCER16 0 / 1 on the 5 shapes (ab16.json).
set -uo pipefail
export CUTE_DSL_ARCH=sm_90a TOKENSPEED_JAX_CACHE_DIR=${TOKENSPEED_JAX_CACHE_DIR:-/tmp/tsj_cache} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
V=TOKENSPEED_SM90_DECODE_PRODUCER16
N="('s2h128p64', 's4h32p32', 's2h32p64_garbage')"
C="64,81920,64,16,1 64,81920,64,32,4 64,81920,64,128,1 128,4096,64,16,1 8,16384,64,128,2"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
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
timeout 90 env $V=1 python -c "
import json, os
from benchmarks.decode import CHECK, check
seed = int.from_bytes(os.urandom(3), 'little')
r = check([c for c in CHECK if c.name in $N], seed)
json.dump({'seed': seed, '$V': '1', 'rows': r}, open('$OUT/check16.json', 'w'), indent=1)
print('CHECK', sum(x['ok'] for x in r), '/', len(r), 'seed', seed)
" > "$OUT/check16.log" 2>&1; echo "check rc=$?"
grep -E '^CHECK|"ok": false|Error' "$OUT/check16.log" | head -n 8
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
