#!/usr/bin/env bash
# Session 21 (issue #19): 8-bit kernel variants of h200_s19_q8_cvt.py in one process (checks by
# the quantized rule on the default workload's 4 heads with the outlier head, then kernel + plan
# and op at TOPK 78 beside the bf16 default), the default among them.
#   carry .kcache;  LABELS=default,kv64 OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache \
#       bash bench/experiments/gpu_s21_q8_variants.sh
# Run 4 took LABELS=default,kv64,kv64_sahead,kv64_sahead_k4v3,kv64_sahead_2c and run 7
# LABELS=default,poly4,poly2,3c,3c_poly4; the S-ahead and polynomial-exp2 builds are removed
# (h200_s19_q8_cvt.py's VARIANTS comment, bench/NOTES.md session 21).
set -uo pipefail
OUT=${OUT:-out/s21}
LABELS=${LABELS:-default,kv64}
mkdir -p "$OUT"
source bench/experiments/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python3 bench/experiments/h200_s19_q8_cvt.py --only "$LABELS" --bf16 bf16_default \
    --out "$OUT/q8_variants.json" > "$OUT/q8_variants.log" 2>&1
echo "rc $?"; grep -E "PASS|FAIL" "$OUT/q8_variants.log" | cut -c1-200 | tail -8
grep -A9 "^| variant" "$OUT/q8_variants.log"
