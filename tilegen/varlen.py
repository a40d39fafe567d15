"""Packed variable-length batches: several sequences (videos of different grids) in one call.

The convention (`tilegen.ops.block_sparse_attention_varlen`):

- tokens are packed along one axis, ``q (total_q, H, D)`` and ``k, v (total_kv, H_kv, D)``, each
  sequence starting on a cube boundary and padded to whole cubes (`tilegen.layout.to_cubes` per
  sequence);
- ``cu_cubes_q`` and ``cu_cubes_kv`` (int32, ``(N + 1,)``, starting at 0) are the cumulative cube
  counts: sequence s owns query cubes ``cu_cubes_q[s] .. cu_cubes_q[s + 1]`` and KV cubes
  ``cu_cubes_kv[s] .. cu_cubes_kv[s + 1]``;
- ``topk_idx (H, NQ_total, TOPK)`` holds KV-cube ids *local* to each row's sequence, in
  ``[0, NKV_s)``; ``counts (H, NQ_total)`` optional, as for one sequence;
- ``vbs (NKV_total,)`` and ``q_vbs (NQ_total,)`` give every cube's real tokens.

The batch is then one block-sparse call of batch 1 whose LUT names global KV cubes: `global_lut`
adds each row's KV offset on the device (no host sync), and a local id outside its sequence
becomes -1, which the kernels treat as any bad index (the row comes out NaN and the op raises
on a later call; on the CPU, or with ``check_values``, `check_offsets` names it before launch).
One launch serves the whole batch, forward and backward.
"""

from __future__ import annotations

import torch

__all__ = ["check_offsets", "global_lut", "validate_offsets"]


def validate_offsets(cu_cubes_q: torch.Tensor, cu_cubes_kv: torch.Tensor,
                     device: torch.device) -> None:
    """Host-only checks of the offsets' type, dtype, shape and device (no device read)."""
    for name, cu in (("cu_cubes_q", cu_cubes_q), ("cu_cubes_kv", cu_cubes_kv)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} has dtype {cu.dtype}, expected torch.int32")
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name} must be (N + 1,) cumulative cube counts of N >= 1 "
                             f"sequences, got shape {tuple(cu.shape)}")
        if cu.device != device:
            raise ValueError(f"{name} is on {cu.device} but q is on {device}")
    if cu_cubes_q.numel() != cu_cubes_kv.numel():
        raise ValueError(f"cu_cubes_q lists {cu_cubes_q.numel() - 1} sequences and cu_cubes_kv "
                         f"{cu_cubes_kv.numel() - 1}; they must list the same sequences")


def check_offsets(cu_cubes_q: torch.Tensor, cu_cubes_kv: torch.Tensor, topk_idx: torch.Tensor,
                  counts: torch.Tensor | None, num_q_blocks: int, num_kv_blocks: int) -> None:
    """The value checks (one host sync): offsets from 0, non-decreasing, ending at the packed
    cube counts, every sequence with a query cube, and every used local id inside its
    sequence's KV cubes."""
    for name, cu, total in (("cu_cubes_q", cu_cubes_q, num_q_blocks),
                            ("cu_cubes_kv", cu_cubes_kv, num_kv_blocks)):
        values = cu.tolist()
        if values[0] != 0 or values[-1] != total or any(
                b < a for a, b in zip(values, values[1:], strict=False)):
            raise ValueError(f"{name}={values} must rise from 0 to the packed tensors' "
                             f"{total} cubes")
    sizes_q = (cu_cubes_q[1:] - cu_cubes_q[:-1]).tolist()
    if min(sizes_q) < 1:
        raise ValueError(f"cu_cubes_q={cu_cubes_q.tolist()}: every sequence needs a query cube")
    seq = sequence_of_cube(cu_cubes_q, num_q_blocks)
    nkv = (cu_cubes_kv[1:] - cu_cubes_kv[:-1]).long()[seq]  # (NQ_total,)
    used = torch.ones(topk_idx.shape, dtype=torch.bool, device=topk_idx.device)
    if counts is not None:
        used = torch.arange(topk_idx.shape[-1], device=topk_idx.device) < counts[..., None].long()
    bad = used & ((topk_idx < 0) | (topk_idx.long() >= nkv[None, :, None]))
    if bool(bad.any()):
        h, c, j = (int(x) for x in bad.nonzero()[0])
        s = int(seq[c])
        raise ValueError(f"topk_idx[{h}, {c}, {j}] = {int(topk_idx[h, c, j])} is outside "
                         f"[0, {int(nkv[c])}): ids are local to the row's sequence ({s}, "
                         f"{int(nkv[c])} KV cubes)")


def sequence_of_cube(cu_cubes: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """(num_blocks,) int64: the sequence of each packed cube (on the offsets' device)."""
    cubes = torch.arange(num_blocks, device=cu_cubes.device, dtype=cu_cubes.dtype)
    return torch.searchsorted(cu_cubes[1:].contiguous(), cubes, right=True)


def global_lut(topk_idx: torch.Tensor, cu_cubes_q: torch.Tensor, cu_cubes_kv: torch.Tensor
               ) -> torch.Tensor:
    """(1, H, NQ_total, TOPK) int32: each row's local KV ids plus its sequence's KV offset; a
    local id outside its sequence becomes -1 (a bad index to the kernels). No host sync."""
    H, nq, _ = topk_idx.shape
    seq = sequence_of_cube(cu_cubes_q, nq)
    start = cu_cubes_kv[:-1][seq][None, :, None]
    size = (cu_cubes_kv[1:] - cu_cubes_kv[:-1])[seq][None, :, None]
    ok = (topk_idx >= 0) & (topk_idx < size)
    return torch.where(ok, topk_idx + start, -1).to(torch.int32).unsqueeze(0).contiguous()
