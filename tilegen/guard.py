"""The device-side value guard of the ops whose kernels trust their inputs (the CUDA and HIP
C++ families), so that they too check index, vbs and count values without a host sync.

Around the unchanged kernel, two Triton launches:

* `_guard_rows`, one program per LUT row (b, h, query cube), checks the row's first n entries
  (`row_entries`: index in [0, NKV), vbs[index] in 1..block, n = counts[row] or TOPK in
  0..TOPK) and writes the counts the kernel walks: n for a good row, 0 for a bad one, so the
  kernel reads nothing of a bad row and never forms an address from a bad value. A bad value
  sets a bit of the error word (1 index, 2 vbs, 4 counts) and marks the row.
* `_poison_rows` writes NaN into every output of a marked row (o, lse, max_prob and its cube
  mean); a program of a good row reads one byte and stops.

The error word is `tilegen.inputs.DeviceErrorFlag`'s: raised as ValueError on a later call or
at `check()`, as for the Triton and Gluon families. The Gluon pre-pass reads its rows with the
same `row_entries`, so every family agrees on what a bad value is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilegen.inputs import DeviceErrorFlag, Shapes
from tilegen.spec import Spec


@triton.jit
def row_entries(LUT, COUNTS, VBS, row, row_live, NKV, TOPK, HAS_COUNTS: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK: tl.constexpr):
    """Load and check the first n entries of one LUT row: (cube, vbs, live, error bits).
    No address is formed from an unchecked value."""
    offs = tl.arange(0, BLOCK_T)
    if HAS_COUNTS:
        n = tl.load(COUNTS + row, mask=row_live, other=0)
    else:
        n = tl.where(row_live, TOPK, 0)
    bad_n = (n < 0) | (n > TOPK)
    n = tl.where(bad_n, 0, n)
    live = offs < n
    idx = tl.load(LUT + row * TOPK + offs, mask=live, other=0)
    bad_i = live & ((idx < 0) | (idx >= NKV))
    cube = tl.where(live & ~bad_i, idx, 0)
    v = tl.load(VBS + cube, mask=live & ~bad_i, other=BLOCK)
    bad_v = live & ((v < 1) | (v > BLOCK))
    err = (tl.max(bad_i.to(tl.int32), 0) | (tl.max(bad_v.to(tl.int32), 0) * 2)
           | (bad_n.to(tl.int32) * 4))
    return cube, v, live, err


@triton.jit
def _guard_rows(LUT, COUNTS, VBS, COUNTS_OUT, ROW_BAD, ERR, NKV, TOPK,
                HAS_COUNTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    _, _, live, err = row_entries(LUT, COUNTS, VBS, row, True, NKV, TOPK, HAS_COUNTS, BLOCK_T,
                                  BLOCK)
    bad = err != 0
    tl.store(COUNTS_OUT + row, tl.where(bad, 0, tl.sum(live.to(tl.int32), 0)))
    tl.store(ROW_BAD + row, bad.to(tl.int8))
    tl.atomic_or(ERR, err, mask=bad)


@triton.jit
def _poison_rows(ROW_BAD, OUT, LSE, MP, MPC, nq, num_heads, seq_len, stride_b, stride_s, stride_h,
                 HAS_LSE: tl.constexpr, HAS_MP: tl.constexpr, BLOCK: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if tl.load(ROW_BAD + row) != 0:
        bh = row // nq
        qc = row - bh * nq
        b = bh // num_heads
        h = bh - b * num_heads
        tokens = qc * BLOCK + tl.arange(0, BLOCK)
        cols = tl.arange(0, HEAD_DIM)
        ptr = (OUT + b * stride_b + h * stride_h + tokens[:, None] * stride_s + cols[None, :])
        nan = tl.full([BLOCK, HEAD_DIM], float("nan"), tl.float32)
        tl.store(ptr, nan.to(OUT.dtype.element_ty))
        nan_rows = tl.full([BLOCK], float("nan"), tl.float32)
        if HAS_LSE:
            tl.store(LSE + bh * seq_len + tokens, nan_rows)
        if HAS_MP:
            tl.store(MP + bh * seq_len + tokens, nan_rows)
            tl.store(MPC + row, float("nan"))


class ValueGuard:
    """The pre-pass, the post-pass and the error word of one op (`DeviceErrorFlag`)."""

    def __init__(self, spec: Spec) -> None:
        self.block_q = spec.block_q  # query tokens of a row: what the post-pass poisons
        self.block_kv = spec.block_kv  # the largest valid vbs
        self.layout = spec.layout
        self.errors = DeviceErrorFlag(kinds=True)

    def before(self, topk_idx: torch.Tensor, vbs: torch.Tensor, counts: torch.Tensor | None,
               shapes: Shapes) -> tuple[torch.Tensor, torch.Tensor]:
        """Raise for an earlier call's bad value (never waits), then check every row on the
        device: ``(counts the kernel walks, row marks)``, both (B, H, NQ)."""
        device = topk_idx.device
        self.errors.raise_pending(device)
        rows = shapes.batch * shapes.heads * shapes.num_q_blocks
        safe = torch.empty((shapes.batch, shapes.heads, shapes.num_q_blocks), dtype=torch.int32,
                           device=device)
        marks = torch.empty((shapes.batch, shapes.heads, shapes.num_q_blocks), dtype=torch.int8,
                            device=device)
        _guard_rows[(rows,)](topk_idx, counts if counts is not None else safe, vbs, safe, marks,
                             self.errors.buffer(device), shapes.num_kv_blocks, shapes.topk,
                             HAS_COUNTS=counts is not None,
                             BLOCK_T=triton.next_power_of_2(shapes.topk), BLOCK=self.block_kv,
                             num_warps=1)
        return safe, marks

    def after(self, marks: torch.Tensor, o: torch.Tensor, lse: torch.Tensor | None,
              max_prob_out: tuple[torch.Tensor, torch.Tensor] | None, shapes: Shapes) -> None:
        """NaN into every output of a marked row; then record the error word (no sync)."""
        if self.layout == "bshd":
            stride_b, stride_s, stride_h = o.stride(0), o.stride(1), o.stride(2)
        else:
            stride_b, stride_h, stride_s = o.stride(0), o.stride(1), o.stride(2)
        mp, mpc = max_prob_out if max_prob_out is not None else (marks, marks)
        _poison_rows[(marks.numel(),)](
            marks, o, lse if lse is not None else marks, mp, mpc, shapes.num_q_blocks,
            shapes.heads, shapes.seq_len, stride_b, stride_s, stride_h,
            HAS_LSE=lse is not None, HAS_MP=max_prob_out is not None, BLOCK=self.block_q,
            HEAD_DIM=shapes.head_dim, num_warps=4)
        self.errors.after_launch(o.device)

    def check(self) -> None:
        """Wait for the op's launches and raise ValueError if any met a bad value."""
        self.errors.check()
