"""Question (issue #22, item 3): do FastVideo's three calls (`tilegen.integrations.fastvideo`)
give the fp32 reference's outputs and gradients on the GPU (BHSD: the Triton family's kernels,
which the Gluon family hands BHSD calls to), with garbage in the padded slots?

    PYTHONPATH=$PWD python3 bench/experiments/h200_fastvideo_smoke.py
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch

from tilegen.integrations import fastvideo as fv


def main() -> int:
    dev = "cuda"
    B, H, NB, D = 1, 4, 24, 128
    S = NB * 64
    g = torch.Generator(device=dev).manual_seed(0)
    vbs = torch.tensor([64, 64, 32, 64, 16, 64, 8, 64] * 3, dtype=torch.int32, device=dev)
    real = (torch.arange(64, device=dev)[None, :] < vbs[:, None]).reshape(1, 1, S, 1)
    xs = [torch.where(real, torch.randn(B, H, S, D, generator=g, device=dev),
                      5 * torch.randn(B, H, S, D, generator=g, device=dev)).bfloat16()
          for _ in range(4)]
    q, k, v = (x.requires_grad_(True) for x in xs[:3])
    do = torch.where(real, xs[3], 0)
    topk = 6
    idx = torch.stack([torch.randperm(NB, generator=g, device=dev)[:topk]
                       for _ in range(B * H * NB)]).view(B, H, NB, topk).int()
    num = torch.randint(1, topk + 1, (B, H, NB), generator=g, device=dev).int()
    allowed = torch.zeros(B, H, NB, NB, dtype=torch.bool, device=dev)
    keep = torch.arange(topk, device=dev) < num[..., None]
    allowed.scatter_(-1, torch.where(keep, idx, idx[..., :1]).long(), True)
    out: dict = {"device": torch.cuda.get_device_name()}

    def reference(allow):
        qr, kr, vr = (t.detach().float().requires_grad_(True) for t in (q, k, v))
        key_real = real.reshape(S)
        mask = allow.repeat_interleave(64, 2).repeat_interleave(64, 3) & key_real
        s = (qr @ kr.transpose(-2, -1) / math.sqrt(D)).masked_fill(~mask, float("-inf"))
        o = torch.softmax(s, -1) @ vr
        return o, torch.autograd.grad(o, (qr, kr, vr), do.float())

    def err(a, b):
        m = real.expand_as(a)
        return float((a.float()[m] - b.float()[m]).abs().max() / b.float()[m].abs().max())

    for name, call in (("from_indices", lambda: fv.block_sparse_attn_from_indices(
            q, k, v, idx, num, vbs)), ("block_map", lambda: fv.block_sparse_attn(
            q, k, v, allowed, vbs))):
        o, m = call()
        grads = torch.autograd.grad(o, (q, k, v), do)
        o_ref, ref_grads = reference(allowed)
        out[name] = {"o": err(o, o_ref), **{f"d{n}": err(gr, r) for n, gr, r in
                                            zip("qkv", grads, ref_grads, strict=True)},
                     "finite": bool(torch.isfinite(o).all())}
        print(name, json.dumps(out[name]), flush=True)
    o = fv.video_sparse_attn(q, k, v, vbs, vbs, topk)
    grads = torch.autograd.grad(o, (q, k, v), do)
    out["video_sparse_attn"] = {"finite": bool(torch.isfinite(o).all()) and all(
        bool(torch.isfinite(gr).all()) for gr in grads)}
    ok = all(max(r[x] for x in ("o", "dq", "dk", "dv")) < 2e-2 and r["finite"]
             for r in (out["from_indices"], out["block_map"])) and out["video_sparse_attn"][
        "finite"]
    out["passed"] = ok
    path = Path(os.environ.get("OUT", "out")) / "h200_fastvideo_smoke.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
