"""Argument checks shared by every backend's op: types, dtypes, shapes, devices, contiguity,
and (on request) index values. Host-only unless ``check_values`` is set; raises before any
kernel launch, naming the argument."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tilegen.spec import Spec

SPEC_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
TORCH_DTYPES = {v: k for k, v in SPEC_DTYPES.items()}


@dataclass(frozen=True)
class Shapes:
    batch: int
    seq_len: int
    heads: int
    head_dim: int
    num_q_blocks: int
    num_kv_blocks: int
    topk: int


def _tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def validate_qkv(spec: Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 vbs: torch.Tensor, extra: tuple[tuple[str, object], ...] = ()
                 ) -> tuple[int, int, int, int, int, int]:
    """The checks every encoding shares: q, k, v (dtype, 4-D, one shape, device, contiguity,
    head dim, whole cubes) and vbs (int32, (NKV,)); ``extra`` names more tensors that must be
    tensors on q's device. Returns (B, S, H, D, NQ, NKV)."""
    for name, x in (("q", q), ("k", k), ("v", v), *extra, ("vbs", vbs)):
        _tensor(name, x)
    want = spec.torch_dtype
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != want:
            raise TypeError(f"{name} has dtype {x.dtype}, spec wants {want} (dtype={spec.dtype!r})")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D {spec.layout.upper()}, "
                             f"got shape {tuple(x.shape)}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must have one shape; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    device = q.device
    for name, x in (("k", k), ("v", v), *extra, ("vbs", vbs)):
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but q is on {device}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not x.is_contiguous():
            raise ValueError(f"{name} is not contiguous in {spec.layout.upper()}; pass "
                             f"{name}.contiguous() or use a spec with the layout it has")
    if spec.layout == "bshd":
        B, S, H, D = q.shape
    else:
        B, H, S, D = q.shape
    if D != spec.head_dim:
        raise ValueError(f"q has head dim {D}, spec wants head_dim={spec.head_dim}")
    if S % spec.block_q:
        raise ValueError(f"q has sequence length {S}, not a multiple of block_q={spec.block_q} "
                         "(pad to whole cubes: tilegen.layout.to_cubes)")
    nq = S // spec.block_q
    nkv = S // spec.block_kv
    if vbs.dtype != torch.int32:
        raise TypeError(f"vbs has dtype {vbs.dtype}, expected torch.int32")
    if tuple(vbs.shape) != (nkv,):
        raise ValueError(f"vbs must have shape (NKV,) = ({nkv},), got {tuple(vbs.shape)}")
    return B, S, H, D, nq, nkv


def validate_inputs(
    spec: Spec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    topk_idx: torch.Tensor,
    vbs: torch.Tensor,
    counts: torch.Tensor | None = None,
    *,
    check_values: bool = True,
) -> Shapes:
    """Check shapes, dtypes, devices and index ranges against `spec`; raise before any launch.

    Errors name the argument: TypeError for a wrong type or dtype, ValueError for the rest.
    ``check_values`` also runs `check_input_values` (index, vbs and count ranges, distinct indices):
    one host sync. Backends whose kernels guard their loads and flag bad values on the device
    (`DeviceErrorFlag`) pass False on GPUs.
    """
    B, S, H, D, nq, nkv = validate_qkv(spec, q, k, v, vbs, extra=(("topk_idx", topk_idx),))
    if topk_idx.dtype != torch.int32:
        raise TypeError(f"topk_idx has dtype {topk_idx.dtype}, expected torch.int32")
    if topk_idx.dim() != 4 or tuple(topk_idx.shape[:3]) != (B, H, nq):
        raise ValueError(f"topk_idx must have shape (B, H, NQ, TOPK) = ({B}, {H}, {nq}, TOPK), "
                         f"got {tuple(topk_idx.shape)}")
    topk = topk_idx.shape[3]
    if topk < 1 or topk > nkv:
        raise ValueError(f"topk_idx has TOPK={topk}; need 1 <= TOPK <= NKV={nkv}")
    if not topk_idx.is_contiguous():
        raise ValueError("topk_idx must be contiguous")
    if counts is not None:
        _tensor("counts", counts)
        if counts.dtype != torch.int32:
            raise TypeError(f"counts has dtype {counts.dtype}, expected torch.int32")
        if tuple(counts.shape) != (B, H, nq) or not counts.is_contiguous():
            raise ValueError(f"counts must be a contiguous (B, H, NQ) = ({B}, {H}, {nq}) tensor, "
                             f"got shape {tuple(counts.shape)}")
        if counts.device != q.device:
            raise ValueError(f"counts is on {counts.device} but q is on {q.device}")
    shapes = Shapes(B, S, H, D, nq, nkv, topk)
    if check_values:
        check_input_values(spec, shapes, topk_idx, vbs, counts)
    return shapes


