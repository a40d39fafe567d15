#!/usr/bin/env bash
# Issue #19 (prepared in session 36, not yet run): where the 8-bit kernel's consumer waits,
# instruction by instruction. Sessions 33 and 35 profiled it by section (issue ~50% of cycles,
# top stall "wait"); the load probes of session 36 put ~94% of the kernel on the consumer's
# chain. Nsight Compute's SourceCounters sample each warp's PC and state: this collects them
# for one launch of the landed 1c K2 V3 linear kernel (TOPK 78; `gpu_s32_bits.py --ncu`, its
# third launch) and of the 2c K2 V2 linear one, writes the source page (SASS) as CSV and prints
# ncu_source_summary.py's reading. Any card (the H100's chain is the same code).
# Before the call, here: bash bench/experiments/gpu_s36_prepare.sh (the cubins).
# Then: carry .kcache .whl;  OUT=$OUT bash bench/experiments/gpu_s37_ncu_source.sh
set -uo pipefail
OUT=${OUT:-out/s37_ncu}
mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "GPU: $gpu"
source bench/experiments/gpu_env.sh
export TILEGEN_CACHE_DIR=$PWD/.kcache
n=0
for L in "1c K2 V3 linear" "2c K2 V2 linear"; do
    n=$((n + 1))
    timeout 200 ncu --clock-control none -k regex:int8_fp8_bm64 --launch-skip 2 --launch-count 1 \
        --section SourceCounters --section WarpStateStats --page source --print-source sass \
        --csv python3 bench/experiments/gpu_s32_bits.py --ncu "$L" \
        > "$OUT/ncu_source_$n.csv" 2> /tmp/ncu_source_$n.err
    echo "== ncu source $n ($L): rc $? at $SECONDS s"
    tail -3 /tmp/ncu_source_$n.err
    python3 bench/experiments/ncu_source_summary.py "$OUT/ncu_source_$n.csv" | head -80
done
