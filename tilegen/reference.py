"""fp32 PyTorch reference for block-sparse attention (the oracle the kernels are checked against).

Computes, per (batch, head, query cube), softmax(q @ k_sel^T * sm_scale) @ v_sel over the KV
cubes the LUT names, attending only the first vbs[c] tokens of cube c, in fp32, chunked so the
full Wan2.2 workload fits in memory. Returns (o, lse) with lse in base-2 units like the kernels.
"""

from __future__ import annotations

import math

import torch

LOG2E = 1.4426950408889634


def to_bhsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x if layout == "bhsd" else x.transpose(1, 2)


def attention_fp32(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk_idx: torch.Tensor,
    vbs: torch.Tensor | None,
    counts: torch.Tensor | None = None,
    *,
    layout: str = "bshd",
    block: int = 64,
    sm_scale: float | None = None,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention in fp32. Inputs are not validated (the op does that).

    Returns ``o`` (fp32, same layout and shape as ``q``) and ``lse`` (fp32, (B, H, S), base 2:
    natural log-sum-exp of the scaled logits times log2 e). ``vbs=None`` means every cube is
    full. Rows with ``counts == 0`` give o = 0 and lse = -inf.
    """
    qh, kh, vh = (to_bhsd(t, layout) for t in (q, k, v))
    B, H, S, D = qh.shape
    nq = S // block
    nkv = kh.shape[2] // block
    topk = topk_idx.shape[-1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    dev = q.device
    token = torch.arange(block, device=dev)
    if vbs is None:
        key_valid = torch.ones(nkv, block, dtype=torch.bool, device=dev)
    else:
        key_valid = token[None, :] < vbs.to(dev).long()[:, None]  # (NKV, block)
    o = torch.empty(B, H, S, D, dtype=torch.float32, device=dev)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=dev)
    slot = torch.arange(topk, device=dev)
    for b in range(B):
        for h in range(H):
            qc = qh[b, h].float().reshape(nq, block, D)
            kc = kh[b, h].float().reshape(nkv, block, D)
            vc = vh[b, h].float().reshape(nkv, block, D)
            for c0 in range(0, nq, chunk):
                idx = topk_idx[b, h, c0:c0 + chunk].long()  # (c, TOPK)
                c = idx.shape[0]
                ks = kc[idx].reshape(c, topk * block, D)
                vs = vc[idx].reshape(c, topk * block, D)
                valid = key_valid[idx]  # (c, TOPK, block)
                if counts is not None:
                    used = slot[None, :] < counts[b, h, c0:c0 + chunk].long()[:, None]
                    valid = valid & used[:, :, None]
                valid = valid.reshape(c, 1, topk * block)
                s = torch.matmul(qc[c0:c0 + c], ks.transpose(1, 2)) * scale
                s = s.masked_fill(~valid, float("-inf"))
                row_lse = torch.logsumexp(s, dim=-1)  # natural units
                empty = torch.isinf(row_lse) & (row_lse < 0)
                p = torch.exp(s - torch.where(empty, 0.0, row_lse)[..., None])
                out = torch.matmul(p, vs)
                out[empty] = 0.0
                o[b, h, c0 * block:(c0 + c) * block] = out.reshape(c * block, D)
                lse[b, h, c0 * block:(c0 + c) * block] = (row_lse * LOG2E).reshape(c * block)
    if layout == "bshd":
        o = o.transpose(1, 2).contiguous()
    return o, lse
