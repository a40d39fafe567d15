#!/usr/bin/env bash
# Session 26, the last device minutes (H200 only; any other GPU: exit at once): the shipped
# default beside the Gluon winner at TOPK 78 on two captures (seeds 0 and 1), then the same at
# 12 heads (issue #20: "does not lose ... on a 12-head model").
#   carry .kcache .whl;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s26_h200_short.sh
set -uo pipefail
OUT=${OUT:-out/s26_short}
mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "GPU: $gpu"
if [[ "$gpu" != *H200* ]]; then exit 0; fi
source bench/experiments/gpu_env.sh
for run in "t78_seeds2:--seeds 2" "h12:--heads 12"; do
    label=${run%%:*}
    start=$SECONDS
    timeout ${BENCH_LIMIT:-90} python3 -m tilegen.cli bench --topk 78 ${run#*:} --backends cuda,gluon \
        --no-dense --no-flex --json "$OUT/bench_$label.json" > "$OUT/bench_$label.log" 2>&1
    echo "bench $label: rc $? in $((SECONDS - start)) s"; grep -E "│ seed" "$OUT/bench_$label.log" | cut -c1-200
done
