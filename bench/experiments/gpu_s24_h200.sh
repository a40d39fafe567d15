#!/usr/bin/env bash
# Session 24: the H200 measurements of the open issues, on an H200 only (any other GPU: exit 0
# at once). WHAT=wan: issue #22's step (gpu_s24_run1.sh: the selection checks, then the
# compiled Wan step, REPS repetitions); WHAT=ship: issues #20/#19 (gpu_s21_ship.sh: the CUDA
# bf16 default tuned and merged, then `tilegen bench --sweep --backends cuda,gluon`).
#   carry .kcache .whl .whl_wan;  WHAT=wan OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s24_h200.sh
set -uo pipefail
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
if [[ "$gpu" != *H200* ]]; then echo "not an H200: $gpu"; exit 0; fi
case "${WHAT:-wan}" in
    wan) bash bench/experiments/gpu_s24_run1.sh ;;
    ship) H200_ONLY=1 TUNE_8BIT=${TUNE_8BIT:-0} bash bench/experiments/gpu_s21_ship.sh ;;
esac
