#!/usr/bin/env bash
# Session 21, run 4 (issue #19): the 8-bit kernel's 64-key tiles with S_{j+1} issued as soon as
# S_j's scores are read out (TILEGEN_EXP_S_AHEAD), against the 128-key default and the plain
# 64-key kernel, one process (checks by the quantized rule, then kernel + plan and op).
#   carry .kcache;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s21_sahead.sh
set -uo pipefail
OUT=${OUT:-out/s21}
mkdir -p "$OUT"
source bench/experiments/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 bench/experiments/h200_s19_q8_cvt.py \
    --only default,kv64,kv64_sahead,kv64_sahead_k4v3,kv64_sahead_2c --bf16 bf16_default \
    --out "$OUT/q8_sahead.json" > "$OUT/q8_sahead.log" 2>&1
echo "rc $?"; grep -E "PASS|FAIL" "$OUT/q8_sahead.log" | cut -c1-200 | tail -8
grep -A9 "^| variant" "$OUT/q8_sahead.log"
