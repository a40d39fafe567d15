#!/usr/bin/env bash
# Session 25 (issue #22): the 8-bit pre-pass that applies Wan's q/k prologue itself
# (gpu_s25_fused.py: checks, pieces with 1-8 heads a program, the layer both ways), then the Wan
# step as in session 24 (compiled rows: dense, bf16, int8_fp8, dense again), with a row for the
# 8-bit layers taking the fused pass when it was ahead alone. On an H200 the step is issue #22's
# measurement. STEP=0: the pieces alone.
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
[[ "${STEP:-1}" != 0 ]] || exit 0
# the step; with a row for the prologue in the pre-pass when that pass is ahead alone
fused_row=()
if grep -q '"fused_faster": true' "$OUT/fused.json" 2>/dev/null; then fused_row=(--prepass-prologue); fi
source bench/experiments/gpu_wan_env.sh
timeout ${WAN_TIMEOUT:-300} python3 bench/experiments/h200_wan_step.py --out "$OUT/wan_step.json" \
    --no-graph --no-eager --reps ${REPS:-3} ${fused_row[@]+"${fused_row[@]}"} > "$OUT/wan_step.log" 2>&1
echo "wan rc $?"
grep -E "^\| |^speedup|^check|^thw|compile failed|_compiled|Error" "$OUT/wan_step.log" | cut -c1-200 | head -40
