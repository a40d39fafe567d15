"""Question (issue #19): does the Triton pre-pass (`tilegen.quant.quantize_triton`) give its
PyTorch model's values on the GPU (e4m3 V included, which the CPU interpreter cannot check), and
what does it cost at the default workload beside the bf16 kernel it would feed?

    PYTHONPATH=$PWD python3 bench/experiments/h200_quant_prepass.py --out $OUT/prepass.json

Also scores the emulation fed by the GPU pre-pass (the kernel's inputs exactly) on one
synthesized capture per seed, padded rows left out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from triton.testing import do_bench

from tilegen import captures, quant
from tilegen.ops import block_sparse_attention
from tilegen.reference import attention_fp32
from tilegen.spec import Spec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="prepass.json")
    ap.add_argument("--seeds", type=int, default=1)
    args = ap.parse_args()
    spec, dev = Spec(), "cuda"
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    cap = captures.synthesize(seed=0, grid=spec.grid, heads=spec.num_heads,
                              head_dim=spec.head_dim, topk=spec.topk)
    q, k, v = (cap[n].to(dev) for n in "qkv")
    idx, vbs = cap["topk_idx"].to(dev), cap["vbs"].to(dev)
    for mode in ("int8", "int8_fp8"):
        got = quant.quantize_triton(q, k, v, vbs, mode)
        want = quant.quantize_torch(q, k, v, vbs, mode)
        row: dict = {}
        for name in ("q8", "k8"):
            d = (getattr(got, name).int() - getattr(want, name).int()).abs()
            row[name] = {"max_diff": int(d.max()), "frac_diff": float((d > 0).float().mean())}
        for name in ("q_scale", "k_scale", "q_mean", "k_mean", "v_scale", "v_mean"):
            a, b = getattr(got, name), getattr(want, name)
            if a is not None:
                row[name] = float(((a - b).abs() / b.abs().clamp_min(1e-30)).max())
        if mode == "int8_fp8":
            a, b = got.v8t.float(), want.v8t.float()
            same = a == b
            row["v8t_equal_frac"] = float(same.float().mean())
            # where they differ: by at most one e4m3 step (the fp32 mean's summation order)
            rel = ((a - b).abs() / b.abs().clamp_min(2 ** -9))[~same]
            row["v8t_max_rel_where_differs"] = float(rel.max()) if rel.numel() else 0.0
        row["prepass_ms"] = do_bench(lambda m=mode: quant.quantize(q, k, v, vbs, m),
                                     warmup=25, rep=200)
        out["rows"][mode] = row
        print(mode, row, flush=True)
    out["bf16_op_ms"] = do_bench(lambda: block_sparse_attention(q, k, v, idx, vbs),
                                 warmup=25, rep=200)
    moved = sum(t.numel() * t.element_size() for t in (q, k, v))
    out["qkv_gb"] = moved / 1e9
    print("bf16 op", out["bf16_op_ms"], flush=True)
    # the emulation fed by the GPU pre-pass, on 4 heads (the emulation runs on the CPU)
    for seed in range(args.seeds):
        c = captures.synthesize(seed=seed, grid=spec.grid, heads=4, head_dim=spec.head_dim,
                                topk=spec.topk)
        call = (c["q"], c["k"], c["v"], c["topk_idx"], c["vbs"])
        o32, _ = attention_fp32(*call)
        for mode in ("int8", "int8_fp8"):
            qi = quant.quantize(*(c[n].to(dev) for n in "qkv"), c["vbs"].to(dev), mode)
            qi_cpu = type(qi)(**{f: (getattr(qi, f).cpu() if isinstance(getattr(qi, f),
                                 torch.Tensor) else getattr(qi, f))
                                 for f in qi.__dataclass_fields__})
            o = quant.emulate(*call, mode=mode, quantized=qi_cpu)
            s = captures.quant_score(o, o32.to(torch.bfloat16), o, o32, vbs=c["vbs"])
            out[f"emulation_gpu_prepass_seed{seed}_{mode}"] = str(s)
            print(seed, mode, s, flush=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out["rows"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
