"""Where tilegen's data lives: the repo's `templates/` and `targets/`, and the user cache."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
ROOT = Path(os.environ.get("TILEGEN_ROOT", PACKAGE_DIR.parent))
TEMPLATES_DIR = ROOT / "templates"
TARGETS_DIR = ROOT / "targets"


def cache_dir() -> Path:
    """Kernel cache: $TILEGEN_CACHE_DIR, else $XDG_CACHE_HOME/tilegen, else ~/.cache/tilegen."""
    if "TILEGEN_CACHE_DIR" in os.environ:
        return Path(os.environ["TILEGEN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tilegen"


def require(path: Path, what: str) -> Path:
    if not path.exists():
        raise FileNotFoundError(
            f"tilegen {what} not found at {path}; install tilegen from its source tree "
            "(pip install -e .) or point TILEGEN_ROOT at a checkout"
        )
    return path
