"""The CUDA C++ backend's toolchain: render the CK-style kernel and compile it with nvcc.

`render_cuda(spec, cfg)` turns a spec and a config into a short ``.cu`` file: the variant's
traits (`Config`: element type, layout, block sizes, options) over the static library under
``templates/cuda/include/tilegen/cuda/`` (plain C++ headers, the tile pieces as templates over
the traits), and the ``extern "C"`` entry point. It is a `tilegen.identity.CxxSource`: the
headers it includes are read with it, and its sha256 covers them. `compile_cuda(source,
target)` runs ``nvcc -cubin -I <include>`` for the target's exact ISA (sm_90a, sm_100a), reads
ptxas's resource report into an `Artifact`, and caches the cubin under a hash of (source and
headers, nvcc version, flags, arch), so a second build of the same source is instant.

The same decisions feed the template, the launcher (`tilegen.backends.cuda.runtime`) and tests:
`cuda_traits` is the one place the tile shapes and shared-memory budget are computed.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tilegen import cache, paths
from tilegen.compile import Artifact, CompileError, ToolchainMissing
from tilegen.config import KernelConfig
from tilegen.cubin import cubin_matrix_ops
from tilegen.identity import CxxSource
from tilegen.render import Source, render, spec_basename
from tilegen.spec import Spec
from tilegen.targets import Target

CUDA_TEMPLATE = "cuda/lut_kernel.cu.j2"
#: where the library's headers are, under the templates folder (`include_dir`)
INCLUDE_SUBDIR = "cuda/include"
INSTALL_HINT = (
    "install the CUDA toolkit 12.8+ (nvcc), e.g. `apt-get install cuda-nvcc-13-0` from NVIDIA's "
    "repository or the runfile from developer.nvidia.com/cuda-downloads, then put nvcc on PATH "
    "or set TILEGEN_NVCC=/path/to/nvcc"
)
#: toolkit folders searched after $TILEGEN_NVCC, PATH, $CUDA_HOME and $CUDA_PATH
NVCC_FALLBACK_HOMES: tuple[str, ...] = ("/usr/local/cuda",)
#: Flags every build uses. No --use_fast_math: it would also turn the epilogue's 1/l and log2(l)
#: into approximations (lse must match the fp32 reference); the one hot transcendental, exp2,
#: already uses ex2.approx explicitly in the template.
NVCC_FLAGS = ("-O3", "-std=c++17", "-Xptxas", "-v")
ELEM_BYTES = 2  # bf16 / fp16
#: registers beyond the O and S accumulators: addresses, Q/K/V fragments, softmax state (a fact
#: of this kernel's design, measured from ptxas reports, not of any chip)
REGISTER_OVERHEAD = 80
#: the kernel's static shared memory (barrier words) on top of its dynamic tiles
STATIC_SMEM_BYTES = 128


def _mma_m(spec: Spec, target: Target) -> int:
    """Rows of the target's mma.sync instruction for the spec's dtype (target.toml [[mma]])."""
    found = target.mma_for("mma_sync", spec.dtype)
    if not found:
        raise ValueError(f"target {target.name} lists no mma_sync instruction for {spec.dtype}")
    return found[0].m


def cuda_violations(spec: Spec, cfg: KernelConfig, target: Target) -> list[str]:
    """Why the CUDA kernel cannot be built for (spec, cfg); empty when it can.

    A config whose ``mainloop`` option is "wgmma" is the Hopper kernel's
    (`tilegen.backends.cuda.wgmma.violations`). Rules of the mma.sync kernel's tiling: each warp
    owns whole m16 row tiles (block_m is a multiple of
    16 * num_warps); S and P V step 16 keys and 16 dims at a time (block_n, head_dim multiples of
    16; ldmatrix.x4 loads two n8 tiles); the shared-memory swizzle permutes 8 chunks of 8
    elements per row (head_dim >= 64); tiles never straddle cubes; interp_bf16 is a Triton
    interpreter workaround with no CUDA meaning; the accumulators fit the register file.
    """
    from tilegen.backends.cuda import wgmma

    try:
        mainloop = wgmma.mainloop_of(cfg)
    except ValueError as exc:
        return [str(exc)]
    if mainloop == "wgmma":
        return wgmma.violations(spec, cfg, target)
    if cfg.options:
        return [f"options {sorted(dict(cfg.options))} belong to mainloop wgmma; the mma.sync "
                "kernel has none"]
    if spec.quant != "none":
        return [f"quant={spec.quant!r}: the CUDA family's 8-bit kernel is its wgmma mainloop's "
                "(Hopper, sm_90a: IGMMA and QGMMA); the mma.sync kernel is 16-bit"]
    problems = []
    if not target.mma_for("mma_sync", spec.dtype):
        return [f"target {target.name} has no mma.sync instruction for {spec.dtype}"]
    mma_m = _mma_m(spec, target)
    if cfg.num_warps < 1 or cfg.block_m % (mma_m * cfg.num_warps):
        problems.append(f"block_m={cfg.block_m} is not a multiple of {mma_m} x num_warps="
                        f"{cfg.num_warps} (each warp owns whole m16 row tiles)")
    if cfg.block_n % 16 or cfg.block_n < 16:
        problems.append(f"block_n={cfg.block_n} is not a multiple of 16")
    if spec.head_dim % 64:
        problems.append(f"head_dim={spec.head_dim} is not a multiple of 64 (shared-memory swizzle)")
    if spec.block_q % max(cfg.block_m, 1) or spec.block_kv % max(cfg.block_n, 1):
        problems.append(f"block_m={cfg.block_m} / block_n={cfg.block_n} must divide the cube "
                        f"sizes {spec.block_q} / {spec.block_kv}")
    if cfg.num_stages < 1:
        problems.append(f"num_stages={cfg.num_stages} < 1")
    if cfg.interp_bf16:
        problems.append("interp_bf16 is a Triton-interpreter option; the CUDA kernel has none")
    if shared_memory_bytes(spec, cfg) + STATIC_SMEM_BYTES > target.max_shared_bytes:
        problems.append(f"needs {shared_memory_bytes(spec, cfg) + STATIC_SMEM_BYTES} B of shared "
                        f"memory, more than the {target.max_shared_bytes} B a block may opt into "
                        f"on {target.name}")
    if not problems and registers_needed(spec, cfg) > target.max_registers_per_thread:
        problems.append(f"each thread would hold ~{registers_needed(spec, cfg)} registers "
                        f"(O and S accumulators of {cfg.block_m // cfg.num_warps} rows per warp), "
                        f"more than the {target.max_registers_per_thread} a thread can have: it "
                        "would spill")
    return problems


def shared_memory_bytes(spec: Spec, cfg: KernelConfig) -> int:
    """Dynamic shared memory of one CTA: the Q tile plus num_stages x (K tile + V tile)."""
    tile = ELEM_BYTES * spec.head_dim
    return tile * (cfg.block_m + cfg.num_stages * 2 * cfg.block_n)


def registers_needed(spec: Spec, cfg: KernelConfig) -> int:
    """Rough registers per thread: each lane holds warp_m x (head_dim + block_n) / 32 fp32
    accumulators (O and S) plus `REGISTER_OVERHEAD`."""
    warp_m = cfg.block_m // max(cfg.num_warps, 1)
    return warp_m * (spec.head_dim + cfg.block_n) // 32 + REGISTER_OVERHEAD


def min_blocks_per_sm(spec: Spec, cfg: KernelConfig, target: Target) -> int:
    """The ``__launch_bounds__`` minimum of resident CTAs per SM: as many as shared memory
    allows, but no more than leaves each thread the registers its accumulators need (O and S
    fragments plus `REGISTER_OVERHEAD`), so ptxas caps registers where that buys occupancy and
    not where it would force spills."""
    threads = target.warp_size * cfg.num_warps
    by_regs = target.registers_per_sm // (threads * registers_needed(spec, cfg))
    by_smem = target.shared_per_sm // (shared_memory_bytes(spec, cfg)
                                       + target.reserved_shared_per_block)
    return max(1, min(by_regs, by_smem))


def cuda_traits(spec: Spec, cfg: KernelConfig, target: Target) -> dict[str, Any]:
    """Every number and choice the template instantiates, computed once (raises ValueError for
    a config the CUDA kernel cannot run). The template, the launcher and the tests read these.
    A wgmma config's come from `tilegen.backends.cuda.wgmma.traits`."""
    from tilegen.backends.cuda import wgmma

    if wgmma.mainloop_of(cfg) == "wgmma":
        return wgmma.traits(spec, cfg, target)
    problems = cuda_violations(spec, cfg, target)
    if problems:
        raise ValueError(f"config {cfg.name} cannot be built as CUDA for this spec: "
                         + "; ".join(problems))
    return {
        "mainloop": "mma_sync",
        "dtype": spec.dtype,
        "elem": {"bf16": "Bf16", "fp16": "Fp16"}[spec.dtype],
        "layout_type": {"bshd": "Bshd", "bhsd": "Bhsd"}[spec.layout],
        "mma_type": {"bf16": "bf16", "fp16": "f16"}[spec.dtype],
        "cvt_type": {"bf16": "bf16x2", "fp16": "f16x2"}[spec.dtype],
        "layout": spec.layout,
        "vbs": spec.variable_block_sizes,
        "store_lse": cfg.store_lse,
        "store_max_prob": cfg.store_max_prob,
        "head_dim": spec.head_dim,
        "block_q": spec.block_q,
        "block_kv": spec.block_kv,
        "block_m": cfg.block_m,
        "block_n": cfg.block_n,
        "num_warps": cfg.num_warps,
        "threads": target.warp_size * cfg.num_warps,
        "mma_name": target.mma_for("mma_sync", spec.dtype)[0].name,
        "arch": target.arch,
        "stages": cfg.num_stages,
        "warp_m": cfg.block_m // cfg.num_warps,
        "m_tiles": cfg.block_m // cfg.num_warps // _mma_m(spec, target),
        "n_sub": spec.block_kv // cfg.block_n,
        "smem_bytes": shared_memory_bytes(spec, cfg),
        "min_blocks": min_blocks_per_sm(spec, cfg, target),
    }


