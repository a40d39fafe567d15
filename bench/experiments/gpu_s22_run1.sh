#!/usr/bin/env bash
# Session 22, device run 1 (issues #19, #20, #22): the 8-bit pre-pass and the THW layer's
# selection, this tree against the one before (.base; gpu_s22_prepass.py), then on an H200 the
# CUDA family tuned for the bf16 default and the sweep with the 8-bit rows (gpu_s21_ship.sh,
# TUNE_8BIT=0).
#   carry .kcache .base .whl;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s22_run1.sh
set -uo pipefail
OUT=${OUT:-out/s22_run1}
mkdir -p "$OUT"
source bench/experiments/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
for tree in base new; do
    dir=$PWD; [ $tree = base ] && dir=$PWD/.base
    (cd "$dir" && PYTHONPATH=$dir timeout 150 python3 "$OLDPWD/bench/experiments/gpu_s22_prepass.py" \
        --out "$OUT/prepass_$tree.json") > "$OUT/prepass_$tree.log" 2>&1
    echo "$tree rc $?"; grep -E "^sha|^pool_check|^thw_op:|^\| " "$OUT/prepass_$tree.log" | cut -c1-220
done
TUNE_8BIT=0 H200_ONLY=1 bash bench/experiments/gpu_s21_ship.sh
