"""The peers beside tilegen: FlexAttention on a BlockMask built from the LUT, dense SDPA."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from tilegen import captures
from tilegen.bench.plan import DENSE_PEERS, Variant
from tilegen.bench.points import first_call, from_bhsd, synchronize, to_bhsd
from tilegen.bench.report import Row
from tilegen.spec import Spec

# ============================================================================ FlexAttention


def lut_block_tensors(topk_idx: torch.Tensor, vbs: torch.Tensor, block: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The LUT as FlexAttention block tensors: ``(kv_num_blocks, kv_indices, full_kv_num_blocks,
    full_kv_indices)``, ``(B, H, NQ)`` and ``(B, H, NQ, NKV)`` int32.

    Selected cubes with ``vbs == block`` are *full* blocks (no mask_mod work); selected partial
    cubes are *partial* blocks, where the mask_mod hides the padding. Each row lists its selected
    cubes first, in ascending id order, then the unselected ones (ignored past the count). No
    value checks and no host sync (the op's own checks guard the LUT)."""
    B, H, NQ, _ = topk_idx.shape
    nkv = vbs.shape[0]
    selected = torch.zeros((B, H, NQ, nkv), dtype=torch.bool, device=topk_idx.device)
    selected.scatter_(-1, topk_idx.long(), True)
    full = (vbs == block).to(selected.device)

    def ordered(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = m.sum(dim=-1, dtype=torch.int32)
        ind = torch.argsort(m.to(torch.int32), dim=-1, descending=True, stable=True)
        return num.contiguous(), ind.to(torch.int32).contiguous()

    kv_num, kv_idx = ordered(selected & ~full)
    full_num, full_idx = ordered(selected & full)
    return kv_num, kv_idx, full_num, full_idx


def padding_mask_mod(vbs: torch.Tensor, block: int, lut_mask: torch.Tensor | None = None
                     ) -> Callable:
    """FlexAttention mask_mod: key slot ``kv`` is real iff ``kv % block < vbs[kv // block]``.

    The compiled kernel only visits the blocks the BlockMask lists, so the padding test is all it
    needs. Eager FlexAttention (no torch.compile; a debugging path) ignores the block lists and
    applies the mask_mod to every pair: pass ``lut_mask`` (``(B, H, NQ, NKV)`` bool) to get the
    exact block-sparse function there too."""
    if lut_mask is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx % block) < vbs[kv_idx // block]
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            cube = kv_idx // block
            return lut_mask[b, h, q_idx // block, cube] & ((kv_idx % block) < vbs[cube])
    return mask_mod


def flex_block_mask(topk_idx: torch.Tensor, vbs: torch.Tensor, block: int,
                    mask_mod: Callable | None = None, *, exact: bool = False) -> Any:
    """A `torch.nn.attention.flex_attention.BlockMask` for the LUT, `block` x `block` blocks:
    `lut_block_tensors` plus `padding_mask_mod` (``exact=True`` makes the mask_mod carry the LUT
    as well, for eager FlexAttention)."""
    from torch.nn.attention.flex_attention import BlockMask

    kv_num, kv_idx, full_num, full_idx = lut_block_tensors(topk_idx, vbs, block)
    if mask_mod is None:
        lut_mask = None
        if exact:
            B, H, NQ, _ = topk_idx.shape
            lut_mask = torch.zeros((B, H, NQ, vbs.shape[0]), dtype=torch.bool,
                                   device=topk_idx.device)
            lut_mask.scatter_(-1, topk_idx.long(), True)
        mask_mod = padding_mask_mod(vbs, block, lut_mask)
    seq = topk_idx.shape[2] * block
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                    mask_mod=mask_mod, seq_lengths=(seq, vbs.shape[0] * block))


class FlexPeer:
    """FlexAttention, compiled once: the compiled function and the mask_mod (with its vbs
    buffer) are kept across sweep points, so a new LUT of the same shape does not recompile.
    A compile failure is remembered and reported for later points without another attempt."""

    def __init__(self, compile: bool = True) -> None:
        self.compile = compile
        self.failed: str | None = None
        self.failed_backward: str | None = None
        self._fn: Callable | None = None
        self._mask_mods: dict[tuple, tuple[torch.Tensor, Callable]] = {}

    def function(self) -> Callable:
        if self._fn is None:
            from torch.nn.attention.flex_attention import flex_attention

            self._fn = (torch.compile(flex_attention, dynamic=False, fullgraph=True)
                        if self.compile else flex_attention)
        return self._fn

    def mask_mod(self, vbs: torch.Tensor, block: int) -> Callable | None:
        if not self.compile:
            return None  # eager: flex_block_mask(exact=True) builds the exact one per LUT
        key = (str(vbs.device), block, vbs.shape[0])
        found = self._mask_mods.get(key)
        if found is None:
            buf = vbs.clone()
            found = self._mask_mods[key] = (buf, padding_mask_mod(buf, block))
        else:
            found[0].copy_(vbs)
        return found[1]

    def block_mask(self, topk_idx: torch.Tensor, vbs: torch.Tensor, block: int) -> Any:
        return flex_block_mask(topk_idx, vbs, block, self.mask_mod(vbs, block),
                               exact=not self.compile)

    def call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any,
             scale: float, block: int) -> torch.Tensor:
        """flex_attention on BHSD tensors, `block` x `block` kernel tiles (matching the mask)."""
        return self.function()(q, k, v, block_mask=block_mask, scale=scale,
                               kernel_options={"BLOCK_M": block, "BLOCK_N": block})


