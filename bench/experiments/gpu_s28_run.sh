#!/usr/bin/env bash
# Session 28 (issue #19), one device call:
#   1. gpu_s28_bulk.py: the product's bulk copies (kv_copies "bulk") against the TMA boxes at
#      five configs, o and lse checked bit-equal, then timed (user's call and kernel + plan);
#      then h200_quant_op.py --small-only with the bulk variant (the quantized rule, check 4);
#   2. on an H200, where the bulk copies' one-consumer op is at least 2% faster than the
#      boxes': the int8_fp8 kernel tuned over the bulk configs of one and two consumers,
#      128-key tiles, no ping-pong or persistence (the family of every 8-bit winner so far;
#      12 points, to fit the session's device time; merged into
#      tuning_db/winners.json, copied to $OUT) and `tilegen bench --sweep` with the winner;
#   3. with the time left, gpu_s27_probe.py --set bulk (bare / no_loads / bare_no_loads on the
#      bulk config beside the boxes': the two paths' lengths), then on an H200 --set parts
#      (session 27 ran it on H100s only).
# At most 8 files under $OUT (the device tool returns no more): the probes' JSON stays in /tmp.
#   carry .kcache .whl;  OUT=$OUT bash bench/experiments/gpu_s28_run.sh
set -uo pipefail
OUT=${OUT:-out/s28_run}
mkdir -p "$OUT"
CALL_LIMIT=${CALL_LIMIT:-560}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "GPU: $gpu"
source bench/experiments/gpu_env.sh
export TILEGEN_CACHE_DIR=${TILEGEN_CACHE_DIR:-$PWD/.kcache}
mkdir -p /tmp/s28db
export TILEGEN_DB=/tmp/s28db/tuning.sqlite
start=$SECONDS
timeout 200 python3 bench/experiments/gpu_s28_bulk.py --out "$OUT/bulk.json" \
    > /tmp/s28db/bulk.log 2>&1
echo "bulk: rc $? in $((SECONDS - start)) s"
sed -n '/bit-equal to tma/p;/^| /p' /tmp/s28db/bulk.log
# the bulk op under the quantized rule with check 4 at small shapes: every encoding the CUDA
# kernel takes, partial cubes, counts, a bad index, the outlier head
start=$SECONDS
timeout 150 python3 bench/experiments/h200_quant_op.py --backend cuda --small-only \
    --variants kv_copies=bulk --out /tmp/s28db/quant_op.json > "$OUT/quant_op.log" 2>&1
echo "quant_op (small, bulk variant): rc $? in $((SECONDS - start)) s"
grep -E "^checks passed|FAIL" "$OUT/quant_op.log" | head -20
probe() {
    local start=$SECONDS
    timeout "$2" python3 bench/experiments/gpu_s27_probe.py --set "$1" --reps 3 \
        --out "/tmp/s28db/probe_$1.json" > "$OUT/probe_$1.log" 2>&1
    echo "probe $1: rc $? in $((SECONDS - start)) s"
    sed -n '/^| /p' "$OUT/probe_$1.log"
}
# what is left of the call after the tune and sweep: the probes (parts on an H200 only)
finish() {
    local left=$((CALL_LIMIT - SECONDS))
    if ((left > 50)); then probe bulk $((left > 100 ? 100 : left - 5)); fi
    left=$((CALL_LIMIT - SECONDS))
    if [[ "$gpu" == *H200* ]] && ((left > 70)); then probe parts $((left - 10)); fi
}
trap finish EXIT
if [[ "$gpu" != *H200* ]]; then exit 0; fi
gain=$(python3 -c "
import json
rows = json.load(open('$OUT/bulk.json'))['rows']
r = [x for x in rows if x['config'].startswith('1c K3 V2') and x['copies'] == 'bulk'][0]
print(int(r['op_vs_tma'] <= 0.98))" 2>/dev/null || echo 0)
echo "bulk 1c op at least 2% faster: $gain"
if [[ "$gain" != 1 ]]; then exit 0; fi
left=$((CALL_LIMIT - SECONDS))
if ((left > 180)); then
    start=$SECONDS
    timeout "$((left - 120))" python3 -m tilegen.cli tune --spec bench/specs/int8_fp8.toml \
        --backend cuda --space kv_copies=bulk --space consumers=1,2 --space kv_tile=128 \
        --space pingpong=false --space persistent=false --sampler grid --trials 12 --seeds 2 \
        --export tuning_db/winners.json --summary /tmp/s28db/summary.json \
        > "$OUT/tune_int8_fp8.log" 2>&1
    echo "tune int8_fp8: rc $? in $((SECONDS - start)) s"
    grep -E "^winner|^trials|merged" "$OUT/tune_int8_fp8.log" | cut -c1-200
    cp tuning_db/winners.json "$OUT/winners.json"
fi
left=$((CALL_LIMIT - SECONDS))
if ((left <= 30)); then exit 0; fi
start=$SECONDS
timeout -k 10 "$((left > 150 ? 150 : left - 10))" python3 -m tilegen.cli bench --sweep \
    --backends cuda,gluon --no-dense --no-flex --json "$OUT/bench_sweep.json" \
    --plot /tmp/s28db/bench_sweep.png > "$OUT/bench_sweep.log" 2>&1
echo "bench: rc $? in $((SECONDS - start)) s"
grep -E "│ seed|^bench finished" "$OUT/bench_sweep.log" | cut -c1-200
