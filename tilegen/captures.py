"""Capture I/O, Wan2.2-like synthetic captures, and THE scoring rule.

A capture is a dict with ``q, k, v`` ``(B, S, H, D)`` (cube-major padded, BSHD), ``topk_idx``
``(B, H, NQ, TOPK)`` int32, ``vbs`` ``(NKV,)`` int32, optional metadata (``call``, ``step``,
``block``, ...) and, when a ground truth is bundled, ``o_ref`` ``(B, S, H, D)`` and ``lse_ref``
``(B, H, S)`` fp32 (base-2 log-sum-exp).

On disk (``torch.load(path, weights_only=True)``) the real files spell the index ``topk_idx`` or
``idx`` and the ground truth ``o_triton`` / ``m_triton``; :func:`load` accepts both and
:func:`save` writes that same format.

Checksums: :func:`save` adds the key ``"checksums"`` (:data:`CHECKSUM_KEY`), a plain
``{name: hex}`` dict of str with one entry per saved tensor, keyed by its on-disk name (``q``,
``k``, ``v``, ``topk_idx`` or ``idx``, ``vbs``, ``o_triton``, ``m_triton``). Each value is the
sha256 hex digest of the tensor's raw bytes in C order (as stored by ``torch.save`` on a
little-endian host), i.e. ``hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy())``.
:func:`load` verifies every entry and raises ``ValueError`` naming the file and the tensor whose
bytes differ. Files without the key (the real captures, files written by other tools or by
older tilegen) still load; the first one in a process is noted once on the ``tilegen`` logger.

A file that cannot be read as a capture (empty, truncated, not a ``torch.save`` archive, or
holding objects other than tensors and plain data) raises ``ValueError`` naming the path. Files
are always read with ``weights_only=True``: a capture never needs to run pickled code.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import pickle
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tilegen import layout, sparsity
from tilegen.cache import atomic_write

__all__ = [
    "CHECKSUM_KEY",
    "COS_MIN",
    "MAX_ABS",
    "MEAN_ABS",
    "Score",
    "score",
    "load",
    "save",
    "validate",
    "synthesize",
    "synthesize_for",
    "for_spec",
]

# --- the scoring rule's thresholds (contract.md "Scoring rule"); used only by score() ---------
COS_MIN = 0.9999  # per-head cosine, min over (b, h), must be >= this
MAX_ABS = 3e-2  # max |o - o_ref| must be <= this
MEAN_ABS = 1e-4  # mean |o - o_ref| must be <= this

# |v| bound of synthetic captures: bf16 spacing in [1, 2) is 2^-7, far under MAX_ABS
V_BOUND = 2.0

# metadata carried through load/save untouched (plain Python values, weights_only-safe)
_META_KEYS = ("call", "step", "block", "outlier_heads", "grid", "cube", "seed")

#: key of the per-tensor sha256 record that :func:`save` writes and :func:`load` verifies
CHECKSUM_KEY = "checksums"

logger = logging.getLogger("tilegen")
_NOTED_UNCHECKED = False  # the "no checksum" note is logged once per process


# ============================================================================ scoring


@dataclass(frozen=True)
class Score:
    """Result of :func:`score`. ``head_cos`` is ``(B, H)`` fp64 on the CPU."""

    finite: bool
    min_head_cos: float
    max_abs: float
    mean_abs: float
    passed: bool
    head_cos: torch.Tensor = field(repr=False, compare=False)

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"finite={self.finite} min_head_cos={self.min_head_cos:.6f} "
            f"max|Δ|={self.max_abs:.2e} mean|Δ|={self.mean_abs:.2e} -> {verdict}"
        )


def score(o: torch.Tensor, o_ref: torch.Tensor, *, layout: str = "bshd") -> Score:
    """Score a candidate output against the reference: the one place the rule lives.

    A candidate passes iff (contract.md):
      1. every element of ``o`` is finite;
      2. ``min over (b, h)`` of ``cosine(o[b, :, h, :], o_ref[b, :, h, :])`` (flattened) is
         ``>= COS_MIN``;
      3. ``max|o - o_ref| <= MAX_ABS`` and ``mean|o - o_ref| <= MEAN_ABS``.

    Args:
        o, o_ref: same shape, ``(B, S, H, D)`` for ``layout="bshd"`` or ``(B, H, S, D)`` for
            ``layout="bhsd"``; any floating dtype.
        layout: layout of both tensors.

    Everything is computed in fp64, one (b, h) head at a time on the tensors' device (two fp64
    copies of one head at a time, never of the whole tensor): for bf16, fp16 and fp32 inputs the
    products and differences are exact and the sums' rounding error is far below 1e-9, so the
    rule's margins (1e-4 on the cosine) are not eaten by rounding and identical outputs score a
    cosine of 1. The cosine is ``o.o_ref / sqrt(max(|o|^2 |o_ref|^2, 1e-16))``, as
    ``torch.nn.functional.cosine_similarity``. Non-finite values never raise: they make the
    cosine and the differences NaN/inf, which fail.
    """
    for name, t in (("o", o), ("o_ref", o_ref)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got dtype {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
    if o.shape != o_ref.shape:
        raise ValueError(f"o and o_ref shapes differ: {tuple(o.shape)} vs {tuple(o_ref.shape)}")
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout must be 'bshd' or 'bhsd', got {layout!r}")
    if o_ref.device != o.device:
        o_ref = o_ref.to(o.device)

    o, o_ref = o.detach(), o_ref.detach()
    if layout == "bshd":  # per-head views: (B, H, S, D)
        o, o_ref = o.permute(0, 2, 1, 3), o_ref.permute(0, 2, 1, 3)
    bsz, heads = o.shape[0], o.shape[1]
    f64 = dict(dtype=torch.float64, device=o.device)
    dots, norms_a, norms_b, max_d, sum_d = (torch.zeros((bsz, heads), **f64) for _ in range(5))
    finite = torch.ones((bsz, heads), dtype=torch.bool, device=o.device)
    buf_a = torch.empty(o.shape[2:], **f64)  # one head of each, reused: no per-head allocation
    buf_b = torch.empty(o.shape[2:], **f64)
    a, b = buf_a.view(-1), buf_b.view(-1)
    for bi in range(bsz):
        for h in range(heads):
            buf_a.copy_(o[bi, h])
            buf_b.copy_(o_ref[bi, h])
            dots[bi, h] = torch.dot(a, b)
            norms_a[bi, h] = na = torch.dot(a, a)
            norms_b[bi, h] = torch.dot(b, b)
            # a finite sum of squares means every element is finite; only then is it skipped
            if not bool(torch.isfinite(na)):
                finite[bi, h] = torch.isfinite(a).all()
            if a.numel():
                diff = a.sub_(b).abs_()  # in place: buf_a now holds |o - o_ref|
                max_d[bi, h] = diff.max()
                sum_d[bi, h] = diff.sum()
    head_cos = dots / (norms_a * norms_b).clamp(min=1e-16).sqrt()
    numel = o.numel()
    finite_ok = bool(finite.all())
    cos_min = float(head_cos.min()) if head_cos.numel() else float("nan")
    max_abs = float(max_d.max()) if max_d.numel() else 0.0
    mean_abs = float(sum_d.sum()) / numel if numel else 0.0
    passed = finite_ok and cos_min >= COS_MIN and max_abs <= MAX_ABS and mean_abs <= MEAN_ABS
    return Score(
        finite=finite_ok,
        min_head_cos=cos_min,
        max_abs=max_abs,
        mean_abs=mean_abs,
        passed=passed,
        head_cos=head_cos.cpu(),
    )


GRAD_COS_MIN = 0.9999  # per-head cosine of a gradient, min over (b, h)
GRAD_MAX_REL = 1e-2  # max |g - g_ref| <= GRAD_MAX_REL * max |g_ref| (of that tensor)


@dataclass(frozen=True)
class GradScore:
    """Result of :func:`grad_score` for one gradient tensor (dq, dk or dv)."""

    finite: bool
    min_head_cos: float
    max_abs: float
    ref_max: float
    passed: bool

    @property
    def max_rel(self) -> float:
        return self.max_abs / self.ref_max if self.ref_max > 0 else float(self.max_abs > 0)

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"finite={self.finite} min_head_cos={self.min_head_cos:.6f} "
                f"max|Δ|={self.max_abs:.2e} ({self.max_rel:.1e} of max|ref|={self.ref_max:.2e}) "
                f"-> {verdict}")


def grad_score(g: torch.Tensor, g_ref: torch.Tensor, *, layout: str = "bshd") -> GradScore:
    """Score a gradient (dq, dk or dv) against the fp32 autograd reference: the backward's rule.

    A gradient passes iff
      1. every element is finite;
      2. ``min over (b, h)`` of the per-head cosine (as :func:`score`: fp64, one head at a time,
         flattened over tokens and head dim) is ``>= GRAD_COS_MIN`` (0.9999); a head whose
         reference and candidate are both all zero counts as cosine 1;
      3. ``max|g - g_ref| <= GRAD_MAX_REL * max|g_ref|`` (1e-2 of the tensor's own scale:
         gradients have no fixed scale, unlike outputs).
    The reference is :func:`tilegen.reference.attention_grads_fp32` (autograd through the fp32
    reference, padded query rows of dO masked).
    """
    s = score(g, g_ref, layout=layout)
    ref = g_ref.detach().to(g.device)
    heads = (ref.permute(0, 2, 1, 3) if layout == "bshd" else ref)
    cand = (g.detach().permute(0, 2, 1, 3) if layout == "bshd" else g.detach())
    zero = (heads.flatten(2).abs().amax(-1) == 0) & (cand.flatten(2).abs().amax(-1) == 0)
    head_cos = torch.where(zero.cpu(), 1.0, s.head_cos)
    cos_min = float(head_cos.min()) if head_cos.numel() else float("nan")
    ref_max = float(ref.abs().max()) if ref.numel() else 0.0
    passed = (s.finite and cos_min >= GRAD_COS_MIN
              and s.max_abs <= GRAD_MAX_REL * ref_max)
    return GradScore(finite=s.finite, min_head_cos=cos_min, max_abs=s.max_abs, ref_max=ref_max,
                     passed=passed)


# ============================================================================ load / save


def _require_tensor(cap: dict, key: str) -> torch.Tensor:
    t = cap.get(key)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"capture key {key!r} must be a tensor, got {type(t).__name__}")
    return t


def validate(cap: dict) -> dict:
    """Check a capture dict's keys, shapes, dtypes and index ranges; return it unchanged.

    Raises ValueError/TypeError naming the offending key.
    """
    if not isinstance(cap, dict):
        raise TypeError(f"capture must be a dict, got {type(cap).__name__}")
    missing = [k for k in ("q", "k", "v", "topk_idx", "vbs") if k not in cap]
    if missing:
        raise ValueError(f"capture is missing key(s) {missing}; has {sorted(cap)}")
    q, k, v = (_require_tensor(cap, n) for n in ("q", "k", "v"))
    idx, vbs = _require_tensor(cap, "topk_idx"), _require_tensor(cap, "vbs")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"capture {name!r} must be 4-D (B, S, H, D), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"capture {name!r} must be floating, got {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"capture 'k' {tuple(k.shape)} and 'v' {tuple(v.shape)} differ in shape")
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(f"capture 'q' {tuple(q.shape)} and 'k' {tuple(k.shape)} differ in B/H/D")
    if vbs.dim() != 1 or vbs.numel() == 0 or vbs.is_floating_point():
        raise ValueError(f"capture 'vbs' must be a non-empty 1-D int tensor, got "
                         f"{tuple(vbs.shape)} {vbs.dtype}")
    nkv = vbs.shape[0]
    if k.shape[1] % nkv:
        raise ValueError(f"capture 'k' length {k.shape[1]} is not a multiple of len(vbs)={nkv}")
    block = k.shape[1] // nkv
    if q.shape[1] % block:
        raise ValueError(f"capture 'q' length {q.shape[1]} is not a multiple of block={block}")
    nq = q.shape[1] // block
    if int(vbs.min()) < 1 or int(vbs.max()) > block:
        raise ValueError(f"capture 'vbs' values must lie in 1..{block}")
    if idx.dim() != 4 or idx.is_floating_point():
        raise ValueError(f"capture 'topk_idx' must be a 4-D int tensor (B, H, NQ, TOPK), got "
                         f"{tuple(idx.shape)} {idx.dtype}")
    if tuple(idx.shape[:3]) != (q.shape[0], q.shape[2], nq):
        raise ValueError(f"capture 'topk_idx' shape {tuple(idx.shape)} does not match "
                         f"(B, H, NQ)=({q.shape[0]}, {q.shape[2]}, {nq})")
    if idx.shape[3] < 1 or idx.shape[3] > nkv:
        raise ValueError(f"capture 'topk_idx' TOPK={idx.shape[3]} must lie in 1..NKV={nkv}")
    if int(idx.min()) < 0 or int(idx.max()) >= nkv:
        raise ValueError(f"capture 'topk_idx' ids must lie in [0, {nkv})")
    if "o_ref" in cap:
        o_ref = _require_tensor(cap, "o_ref")
        if o_ref.shape != q.shape:
            raise ValueError(f"capture 'o_ref' shape {tuple(o_ref.shape)} != q {tuple(q.shape)}")
    if "lse_ref" in cap:
        lse = _require_tensor(cap, "lse_ref")
        want = (q.shape[0], q.shape[2], q.shape[1])
        if tuple(lse.shape) != want:
            raise ValueError(f"capture 'lse_ref' shape {tuple(lse.shape)} != (B, H, S)={want}")
    return cap


_WHAT = "a capture is a torch.save dict of tensors q, k, v, topk_idx, vbs"
# torch.save's legacy (pre-zip) format starts with the pickled magic number
_LEGACY_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19."


def _first_sentence(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split(". ")[0].rstrip(".")


def _read(path: str | os.PathLike) -> Any:
    """``torch.load(path, weights_only=True)`` with every failure a ValueError naming the path.

    Never suggests ``weights_only=False``: a capture holds tensors and plain data only.
    """
    size = os.stat(path).st_size  # FileNotFoundError as is
    if size == 0:
        raise ValueError(f"{path}: the file is empty, not a capture ({_WHAT})")
    with open(path, "rb") as f:
        head = f.read(len(_LEGACY_MAGIC))
    archive = head.startswith(b"PK\x03\x04")  # torch.save's format is a zip archive
    try:
        return torch.load(os.fspath(path), map_location="cpu", weights_only=True)
    except (OSError, MemoryError):
        raise
    except Exception as exc:  # torch raises RuntimeError, UnpicklingError, EOFError, ...
        if archive and not zipfile.is_zipfile(path):
            cause = (f"the zip archive torch.save writes has no central directory (the end of "
                     f"the file, {size} bytes long, is missing or overwritten)")
            raise ValueError(f"{path}: the capture file is truncated or damaged: {cause}; "
                             f"copy or write it again") from None
        if archive or head == _LEGACY_MAGIC:
            if isinstance(exc, pickle.UnpicklingError) and "Unsupported global" in str(exc):
                raise ValueError(
                    f"{path}: not a capture: the torch.save archive holds objects other than "
                    f"tensors and plain data, which tilegen never loads ({_WHAT})") from None
            raise ValueError(f"{path}: the capture file is truncated or damaged "
                             f"({type(exc).__name__}: {_first_sentence(exc)}); copy or write "
                             f"it again") from None
        raise ValueError(f"{path}: not a capture: the file is not a torch.save archive "
                         f"({_WHAT})") from None


def _sha256(t: torch.Tensor) -> str:
    data = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy()).hexdigest()


def _verify_checksums(raw: dict, path: str | os.PathLike) -> None:
    """Check every tensor against the sha256 that `save` recorded; ValueError on a mismatch."""
    global _NOTED_UNCHECKED
    sums = raw.get(CHECKSUM_KEY)
    tensors = sorted(k for k, t in raw.items() if isinstance(t, torch.Tensor))
    if sums is None:
        if not _NOTED_UNCHECKED:
            _NOTED_UNCHECKED = True
            logger.warning("note: capture %s has no %r record, so damaged data in it cannot be "
                           "detected (captures.save writes one); further files without one are "
                           "not reported", path, CHECKSUM_KEY)
        return
    if not isinstance(sums, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in sums.items()):
        raise ValueError(f"{path}: the {CHECKSUM_KEY!r} record is damaged (expected a dict of "
                         f"tensor name -> sha256 hex digest); the file cannot be verified")
    missing = sorted(set(sums) - set(tensors))
    if missing:
        raise ValueError(f"{path}: the {CHECKSUM_KEY!r} record names tensor(s) {missing} that "
                         f"the file does not hold; the file is damaged")
    unlisted = sorted(set(tensors) - set(sums))
    if unlisted:
        raise ValueError(f"{path}: tensor(s) {unlisted} have no checksum in the "
                         f"{CHECKSUM_KEY!r} record; the file was changed after it was saved")
    bad = [k for k in tensors if _sha256(raw[k]) != sums[k].lower()]
    if bad:
        names = ", ".join(repr(k) for k in bad)
        raise ValueError(f"{path}: tensor {names} does not match its sha256 checksum: the file "
                         f"is damaged (flipped bytes); copy or write it again")


def load(path: str | os.PathLike, device: torch.device | str | None = None) -> dict:
    """Load a capture file into a validated dict.

    Keys: ``q, k, v, topk_idx, vbs`` (the file may spell the index ``idx``), plus ``o_ref`` /
    ``lse_ref`` when the file bundles ``o_triton`` / ``m_triton``, plus any of
    ``call, step, block, outlier_heads, grid, cube, seed`` present. Tensors go to ``device``
    (default: stay on the CPU).

    Raises ValueError naming the path when the file is empty, truncated or damaged, is not a
    capture, or a tensor's bytes differ from the sha256 that :func:`save` recorded (see the
    module docstring); FileNotFoundError when it does not exist.
    """
    raw = _read(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a capture: expected a dict of tensors, got "
                         f"{type(raw).__name__}")
    _verify_checksums(raw, path)
    if "topk_idx" in raw:
        idx = raw["topk_idx"]
    elif "idx" in raw:
        idx = raw["idx"]
    else:
        raise ValueError(f"{path}: no 'topk_idx' (or 'idx') key; keys are {sorted(raw)}")
    missing = [k for k in ("q", "k", "v", "vbs") if k not in raw]
    if missing:
        raise ValueError(f"{path}: missing key(s) {missing}; keys are {sorted(raw)}")
    cap: dict[str, Any] = {"q": raw["q"], "k": raw["k"], "v": raw["v"], "topk_idx": idx,
                           "vbs": raw["vbs"]}
    for src, dst in (("o_triton", "o_ref"), ("o_ref", "o_ref"),
                     ("m_triton", "lse_ref"), ("lse_ref", "lse_ref")):
        if src in raw and dst not in cap:
            cap[dst] = raw[src]
    for key in _META_KEYS:
        if key in raw:
            cap[key] = raw[key]
    try:
        validate(cap)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{path}: {e}") from None
    if device is not None:
        cap = {k: (t.to(device) if isinstance(t, torch.Tensor) else t) for k, t in cap.items()}
    return cap


def save(cap: dict, path: str | os.PathLike, *, index_key: str = "topk_idx") -> None:
    """Write a capture in the real files' format, atomically.

    Written keys: ``q, k, v, <index_key>, vbs`` (``index_key`` is ``"topk_idx"`` or ``"idx"``, the
    outlier file's spelling), the metadata keys present (``call, step, block, outlier_heads, grid,
    cube, seed``), ``o_ref`` / ``lse_ref`` as ``o_triton`` / ``m_triton`` like the outlier file,
    and ``checksums`` (:data:`CHECKSUM_KEY`): the sha256 of each tensor, which :func:`load`
    verifies. Tensors are saved contiguous on the CPU. The file is written to a temporary file in
    the same directory and moved into place with ``os.replace``, so readers never see a partial
    file.
    """
    if index_key not in ("topk_idx", "idx"):
        raise ValueError(f"index_key must be 'topk_idx' or 'idx', got {index_key!r}")
    validate(cap)
    out: dict[str, Any] = {}
    for src, dst in (("q", "q"), ("k", "k"), ("v", "v"), ("topk_idx", index_key), ("vbs", "vbs"),
                     ("o_ref", "o_triton"), ("lse_ref", "m_triton")):
        if src in cap:
            out[dst] = cap[src].detach().to("cpu").contiguous()
    for key in _META_KEYS:
        if key in cap:
            val = cap[key]
            out[key] = list(val) if isinstance(val, tuple) and key == "outlier_heads" else val
    out[CHECKSUM_KEY] = {k: _sha256(t) for k, t in out.items() if isinstance(t, torch.Tensor)}
    atomic_write(Path(path), lambda f: torch.save(out, f))


# ============================================================================ synthesis

_ROPE_THETA = 10000.0


def _rope_bands(head_dim: int) -> tuple[int, int, int]:
    """Wan's split of head_dim into (t, h, w) RoPE bands: d - 4*(d//6), 2*(d//6), 2*(d//6)."""
    s = head_dim // 6
    return head_dim - 4 * s, 2 * s, 2 * s


