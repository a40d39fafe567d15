"""Per-row top-k ids of a score matrix, ascending by id, in one Triton program per row.

`torch.topk` followed by a sort of the ids costs ~1 ms on the default workload's coarse scores
(40 x 624 rows of 624) on the H200, two thirds of the whole coarse stage. Here one program per
row sorts the row's (score, id) pairs as 64-bit keys (distinct: the id breaks ties, lower id
first), reads the k-th key as the threshold and compacts the ids at or above it in id order:
the same selection as `torch.topk` with lowest-id tie-breaking, already ascending.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_topk_kernel(SCORES, OUT, n_cols, k, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    live = col < n_cols
    s = tl.load(SCORES + row * n_cols + col, mask=live, other=float("-inf"))
    bits = s.to(tl.int32, bitcast=True)
    # fp32 bits -> an int32 that orders like the float (negative floats flip their magnitude)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    key = (ordered << 32) | (BLOCK - 1 - col).to(tl.int64)
    # below every real key (the smallest is -inf's, -2^63 + ...): the padding never wins
    key = tl.where(live, key, tl.full([BLOCK], -2147483648, tl.int64) << 32)
    srt = tl.sort(key, 0, descending=True)
    thr = tl.sum(tl.where(col == k - 1, srt, 0), 0)
    take = live & (key >= thr)
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
                                       num_warps=4 if block <= 1024 else 8)
    return out.view(*scores.shape[:-1], k)
