"""fp32 PyTorch reference for block-sparse attention (the oracle the kernels are checked against).

Computes, per (batch, head, query cube), softmax(q @ k_sel^T * sm_scale) @ v_sel over the KV
cubes the LUT names, attending only the first vbs[c] tokens of cube c, in fp32, chunked so the
full Wan2.2 workload fits in memory. Returns (o, lse) with lse in base-2 units like the kernels.

K and V may have their own length (cross-attention: the LUT names their cubes) and a head count
dividing q's (GQA/MQA: query head h reads KV head h // (H_q // H_kv)); the query cubes' real rows
are then ``q_vbs`` (`query_vbs`).
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
    max_prob: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Block-sparse attention in fp32. Inputs are not validated (the op does that).

    Returns ``o`` (fp32, same layout and shape as ``q``) and ``lse`` (fp32, (B, H, S), base 2:
    natural log-sum-exp of the scaled logits times log2 e). ``vbs=None`` means every cube is
    full. Rows with ``counts == 0`` give o = 0 and lse = -inf. With ``max_prob=True`` a third
    tensor: fp32 (B, H, S), each row's largest softmax weight ``exp(max_j s_ij - lse_i)`` (=
    1 / l_i of the kernels' online softmax), 0 for a row with no key.
    """
    qh, kh, vh = (to_bhsd(t, layout) for t in (q, k, v))
    B, H, S, D = qh.shape
    nq = S // block
    nkv = kh.shape[2] // block
    group = H // kh.shape[1]
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
    peak = torch.empty(B, H, S, dtype=torch.float32, device=dev) if max_prob else None
    slot = torch.arange(topk, device=dev)
    for b in range(B):
        for h in range(H):
            qc = qh[b, h].float().reshape(nq, block, D)
            kc = kh[b, h // group].float().reshape(nkv, block, D)
            vc = vh[b, h // group].float().reshape(nkv, block, D)
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
                if peak is not None:  # the largest weight of the row: p at its max logit
                    top = torch.where(empty, 0.0, torch.exp(s.amax(-1) - row_lse))
                    peak[b, h, c0 * block:(c0 + c) * block] = top.reshape(c * block)
    if layout == "bshd":
        o = o.transpose(1, 2).contiguous()
    return (o, lse, peak) if peak is not None else (o, lse)


def query_vbs(vbs: torch.Tensor | None, q_vbs: torch.Tensor | None, seq_len: int,
              kv_seq_len: int) -> torch.Tensor | None:
    """The query cubes' real rows: ``q_vbs`` when given, else ``vbs`` when q and k/v have one
    length, else None (every query row real)."""
    if q_vbs is not None:
        return q_vbs
    return vbs if seq_len == kv_seq_len else None


def query_valid(vbs: torch.Tensor | None, seq_len: int, block: int,
                device: torch.device) -> torch.Tensor:
    """(S,) bool: True for the real query tokens (the first vbs[c] of cube c's block slots)."""
    if vbs is None:
        return torch.ones(seq_len, dtype=torch.bool, device=device)
    token = torch.arange(block, device=device)
    return (token[None, :] < vbs.to(device).long()[:, None]).reshape(-1)[:seq_len]


def attention_grads_fp32(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk_idx: torch.Tensor,
    vbs: torch.Tensor | None,
    counts: torch.Tensor | None,
    do: torch.Tensor,
    dlse: torch.Tensor | None = None,
    *,
    layout: str = "bshd",
    block: int = 64,
    sm_scale: float | None = None,
    q_vbs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in fp32: PyTorch autograd through `attention_fp32` (the backward's oracle).

    ``do`` (like q) and ``dlse`` ((B, H, S), base-2 lse units, optional) are the incoming
    gradients. Padded query rows (past vbs of their cube) are masked in them first: they are not
    real outputs, so their garbage must not reach any real gradient (the kernels mask them
    too). Padded key slots get zero dk/dv through the forward's masking.
    """
    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    axis = 1 if layout == "bshd" else 2
    S = q.shape[axis]
    valid = query_valid(query_vbs(vbs, q_vbs, S, k.shape[axis]), S, block, q.device)
    mask = valid.view(1, S, 1, 1) if layout == "bshd" else valid.view(1, 1, S, 1)
    with torch.enable_grad():
        o, lse = attention_fp32(qf, kf, vf, topk_idx, vbs, counts, layout=layout, block=block,
                                sm_scale=sm_scale)
        outs, grads = [o], [torch.where(mask, do.float(), 0.0)]
        if dlse is not None:
            lse_ok = torch.isfinite(lse)  # rows that saw no key: lse = -inf, no gradient
            outs.append(torch.where(lse_ok, lse, 0.0))
            grads.append(torch.where(valid.view(1, 1, S) & lse_ok, dlse.float(), 0.0))
        dq, dk, dv = torch.autograd.grad(outs, (qf, kf, vf), grads, allow_unused=True)
    return tuple(torch.zeros_like(x) if g is None else g
                 for g, x in zip((dq, dk, dv), (qf, kf, vf), strict=True))


def attention_backward_fp32(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk_idx: torch.Tensor,
    vbs: torch.Tensor | None,
    counts: torch.Tensor | None,
    do: torch.Tensor,
    dlse: torch.Tensor | None = None,
    *,
    layout: str = "bshd",
    block: int = 64,
    sm_scale: float | None = None,
    chunk: int = 64,
    q_vbs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in fp32 by the explicit backward formulas (P, dP = dO V^T, delta = rowsum(P dP),
    dS = P (dP - delta), dq = dS K, dk = dS^T Q, dv = P^T dO), chunked like `attention_fp32`.

    The same function as `attention_grads_fp32` (which takes autograd through the forward) with
    no autograd: it runs inside a custom op's implementation (the CPU PyTorch path of the op's
    backward), where autograd does not record. Padded query rows of ``do``/``dlse`` are masked.
    """
    qh, kh, vh, doh = (to_bhsd(t, layout) for t in (q, k, v, do))
    B, H, S, D = qh.shape
    nq, nkv, topk = S // block, kh.shape[2] // block, topk_idx.shape[-1]
    group = H // kh.shape[1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    dev = q.device
    token = torch.arange(block, device=dev)
    key_valid = (torch.ones(nkv, block, dtype=torch.bool, device=dev) if vbs is None
                 else token[None, :] < vbs.to(dev).long()[:, None])
    qv = query_valid(query_vbs(vbs, q_vbs, S, kh.shape[2]), S, block, dev).reshape(nq, block)
    dq = torch.zeros(B, H, S, D, dtype=torch.float32, device=dev)
    dk = torch.zeros(kh.shape, dtype=torch.float32, device=dev)
    dv = torch.zeros(kh.shape, dtype=torch.float32, device=dev)
    slot = torch.arange(topk, device=dev)
    for b in range(B):
        for h in range(H):
            qc = qh[b, h].float().reshape(nq, block, D)
            kc = kh[b, h // group].float().reshape(nkv, block, D)
            vc = vh[b, h // group].float().reshape(nkv, block, D)
            dc = doh[b, h].float().reshape(nq, block, D)
            dkc = dk[b, h // group].view(nkv, block, D)  # GQA: summed over the group
            dvc = dv[b, h // group].view(nkv, block, D)
            for c0 in range(0, nq, chunk):
                idx = topk_idx[b, h, c0:c0 + chunk].long()
                c = idx.shape[0]
                ks = kc[idx].reshape(c, topk * block, D)
                vs = vc[idx].reshape(c, topk * block, D)
                valid = key_valid[idx]
                if counts is not None:
                    used = slot[None, :] < counts[b, h, c0:c0 + chunk].long()[:, None]
                    valid = valid & used[:, :, None]
                valid = valid.reshape(c, 1, topk * block)
                s = torch.matmul(qc[c0:c0 + c], ks.transpose(1, 2)) * scale
                s = s.masked_fill(~valid, float("-inf"))
                row_lse = torch.logsumexp(s, dim=-1)
                empty = torch.isinf(row_lse) & (row_lse < 0)
                p = torch.exp(s - torch.where(empty, 0.0, row_lse)[..., None])
                rows = qv[c0:c0 + c, :, None]
                g = torch.where(rows, dc[c0:c0 + c], 0.0)
                dp = torch.matmul(g, vs.transpose(1, 2))
                delta = (p * dp).sum(-1, keepdim=True)
                if dlse is not None:
                    dl = dlse[b, h, c0 * block:(c0 + c) * block].float().reshape(c, block, 1)
                    delta = delta - torch.where(rows & ~empty[..., None], dl, 0.0) * LOG2E
                ds = p * (dp - delta)
                dq[b, h, c0 * block:(c0 + c) * block] = (
                    torch.matmul(ds, ks) * scale).reshape(c * block, D)
                dks = (torch.matmul(ds.transpose(1, 2), qc[c0:c0 + c]) * scale)
                dvs = torch.matmul(p.transpose(1, 2), g)
                flat = idx.reshape(-1)
                dkc.index_add_(0, flat, dks.reshape(c * topk, block, D))
                dvc.index_add_(0, flat, dvs.reshape(c * topk, block, D))
    if layout == "bshd":
        dq, dk, dv = (t.transpose(1, 2).contiguous() for t in (dq, dk, dv))
    return dq, dk, dv
