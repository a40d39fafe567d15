"""The encodings other than the LUT, as the ops and their callers (tune, bench) see them.

* "mask" (Jenga's block mask ``B[i][j]``): ``op(q, k, v, mask, vbs)`` with ``mask``
  ``(B, H, NQ, NKV)`` bool or uint8 (nonzero = attended). `MaskAttention` turns the mask into a
  LUT of width NKV plus per-row counts on the device (`mask_to_lut_device`: one tiny Triton
  kernel, one program per row, no host sync) and runs the family's LUT kernel with counts. The
  time users see includes the conversion. Why a conversion and not a kernel that walks the
  mask: bench/NOTES.md ("mask encoding").
* "sliding_tile" (STA): ``op(q, k, v, vbs)``; the KV cubes of query cube c are the window
  (`Spec.window`, per head or one for all) around c's (t, h, w) cube coordinate, its centre
  clamped so the window stays inside the cube grid. The Triton kernel computes them from
  coordinates (the cursor branch of templates/triton/attention_macros.j2); `sliding_tile_lut`
  lists the same cubes as a LUT for the references, the backward's inverse map and
  FlexAttention's BlockMask.

`call_args`, `reference_lut` and `validate` give every caller that holds a capture (the tuner,
the bench) the op's arguments, the equivalent LUT and the input checks of a spec's encoding:
they dispatch through the encoding's entry in `tilegen.encoding_registry`, which names the
per-encoding functions here (`lut_call_args`, `capture_lut`, ...).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from tilegen.inputs import Shapes, validate_mask_inputs
from tilegen.spec import Spec

__all__ = ["MaskAttention", "call_args", "capture_lut", "lut_call_args", "lut_spec",
           "mask_call_args", "mask_to_lut_device", "reference_lut", "sliding_tile_call_args",
           "sliding_tile_lut", "sliding_tile_reference_lut", "validate", "window_table"]


# -- mask -> LUT on the device ------------------------------------------------------------------
@functools.cache
def _mask_kernel():
    """The conversion kernel (built on first use: importing Triton costs a second)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _mask_to_lut(MASK, IDX, COUNTS, NKV, BLOCK: tl.constexpr):
        # one program per (b, h, query cube) row: the row's selected cube ids first, ascending,
        # then its unselected ones, ascending (a permutation of 0..NKV-1, so every entry is a
        # valid id and none repeats: the LUT kernel reads the first COUNTS[row])
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        live = offs < NKV
        sel = (tl.load(MASK + row * NKV + offs, mask=live, other=0) != 0) & live
        sel_i = sel.to(tl.int32)
        n_sel = tl.sum(sel_i, 0)
        pos_sel = tl.cumsum(sel_i, 0) - 1
        pos_unsel = n_sel + tl.cumsum((live & ~sel).to(tl.int32), 0) - 1
        pos = tl.where(sel, pos_sel, pos_unsel)
        tl.store(IDX + row * NKV + pos, offs, mask=live)
        tl.store(COUNTS + row, n_sel)

    return _mask_to_lut