def kernel_name(spec: Spec, cfg: KernelConfig) -> str:
    """``tilegen_cuda_<spec traits>_<config traits>``: a C identifier naming the variant."""
    return f"tilegen_cuda_{spec_basename(spec)}_{cfg.name}"


def include_dir() -> Path:
    """The CUDA library's include folder: ``templates/cuda/include`` of the checkout, or inside
    the wheel (`tilegen.paths`)."""
    return paths.require(paths.TEMPLATES_DIR / INCLUDE_SUBDIR, "CUDA headers")


def render_cuda(spec: Spec, cfg: KernelConfig, target: Target) -> CxxSource:
    """The CUDA source for (spec, cfg): its traits and entry point, with the headers it
    includes. Unlike the Triton source, block sizes are template arguments baked into the
    text, so every launch configuration is its own file. A wgmma config renders the Hopper
    kernel (`tilegen.backends.cuda.wgmma.render_wgmma`)."""
    from tilegen.backends.cuda import wgmma

    if wgmma.mainloop_of(cfg) == "wgmma":
        return CxxSource.including(wgmma.render_wgmma(spec, cfg, target), include_dir())
    traits = cuda_traits(spec, cfg, target)
    name = kernel_name(spec, cfg)
    src = render(CUDA_TEMPLATE, "cuda", spec, cfg, f"{name[len('tilegen_cuda_'):]}.cu", name,
                 target=target, t=traits)
    return CxxSource.including(src, include_dir())


