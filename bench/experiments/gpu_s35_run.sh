#!/usr/bin/env bash
# Session 35 (issue #19), one device call. On any card, first: the fixed-cost probe
# (gpu_s35_fixed.py: the 8-bit op's pass, plan and kernel at TOPK 2, 8 and 78, the persistent
# grid's static and dynamic schedules, each checked with the quantized rule). Then on an H200:
# the 8-bit tune (gpu_s35_space.sh: SPACE_DYN where the probe found the dynamic schedule
# passing and ahead at TOPK 78, else gpu_s32_space.sh's SPACE), exported to
# tuning_db/winners.json and copied out, and `tilegen bench --sweep --backends cuda` with it.
# At most 8 files under $OUT. Before the call, on the CPU machine:
#   bash bench/experiments/gpu_s35_prepare.sh
# Then: carry .kcache .whl;  CALL_LIMIT=540 OUT=$OUT bash bench/experiments/gpu_s35_run.sh
# (SKIP_PROBE=1 CALL_LIMIT=400 ...: the H200's tune and sweep only)
set -uo pipefail
OUT=${OUT:-out/s35_run}
mkdir -p "$OUT"
CALL_LIMIT=${CALL_LIMIT:-540}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "GPU: $gpu"
source bench/experiments/gpu_env.sh
export TILEGEN_CACHE_DIR=$PWD/.kcache
# SKIP_PROBE=1: no probe (it ran on an H100 in runs 3-4), and nothing on another card
if [[ "${SKIP_PROBE:-0}" != 1 ]]; then
    start=$SECONDS
    timeout 170 python3 bench/experiments/gpu_s35_fixed.py --out "$OUT/fixed.json" \
        > "$OUT/fixed.log" 2>&1
    echo "fixed-cost probe: rc $? in $((SECONDS - start)) s"
    grep -E "^check|^\||, torch|^dynamic verdict" "$OUT/fixed.log"
    tail -3 "$OUT/fixed.log" | grep -v "^dynamic verdict\|^|"
fi
[[ "$gpu" == *H200* ]] || exit 0
source bench/experiments/gpu_s35_space.sh
if grep -qs "^dynamic verdict: passed True ahead_at_78 True" "$OUT/fixed.log"; then
    space=("${SPACE_DYN[@]}"); trials=22
else
    space=("${SPACE[@]}"); trials=12
fi
echo "tune space: ${space[*]}"
mkdir -p /tmp/s35db
export TILEGEN_DB=/tmp/s35db/tuning.sqlite
left=$((CALL_LIMIT - SECONDS))
start=$SECONDS
timeout "$((left > 350 ? 220 : left - 130))" python3 -m tilegen.cli tune \
    --spec bench/specs/int8_fp8.toml --backend cuda "${space[@]}" --sampler grid \
    --trials "$trials" --seeds 2 --export tuning_db/winners.json > "$OUT/tune_int8_fp8.log" 2>&1
echo "tune int8_fp8: rc $? in $((SECONDS - start)) s"
grep -E "^winner|^trials|^speedup|merged" "$OUT/tune_int8_fp8.log" | cut -c1-240
sed -n '/^rank/,/^$/p' "$OUT/tune_int8_fp8.log" | cut -c1-40,170-250 | head -26
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
