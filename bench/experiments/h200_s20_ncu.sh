#!/usr/bin/env bash
# Session 20 (issue #19): why three consumers a CTA did not speed the 8-bit kernel. Times of
# $Q8 and $BF16 (h200_s19_q8_cvt.py), then Nsight Compute on one launch of each of $NCU_LABELS:
# speed of light, memory (shared memory and L2), pipes, warp states and scheduler.
#   OUT=/some/dir TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/h200_s20_ncu.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/s20}
mkdir -p "$OUT"
source bench/experiments/gpu_env.sh
S=bench/experiments/h200_s19_q8_cvt.py
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm --format=csv,noheader
if [ -n "${Q8:-}${BF16:-}" ]; then
    timeout "${TIME_LIMIT:-240}" python3 $S --only "${Q8:-}" --bf16 "${BF16:-}" \
        --out "$OUT/q8_times.json" > "$OUT/q8_times.log" 2>&1
    echo "times rc $?"; tail -14 "$OUT/q8_times.log"
fi
for L in ${NCU_LABELS:-default 3c}; do
    timeout 150 ncu -k regex:int8_fp8_bm64 --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section Occupancy \
        --metrics sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum \
        --page raw --csv python3 $S --ncu "$L" > "$OUT/ncu_$L.csv" 2> "$OUT/ncu_$L.err"
    echo "== ncu $L rc $?"
    python3 $S --ncu-summary "$OUT/ncu_$L.csv" | grep -v "\.max \|\.min \|\.sum \[" \
        | grep -E "pct_of_peak_sustained_(active|elapsed)|warp_issue_stalled.*per_warp_active|issue_active|gpu__time_duration.sum|warps_active.avg.per_cycle|inst_executed.sum" | grep -v "^smsp__pcsamp" | head -80
done