def _rope_tables(
    grid: tuple[int, int, int], head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``(N, head_dim // 2)`` for Wan 3D RoPE, tokens row-major over (t, h, w)."""
    T, H, W = grid
    t = torch.arange(T, device=device).repeat_interleave(H * W)
    h = torch.arange(H, device=device).repeat_interleave(W).repeat(T)
    w = torch.arange(W, device=device).repeat(T * H)
    angles = []
    for pos, dim in zip((t, h, w), _rope_bands(head_dim), strict=True):
        exps = torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim
        inv = 1.0 / _ROPE_THETA**exps
        angles.append(pos.to(torch.float64)[:, None] * inv[None, :])
    ang = torch.cat(angles, dim=1)
    return torch.cos(ang).to(torch.float32), torch.sin(ang).to(torch.float32)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of ``x`` ``(h, N, D)`` by the per-token angles.

    ``(x0 cos - x1 sin, x0 sin + x1 cos)``. On the CPU as one complex multiply, ~10x faster than
    the four real products and a stack, and bit-identical to them: ATen's vectorized complex
    product rounds ``ac - bd`` and ``ad + bc`` the same way (no fused multiply-add). Elsewhere
    (CUDA may contract into FMA) the real form keeps each device's stream as it was.
    """
    xp = x.view(*x.shape[:-1], -1, 2)
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous():
        rot = torch.view_as_complex(xp) * torch.complex(cos, sin)
        return torch.view_as_real(rot).view_as(x)
    x0, x1 = xp[..., 0], xp[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.view_as(x)


def _low_freq_pairs(head_dim: int, per_band: int = 2) -> list[int]:
    """The slowest-rotating RoPE pairs (last pairs of each band): alignment survives position."""
    pairs, start = [], 0
    for dim in _rope_bands(head_dim):
        n = dim // 2
        pairs += list(range(start + n - min(per_band, n), start + n))
        start += n
    return pairs


def _fourier_basis(
    pos: torch.Tensor, freqs: torch.Tensor, phase: torch.Tensor
) -> torch.Tensor:
    """Random Fourier features: ``sqrt(2/M) cos(2 pi pos @ f + phase)``.

    pos ``(N, 3)``, freqs ``(h, M, 3)`` cycles/token, phase ``(h, M)`` -> ``(h, N, M)``.
    """
    m = freqs.shape[1]
    arg = torch.einsum("nc,hmc->hnm", pos, freqs) * (2 * math.pi) + phase[:, None, :]
    return torch.cos(arg) * math.sqrt(2.0 / m)


def _rand(shape: Sequence[int], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.rand(tuple(shape), generator=gen, device=device)


def _randn(shape: Sequence[int], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=gen, device=device)


def _uniform(shape: Sequence[int], lo: float, hi: float, gen: torch.Generator,
             device: torch.device) -> torch.Tensor:
    return lo + (hi - lo) * _rand(shape, gen, device)


def _resolve_outlier(outlier: object, heads: int, gen: torch.Generator) -> list[int]:
    if outlier is None or outlier is False:
        return []
    if outlier is True:
        # drawn on a CPU generator seeded from the main one: the index depends only on the seed
        return [int(torch.randint(heads, (1,), generator=gen).item())]
    if isinstance(outlier, int):
        items = [outlier]
    elif isinstance(outlier, Sequence) and not isinstance(outlier, str):
        items = list(outlier)
    else:
        raise TypeError(f"outlier must be True/False/None, a head index or a list of them, "
                        f"got {outlier!r}")
    out = []
    for h in items:
        if isinstance(h, bool) or not isinstance(h, int):
            raise TypeError(f"outlier head indices must be ints, got {h!r}")
        if not 0 <= h < heads:
            raise ValueError(f"outlier head {h} is outside 0..{heads - 1}")
        out.append(h)
    return sorted(set(out))


def _check_synth_args(grid, heads, head_dim, topk, batch, dtype, cube):
    g = layout._triple(grid, "grid")
    c = layout._triple(cube, "cube")
    for name, v in (("heads", heads), ("head_dim", head_dim), ("topk", topk), ("batch", batch)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {v!r}")
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"head_dim must be even and >= 6 (Wan RoPE splits it into t/h/w bands "
                         f"of {_rope_bands(max(head_dim, 6))}), got {head_dim}")
    nc = math.prod(layout.cube_grid(g, c))
    if topk > nc:
        raise ValueError(f"topk={topk} exceeds the number of cubes NKV={nc} for grid={g}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return g, c


def synthesize(
    seed: int = 0,
    grid: Sequence[int] = (21, 30, 52),
    heads: int = 40,
    head_dim: int = 128,
    topk: int = 78,
    outlier: bool | int | Sequence[int] | None = True,
    batch: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    cube: Sequence[int] = (4, 4, 4),
    *,
    outlier_logit: float = 300.0,
    progress: Callable[[int, int], object] | None = None,
) -> dict:
    """A Wan2.2-like synthetic capture, seeded and deterministic.

    The default is the contract workload: ``q, k, v`` ``(1, 39936, 40, 128)`` bf16, ``topk_idx``
    ``(1, 40, 624, 78)`` int32, ``vbs`` ``(624,)`` int32. Returned keys: ``q, k, v, topk_idx, vbs,
    outlier_heads`` (list of int), ``grid, cube, seed, block`` (tokens per cube).

    It closes the loopholes the real captures close (the Wan2.2 capture benchmark behind
    contract.md):

    * **Per-head, data-dependent selection.** ``topk_idx`` is :func:`sparsity.mean_pool_topk` of the
      synthesized q/k (mean-pooled cube scores, per head), so it is neither a sliding window nor
      shared across heads: every head has its own fields, frequencies and gains.
    * **Real q/k structure and magnitude.** Per head: a smooth content field (random Fourier
      features over (t, h, w) with head-specific low frequencies; k's field correlated with q's, so
      similar content attends across distance) + a per-head mean direction (with RoPE this gives a
      locality bias) + per-token noise; then RMSNorm per token per head with per-head, per-channel
      gains (Wan's norm_q/norm_k); then Wan 3D RoPE (head_dim split into t/h/w bands of
      ``d - 4*(d//6), 2*(d//6), 2*(d//6)``, theta 10000, pairs (2i, 2i+1) rotated). Built in
      row-major token order, then reordered with :func:`layout.to_cubes` (zero padding).
    * **Partial cubes.** 21x30x52 with 4x4x4 cubes gives ``vbs`` in {64, 32, 16, 8}.
    * **Outlier head(s).** ``outlier=True`` picks one head from the seed (``False``/``None``: none;
      an int or list: those heads). In a smooth ~20% region of the grid, that head's q is dominated
      by a few slow-RoPE channels aligned with a constant k direction, with large gains there, so
      the max logit ``q.k * sm_scale`` is about ``outlier_logit`` (~300 natural units) while q/k
      stay finite in bf16 (|x| < ~50). A softmax without row-max subtraction overflows fp32 ``exp``
      (> ~88.7) on those rows: non-finite output in the outlier head only. Other heads keep max
      logits of a few tens.
    * **Smooth v.** v is a per-head smooth field + per-channel bias + noise (RMS ~1), softly
      bounded to ``|v| < V_BOUND`` (2) with tanh, so attention outputs are O(0.1-1) and never
      reach 4, where a single bf16 ulp (2^-5) would already exceed ``MAX_ABS``: the bf16
      tolerances (max|Δ| <= 3e-2, mean|Δ| <= 1e-4) bite on kernel errors, not on rounding.

    Everything is drawn from one ``torch.Generator(device)`` seeded with ``seed``: the same seed and
    device give identical tensors (CPU and CUDA streams differ). Work is done in fp32 in chunks of
    heads, directly on ``device``. ``progress(done, total)``, when given, is called after each
    step (one per batch entry and chunk of 8 heads, then one for the cube layout and selection).
    """
    g3, c3 = _check_synth_args(grid, heads, head_dim, topk, batch, dtype, cube)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    outlier_heads = _resolve_outlier(outlier, heads, cpu_gen)

    T, H, W = g3
    n_tok = T * H * W
    d = head_dim
    f32 = dict(device=dev, dtype=torch.float32)
    t_pos = torch.arange(T, **f32).repeat_interleave(H * W)
    h_pos = torch.arange(H, **f32).repeat_interleave(W).repeat(T)
    w_pos = torch.arange(W, **f32).repeat(T * H)
    pos = torch.stack((t_pos, h_pos, w_pos), dim=1)  # (N, 3)
    cos, sin = _rope_tables(g3, d, dev)

    # ---- per-head "weights" (shared across the batch, like a model's layer) ----
    m_qk, m_v = 32, 16
    # spatial wavelengths of ~12-48 tokens, temporal ones longer: video content is smooth
    sig = torch.stack(
        (_uniform((heads,), 1 / 64, 1 / 16, gen, dev),
         _uniform((heads,), 1 / 48, 1 / 12, gen, dev),
         _uniform((heads,), 1 / 48, 1 / 12, gen, dev)), dim=1)  # (heads, 3) cycles/token
    corr = _uniform((heads, 1, 1), 0.4, 0.9, gen, dev)  # q/k content correlation
    mu_q = _randn((heads, d), gen, dev) * 0.8
    mu_k = mu_q * 0.7 + _randn((heads, d), gen, dev) * 0.5
    noise_qk = _uniform((heads, 1, 1), 0.3, 0.8, gen, dev)
    # per-head scale times per-channel spread: Wan's learned RMSNorm weights
    gain_q = _uniform((heads, 1), 0.8, 1.5, gen, dev) * _randn((heads, d), gen, dev).mul(0.25).exp()
    gain_k = _uniform((heads, 1), 0.8, 1.5, gen, dev) * _randn((heads, d), gen, dev).mul(0.25).exp()
    v_bias = _randn((heads, d), gen, dev) * 0.5
    noise_v = _uniform((heads, 1, 1), 0.3, 0.6, gen, dev)

    pairs = torch.tensor(_low_freq_pairs(d), device=dev)
    out_ch = torch.stack((2 * pairs, 2 * pairs + 1), dim=1).reshape(-1)  # outlier channels
    out_sign = torch.where(_rand((out_ch.numel(),), gen, dev) < 0.5, -1.0, 1.0)

    q_all = torch.empty((batch, n_tok, heads, d), device=dev, dtype=dtype)
    k_all = torch.empty_like(q_all)
    v_all = torch.empty_like(q_all)
    chunk = 8
    steps = batch * -(-heads // chunk) + 1
    done = 0
    for b in range(batch):
        for h0 in range(0, heads, chunk):
            h1 = min(heads, h0 + chunk)
            hs = slice(h0, h1)
            nh = h1 - h0
            # content basis: per-head low-frequency random Fourier features
            freqs = _randn((nh, m_qk, 3), gen, dev) * sig[hs, None, :]
            phase = _uniform((nh, m_qk), 0.0, 2 * math.pi, gen, dev)
            basis = _fourier_basis(pos, freqs, phase)  # (nh, N, M)
            a_q = _randn((nh, m_qk, d), gen, dev)
            a_k = corr[hs] * a_q + torch.sqrt(1 - corr[hs] ** 2) * _randn((nh, m_qk, d), gen, dev)
            qh = torch.bmm(basis, a_q).add_(mu_q[hs, None, :])
            qh.add_(_randn(qh.shape, gen, dev).mul_(noise_qk[hs]))
            kh = torch.bmm(basis, a_k).add_(mu_k[hs, None, :])
            kh.add_(_randn(kh.shape, gen, dev).mul_(noise_qk[hs]))
            del basis
            # smooth hot-region field for outlier heads (drawn for every chunk: keeps the stream
            # independent of which heads are outliers)
            hot_f = _randn((1, 16, 3), gen, dev) * torch.tensor([1 / 32, 1 / 24, 1 / 24], **f32)
            hot_p = _uniform((1, 16), 0.0, 2 * math.pi, gen, dev)
            hot = _fourier_basis(pos, hot_f, hot_p)[0].sum(-1)  # (N,)
            thr = torch.quantile(hot[:: max(1, n_tok // 100_000)], 0.8)
            # 0 outside the top ~20%, rising to 1 at the peak
            hot = ((hot - thr) / (hot.max() - thr).clamp(min=1e-6)).clamp_(0.0, 1.0)

            gq = gain_q[hs].clone()
            gk = gain_k[hs].clone()
            local_out = [h - h0 for h in outlier_heads if h0 <= h < h1]
            for lh in local_out:
                # q: in the hot region a few slow-RoPE channels dominate the pre-norm vector;
                # k: a constant component on the same channels everywhere (an attention sink)
                qh[lh][:, out_ch] += hot[:, None] * (15.0 * out_sign)
                kh[lh][:, out_ch] += 4.0 * out_sign
            # in place, here and below: no fresh (nh, N, d) temporaries to page in
            qh.mul_(torch.rsqrt(qh.pow(2).mean(-1, keepdim=True) + 1e-6))
            kh.mul_(torch.rsqrt(kh.pow(2).mean(-1, keepdim=True) + 1e-6))
            for lh in local_out:
                # gain on the outlier channels so the max logit is ~outlier_logit:
                # logit_out ~= G^2 * P_q(x) * P_k(y) / (n_ch * sqrt(d)), P = projection on sign
                pq = (qh[lh][:, out_ch] * out_sign).sum(-1)
                pk = (kh[lh][:, out_ch] * out_sign).sum(-1)
                denom = (pq.max() * pk.mean()).clamp(min=1e-3)
                g2 = outlier_logit * out_ch.numel() * math.sqrt(d) / denom
                gq[lh, out_ch] = torch.sqrt(g2)
                gk[lh, out_ch] = torch.sqrt(g2)
            qh = _apply_rope(qh.mul_(gq[:, None, :]), cos, sin)
            kh = _apply_rope(kh.mul_(gk[:, None, :]), cos, sin)
            q_all[b, :, hs].copy_(qh.permute(1, 0, 2))  # cast and transpose in one pass
            k_all[b, :, hs].copy_(kh.permute(1, 0, 2))
            del qh, kh

            # v: its own smooth field + bias + noise
            freqs_v = _randn((nh, m_v, 3), gen, dev) * sig[hs, None, :]
            phase_v = _uniform((nh, m_v), 0.0, 2 * math.pi, gen, dev)
            basis_v = _fourier_basis(pos, freqs_v, phase_v)
            vh = torch.bmm(basis_v, _randn((nh, m_v, d), gen, dev)).add_(v_bias[hs, None, :])
            vh.add_(_randn(vh.shape, gen, dev).mul_(noise_v[hs]))
            # soft bound |v| < V_BOUND: outputs stay where one bf16 ulp is well under MAX_ABS
            vh.mul_(1.0 / V_BOUND).tanh_().mul_(V_BOUND)
            v_all[b, :, hs].copy_(vh.permute(1, 0, 2))
            del vh, basis_v
            done += 1
            if progress is not None:
                progress(done, steps)

    q, vbs = layout.to_cubes(q_all, g3, c3)
    del q_all
    k, _ = layout.to_cubes(k_all, g3, c3)
    del k_all
    v, _ = layout.to_cubes(v_all, g3, c3)
    del v_all
    block = math.prod(c3)
    topk_idx = sparsity.mean_pool_topk(q, k, vbs, topk, block=block)
    if progress is not None:
        progress(steps, steps)
    return {
        "q": q,
        "k": k,
        "v": v,
        "topk_idx": topk_idx,
        "vbs": vbs,
        "outlier_heads": outlier_heads,
        "grid": g3,
        "cube": c3,
        "seed": seed,
        "block": block,
    }


# ============================================================================ captures for a spec


def for_spec(cap: dict, spec: Any) -> dict:
    """The capture with q, k, v (and a bundled o_ref) in `spec`'s dtype and layout.

    Capture files are BSHD (contract.md); a BHSD spec gets contiguous transposed copies, and a
    dtype other than the file's is a cast (say so when you tune an fp16 spec on bf16 captures).
    The capture must be BSHD (as loaded or synthesized, not already converted) and match the
    spec's workload (batch, grid and cube, heads, head dim, topk): ValueError naming the field.
    """
    out = dict(cap)
    # The workload fields are part of the spec hash that keys tuned winners: a capture of
    # another shape would record a winner for a workload it was never measured on.
    B, S, H, D = cap["q"].shape  # BSHD, as on disk
    topk = cap["topk_idx"].shape[-1]
    for field_name, have, want in (("head_dim", D, spec.head_dim), ("batch", B, spec.batch),
                                   ("seq_len (grid, cube)", S, spec.seq_len),
                                   ("num_heads", H, spec.num_heads), ("topk", topk, spec.topk)):
        if field_name == "topk" and getattr(spec, "encoding", "lut") == "sliding_tile":
            continue  # the window decides which cubes a sliding_tile spec attends
        if have != want:
            raise ValueError(f"capture q {tuple(cap['q'].shape)} (BSHD) does not fit the spec: "
                             f"{field_name} is {have}, spec wants {want}")
    for key in ("q", "k", "v", "o_ref"):
        if key in out:
            t = out[key].to(spec.torch_dtype)
            out[key] = t.transpose(1, 2).contiguous() if spec.layout == "bhsd" else t
    return out


def synthesize_for(spec: Any, seed: int = 0, device: torch.device | str = "cpu",
                   outlier: bool | int | Sequence[int] | None = True) -> dict:
    """`synthesize` at the spec's workload (grid, heads, head dim, topk, batch, cube, dtype),
    returned in the spec's layout (see `for_spec`)."""
    cap = synthesize(seed=seed, grid=spec.grid, heads=spec.num_heads, head_dim=spec.head_dim,
                     topk=min(spec.topk, spec.num_cubes),  # sliding_tile ignores topk
                     outlier=outlier, batch=spec.batch,
                     dtype=spec.torch_dtype, device=device, cube=spec.cube)
    return for_spec(cap, spec)
