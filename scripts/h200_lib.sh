# Shared by the scripts/h200_*.sh device calls (sourced): the environment, $OUT, stamp, and the check helper.
export CUTE_DSL_ARCH=sm_90a TOKENSPEED_JAX_CACHE_DIR=${TOKENSPEED_JAX_CACHE_DIR:-/tmp/tsj_cache} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
gpu_line() { nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader; }
# check_cases SECONDS VAR VALUE FILTER NAME: benchmarks.decode.check of the CHECK cases ``c`` for which the Python
# expression FILTER holds, with VAR=VALUE (or with VAR "-" the switch set VALUE, as benchmarks.harness.switches and
# scripts/decode_ab.py take it), against the fp32 reference (fresh seed); writes $OUT/NAME.json and $OUT/NAME.log and
# prints "CHECK passed / cases" and the failed rows
check_cases() {
  timeout "$1" python -c "
import json, os
from benchmarks.decode import CHECK, check
from benchmarks.harness import switches
seed = int.from_bytes(os.urandom(3), 'little')
with switches('$2', '$3'):
    r = check([c for c in CHECK if $4], seed)
json.dump({'seed': seed, '$2': '$3', 'rows': r}, open('$OUT/$5.json', 'w'), indent=1)
print('CHECK', sum(x['ok'] for x in r), '/', len(r), 'seed', seed)
" > "$OUT/$5.log" 2>&1; echo "check rc=$?"
  grep -E '^CHECK|"ok": false|Error|error' "$OUT/$5.log" | head -n 12
}
# switch_envs VAR VALUE: VAR=VALUE, or with VAR "-" the switch set VALUE (NAME=VALUE[,...] after the
# TOKENSPEED_SM90_DECODE_ prefix, "-": none, as benchmarks.harness.switches takes it) as environment assignments, one
# per line (for memcheck_start: mapfile -t ENVS < <(switch_envs VAR VALUE))
switch_envs() {
  if [ "$1" != - ]; then echo "$1=$2"; return 0; fi
  local kv kvs; IFS=, read -r -a kvs <<< "$2"
  for kv in "${kvs[@]}"; do [ "$kv" != - ] && echo "TOKENSPEED_SM90_DECODE_$kv"; done
  return 0
}
# memcheck_start SECONDS [VAR=VALUE ...]: the compute-sanitizer memcheck test of tests/gpu/test_sm90_decode.py in the
# background, with the given environment, into $OUT/memcheck.log; memcheck_wait: wait for it and print its summary
memcheck_start() {
  local secs=$1; shift
  (
    timeout "$secs" env "$@" TOKENSPEED_SANITIZER=1 python -m pytest -q -s -rfEx -p no:cacheprovider -k memcheck \
      tests/gpu/test_sm90_decode.py > "$OUT/memcheck.log" 2>&1
    echo "memcheck rc=$?" >> "$OUT/memcheck.log"
  ) &
  MEMCHECK_PID=$!
}
memcheck_wait() {
  while kill -0 "$MEMCHECK_PID" 2>/dev/null; do sleep 2; done; stamp "memcheck done"
  grep -E "memcheck rc|ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -n 4
}
