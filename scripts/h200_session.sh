#!/usr/bin/env bash
# One device call on the H200 that validates and times the sm90 decode kernel (issue 3), writing logs and
# JSON/PNG under $OUT.  Run through the device tool with carry [".device"]:
#   source .device/bootstrap.sh && bash scripts/h200_session.sh
# (the prefill backend has its own call: scripts/h200_prefill.sh).  Steps, each under its own time limit:
#   1. compile every config in parallel (disk cache), the correctness matrix of benchmarks.decode.CHECK on
#      the default ("auto": seesaw for bf16/fp16, lockstep for FP8), then the full benchmark matrix of the
#      issue (ours BF16 / FP8, FlashMLA BF16 / FP8, plain XLA, rooflines)
#   (SCHED=<schedule> also checks that schedule and times it next to the default)
#   2. the GPU pytest module (the same matrix with fresh seeds, the no-recompile check and the
#      compute-sanitizer memcheck, TOKENSPEED_SANITIZER=1)
set -uo pipefail
export CUTE_DSL_ARCH=sm_90a TOKENSPEED_JAX_CACHE_DIR=/tmp/tsj_cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout "${DECODE_S:-330}" python -m benchmarks.decode --prewarm 15 --check --bench ${SCHED:+--schedule $SCHED} ${BENCH_ARGS:-} \
  --out "$OUT/decode.json" --png "$OUT/decode.png" > "$OUT/decode.log" 2>&1
echo "decode rc=$?"; grep -E "^check:|bitwise|FlashMLA\|" "$OUT/decode.log" | cut -c1-200 | tail -n 8
grep -v "^prewarm\|^{" "$OUT/decode.log" | tail -n 60
timeout "${TEST_S:-150}" env TOKENSPEED_SANITIZER=1 python -m pytest -q -rfEx -p no:cacheprovider --durations=5 \
  tests/gpu/test_sm90_decode.py > "$OUT/decode_tests.log" 2>&1; echo "decode tests rc=$?"
tail -n 15 "$OUT/decode_tests.log"
