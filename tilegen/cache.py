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
from pathlib import Path

from tilegen.paths import cache_dir


def key_of(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()


def atomic_write(path: Path, data: str | bytes) -> Path:
    """Write `data` to `path` through a temp file and os.replace (atomic on POSIX)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
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