def validate_mask_inputs(spec: Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor, vbs: torch.Tensor, *, check_values: bool = True
                         ) -> Shapes:
    """The checks of encoding "mask": q, k, v and vbs as every encoding (`validate_qkv`), and
    ``mask`` a contiguous (B, H, NQ, NKV) bool or uint8 tensor (nonzero = the KV cube is
    attended). Shapes.topk is NKV, the width of the LUT the mask turns into. ``check_values``
    checks the vbs values (one host sync); a mask has no bad values."""
    B, S, H, D, nq, nkv = validate_qkv(spec, q, k, v, vbs, extra=(("mask", mask),))
    if mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(f"mask has dtype {mask.dtype}, expected torch.bool or torch.uint8")
    if mask.dim() != 4 or tuple(mask.shape) != (B, H, nq, nkv):
        raise ValueError(f"mask must have shape (B, H, NQ, NKV) = ({B}, {H}, {nq}, {nkv}), "
                         f"got {tuple(mask.shape)}")
    if not mask.is_contiguous():
        raise ValueError("mask must be contiguous")
    if check_values:
        check_vbs_values(spec, vbs)
    return Shapes(B, S, H, D, nq, nkv, nkv)


def validate_sliding_tile_inputs(spec: Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 vbs: torch.Tensor, *, check_values: bool = True) -> Shapes:
    """The checks of encoding "sliding_tile": q, k, v and vbs as every encoding
    (`validate_qkv`); the sequence holds exactly the cubes of the spec's grid (the windows
    follow its cube grid), and per-head windows need q's head count to be the spec's.
    Shapes.topk is the largest window volume. ``check_values`` checks the vbs values (one host
    sync)."""
    B, S, H, D, nq, nkv = validate_qkv(spec, q, k, v, vbs)
    if nq != spec.num_cubes:
        raise ValueError(f"q has {nq} cubes (S={S}) but the spec's grid {spec.grid} with cube "
                         f"{spec.cube} has {spec.num_cubes} (cube grid {spec.cube_grid}); "
                         "sliding_tile windows follow the spec's cube grid (Spec.grid)")
    per_head = isinstance(spec.window[0], tuple)
    if per_head and H != spec.num_heads:
        raise ValueError(f"q has {H} heads but Spec.window lists {spec.num_heads} windows, one "
                         "per head")
    if check_values:
        check_vbs_values(spec, vbs)
    volumes = [math.prod(w) for w in spec.windows]
    return Shapes(B, S, H, D, nq, nkv, max(volumes))


def check_vbs_values(spec: Spec, vbs: torch.Tensor) -> None:
    """vbs values in 1..block (when the spec masks partial cubes); one host sync."""
    if spec.variable_block_sizes and vbs.numel():
        lo, hi = int(vbs.min()), int(vbs.max())
        if lo < 1 or hi > spec.block_kv:
            raise ValueError(f"vbs holds values in [{lo}, {hi}], outside 1..{spec.block_kv}")


def check_sm_scale(sm_scale: object) -> None:
    """sm_scale is None (1/sqrt(D)) or a positive, finite number."""
    if sm_scale is None:
        return
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, int | float):
        raise TypeError(f"sm_scale must be a float or None, got {type(sm_scale).__name__}")
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be positive and finite, got {sm_scale!r}")


