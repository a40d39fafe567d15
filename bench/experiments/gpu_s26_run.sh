#!/usr/bin/env bash
# Session 26: one call that measures what the GPU it lands on can measure.
# On an H200 (issues #22 and #20, in one call of at most 600 s): the compiled Wan step with the
# row for the q/k prologue inside the 8-bit pre-pass (issue #22's figure), then the CUDA bf16
# default tuned and `tilegen bench --sweep --backends cuda,gluon` (issue #20's figure; the tune's
# winner merged into tuning_db/winners.json and copied to $OUT). The sweep gets what is left of
# the call. On another GPU: gpu_s25_run.sh (the fused pre-pass at 1-8 heads a program, the step).
#   carry .kcache .whl .whl_wan;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s26_run.sh
set -uo pipefail
OUT=${OUT:-out/s26_run}
mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "GPU: $gpu"
if [[ "$gpu" != *H200* ]]; then
    OUT=$OUT REPS=${REPS:-3} bash bench/experiments/gpu_s25_run.sh
    exit $?
fi
CALL_LIMIT=${CALL_LIMIT:-590}
source bench/experiments/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
(
    source bench/experiments/gpu_wan_env.sh
    timeout ${WAN_TIMEOUT:-190} python3 bench/experiments/h200_wan_step.py --out "$OUT/wan_step.json" \
        --no-graph --no-eager --reps ${REPS:-3} --prepass-prologue > "$OUT/wan_step.log" 2>&1
    echo "wan rc $? at ${SECONDS} s"
)
grep -E "^\| |^speedup|^check|^thw|compile failed|_compiled|Error" "$OUT/wan_step.log" | cut -c1-200 | head -30
mkdir -p /tmp/s26db  # the DBs outside $OUT: the device tool returns at most 8 files of it
export TILEGEN_DB=/tmp/s26db/tuning.sqlite
start=$SECONDS
timeout ${TUNE_LIMIT:-150} python3 -m tilegen.cli tune --backend cuda --sampler grid \
    --trials 144 --seeds 2 --export tuning_db/winners.json \
    --summary "$OUT/summary_default.json" > "$OUT/tune_default.log" 2>&1
echo "tune default: rc $? in $((SECONDS - start)) s"
grep -E "^winner|^trials|merged" "$OUT/tune_default.log" | cut -c1-200
cp tuning_db/winners.json "$OUT/winners.json"
left=$((CALL_LIMIT - SECONDS - 10))
echo "bench limit ${left} s"
start=$SECONDS
timeout "$left" python3 -m tilegen.cli bench --sweep --backends cuda,gluon --no-dense --no-flex \
    --json "$OUT/bench_sweep.json" --plot "$OUT/bench_sweep.png" > "$OUT/bench_sweep.log" 2>&1
echo "bench: rc $? in $((SECONDS - start)) s"; tail -n 45 "$OUT/bench_sweep.log" | cut -c1-230