def run_flex(spec: Spec, idx: torch.Tensor, vbs: torch.Tensor, peer_inputs: tuple,
              flex: FlexPeer, timer: Callable, row: Row, o_ref: torch.Tensor | None,
              against: str, device: str) -> None:
    """FlexAttention with the BlockMask of the pattern `idx` (a LUT whose rows may repeat a
    cube past their count: scattered into a block mask, repeats collapse)."""
    row.config = (f"BlockMask {spec.block_q}x{spec.block_kv}, "
                  + ("torch.compile" if flex.compile else "eager"))
    if flex.failed:
        row.fail(f"skipped: FlexAttention failed earlier ({flex.failed[:300]})")
        return
    block = spec.block_kv
    bm = flex.block_mask(idx, vbs, block)
    row.ms_mask = timer(lambda: flex.block_mask(idx, vbs, block))
    q, k, v = peer_inputs

    def call() -> torch.Tensor:
        return flex.call(q, k, v, bm, spec.sm_scale, block)

    t0 = time.perf_counter()
    try:
        o = call()
        synchronize(device)
    except Exception as exc:
        if not isinstance(exc, torch.cuda.OutOfMemoryError):
            flex.failed = f"{type(exc).__name__}: {exc}"
        raise
    row.first_call_s = time.perf_counter() - t0
    if o_ref is None:
        row.fail("no reference output to score against (the reference variant failed)")
    else:
        row.set_score(captures.score(from_bhsd(o, spec.layout), o_ref, layout=spec.layout),
                      against)
    del o
    row.ms_op = timer(call)


def run_dense(spec: Spec, variant: Variant, peer_inputs: tuple, timer: Callable, row: Row,
               device: str) -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    member = DENSE_PEERS[variant.label]
    row.config = f"dense, SDPBackend.{member}"
    row.add_note("dense attention computes a different function (every key): timed, not "
                 "scored")
    q, k, v = peer_inputs
    with sdpa_kernel([getattr(SDPBackend, member)]):
        def call() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, scale=spec.sm_scale)

        t0 = time.perf_counter()
        o = call()
        synchronize(device)
        row.first_call_s = time.perf_counter() - t0
        del o
        row.ms_op = timer(call)


def bwd_flex(spec: Spec, args: tuple, do: torch.Tensor, timer: Callable, row: Row,
              device: str, *, flex: FlexPeer, **_: Any) -> tuple[torch.Tensor, ...] | None:
    """flex fwd+bwd: the flex peer's compiled function and BlockMask, forward + autograd.grad
    (BHSD leaves copied outside the timing); gradients returned in the spec's layout."""
    layout, block = spec.layout, spec.block_kv
    row.config = (f"BlockMask {spec.block_q}x{block}, "
                  + ("torch.compile" if flex.compile else "eager"))
    if flex.failed:
        row.fail(f"skipped: FlexAttention failed earlier ({flex.failed[:300]})")
        return None
    if flex.failed_backward:
        row.fail(f"skipped: FlexAttention's backward failed earlier "
                 f"({flex.failed_backward[:300]})")
        return None
    bm = flex.block_mask(args[3], args[4], block)
    q, k, v = (to_bhsd(t, layout).detach().clone().requires_grad_(True) for t in args[:3])
    dob = to_bhsd(do, layout)

    def step() -> tuple[torch.Tensor, ...]:
        o = flex.call(q, k, v, bm, spec.sm_scale, block)
        return torch.autograd.grad(o, (q, k, v), dob)

    try:
        grads = first_call(step, row, device)
    except Exception as exc:
        if not isinstance(exc, torch.cuda.OutOfMemoryError):
            flex.failed_backward = f"{type(exc).__name__}: {exc}"
        raise
    row.ms_op = timer(step)
    return tuple(from_bhsd(g, layout) for g in grads)


