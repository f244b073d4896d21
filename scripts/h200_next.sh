#!/usr/bin/env bash
# The H200 validation of the FP8 QGMMA QK (decode) and the empty-row kernel (prefill) of 2026-11-30, in one device call (carry [".device"]; for the FA3
# column first a call with carry [".device-fa3"] running `bash .device-fa3/unpack.sh`, then within 30 s):
#   source .device/bootstrap.sh && bash scripts/h200_next.sh
# - decode, in the background: the FP8 cases of the check matrix (QK on QGMMA, with the FP8 LSE tolerance of
#   benchmarks.decode.FP8_QK_ACC_EPS) and the memcheck test (its bf16 cases are checked first, which also
#   compiles them);
# - prefill, in the foreground: scripts/h200_prefill.sh (precompile, all GPU tests, the benchmark) with the
#   default "fixup" mode for rows without keys; the benchmark waits for the background job.
# 8 files come back: decode_fp8_check.json, decode_fp8.log, memcheck.log and h200_prefill.sh's 5.
set -uo pipefail
export CUTE_DSL_ARCH=sm_90a TOKENSPEED_JAX_CACHE_DIR=${TOKENSPEED_JAX_CACHE_DIR:-/tmp/tsj_cache} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
(
  timeout 150 python -m benchmarks.decode --prewarm 8 --check --out "$OUT/decode_fp8.json" \
    --cases fp8_s1h16p64,fp8_s4h128p64,fp8_s2h32p32_garbage,fp8_s8h16p128,s2h32p64_garbage,b1s1h16p64_short,s4h32p32 \
    > "$OUT/decode_fp8.log" 2>&1
  echo "decode check rc=$?" >> "$OUT/decode_fp8.log"
  timeout 120 env TOKENSPEED_SANITIZER=1 python -m pytest -q -s -rfEx -p no:cacheprovider -k memcheck \
    tests/gpu/test_sm90_decode.py > "$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$?" >> "$OUT/memcheck.log"
) &
echo $! > /tmp/tsj_bg.pid
PRE_S=${PRE_S:-90} TEST_S=${TEST_S:-220} BENCH_S=${BENCH_S:-170} bash scripts/h200_prefill.sh
echo "--- decode (background)"
grep -E "^check:|decode check rc" "$OUT/decode_fp8.log"; grep -o '"case": "[^"]*", "ok": [a-z]*' "$OUT/decode_fp8.log"
grep -E "memcheck rc|ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -n 4
