#!/usr/bin/env bash
# One device call: decode GPU tests (pytest module incl. the compute-sanitizer memcheck) and an ncu profile
# of our sm90 decode kernel next to FlashMLA.  Run through the device tool with carry [".device"]:
#   source .device/bootstrap.sh && bash scripts/h200_decode_profile.sh
set -uo pipefail
export CUTE_DSL_ARCH=sm_90a TOKENSPEED_JAX_CACHE_DIR=/tmp/tsj_cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
CASES=${CASES:-"64,16384,64,32,4 64,16384,64,16,1"}
SCHED=${SCHED:-}
# compile everything first, in parallel on the CPU cores (disk cache), then profile
timeout "${PREWARM_S:-150}" python -m benchmarks.decode --prewarm 15 --check ${SCHED:+--schedule $SCHED} \
  --out "$OUT/check.json" > "$OUT/check.log" 2>&1; echo "check rc=$?"; tail -n 22 "$OUT/check.log"
timeout "${NCU_S:-150}" ncu --kernel-name regex:'TiledMMA|splitkv_mla' --launch-skip 0 \
  --launch-count ${NCU_N:-12} --set full -o "$OUT/decode" -f \
  python -m benchmarks.profile_decode --cases $CASES ${SCHED:+--schedule $SCHED} > "$OUT/ncu.log" 2>&1
echo "ncu rc=$?"; tail -n 5 "$OUT/ncu.log"
ncu --import "$OUT/decode.ncu-rep" --page details --csv > "$OUT/ncu_details.csv" 2>&1
ncu --import "$OUT/decode.ncu-rep" --page details --section SpeedOfLight --section WarpStateStats \
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis 2>&1 | \
  grep -E "MlaDecode|splitkv|Duration|Throughput|Pipe|Stall|Issue|Shared|Bank|Eligible|Warp Cycles" | head -150
if [ -n "${TESTS:-1}" ]; then
  timeout "${TEST_S:-200}" env TOKENSPEED_SANITIZER=1 python -m pytest -q -rfEx -p no:cacheprovider \
    tests/gpu/test_sm90_decode.py > "$OUT/decode_tests.log" 2>&1; echo "decode tests rc=$?"
  tail -n 15 "$OUT/decode_tests.log"
fi
