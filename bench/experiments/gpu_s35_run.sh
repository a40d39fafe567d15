#!/usr/bin/env bash
# Session 35 (issue #19), one device call. On any card, first: the fixed-cost probe
# (gpu_s35_fixed.py: the 8-bit op's pass, plan and kernel at TOPK 2, 8 and 78, the persistent
# grid's static and dynamic schedules, each checked with the quantized rule). Then on an H200:
# gpu_s34_run.sh (the 8-bit tune over gpu_s32_space.sh's SPACE, exported to
# tuning_db/winners.json and copied out, and `tilegen bench --sweep --backends cuda` with it).
# At most 8 files under $OUT. Before the call, on the CPU machine:
#   bash bench/experiments/gpu_s35_prepare.sh
# Then: carry .kcache .whl;  CALL_LIMIT=540 OUT=$OUT bash bench/experiments/gpu_s35_run.sh
# (SKIP_PROBE=1 CALL_LIMIT=400 ...: the H200's tune and sweep only)
set -uo pipefail
OUT=${OUT:-out/s35_run}
mkdir -p "$OUT"
CALL_LIMIT=${CALL_LIMIT:-540}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "GPU: $gpu"
source bench/experiments/gpu_env.sh
export TILEGEN_CACHE_DIR=$PWD/.kcache
# SKIP_PROBE=1: no probe (it ran on an H100 in runs 3-4), and nothing on another card
if [[ "${SKIP_PROBE:-0}" != 1 ]]; then
    start=$SECONDS
    timeout 170 python3 bench/experiments/gpu_s35_fixed.py --out "$OUT/fixed.json" \
        > "$OUT/fixed.log" 2>&1
    echo "fixed-cost probe: rc $? in $((SECONDS - start)) s"
    grep -E "^check|^\||, torch|^dynamic verdict" "$OUT/fixed.log"
    tail -3 "$OUT/fixed.log" | grep -v "^dynamic verdict\|^|"
fi
[[ "$gpu" == *H200* ]] || exit 0
# the dynamic schedule was not ahead at TOPK 78 on the H100 (runs 3-4), so the H200's tune is
# gpu_s34_run.sh's: the linear P, one or two consumers, then the sweep
CALL_LIMIT=$((CALL_LIMIT - SECONDS)) OUT="$OUT" bash bench/experiments/gpu_s34_run.sh
