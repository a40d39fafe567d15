"""What a target is: limits, matrix instructions, backends and tunable ranges.

Every hardware fact lives in `targets/<name>/target.toml`; this module only reads it.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from dataclasses import dataclass, field
from typing import Any

from tilegen.paths import TARGETS_DIR, require


def _target_names() -> tuple[str, ...]:
    """Every folder of targets/ with a target.toml, ordered by its `order` field: adding a
    target is adding a folder."""
    found = []
    for path in sorted(TARGETS_DIR.glob("*/target.toml")):
        order = tomllib.loads(path.read_text()).get("order", 1000)
        found.append((order, path.parent.name))
    return tuple(name for _, name in sorted(found))


TARGET_NAMES = _target_names()


@dataclass(frozen=True)
class Mma:
    """One matrix instruction of a target (targets/<t>/target.toml [[mma]])."""

    name: str
    kind: str  # "mma_sync", "wgmma", "tcgen05", "mfma": which templates may use it
    dtypes: tuple[str, ...]
    shape: tuple[int, int, int]  # (m, n, k); n is the largest for instructions with variable N

    @property
    def m(self) -> int:
        return self.shape[0]

    @property
    def n(self) -> int:
        return self.shape[1]

    @property
    def k(self) -> int:
        return self.shape[2]


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
    shared_per_sm: int
    reserved_shared_per_block: int
    default_shared_per_block: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    register_alloc_unit: int
    max_grid: tuple[int, int, int]
    mma: tuple[Mma, ...]
    backends: tuple[str, ...]
    triton_backend: str
    triton_arch: int | str
    default: dict[str, int]
    tunable: dict[str, tuple[int, ...]]
    #: per-backend tables ([tunable.<backend>], [default.<backend>]) for families whose knobs
    #: differ from the common launch parameters
    tunable_by_backend: dict[str, dict[str, tuple[Any, ...]]] = field(default_factory=dict)
    default_by_backend: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: vendor-specific facts (AMD: simds_per_cu, registers_per_simd_lane, lds_banks, ...)
    extra: dict[str, Any] = field(default_factory=dict)
    #: the family a GPU of this target with no tuned winner for a spec gets, at its tuning base
    #: config (`Backend.tuning_base`); "triton" unless target.toml measured another faster
    untuned_backend: str = "triton"

    def mma_for(self, kind: str, dtype: str) -> tuple[Mma, ...]:
        """The target's matrix instructions of `kind` that take `dtype`, smallest first."""
        return tuple(m for m in self.mma if m.kind == kind and dtype in m.dtypes)

    def fact(self, name: str) -> Any:
        """A vendor-specific fact from target.toml; KeyError naming the file when absent."""
        if name not in self.extra:
            raise KeyError(f"targets/{self.name}/target.toml has no {name!r}")
        return self.extra[name]

    def occupancy(self, registers: int | None, threads: int | None, shared_bytes: int | None,
                  agprs: int | None = None) -> int | None:
        """Resident blocks per SM / CU allowed by registers, shared memory / LDS and threads,
        from this target's allocation rules (the one occupancy formula tilegen uses)."""
        if not threads or registers is None:
            return None
        waves = -(-threads // self.warp_size)
        shared = shared_bytes or 0
        by_smem = (self.shared_per_sm // (shared + self.reserved_shared_per_block)
                   if shared + self.reserved_shared_per_block else self.max_blocks_per_sm)
        if self.vendor == "amd":
            unit = self.register_alloc_unit
            vgprs = -(-max(registers + (agprs or 0), 1) // unit) * unit
            waves_per_simd = self.fact("registers_per_simd_lane") // vgprs
            by_regs = waves_per_simd * self.fact("simds_per_cu") // waves
        else:
            unit = self.register_alloc_unit
            regs_per_warp = -(-max(registers, 1) * self.warp_size // unit) * unit
            by_regs = self.registers_per_sm // (regs_per_warp * waves)
        by_threads = self.max_threads_per_sm // threads
        return max(0, min(by_regs, by_smem, by_threads, self.max_blocks_per_sm))

    def tunable_for(self, backend: str) -> dict[str, tuple[Any, ...]]:
        """The tunable ranges of `backend` on this target: its own table
        ([tunable.<backend>] in target.toml) when it has one, else the common [tunable]."""
        own = self.tunable_by_backend.get(backend)
        return dict(own) if own is not None else dict(self.tunable)

    def default_for(self, backend: str) -> dict[str, Any]:
        """The default config fields of `backend` ([default.<backend>] or the common one)."""
        own = self.default_by_backend.get(backend)
        return dict(own) if own is not None else dict(self.default)

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
    known = {f.name for f in dataclasses.fields(Target)} | {"mma", "default", "tunable", "order"}
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
        shared_per_sm=raw["shared_per_sm"],
        reserved_shared_per_block=raw["reserved_shared_per_block"],
        default_shared_per_block=raw["default_shared_per_block"],
        max_threads_per_sm=raw["max_threads_per_sm"],
        max_blocks_per_sm=raw["max_blocks_per_sm"],
        register_alloc_unit=raw["register_alloc_unit"],
        max_grid=tuple(raw["max_grid"]),
        mma=tuple(Mma(m["name"], m["kind"], tuple(m["dtypes"]), tuple(m["shape"]))
                  for m in raw["mma"]),
        backends=tuple(raw["backends"]),
        triton_backend=triton["backend"],
        triton_arch=triton["arch"],
        default={k: v for k, v in raw["default"].items() if not isinstance(v, dict)},
        tunable={k: tuple(v) for k, v in raw["tunable"].items() if not isinstance(v, dict)},
        tunable_by_backend={b: {k: tuple(v) for k, v in t.items()}
                            for b, t in raw["tunable"].items() if isinstance(t, dict)},
        default_by_backend={b: dict(t) for b, t in raw["default"].items()
                            if isinstance(t, dict)},
        extra={k: v for k, v in raw.items() if k not in known},
        untuned_backend=_untuned_backend(raw),
    )


def _untuned_backend(raw: dict[str, Any]) -> str:
    name = raw.get("untuned_backend", "triton")
    if name not in raw["backends"]:
        raise ValueError(f"targets/{raw['name']}/target.toml: untuned_backend {name!r} is not "
                         f"one of its backends {raw['backends']}")
    return name


def detect_target() -> Target | None:
    """The target of the current torch device, or None on a CPU-only machine."""
    import torch

    if not torch.cuda.is_available():
        return None
    if getattr(torch.version, "hip", None):
        arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
        return get_target(arch) if arch in TARGET_NAMES else None
    major, minor = torch.cuda.get_device_capability()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return target_for_capability(major * 10 + minor,
                                 getattr(props, "shared_memory_per_block_optin", None))


_FALLBACK_NOTED: set[tuple] = set()


def target_for_capability(cc: int, max_shared: int | None = None,
                          backend: str | None = None) -> Target | None:
    """The NVIDIA target of compute capability `cc` (major * 10 + minor; with `backend`, among
    the targets that list that family): the target file of that capability, else the closest
    lower target of the same major version (whose machine code runs there: sm_80 on 8.6 and
    8.7, sm_120 on 12.1) whose shared memory per block fits the GPU's opt-in limit
    `max_shared`, named once in the log. None when no target qualifies, with a warning: an
    unknown `max_shared`, another major version (sm_89 code does not run on 10.3), or an
    arch-specific target (sm_90a, sm_100a code runs only on its own capability). The op then
    runs the untuned reference config on the Triton family, which compiles for the device."""
    import logging

    nvidia = [get_target(n) for n in TARGET_NAMES if get_target(n).vendor == "nvidia"
              and (backend is None or backend in get_target(n).backends)]
    for target in nvidia:
        if target.compute_capability == cc:
            return target
    fits = [t for t in nvidia if t.compute_capability // 10 == cc // 10
            and t.compute_capability < cc and not t.arch.endswith("a")
            and max_shared is not None and t.max_shared_bytes <= max_shared]
    target = max(fits, key=lambda t: t.compute_capability) if fits else None
    key = (cc, max_shared, backend)
    if key not in _FALLBACK_NOTED:
        _FALLBACK_NOTED.add(key)
        log = logging.getLogger("tilegen")
        if target is not None:
            log.info("no target file for compute capability %d.%d; using %s (%s), the closest "
                     "lower target of its major version", cc // 10, cc % 10, target.name,
                     target.description)
        else:
            log.warning("no target file for compute capability %d.%d%s and no lower one of its "
                        "major version whose shared memory per block fits it (%s B); the op "
                        "runs the untuned reference config", cc // 10, cc % 10,
                        f" with the {backend} family" if backend else "", max_shared)
    return target
