#!/usr/bin/env bash
# One H200 call (carry [".device"]) that checks the defaults with the producer warpgroups (FP8 mode 4,
# TOKENSPEED_SM90_DECODE_PRODUCER16=1): ~8-9 min on a warm machine (estimate from the 2026-12-01 calls).
#   source .device/bootstrap.sh && bash scripts/h200_producer.sh
# 1. prewarm (CPU, 14 processes): the check matrix;
# 2. the compute-sanitizer memcheck test (background) and the whole check matrix against the fp32 reference
#    (check.json);
# 3. tests/gpu/test_sm90_decode.py and tests/gpu/test_vllm_adapter.py, memcheck excluded, until the call's time
#    runs out (gpu_tests.log).
# The benchmark against FlashMLA is a call of its own: M=4 bash scripts/h200_fp8pv.sh bench.
# (Its 19:05 UTC version of 2026-12-01 checked PRODUCER16=1 and A/B-timed it before the GPU tests; that build of the
# 16-bit producer had a barrier-id clash, since fixed: docs/sm90_decode.md, "Producer warpgroup".)
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/h200_lib.sh"
gpu_line
stamp "prewarm (CPU)"
timeout 200 python -c "
from benchmarks.decode import CHECK, prewarm
prewarm(CHECK, 14)
" > "$OUT/prewarm.log" 2>&1; echo "prewarm rc=$?"
memcheck_start 200
stamp "check (defaults)"
check_cases 200 TOKENSPEED_SM90_DECODE_PRODUCER16 1 "True" check
memcheck_wait
stamp "GPU tests (defaults)"
timeout $((575 - ($(date +%s) - t0))) python -m pytest -q -rfEx -p no:cacheprovider -k "not memcheck" \
  tests/gpu/test_sm90_decode.py tests/gpu/test_vllm_adapter.py > "$OUT/gpu_tests.log" 2>&1; echo "tests rc=$?"
tail -n 6 "$OUT/gpu_tests.log"
stamp done
