"""The backward's maps on a GPU: the inverse map and the Gluon dQ plan, in four launches.

`tilegen.backends.triton.backward.inverse_map` and `tilegen.backends.gluon.backward.dq_plan`
are the vectorized torch models (and the CPU path); this module computes the same tensors with
fewer, fused launches (bench/NOTES.md, issue #18: the torch routine's ~20 elementwise passes
over the B*H*NQ*TOPK entries cost more than its sort):

1. `_lut_keys`: per LUT entry its sort key, ``bh * NKV + index`` (int32; ``B*H*NKV``, sorted
   last, for an entry past the row's count or out of range), and per row the dQ plan's
   ``meta`` (the entry count, or -1 for a row with a bad index, vbs or count);
2. one stable sort of the int32 keys (torch; keeps each key's query cubes ascending);
3. ``offsets`` by one searchsorted of the sorted keys (the first slot of every key);
4. `_scatter_order`: per slot p of the map its query cube (``qcubes[p]``) and, for the plan,
   the slot of each LUT entry (``pos[order[p]] = p``).

No host sync. The outputs equal the torch models' bit for bit (tests/test_gluon_backward.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: LUT rows per `_lut_keys` program, and map slots per `_scatter_order` program
ROWS = 16
SLOTS = 1024


@triton.jit
def _lut_keys(LUT, COUNTS, VBS, KEY, META, n_rows, NQ, NKV, TOPK, SENTINEL,
              HAS_COUNTS: tl.constexpr, ROWS: tl.constexpr, BLOCK_T: tl.constexpr,
              BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_live = rows < n_rows
    slot = tl.arange(0, BLOCK_T)
    if HAS_COUNTS:
        count = tl.load(COUNTS + rows, mask=row_live, other=0)
    else:
        count = tl.zeros([ROWS], tl.int32) + TOPK
    in_lut = row_live[:, None] & (slot[None, :] < TOPK)
    entry = rows.to(tl.int64)[:, None] * TOPK + slot[None, :]
    idx = tl.load(LUT + entry, mask=in_lut, other=0)
    real = in_lut & (slot[None, :] < count[:, None])
    ok = (idx >= 0) & (idx < NKV)
    key = tl.where(real & ok, (rows // NQ)[:, None] * NKV + idx, SENTINEL)
    tl.store(KEY + entry, key, mask=in_lut)
    # the dQ plan's row check: the vbs of a chosen cube, read only at an index in range
    n_valid = tl.load(VBS + tl.where(ok, idx, 0), mask=in_lut, other=1)
    bad_entry = real & (~ok | (n_valid < 1) | (n_valid > BLOCK))
    bad = (tl.max(bad_entry.to(tl.int32), 1) != 0) | (count < 0) | (count > TOPK)
    tl.store(META + rows, tl.where(bad, -1, count), mask=row_live)


@triton.jit
def _scatter_order(ORDER, QCUBES, POS, n, NQ, TOPK, HAS_POS: tl.constexpr,
                   SLOTS: tl.constexpr):
    p = tl.program_id(0).to(tl.int64) * SLOTS + tl.arange(0, SLOTS)
    live = p < n
    entry = tl.load(ORDER + p, mask=live, other=0)
    tl.store(QCUBES + p, ((entry // TOPK) % NQ).to(tl.int32), mask=live)
    if HAS_POS:
        tl.store(POS + entry, p.to(tl.int32), mask=live)


def device_maps(topk_idx: torch.Tensor, counts: torch.Tensor | None, vbs: torch.Tensor,
                num_kv_blocks: int, block: int = 64, with_plan: bool = True):
    """``(offsets, qcubes, plan)`` as `inverse_map` and `dq_plan` give them (``plan`` = (pos,
    meta), or None without ``with_plan``), on the LUT's device (CUDA, or the CPU under the
    Triton interpreter)."""
    B, H, NQ, TOPK = topk_idx.shape
    BH = B * H
    n = BH * NQ * TOPK
    sentinel = BH * num_kv_blocks
    if n > 2**31 - 1 or sentinel > 2**31 - 2:
        raise ValueError(f"the backward's maps number B*H*NQ*TOPK = {n} LUT entries and "
                         f"B*H*NKV = {sentinel} lists in int32")
    dev = topk_idx.device
    lut = topk_idx.contiguous()
    key = torch.empty(n, dtype=torch.int32, device=dev)
    meta = torch.empty(BH * NQ, dtype=torch.int32, device=dev)
    cnt = counts.reshape(-1).to(torch.int32).contiguous() if counts is not None else None
    _lut_keys[(triton.cdiv(BH * NQ, ROWS),)](
        lut, cnt if cnt is not None else meta, vbs, key, meta, BH * NQ, NQ, num_kv_blocks,
        TOPK, sentinel, HAS_COUNTS=cnt is not None, ROWS=ROWS,
        BLOCK_T=max(16, triton.next_power_of_2(TOPK)), BLOCK=block, num_warps=4)
    sorted_key, order = torch.sort(key, stable=True)
    bounds = torch.arange(sentinel + 1, dtype=torch.int32, device=dev)
    offsets = torch.searchsorted(sorted_key, bounds, out_int32=True)
    qcubes = torch.empty(n, dtype=torch.int32, device=dev)
    pos = torch.empty(n, dtype=torch.int32, device=dev) if with_plan else None
    _scatter_order[(triton.cdiv(n, SLOTS),)](
        order, qcubes, pos if pos is not None else qcubes, n, NQ, TOPK,
        HAS_POS=with_plan, SLOTS=SLOTS, num_warps=4)
    plan = (pos.view(topk_idx.shape), meta) if with_plan else None
    return offsets, qcubes, plan
