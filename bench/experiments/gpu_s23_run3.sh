#!/usr/bin/env bash
# Session 23, device run 3 (issue #22): the Wan step as in runs 1 and 2 with the top-k's early
# stop, compiled rows only (dense, bf16, int8_fp8, dense again), REPS repetitions each (default
# 3), no profile. Run 3 itself ran at e18765e, where the processor also took Q quantized by the
# prologue and the step script checked it; that failed and was reverted (bench/NOTES.md).
#   carry .kcache .whl .whl_wan;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s23_run3.sh
set -uo pipefail
OUT=${OUT:-out/s23_run3}
mkdir -p "$OUT"
source bench/experiments/gpu_env.sh
source bench/experiments/gpu_wan_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
timeout ${WAN_TIMEOUT:-170} python3 bench/experiments/h200_wan_step.py --out "$OUT/wan_step.json" --no-graph \
    --no-eager --reps ${REPS:-3} > "$OUT/wan_step.log" 2>&1
echo "wan rc $?"
grep -E "^\| |^speedup|^check|^thw|^prologue|compile failed|_compiled" "$OUT/wan_step.log" | cut -c1-160 | head -40
