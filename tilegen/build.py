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
from tilegen import backends as registry
from tilegen.compile import format_matrix_ops
from tilegen.config import KernelConfig
from tilegen.identity import VariantKey
from tilegen.pathcheck import writable_dir
from tilegen.render import Source
from tilegen.spec import Spec
from tilegen.targets import Target


@dataclass(frozen=True)
class PlannedSource:
    backend: str
    config: KernelConfig
    source: Source
    key: VariantKey | None = None  # filled in by build(), which knows the toolchain


def plan(spec: Spec, target: Target, config: KernelConfig | None = None,
         backends: tuple[str, ...] | None = None,
         skipped: list[str] | None = None) -> list[PlannedSource]:
    """What a build of `target` renders: each backend's `sources()` (registry order; the Triton
    family's forward and backward), for `config` or each backend's default. Invalid configs
    raise before anything renders.

    A spec is built as its kernel (`Spec.kernel_spec`: a mask spec builds the LUT kernels it
    runs). Without `backends`, a family that cannot compute the spec (its encoding, layout,
    cube size, ...), or whose default config does not fit it when no `config` is given, is
    left out, its reason appended to `skipped`; a family named in `backends` that cannot
    raises, and so does a target none of whose families can."""
    spec = spec.kernel_spec
    chosen = backends or target.backends
    unknown = [b for b in chosen if b not in target.backends]
    if unknown:
        raise ValueError(f"backend(s) {unknown} not available for {target.name}; "
                         f"allowed values: {list(target.backends)}")
    items = []
    reasons = []
    for impl in registry.for_target(target):
        if impl.name not in chosen:
            continue
        refused = impl.spec_violations(spec, target)
        if refused and backends is None:
            reasons.append(f"{target.name}/{impl.name}: " + "; ".join(refused))
            continue
        cfg = config or impl.default_config(spec, target)
        problems = impl.violations(spec, target, cfg)
        if problems and config is None and backends is None:
            # its default config does not fit this spec: left out with the reason, as above
            reasons.append(f"{target.name}/{impl.name}: its default config {cfg.name} does not "
                           f"fit the spec (" + "; ".join(problems) + "); pass --config or "
                           "--backend to build it")
            continue
        impl.check(spec, target, cfg)
        items.extend(PlannedSource(impl.name, cfg, src) for src in impl.sources(spec, cfg, target))
    if not items:
        raise ValueError(f"no family of {target.name} can build spec {spec.short_hash}: "
                         + "; ".join(reasons))
    if skipped is not None:
        skipped.extend(reasons)
    return items


def build(spec: Spec, target: Target, out_dir: Path, config: KernelConfig | None = None,
          backends: tuple[str, ...] | None = None,
          progress: Callable[[str], None] = lambda _: None) -> dict:
    """Render, compile and write everything for `target`; return the manifest dict.

    All or nothing: missing compilers are reported before any work, everything is compiled
    into a staging folder beside `out_dir`, and files move into `out_dir` only when every
    backend succeeded (a failed build leaves `out_dir` as it was). Families left out for the
    spec's encoding are reported through `progress` and listed in the manifest ("skipped")."""
    skipped: list[str] = []
    items = plan(spec, target, config, backends, skipped)
    for why in skipped:
        progress(f"[{target.name}] skipped {why}")
    for item in items:
        registry.get(item.backend).require_toolchain(target)
    # before any compile: a file at out_dir (or above it) would otherwise fail only at the end
    writable_dir(out_dir, "output directory", staging=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        manifest = _build_into(staging, items, spec, target, progress)
        manifest["skipped"] = skipped
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


def _build_into(out_dir: Path, items: list[PlannedSource], spec: Spec, target: Target,
                progress: Callable[[str], None]) -> dict:
    artifacts = []
    for item in items:
        src_path = cache.atomic_write(out_dir / item.source.name, item.source.text)
        if getattr(item.source, "headers", None):
            # a C++ kernel is its traits over the static headers: beside it, one file with the
            # headers pasted in, which compiles on its own (nvcc / clang++ with no -I)
            name = Path(item.source.name)
            cache.atomic_write(out_dir / f"{name.stem}.standalone{name.suffix}",
                               item.source.expanded())
        progress(f"[{target.name}] {item.backend}: compiling {item.source.name}")
        impl = registry.get(item.backend)
        compiled = impl.compile(spec.kernel_spec, item.config, target, item.source, out_dir)
        key = impl.variant_key(spec, item.config, target, item.source)
        for art in compiled if isinstance(compiled, list) else [compiled]:
            art.source = src_path
            art.source_sha256 = item.source.sha256
            art.config = art.config if art.config == "backward" else item.config.name
            if art.occupancy is None:
                art.occupancy = target.occupancy(art.registers, art.threads, art.shared_bytes,
                                                 art.agprs)
            progress(f"[{target.name}] {item.backend}: {art.path.name} regs={art.registers} "
                     f"shared={art.shared_bytes} spills={art.spill_bytes} "
                     f"mma={format_matrix_ops(art.matrix_ops)}")
            artifacts.append((art, key))
    manifest = {
        "tilegen": __version__,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "target": target.name,
        "arch": target.arch,
        "spec": spec.to_dict(),
        "spec_hash": spec.hash,
        "kernel_hash": spec.kernel_hash,
        "artifacts": [{**_relative(a.to_dict(), out_dir), "variant": key.to_dict(),
                       "variant_id": key.digest} for a, key in artifacts],
    }
    return manifest


def _relative(d: dict, root: Path) -> dict:
    for key in ("path", "source"):
        if d.get(key):
            d[key] = str(Path(d[key]).relative_to(root))
    d["sha256"] = hashlib.sha256((root / d["path"]).read_bytes()).hexdigest()
    return d
