#!/usr/bin/env bash
# One H200 call (carry [".device"]): the 16-bit seesaw loop's stores, TOKENSPEED_SM90_DECODE_P_STSM=1 (P by stmatrix)
# and TOKENSPEED_SM90_DECODE_EPILOGUE=staged (O through shared memory, 16-byte chunks; both defaults since
# 2026-12-02), ~8 min on a fresh machine.
#   source .device/bootstrap.sh && bash scripts/h200_stores.sh
# 1. prewarm (CPU): the check matrix with both switches, and the A/B's configurations;
# 2. the check matrix's 16-bit cases with both switches against the fp32 reference (stores_check.json), the
#    compute-sanitizer memcheck test with them beside it (memcheck.log);
# 3. interleaved A/B of the old stores, each switch alone and both (scripts/decode_ab.py: stores_ab.json, also bitwise
#    equality of the outputs) on the 64-row shapes where the fixed cost per call is largest (scripts/h200_fixed.sh);
# 4. the GPU tests not run by scripts/h200_tests.sh's 2026-12-02 call: recompile, CUDA graph, the vLLM adapter.
# With DT=fp8 the same for FP8 mode 4 and TOKENSPEED_SM90_DECODE_EPILOGUE_FP8=staged (the default since this
# script's run of 2026-12-02, 08:16 UTC device clock):
#   source .device/bootstrap.sh && DT=fp8 bash scripts/h200_stores.sh
# (the FP8 check cases, memcheck with it, the A/B of direct / staged on FP8 64-row shapes; step 4 as above).
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/h200_lib.sh"
gpu_line
SW="P_STSM=1,EPILOGUE=staged"
SEL="c.dtype != 'float8_e4m3fn'"
AB=(- P_STSM=0,EPILOGUE=direct P_STSM=1,EPILOGUE=direct P_STSM=0,EPILOGUE=staged "$SW")
ABDT=bfloat16
if [ "${DT:-bf16}" = fp8 ]; then
  SW="EPILOGUE_FP8=staged"; SEL="c.dtype == 'float8_e4m3fn'"
  AB=(- EPILOGUE_FP8=direct "$SW"); ABDT=float8_e4m3fn
fi
stamp "prewarm (CPU)"
timeout 150 python -c "
from benchmarks.decode import CHECK, prewarm
from benchmarks.harness import switches
with switches('-', '$SW'):
    prewarm([c for c in CHECK if $SEL], 15)
" > "$OUT/prewarm.log" 2>&1; echo "prewarm rc=$?"
mapfile -t MEM < <(switch_envs - "$SW")
memcheck_start 200 "${MEM[@]}"
stamp "check ($SW)"
check_cases 200 - "$SW" "$SEL" stores_check
memcheck_wait
stamp "A/B"
timeout 240 python scripts/decode_ab.py "${AB[@]}" --dtype $ABDT --prewarm 15 --rounds 5 \
  --cases 128,4096,64,128,1 128,1024,64,128,1 8,16384,64,128,2 64,81920,64,128,1 64,81920,64,32,4 64,81920,64,16,4 \
  --out "$OUT/stores_ab.json" > "$OUT/ab.log" 2>&1; echo "ab rc=$?"
grep '^{' "$OUT/ab.log" | cut -c1-260
stamp "GPU tests"
timeout $((575 - ($(date +%s) - t0))) python -m pytest -q -rfEx -p no:cacheprovider \
  -k "not memcheck and not matches_reference" tests/gpu/test_sm90_decode.py tests/gpu/test_vllm_adapter.py \
  > "$OUT/gpu_tests.log" 2>&1; echo "tests rc=$?"
tail -n 6 "$OUT/gpu_tests.log"
stamp done
