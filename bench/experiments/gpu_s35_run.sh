#!/usr/bin/env bash
# Session 35 (issue #19), one device call.
#   On an H200: gpu_s34_run.sh's block (the 8-bit tune over the linear P, exported to
#   tuning_db/winners.json and copied out; `tilegen bench --sweep --backends cuda`), then, with
#   time left, the fixed-cost probe (gpu_s35_fixed.py).
#   On another card: the fixed-cost probe only (session 35's S-ahead probes ran already).
# At most 8 files under $OUT. Before the call, on the CPU machine:
#   bash bench/experiments/gpu_s33_prepare.sh
#   TILEGEN_CACHE_DIR=$PWD/.kcache python3 bench/experiments/gpu_s35_fixed.py --prebuild
# Then: carry .kcache .whl;  CALL_LIMIT=540 OUT=$OUT bash bench/experiments/gpu_s35_run.sh
set -uo pipefail
OUT=${OUT:-out/s35_run}
mkdir -p "$OUT"
CALL_LIMIT=${CALL_LIMIT:-540}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "GPU: $gpu"
source bench/experiments/gpu_env.sh
export TILEGEN_CACHE_DIR=$PWD/.kcache
if [[ "$gpu" == *H200* ]]; then
    CALL_LIMIT=$((CALL_LIMIT - 100)) OUT="$OUT" bash bench/experiments/gpu_s34_run.sh
fi
left=$((CALL_LIMIT - SECONDS))
if ((left > 60)); then
    start=$SECONDS
    timeout "$((left - 10))" python3 bench/experiments/gpu_s35_fixed.py --out "$OUT/fixed.json" \
        > "$OUT/fixed.log" 2>&1
    echo "fixed-cost probe: rc $? in $((SECONDS - start)) s"
    grep -E "^check|^\||, torch" "$OUT/fixed.log"
    tail -3 "$OUT/fixed.log"
fi