def check_input_values(spec: Spec, shapes: Shapes, topk_idx: torch.Tensor, vbs: torch.Tensor,
                 counts: torch.Tensor | None = None) -> None:
    """The eager value checks (``check_values=True``; always on the CPU): index range, vbs
    range, counts range and distinct indices within each row's used prefix. Reads the answer
    back from the device: one host sync."""
    nkv, topk = shapes.num_kv_blocks, shapes.topk
    if topk_idx.numel():
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < 0 or hi >= nkv:
            raise ValueError(f"topk_idx holds values in [{lo}, {hi}], outside [0, NKV={nkv})")
    check_vbs_values(spec, vbs)
    if counts is not None and counts.numel():
        lo, hi = int(counts.min()), int(counts.max())
        if lo < 0 or hi > topk:
            raise ValueError(f"counts holds values in [{lo}, {hi}], outside 0..TOPK={topk}")
    if topk_idx.numel() and topk > 1:
        idx = topk_idx.long()
        if counts is not None:  # slots past a row's count are never read: give them unique ids
            slot = torch.arange(topk, device=idx.device)
            unused = slot >= counts.long()[..., None]
            idx = torch.where(unused, -1 - slot, idx)
        ordered = idx.sort(dim=-1).values
        dup = ordered[..., 1:] == ordered[..., :-1]
        if bool(dup.any()):
            where = dup.any(dim=-1).nonzero()[0].tolist()
            row = ordered[tuple(where)]
            value = int(row[1:][row[1:] == row[:-1]][0])
            raise ValueError(f"topk_idx row (b, h, q) = {tuple(where)} holds index {value} "
                             "more than once; indices within a row must be distinct")


def needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


#: the error word's bits where a kernel tells the kinds apart (`DeviceErrorFlag(kinds=True)`)
ERROR_KINDS = {1: "a topk_idx entry outside [0, NKV)", 2: "a vbs entry outside 1..block",
               4: "a count outside 0..TOPK"}


class DeviceErrorFlag:
    """An int32 error word the kernel sets on the device when it meets a bad index, vbs or count,
    read back without a host sync.

    After each launch the word is copied to pinned host memory on the launch stream and an event
    is recorded; the next call looks at it only once that event has completed (no waiting).
    `check()` waits and raises. During CUDA graph capture nothing is copied: the kernel still
    sets the word, and `check()` after a replay reads it.

    ``kinds=True``: the kernels set one bit per kind of bad value (`ERROR_KINDS`: 1 index,
    2 vbs, 4 counts; the Gluon pre-pass and `tilegen.guard`) and the error names them; the
    Triton kernels store 1 for any kind, so their error names none."""

    def __init__(self, kinds: bool = False) -> None:
        self.kinds = kinds
        self._dev: dict[torch.device, torch.Tensor] = {}
        self._host: dict[torch.device, torch.Tensor] = {}
        self._event: dict[torch.device, torch.cuda.Event] = {}

    def buffer(self, device: torch.device) -> torch.Tensor:
        """The device word for `device` (zeroed on first use)."""
        buf = self._dev.get(device)
        if buf is None:
            buf = self._dev[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return buf

    def after_launch(self, device: torch.device) -> None:
        if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return
        host = self._host.get(device)
        if host is None:
            host = self._host[device] = torch.zeros(1, dtype=torch.int32).pin_memory()
            self._event[device] = torch.cuda.Event()
        host.copy_(self._dev[device], non_blocking=True)
        self._event[device].record()

    def raise_pending(self, device: torch.device) -> None:
        """Raise for an earlier launch on `device` whose flag is known set (never waits)."""
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return  # no event queries inside a graph capture; `check()` after a replay
        event = self._event.get(device)
        if event is None or not event.query():
            return
        self._raise_if_set(device)

    def check(self, device: torch.device | None = None) -> None:
        """Wait for the launches so far and raise if any of them met a bad value."""
        for dev in [device] if device is not None else list(self._dev):
            if dev not in self._dev:
                continue
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            host = self._host.get(dev)
            if host is not None:
                host.copy_(self._dev[dev])
            self._raise_if_set(dev, fresh=self._dev[dev].cpu())

    def _raise_if_set(self, device: torch.device, fresh: torch.Tensor | None = None) -> None:
        word = int((fresh if fresh is not None else self._host[device]).item())
        if word:
            self._dev[device].zero_()
            if device in self._host:
                self._host[device].zero_()
            found = [what for bit, what in ERROR_KINDS.items() if word & bit] if self.kinds else []
            raise ValueError(
                "an earlier block-sparse attention call met a bad value ("
                + (" and ".join(found) if found else "a topk_idx entry outside [0, NKV), a vbs "
                   "entry outside 1..block or a count outside 0..TOPK")
                + "); the rows it touched came out NaN. Call with check_values=True to find it.")
