"""Argument checks shared by every backend's op: types, dtypes, shapes, devices, contiguity,
and (on request) index values. Host-only unless ``check_values`` is set; raises before any
kernel launch, naming the argument."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from tilegen.spec import Spec

SPEC_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
TORCH_DTYPES = {v: k for k, v in SPEC_DTYPES.items()}


@dataclass(frozen=True)
class Shapes:
    """The sizes of one call. ``kv_seq_len`` and ``kv_heads`` are K/V's (None: q's);
    ``separate_kv`` says the kernels must address K/V on their own (their length or head count
    differs from q's, or the call passed its own ``q_vbs``: `tilegen.config.KernelConfig`)."""

    batch: int
    seq_len: int
    heads: int
    head_dim: int
    num_q_blocks: int
    num_kv_blocks: int
    topk: int
    kv_seq_len: int | None = None
    kv_heads: int | None = None
    separate_kv: bool = False

    def __post_init__(self) -> None:
        if self.kv_seq_len is None:
            object.__setattr__(self, "kv_seq_len", self.seq_len)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA/MQA; 1 for plain multi-head attention)."""
        return self.heads // self.kv_heads  # type: ignore[operator]


#: the families whose kernels take K/V of their own shape and a q_vbs (the error names them)
SEPARATE_KV_FAMILIES = ("the Triton family (tilegen.load(spec, backend='triton'); the Gluon "
                        "family's LUT forward takes them too)")


def _tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _bshd(spec: Spec, x: torch.Tensor) -> tuple[int, int, int, int]:
    """(B, S, H, D) of a 4-D tensor in the spec's layout."""
    if spec.layout == "bshd":
        B, S, H, D = x.shape
    else:
        B, H, S, D = x.shape
    return B, S, H, D


def validate_qkv(spec: Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 vbs: torch.Tensor, extra: tuple[tuple[str, object], ...] = (), *,
                 q_vbs: torch.Tensor | None = None, separate_kv: bool = False) -> Shapes:
    """The checks every encoding shares: q, k, v (dtype, 4-D, device, contiguity, head dim,
    whole cubes), vbs (int32, (NKV,)) and q_vbs (int32, (NQ,), optional); ``extra`` names more
    tensors that must be tensors on q's device. Returns the call's `Shapes` (topk 0).

    k and v share one shape. With ``separate_kv`` (a family whose kernels address K/V on their
    own) it may differ from q's in length (cross-attention: ``S_kv`` tokens, NKV cubes) and
    head count (GQA/MQA: ``H_q = g * H_kv``), and ``q_vbs`` gives the query cubes' real rows;
    without it such a call is refused, naming the family that takes it."""
    named = [("q", q), ("k", k), ("v", v), *extra, ("vbs", vbs)]
    if q_vbs is not None:
        named.append(("q_vbs", q_vbs))
    for name, x in named:
        _tensor(name, x)
    want = spec.torch_dtype
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != want:
            raise TypeError(f"{name} has dtype {x.dtype}, spec wants {want} (dtype={spec.dtype!r})")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D {spec.layout.upper()}, "
                             f"got shape {tuple(x.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"k and v must have one shape; got k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    B, S, H, D = _bshd(spec, q)
    Bk, S_kv, H_kv, Dk = _bshd(spec, k)
    separate = k.shape != q.shape or q_vbs is not None
    if separate and not separate_kv:
        what = ("q_vbs" if k.shape == q.shape else
                f"q {tuple(q.shape)} and k, v {tuple(k.shape)} differ in shape")
        raise ValueError(f"{what}: this family takes q, k, v of one shape and one vbs; "
                         f"cross-attention (S_q != S_kv), GQA/MQA and q_vbs run on "
                         f"{SEPARATE_KV_FAMILIES}")
    if Bk != B or Dk != D:
        raise ValueError(f"k, v {tuple(k.shape)} must have q's batch ({B}) and head dim ({D}); "
                         f"q is {tuple(q.shape)} ({spec.layout.upper()})")
    if H_kv < 1 or H % H_kv:
        raise ValueError(f"k has {H_kv} heads, which does not divide q's {H}: GQA/MQA needs "
                         "H_q = g * H_kv")
    device = q.device
    for name, x in named[1:]:
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but q is on {device}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not x.is_contiguous():
            raise ValueError(f"{name} is not contiguous in {spec.layout.upper()}; pass "
                             f"{name}.contiguous() or use a spec with the layout it has")
    if D != spec.head_dim:
        raise ValueError(f"q has head dim {D}, spec wants head_dim={spec.head_dim}")
    if S % spec.block_q:
        raise ValueError(f"q has sequence length {S}, not a multiple of block_q={spec.block_q} "
                         "(pad to whole cubes: tilegen.layout.to_cubes)")
    if S_kv % spec.block_kv:
        raise ValueError(f"k has sequence length {S_kv}, not a multiple of "
                         f"block_kv={spec.block_kv} (pad to whole cubes: tilegen.layout.to_cubes)")
    nq = S // spec.block_q
    nkv = S_kv // spec.block_kv
    if vbs.dtype != torch.int32:
        raise TypeError(f"vbs has dtype {vbs.dtype}, expected torch.int32")
    if tuple(vbs.shape) != (nkv,):
        raise ValueError(f"vbs must have shape (NKV,) = ({nkv},), got {tuple(vbs.shape)}")
    if q_vbs is not None:
        if q_vbs.dtype != torch.int32:
            raise TypeError(f"q_vbs has dtype {q_vbs.dtype}, expected torch.int32")
        if tuple(q_vbs.shape) != (nq,) or not q_vbs.is_contiguous():
            raise ValueError(f"q_vbs must be a contiguous (NQ,) = ({nq},) tensor, got shape "
                             f"{tuple(q_vbs.shape)}")
    return Shapes(B, S, H, D, nq, nkv, 0, S_kv, H_kv, separate)


