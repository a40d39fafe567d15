#!/usr/bin/env bash
# Session 22, device runs 6 and 7 (issue #22; #20, #19 on an H200; run 6 stopped at the
# diffusers import, fixed for run 7): the model's own q, k, v of three layers
# against random ones, the 8-bit layer's parts alone, and each row's KV cubes in another order
# (gpu_s22_wan_layer.py), with the SM clocks sampled; on an H200 then the CUDA family tuned for
# the bf16 default and the sweep (gpu_s21_ship.sh, TUNE_8BIT=0).
#   carry .kcache .whl .whl_wan;  OUT=$OUT TILEGEN_CACHE_DIR=$PWD/.kcache bash bench/experiments/gpu_s22_run5.sh
set -uo pipefail
OUT=${OUT:-out/s22_run5}
mkdir -p "$OUT"
source bench/experiments/gpu_env.sh
if ! python3 -c "import diffusers" 2>/dev/null; then  # as gpu_s21_wan.sh
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/wan .whl_wan/diffusers-*.whl
    export PYTHONPATH=/tmp/wan:$PYTHONPATH
    if ! python3 -c "import diffusers.models" 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/wan .whl_wan/huggingface_hub-*.whl
    fi
fi
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "$gpu"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 250 \
    > "$OUT/clocks.csv" 2>&1 &
smi=$!
SECONDS=0
timeout 200 python3 bench/experiments/gpu_s22_wan_layer.py --out "$OUT/wan_layer.json" \
    > "$OUT/wan_layer.log" 2>&1
echo "wan layer rc $? in ${SECONDS} s"; grep -E "^captured|^\| |^layer|^random|^default" "$OUT/wan_layer.log" | cut -c1-400
kill $smi
python3 - "$OUT/clocks.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))[1:]
mhz = [int(r[1].split()[0]) for r in rows if len(r) > 2 and r[1].strip()[0].isdigit()]
w = [float(r[2].split()[0]) for r in rows if len(r) > 2 and r[2].strip()[0].isdigit()]
busy = [m for m in mhz if m > 400] or [0]
print(f"clocks: {len(mhz)} samples, busy {len(busy)}: min {min(busy)} median {sorted(busy)[len(busy)//2]} max {max(busy)} MHz; power max {max(w or [0]):.0f} W")
PY
if [[ "$gpu" == *H200* ]]; then
    TUNE_8BIT=0 bash bench/experiments/gpu_s21_ship.sh
fi
