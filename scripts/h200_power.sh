#!/usr/bin/env bash
# The H200 runs behind the 2026-12-02 defaults chosen for sustained load (TOKENSPEED_SM90_DECODE_T16=1,
# TOKENSPEED_SM90_DECODE_PAD_ROWS=zero; docs/sm90_decode.md, "Power"), two device calls back to back (carry
# [".device"]; the second within 30 s of the first so the compile cache stays):
#   source .device/bootstrap.sh && bash scripts/h200_power.sh check    # ~4 min
#   source .device/bootstrap.sh && bash scripts/h200_power.sh bench    # ~6 min
# check: every configuration of both compiles on the CPU (15 workers); the whole check matrix with the defaults
#        against the fp32 reference (decode_check.json) and the compute-sanitizer memcheck test beside it
#        (memcheck.log);
# bench: the decode benchmark, interleaved bursts and sustained (2 s per contender and round, the second half timed,
#        SM clock and power polled): decode.json / .png, decode_sustained.json / .png, bench.log.  Bursts of 20 calls
#        per dispatch (--calls 20, since 2026-12-02 midday), so the short shapes time the device, not the host's
#        dispatch (docs/sm90_decode.md, "L2 prefetch off, calls per dispatch, ...").
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/h200_lib.sh"
gpu_line
if [ "${1:-check}" = check ]; then
  stamp "prewarm (CPU)"
  timeout 240 python -c "
import dataclasses
from benchmarks.decode import BENCH, CHECK, bench_case, prewarm
prewarm(list(CHECK) + [bench_case(*s) for s in BENCH] + [dataclasses.replace(bench_case(*s), dtype='float8_e4m3fn')
                                                         for s in BENCH], 15)
" > "$OUT/prewarm.log" 2>&1; echo "prewarm rc=$?"; grep "configs in\|Error" "$OUT/prewarm.log" | head
  memcheck_start 280
  stamp "check (defaults)"
  timeout 240 python -m benchmarks.decode --check --out "$OUT/decode.json" > "$OUT/check.log" 2>&1; echo "check rc=$?"
  grep -E "^check:|FAIL|Error" "$OUT/check.log" | head -n 12
  memcheck_wait
else
  stamp "bench"
  timeout 560 python -m benchmarks.decode --prewarm 15 --bench --no-xla --calls 20 --sustain 2 \
    --out "$OUT/decode.json" --png "$OUT/decode.png" > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
  tail -n 60 "$OUT/bench.log"
fi
stamp "done"
