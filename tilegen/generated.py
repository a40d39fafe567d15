"""Committed generated sources and the CI regeneration check (`tilegen check`).

For the default spec (and the default sliding_tile spec: `GENERATED_SPECS`) and each target x
backend that implements it, the rendered source is committed under
`targets/<target>/generated/`. `check()` re-renders everything with `build.plan()` and compares
byte for byte: a template or spec change that was not regenerated is drift. Every drift carries
a `target/backend` label: the Triton source of each target has the same file name.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from tilegen import encoding_registry
from tilegen.build import plan
from tilegen.cache import atomic_write
from tilegen.paths import ROOT
from tilegen.spec import Spec
from tilegen.targets import TARGET_NAMES, get_target

REGENERATE = "tilegen check --update"

# backend of a committed file no longer in the plan (a stale one), by suffix
_BACKEND_OF_SUFFIX = {".py": "triton", ".cu": "cuda", ".hip": "hip"}


@dataclass(frozen=True)
class Drift:
    path: Path
    kind: str  # "changed" | "missing" | "stale"
    diff: str
    label: str = ""  # "target/backend", e.g. "sm_90/triton"

    def describe(self) -> str:
        """``target/backend: path (kind)``, the path relative to the checkout when inside it."""
        try:
            shown = self.path.relative_to(ROOT)
        except ValueError:
            shown = self.path
        return f"{self.label}: {shown} ({self.kind})"


#: The specs whose sources are committed: the default spec of each kernel encoding
#: (`encoding_registry.kernel_encodings`: lut, then sliding_tile; "mask" runs the LUT kernel,
#: nothing of its own), rendered for the families that implement it.
GENERATED_SPECS = tuple(Spec(encoding=name) for name in encoding_registry.kernel_encodings())


def _planned(targets: tuple[str, ...]) -> dict[Path, tuple[str, str]]:
    """Every committed file -> (``target/backend`` label, the text it must hold)."""
    files: dict[Path, tuple[str, str]] = {}
    for name in targets:
        target = get_target(name)
        for spec in GENERATED_SPECS:
            for item in plan(spec, target):
                path = target.generated_dir / item.source.name
                files[path] = (f"{target.name}/{item.backend}", item.source.text)
    return files


def expected(targets: tuple[str, ...] = TARGET_NAMES) -> dict[Path, str]:
    """Every committed file and the text it must hold (`GENERATED_SPECS`, each target's
    default config)."""
    return {path: text for path, (_, text) in _planned(targets).items()}


def check(targets: tuple[str, ...] = TARGET_NAMES) -> list[Drift]:
    want = _planned(targets)
    drifts: list[Drift] = []
    for path, (label, text) in sorted(want.items()):
        if not path.exists():
            drifts.append(Drift(path, "missing", f"--- {path} is missing\n", label))
            continue
        have = path.read_text()
        if have != text:
            diff = "".join(difflib.unified_diff(
                have.splitlines(keepends=True), text.splitlines(keepends=True),
                fromfile=f"{path} (committed)", tofile=f"{path} (rendered now)"))
            drifts.append(Drift(path, "changed", diff, label))
    for name in targets:
        folder = get_target(name).generated_dir
        for path in sorted(folder.glob("*")) if folder.exists() else ():
            if path.is_file() and path not in want:
                label = f"{name}/{_BACKEND_OF_SUFFIX.get(path.suffix, path.suffix or '?')}"
                drifts.append(Drift(path, "stale", f"--- {path} is no longer generated\n", label))
    return drifts


def update(targets: tuple[str, ...] = TARGET_NAMES) -> list[Drift]:
    """Rewrite the committed sources that drifted (and delete ones no longer generated).

    Returns what it fixed: one Drift per file written ("changed" or "missing") or deleted
    ("stale"); files already up to date are not touched and not returned.
    """
    want = expected(targets)
    fixed = check(targets)
    for drift in fixed:
        if drift.kind == "stale":
            drift.path.unlink()
        else:
            atomic_write(drift.path, want[drift.path])
    return fixed
