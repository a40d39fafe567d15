#!/usr/bin/env bash
# Session 36 (issue #19), one device call.
#   On an H200: gpu_s34_run.sh (the 8-bit tune over gpu_s32_space.sh's space, exported to
#   tuning_db/winners.json and copied out; `tilegen bench --sweep --backends cuda`: the issue's
#   figure), within TUNE_LIMIT seconds.
#   Then, on any card with time left, probes with their patch applied on the device only:
#   PROBE_SET=4, the load probes (s36_load_probes.patch: how much of the kernel's time its K/V
#   bytes set, run 1); PROBE_SET=5 (the default), mbarrier waits with a suspend-time hint
#   (s36_wait_hint.patch), at one and two consumers and on the dynamic schedule; PROBE_SET=6,
#   session 37's codes under P V's last part and the sat code (s37_probes.patch); PROBE_SET=7,
#   session 38's producer copies over four warps (s38_split_producer.patch); PROBE_SET=8,
#   session 39's linear-P shift moved only on need (s39_stale_shift.patch). The patch is
#   reverted after, so that what follows (gpu_s37_run.sh's Nsight run) sees the landed code.
# At most 8 files under $OUT. Before the call, on the CPU machine:
#   bash bench/experiments/gpu_s36_prepare.sh
# Then: carry .kcache .whl;  CALL_LIMIT=540 OUT=$OUT bash bench/experiments/gpu_s36_run.sh
# (ONLY_H200=1: the H200's tune and sweep, nothing on another card)
set -uo pipefail
OUT=${OUT:-out/s36_run}
mkdir -p "$OUT"
CALL_LIMIT=${CALL_LIMIT:-540}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "GPU: $gpu"
if [[ "$gpu" == *H200* ]]; then
    CALL_LIMIT=${TUNE_LIMIT:-400} OUT="$OUT" bash bench/experiments/gpu_s34_run.sh
fi
# ONLY_H200=1: nothing more (the probes ran on an H100 in run 1)
[[ "${ONLY_H200:-0}" == 1 ]] && exit 0
source bench/experiments/gpu_env.sh
left=$((CALL_LIMIT - SECONDS))
# PROBE_SET 4: the load probes (run 1); 5 (default): the wait hint; 6: session 37's probes;
# 7: session 38's split producer; 8: session 39's stale shift
PROBE_SET=${PROBE_SET:-5}
case "$PROBE_SET" in
    4) patch_file=bench/experiments/s36_load_probes.patch ;;
    6) patch_file=bench/experiments/s37_probes.patch ;;
    7) patch_file=bench/experiments/s38_split_producer.patch ;;
    8) patch_file=bench/experiments/s39_stale_shift.patch ;;
    *) patch_file=bench/experiments/s36_wait_hint.patch ;;
esac
if ((left > 100)); then
    git apply "$patch_file" 2>/dev/null || patch -p1 < "$patch_file"
    export TILEGEN_CACHE_DIR=$PWD/.kcache
    timeout $((left - 10)) python3 bench/experiments/gpu_s32_probes.py --set "$PROBE_SET" \
        --seeds 0 --out /tmp/probes.json > "$OUT/probes$PROBE_SET.log" 2>&1
    echo "probes (set $PROBE_SET): rc $? at $SECONDS s"
    sed -n '/^bf16 default op:/,$p' "$OUT/probes$PROBE_SET.log"
    grep -E "rel_l1 .* passed" "$OUT/probes$PROBE_SET.log" | cut -c1-200
    git apply -R "$patch_file" 2>/dev/null || patch -R -p1 < "$patch_file"
fi
