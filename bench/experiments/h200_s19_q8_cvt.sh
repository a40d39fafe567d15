#!/usr/bin/env bash
# Session 19 (issue #19): h200_s19_q8_cvt.py's checks and times, then Nsight Compute's pipe
# metrics and stalls of $NCU_LABELS (one launch each, TOPK 78).
#   OUT=/some/dir TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/h200_s19_q8_cvt.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/q8_cvt}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
S=bench/experiments/h200_s19_q8_cvt.py
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm --format=csv,noheader
timeout "${TIME_LIMIT:-330}" python3 $S --out "$OUT/q8_cvt.json" > "$OUT/q8_cvt.log" 2>&1
echo "rc $?"; tail -16 "$OUT/q8_cvt.log"
for L in ${NCU_LABELS:-default}; do
    timeout 150 ncu -k regex:int8_fp8_bm64 --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --metrics sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active \
        --page raw --csv python3 $S --ncu "$L" > "$OUT/ncu_$L.csv" 2> "$OUT/ncu_$L.err"
    echo "== ncu $L rc $?"; python3 $S --ncu-summary "$OUT/ncu_$L.csv" | grep -v "\.max\|\.min\|\.sum" | grep -E "pct_of_peak_sustained_active|stalled|issue_active|duration|warps_active" | head -60
done
