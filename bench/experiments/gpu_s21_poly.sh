#!/usr/bin/env bash
# Session 21, run 7 (issue #19): a quarter or half of the 8-bit kernel's exponentials on the FMA
# pipe (TILEGEN_EXP_POLY_QUARTER / _HALF; run 6's Nsight put 17.7% of the warps' samples on
# MUFU.EX2), against the default, for one and three consumers, one process.
#   carry .kcache;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s21_poly.sh
set -uo pipefail
OUT=${OUT:-out/s21}
mkdir -p "$OUT"
source bench/experiments/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python3 bench/experiments/h200_s19_q8_cvt.py \
    --only default,poly4,poly2,3c,3c_poly4 --bf16 bf16_default \
    --out "$OUT/q8_poly.json" > "$OUT/q8_poly.log" 2>&1
echo "rc $?"; grep -E "PASS|FAIL" "$OUT/q8_poly.log" | cut -c1-200 | tail -7
grep -A8 "^| variant" "$OUT/q8_poly.log"
