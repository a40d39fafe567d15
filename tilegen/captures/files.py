"""Capture files: `load`, `save`, `validate`.

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
The rest of the archive (the pickled dict with the metadata and this record, the version and
byte-order records) is covered by the CRC-32 that torch.save's zip writer records, which
:func:`load` checks before unpickling (torch's own reader does not). So a single flipped byte
in a file that :func:`save` wrote either raises ``ValueError`` or lands in a field no reader
looks at (a time stamp, alignment padding), and the capture loads as it was saved.

A file that cannot be read as a capture (empty, truncated, damaged, a directory, not a
``torch.save`` archive, or holding objects other than tensors and plain data) raises
``ValueError`` naming the path, whatever torch version raised what; a missing file raises
``FileNotFoundError``. Files
are always read with ``weights_only=True``: a capture never needs to run pickled code.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import stat
import zipfile
from pathlib import Path
from typing import Any

import torch

from tilegen.cache import atomic_write

# metadata carried through load/save untouched (plain Python values, weights_only-safe)
_META_KEYS = ("call", "step", "block", "outlier_heads", "grid", "cube", "seed")

#: key of the per-tensor sha256 record that :func:`save` writes and :func:`load` verifies
CHECKSUM_KEY = "checksums"

logger = logging.getLogger("tilegen")
_NOTED_UNCHECKED = False  # the "no checksum" note is logged once per process





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


def _damaged(path: str | os.PathLike, what: str) -> ValueError:
    return ValueError(f"{path}: the capture file is truncated or damaged: {what}; copy or "
                      f"write it again")


def _check_archive(path: str | os.PathLike, size: int) -> None:
    """Check the zip structure of a torch.save archive and the CRC-32 of its small records
    (the pickled dict, the version and byte-order records) before anything is unpickled.

    Why: torch's zip reader checks no CRC, so a flipped byte in the pickle can still unpickle
    into another capture (a changed ``seed`` or ``grid``, or a renamed checksum record, which
    turns verification off). Tensor storage records (``<archive>/data/<n>``) are left to the
    sha256 record: reading them twice would double the cost of loading a 1.2 GB capture.
    """
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                parts = info.filename.split("/")
                if (len(parts) >= 2 and parts[-2] == "data") or info.CRC == 0:
                    continue  # a tensor's bytes, or a writer that recorded no CRC
                if max(info.file_size, info.compress_size) > size:  # never read past the end
                    problem = (f"the zip directory gives record {info.filename!r} "
                               f"{info.file_size} bytes, more than the whole file")
                    break
                zf.read(info)  # zipfile raises BadZipFile when the CRC-32 differs
            else:
                return
    except zipfile.BadZipFile as exc:
        if str(exc) == "File is not a zip file":  # no end-of-central-directory record
            problem = (f"the zip archive torch.save writes has no central directory (the end "
                       f"of the file, {size} bytes long, is missing or overwritten)")
        else:
            problem = f"its zip structure fails a check ({_first_sentence(exc)})"
    except (FileNotFoundError, MemoryError):
        raise
    except Exception as exc:  # OSError, EOFError, NotImplementedError, struct.error, ...
        problem = (f"its zip structure cannot be read ({type(exc).__name__}: "
                   f"{_first_sentence(exc)})")
    raise _damaged(path, problem)


def _read(path: str | os.PathLike) -> Any:
    """``torch.load(path, weights_only=True)`` with every failure a ValueError naming the path.

    Only a missing file is not a ValueError (FileNotFoundError, as the command line expects).
    What torch raises for a damaged file differs between versions (2.13 reports a cut-off
    archive as ``OSError: [Errno 22] Invalid argument``, without the path; earlier ones raise
    RuntimeError), so every exception of the load but those two becomes a ValueError that
    names the file and says what was wrong. Never suggests ``weights_only=False``: a capture
    holds tensors and plain data only.
    """
    st = os.stat(path)  # FileNotFoundError as is
    size = st.st_size
    if stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{path}: is a directory, not a capture file ({_WHAT})")
    if size == 0:
        raise ValueError(f"{path}: the file is empty, not a capture ({_WHAT})")
    with open(path, "rb") as f:
        head = f.read(len(_LEGACY_MAGIC))
    archive = head.startswith(b"PK\x03\x04")  # torch.save's format is a zip archive
    if archive:
        _check_archive(path, size)
    try:
        return torch.load(os.fspath(path), map_location="cpu", weights_only=True)
    except (FileNotFoundError, MemoryError):  # removed meanwhile; too large for this host
        raise
    except Exception as exc:  # RuntimeError, OSError, UnpicklingError, EOFError, ...
        if archive or head == _LEGACY_MAGIC:
            if isinstance(exc, pickle.UnpicklingError) and "Unsupported global" in str(exc):
                raise ValueError(
                    f"{path}: not a capture: the torch.save archive holds objects other than "
                    f"tensors and plain data, which tilegen never loads ({_WHAT})") from None
            raise _damaged(path, f"{type(exc).__name__}: {_first_sentence(exc)}") from None
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


