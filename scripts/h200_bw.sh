#!/usr/bin/env bash
# The H200 run behind the KV eviction hint (TOKENSPEED_SM90_DECODE_KV_EVICT) and the 16-bit loop's cross-PV-first
# order (TOKENSPEED_SM90_DECODE_CROSS_FIRST), one device call (carry [".device"]):
#   source .device/bootstrap.sh && bash scripts/h200_bw.sh            # ~8 min
# 1. the BF16 cases of the check matrix with CROSS_FIRST=1 against the fp32 reference (check_cf.json), the memcheck
#    test with it beside them;
# 2. interleaved A/B on the 13 shapes of the issue matrix, BF16: default / CROSS_FIRST=1 / KV_EVICT=first / both
#    (ab_bf16.json); FP8: default / KV_EVICT=first, plus B128/H16/S1 at K 1024..16384 (fixed cost per call vs per
#    token; ab_fp8.json);
# 3. the 16-bit loop's timeline at B64/K81920/H16/S1 (memory-bound), own PV first and cross PV first (trace_*.json).
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/h200_lib.sh"
gpu_line
ab_rows() {  # µs per value and ratio to the first, per case; geometric means of the ratios
  grep '^{"case"' "$1" | python -c "
import sys, json, math
r = [json.loads(l) for l in sys.stdin]
vs = [k[3:] for k in r[0] if k.startswith('us_')] if r else []
for x in r: print(x['case'], *[round(x['us_' + v], 1) for v in vs], *[round(x['us_' + vs[0]] / x['us_' + v], 3) for v in vs[1:]], x['bitwise_equal'])
for v in vs[1:]:
    if r: print('geomean', vs[0], '/', v, round(math.exp(sum(math.log(x['us_' + vs[0]] / x['us_' + v]) for x in r) / len(r)), 4))
"
}
KS="128,1024,64,16,1 128,2048,64,16,1 128,4096,64,16,1 128,8192,64,16,1 128,16384,64,16,1"
stamp "prewarm (CPU)"
timeout 260 python -c "
import dataclasses
from benchmarks.decode import BENCH, CHECK, bench_case, prewarm
from benchmarks.harness import scoped_env
from scripts.decode_ab import switches
bf = [bench_case(*s) for s in BENCH]
f8 = [dataclasses.replace(c, dtype='float8_e4m3fn') for c in bf]
ks = [bench_case(*map(int, s.split(','))) for s in '$KS'.split()]
ks8 = [dataclasses.replace(c, dtype='float8_e4m3fn') for c in ks]
with switches('-', 'CROSS_FIRST=1'):
    prewarm([c for c in CHECK if c.dtype != 'float8_e4m3fn'], 15)
for v in ('-', 'CROSS_FIRST=1', 'KV_EVICT=first', 'CROSS_FIRST=1,KV_EVICT=first'):
    with switches('-', v):
        prewarm(bf, 15)
for v in ('-', 'KV_EVICT=first'):
    with switches('-', v):
        prewarm(f8 + ks8, 15)
" > "$OUT/prewarm.log" 2>&1; echo "prewarm rc=$?"; grep "configs in" "$OUT/prewarm.log"
memcheck_start 200 TOKENSPEED_SM90_DECODE_CROSS_FIRST=1
stamp "check CROSS_FIRST=1 (BF16 cases)"
check_cases 200 TOKENSPEED_SM90_DECODE_CROSS_FIRST 1 "c.dtype != 'float8_e4m3fn'" check_cf
memcheck_wait
stamp "A/B BF16"
timeout 200 python scripts/decode_ab.py - - CROSS_FIRST=1 KV_EVICT=first CROSS_FIRST=1,KV_EVICT=first \
  --cases matrix --out "$OUT/ab_bf16.json" > "$OUT/ab_bf16.log" 2>&1; echo "ab rc=$?"
ab_rows "$OUT/ab_bf16.log"
stamp "A/B FP8"
timeout 150 python scripts/decode_ab.py - - KV_EVICT=first --dtype float8_e4m3fn --cases matrix $KS \
  --out "$OUT/ab_fp8.json" > "$OUT/ab_fp8.log" 2>&1; echo "ab rc=$?"
ab_rows "$OUT/ab_fp8.log"
for cf in 0 1; do
  stamp "trace BF16 H16/S1 CROSS_FIRST=$cf"
  timeout 100 env TOKENSPEED_SM90_DECODE_CROSS_FIRST=$cf python -m benchmarks.trace_decode --dtype bfloat16 \
    --cases 64,81920,64,16,1 --out "$OUT/trace_cf$cf.json" > "$OUT/trace_cf$cf.log" 2>&1; echo "trace rc=$?"
  tail -n 32 "$OUT/trace_cf$cf.log"
done
stamp "done"
