#!/usr/bin/env bash
# Session 26, run 2 (H200 only; any other GPU: exit at once): run 1's figures again on the
# shipped winners (run 1's CUDA bf16 winner is in tuning_db/winners.json now): the compiled Wan
# step (issue #22), `tilegen bench --sweep --seeds 2 --backends cuda,gluon` (issues #20, #19),
# the same at 12 heads and TOPK 78, and, when the call has TUNE8_MIN seconds left, the int8_fp8
# CUDA kernel tuned on the H200 (its winner merged into tuning_db/winners.json; the shipped one
# is stale since session 23's header change). At most 8 files under $OUT (the device tool
# returns no more): the DBs and the 12-head JSON live in /tmp.
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
timeout "$((left > 160 ? 160 : left))" python3 -m tilegen.cli bench --sweep --seeds 2 \
    --backends cuda,gluon --no-dense --no-flex \
    --json "$OUT/bench_sweep.json" --plot "$OUT/bench_sweep.png" > "$OUT/bench_sweep.log" 2>&1
echo "bench: rc $? in $((SECONDS - start)) s"; grep -E "│ seed|^bench finished" "$OUT/bench_sweep.log" | cut -c1-200
left=$((CALL_LIMIT - SECONDS))
if ((left > 30)); then
    start=$SECONDS
    timeout "$((left > 60 ? 60 : left))" python3 -m tilegen.cli bench --heads 12 --backends cuda,gluon \
        --no-dense --no-flex --json /tmp/s26db/bench_h12.json > "$OUT/bench_h12.log" 2>&1
    echo "bench heads 12: rc $? in $((SECONDS - start)) s"; grep -E "│ seed" "$OUT/bench_h12.log" | cut -c1-200
fi
left=$((CALL_LIMIT - SECONDS))
if ((left > ${TUNE8_MIN:-250})); then
    start=$SECONDS
    timeout "$left" python3 -m tilegen.cli tune --spec bench/specs/int8_fp8.toml \
        --backend cuda --sampler grid --trials 144 --seeds 2 --export tuning_db/winners.json \
        --summary /tmp/s26db/summary_int8_fp8.json > "$OUT/tune_int8_fp8.log" 2>&1
    echo "tune int8_fp8: rc $? in $((SECONDS - start)) s"
    grep -E "^winner|^trials|merged" "$OUT/tune_int8_fp8.log" | cut -c1-200
    cp tuning_db/winners.json "$OUT/winners.json"
else
    echo "tune int8_fp8: not run (${left} s left)"
fi
