"""The softmax-normalizer signal ``max_prob`` (issue #14): its return type and its reference.

Every flash-style kernel holds, per query row i, the online-softmax normalizer
``l_i = sum_j 2^(s_ij - m_i)`` with ``m_i`` the row max, so ``max_prob_i = 1 / l_i`` is the row's
largest attention weight: near 1 for a peaked row, near 1/keys for a diffuse one. With
``return_max_prob=True`` the ops write it from the epilogue (a render-time option,
`tilegen.config.KernelConfig.store_max_prob`: off, the source is the one without it), together
with its mean over the real rows of each query cube, which `tilegen.sparsity.adaptive_topk`
turns into a per-row cube budget for the next call.

Return convention: ``AttentionOutput(o, lse, max_prob, max_prob_cube)``, a named tuple, whenever
``return_max_prob=True``; ``lse`` is None when ``return_lse=False``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class AttentionOutput(NamedTuple):
    """What ``op(..., return_max_prob=True)`` and ``block_sparse_attention(...,
    return_max_prob=True)`` return.

    - ``o``: the attention output (q's dtype, layout and shape);
    - ``lse``: fp32 (B, H, S) base-2 log-sum-exp, or None when ``return_lse=False``;
    - ``max_prob``: fp32 (B, H, S), ``1 / l`` per row (its largest softmax weight); 0 for a row
      that saw no key (count 0), NaN for a row that saw a NaN or a bad index/vbs/count;
      padded query rows are computed like real ones (their values are unspecified);
    - ``max_prob_cube``: fp32 (B, H, NQ), the mean of ``max_prob`` over the real rows of each
      query cube (its first ``vbs[c]`` rows; all ``block_q`` rows when the spec has no variable
      block sizes).
    """

    o: torch.Tensor
    lse: torch.Tensor | None
    max_prob: torch.Tensor
    max_prob_cube: torch.Tensor


def real_rows(vbs: torch.Tensor | None, num_q_blocks: int, block: int,
              device: torch.device) -> torch.Tensor:
    """(NQ, block) bool: True for the real query rows of each cube (the first vbs[c])."""
    token = torch.arange(block, device=device)
    if vbs is None:
        return torch.ones(num_q_blocks, block, dtype=torch.bool, device=device)
    n = vbs[:num_q_blocks].to(device=device, dtype=torch.long).clamp(1, block)
    return token[None, :] < n[:, None]


def cube_mean(max_prob: torch.Tensor, vbs: torch.Tensor | None, block: int) -> torch.Tensor:
    """(B, H, NQ) fp32: the mean of ``max_prob`` (B, H, S) over the real rows of each query cube
    (the reference of the kernels' epilogue reduction; the CPU PyTorch path uses it)."""
    B, H, S = max_prob.shape
    nq = S // block
    real = real_rows(vbs, nq, block, max_prob.device)
    x = torch.where(real, max_prob.float().reshape(B, H, nq, block), 0.0)
    return x.sum(-1) / real.sum(-1).to(torch.float32)


def empty_buffers(batch: int, heads: int, seq_len: int, num_q_blocks: int,
                  device: torch.device, *, zero_cube: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh (max_prob, max_prob_cube) buffers; ``zero_cube`` when programs of one cube add
    their shares atomically."""
    mp = torch.empty((batch, heads, seq_len), dtype=torch.float32, device=device)
    make = torch.zeros if zero_cube else torch.empty
    mpc = make((batch, heads, num_q_blocks), dtype=torch.float32, device=device)
    return mp, mpc


__all__ = ["AttentionOutput", "cube_mean", "empty_buffers", "real_rows"]
