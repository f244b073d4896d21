#!/usr/bin/env bash
# One device call on the H200 that validates and times the sm90 decode kernel (issue 3), writing logs and
# JSON/PNG under $OUT.  Run through the device tool with carry [".device"]:
#   source .device/bootstrap.sh && bash scripts/h200_session.sh
# (the prefill backend has its own call: scripts/h200_prefill.sh).  Steps, each under its own time limit:
#   0. smoke (SMOKE_S, 100 s): compile in parallel, then 4 correctness cases on the default loop (pages 64,
#      32, 16: 1, 2 and 4 TMA boxes per chunk; and FP8 on the seesaw loop, page 64).  A hang (e.g. a lost
#      mbarrier arrival) or a wrong result stops the call here instead of eating the whole budget (a first
#      TMA build hung on 2026-11-29).
#   1. (DECODE_S, 330 s) the correctness matrix of benchmarks.decode.CHECK on the default ("auto": seesaw;
#      lockstep for FP8 with 8-token pages), then the full benchmark matrix of the issue (ours BF16 / FP8,
#      FlashMLA BF16 / FP8, plain XLA unless BENCH_ARGS=--no-xla, rooflines).  SCHED=<schedule> checks
#      that schedule instead (recording whether it is bitwise equal to the default) and times it next to
#      the default, e.g. SCHED=seesaw-cpasync for the TMA vs cp.async comparison.
#      NO_BENCH=1 runs the matrix only.  TOKENSPEED_JAX_CACHE_DIR (default /tmp/tsj_cache) keeps the compile
#      caches of different checkouts apart on one warm machine.
#   2. (TEST_S, 160 s) the GPU pytest module's no-recompile and CUDA-graph tests and the compute-sanitizer
#      memcheck (TOKENSPEED_SANITIZER=1, ~60 s); FULL_TESTS=1 runs the whole module (its 16 cases repeat step 1's
#      matrix with fresh seeds and take ~20 s each: give it TEST_S=420 and a call of its own).
set -uo pipefail
export CUTE_DSL_ARCH=sm_90a TOKENSPEED_JAX_CACHE_DIR=${TOKENSPEED_JAX_CACHE_DIR:-/tmp/tsj_cache} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout "${SMOKE_S:-100}" python -m benchmarks.decode --prewarm 16 --check \
  --cases s1h16p64,s4h32p32,s16h1p16,fp8_s1h16p64 --out "$OUT/smoke.json" > "$OUT/smoke.log" 2>&1
echo "smoke rc=$?"; grep -v "^prewarm " "$OUT/smoke.log" | cut -c1-160 | tail -n 4
grep -qE "check: ([0-9]+)/\1 cases" "$OUT/smoke.log" || { echo "smoke failed: stopping"; exit 1; }
BENCH=(--bench --png "$OUT/decode.png"); [ "${NO_BENCH:-0}" = 1 ] && BENCH=()
timeout "${DECODE_S:-330}" python -m benchmarks.decode --prewarm 16 --check "${BENCH[@]}" \
  ${SCHED:+--schedule $SCHED} ${BENCH_ARGS:-} --out "$OUT/decode.json" > "$OUT/decode.log" 2>&1
echo "decode rc=$?"; grep -E "^check:|bitwise|FlashMLA\|" "$OUT/decode.log" | cut -c1-200 | tail -n 8
grep -v "^prewarm\|^{\|max |ours" "$OUT/decode.log" | tail -n 70
K=(-k "memcheck or recompile or graph"); [ "${FULL_TESTS:-0}" = 1 ] && K=()
timeout "${TEST_S:-160}" env TOKENSPEED_SANITIZER=1 python -m pytest -q -s -rfEx -p no:cacheprovider --durations=5 \
  tests/gpu/test_sm90_decode.py "${K[@]}" > "$OUT/decode_tests.log" 2>&1; echo "decode tests rc=$?"
grep -E "ERROR SUMMARY|passed|failed" "$OUT/decode_tests.log" | tail -n 5
