#!/usr/bin/env bash
# Session 21: the CUDA family tuned on this GPU for the default spec, bf16 and int8_fp8 (every
# feasible point of [tunable.cuda]; the cubins prebuilt on a CPU by prebuild_cuda_space.py and
# carried), the winners merged into tuning_db/winners.json (a copy in $OUT).
#   carry .kcache .whl;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s21_tune.sh
set -euo pipefail
OUT=${OUT:-out/s21_tune}
mkdir -p "$OUT"
. bench/experiments/gpu_env.sh
export TILEGEN_DB=$OUT/tuning.sqlite
nvidia-smi --query-gpu=name --format=csv,noheader
for spec in default int8_fp8; do
    SECONDS=0
    args=(); [ $spec = int8_fp8 ] && args=(--spec bench/specs/int8_fp8.toml)
    python3 -m tilegen.cli tune "${args[@]}" --backend cuda --sampler grid --trials 144 --seeds 2 \
        --export tuning_db/winners.json --summary "$OUT/summary_$spec.json" > "$OUT/tune_$spec.log" 2>&1
    echo "$spec: rc $? in ${SECONDS} s"; tail -n 15 "$OUT/tune_$spec.log" | cut -c1-220
    cp tuning_db/winners.json "$OUT/winners.json"
done
