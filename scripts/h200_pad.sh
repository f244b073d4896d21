#!/usr/bin/env bash
# The H200 runs behind TOKENSPEED_SM90_DECODE_PAD_ROWS=zero and the sustained-load clocks, two device calls back to
# back (carry [".device"]; the second within 30 s of the first so the machine and its compile cache stay warm):
#   source .device/bootstrap.sh && bash scripts/h200_pad.sh check     # ~2.5 min
# (written when PAD_ROWS=zero and T16=1 were opt-in: "-" below is today's default, which has both)
#   source .device/bootstrap.sh && bash scripts/h200_pad.sh clocks    # ~3 min
# check:  the check cases with padded rows (S x H % 64 != 0) with PAD_ROWS=zero against the fp32 reference
#         (check_pad.json), the compute-sanitizer memcheck test with it beside them (memcheck.log), then an interleaved
#         A/B of the default, PAD_ROWS=zero and T16=1 on the BF16 shapes of the issue matrix with padded rows
#         ($CASES; ab_pad.json);
# clocks: scripts/clock_probe.py with the same three builds of ours beside FlashMLA (SM clock and power under
#         sustained load; clock_probe.json; the 2026-12-02 03:50 UTC run's version of it timed the whole 3 s window,
#         today's the second half), then the loop's timeline (benchmarks/trace_decode.py) after 3 s of
#         sustained load and for one launch (trace_sustain.json, trace_once.json).
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/h200_lib.sh"
V=TOKENSPEED_SM90_DECODE_PAD_ROWS
CASES=${CASES:-64,81920,64,16,1 64,81920,64,32,1 128,4096,64,16,1 1,81920,64,16,1}
FILTER="c.S * c.H % 64"
gpu_line
if [ "${1:-check}" = check ]; then
  stamp "prewarm (CPU)"
  timeout 200 python -c "
from benchmarks.decode import CHECK, bench_case, prewarm
from benchmarks.harness import scoped_env
cases = [bench_case(*map(int, s.split(','))) for s in '$CASES'.split()]
with scoped_env('$V', 'zero'):
    prewarm([c for c in CHECK if $FILTER] + cases, 15)
prewarm(cases, 15)
with scoped_env('TOKENSPEED_SM90_DECODE_T16', '1'):
    prewarm(cases, 15)
" > "$OUT/prewarm.log" 2>&1; echo "prewarm rc=$?"; grep "configs in\|Error" "$OUT/prewarm.log" | head
  memcheck_start 240 $V=zero
  stamp "check $V=zero"
  check_cases 150 $V zero "$FILTER" check_pad
  memcheck_wait
  stamp "A/B - PAD_ROWS=zero T16=1"
  timeout 200 python scripts/decode_ab.py - - PAD_ROWS=zero T16=1 --rounds 5 --cases $CASES --out "$OUT/ab_pad.json" \
    > "$OUT/ab_pad.log" 2>&1; echo "ab rc=$?"
  grep '^{"case"' "$OUT/ab_pad.log" | cut -c1-400
  tail -n 3 "$OUT/ab_pad.log"
else
  stamp "clock probe"
  timeout 240 python scripts/clock_probe.py --cases 64,81920,64,16,1 128,4096,64,16,1 --ours - PAD_ROWS=zero T16=1 \
    --out "$OUT/clock_probe.json" > "$OUT/clock_probe.log" 2>&1; echo "probe rc=$?"
  grep '^{' "$OUT/clock_probe.log" | python -c "
import sys, json
for l in sys.stdin:
    x = json.loads(l); print(x['case'], x['contender'], round(x['median_us'], 1), x['samples_us'], x['sm_mhz'], x['power_w'], x['throttle_reasons'])
"
  for m in sustain once; do
    stamp "trace $m"
    s=0; [ $m = sustain ] && s=3
    timeout 150 python -m benchmarks.trace_decode --dtype bfloat16 --sustain $s --cases 64,81920,64,16,1 \
      --out "$OUT/trace_$m.json" > "$OUT/trace_$m.log" 2>&1; echo "trace rc=$?"
    tail -n 30 "$OUT/trace_$m.log"
  done
fi
stamp "done"
