#!/usr/bin/env bash
# Prepared in session 27, not run (issue #19): the next device call's probes. On any Hopper,
# `gpu_s27_probe.py --set bulk` (K8's and V^T's halves as 4 KB bulk copies, o checked bit-equal
# to the shipped kernel's, then timed beside it and beside the load-free probe); on an H200 also
# `--set parts` (runs 2-3 measured it on H100s only). About 30 s a set; cubins in .kcache.
#   carry .kcache .whl;  OUT=$OUT bash bench/experiments/gpu_s27_next.sh
set -uo pipefail
OUT=${OUT:-out/s27_next}
mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "GPU: $gpu"
source bench/experiments/gpu_env.sh
export TILEGEN_CACHE_DIR=${TILEGEN_CACHE_DIR:-$PWD/.kcache}
sets=bulk
if [[ "$gpu" == *H200* ]]; then sets="bulk parts"; fi
for s in $sets; do
    start=$SECONDS
    timeout 150 python3 bench/experiments/gpu_s27_probe.py --set "$s" --reps 3 \
        --out "$OUT/probe_$s.json" > "$OUT/probe_$s.log" 2>&1
    echo "$s: rc $? in $((SECONDS - start)) s"
    grep "bit-equal" "$OUT/probe_$s.log" | sort -u
    sed -n '/^| /p' "$OUT/probe_$s.log"
done
