#!/usr/bin/env bash
# Session 23, device run 2 (issue #22): the CUDA 8-bit kernel's header changed (o stored in the
# model's token order when the call gives out_rows), so its shipped winner is re-tuned on this
# GPU first (tuning_db/winners.json, a copy in $OUT); then the prologue alone (4 warps now, its
# values against diffusers' eager and compiled modules) and the Wan step as in run 1.
#   carry .kcache .whl .whl_wan;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s23_run2.sh
set -uo pipefail
OUT=${OUT:-out/s23_run2}
mkdir -p "$OUT"
source bench/experiments/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
SECONDS=0
TILEGEN_DB=$OUT/tuning.sqlite timeout 300 python3 -m tilegen.cli tune --spec bench/specs/int8_fp8.toml \
    --backend cuda --sampler grid --trials 144 --seeds 2 --export tuning_db/winners.json \
    --summary "$OUT/summary_int8_fp8.json" > "$OUT/tune_int8_fp8.log" 2>&1
echo "tune int8_fp8: rc $? in ${SECONDS} s"; grep -E "^winner|^trials|merged|export" "$OUT/tune_int8_fp8.log" | cut -c1-220
cp tuning_db/winners.json "$OUT/winners.json"
source bench/experiments/gpu_wan_env.sh
timeout 120 python3 bench/experiments/gpu_s23_prologue.py --out "$OUT/prologue.json" > "$OUT/prologue.log" 2>&1
echo "prologue rc $?"; head -c 1500 "$OUT/prologue.log"; echo; tail -14 "$OUT/prologue.log"
timeout ${WAN_TIMEOUT:-300} python3 bench/experiments/h200_wan_step.py --out "$OUT/wan_step.json" --no-graph \
    --no-eager --profile > "$OUT/wan_step.log" 2>&1
echo "wan rc $?"
grep -E "^profile|^   |^\| |^speedup|^check|^thw|compile failed|ops:" "$OUT/wan_step.log" | cut -c1-200 | head -70
