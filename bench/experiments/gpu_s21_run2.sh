#!/usr/bin/env bash
# Session 21, run 2: (1) the 8-bit kernel's consumer counts with K's scale one a half (this
# tree) against the tree before (.base), same harness, back to back: one consumer with 128-key
# tiles (the default), three with 64-key tiles, two with 128-key tiles; (2) the Wan step
# (gpu_s21_wan.sh).
#   carry .kcache .base .whl_wan;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s21_run2.sh
set -uo pipefail
OUT=${OUT:-out/s21}
mkdir -p "$OUT"
source bench/experiments/gpu_env.sh
for tree in base new; do
    dir=$PWD; [ $tree = base ] && dir=$PWD/.base
    (cd "$dir" && PYTHONPATH=$dir timeout 150 python3 bench/experiments/h200_s19_q8_cvt.py \
        --only default,3c,k128_2c --bf16 bf16_default --out "$OUT/q8_$tree.json") \
        > "$OUT/q8_$tree.log" 2>&1
    echo "$tree rc $?"; grep -A8 "^| variant" "$OUT/q8_$tree.log" | cut -c1-200
done
timeout 400 bash bench/experiments/gpu_s21_wan.sh
