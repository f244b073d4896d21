#!/usr/bin/env bash
# The H200 run behind TOKENSPEED_SM90_DECODE_PDL_MAIN (the main decode kernel launched with PDL too), one device call
# (carry [".device"]):
#   source .device/bootstrap.sh && bash scripts/h200_pdl_main.sh            # ~7 min
# 1. 8 check cases (both dtypes, every loop family, splits and garbage tables) with PDL_MAIN=1 against the fp32
#    reference (check_pdl.json), then the CUDA-graph test with it (a scan of decode calls in one command buffer);
# 2. interleaved A/B of PDL_MAIN 0 / 1 on the 13 shapes of the issue matrix, BF16 and FP8 (ab_<dtype>.json).
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/h200_lib.sh"
V=TOKENSPEED_SM90_DECODE_PDL_MAIN
NAMES="'s1h16p64', 's16h1p16', 's2h32p64_garbage', 'b1s1h128p64_81920', 'fp8_s1h16p64', 'fp8_s4h128p64', 'fp8_s2h64p16', 'fp8_b1s1h16p64_16k'"
gpu_line
stamp "prewarm (CPU)"
timeout 240 python -c "
import dataclasses
from benchmarks.decode import BENCH, CHECK, bench_case, prewarm
from benchmarks.harness import scoped_env
bf = [bench_case(*s) for s in BENCH]
f8 = [dataclasses.replace(c, dtype='float8_e4m3fn') for c in bf]
with scoped_env('$V', '1'):
    prewarm([c for c in CHECK if c.name in ($NAMES)] + bf + f8, 15)
with scoped_env('$V', '0'):
    prewarm(bf + f8, 15)
" > "$OUT/prewarm.log" 2>&1; echo "prewarm rc=$?"; grep "configs in\|Error" "$OUT/prewarm.log" | head
stamp "check $V=1"
check_cases 150 $V 1 "c.name in ($NAMES)" check_pdl
stamp "CUDA graph test $V=1"
timeout 120 env $V=1 python -m pytest -q -p no:cacheprovider -k inside_cuda_graph tests/gpu/test_sm90_decode.py 2>&1 | tail -n 2
for d in bfloat16 float8_e4m3fn; do
  stamp "A/B $V 0 1 ($d)"
  timeout 150 python scripts/decode_ab.py $V 0 1 --dtype $d --cases matrix --out "$OUT/ab_$d.json" > "$OUT/ab_$d.log" 2>&1
  echo "ab rc=$?"
  grep '^{"case"' "$OUT/ab_$d.log" | python -c "
import sys, json, math
r = [json.loads(l) for l in sys.stdin]
for x in r: print(x['case'], round(x['us_0'], 1), round(x['us_1'], 1), round(x['us_0'] / x['us_1'], 3), x['bitwise_equal'])
if r: print('geomean 0/1', round(math.exp(sum(math.log(x['us_0'] / x['us_1']) for x in r) / len(r)), 4))
"
done
stamp "done"
