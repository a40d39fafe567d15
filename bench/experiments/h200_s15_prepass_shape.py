"""Issue #19, session 15: the 8-bit pre-pass (`tilegen.quant.quantize_triton`) split into one
tensor a program and ``tokens`` tokens a program. Offline (sm_90, 4 warps) one cube of all
three tensors took 255 registers with spills; 32 tokens of one tensor 216, 16 tokens 127.
Each shape's outputs must equal the 64-token, 4-warp shape's bit for bit (the arithmetic per
token is the same); then each is timed on the default workload (TOPK 78 capture, seed 0).

    PYTHONPATH=$PWD python3 bench/experiments/h200_s15_prepass_shape.py \
        --out $OUT/prepass_shape.json

The table is printed last.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from triton.testing import do_bench

from tilegen import captures, quant
from tilegen.spec import Spec

# (tokens, warps): run 2 measured the first seven (8 tokens gave wrong values and is refused
# since); run 6 the fewer-warp ones
SHAPES = [(64, 4), (64, 2), (64, 1), (32, 2), (32, 1), (16, 2), (16, 1)]


def _differ(a: quant.QuantizedInputs, b: quant.QuantizedInputs) -> dict:
    """The fields that differ, with how many values (a field both leave out, such as Q's
    without it, is not compared; one side's alone counts as differing)."""
    out = {}
    for f in ("q8", "q_scale", "k8", "k_scale", "k_mean", "v8t", "v_scale", "v_mean"):
        x, y = getattr(a, f), getattr(b, f)
        if x is None or y is None:
            if x is not y:
                out[f] = -1
            continue
        if x.dtype == torch.float8_e4m3fn:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        if not torch.equal(x, y):
            out[f] = int((x != y).sum())
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="prepass_shape.json")
    args = ap.parse_args()
    spec = Spec()
    cap = captures.synthesize(seed=0, grid=spec.grid, heads=spec.num_heads,
                              head_dim=spec.head_dim, topk=spec.topk)
    q, k, v = (cap[n].to("cuda") for n in "qkv")
    vbs = cap["vbs"].to("cuda")
    base = quant.quantize_triton(q, k, v, vbs, "int8_fp8", tokens=64, num_warps=4)
    model = quant.quantize_torch(q, k, v, vbs, "int8_fp8")  # the PyTorch model, on the GPU
    vs_model = _differ(base, model)
    print("the 64-token pre-pass against its PyTorch model:", vs_model or "equal", flush=True)
    rows = []
    for tokens, warps in SHAPES:
        got = quant.quantize_triton(q, k, v, vbs, "int8_fp8", tokens=tokens, num_warps=warps)
        ms = do_bench(lambda t=tokens, w=warps: quant.quantize_triton(
            q, k, v, vbs, "int8_fp8", tokens=t, num_warps=w), warmup=50, rep=300)
        # K and V only: what the op runs (its kernel quantizes Q)
        ms_kv = do_bench(lambda t=tokens, w=warps: quant.quantize_triton(
            q, k, v, vbs, "int8_fp8", tokens=t, num_warps=w, with_q=False), warmup=50, rep=300)
        diff = _differ(got, base)
        rows.append({"tokens": tokens, "warps": warps, "equal": not diff, "differ": diff,
                     "ms": ms, "kv_ms": ms_kv})
        print(rows[-1], flush=True)
    ms_default = do_bench(lambda: quant.quantize(q, k, v, vbs, "int8_fp8", with_q=False),
                          warmup=50, rep=300)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
           "quantize_default_ms": ms_default, "against_model": vs_model}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("\ntokens warps  equal   ms  (K/V only)")
    for r in rows:
        print(f"{r['tokens']:6d} {r['warps']:5d}  {str(r['equal']):5s}  {r['ms']:.3f}  "
              f"{r['kv_ms']:.3f}  {r['differ'] or ''}")
    print(f"quant.quantize(with_q=False) (the op's pre-pass): {ms_default:.3f} ms")
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
