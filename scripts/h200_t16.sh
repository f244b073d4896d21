#!/usr/bin/env bash
# The H200 run behind the transposed 16-bit loop (TOKENSPEED_SM90_DECODE_T16), one device call (carry [".device"]):
#   source .device/bootstrap.sh && bash scripts/h200_t16.sh            # ~6 min
# 1. the 16-bit check cases it runs (S x H <= 32, pages >= 32) with T16=1 against the fp32 reference (check_t16.json),
#    the compute-sanitizer memcheck test with T16=1 beside them (memcheck.log);
# 2. interleaved A/B of T16 0 / 1 on the BF16 shapes of the issue matrix with S x H <= 32 ($CASES; ab_t16.json).
# Other switches of that loop the same way: V names the variable and VALS its values (the check and memcheck run
# with the last), or V=- and VALS sets of switches as scripts/decode_ab.py takes them (NAME=VALUE[,...] after the
# TOKENSPEED_SM90_DECODE_ prefix; "-": the defaults).  The opt-ins of 2026-12-02, alone and together:
#   source .device/bootstrap.sh && V=- VALS="- T16_PT=q T16_BARS=chunk T16_PT=q,T16_BARS=chunk" bash scripts/h200_t16.sh
# CALLS=20: the A/B makes 20 calls per dispatch (decode_ab.py --calls), so B1 is timed by the device, not the host.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/h200_lib.sh"
V=${V:-TOKENSPEED_SM90_DECODE_T16}
read -r -a VS <<< "${VALS:-0 1}"
LAST=${VS[-1]}
mapfile -t ENVS < <(switch_envs "$V" "$LAST")  # the last value as environment assignments (memcheck)
CASES=${CASES:-64,81920,64,16,1 64,81920,64,32,1 128,4096,64,16,1 1,81920,64,16,1}
FILTER="c.dtype != 'float8_e4m3fn' and c.page >= 32 and c.S * c.H <= 32"
gpu_line
stamp "prewarm (CPU)"
timeout 240 python -c "
from benchmarks.decode import CHECK, bench_case, prewarm
from benchmarks.harness import switches
cases = [bench_case(*map(int, s.split(','))) for s in '$CASES'.split()]
vals = '${VS[*]}'.split()
with switches('$V', vals[-1]):
    prewarm([c for c in CHECK if $FILTER] + cases, 15)
for v in vals[:-1]:
    with switches('$V', v):
        prewarm(cases, 15)
" > "$OUT/prewarm.log" 2>&1; echo "prewarm rc=$?"; grep "configs in\|Error" "$OUT/prewarm.log" | head
memcheck_start 240 "${ENVS[@]}"
stamp "check ${ENVS[*]}"
check_cases 150 "$V" "$LAST" "$FILTER" check_t16
memcheck_wait
stamp "A/B $V ${VS[*]}"
timeout 200 python scripts/decode_ab.py "$V" "${VS[@]}" --rounds 5 --calls "${CALLS:-1}" --cases $CASES \
  --out "$OUT/ab_t16.json" > "$OUT/ab_t16.log" 2>&1; echo "ab rc=$?"
grep '^{"case"' "$OUT/ab_t16.log" | python -c "
import sys, json
vals = '${VS[*]}'.split()
for l in sys.stdin:
    x = json.loads(l); us = [x['us_' + v] for v in vals]
    print(x['case'], ' '.join(f'{v}: {u:.1f} ({us[0] / u:.3f}x)' for v, u in zip(vals, us)), x.get('max_abs_diff'))
"
tail -n 3 "$OUT/ab_t16.log"
stamp "done"
