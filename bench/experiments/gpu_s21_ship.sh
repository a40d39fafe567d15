#!/usr/bin/env bash
# Session 21, run 5 (issues #19, #20): on an H200, the CUDA family tuned for the bf16 default
# spec (its winner merged into tuning_db/winners.json, so `tilegen.load(Spec())` takes the
# fastest family), then `tilegen bench --sweep --backends cuda,gluon` with the 8-bit rows
# (figures, JSON, plot), then the 8-bit CUDA kernel tuned (its H200 winner). On another GPU
# only the sweep runs (that GPU's winners are already shipped), or nothing with H200_ONLY=1;
# TUNE_8BIT=0 leaves the 8-bit tune out.
#   carry .kcache .whl;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s21_ship.sh
set -uo pipefail
OUT=${OUT:-out/s21_ship}
mkdir -p "$OUT"
. bench/experiments/gpu_env.sh
export TILEGEN_DB=$OUT/tuning.sqlite
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "$gpu"
if [[ "$gpu" != *H200* && "${H200_ONLY:-0}" = 1 ]]; then exit 0; fi
tune() {  # spec label, extra args
    local label=$1; shift
    SECONDS=0
    timeout "$TUNE_LIMIT" python3 -m tilegen.cli tune "$@" --backend cuda --sampler grid \
        --trials 144 --seeds 2 --export tuning_db/winners.json \
        --summary "$OUT/summary_$label.json" > "$OUT/tune_$label.log" 2>&1
    echo "tune $label: rc $? in ${SECONDS} s"; grep -E "^winner|^trials|merged" "$OUT/tune_$label.log" | cut -c1-200
    cp tuning_db/winners.json "$OUT/winners.json"
}
if [[ "$gpu" == *H200* ]]; then TUNE_LIMIT=150 tune default; fi
SECONDS=0
timeout 240 python3 -m tilegen.cli bench --sweep --backends cuda,gluon --no-dense --no-flex \
    --json "$OUT/bench_sweep.json" --plot "$OUT/bench_sweep.png" > "$OUT/bench_sweep.log" 2>&1
echo "bench: rc $? in ${SECONDS} s"; tail -n 45 "$OUT/bench_sweep.log" | cut -c1-230
if [[ "$gpu" == *H200* && "${TUNE_8BIT:-1}" = 1 ]]; then
    TUNE_LIMIT=230 tune int8_fp8 --spec bench/specs/int8_fp8.toml
fi
