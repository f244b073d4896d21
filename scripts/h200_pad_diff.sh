#!/usr/bin/env bash
# One H200 call (carry [".device"]): where zero and copied padded rows change the 16-bit seesaw loop's outputs, and
# the GPU tests of the non-default 16-bit paths:
#   source .device/bootstrap.sh && bash scripts/h200_pad_diff.sh      # ~5 min
# 1. prewarm (CPU, 15 processes) with T16=0, and with T16=0 PAD_ROWS=copy;
# 2. scripts/decode_diff.py on three BF16 shapes with 16 of 64 rows real: T16=0 (zero padding) twice, then
#    T16=0,PAD_ROWS=copy twice, each against the first build (decode_diff.json);
# 3. tests/gpu/test_sm90_decode.py: the T16=0 and PAD_ROWS=copy check tests, the CUDA-graph and recompile tests, until
#    the call's time runs out (gpu_tests.log).
set -uo pipefail
. scripts/h200_lib.sh
gpu_line
stamp prewarm
timeout 150 python -c "
from benchmarks.decode import CHECK, bench_case, prewarm
from benchmarks.harness import scoped_env
cases = [bench_case(*map(int, s.split(','))) for s in '64,16384,64,16,1 64,81920,64,16,1 1,81920,64,16,1'.split()]
with scoped_env('TOKENSPEED_SM90_DECODE_T16', '0'):
    prewarm(cases + [c for c in CHECK if c.dtype != 'float8_e4m3fn' and c.page >= 32 and c.S * c.H <= 32], 15)
    with scoped_env('TOKENSPEED_SM90_DECODE_PAD_ROWS', 'copy'):
        prewarm(cases + [c for c in CHECK if c.S * c.H % 64], 15)
" > $OUT/prewarm.log 2>&1; echo prewarm rc=$?; grep "configs in" $OUT/prewarm.log
stamp diff
timeout 150 python scripts/decode_diff.py --cases 64,16384,64,16,1 64,81920,64,16,1 1,81920,64,16,1 --sets T16=0 T16=0 T16=0,PAD_ROWS=copy T16=0,PAD_ROWS=copy --out $OUT/decode_diff.json 2>&1 | grep '^{' | cut -c1-330
stamp tests
timeout $((540 - ($(date +%s) - t0))) python -m pytest -q -rfEx -p no:cacheprovider -k "t16_off or pad_rows_copy or cuda_graph or recompile" tests/gpu/test_sm90_decode.py > $OUT/gpu_tests.log 2>&1; echo tests rc=$?
tail -n 8 $OUT/gpu_tests.log
stamp done
