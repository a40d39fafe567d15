#!/usr/bin/env bash
# Session 29 (issue #19), one device call:
#   1. gpu_s29_bookkeeping.py: the consumer loop with less bookkeeping (this checkout) against
#      session 28's kernel (.s28_headers), each with TMA boxes and bulk copies, at three
#      configs: o and lse bit-equal to session 28's boxes, then timed (user's call, kernel + plan);
#   2. the 8-bit kernel re-tuned on this card (its headers changed, so the shipped winner is
#      stale): one and two consumers, 128-key tiles, K ring 2-3, V ring 1-3, boxes and bulk
#      copies (20 points), merged into tuning_db/winners.json and copied to $OUT;
#   3. h200_quant_op.py --small-only with the bulk variant: the quantized rule with check 4;
#   4. on an H200, `tilegen bench --sweep` with that winner;
#   5. with the time left, gpu_s27_probe.py --set bulk (the two paths' lengths).
# At most 8 files under $OUT (the device tool returns no more).
#
# The kernel change is not in the product until a device has checked it (bit-equal o and lse)
# and re-tuned the 8-bit winner; it waits as bench/experiments/s29_bookkeeping.patch (session
# 29 found no device machine). Before the call, on the CPU machine, from a clean checkout:
#   bash bench/experiments/gpu_s29_prepare.sh   (the patch applied, .s28_headers, .whl, .kcache)
# Then: carry .kcache .whl;  CALL_LIMIT=540 OUT=$OUT bash bench/experiments/gpu_s29_run.sh
set -uo pipefail
OUT=${OUT:-out/s29_run}
mkdir -p "$OUT"
CALL_LIMIT=${CALL_LIMIT:-540}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "GPU: $gpu"
source bench/experiments/gpu_env.sh
export TILEGEN_CACHE_DIR=${TILEGEN_CACHE_DIR:-$PWD/.kcache}
mkdir -p /tmp/s29db
export TILEGEN_DB=/tmp/s29db/tuning.sqlite
start=$SECONDS
timeout 160 python3 bench/experiments/gpu_s29_bookkeeping.py --old-headers .s28_headers \
    --out "$OUT/bookkeeping.json" > "$OUT/bookkeeping.log" 2>&1
echo "bookkeeping: rc $? in $((SECONDS - start)) s"
sed -n '/bit-equal to the ref/p;/^| /p' "$OUT/bookkeeping.log"
finish() {
    local left=$((CALL_LIMIT - SECONDS))
    if ((left > 50)); then
        local start=$SECONDS
        timeout "$((left > 110 ? 100 : left - 10))" python3 bench/experiments/gpu_s27_probe.py \
            --set bulk --reps 3 --out /tmp/s29db/probe_bulk.json > /tmp/s29db/probe_bulk.log 2>&1
        echo "probe bulk: rc $? in $((SECONDS - start)) s"
        sed -n '/^| /p' /tmp/s29db/probe_bulk.log
    fi
}
trap finish EXIT
left=$((CALL_LIMIT - SECONDS))
if ((left > 120)); then
    start=$SECONDS
    timeout "$((left > 220 ? 160 : left - 60))" python3 -m tilegen.cli tune \
        --spec bench/specs/int8_fp8.toml --backend cuda --space kv_copies=tma,bulk \
        --space consumers=1,2 --space kv_tile=128 --space pingpong=false \
        --space persistent=false --sampler grid --trials 24 --seeds 2 \
        --export tuning_db/winners.json --summary /tmp/s29db/summary.json \
        > "$OUT/tune_int8_fp8.log" 2>&1
    echo "tune int8_fp8: rc $? in $((SECONDS - start)) s"
    grep -E "^winner|^trials|^speedup|merged" "$OUT/tune_int8_fp8.log" | cut -c1-200
    cp tuning_db/winners.json "$OUT/winners.json"
fi
left=$((CALL_LIMIT - SECONDS))
if ((left > 60)); then
    start=$SECONDS
    timeout "$((left > 160 ? 150 : left - 10))" python3 bench/experiments/h200_quant_op.py \
        --backend cuda --small-only --variants kv_copies=bulk --out /tmp/s29db/quant_op.json \
        > "$OUT/quant_op.log" 2>&1
    echo "quant_op (small, default and bulk): rc $? in $((SECONDS - start)) s"
    grep -E "^checks passed|FAIL" "$OUT/quant_op.log" | head -20
fi
if [[ "$gpu" != *H200* ]]; then exit 0; fi
left=$((CALL_LIMIT - SECONDS))
if ((left <= 40)); then exit 0; fi
start=$SECONDS
timeout -k 10 "$((left > 130 ? 120 : left - 10))" python3 -m tilegen.cli bench --sweep \
    --backends cuda,gluon --no-dense --no-flex --json "$OUT/bench_sweep.json" \
    --plot /tmp/s29db/bench_sweep.png > "$OUT/bench_sweep.log" 2>&1
echo "bench: rc $? in $((SECONDS - start)) s"
grep -E "│ seed|^bench finished" "$OUT/bench_sweep.log" | cut -c1-200
