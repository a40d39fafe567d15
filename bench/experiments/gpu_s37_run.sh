#!/usr/bin/env bash
# Session 37 (issue #19), one device call.
#   On an H200: gpu_s34_run.sh (the 8-bit tune over gpu_s32_space.sh's linear-P space, exported
#   to tuning_db/winners.json and copied out; then `tilegen bench --sweep --backends cuda`,
#   the figure).
#   On another card: gpu_s37_ncu_source.sh (per-SASS-instruction stall samples of the 1c K2 V3
#   and 2c K2 V2 linear kernels).
# Before the call, on the CPU machine: bash bench/experiments/gpu_s36_prepare.sh
# Then: carry .kcache .whl;  CALL_LIMIT=420 OUT=$OUT bash bench/experiments/gpu_s37_run.sh
set -uo pipefail
OUT=${OUT:-out/s37_run}
mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
if [[ "$gpu" == *H200* ]]; then
    CALL_LIMIT=${CALL_LIMIT:-420} OUT="$OUT" exec bash bench/experiments/gpu_s34_run.sh
fi
OUT="$OUT" exec bash bench/experiments/gpu_s37_ncu_source.sh
