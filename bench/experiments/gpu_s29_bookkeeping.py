"""Issue #19, session 29: the 8-bit kernel's consumer loop with less bookkeeping (wgmma
descriptors from an address word, one add an MMA; the halves' fills stored by the producer in
the K stage, so a consumer reads no plan), against session 28's kernel, and the bulk copies of
session 28 against the TMA boxes, in one process (what session 28's gpu_s28_bulk.py was to
measure, which this replaces).

Run with bench/experiments/s29_bookkeeping.patch applied (gpu_s29_run.sh says how). Session
28's kernel is then this checkout's source with its two changed headers (sm90/wgmma.cuh,
sm90/lut_attention_8bit.cuh) replaced by session 28's (`--old-headers`, a directory holding
them, not committed: `git show 564b599:templates/cuda/include/tilegen/cuda/sm90/<name>`), under
its own cache key. Per config: o and lse of the user's call must be bit-equal across the four
kernels (the same bytes and the same arithmetic), then all are timed in rounds, as the user's
call (``op(q, k, v, topk_idx, vbs)``, pre-pass included) and as kernel + plan
(`from_quantized`).

    PYTHONPATH=$PWD TILEGEN_CACHE_DIR=$PWD/.kcache \
        python3 bench/experiments/gpu_s29_bookkeeping.py --old-headers .s28_headers \
        --out $OUT/bookkeeping.json                   (on the GPU; --prebuild: compile here)

The table is printed last; the rows are also in the JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch
from gpu_s27_probe import with_headers  # this directory: the scripts run by path

import tilegen
from tilegen import captures
from tilegen.backends.cuda import wgmma
from tilegen.spec import Spec

HEADERS = ("tilegen/cuda/sm90/wgmma.cuh", "tilegen/cuda/sm90/lut_attention_8bit.cuh")
BASE = dict(wgmma.QUANT_DEFAULTS)
#: config label -> wgmma knobs
CONFIGS: dict[str, dict] = {
    "1c K2 V3 (H200 winner)": {**BASE, "k_stages": 2, "v_stages": 3},
    "1c K3 V2 (default)": BASE,
    "2c K2 V1": {**BASE, "consumers": 2, "k_stages": 2, "v_stages": 1},
    "3c K2 V1 kv64": {**BASE, "consumers": 3, "k_stages": 2, "v_stages": 1, "kv_tile": 64},
}
COPIES = ("tma", "bulk")
KERNELS = ("s28", "s29")


def variants():
    for label, knobs in CONFIGS.items():
        for copies in COPIES:
            for kernel in KERNELS:
                yield label, copies, kernel, wgmma.config(**knobs, kv_copies=copies)


def old_source(run, old_headers: Path):
    """`run`'s source with session 28's headers, and its own digest."""
    def swap(headers: dict) -> None:
        for name in HEADERS:
            if name not in headers:
                raise RuntimeError(f"{name} is not among the kernel's headers")
            headers[name] = (old_headers / Path(name).name).read_bytes()

    source = with_headers(run.source, swap)
    return source, hashlib.sha256(f"{run.digest}|kernel:s28".encode()).hexdigest()


def load(spec: Spec, cfg, kernel: str, old_headers: Path):
    op = tilegen.load(spec, cfg, backend="cuda", target="sm_90")
    if kernel == "s28":
        for lse in (True, False):
            run = op._launch_for(lse)
            run.source, run.digest = old_source(run, old_headers)
    return op


def prebuild(old_headers: Path) -> None:
    from tilegen.backends.cuda.nvcc import compile_cuda
    from tilegen.targets import get_target

    target = get_target("sm_90")
    spec = Spec(quant="int8_fp8")
    for label, copies, kernel, cfg in variants():
        op = load(spec, cfg, kernel, old_headers)
        for lse in (True, False):
            run = op._launch_for(lse)
            art = compile_cuda(run.source, target, None, run.digest)
        print(f"prebuilt {label} {copies} {kernel}: {art.registers} registers, spills "
              f"{art.spill_bytes}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bookkeeping.json")
    ap.add_argument("--old-headers", type=Path, default=Path(".s28_headers"))
    ap.add_argument("--prebuild", action="store_true")
    ap.add_argument("--reps", type=int, default=3, help="rounds over all variants")
    args = ap.parse_args()
    if args.prebuild:
        prebuild(args.old_headers)
        return 0
    from triton.testing import do_bench

    spec = Spec(quant="int8_fp8")
    cap = captures.synthesize_for(spec.replace(quant="none"), seed=0, device="cuda")
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "tilegen": tilegen.__version__, "rows": [], "equal": {}}
    ops = {(label, copies, kernel): load(spec, cfg, kernel, args.old_headers)
           for label, copies, kernel, cfg in variants()}
    quantized = {key: op.quantize(q, k, v, vbs) for key, op in ops.items()}
    for label in CONFIGS:
        ref_o, ref_lse = ops[(label, "tma", "s28")](q, k, v, idx, vbs)
        for copies in COPIES:
            for kernel in KERNELS:
                o, lse = ops[(label, copies, kernel)](q, k, v, idx, vbs)
                same = bool(torch.equal(o, ref_o) and torch.equal(lse, ref_lse))
                res["equal"][f"{label} {copies} {kernel}"] = same
                print(f"{label} {copies} {kernel}: o and lse bit-equal to tma s28's: {same}; "
                      f"o finite: {bool(torch.isfinite(o).all())}", flush=True)
    times = {key: {"op": [], "kernel": []} for key in ops}
    t0 = time.perf_counter()
    for rnd in range(args.reps):
        for key, op in ops.items():
            qi = quantized[key]
            t_op = do_bench(lambda op=op: op(q, k, v, idx, vbs, return_lse=False), rep=300)
            t_k = do_bench(lambda op=op, qi=qi: op.from_quantized(qi, idx, vbs, return_lse=False),
                           rep=300)
            times[key]["op"].append(t_op)
            times[key]["kernel"].append(t_k)
            print(f"round {rnd} {' '.join(key)}: op {t_op:.3f} ms, kernel + plan {t_k:.3f}",
                  flush=True)
    for (label, copies, kernel), t in times.items():
        ref = times[(label, "tma", "s28")]
        res["rows"].append({"config": label, "copies": copies, "kernel": kernel,
                            "op_ms": t["op"], "kernel_plan_ms": t["kernel"],
                            "best_op_ms": min(t["op"]), "best_kernel_plan_ms": min(t["kernel"]),
                            "op_vs_ref": min(t["op"]) / min(ref["op"]),
                            "kernel_vs_ref": min(t["kernel"]) / min(ref["kernel"])})
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"\n{res['device']}, {time.perf_counter() - t0:.0f} s, TOPK {spec.topk}, "
          f"{spec.num_heads} heads, best of {args.reps}; ref: tma copies, session 28's kernel")
    for name, same in res["equal"].items():
        print(f"{name}: bit-equal to the ref: {same}")
    print("| config | copies | kernel | op ms | kernel + plan ms | op vs ref | kernel vs ref |")
    print("|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['config']} | {r['copies']} | {r['kernel']} | {r['best_op_ms']:.3f} | "
              f"{r['best_kernel_plan_ms']:.3f} | {r['op_vs_ref']:.3f} | "
              f"{r['kernel_vs_ref']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
