"""Where tilegen's data lives: `templates/`, `targets/` and `tuning_db/`, and the user cache.

In a source checkout (and an editable install) they are the checkout's top-level folders. A
wheel carries them inside the package as `tilegen/_data/{templates,targets,tuning_db}` (see
pyproject.toml), so a plain `pip install` works from any directory. `TILEGEN_ROOT` points at
another tree holding the three folders (tests use it to edit templates in a copy).
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def _data_root() -> Path:
    if "TILEGEN_ROOT" in os.environ:
        return Path(os.environ["TILEGEN_ROOT"])
    packaged = PACKAGE_DIR / "_data"
    if (packaged / "templates").is_dir():
        return packaged
    return PACKAGE_DIR.parent


ROOT = _data_root()
TEMPLATES_DIR = ROOT / "templates"
TARGETS_DIR = ROOT / "targets"
SHIPPED_WINNERS_DIR = ROOT / "tuning_db"


def cache_dir() -> Path:
    """Kernel cache: $TILEGEN_CACHE_DIR, else $XDG_CACHE_HOME/tilegen, else ~/.cache/tilegen."""
    if "TILEGEN_CACHE_DIR" in os.environ:
        return Path(os.environ["TILEGEN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tilegen"


def require(path: Path, what: str) -> Path:
    if not path.exists():
        raise FileNotFoundError(
            f"tilegen {what} not found at {path}; reinstall tilegen (its wheel carries "
            "templates/, targets/ and tuning_db/) or point TILEGEN_ROOT at a checkout")
    return path
