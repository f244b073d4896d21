#!/usr/bin/env bash
# The DRAM side of the memory-bound BF16 decode, ours next to FlashMLA, under ncu (one device call, carry [".device"]):
#   source .device/bootstrap.sh && bash scripts/h200_ncu_mem.sh            # ~1 min
#   source .device/bootstrap.sh && CC=none RUNS=late:flash bash scripts/h200_ncu_mem.sh   # free-running clocks
# B64/K16384/H16/S1 (page 64): our seesaw kernel with the default L2 prefetch ("late") and FlashMLA BF16, then ours
# with TOKENSPEED_SM90_DECODE_L2_PREFETCH=off.  Raw metrics of the SpeedOfLight and MemoryWorkloadAnalysis sections plus
# DRAM bytes read and L2 read sectors, per kernel launch; ncu_<run>.csv, and a summary.  $CC is ncu's --clock-control
# (default "base": ncu locks the clocks at base; "none": the GPU's own, free-running and power-capped, clocks).
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/h200_lib.sh"
gpu_line
CC=${CC:-base}
M="--clock-control $CC --section SpeedOfLight --section MemoryWorkloadAnalysis --metrics dram__bytes_read.sum,lts__t_sectors_op_read.sum"
for run in ${RUNS:-late:flash off:none}; do
  pf=${run%%:*}; fm=${run#*:}
  stamp "ncu L2_PREFETCH=$pf"
  timeout 200 env TOKENSPEED_SM90_DECODE_L2_PREFETCH=$pf ncu --kernel-name regex:'seesaw_kernel|flash_fwd' \
    --launch-count 12 $M --csv --page raw python -m benchmarks.profile_decode --cases 64,16384,64,16,1 \
    $([ $fm = none ] && echo --no-flashmla) > "$OUT/ncu_${pf}_$CC.csv" 2>&1; echo "ncu rc=$?"
done
python - "$OUT" <<'PY'
import csv, io, sys, glob, json, os
want = ["gpu__time_duration.sum", "sm__cycles_elapsed.avg.per_second", "dram__cycles_elapsed.avg.per_second",
        "dram__bytes.sum.per_second", "dram__bytes_read.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "lts__t_sectors_op_read.sum", "lts__t_sector_op_read_hit_rate.pct", "lts__t_sector_hit_rate.pct"]
out = []
for f in sorted(glob.glob(os.path.join(sys.argv[1], "ncu_*.csv"))):
    txt = open(f).read()
    i = txt.find('"ID"')
    if i < 0:
        print(f, "no table:", txt[-600:]); continue
    rows = list(csv.reader(io.StringIO(txt[i:])))
    hdr = rows[0]
    for r in rows[2:]:
        if len(r) != len(hdr):
            continue
        d = dict(zip(hdr, r))
        row = {"file": os.path.basename(f), "kernel": d.get("Kernel Name", "")[:60]}
        row.update({k: d.get(k) for k in want})
        out.append(row)
        print(json.dumps(row))
json.dump(out, open(os.path.join(sys.argv[1], "ncu_mem_summary.json"), "w"), indent=1)
PY
stamp "done"
