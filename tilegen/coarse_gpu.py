"""GPU kernels of the coarse stage's selection (`sparsity.mean_pool_topk`): cube pooling and
per-row top-k, each one Triton launch (the torch version is a dozen small launches, and on the
H200 the launches, not the bytes, set its time: 1.5 ms against a 0.2 ms byte floor).

* `pool_means`: the mean of each cube over its real tokens, (B, S, H, D) -> (B, H, NC, D)
  fp32, one program per (cube, batch*head): the sum in fp32, rounded once to the input dtype,
  then divided by vbs in fp32 (`sparsity.pool_cubes`' arithmetic, up to fp32 summation order).
* `row_topk_ids`: one single-warp program per row finds the k-th largest score by bisection
  on its order-preserving int32 bits (32 steps of a count), takes the scores above it and the
  lowest ids among those equal to it, and compacts the ids in id order: `torch.topk`'s
  selection with lowest-id tie-breaking, already ascending (a full sort of the row in Triton
  measured 1.4 ms, twice torch.topk).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pool_kernel(X, VBS, OUT, seq_len, num_heads, nc, HEAD_DIM: tl.constexpr,
                 BLOCK: tl.constexpr):
    cube = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // num_heads
    h = bh % num_heads
    rows = tl.arange(0, BLOCK)
    d = tl.arange(0, HEAD_DIM)
    n = tl.load(VBS + cube)
    ok = (n >= 1) & (n <= BLOCK)
    tok = cube * BLOCK + rows
    x = tl.load(X + ((b * seq_len + tok) * num_heads + h)[:, None] * HEAD_DIM + d[None, :],
                mask=(rows < n)[:, None], other=0.0)
    total = tl.sum(x.to(tl.float32), 0).to(X.dtype.element_ty).to(tl.float32)
    mean = total / tl.where(ok, n, 1).to(tl.float32)
    mean = tl.where(ok, mean, float("nan"))
    tl.store(OUT + (bh * nc + cube) * HEAD_DIM + d, mean)


def pool_means(x: torch.Tensor, vbs: torch.Tensor, block: int = 64) -> torch.Tensor:
    """(B, S, H, D) BSHD -> (B, H, NC, D) fp32 cube means over the first vbs[c] tokens (NaN for
    a vbs outside 1..block); GPU tensors only (`sparsity.pool_cubes` is the general form)."""
    b, s, h, d = x.shape
    nc = s // block
    x = x.contiguous()
    out = torch.empty((b, h, nc, d), dtype=torch.float32, device=x.device)
    _pool_kernel[(nc, b * h)](x, vbs, out, s, h, nc, HEAD_DIM=d, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _row_topk_kernel(SCORES, OUT, n_cols, k, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    live = col < n_cols
    s = tl.load(SCORES + row * n_cols + col, mask=live, other=float("-inf"))
    bits = s.to(tl.int32, bitcast=True)
    # fp32 bits -> an int32 that orders like the float (negative floats flip their magnitude)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    key = tl.where(live, key, -(2 ** 40))  # below every real key
    # the k-th largest key by bisection: the largest t with count(key >= t) >= k
    lo = tl.full([], -(2 ** 31), tl.int64)
    hi = tl.full([], 2 ** 31 - 1, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        enough = tl.sum((key >= mid).to(tl.int32), 0) >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    above = key > lo
    # ties at the threshold: the lowest ids fill what the keys above leave
    tie = (key == lo) & live
    need = k - tl.sum(above.to(tl.int32), 0)
    take = above | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= need))
    pos = tl.cumsum(take.to(tl.int32), 0) - 1
    tl.store(OUT + row * k + pos, col, mask=take)


def row_topk_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``(..., N)`` fp32 scores -> ``(..., k)`` int32 ids of each row's k largest, ascending by
    id (ties: lower id first). GPU tensors run the Triton kernel; CPU tensors use torch.topk
    with the same tie rule."""
    n = scores.shape[-1]
    if scores.device.type == "meta":  # shapes only (the no-sync checks run on meta tensors)
        return torch.empty((*scores.shape[:-1], k), dtype=torch.int32, device="meta")
    if scores.device.type == "cpu":
        # stable descending sort keeps the lower id first among equal scores
        ids = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
        return ids.sort(dim=-1).values.to(torch.int32)
    flat = scores.reshape(-1, n).float().contiguous()
    out = torch.empty((flat.shape[0], k), dtype=torch.int32, device=scores.device)
    block = triton.next_power_of_2(n)
    _row_topk_kernel[(flat.shape[0],)](flat, out, n, k, BLOCK=block,
                                       num_warps=1 if block <= 1024 else 4)
    return out.view(*scores.shape[:-1], k)
