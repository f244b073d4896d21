#!/usr/bin/env bash
# One device call on the H200 that validates and times everything GPU-side, writing logs and JSON under
# $OUT (at most 8 files come back).  Run through the device tool with carry [".device"]:
#   source .device/bootstrap.sh && bash scripts/h200_session.sh
# Steps (each with its own time limit, so a slow step cannot starve the next):
#   1. decode: correctness matrix on the opt-in "overlap" schedule and the default (bitwise comparison),
#      then the quick benchmark (ours default / overlap / FP8, FlashMLA BF16 + FP8)
#   2. in parallel: sm90 prefill GPU tests, vLLM-adapter GPU tests, and the DeepSeek CLI on kernel backends
#   3. the demo on serving-sized shapes
set -uo pipefail
export CUTE_DSL_ARCH=sm_90a TOKENSPEED_JAX_CACHE_DIR=/tmp/tsj_cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout "${DECODE_S:-200}" python -m benchmarks.decode --prewarm 15 --check --bench --schedule overlap --quick \
  --out "$OUT/decode.json" --png "$OUT/decode.png" > "$OUT/decode.log" 2>&1
echo "decode rc=$?"; tail -n 25 "$OUT/decode.log"
( timeout "${PAR_S:-170}" bash -c 'python -m tests.gpu.precompile_sm90_prefill --jobs 6 && \
    python -m pytest -q -rfEx -p no:cacheprovider tests/gpu/test_sm90_prefill.py tests/gpu/test_sm90_decode.py' \
    > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?" >> "$OUT/gpu_tests.log" ) &
( timeout "${PAR_S:-170}" python -m pytest -q -rfEx -p no:cacheprovider tests/gpu/test_vllm_adapter.py \
    > "$OUT/vllm_gpu.log" 2>&1; echo "vllm gpu rc=$?" >> "$OUT/vllm_gpu.log" ) &
timeout "${PAR_S:-170}" python -m tokenspeed_jax.models.deepseek --preset small --json "$OUT/deepseek.json" \
  > "$OUT/deepseek.log" 2>&1; echo "deepseek rc=$?"; tail -n 20 "$OUT/deepseek.log"
wait
tail -n 15 "$OUT/gpu_tests.log"; tail -n 8 "$OUT/vllm_gpu.log"
timeout "${DEMO_S:-45}" python -m tokenspeed_jax.demo --large > "$OUT/demo.log" 2>&1; echo "demo rc=$?"
tail -n 30 "$OUT/demo.log"
