"""Issue #19, session 39: the recipe with Q.K in e4m3 instead of INT8 (CPU, the emulation only).
An e4m3 S comes out of QGMMA as fp32, so the kernel would drop its 72 I2FP a tile (15% of the
loop's instructions). The question here is only the accuracy: the quantized rule on the default
workload's synthesized captures (4 heads, the outlier among them), e4m3 Q and K with the INT8
recipe's smoothing and scale groups (one scale a query token, one a 32-key group, amax / 448),
e4m3 V and the linear P as shipped; the INT8 recipe beside it.

    python3 bench/experiments/e4m3_qk_recipe.py [--seeds 0,1]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from tilegen import captures, quant
from tilegen.reference import attention_fp32
from tilegen.spec import Spec


def e4m3_qk(qi: quant.QuantizedInputs, q, k, vbs, q_smooth: bool = False,
            block: int = 64) -> quant.QuantizedInputs:
    """qi with Q and K in e4m3 (as fp32 values): the same smoothing and scale groups as INT8,
    each scale amax / 448."""
    B, S, H, D = q.shape
    n = S // block
    real = (torch.arange(block)[None, :] < vbs[:, None].long()).reshape(1, n, block, 1, 1)
    qf = q.float().view(B, n, block, H, D)
    q_mean = None
    if q_smooth:
        q_mean = torch.where(real, qf, 0.0).sum(2) / vbs.view(1, n, 1, 1).float()
        qf = qf - q_mean[:, :, None]
    qs = torch.where(real, qf, 0.0)
    ks = torch.where(real, k.float().view(B, n, block, H, D) - qi.k_mean[:, None, None], 0.0)
    top = quant.E4M3_MAX
    q_scale = qs.abs().amax(-1) / top
    g = quant.K_SCALE_GROUP
    groups = ks.view(B, n, block // g, g, H, D)
    k_scale = (groups.abs().amax(dim=(3, 5), keepdim=True) / top).expand(
        -1, -1, -1, g, -1, -1).reshape(B, n, block, H)

    def to_e4m3(x, scale):
        inv = 1.0 / torch.where(scale > 0, scale, 1.0)
        return (x * inv[..., None]).clamp(-top, top).to(torch.float8_e4m3fn).float()

    def per_head(scale):
        return scale.reshape(B, S, H).permute(0, 2, 1).contiguous()

    return dataclasses.replace(
        qi, q8=to_e4m3(qs, q_scale).view(B, S, H, D), q_scale=per_head(q_scale),
        k8=to_e4m3(ks, k_scale).view(B, S, H, D), k_scale=per_head(k_scale),
        q_mean=None if q_mean is None else q_mean.permute(0, 2, 1, 3).contiguous())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1")
    args = ap.parse_args()
    spec = Spec(quant="none", num_heads=4)
    for seed in (int(x) for x in args.seeds.split(",")):
        cap = captures.synthesize_for(spec, seed=seed)
        q, k, v, idx, vbs = (cap[n] for n in ("q", "k", "v", "topk_idx", "vbs"))
        o32, _ = attention_fp32(q, k, v, idx, vbs)
        ref = o32.to(q.dtype)
        qi = quant.quantize_torch(q, k, v, vbs, "int8_fp8")
        rows = {"int8 Q.K (shipped)": qi, "e4m3 Q.K": e4m3_qk(qi, q, k, vbs),
                "e4m3 Q.K, Q smoothed": e4m3_qk(qi, q, k, vbs, q_smooth=True)}
        for label, inputs in rows.items():
            t0 = time.perf_counter()
            o = quant.emulate(q, k, v, idx, vbs, quantized=inputs, p_exp="linear")
            s = captures.quant_score(o, ref, vbs=vbs)
            print(f"seed {seed} {label:22s} {s}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
