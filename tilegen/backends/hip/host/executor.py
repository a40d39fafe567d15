"""CPU executor of the gfx942 HIP kernel: the rendered HIP C++ itself, built as host C++.

``render_hip(spec, cfg, target)`` (the text ``tilegen build --target gfx942`` compiles for the
GPU, with the same snapshot of the library's headers, passed with -I) is written to disk
unchanged and compiled with clang++-19 as host C++ into a shared library, after
``hip_host_runtime.h``, which supplies the launch model (workgroups of 64-lane waves,
every lane a fiber), LDS, barriers and every ``__builtin_amdgcn_*`` the kernel calls, the MFMAs
with the lane layouts of AMD's matrix instruction calculator (see the header's comment).

The library's one entry point takes the kernarg buffer that
`tilegen.backends.hip.runtime.pack_kernargs` builds for the ROCm launcher (the same bytes,
unpacked by the AMDGPU kernarg rules) and the grid and block of
`tilegen.backends.hip.runtime.launch_geometry`, so a run also checks the launcher's half.

    o, lse = run(spec, cfg, q, k, v, topk_idx, vbs, counts)   # CPU tensors in, CPU tensors out
    kernel = HostKernel(spec, cfg.replace(store_max_prob=True))   # with the signal:
    o, lse = kernel(q, k, v, topk_idx, vbs, counts); kernel.max_prob  # (max_prob, max_prob_cube)

Nothing here has run on an MI300: this executes the C++ source's semantics on the CPU with
ISA-documented MFMA semantics, not the compiled gfx942 code object.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from tilegen import cache

# The HIP backend's render, plan and toolchain (tilegen.backends.hip.plan, .compile) and its ROCm
# launcher's kernarg packing and grid (tilegen.backends.hip.runtime) are imported here only.
from tilegen.backends.hip.compile import clang_version, find_clang
from tilegen.backends.hip.plan import HIP_KERNEL_NAME, as_cxx, plan_for, render_hip
from tilegen.backends.hip.runtime import (
    check_alignment,
    kernel_values,
    launch_geometry,
    pack_kernargs,
)
from tilegen.compile import CompileError
from tilegen.config import KernelConfig
from tilegen.inputs import check_sm_scale, validate_inputs
from tilegen.reference import LOG2E
from tilegen.render import Source
from tilegen.spec import Spec
from tilegen.targets import Target

HEADER = Path(__file__).parent / "hip_host_runtime.h"

#: Host build of the kernel text. -std=c++17 like the device build; -O1 (LDS traffic is ordered
#: across barriers by the prelude's fences, see the header); no FMA contraction, so the host's
#: rounding does not depend on the build machine.
HOST_FLAGS = (
    "-std=c++17", "-O1", "-fPIC", "-shared", "-fvisibility=hidden", "-fno-strict-aliasing",
    "-ffp-contract=off", "-fno-exceptions", "-fno-rtti",  # no exceptions on the device either
    "-Wall", "-Wextra", "-Werror=return-type",
    "-Wno-unknown-attributes",  # amdgpu_flat_work_group_size means nothing to the host
    "-Wno-unused-function",     # the header's builtins the kernel does not call
)

#: Scheduling orders of the waves between barriers (hip_host_runtime.h `schedule`).
SCHEDULES = {"ascending": 0, "descending": 1, "alternating": 2}

_ENTRY = """\
// Host build of {name} (tilegen CPU executor; see hip_host_runtime.h). Generated; do not edit.
#include "hip_host_runtime.h"
#include "{name}"

