#!/usr/bin/env bash
# The H200 run behind the decode L2 prefetch default (2026-12-01 13:45-13:50 UTC device clock), one device call (carry [".device"]):
#   source .device/bootstrap.sh && bash scripts/h200_next.sh
# - in the background: the compute-sanitizer memcheck test with the default (late) prefetch, while the A/B
#   configurations compile on the CPU;
# - the interleaved A/B of TOKENSPEED_SM90_DECODE_L2_PREFETCH off / late over the 13 shapes of the issue
#   matrix, BF16 and FP8 (scripts/decode_ab.py; bitwise equality reported per shape);
# - the decode benchmark with the defaults against FlashMLA BF16 / FP8 (python -m benchmarks.decode --bench).
# 6 files come back: memcheck.log, ab.log, ab_bf16.json, ab_fp8.json, decode.json, decode.png
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/h200_lib.sh"
V=TOKENSPEED_SM90_DECODE_L2_PREFETCH
gpu_line
memcheck_start 130
stamp "prewarm A/B configurations (CPU)"
timeout 200 python -c "
import dataclasses
from benchmarks.decode import BENCH, bench_case, prewarm
from benchmarks.harness import scoped_env
cases = [dataclasses.replace(bench_case(*s), dtype=d) for d in ('bfloat16', 'float8_e4m3fn') for s in BENCH]
for v in ('off', 'late'):
    with scoped_env('$V', v):
        prewarm(cases, 14)
" > "$OUT/ab.log" 2>&1; echo "prewarm rc=$?" | tee -a "$OUT/ab.log"
memcheck_wait
for nd in bf16:bfloat16 fp8:float8_e4m3fn; do
  stamp "A/B ${nd#*:}"
  timeout 120 python scripts/decode_ab.py $V off late --dtype "${nd#*:}" --cases matrix --out "$OUT/ab_${nd%%:*}.json" \
    >> "$OUT/ab.log" 2>&1
  echo "ab ${nd#*:} rc=$?"
done
grep '^{"case"' "$OUT/ab.log" | python -c "
import sys, json, math
rows = [json.loads(l) for l in sys.stdin]
for d in ('bfloat16', 'float8_e4m3fn'):
    r = [x for x in rows if x['dtype'] == d]
    for x in r: print(d[:4], x['case'], round(x['us_off'], 1), round(x['us_late'], 1), round(x['us_off'] / x['us_late'], 3), x['bitwise_equal'])
    if r: print(d, 'geomean off/late', round(math.exp(sum(math.log(x['us_off'] / x['us_late']) for x in r) / len(r)), 4))
"
stamp "benchmark (defaults) vs FlashMLA"
timeout 300 python -m benchmarks.decode --prewarm 16 --bench --no-xla --png "$OUT/decode.png" --out "$OUT/decode.json" \
  > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
grep -v "^prewarm\|^{\|max |ours" "$OUT/bench.log" | tail -n 30
stamp "done"
