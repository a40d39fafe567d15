#!/usr/bin/env bash
# Session 27 (issue #19), one device call: the softmax probes of the 8-bit kernel
# (gpu_s27_probe.py: valid on any Hopper, so they run first), then, on an H200 only, the
# int8_fp8 CUDA kernel tuned there (its shipped winner is stale since session 23; the winner is
# merged into tuning_db/winners.json and copied to $OUT) and `tilegen bench --sweep` with it.
# At most 8 files under $OUT (the device tool returns no more); the DB and summary in /tmp.
#   carry .kcache .whl;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s27_run.sh
set -uo pipefail
OUT=${OUT:-out/s27}
mkdir -p "$OUT"
CALL_LIMIT=${CALL_LIMIT:-570}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "GPU: $gpu"
source bench/experiments/gpu_env.sh
mkdir -p /tmp/s27db
export TILEGEN_DB=/tmp/s27db/tuning.sqlite
start=$SECONDS
timeout 120 python3 bench/experiments/gpu_s27_probe.py --out "$OUT/probe.json" > "$OUT/probe.log" 2>&1
echo "probe: rc $? in $((SECONDS - start)) s"
sed -n '/^| config/,$p' "$OUT/probe.log"
if [[ "$gpu" != *H200* ]]; then exit 0; fi
left=$((CALL_LIMIT - SECONDS))
if ((left > 300)); then
    start=$SECONDS
    timeout "$((left - 60))" python3 -m tilegen.cli tune --spec bench/specs/int8_fp8.toml \
        --backend cuda --sampler grid --trials 144 --seeds 2 --export tuning_db/winners.json \
        --summary /tmp/s27db/summary_int8_fp8.json > "$OUT/tune_int8_fp8.log" 2>&1
    echo "tune int8_fp8: rc $? in $((SECONDS - start)) s"
    grep -E "^winner|^trials|merged" "$OUT/tune_int8_fp8.log" | cut -c1-200
    cp tuning_db/winners.json "$OUT/winners.json"
fi
left=$((CALL_LIMIT - SECONDS))
start=$SECONDS
timeout "$((left > 150 ? 150 : left))" python3 -m tilegen.cli bench --sweep \
    --backends cuda,gluon --no-dense --no-flex \
    --json "$OUT/bench_sweep.json" --plot "$OUT/bench_sweep.png" > "$OUT/bench_sweep.log" 2>&1
echo "bench: rc $? in $((SECONDS - start)) s"
grep -E "│ seed|^bench finished" "$OUT/bench_sweep.log" | cut -c1-200
