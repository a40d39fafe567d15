"""Issue #19, session 28: the 8-bit kernel's K8 and V^T halves as 4 KB bulk copies in the
product (``kv_copies="bulk"``: the pre-pass writes K8 and V^T as tiles in the shared tile's byte
order, `tilegen.quant` k_tiles / vt_tiles), against the TMA boxes (``"tma"``), config by config.

Per config, both copies: o and lse of the user's call (``op(q, k, v, topk_idx, vbs)``, the
pre-pass included) must be bit-equal between the two (the same bytes reach shared memory), then
both are timed in rounds, as the user's call and as kernel + plan (`from_quantized`).

    PYTHONPATH=$PWD TILEGEN_CACHE_DIR=$PWD/.kcache python3 bench/experiments/gpu_s28_bulk.py \
        --out $OUT/bulk.json                       (on the GPU; --prebuild: compile here)

The table is printed last; the rows are also in the JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import tilegen
from tilegen import captures
from tilegen.backends.cuda import wgmma
from tilegen.spec import Spec

BASE = dict(wgmma.QUANT_DEFAULTS)
#: config label -> wgmma knobs (the copies added per row)
CONFIGS: dict[str, dict] = {
    "1c K3 V2 (default)": BASE,
    "1c K2 V3 (H200 winner)": {**BASE, "k_stages": 2, "v_stages": 3},
    "1c K2 V2": {**BASE, "k_stages": 2, "v_stages": 2},
    "2c K2 V1": {**BASE, "consumers": 2, "k_stages": 2, "v_stages": 1},
    "3c K2 V1 kv64": {**BASE, "consumers": 3, "k_stages": 2, "v_stages": 1, "kv_tile": 64},
}
COPIES = ("tma", "bulk")


def variants():
    for label, knobs in CONFIGS.items():
        for copies in COPIES:
            yield label, copies, wgmma.config(**knobs, kv_copies=copies)


def prebuild() -> None:
    from tilegen.backends.cuda.nvcc import compile_cuda
    from tilegen.targets import get_target

    target = get_target("sm_90")
    spec = Spec(quant="int8_fp8")
    for label, copies, cfg in variants():
        op = tilegen.load(spec, cfg, backend="cuda", target="sm_90")
        for lse in (True, False):
            run = op._launch_for(lse)
            art = compile_cuda(run.source, target, None, run.digest)
        print(f"prebuilt {label} {copies}: spills {art.spill_bytes}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bulk.json")
    ap.add_argument("--prebuild", action="store_true")
    ap.add_argument("--reps", type=int, default=3, help="rounds over all variants")
    args = ap.parse_args()
    if args.prebuild:
        prebuild()
        return 0
    from triton.testing import do_bench

    spec = Spec(quant="int8_fp8")
    cap = captures.synthesize_for(spec.replace(quant="none"), seed=0, device="cuda")
    q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "tilegen": tilegen.__version__, "rows": [], "equal": {}}
    ops = {(label, copies): tilegen.load(spec, cfg, backend="cuda")
           for label, copies, cfg in variants()}
    quantized = {key: op.quantize(q, k, v, vbs) for key, op in ops.items()}
    for label in CONFIGS:
        o_t, lse_t = ops[(label, "tma")](q, k, v, idx, vbs)
        o_b, lse_b = ops[(label, "bulk")](q, k, v, idx, vbs)
        same = bool(torch.equal(o_t, o_b) and torch.equal(lse_t, lse_b))
        res["equal"][label] = same
        print(f"{label}: bulk o and lse bit-equal to tma's: {same}; o finite: "
              f"{bool(torch.isfinite(o_b).all())}", flush=True)
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
            print(f"round {rnd} {key[0]} {key[1]}: op {t_op:.3f} ms, kernel + plan {t_k:.3f}",
                  flush=True)
    for (label, copies), t in times.items():
        base = times[(label, "tma")]
        res["rows"].append({"config": label, "copies": copies, "op_ms": t["op"],
                            "kernel_plan_ms": t["kernel"], "best_op_ms": min(t["op"]),
                            "best_kernel_plan_ms": min(t["kernel"]),
                            "op_vs_tma": min(t["op"]) / min(base["op"]),
                            "kernel_vs_tma": min(t["kernel"]) / min(base["kernel"])})
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"\n{res['device']}, {time.perf_counter() - t0:.0f} s, TOPK {spec.topk}, "
          f"{spec.num_heads} heads, best of {args.reps}")
    for label, same in res["equal"].items():
        print(f"{label}: bulk bit-equal to tma: {same}")
    print("| config | copies | op ms | kernel + plan ms | op vs tma | kernel vs tma |")
    print("|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['config']} | {r['copies']} | {r['best_op_ms']:.3f} | "
              f"{r['best_kernel_plan_ms']:.3f} | {r['op_vs_tma']:.3f} | "
              f"{r['kernel_vs_tma']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
