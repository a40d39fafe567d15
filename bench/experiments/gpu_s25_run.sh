#!/usr/bin/env bash
# Session 25 (issue #22): the 8-bit pre-pass that applies Wan's q/k prologue itself
# (gpu_s25_fused.py: checks, pieces, the layer both ways), then the Wan step as in session 24
# (compiled rows: dense, bf16, int8_fp8, dense again; the int8 layers now take the fused path).
# On an H200 the step is issue #22's measurement.
#   carry .kcache .whl .whl_wan;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s25_run.sh
set -uo pipefail
OUT=${OUT:-out/s25_run}
mkdir -p "$OUT"
source bench/experiments/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
if [[ "${FUSED:-1}" = 1 ]]; then
    timeout 200 python3 bench/experiments/gpu_s25_fused.py --out "$OUT/fused.json" \
        > "$OUT/fused.log" 2>&1
    echo "fused rc $?"; grep -E "^check|^\| |Error|error" "$OUT/fused.log" | cut -c1-200 | head -40
fi
[[ "${STEP:-1}" = 1 ]] || exit 0
source bench/experiments/gpu_wan_env.sh
timeout ${WAN_TIMEOUT:-240} python3 bench/experiments/h200_wan_step.py --out "$OUT/wan_step.json" \
    --no-graph --no-eager --reps ${REPS:-3} > "$OUT/wan_step.log" 2>&1
echo "wan rc $?"
grep -E "^\| |^speedup|^check|^thw|compile failed|_compiled|Error" "$OUT/wan_step.log" | cut -c1-200 | head -40
