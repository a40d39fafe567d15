#!/usr/bin/env bash
# Session 21 (issue #19): K's INT8 scale one a 32-key half, read once a half by the CUDA 8-bit
# kernel (no per-score multiply, no per-key scale loads). (1) The small checks of the 8-bit op
# (new tree); (2) the same harness on the tree before (.base: `git archive HEAD`, carried) and
# on this one, back to back on one GPU: the default 8-bit kernel + plan and op, checked by the
# quantized rule at the default workload's 4 heads, beside the bf16 default op.
#   carry .kcache .base;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s21_q8.sh
set -uo pipefail
OUT=${OUT:-out/s21}
mkdir -p "$OUT"
source bench/experiments/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm --format=csv,noheader
timeout 200 python3 bench/experiments/h200_quant_op.py --backend cuda --small-only \
    --out "$OUT/q8_small.json" > "$OUT/q8_small.log" 2>&1
echo "small rc $?"; grep -E "PASS|FAIL|rc|Error" "$OUT/q8_small.log" | cut -c1-200 | tail -30
for tree in base new; do
    dir=$PWD; [ $tree = base ] && dir=$PWD/.base
    (cd "$dir" && PYTHONPATH=$dir timeout 170 python3 bench/experiments/h200_s19_q8_cvt.py \
        --only default --bf16 bf16_default --out "$OUT/q8_$tree.json") > "$OUT/q8_$tree.log" 2>&1
    echo "$tree rc $?"; tail -12 "$OUT/q8_$tree.log" | cut -c1-250
done
