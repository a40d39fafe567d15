#!/usr/bin/env bash
# Session 23, device run 1 (issue #22): the fused q/k prologue (tilegen.prologue) against
# diffusers' modules alone, then the Wan2.2-A14B-shaped step compiled (dense, bf16, int8_fp8;
# no eager rows) with one step of each profiled by kernel.
#   carry .kcache .whl .whl_wan;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s23_run1.sh
set -uo pipefail
OUT=${OUT:-out/s23_run1}
mkdir -p "$OUT"
source bench/experiments/gpu_env.sh
source bench/experiments/gpu_wan_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
timeout 150 python3 bench/experiments/gpu_s23_prologue.py --out "$OUT/prologue.json" > "$OUT/prologue.log" 2>&1
echo "prologue rc $?"; tail -14 "$OUT/prologue.log"
timeout ${WAN_TIMEOUT:-400} python3 bench/experiments/h200_wan_step.py --out "$OUT/wan_step.json" --no-graph \
    --no-eager --profile ${WAN_ARGS:-} > "$OUT/wan_step.log" 2>&1
echo "wan rc $?"
grep -E "^profile|^   |^\| |^speedup|^check|^thw|compile failed" "$OUT/wan_step.log" | cut -c1-200 | head -80
