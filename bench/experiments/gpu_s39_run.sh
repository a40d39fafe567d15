#!/usr/bin/env bash
# Session 39 (issue #19), one device call.
#   On an H200: gpu_s36_run.sh's tune and sweep (ONLY_H200=1: the 8-bit tune exported to
#   tuning_db/winners.json and copied out, then `tilegen bench --sweep`: the issue's figure),
#   within TUNE_LIMIT seconds.
#   Then, on any card with time left: the padded-row fix's check on a GPU (the 8-bit scales'
#   floor at 2^-60, landed in session 38 without one): h200_quant_op.py's small cases, which
#   require every row of o finite, padded rows included, with the H200 winner's ex2 P (K2 V3)
#   and the linear P. With PROBE_SET on another card: gpu_s36_run.sh's probes instead (set 8,
#   session 39's stale shift). On an H200, the SM clock and board power are sampled every 0.5 s
#   through the tune and sweep into clocks.csv.
# At most 8 files under $OUT. Before the call, on the CPU machine:
#   bash bench/experiments/gpu_s39_prepare.sh
# Then: carry .kcache .whl;  [ONLY_H200=1] CALL_LIMIT=560 OUT=$OUT bash bench/experiments/gpu_s39_run.sh
set -uo pipefail
S39_SMALL="q_in_kernel=1,kv_copies=bulk,k_stages=2,v_stages=3;q_in_kernel=1,kv_copies=bulk,p_exp=linear,row_sum=mma"
OUT=${OUT:-out/s39_run}
mkdir -p "$OUT"
CALL_LIMIT=${CALL_LIMIT:-560}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "GPU: $gpu"
# ONLY_H200=1: nothing at all on another card (the call then costs only the machine's start)
[[ "${ONLY_H200:-0}" == 1 && "$gpu" != *H200* ]] && exit 0
if [[ "$gpu" == *H200* ]]; then
    # the SM clock and board power through the tune and sweep (session 40: is the H200's 8-bit
    # kernel, issue-bound, held at a lower clock than the H100's?), and the card's limits
    nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,power.max_limit --format=csv
    echo "clocks.csv from $(date -u +%T) UTC (the tune, then the sweep: their logs give seconds)"
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu \
        --format=csv -lms 500 > "$OUT/clocks.csv" 2>&1 &
    smi=$!
    ONLY_H200=1 TUNE_LIMIT=${TUNE_LIMIT:-400} CALL_LIMIT="$CALL_LIMIT" OUT="$OUT" \
        bash bench/experiments/gpu_s36_run.sh
    kill "$smi" 2>/dev/null
fi
if [[ "$gpu" != *H200* && -n "${PROBE_SET:-}" ]]; then
    # another card: gpu_s36_run.sh's probes (PROBE_SET=8: s39_stale_shift.patch), no checks
    PROBE_SET=$PROBE_SET CALL_LIMIT="$CALL_LIMIT" OUT="$OUT" exec bash bench/experiments/gpu_s36_run.sh
fi
source bench/experiments/gpu_env.sh
export TILEGEN_CACHE_DIR=$PWD/.kcache
left=$((CALL_LIMIT - SECONDS))
if ((left > 60)); then
    start=$SECONDS
    timeout $((left - 10)) python3 bench/experiments/h200_quant_op.py --backend cuda \
        --small-only --variants "$S39_SMALL" --out "$OUT/quant_small.json" \
        > "$OUT/quant_small.log" 2>&1
    echo "small checks: rc $? in $((SECONDS - start)) s"
    sed -n '/^checks passed/,$p' "$OUT/quant_small.log" | cut -c1-220
fi
