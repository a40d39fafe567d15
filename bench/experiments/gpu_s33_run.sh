#!/usr/bin/env bash
# Session 33 (issue #19), one device call. On an H200: the pre-pass against the card's copy
# rate (gpu_s33_prepass.py), then session 32's call (gpu_s32_run.sh: the check, the tune
# over the linear P, the small checks, the sweep). On another
# card nothing, or with TOPK31_TUNE=1 the tune of the TOPK-31 workload
# (bench/specs/int8_fp8_topk31.toml; run 4), or with NCU=1 Nsight Compute on the ex2 and the
# linear P kernels (run 5). Run 2 was the H100's pre-pass probe, run 3 one and
# two consumers at TOPK 31 and 187 (`gpu_s32_bits.py --topk`).
# With PROBES=1, last and on any card: the S-ahead probes (gpu_s32_probes.py --set 3 with
# s33_s_ahead.patch applied on the device only).
# Before the call, on the CPU machine: bash bench/experiments/gpu_s33_prepare.sh.
# Then: carry .kcache .whl;  CALL_LIMIT=540 OUT=$OUT bash bench/experiments/gpu_s33_run.sh
set -uo pipefail
OUT=${OUT:-out/s33_run}
mkdir -p "$OUT"
CALL_LIMIT=${CALL_LIMIT:-540}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
source bench/experiments/gpu_env.sh
if [[ "$gpu" == *H200* ]]; then
    timeout 120 python3 bench/experiments/gpu_s33_prepass.py --out /tmp/prepass.json \
        > /tmp/prepass.log 2>&1
    echo "prepass: rc $? in $SECONDS s"
    sed -n '/moves/,$p' /tmp/prepass.log
    # without the padded-rows fix: a linear-P winner has finite padded rows already, and the
    # fix would make the H100's winners stale
    CALL_LIMIT=$((CALL_LIMIT - SECONDS)) OUT="$OUT" bash bench/experiments/gpu_s32_run.sh
elif [[ "${TOPK31_TUNE:-0}" == 1 ]]; then
    # another card, asked for (run 4): the H100's own 8-bit winner at TOPK 31 (run 3: one
    # consumer 5% ahead of two there, level at 78 and 187, where the TOPK-78 tune's pick is noise)
    echo "GPU: $gpu"
    source bench/experiments/gpu_s32_space.sh
    export TILEGEN_CACHE_DIR=$PWD/.kcache TILEGEN_DB=/tmp/s33db/tuning.sqlite
    mkdir -p /tmp/s33db
    timeout 300 python3 -m tilegen.cli tune --spec bench/specs/int8_fp8_topk31.toml \
        --backend cuda "${SPACE[@]}" --sampler grid --trials 12 --seeds 2 \
        --export tuning_db/winners.json > "$OUT/tune_topk31.log" 2>&1
    echo "tune int8_fp8 TOPK 31: rc $? at $SECONDS s"
    grep -E "^winner|^trials|merged" "$OUT/tune_topk31.log" | cut -c1-220
    sed -n '/^rank/,/^$/p' "$OUT/tune_topk31.log" | cut -c1-40,170-230
    cp tuning_db/winners.json "$OUT/winners.json"
elif [[ "${NCU:-0}" == 1 ]]; then
    # another card, asked for (run 5): Nsight Compute on one launch of the ex2 and the linear P
    # kernel (the H200 winner's config): pipes, warp states, scheduler
    echo "GPU: $gpu"
    export TILEGEN_CACHE_DIR=$PWD/.kcache
    n=0
    for L in "1c K2 V3" "1c K2 V3 linear" "2c K2 V2 linear"; do
        n=$((n + 1))
        timeout 150 ncu --clock-control none -k regex:int8_fp8_bm64 --launch-skip 2 \
            --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
            --section InstructionStats --section WarpStateStats --section SchedulerStats \
            --section Occupancy --section MemoryWorkloadAnalysis \
            --metrics smsp__inst_executed.sum,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active \
            --page raw --csv python3 bench/experiments/gpu_s32_bits.py --ncu "$L" \
            > "$OUT/ncu_$n.csv" 2> /tmp/ncu_$n.err
        echo "== ncu $n ($L) rc $? at $SECONDS s"; tail -3 /tmp/ncu_$n.err
        python3 bench/experiments/h200_s19_q8_cvt.py --ncu-summary "$OUT/ncu_$n.csv" \
            | grep -v "\.max \|\.min \|\.sum \[" \
            | grep -E "pipe_.*pct_of_peak_sustained_active|pipe_.*cycles_active.avg.pct|warp_issue_stalled.*per_warp_active|issue_active.*pct|gpu__time_duration.sum|inst_executed.sum|cycles_elapsed.avg.per_second|tensor" \
            | grep -v "^smsp__pcsamp" | head -60
    done
else
    echo "GPU: $gpu: not an H200 (TOPK31_TUNE=1: the TOPK-31 tune; NCU=1: profiles)"
fi
if [[ "${PROBES:-0}" == 1 ]]; then
    # on any card, last: the S-ahead probes (s33_s_ahead.patch, applied here only; their
    # cubins from gpu_s33_prepare.sh), checked and timed beside the landed loop
    left=$((CALL_LIMIT - SECONDS))
    if ((left > 90)); then
        git apply bench/experiments/s33_s_ahead.patch 2>/dev/null \
            || patch -p1 < bench/experiments/s33_s_ahead.patch
        export TILEGEN_CACHE_DIR=$PWD/.kcache
        timeout $((left - 10)) python3 bench/experiments/gpu_s32_probes.py --set 3 \
            --out /tmp/probes3.json > "$OUT/probes3.log" 2>&1
        echo "probes (set 3): rc $? at $SECONDS s"
        sed -n '/^bf16 default op:/,$p' "$OUT/probes3.log"
        grep -E "rel_l1 .* passed" "$OUT/probes3.log" | cut -c1-200
    fi
fi
