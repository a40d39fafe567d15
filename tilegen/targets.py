"""What a target is: limits, matrix instructions, backends and tunable ranges.

Every hardware fact lives in `targets/<name>/target.toml`; this module only reads it.
"""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass
from typing import Any

from tilegen.paths import TARGETS_DIR, require

TARGET_NAMES = ("sm_90", "sm_100a", "gfx942")


@dataclass(frozen=True)
class Target:
    name: str
    vendor: str
    description: str
    arch: str
    compute_capability: int
    warp_size: int
    max_shared_bytes: int
    max_registers_per_thread: int
    registers_per_sm: int
    max_threads_per_block: int
    num_sms: int
    mma_shapes: tuple[tuple[int, int, int], ...]
    mma_names: tuple[str, ...]
    backends: tuple[str, ...]
    triton_backend: str
    triton_arch: int | str
    default: dict[str, int]
    tunable: dict[str, tuple[int, ...]]

    def tunable_for(self, backend: str) -> dict[str, tuple[int, ...]]:
        """The tunable ranges of `backend` on this target (one table for all backends today)."""
        return dict(self.tunable)

    @property
    def generated_dir(self):
        return TARGETS_DIR / self.name / "generated"


@functools.cache
def get_target(name: str) -> Target:
    """Load `targets/<name>/target.toml`; unknown names raise ValueError listing the known ones."""
    if name not in TARGET_NAMES:
        raise ValueError(f"unknown target {name!r}; allowed values: {list(TARGET_NAMES)}")
    path = require(TARGETS_DIR / name / "target.toml", f"target file for {name}")
    raw: dict[str, Any] = tomllib.loads(path.read_text())
    triton = raw.pop("triton")
    return Target(
        name=raw["name"],
        vendor=raw["vendor"],
        description=raw["description"],
        arch=raw["arch"],
        compute_capability=raw["compute_capability"],
        warp_size=raw["warp_size"],
        max_shared_bytes=raw["max_shared_bytes"],
        max_registers_per_thread=raw["max_registers_per_thread"],
        registers_per_sm=raw["registers_per_sm"],
        max_threads_per_block=raw["max_threads_per_block"],
        num_sms=raw["num_sms"],
        mma_shapes=tuple(tuple(s) for s in raw["mma_shapes"]),
        mma_names=tuple(raw["mma_names"]),
        backends=tuple(raw["backends"]),
        triton_backend=triton["backend"],
        triton_arch=triton["arch"],
        default=dict(raw["default"]),
        tunable={k: tuple(v) for k, v in raw["tunable"].items()},
    )


def detect_target() -> Target | None:
    """The target of the current torch device, or None on a CPU-only machine."""
    import torch

    if not torch.cuda.is_available():
        return None
    if getattr(torch.version, "hip", None):
        arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
        return get_target(arch) if arch in TARGET_NAMES else None
    major, minor = torch.cuda.get_device_capability()
    cc = major * 10 + minor
    for name in TARGET_NAMES:
        target = get_target(name)
        if target.vendor == "nvidia" and target.compute_capability == cc:
            return target
    return None