def query_vbs(shapes: Shapes, vbs: torch.Tensor, q_vbs: torch.Tensor | None, block_q: int,
              cache: dict | None = None) -> torch.Tensor | None:
    """The kernels' Q_VBS for a call of separate K/V (None for any other call): the call's
    ``q_vbs``, else ``vbs`` when q and k/v have one length, else a tensor of full query cubes
    (kept in ``cache`` per device and cube count, so a call allocates none)."""
    if not shapes.separate_kv:
        return None
    if q_vbs is not None:
        return q_vbs
    if shapes.kv_seq_len == shapes.seq_len:
        return vbs
    key = (vbs.device, shapes.num_q_blocks, block_q)
    full = cache.get(key) if cache is not None else None
    if full is None:
        full = torch.full((shapes.num_q_blocks,), block_q, dtype=torch.int32, device=vbs.device)
        if cache is not None:
            cache[key] = full
    return full


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
    q_vbs: torch.Tensor | None = None,
    separate_kv: bool = False,
) -> Shapes:
    """Check shapes, dtypes, devices and index ranges against `spec`; raise before any launch.

    Errors name the argument: TypeError for a wrong type or dtype, ValueError for the rest.
    ``check_values`` also runs `check_input_values` (index, vbs and count ranges, distinct indices):
    one host sync. Backends whose kernels guard their loads and flag bad values on the device
    (`DeviceErrorFlag`) pass False on GPUs. ``q_vbs`` and ``separate_kv``: see `validate_qkv`
    (topk_idx then has one row per query cube and query head, with KV-cube ids).
    """
    shapes = validate_qkv(spec, q, k, v, vbs, extra=(("topk_idx", topk_idx),), q_vbs=q_vbs,
                          separate_kv=separate_kv)
    B, H, nq, nkv = shapes.batch, shapes.heads, shapes.num_q_blocks, shapes.num_kv_blocks
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
    shapes = dataclasses.replace(shapes, topk=topk)
    if check_values:
        check_input_values(spec, shapes, topk_idx, vbs, counts)
        check_vbs_values(spec, q_vbs, "q_vbs", spec.block_q)
    return shapes


def validate_mask_inputs(spec: Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor, vbs: torch.Tensor, *, check_values: bool = True,
                         q_vbs: torch.Tensor | None = None, separate_kv: bool = False
                         ) -> Shapes:
    """The checks of encoding "mask": q, k, v and vbs as every encoding (`validate_qkv`), and
    ``mask`` a contiguous (B, H, NQ, NKV) bool or uint8 tensor (nonzero = the KV cube is
    attended). Shapes.topk is NKV, the width of the LUT the mask turns into. ``check_values``
    checks the vbs values (one host sync); a mask has no bad values. ``q_vbs`` and
    ``separate_kv``: see `validate_qkv`."""
    shapes = validate_qkv(spec, q, k, v, vbs, extra=(("mask", mask),), q_vbs=q_vbs,
                          separate_kv=separate_kv)
    B, H, nq, nkv = shapes.batch, shapes.heads, shapes.num_q_blocks, shapes.num_kv_blocks
    if mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(f"mask has dtype {mask.dtype}, expected torch.bool or torch.uint8")
    if mask.dim() != 4 or tuple(mask.shape) != (B, H, nq, nkv):
        raise ValueError(f"mask must have shape (B, H, NQ, NKV) = ({B}, {H}, {nq}, {nkv}), "
                         f"got {tuple(mask.shape)}")
    if not mask.is_contiguous():
        raise ValueError("mask must be contiguous")
    if check_values:
        check_vbs_values(spec, vbs)
        check_vbs_values(spec, q_vbs, "q_vbs", spec.block_q)
    return dataclasses.replace(shapes, topk=nkv)


def validate_sliding_tile_inputs(spec: Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 vbs: torch.Tensor, *, check_values: bool = True,
                                 separate_kv: bool = False) -> Shapes:
    """The checks of encoding "sliding_tile": q, k, v and vbs as every encoding
    (`validate_qkv`); the sequence holds exactly the cubes of the spec's grid (the windows
    follow its cube grid), and per-head windows need q's head count to be the spec's.
    Shapes.topk is the largest window volume. ``check_values`` checks the vbs values (one host
    sync). With ``separate_kv``, k and v may have fewer heads (GQA/MQA), never another length:
    the windows are centred on one cube grid for both sides."""
    shapes = validate_qkv(spec, q, k, v, vbs, separate_kv=separate_kv)
    S, H, nq = shapes.seq_len, shapes.heads, shapes.num_q_blocks
    if shapes.kv_seq_len != S:
        raise ValueError(f"k has sequence length {shapes.kv_seq_len} but q {S}: sliding_tile "
                         "windows follow one cube grid (Spec.grid) for q and k/v; cross-attention "
                         "takes the lut or mask encoding")
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
    return dataclasses.replace(shapes, topk=max(volumes))


def check_vbs_values(spec: Spec, vbs: torch.Tensor | None, name: str = "vbs",
                     block: int | None = None) -> None:
    """vbs (or q_vbs) values in 1..block (when the spec masks partial cubes); one host sync."""
    block = block or spec.block_kv
    if spec.variable_block_sizes and vbs is not None and vbs.numel():
        lo, hi = int(vbs.min()), int(vbs.max())
        if lo < 1 or hi > block:
            raise ValueError(f"{name} holds values in [{lo}, {hi}], outside 1..{block}")


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
