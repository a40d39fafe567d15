#!/usr/bin/env bash
# Session 26, run 2 (H200 only; any other GPU: exit at once): the int8_fp8 CUDA kernel tuned on
# the H200 (its winner merged into tuning_db/winners.json; the shipped one was stale since
# session 23's header change), the compiled Wan step again with it (issue #22), then
# `tilegen bench --sweep --seeds 2 --backends cuda,gluon` (issues #20, #19) and, with what is
# left of the call, the same at 12 heads, TOPK 78. At most 8 files under $OUT (the device
# tool returns no more): the DBs live in /tmp.
#   carry .kcache .whl .whl_wan;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s26_h200_confirm.sh
set -uo pipefail
OUT=${OUT:-out/s26_confirm}
mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "GPU: $gpu"
if [[ "$gpu" != *H200* ]]; then exit 0; fi
CALL_LIMIT=${CALL_LIMIT:-585}
source bench/experiments/gpu_env.sh
mkdir -p /tmp/s26db
export TILEGEN_DB=/tmp/s26db/tuning.sqlite
if [[ "${TUNE8:-1}" = 1 ]]; then  # TUNE8=0: the step and the benches only
start=$SECONDS
timeout ${TUNE_LIMIT:-280} python3 -m tilegen.cli tune --spec bench/specs/int8_fp8.toml \
    --backend cuda --sampler grid --trials 144 --seeds 2 --export tuning_db/winners.json \
    --summary /tmp/s26db/summary_int8_fp8.json > "$OUT/tune_int8_fp8.log" 2>&1
echo "tune int8_fp8: rc $? in $((SECONDS - start)) s"
grep -E "^winner|^trials|merged" "$OUT/tune_int8_fp8.log" | cut -c1-200
cp tuning_db/winners.json "$OUT/winners.json"
fi
(
    source bench/experiments/gpu_wan_env.sh
    start=$SECONDS
    timeout ${WAN_TIMEOUT:-150} python3 bench/experiments/h200_wan_step.py --out "$OUT/wan_step.json" \
        --no-graph --no-eager --reps ${REPS:-3} > "$OUT/wan_step.log" 2>&1
    echo "wan rc $? in $((SECONDS - start)) s"
)
grep -E "^ops|^speedup|_compiled:" "$OUT/wan_step.log" | cut -c1-400
left=$((CALL_LIMIT - SECONDS))
start=$SECONDS
timeout "$((left > 150 ? 150 : left))" python3 -m tilegen.cli bench --sweep --seeds 2 \
    --backends cuda,gluon --no-dense --no-flex \
    --json "$OUT/bench_sweep.json" --plot "$OUT/bench_sweep.png" > "$OUT/bench_sweep.log" 2>&1
echo "bench: rc $? in $((SECONDS - start)) s"; grep -E "│ seed|^bench finished" "$OUT/bench_sweep.log" | cut -c1-200
left=$((CALL_LIMIT - SECONDS))
if ((left > 30)); then
    start=$SECONDS
    timeout "$left" python3 -m tilegen.cli bench --heads 12 --backends cuda,gluon --no-dense \
        --no-flex --json /tmp/s26db/bench_h12.json > "$OUT/bench_h12.log" 2>&1
    echo "bench heads 12: rc $? in $((SECONDS - start)) s"; grep -E "│ seed" "$OUT/bench_h12.log" | cut -c1-200
fi
