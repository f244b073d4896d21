#!/usr/bin/env bash
# One H200 call (carry [".device"]): the two GPU test files of the decode backend with the defaults, memcheck excluded
# (it ran with them on 2026-12-02: scripts/h200_power.sh check), ~8 min on a fresh machine.
#   source .device/bootstrap.sh && bash scripts/h200_tests.sh
# 1. prewarm (CPU, 15 processes): the check matrix with the defaults and with each switch its tests set
#    (TOKENSPEED_SM90_DECODE_FP8_PV 5 / 7 / 8, T16=0, PAD_ROWS=copy), so the tests load every kernel from the disk cache;
# 2. tests/gpu/test_sm90_decode.py and tests/gpu/test_vllm_adapter.py (gpu_tests.log; -v: one line per test).
# The two files took more than one call's 10 minutes on 2026-12-02 (the vLLM adapter's 34 cases compile their own
# decode and FA4 prefill kernels, not prewarmed): FILES=tests/gpu/test_vllm_adapter.py runs one file (and skips the
# prewarm, which only serves the decode file).  The vLLM adapter file needs FlashAttention-4 on the GPU machine (its
# prefill backend): stage the kit with `bash ../shared/device/stage --fa4`; without it its 34 cases skip (2026-12-02),
# so the script stops first.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/h200_lib.sh"
gpu_line
prewarm_with() {  # VAR=VALUE FILTER
  timeout 150 env "$1" python -c "
from benchmarks.decode import CHECK, prewarm
prewarm([c for c in CHECK if $2], 15)
" >> "$OUT/prewarm.log" 2>&1; echo "prewarm $1 rc=$?"
}
FILES=${FILES:-tests/gpu/test_sm90_decode.py tests/gpu/test_vllm_adapter.py}
if [[ "$FILES" == *test_vllm_adapter.py* ]]; then  # (the sm90 prefill backend's own check of its packages)
  missing=$(python -c "from tokenspeed_jax.backends.sm90_prefill import _missing_packages; print(_missing_packages() or '')")
  if [ -n "$missing" ]; then
    echo "$missing is not installed: the vLLM adapter's GPU tests would all skip; stage the kit with" \
      "'bash ../shared/device/stage --fa4' (or pass FILES=tests/gpu/test_sm90_decode.py)"
    exit 1
  fi
fi
if [[ "$FILES" == *test_sm90_decode.py* ]]; then
  stamp "prewarm (CPU)"
  prewarm_with TOKENSPEED_SM90_DECODE_FP8_PV= "True"
  for m in 5 7 8; do prewarm_with TOKENSPEED_SM90_DECODE_FP8_PV=$m "c.dtype == 'float8_e4m3fn'"; done
  prewarm_with TOKENSPEED_SM90_DECODE_T16=0 "c.dtype != 'float8_e4m3fn'"
  prewarm_with TOKENSPEED_SM90_DECODE_PAD_ROWS=copy "c.S * c.H % 64"
fi
stamp "GPU tests (defaults): $FILES"
# shellcheck disable=SC2086
timeout $((575 - ($(date +%s) - t0))) python -m pytest -v -rfEx -p no:cacheprovider -k "not memcheck" $FILES \
  > "$OUT/gpu_tests.log" 2>&1; echo "tests rc=$?"
grep -cE " PASSED" "$OUT/gpu_tests.log"; grep -E " (FAILED|ERROR)" "$OUT/gpu_tests.log" | head; tail -n 3 "$OUT/gpu_tests.log"
stamp done
