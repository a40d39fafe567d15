#!/usr/bin/env bash
# Session 34 (issue #19), one device call (session 34's own call measured overlap_prepass on an
# H100 with gpu_s34_overlap.py and s34_overlap_prepass.patch: slower, not landed).
#   On an H200:
#   1. the 8-bit tune over gpu_s32_space.sh's space (one or two consumers, the linear P),
#      exported to tuning_db/winners.json and copied out;
#   2. `tilegen bench --sweep --backends cuda` with that winner (the issue's figure).
#   On another card: gpu_s33_run.sh's S-ahead probes (PROBES=1: gpu_s32_probes.py --set 3,
#   s33_s_ahead.patch applied there only).
# At most 8 files under $OUT. Before the call, on the CPU machine:
#   bash bench/experiments/gpu_s33_prepare.sh
# Then: carry .kcache .whl;  CALL_LIMIT=540 OUT=$OUT bash bench/experiments/gpu_s34_run.sh
set -uo pipefail
OUT=${OUT:-out/s34_run}
mkdir -p "$OUT"
CALL_LIMIT=${CALL_LIMIT:-540}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
if [[ "$gpu" != *H200* ]]; then
    PROBES=1 CALL_LIMIT=$CALL_LIMIT OUT="$OUT" exec bash bench/experiments/gpu_s33_run.sh
fi
echo "GPU: $gpu"
source bench/experiments/gpu_env.sh
export TILEGEN_CACHE_DIR=$PWD/.kcache
source bench/experiments/gpu_s32_space.sh
mkdir -p /tmp/s34db
export TILEGEN_DB=/tmp/s34db/tuning.sqlite
left=$((CALL_LIMIT - SECONDS))
start=$SECONDS
timeout "$((left > 350 ? 220 : left - 120))" python3 -m tilegen.cli tune \
    --spec bench/specs/int8_fp8.toml --backend cuda "${SPACE[@]}" --sampler grid \
    --trials 20 --seeds 2 --export tuning_db/winners.json > "$OUT/tune_int8_fp8.log" 2>&1
echo "tune int8_fp8: rc $? in $((SECONDS - start)) s"
grep -E "^winner|^trials|^speedup|merged" "$OUT/tune_int8_fp8.log" | cut -c1-220
sed -n '/^rank/,/^$/p' "$OUT/tune_int8_fp8.log" | cut -c1-40,170-240 | head -24
cp tuning_db/winners.json "$OUT/winners.json"
left=$((CALL_LIMIT - SECONDS))
if ((left > 40)); then
    start=$SECONDS
    timeout -k 10 "$((left > 130 ? 120 : left - 10))" python3 -m tilegen.cli bench \
        --sweep --backends cuda --no-dense --no-flex --json "$OUT/bench_sweep.json" \
        --plot "$OUT/bench_sweep.png" > "$OUT/bench_sweep.log" 2>&1
    echo "bench: rc $? in $((SECONDS - start)) s"
    grep -E "│ seed|^bench finished" "$OUT/bench_sweep.log" | cut -c1-200
fi
