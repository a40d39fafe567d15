#!/usr/bin/env bash
# Session 22, device run 4 (issue #19): 8-bit kernel variants in one process
# (h200_s19_q8_cvt.py: the quantized rule's checks, then kernel + plan and op at TOPK 78); on an
# H200 then the CUDA family tuned for the bf16 default. Run 4 took
# LABELS=default,rowsum,sumtree,k128_2c,k128_2c_rowsum,3c,3c_rowsum: l from the P V MMA and l
# in four chains, builds since removed (h200_s19_q8_cvt.py's VARIANTS comment).
#   carry .kcache .whl;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s22_run3.sh
set -uo pipefail
OUT=${OUT:-out/s22_run3}
LABELS=${LABELS:-default,k128_2c,3c}
mkdir -p "$OUT"
source bench/experiments/gpu_env.sh
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "$gpu"
SECONDS=0
timeout 330 python3 bench/experiments/h200_s19_q8_cvt.py --only "$LABELS" --bf16 bf16_default \
    --out "$OUT/q8_variants.json" > "$OUT/q8_variants.log" 2>&1
echo "variants rc $? in ${SECONDS} s"; grep -E "PASS|FAIL" "$OUT/q8_variants.log" | cut -c1-200 | tail -10
grep -A12 "^| variant" "$OUT/q8_variants.log"
if [[ "$gpu" == *H200* ]]; then
    export TILEGEN_DB=$OUT/tuning.sqlite
    SECONDS=0
    timeout 150 python3 -m tilegen.cli tune --backend cuda --sampler grid --trials 144 --seeds 2 \
        --export tuning_db/winners.json --summary "$OUT/summary_default.json" \
        > "$OUT/tune_default.log" 2>&1
    echo "tune default: rc $? in ${SECONDS} s"; grep -E "^winner|^trials|merged" "$OUT/tune_default.log" | cut -c1-200
    cp tuning_db/winners.json "$OUT/winners.json"
fi
