"""`tilegen build`: render every backend of a target and compile it ahead of time.

List, then write: `plan()` decides which (backend, config, source) triples a target gets, and
`build()` compiles them and writes sources, binaries and `manifest.json` under the output dir.
`tilegen check` uses the same `plan()` to re-render the committed sources.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tilegen import __version__, cache
from tilegen import config as cfgmod
from tilegen.compile import Artifact
from tilegen.config import KernelConfig
from tilegen.render import Source, render_triton, template_set_hash
from tilegen.spec import Spec
from tilegen.targets import Target


@dataclass(frozen=True)
class PlannedSource:
    backend: str
    config: KernelConfig
    source: Source


def _render_cuda(spec: Spec, cfg: KernelConfig) -> Source:
    from tilegen.compile.nvcc import render_cuda

    return render_cuda(spec, cfg)


def _render_hip(spec: Spec, cfg: KernelConfig) -> Source:
    from tilegen.compile.hip import render_hip

    return render_hip(spec, cfg)


RENDERERS: dict[str, Callable[[Spec, KernelConfig], Source]] = {
    "triton": render_triton,
    "cuda": _render_cuda,
    "hip": _render_hip,
}


def backend_violations(backend: str, spec: Spec, cfg: KernelConfig) -> list[str]:
    """Rules of one C++ backend's tiling on top of the target's (`config.PREDICATES`)."""
    if backend == "cuda":
        from tilegen.compile.nvcc import cuda_violations

        return cuda_violations(spec, cfg)
    if backend == "hip":
        from tilegen.compile.hip import hip_violations

        return hip_violations(spec, cfg)
    return []


def plan(spec: Spec, target: Target, config: KernelConfig | None = None,
         backends: tuple[str, ...] | None = None) -> list[PlannedSource]:
    """What a build of `target` renders: one source per backend, for `config` or the target's
    default. Invalid configs raise before anything is rendered."""
    cfg = config or cfgmod.default_config(target, spec)
    cfgmod.check(spec, target, cfg)
    chosen = backends or target.backends
    unknown = [b for b in chosen if b not in target.backends]
    if unknown:
        raise ValueError(f"backend(s) {unknown} not available for {target.name}; "
                         f"allowed values: {list(target.backends)}")
    for b in chosen:
        problems = backend_violations(b, spec, cfg)
        if problems:
            raise ValueError(f"config {cfg.name} is invalid for the {b} backend on "
                             f"{target.name}: " + "; ".join(problems))
    return [PlannedSource(b, cfg, RENDERERS[b](spec, cfg)) for b in chosen]


def compile_one(item: PlannedSource, spec: Spec, target: Target, out_dir: Path) -> Artifact:
    if item.backend == "triton":
        from tilegen.compile.triton_aot import compile_triton

        return compile_triton(spec, item.config, target, out_dir, item.source)
    if item.backend == "cuda":
        from tilegen.compile.nvcc import compile_cuda

        return compile_cuda(item.source, target.name, out_dir)
    if item.backend == "hip":
        from tilegen.compile.hip import compile_hip

        return compile_hip(item.source, out_dir)
    raise ValueError(f"unknown backend {item.backend!r}")


def estimate_occupancy(art: Artifact, target: Target) -> int | None:
    """Resident blocks per SM/CU from registers, shared memory and threads (upper bound)."""
    if not art.threads or art.registers is None:
        return None
    waves = art.threads // target.warp_size
    if target.vendor == "nvidia":
        regs_per_warp = -(-art.registers * target.warp_size // 256) * 256  # 256-reg granules
        by_regs = target.registers_per_sm // max(regs_per_warp * waves, 1)
        by_smem = (target.max_shared_bytes + 1024) // max(art.shared_bytes or 1, 1)
        return max(0, min(by_regs, by_smem, 32))
    # CDNA3: 512 VGPRs (arch + acc) per SIMD lane, 4 SIMDs per CU, waves spread over SIMDs
    vgprs = (art.registers or 0) + (art.agprs or 0)
    waves_per_simd = 512 // max(-(-vgprs // 8) * 8, 8)
    by_regs = (waves_per_simd * 4) // max(waves, 1)
    by_lds = target.max_shared_bytes // max(art.shared_bytes or 1, 1)
    return max(0, min(by_regs, by_lds, 8))


def build(spec: Spec, target: Target, out_dir: Path, config: KernelConfig | None = None,
          backends: tuple[str, ...] | None = None,
          progress: Callable[[str], None] = lambda _: None) -> dict:
    """Render, compile and write everything for `target`; return the manifest dict.

    All or nothing: missing compilers are reported before any work, everything is compiled
    into a staging folder beside `out_dir`, and files move into `out_dir` only when every
    backend succeeded (a failed build leaves `out_dir` as it was)."""
    items = plan(spec, target, config, backends)
    for item in items:
        require_toolchain(item.backend)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        manifest = _build_into(staging, items, spec, target, progress)
        manifest["files"] = sorted(p.name for p in staging.iterdir()) + ["manifest.json"]
        cache.atomic_write(staging / "manifest.json", json.dumps(manifest, indent=2) + "\n")
        out_dir.mkdir(parents=True, exist_ok=True)
        _remove_previous_build(out_dir)
        for path in sorted(staging.iterdir()):
            os.replace(path, out_dir / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _remove_previous_build(out_dir: Path) -> None:
    """Delete what an earlier build listed in its manifest, so the folder never mixes binaries
    of two builds; files the user put there are left alone."""
    old = out_dir / "manifest.json"
    if not old.exists():
        return
    try:
        names = json.loads(old.read_text()).get("files", [])
    except (OSError, ValueError):
        names = []
    for name in names:
        if "/" not in name and name not in ("", ".", ".."):
            (out_dir / name).unlink(missing_ok=True)


def require_toolchain(backend: str) -> None:
    """Raise ToolchainMissing (with the install hint) when a backend's compiler is absent."""
    if backend == "cuda":
        from tilegen.compile.nvcc import find_nvcc

        find_nvcc()
    elif backend == "hip":
        from tilegen.compile.hip import find_clang

        find_clang()


def _build_into(out_dir: Path, items: list[PlannedSource], spec: Spec, target: Target,
                progress: Callable[[str], None]) -> dict:
    artifacts = []
    for item in items:
        src_path = cache.atomic_write(out_dir / item.source.name, item.source.text)
        progress(f"[{target.name}] {item.backend}: compiling {item.source.name}")
        art = compile_one(item, spec, target, out_dir)
        art.source = src_path
        art.source_sha256 = item.source.sha256
        art.config = item.config.name
        if art.occupancy is None:
            art.occupancy = estimate_occupancy(art, target)
        progress(f"[{target.name}] {item.backend}: {art.path.name} regs={art.registers} "
                 f"shared={art.shared_bytes} spills={art.spill_bytes}")
        artifacts.append(art)
    manifest = {
        "tilegen": __version__,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "target": target.name,
        "arch": target.arch,
        "spec": spec.to_dict(),
        "spec_hash": spec.hash,
        "template_set_hash": template_set_hash(),
        "backend_template_hashes": {b: template_set_hash(b) for b in target.backends},
        "artifacts": [_relative(a.to_dict(), out_dir) for a in artifacts],
    }
    return manifest


def _relative(d: dict, root: Path) -> dict:
    for key in ("path", "source"):
        if d.get(key):
            d[key] = str(Path(d[key]).relative_to(root))
    d["sha256"] = hashlib.sha256((root / d["path"]).read_bytes()).hexdigest()
    return d
