"""The VSA forward's reorder to cube-major order on the GPU: q, k and v in one Triton launch.

`layout.to_cubes` is a zero fill of the padded output plus an `index_copy` per tensor (three
launches each, ~0.62 ms per tensor on the default workload on the H200). Here one program per
(64 cube slots, batch) gathers each slot's token row (H*D contiguous elements, or zeros for a
padding slot) of the three tensors: the bytes once, no separate fill. The slot -> token map is
`layout.packed_slot_sources` (cached per grids, cube and device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilegen import layout


@triton.jit
def _gather_rows(X, OUT, SRC, b, n_tok, n_slot, slot, row, ROW: tl.constexpr,
                 CHUNK: tl.constexpr):
    """OUT[b, slot, :] = X[b, SRC[slot], :] (a row of ROW elements), zeros where SRC < 0."""
    src = tl.load(SRC + slot, mask=slot < n_slot, other=-1)
    real = src >= 0
    src = tl.where(real, src, 0).to(tl.int64)
    for c0 in tl.static_range(0, ROW, CHUNK):
        col = c0 + tl.arange(0, CHUNK)
        x = tl.load(X + (b * n_tok + src)[:, None] * ROW + col[None, :],
                    mask=real[:, None] & (col[None, :] < ROW), other=0.0)
        tl.store(OUT + (b * n_slot + row)[:, None] * ROW + col[None, :], x,
                 mask=(slot < n_slot)[:, None] & (col[None, :] < ROW))


@triton.jit
def _to_cubes3_kernel(Q, K, V, QC, KC, VC, SRC, n_tok, n_slot, ROW: tl.constexpr,
                      SLOTS: tl.constexpr, CHUNK: tl.constexpr):
    slot = tl.program_id(0) * SLOTS + tl.arange(0, SLOTS)
    b = tl.program_id(1).to(tl.int64)
    row = slot.to(tl.int64)
    _gather_rows(Q, QC, SRC, b, n_tok, n_slot, slot, row, ROW, CHUNK)
    _gather_rows(K, KC, SRC, b, n_tok, n_slot, slot, row, ROW, CHUNK)
    _gather_rows(V, VC, SRC, b, n_tok, n_slot, slot, row, ROW, CHUNK)


def _gather3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, src: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slot s of each output holds token src[s] of q, k, v (zeros where src < 0), one launch."""
    B, n_tok = q.shape[:2]
    n_slot = src.numel()
    row = q[0, 0].numel()
    outs = tuple(t.new_empty((B, n_slot, *t.shape[2:])) for t in (q, k, v))
    slots = 16
    _to_cubes3_kernel[(triton.cdiv(n_slot, slots), B)](
        q, k, v, *outs, src, n_tok, n_slot, ROW=row, SLOTS=slots,
        CHUNK=min(1024, triton.next_power_of_2(row)), num_warps=4)
    return outs  # type: ignore[return-value]


def to_cubes3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: tuple[int, int, int],
              cube: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`layout.to_cubes` of q, k and v (equal shapes, contiguous, on one CUDA device) in one
    launch; the same outputs (padding slots zero)."""
    return _gather3(q, k, v, layout.packed_slot_sources((tuple(grid),), tuple(cube), q.device))


def to_cubes3_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     grids: tuple[tuple[int, int, int], ...], cube: tuple[int, int, int]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`to_cubes3` of packed sequences (batch 1, their THW tokens one after another): every
    sequence cube-major, side by side, in one launch."""
    return _gather3(q, k, v, layout.packed_slot_sources(tuple(grids), tuple(cube), q.device))