def mask_to_lut_device(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, H, NQ, NKV)`` bool/uint8 mask -> ``(idx, counts)``, with no host sync.

    ``idx`` is ``(B, H, NQ, NKV)`` int32: each row's selected ids ascending, then its unselected
    ids ascending (the layout of `tilegen.sparsity.mask_to_lut`, at the full width NKV, since
    the longest row is not known without a sync); ``counts`` ``(B, H, NQ)`` int32. On CUDA /
    ROCm and under the Triton interpreter one Triton kernel does it (one program per row); on
    a CPU without the interpreter, vectorized torch. No checks (the op validates first)."""
    from tilegen.backends.triton.jit import interpreting

    B, H, NQ, NKV = mask.shape
    src = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    if mask.device.type == "cpu" and not interpreting():
        sel = src != 0
        ar = torch.arange(NKV, device=mask.device)
        key = torch.where(sel, ar, ar + NKV).sort(dim=-1).values
        idx = torch.where(key >= NKV, key - NKV, key).to(torch.int32)
        return idx.contiguous(), sel.sum(-1, dtype=torch.int32)
    import triton

    idx = torch.empty((B, H, NQ, NKV), dtype=torch.int32, device=mask.device)
    counts = torch.empty((B, H, NQ), dtype=torch.int32, device=mask.device)
    if idx.numel():
        _mask_kernel()[(B * H * NQ,)](src, idx, counts, NKV,
                                      BLOCK=triton.next_power_of_2(NKV), num_warps=4)
    return idx, counts


class MaskAttention:
    """The op of a "mask" spec: ``o, lse = op(q, k, v, mask, vbs)``, the family's LUT op behind
    the on-device conversion. Everything else (config, backend, check, gradients: the LUT op
    gives them) is the LUT op's."""

    def __init__(self, spec: Spec, lut_op: Any) -> None:
        self.spec = spec
        self.lut_op = lut_op

    def __getattr__(self, name: str) -> Any:  # config, backend, config_source, check, ...
        if name == "lut_op":
            raise AttributeError(name)
        return getattr(self.lut_op, name)

    def __repr__(self) -> str:
        return f"MaskAttention(spec={self.spec.short_hash}, lut_op={self.lut_op!r})"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 vbs: torch.Tensor, *, sm_scale: float | None = None, return_lse: bool = True,
                 return_max_prob: bool = False, check_values: bool = False,
                 q_vbs: torch.Tensor | None = None) -> Any:
        """Validate (before any launch), convert, run the LUT op with counts. K/V of their own
        length or heads (mask (B, H_q, NQ, NKV)) and ``q_vbs`` go to a family that takes them
        (the Triton family's `BlockSparseAttention.__call__`); the others refuse them."""
        separate = getattr(self.lut_op, "takes_separate_kv", False)
        validate_mask_inputs(self.spec, q, k, v, mask, vbs, check_values=False, q_vbs=q_vbs,
                             separate_kv=separate)
        idx, counts = mask_to_lut_device(mask)
        extra: dict[str, Any] = {"check_values": check_values}
        if q_vbs is not None:
            extra["q_vbs"] = q_vbs
        if return_max_prob:
            if not getattr(self.lut_op, "provides_max_prob", False):
                raise ValueError(f"return_max_prob: the {self.lut_op.backend} family does not "
                                 "write the softmax-normalizer signal")
            extra["return_max_prob"] = True
        return self.lut_op(q, k, v, idx, vbs, counts, sm_scale=sm_scale, return_lse=return_lse,
                           **extra)

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               vbs: torch.Tensor, **options: Any) -> Any:
        """The bare launch (no input checks): the conversion and the LUT kernel. ``options``
        (shapes, sm_scale, out, store_lse, ...) go to the family's `launch` as they are."""
        idx, counts = mask_to_lut_device(mask)
        return self.lut_op.launch(q, k, v, idx, vbs, counts, **options)


# -- sliding tile -------------------------------------------------------------------------------
def window_table(spec: Spec, heads: int, device: torch.device | str) -> torch.Tensor:
    """``(heads * 3,)`` int32: the (t, h, w) window of each head (what the kernel reads)."""
    windows = spec.windows if isinstance(spec.window[0], tuple) else (spec.window,) * heads
    return torch.tensor([x for w in windows for x in w], dtype=torch.int32, device=device)


