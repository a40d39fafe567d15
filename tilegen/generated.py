"""Committed generated sources and the CI regeneration check (`tilegen check`).

For the default spec and each target x backend, the rendered source is committed under
`targets/<target>/generated/`. `check()` re-renders everything with `build.plan()` and compares
byte for byte: a template or spec change that was not regenerated is drift.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from tilegen.build import plan
from tilegen.cache import atomic_write
from tilegen.spec import Spec
from tilegen.targets import TARGET_NAMES, get_target

REGENERATE = "tilegen check --update"


@dataclass(frozen=True)
class Drift:
    path: Path
    kind: str  # "changed" | "missing" | "stale"
    diff: str


def expected(targets: tuple[str, ...] = TARGET_NAMES) -> dict[Path, str]:
    """Every committed file and the text it must hold (default spec, each target's default)."""
    files: dict[Path, str] = {}
    for name in targets:
        target = get_target(name)
        for item in plan(Spec(), target):
            files[target.generated_dir / item.source.name] = item.source.text
    return files


def check(targets: tuple[str, ...] = TARGET_NAMES) -> list[Drift]:
    want = expected(targets)
    drifts: list[Drift] = []
    for path, text in sorted(want.items()):
        if not path.exists():
            drifts.append(Drift(path, "missing", f"--- {path} is missing\n"))
            continue
        have = path.read_text()
        if have != text:
            diff = "".join(difflib.unified_diff(
                have.splitlines(keepends=True), text.splitlines(keepends=True),
                fromfile=f"{path} (committed)", tofile=f"{path} (rendered now)"))
            drifts.append(Drift(path, "changed", diff))
    for name in targets:
        folder = get_target(name).generated_dir
        for path in sorted(folder.glob("*")) if folder.exists() else ():
            if path.is_file() and path not in want:
                drifts.append(Drift(path, "stale", f"--- {path} is no longer generated\n"))
    return drifts


def update(targets: tuple[str, ...] = TARGET_NAMES) -> list[Path]:
    """Rewrite the committed sources (and delete ones no longer generated)."""
    want = expected(targets)
    for drift in check(targets):
        if drift.kind == "stale":
            drift.path.unlink()
    for path, text in want.items():
        if not path.exists() or path.read_text() != text:
            atomic_write(path, text)
    return sorted(want)