# -- toolchain ---------------------------------------------------------------------------------
def find_nvcc() -> Path:
    """$TILEGEN_NVCC, else nvcc on PATH, else $CUDA_HOME/bin/nvcc or /usr/local/cuda/bin/nvcc."""
    explicit = os.environ.get("TILEGEN_NVCC")
    if explicit:  # an explicit choice is final: never fall back to another nvcc silently
        if Path(explicit).is_file() and os.access(explicit, os.X_OK):
            return Path(explicit)
        raise ToolchainMissing(f"nvcc not found: TILEGEN_NVCC={explicit!r} is not an "
                               f"executable; {INSTALL_HINT}")
    candidates: list[str] = []
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(on_path)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), *NVCC_FALLBACK_HOMES):
        if home:
            candidates.append(str(Path(home) / "bin" / "nvcc"))
    for cand in candidates:
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return Path(cand)
    raise ToolchainMissing(f"nvcc not found (searched PATH, $CUDA_HOME, /usr/local/cuda): "
                           f"{INSTALL_HINT}")


@functools.cache
def _version_of(nvcc: str) -> str:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ToolchainMissing(f"{nvcc} --version failed ({exc}): {INSTALL_HINT}") from exc
    m = re.search(r"release [\d.]+, V([\d.]+)", out) or re.search(r"release ([\d.]+)", out)
    if not m:
        raise ToolchainMissing(f"cannot read a version from `{nvcc} --version`: {out.strip()!r}")
    return m.group(1)


