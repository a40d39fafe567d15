#!/usr/bin/env bash
# Session 22, device run 8: on an H200, the CUDA family tuned for the bf16 default (its winner
# merged into tuning_db/winners.json) and `tilegen bench --sweep --backends cuda,gluon` with the
# 8-bit rows (gpu_s21_ship.sh, TUNE_8BIT=0: issues #20, #19); then, on any GPU, the pre-pass of
# this tree against the one before (gpu_s22_prepass.py, .base).
#   carry .kcache .base .whl;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s22_run8.sh
set -uo pipefail
OUT=${OUT:-out/s22_run8}
mkdir -p "$OUT"
TUNE_8BIT=0 H200_ONLY=1 bash bench/experiments/gpu_s21_ship.sh
source bench/experiments/gpu_env.sh
for tree in base new; do
    dir=$PWD; [ $tree = base ] && dir=$PWD/.base
    (cd "$dir" && PYTHONPATH=$dir timeout 60 python3 "$OLDPWD/bench/experiments/gpu_s22_prepass.py" \
        --out "$OUT/prepass_$tree.json") > "$OUT/prepass_$tree.log" 2>&1
    echo "$tree rc $?"; grep -E "^\| prepass_(default|wan_thw) " "$OUT/prepass_$tree.log"
done