extern "C" __attribute__((visibility("default"))) int tg_host_run(
    const unsigned char* kernargs, unsigned long size, tg_host_launch* launch) {{
  return tg_host::launch_packed(&{kernel}, kernargs, size, launch);
}}
"""


class HostExecutionError(RuntimeError):
    """The host-built kernel failed: divergent lanes, a bad launch, or (RaceDetected) outputs
    that depend on the order the waves ran in."""


class RaceDetected(HostExecutionError):
    """Two wave orders gave different outputs: some LDS access is not ordered by a barrier."""


class _Launch(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
        ("schedule", ctypes.c_int), ("lds_poison", ctypes.c_int),
        ("lds_bytes", ctypes.c_ulonglong), ("workgroups", ctypes.c_ulonglong),
        ("barriers", ctypes.c_ulonglong), ("mfma", ctypes.c_ulonglong),
        ("bpermute", ctypes.c_ulonglong), ("readfirstlane", ctypes.c_ulonglong),
        ("error", ctypes.c_char * 1024),
    ]


@dataclass(frozen=True)
class LaunchStats:
    """What one launch did (summed over the grid): wave-level instruction counts."""

    lds_bytes: int
    workgroups: int
    barriers: int
    mfma: int
    bpermute: int
    readfirstlane: int


def host_flags() -> list[str]:
    return ["-x", "c++", *HOST_FLAGS]


def build_library(source: Source) -> Path:
    """Compile `source` (rendered HIP text, unchanged, and the library headers it includes:
    `tilegen.identity.CxxSource`) with the runtime header into a shared library; cached under
    the kernel cache (`hip-host/`) by the source's sha256 (headers included), the runtime
    header, the flags and the clang version. CompileError with clang's diagnostics on
    failure."""
    source = as_cxx(source)
    clang = find_clang()
    version = clang_version(clang)
    header = HEADER.read_text()
    entry = _ENTRY.format(name=source.name, kernel=HIP_KERNEL_NAME)
    flags = host_flags()
    key = cache.key_of(source.sha256, header, entry, " ".join(flags), version)
    folder = cache_root() / key[:2] / key
    lib = folder / f"{source.name.removesuffix('.hip')}.so"
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tilegen-hip-host-") as tmp:
        tmpdir = Path(tmp)
        (tmpdir / source.name).write_text(source.text)
        (tmpdir / "hip_host_runtime.h").write_text(header)
        (tmpdir / "entry.cpp").write_text(entry)
        include = source.write_headers(tmpdir / "include")
        out = tmpdir / "kernel.so"
        cmd = [str(clang), *flags, "-I", str(include), str(tmpdir / "entry.cpp"), "-o",
               str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            raise CompileError(f"host build of {source.name} with clang++ {version} failed "
                               f"(exit {proc.returncode}):\n{proc.stderr}")
        cache.atomic_write(lib, out.read_bytes())
    return lib


_libs: dict[Path, ctypes.CDLL] = {}
_lock = threading.Lock()  # the runtime keeps its state in globals: one launch at a time


def _load(path: Path) -> ctypes.CDLL:
    lib = _libs.get(path)
    if lib is None:
        lib = ctypes.CDLL(str(path))
        lib.tg_host_run.argtypes = [ctypes.c_char_p, ctypes.c_ulong, ctypes.POINTER(_Launch)]
        lib.tg_host_run.restype = ctypes.c_int
        _libs[path] = lib
    return lib


def _hip_target() -> Target:
    """The one target that lists the hip backend (targets/*/target.toml)."""
    from tilegen.targets import TARGET_NAMES, get_target

    found = [get_target(n) for n in TARGET_NAMES if "hip" in get_target(n).backends]
    if len(found) != 1:
        raise ValueError(f"pass target=: targets with a hip backend: {[t.name for t in found]}")
    return found[0]


class HostKernel:
    """One (spec, config) built for the host: ``o, lse = kernel(q, k, v, topk_idx, vbs, counts)``.

    `source` defaults to ``render_hip(spec, cfg, target)``; pass another text (say, a
    deliberately broken one) to run that instead. The plan (grid, block) always comes from
    (spec, cfg).
    """

    def __init__(self, spec: Spec, cfg: KernelConfig, source: Source | None = None,
                 target: Target | None = None) -> None:
        self.spec = spec
        self.config = cfg
        self.target = target or _hip_target()
        self.plan = plan_for(spec, cfg, self.target)
        self.source = source if source is not None else render_hip(spec, cfg, self.target)
        self.path = build_library(self.source)
        self.lib = _load(self.path)
        self.stats: LaunchStats | None = None
        #: (max_prob, max_prob_cube) of the last call, for a config with ``store_max_prob``
        self.max_prob: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 topk_idx: torch.Tensor, vbs: torch.Tensor, counts: torch.Tensor | None = None,
                 *, sm_scale: float | None = None,
                 schedules: tuple[str, ...] = ("ascending", "descending"),
                 poison_lds: bool = True,
                 check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the grid once per wave order in `schedules` on CPU tensors (validated as
        `tilegen.ops` does) and return (o, lse) of the first; RaceDetected if another order
        gives an output that differs in any bit. o and lse start as NaN, so anything the kernel
        fails to write shows up; LDS starts as 0xff bytes (NaN) in every workgroup unless
        `poison_lds` is False. `stats` holds the first run's instruction counts. With
        ``store_max_prob`` the signal lands in `max_prob`: max_prob (NaN-initialised) is
        compared bit for bit too; max_prob_cube (zeroed, the waves add to it atomically) to
        1e-6 relative, since the order of the adds may change its last bits.
        ``check_values=False`` skips the eager value checks, to run what the op launches after
        its device guard (`tilegen.guard`) on inputs that hold bad values."""
        unknown = [s for s in schedules if s not in SCHEDULES]
        if unknown or not schedules:
            raise ValueError(f"schedules={schedules!r}; allowed: {sorted(SCHEDULES)}")
        shapes = validate_inputs(self.spec, q, k, v, topk_idx, vbs, counts,
                                 check_values=check_values)
        check_sm_scale(sm_scale)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.device.type != "cpu":
                raise ValueError(f"the host executor runs on CPU tensors; {name} is on "
                                 f"{t.device}")
        check_alignment(q=q, k=k, v=v)
        grid, block = launch_geometry(self.plan, shapes)
        lo, hi = self.flat_work_group_size
        if not lo <= block[0] <= hi:
            raise HostExecutionError(f"{self.source.name}: block {block} outside the kernel's "
                                     f"amdgpu_flat_work_group_size({lo}, {hi})")
        scale = sm_scale if sm_scale is not None else self.spec.sm_scale
        results = []
        for schedule in schedules:
            o = torch.full_like(q, float("nan"))
            lse = (torch.full((shapes.batch, shapes.heads, shapes.seq_len), float("nan"),
                              dtype=torch.float32) if self.plan.store_lse else None)
            mp = None
            if self.plan.store_max_prob:
                mp = (torch.full((shapes.batch, shapes.heads, shapes.seq_len), float("nan"),
                                 dtype=torch.float32),
                      torch.zeros((shapes.batch, shapes.heads, shapes.num_q_blocks),
                                  dtype=torch.float32))
            values = kernel_values(q, k, v, topk_idx, vbs, counts, o, lse, shapes,
                                   scale * LOG2E, mp)
            kernargs = pack_kernargs(values)
            launch = _Launch()
            launch.grid[:] = list(grid)
            launch.block[:] = list(block)
            launch.schedule = SCHEDULES[schedule]
            launch.lds_poison = 0xFF if poison_lds else -1
            with _lock:
                rc = self.lib.tg_host_run(kernargs, len(kernargs), ctypes.byref(launch))
            if rc != 0:
                raise HostExecutionError(f"{self.source.name} ({schedule}): "
                                         f"{launch.error.decode()}")
            if not results:
                self.stats = LaunchStats(launch.lds_bytes, launch.workgroups, launch.barriers,
                                         launch.mfma, launch.bpermute, launch.readfirstlane)
            results.append((o, lse, mp))
        o, lse, mp = results[0]
        for schedule, (o2, lse2, mp2) in zip(schedules[1:], results[1:], strict=True):
            same = _bits_equal(o, o2) and (lse is None or _bits_equal(lse, lse2))
            if mp is not None:
                same = same and _bits_equal(mp[0], mp2[0]) and torch.allclose(
                    mp[1], mp2[1], rtol=1e-6, atol=0.0, equal_nan=True)
            if not same:
                raise RaceDetected(f"{self.source.name}: waves {schedules[0]} and {schedule} "
                                   "between barriers give different outputs (an LDS access "
                                   "that no barrier orders)")
        self.max_prob = mp
        return o, lse

    @property
    def flat_work_group_size(self) -> tuple[int, int]:
        """The (min, max) of the kernel's amdgpu_flat_work_group_size attribute, from the text
        (the host build turns the attribute into an annotation)."""
        m = _FLAT.search(self.source.text)
        if m is None:
            raise HostExecutionError(f"{self.source.name}: no amdgpu_flat_work_group_size")
        return int(m.group(1)), int(m.group(2))


_FLAT = re.compile(r"amdgpu_flat_work_group_size\((\d+),\s*(\d+)\)")


def run(spec: Spec, cfg: KernelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        topk_idx: torch.Tensor, vbs: torch.Tensor, counts: torch.Tensor | None = None, *,
        sm_scale: float | None = None, source: Source | None = None,
        check_races: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the host build of (spec, cfg), or of `source` instead of its render, on CPU tensors;
    (o, lse) like the HIP op. With `check_races` (the default) the grid runs twice, waves
    ascending and descending between barriers, and outputs that differ in any bit raise
    RaceDetected."""
    kernel = HostKernel(spec, cfg, source)
    schedules = ("ascending", "descending") if check_races else ("ascending",)
    return kernel(q, k, v, topk_idx, vbs, counts, sm_scale=sm_scale, schedules=schedules)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def cache_root() -> Path:
    """Where host builds are cached."""
    return cache.cache_dir() / "hip-host"


__all__ = ["HEADER", "HostExecutionError", "HostKernel", "LaunchStats", "RaceDetected",
           "build_library", "cache_root", "host_flags", "run"]
