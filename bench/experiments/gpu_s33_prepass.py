"""Issue #19, session 33: how far the 8-bit op's pre-pass (K and V only: `q_in_kernel`) sits from
the card's copy rate. The op spends ~0.5 ms outside kernel + plan (H100, session 33, run 1:
4.762 against 4.264 ms); the pass moves ~1.2 GB (K and V read as bf16 in the padded cube
layout, K8 and V^T written as bytes, the scales), so at the copy rate (3.0 TB/s on an H100,
~4.3 on an H200) it would take ~0.41 ms and ~0.29 ms.

Timed on the default workload (synthetic capture, seed 0), each in its own do_bench:
  * the op's pre-pass as the op calls it (`quant.quantize(..., with_q=False, **quant_layout)`),
    and the same with other program shapes (tokens, warps): bit-equal outputs required;
  * the ceiling: torch's casts of K to int8 and V to e4m3 (2 bytes read, 1 written an element,
    contiguous: what an elementwise kernel reaches on this card), and a plain copy of K and V.

    PYTHONPATH=$PWD python3 bench/experiments/gpu_s33_prepass.py --out $OUT/prepass.json

The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

from tilegen import captures, quant
from tilegen.backends.cuda.wgmma_op import quant_layout
from tilegen.spec import Spec

sys.path.insert(0, str(Path(__file__).parent))
from h200_s15_prepass_shape import _differ  # noqa: E402

SHAPES = [(32, 2), (32, 4), (64, 2), (64, 4)]  # (tokens, warps); (32, 2) is the default


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="prepass.json")
    args = ap.parse_args()
    spec = Spec()
    cap = captures.synthesize(seed=0, grid=spec.grid, heads=spec.num_heads,
                              head_dim=spec.head_dim, topk=spec.topk)
    q, k, v = (cap[n].to("cuda") for n in "qkv")
    vbs = cap["vbs"].to("cuda")
    layout = quant_layout(True)

    def pre(tokens=32, warps=2):
        return quant.quantize_triton(q, k, v, vbs, "int8_fp8", with_q=False, tokens=tokens,
                                     num_warps=warps, **layout)

    base = quant.quantize(q, k, v, vbs, "int8_fp8", with_q=False, **layout)
    moved = (_bytes(k) + _bytes(v) + sum(_bytes(getattr(base, f)) for f in
             ("k8", "k_scale", "k_mean", "v8t", "v_scale", "v_mean")))
    rows = []

    def row(name, fn, equal=None, nbytes=moved):
        ms = do_bench(fn, warmup=50, rep=400)
        rows.append({"name": name, "ms": ms, "tb_s": nbytes / ms / 1e9, "equal": equal})
        print(rows[-1], flush=True)

    row("op's pre-pass (quant.quantize)", lambda: quant.quantize(
        q, k, v, vbs, "int8_fp8", with_q=False, **layout), True)
    for tokens, warps in SHAPES:
        row(f"quantize_triton tokens {tokens} warps {warps}", lambda t=tokens, w=warps: pre(t, w),
            not _differ(pre(tokens, warps), base))
    k8 = torch.empty(k.shape, dtype=torch.int8, device="cuda")
    v8 = torch.empty(v.shape, dtype=torch.float8_e4m3fn, device="cuda")
    row("ceiling: K -> int8 and V -> e4m3 casts (torch)",
        lambda: (k8.copy_(k), v8.copy_(v)), nbytes=3 * _bytes(k))
    kc, vc = torch.empty_like(k), torch.empty_like(v)
    row("copy K and V (bf16 -> bf16)", lambda: (kc.copy_(k), vc.copy_(v)),
        nbytes=4 * _bytes(k))
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "bytes_moved": moved, "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\n{out['device']}: the pre-pass moves {moved / 1e9:.3f} GB "
          "(TB/s: the row's bytes over its time)")
    print("| what | ms | TB/s | outputs equal |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['ms']:.3f} | {r['tb_s']:.2f} | "
              f"{'' if r['equal'] is None else r['equal']} |")
    return 0 if all(r["equal"] is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
