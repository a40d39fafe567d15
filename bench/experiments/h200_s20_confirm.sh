#!/usr/bin/env bash
# Session 20: the consolidated kernels as users load them. (1) The 8-bit op,
# `tilegen.load(Spec(quant="int8_fp8"))` (now the CUDA kernel with 128-key tiles), checked on
# every small case and the outlier head, then timed at TOPK 78, 31 and 187 beside the bf16
# default op and the Gluon 8-bit op (h200_quant_op.py --backend cuda). (2) The bf16 kernel with
# three consumers a CTA: small checks, the default workload and the sweep beside the default
# (h200_s17_wgmma.py).
#   OUT=/some/dir TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/h200_s20_confirm.sh
# (cubins prebuilt on a CPU: h200_quant_op.py --backend cuda --prebuild;
#  h200_s17_wgmma.py --prebuild --only default,three_k2v1,three_k2v1_d64)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/s20}
mkdir -p "$OUT"
source bench/experiments/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm --format=csv,noheader
timeout "${Q8_LIMIT:-300}" python3 bench/experiments/h200_quant_op.py --backend cuda \
    --topks "${TOPKS:-78,31,187}" --out "$OUT/q8_op.json" > "$OUT/q8_op.log" 2>&1
echo "8-bit rc $?"; grep -A40 "^checks passed" "$OUT/q8_op.log" | cut -c1-300
timeout "${BF16_LIMIT:-240}" python3 bench/experiments/h200_s17_wgmma.py \
    --only "${BF16_ONLY:-default,three_k2v1,three_k2v1_d64}" --seeds 1 --sweep \
    --out "$OUT/bf16.json" > "$OUT/bf16.log" 2>&1
echo "bf16 rc $?"; tail -30 "$OUT/bf16.log"
