"""The sum of GQA's per-query-head dK and dV over each group of query heads, in one launch.

The Gluon backward of grouped-query attention writes dK and dV per query head ``(B, S, H, D)``
(``H = g * H_kv``; head ``h`` belongs to KV head ``h // g``). The gradient of K/V is their sum
over each group: ``(B, S, H_kv, D)``, accumulated in fp32 and rounded once. torch's reduction
over the middle axis of ``(B*S*H_kv, g, D)`` reads at about 2.3 TB/s on the H200 (0.43 ms for
both tensors at the default workload: bench/NOTES.md); this kernel reads each row's ``g * D``
contiguous values once and sums both tensors in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 16  # (b, s, kv head) rows per program


@triton.jit
def _group_sum_kernel(dk_ptr, dv_ptr, dk_out, dv_out, n_rows,
                      G: tl.constexpr, G_POW2: tl.constexpr, D: tl.constexpr,
                      ROWS: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    heads = tl.arange(0, G_POW2)
    cols = tl.arange(0, D)
    live = rows < n_rows
    src = (rows[:, None, None] * (G * D) + heads[None, :, None] * D + cols[None, None, :])
    mask = live[:, None, None] & (heads < G)[None, :, None]
    dst = rows[:, None] * D + cols[None, :]
    k = tl.sum(tl.load(dk_ptr + src, mask=mask, other=0.0).to(tl.float32), 1)
    tl.store(dk_out + dst, k.to(dk_out.dtype.element_ty), mask=live[:, None])
    v = tl.sum(tl.load(dv_ptr + src, mask=mask, other=0.0).to(tl.float32), 1)
    tl.store(dv_out + dst, v.to(dv_out.dtype.element_ty), mask=live[:, None])


def head_group_sum(dk: torch.Tensor, dv: torch.Tensor, kv_heads: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, S, H, D)`` contiguous dK, dV per query head -> ``(B, S, kv_heads, D)`` each, the
    sum over each group of ``H // kv_heads`` consecutive heads (fp32 accumulation, one rounding
    to the input dtype)."""
    B, S, H, D = dk.shape
    g = H // kv_heads
    if D & (D - 1) or H != g * kv_heads or dv.shape != dk.shape or not (
            dk.is_contiguous() and dv.is_contiguous()):
        raise ValueError(f"head_group_sum: contiguous (B, S, H, D) dk and dv with a power-of-two"
                         f" D and H a multiple of {kv_heads}, got {tuple(dk.shape)} and "
                         f"{tuple(dv.shape)}")
    n_rows = B * S * kv_heads
    dk_out = torch.empty((B, S, kv_heads, D), dtype=dk.dtype, device=dk.device)
    dv_out = torch.empty_like(dk_out)
    _group_sum_kernel[(triton.cdiv(n_rows, ROWS),)](
        dk, dv, dk_out, dv_out, n_rows, G=g, G_POW2=triton.next_power_of_2(g), D=D, ROWS=ROWS)
    return dk_out, dv_out