def window_cubes(cube_grid: tuple[int, int, int], window: tuple[int, int, int]) -> torch.Tensor:
    """``(NQ, prod(window))`` int64: the KV cubes of each query cube for one window, in the
    kernel's order (row-major over the window), the centre clamped so the window stays inside
    the cube grid (STA). Plain torch on the CPU."""
    gt, gh, gw = cube_grid
    q = torch.arange(gt * gh * gw)
    coord = torch.stack((q // (gh * gw), q // gw % gh, q % gw), 1)  # (NQ, 3)
    size = torch.tensor(window)
    start = torch.minimum((coord - size // 2).clamp(min=0), torch.tensor(cube_grid) - size)
    wt, wh, ww = window
    off = torch.stack(torch.meshgrid(torch.arange(wt), torch.arange(wh), torch.arange(ww),
                                     indexing="ij"), -1).reshape(-1, 3)  # (W, 3)
    pos = start[:, None, :] + off[None, :, :]
    return (pos[..., 0] * gh + pos[..., 1]) * gw + pos[..., 2]


def sliding_tile_lut(spec: Spec, batch: int, heads: int, device: torch.device | str
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sliding-tile pattern as a LUT: ``(idx, counts)`` with idx ``(B, H, NQ, Wmax)`` int32
    and counts ``(B, H, NQ)`` int32, or None when every head's window has one volume. Rows of a
    smaller window repeat their first cube past their count (never read; a mask built by
    scattering the row is still exact). Built on the CPU and copied once (callers cache it)."""
    windows = spec.windows if isinstance(spec.window[0], tuple) else (spec.window,) * heads
    width = max(math.prod(w) for w in windows)
    rows = []
    for w in windows:
        ids = window_cubes(spec.cube_grid, w)
        pad = ids[:, :1].expand(-1, width - ids.shape[1])
        rows.append(torch.cat((ids, pad), 1))
    idx = torch.stack(rows)[None].expand(batch, -1, -1, -1).to(torch.int32).contiguous()
    counts = None
    if len({math.prod(w) for w in windows}) > 1:
        per_head = torch.tensor([math.prod(w) for w in windows], dtype=torch.int32)
        counts = per_head[None, :, None].expand(batch, heads, idx.shape[2]).contiguous()
        counts = counts.to(device)
    return idx.to(device), counts


# -- what callers holding a capture need --------------------------------------------------------
# Each encoding's entry in `tilegen.encoding_registry` names its functions below; `call_args`,
# `reference_lut` and `validate` dispatch on the spec's encoding.
def capture_lut(spec: Spec, cap: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """lut and mask: the capture's own ``topk_idx`` (and counts; the mask is built from them)."""
    return cap["topk_idx"], cap.get("counts")


def sliding_tile_reference_lut(spec: Spec, cap: dict
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """sliding_tile: the window LUT (`sliding_tile_lut`), built once per capture."""
    if "sliding_tile_lut" not in cap:
        B, H = cap["topk_idx"].shape[:2]
        cap["sliding_tile_lut"] = sliding_tile_lut(spec, B, H, cap["q"].device)
    return cap["sliding_tile_lut"]


def lut_call_args(spec: Spec, cap: dict) -> tuple[torch.Tensor, ...]:
    """lut: (q, k, v, topk_idx, vbs)."""
    return cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"]


def mask_call_args(spec: Spec, cap: dict) -> tuple[torch.Tensor, ...]:
    """mask: (q, k, v, mask, vbs), the capture's LUT as a block mask
    (`tilegen.sparsity.lut_to_mask`), built once per capture."""
    if "mask" not in cap:
        from tilegen.sparsity import lut_to_mask

        cap["mask"] = lut_to_mask(cap["topk_idx"], cap["vbs"].shape[0])
    return cap["q"], cap["k"], cap["v"], cap["mask"], cap["vbs"]


def sliding_tile_call_args(spec: Spec, cap: dict) -> tuple[torch.Tensor, ...]:
    """sliding_tile: (q, k, v, vbs)."""
    return cap["q"], cap["k"], cap["v"], cap["vbs"]


def reference_lut(spec: Spec, cap: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LUT (and counts) that computes the capture's attention under the spec's encoding:
    the capture's own ``topk_idx`` for lut and mask (the mask is built from it), the window
    LUT for sliding_tile. For the fp32 oracle, the LUT reference kernel and FlexAttention."""
    return spec.encoding_info.reference_lut(spec, cap)


def call_args(spec: Spec, cap: dict) -> tuple[torch.Tensor, ...]:
    """The op's positional arguments for the capture under the spec's encoding:
    (q, k, v, topk_idx, vbs) for lut, (q, k, v, mask, vbs) for mask (the capture's LUT as a
    block mask, `tilegen.sparsity.lut_to_mask`, built once per capture), (q, k, v, vbs) for
    sliding_tile."""
    return spec.encoding_info.call_args(spec, cap)


def lut_spec(spec: Spec, topk: int) -> Spec:
    """The LUT spec of the same kernel fields and workload with LUT width `topk`: the spec of
    the LUT reference kernel that yardsticks any encoding on `reference_lut`."""
    return spec.replace(encoding="lut", window=None, topk=topk)


def validate(spec: Spec, *args: torch.Tensor, check_values: bool = False) -> Shapes:
    """The input checks of the spec's encoding on `call_args`-shaped arguments."""
    return spec.encoding_info.validate(spec, *args, check_values=check_values)
