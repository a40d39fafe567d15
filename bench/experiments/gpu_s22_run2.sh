#!/usr/bin/env bash
# Session 22, device runs 2 and 3 (issues #19, #20, #22): the host's share of the ops' time
# (gpu_s22_host.py; run 2 stopped at an import, fixed for run 3), the pre-pass's program shapes
# (gpu_s22_prepass.py), then on an H200 the CUDA family tuned for the bf16 default and the
# sweep (gpu_s21_ship.sh).
#   carry .kcache .whl;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s22_run2.sh
set -uo pipefail
OUT=${OUT:-out/s22_run2}
mkdir -p "$OUT"
source bench/experiments/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout 200 python3 bench/experiments/gpu_s22_host.py --out "$OUT/host.json" > "$OUT/host.log" 2>&1
echo "host rc $?"; grep -E "^==|^   kernel|^\| " "$OUT/host.log" | cut -c1-200
timeout 150 python3 bench/experiments/gpu_s22_prepass.py --out "$OUT/prepass.json" > "$OUT/prepass.log" 2>&1
echo "prepass rc $?"; grep -E "^pool_check|^\| " "$OUT/prepass.log" | cut -c1-200
TUNE_8BIT=0 H200_ONLY=1 bash bench/experiments/gpu_s21_ship.sh
