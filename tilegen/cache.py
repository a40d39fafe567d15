"""On-disk artifact cache: files keyed by a content hash, written atomically.

Layout: `<cache_dir>/<kind>/<key[:2]>/<key>/<filename>` plus a `meta.json` beside each file.
A writer renders into a temp file in the same directory and `os.replace`s it into place, so a
concurrent reader sees either nothing or the whole file, never a torn one.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from tilegen.pathcheck import write_error
from tilegen.paths import cache_dir


def key_of(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()


def _read_umask() -> int:
    # Read once, at import: os.umask can only be read by setting it, which would race with
    # other threads creating files (tuning sessions drive workers from threads).
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def atomic_write(path: Path, data: str | bytes | Callable[[BinaryIO], object]) -> Path:
    """Write `data` (text, bytes, or a function that writes to a binary file) to `path`
    through a temp file in the same folder, fsync, then os.replace: atomic on POSIX. The file
    gets the permissions a plain open() would (0666 less the umask), not mkstemp's 0600.

    A failure to create or replace the file is a `tilegen.pathcheck.PathError` (an OSError)
    naming `path`, never the hidden temp file."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise write_error(path, exc, creating_in=path.parent) from None
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            # e.g. `path` is a directory, or the disk filled up: say so about the user's path
            raise write_error(path, exc) from None
        raise
    return path


def store(kind: str, key: str, filename: str, data: str | bytes, meta: dict | None = None,
          root: Path | None = None) -> Path:
    """Put one artifact in the cache (idempotent: an existing identical entry is kept)."""
    folder = (root or cache_dir()) / kind / key[:2] / key
    path = folder / filename
    if not path.exists():
        atomic_write(path, data)
        if meta is not None:
            atomic_write(folder / "meta.json", json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return path
