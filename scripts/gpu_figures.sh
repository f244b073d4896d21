#!/usr/bin/env bash
# The GPU figures of issues #36-#38 on one H200, one section per device call:
#
#   source .device/bootstrap.sh && export CUTE_DSL_ARCH=sm_90a && bash scripts/gpu_figures.sh r1
#   source .device/bootstrap.sh && export CUTE_DSL_ARCH=sm_90a && bash scripts/gpu_figures.sh gen
#   source .device/bootstrap.sh && export CUTE_DSL_ARCH=sm_90a && bash scripts/gpu_figures.sh mtp
#   bash scripts/gpu_figures.sh smoke          # the three scripts' --smoke runs (a CPU check of this driver)
#
# SECTION   what (script)                                           writes $OUT/NAME.json, .log  budget / timeout
#   r1      R1-width model, decode + prefill (deepseek_r1_h200.py)  r1                           230 s / 280 s
#   gen     batching, warm start, MTP, early stop (generation.py)   gen                          230 s / 280 s
#   mtp     shipped checkpoint: loss, MTP k = 0..3 (mtp_speedup.py) mtp                          230 s / 280 s
#   r1-32k  (optional) r1's prefill only, the 32k prompt first      r1_32k                       230 s / 280 s
#   gen-mtp (optional) gen's MTP and early-stop sections only       gen_mtp                      230 s / 280 s
#   smoke   the three --smoke runs (CPU check of this driver)       r1_smoke, gen_smoke, ...     - / 600 s each
#
# Each script writes its JSON after every measured point and skips (with the reason in the JSON) the points
# its --budget-s no longer covers; `timeout` is the backstop (SIGTERM: the JSON is marked "killed"; SIGKILL 15 s
# later).  A script that ends early prints no table: then `python -m benchmarks.runinfo summary` prints (and appends
# to the log) the JSON's status, the point in progress, the backends and the points so far.
# Extra arguments after SECTION go to the script (e.g. `bash scripts/gpu_figures.sh r1 --experts 16`).
# Environment: OUT (default results/gpu_figures), PYTHON (default python3), BUDGET_S / TIMEOUT_S (override the
# defaults above), TOKENSPEED_JAX_COMMIT (the commit to record, ahead of the checkout's git HEAD).  The attention
# backend is `auto`: the sm90 decode kernel, and the sm90 prefill only where FlashAttention-4 is importable
# (else the xla reference); each JSON's attention_backends says which ran.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
section="${1:-}"
shift || true
OUT="${OUT:-results/gpu_figures}"
PY="${PYTHON:-python3}"
BUDGET_S="${BUDGET_S:-230}"
TIMEOUT_S="${TIMEOUT_S:-280}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

run() {  # run NAME LIMIT MODULE ARGS...: the script under timeout, its output tee'd to $OUT/NAME.log
  local name="$1" limit="$2"
  shift 2
  echo "== $name ($(date -u +%H:%M:%S) UTC): timeout ${limit}s: $PY -m $* --out $OUT/$name.json"
  timeout -k 15 "$limit" "$PY" -m "$@" --out "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
  local rc=$?
  echo "== $name: exit $rc" | tee -a "$OUT/$name.log"
  if [ "$rc" -ne 0 ]; then  # killed or failed: the script printed no table; the JSON holds the points so far
    "$PY" -m benchmarks.runinfo summary "$OUT/$name.json" 2>&1 | tee -a "$OUT/$name.log"
  fi
  return "$rc"
}

case "$section" in
  r1)
    # R1 width, 1 dense + 2 MoE layers, 32 experts, FP8 resident: decode at B = 1 / 16 / 64 x 4k / 32k (with the
    # profile breakdown), then prefill of 4k prompts (1 and 2 per step) and of a 32k prompt (4 chunks of 8192).
    run r1 "$TIMEOUT_S" benchmarks.deepseek_r1_h200 --budget-s "$BUDGET_S" "$@"
    ;;
  r1-32k)
    # what `r1` leaves to its budget when the compiles take long: the prefill of one 32k prompt (4 chunks of 8192,
    # 4 step shapes to compile) and, after it, the 4k prompts.
    run r1_32k "$TIMEOUT_S" benchmarks.deepseek_r1_h200 --budget-s "$BUDGET_S" --sections prefill --batches 1 \
      --contexts 32768 4096 "$@"
    ;;
  gen)
    # small preset, bf16, 256 prompts (32..512 tokens, 16..256 new), 64 slots: continuous vs static, warm start of
    # the CLI (two processes), plain vs MTP k = 1, 2, 3 on one batch of 64 (random weights: acceptance ~0), early
    # stop last.  --token-bucket 512: the continuous run's prefill shapes (group size x padded length) are each
    # compiled in its warm-up; 512-token buckets make them a few instead of dozens.
    run gen "$TIMEOUT_S" benchmarks.generation --budget-s "$BUDGET_S" --token-bucket 512 "$@"
    ;;
  gen-mtp)
    # what `gen` leaves to the budget when its first sections take long: MTP k = 1, 2, 3 and early stop only.
    run gen_mtp "$TIMEOUT_S" benchmarks.generation --budget-s "$BUDGET_S" --token-bucket 512 \
      --sections mtp,early_stop "$@"
    ;;
  mtp)
    # the shipped pystdlib-tiny checkpoint, bf16: held-out loss, then plain / k = 1, 2, 3 at batch 1 and 32
    # (32 held-out prompts of 64 tokens, 128 new tokens), 3 timed repeats.
    run mtp "$TIMEOUT_S" benchmarks.mtp_speedup --budget-s "$BUDGET_S" --repeats 3 "$@"
    ;;
  smoke)
    rc=0
    run r1_smoke 600 benchmarks.deepseek_r1_h200 --smoke || rc=$?
    run gen_smoke 600 benchmarks.generation --smoke || rc=$?
    run mtp_smoke 600 benchmarks.mtp_speedup --smoke || rc=$?
    exit "$rc"
    ;;
  *)
    echo "usage: bash scripts/gpu_figures.sh r1|r1-32k|gen|gen-mtp|mtp|smoke [script arguments...]" >&2
    exit 2
    ;;
esac
