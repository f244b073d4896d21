#!/usr/bin/env bash
# Validation of branch wip/next (= wip/fp8-qgmma + wip/prefill-xla-empty-rows) on the H200 in two device
# calls (carry [".device"]; each under the 600 s limit; logs and JSON under $OUT):
#   call 1: source .device/bootstrap.sh && bash scripts/h200_next.sh check          (~450 s expected)
#     - decode: smoke + the correctness matrix (FP8 cases now run the QGMMA QK) + memcheck/no-recompile/graph
#       tests (scripts/h200_session.sh with NO_BENCH=1)
#     - prefill: kernel times at ncu's locked clock, S128k/H16 non-causal, ours vs ours_xla_rows vs the
#       single-override variants vs FA4 (benchmarks/prefill_variants.py --ncu)
#     - prefill: the GPU tests with TOKENSPEED_SM90_PREFILL_EMPTY_ROWS=xla (their kernels precompiled first)
#   call 2: source .device/bootstrap.sh && bash scripts/h200_next.sh bench          (~520 s expected)
#     - the decode benchmark matrix (FP8 columns = QGMMA QK), the FP8 QK A/B (QGMMA vs 16-bit QK,
#       interleaved, scripts/decode_ab.py), the prefill benchmark (default mode; PREFILL_MODE=xla times the
#       xla mode instead)
set -uo pipefail
export CUTE_DSL_ARCH=sm_90a TOKENSPEED_JAX_CACHE_DIR=${TOKENSPEED_JAX_CACHE_DIR:-/tmp/tsj_cache} PYTHONUNBUFFERED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
case "${1:-check}" in
check)
  NO_BENCH=1 SMOKE_S=100 DECODE_S=170 TEST_S=90 bash scripts/h200_session.sh 2>&1 | tail -n 12
  stamp "prefill ncu"
  timeout 90 ncu --kernel-name regex:'(?i)sm90' --clock-control base --csv \
    --metrics gpu__time_duration.sum,launch__grid_size python -m benchmarks.prefill_variants --ncu --seqlen 131072 \
    --heads 16 --modes full --variants ours,ours_xla_rows,scale_only,epi_only,epi_uniform,plain \
    --out "$OUT/v128.json" > "$OUT/ncu128.csv" 2> "$OUT/ncu128.err"; echo "ncu rc=$?"
  stamp "prefill GPU tests, empty rows by XLA (precompiled first, in that mode)"
  export TOKENSPEED_SM90_PREFILL_EMPTY_ROWS=xla
  timeout 70 python -m benchmarks.prefill --prewarm 16 --prewarm-only --with-test-configs \
    > "$OUT/precompile_xla.log" 2>&1; echo "precompile rc=$?"
  timeout 110 python -m pytest -q -rfEx -p no:cacheprovider tests/gpu/test_sm90_prefill.py \
    > "$OUT/prefill_tests_xla.log" 2>&1; echo "prefill tests rc=$?"
  tail -n 3 "$OUT/prefill_tests_xla.log"
  ;;
bench)
  timeout 230 python -m benchmarks.decode --prewarm 16 --bench --no-xla --out "$OUT/decode.json" \
    --png "$OUT/decode.png" > "$OUT/decode.log" 2>&1; echo "decode rc=$?"
  stamp "FP8 QK A/B"
  timeout 100 python scripts/decode_ab.py TOKENSPEED_SM90_DECODE_FP8_QK 1 0 --dtype float8_e4m3fn --prewarm 16 \
    --out "$OUT/ab_fp8qk.json" --cases 64,81920,64,16,1 64,81920,64,32,4 64,81920,64,128,4 1,81920,64,16,1 \
    8,16384,64,128,2 > "$OUT/ab.log" 2>&1
  grep -v "^prewarm" "$OUT/ab.log" | cut -c1-220 | tail -n 6
  stamp "prefill benchmark (TOKENSPEED_SM90_PREFILL_EMPTY_ROWS=${PREFILL_MODE:-kernel})"
  export TOKENSPEED_SM90_PREFILL_EMPTY_ROWS="${PREFILL_MODE:-kernel}"
  timeout 50 python -m benchmarks.prefill --prewarm 16 --prewarm-only > "$OUT/precompile.log" 2>&1
  timeout 200 python -m benchmarks.prefill --fp8 --out "$OUT/prefill.json" --png "$OUT/prefill.png" \
    > "$OUT/bench.log" 2>&1; echo "prefill rc=$?"
  sed -n '/^case .*vs FA4/,$p' "$OUT/bench.log"
  ;;
*) echo "usage: bash scripts/h200_next.sh check|bench"; exit 2 ;;
esac
stamp done
