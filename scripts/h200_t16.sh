#!/usr/bin/env bash
# The H200 run behind the transposed 16-bit loop (TOKENSPEED_SM90_DECODE_T16), one device call (carry [".device"]):
#   source .device/bootstrap.sh && bash scripts/h200_t16.sh            # ~6 min
# 1. the 16-bit check cases it runs (S x H <= 32, pages >= 32) with T16=1 against the fp32 reference (check_t16.json),
#    the compute-sanitizer memcheck test with T16=1 beside them (memcheck.log);
# 2. interleaved A/B of T16 0 / 1 on the BF16 shapes of the issue matrix with S x H <= 32 ($CASES; ab_t16.json).
# Another switch of that loop the same way (the check and memcheck with the second value, the A/B of both), e.g. where
# it keeps P^T (TOKENSPEED_SM90_DECODE_T16_PT, opt-in since 2026-12-02):
#   source .device/bootstrap.sh && V=TOKENSPEED_SM90_DECODE_T16_PT VALS="rope q" bash scripts/h200_t16.sh
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/h200_lib.sh"
V=${V:-TOKENSPEED_SM90_DECODE_T16}
read -r A B <<< "${VALS:-0 1}"
CASES=${CASES:-64,81920,64,16,1 64,81920,64,32,1 128,4096,64,16,1 1,81920,64,16,1}
FILTER="c.dtype != 'float8_e4m3fn' and c.page >= 32 and c.S * c.H <= 32"
gpu_line
stamp "prewarm (CPU)"
timeout 200 python -c "
from benchmarks.decode import CHECK, bench_case, prewarm
from benchmarks.harness import scoped_env
cases = [bench_case(*map(int, s.split(','))) for s in '$CASES'.split()]
with scoped_env('$V', '$B'):
    prewarm([c for c in CHECK if $FILTER] + cases, 15)
with scoped_env('$V', '$A'):
    prewarm(cases, 15)
" > "$OUT/prewarm.log" 2>&1; echo "prewarm rc=$?"; grep "configs in\|Error" "$OUT/prewarm.log" | head
memcheck_start 240 "$V=$B"
stamp "check $V=$B"
check_cases 150 "$V" "$B" "$FILTER" check_t16
stamp "A/B $V $A $B"
memcheck_wait
timeout 150 python scripts/decode_ab.py "$V" "$A" "$B" --rounds 5 --cases $CASES --out "$OUT/ab_t16.json" \
  > "$OUT/ab_t16.log" 2>&1; echo "ab rc=$?"
grep '^{"case"' "$OUT/ab_t16.log" | python -c "
import sys, json
for l in sys.stdin:
    x = json.loads(l); a, b = x['us_$A'], x['us_$B']; print(x['case'], round(a, 1), round(b, 1), round(a / b, 3), x['max_abs_diff'])
"
tail -n 3 "$OUT/ab_t16.log"
stamp "done"