def nvcc_version(nvcc: Path | None = None) -> str:
    """nvcc's full version, e.g. ``13.0.88``."""
    return _version_of(str(nvcc or find_nvcc()))


def arch_of(target: Target) -> str:
    """The exact ISA nvcc builds for `target` (target.toml `arch`: sm_90a, sm_100a)."""
    if target.vendor != "nvidia":
        raise ValueError(f"target {target.name!r} has no CUDA backend")
    return target.arch


def nvcc_command(nvcc: Path | str, src: Path, out: Path, arch: str,
                 include: Path | str | None = None) -> list[str]:
    """The exact command line (``arch`` is the ISA, e.g. sm_90a; ``include`` the folder that
    holds the library's headers, passed with -I)."""
    compute = arch.replace("sm_", "compute_")
    inc = ["-I", str(include)] if include is not None else []
    return [str(nvcc), "-cubin", "-gencode", f"arch={compute},code={arch}", *NVCC_FLAGS,
            *inc, "-o", str(out), str(src)]


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> dict[str, dict[str, int | None]]:
    """ptxas -v's report, per entry function: registers, stack frame, spill stores / loads and
    static shared memory (bytes)."""
    out: dict[str, dict[str, int | None]] = {}
    current: dict[str, int | None] | None = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = out.setdefault(m.group(1), {"registers": None, "stack": 0,
                                                  "spill_stores": 0, "spill_loads": 0,
                                                  "smem": 0})
        elif current is None:
            continue
        elif m := _FRAME.search(line):
            current["stack"], current["spill_stores"], current["spill_loads"] = (
                int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif m := _USED.search(line):
            current["registers"] = int(m.group(1))
            if s := _SMEM.search(line):
                current["smem"] = int(s.group(1))
    return out


def _config_name(text: str) -> str | None:
    m = re.search(r"^// tilegen config: (\S+)$", text, re.MULTILINE)
    return m.group(1) if m else None


def _define(text: str, name: str) -> int | None:
    m = re.search(rf"^#define {name} (\d+)$", text, re.MULTILINE)
    return int(m.group(1)) if m else None


def toolchain_id(nvcc: Path | None = None) -> str:
    """The toolchain part of the variant key: nvcc's version and the flags every build uses."""
    return f"nvcc={nvcc_version(nvcc)} {' '.join(NVCC_FLAGS)}"


def compile_cuda(source: Source, target: Target, out_dir: str | Path | None = None,
                 variant: str | None = None) -> Artifact:
    """Compile `source` for `target` (its ISA, target.toml `arch`) into a cubin; `variant` is
    the digest of its `tilegen.identity.VariantKey`, the cache key.

    The cubin is cached under sha256(source and the headers it includes, nvcc version, flags,
    arch); a hit skips nvcc. nvcc compiles the source's own snapshot of the headers (what its
    sha256 covers), from a temporary folder passed with -I; a plain `Source` gets the current
    headers (`include_dir`). With `out_dir` the source and the cubin are also written there
    (the build's output folder); without it the artifact points into the cache. Raises
    `ToolchainMissing` without nvcc and `CompileError` (with nvcc's output) when the source
    does not compile.
    """
    if source.backend != "cuda":
        raise ValueError(f"{source.name} is a {source.backend} source, not CUDA")
    if not isinstance(source, CxxSource):
        source = CxxSource.including(source, include_dir())
    arch = arch_of(target)
    nvcc = find_nvcc()
    version = nvcc_version(nvcc)
    # the variant key's digest (tilegen.identity) names the cubin in the cache; without one
    # (a bare source), the same parts: source, toolchain, ISA
    key = variant or cache.key_of("cuda", source.sha256, toolchain_id(nvcc), arch)
    stem = Path(source.name).stem
    cubin_name = f"{stem}.{arch}.cubin"
    folder = cache.cache_dir() / "cuda" / key[:2] / key
    meta_path = folder / "meta.json"
    if (folder / cubin_name).is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
    else:
        meta = _run_nvcc(source, nvcc, version, arch, key, cubin_name)
    cubin = folder / cubin_name
    src_path = None
    if out_dir is not None:
        out = Path(out_dir)
        src_path = cache.atomic_write(out / source.name, source.text)
        cubin = cache.atomic_write(out / cubin_name, cubin.read_bytes())
    dynamic = _define(source.text, "TILEGEN_DYNAMIC_SMEM_BYTES") or 0
    threads = _define(source.text, "TILEGEN_THREADS")
    shared = meta["smem"] + dynamic
    return Artifact(
        path=cubin, kind="cubin", backend="cuda", target=target.name, arch=arch,
        kernel_name=meta["kernel_name"], source=src_path, source_sha256=source.sha256,
        config=_config_name(source.text) or stem, registers=meta["registers"], shared_bytes=shared,
        spill_bytes=meta["spill_stores"] + meta["spill_loads"], stack_bytes=meta["stack"],
        occupancy=target.occupancy(meta["registers"], threads, shared),
        threads=threads, compiler={"nvcc": version}, command=meta["command"],
        matrix_ops=cubin_matrix_ops(cubin),
    )


#: the longest source file stem nvcc's intermediates take (255 bytes, less their prefix and
#: suffix, with room to spare)
MAX_NVCC_STEM = 200


def _run_nvcc(source: CxxSource, nvcc: Path, version: str, arch: str, key: str,
              cubin_name: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tilegen-nvcc-") as tmp:
        # nvcc names its intermediates tmpxft_<16 chars>-<n>_<stem>.cudafe1.gpu: a config's
        # long name would pass the file system's 255 bytes, so such a source goes by its key
        name = source.name if len(Path(source.name).stem) <= MAX_NVCC_STEM else f"{key}.cu"
        src = Path(tmp) / name
        src.write_text(source.text)
        include = source.write_headers(Path(tmp) / "include")
        out = Path(tmp) / cubin_name
        cmd = nvcc_command(nvcc, src, out, arch, include)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired as exc:
            raise CompileError(f"nvcc timed out after 600 s on {source.name}") from exc
        log = proc.stdout + proc.stderr
        if proc.returncode != 0 or not out.is_file():
            raise CompileError(f"nvcc failed on {source.name} for {arch} "
                               f"(exit {proc.returncode}):\n{' '.join(cmd)}\n{log}")
        report = parse_ptxas(log)
        if len(report) != 1:
            raise CompileError(f"expected one kernel in ptxas's report for {source.name}, got "
                               f"{sorted(report)}:\n{log}")
        ((name, res),) = report.items()
        # the cached command names the source by file name and the include folder by where
        # the headers come from: the temp dir is gone
        shown = {str(src): src.name, str(out): out.name,
                 str(include): f"{paths.TEMPLATES_DIR.name}/{INCLUDE_SUBDIR}"}
        meta = {"kernel_name": name, "arch": arch, "nvcc": version, "command":
                [shown.get(c, c) for c in cmd],
                "source_sha256": source.sha256, "ptxas_log": log, **res}
        path = cache.store("cuda", key, cubin_name, out.read_bytes(), meta=meta)
        if not (path.parent / "meta.json").is_file():  # a cubin left without its meta
            cache.atomic_write(path.parent / "meta.json", json.dumps(meta, indent=2) + "\n")
    return meta
