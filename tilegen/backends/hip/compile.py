"""clang-19 for gfx942: find the compiler, build the HIP source into a code object, read its
resources."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from tilegen import cache, paths
from tilegen.backends.hip.plan import HIP_KERNEL_NAME, INCLUDE_SUBDIR, as_cxx, source_stamp
from tilegen.compile import Artifact, CompileError, ToolchainMissing, matrix_ops
from tilegen.render import Source
from tilegen.targets import Target

INSTALL_HINT = "apt-get install -y clang-19 lld-19 llvm-19"

# -- toolchain ---------------------------------------------------------------------------------
def find_clang() -> Path:
    """clang++ with the AMDGPU target: $TILEGEN_CLANG, clang++-19, ROCm's, or a clang++ >= 19.

    Raises ToolchainMissing with the install command when none is found.
    """
    env = os.environ.get("TILEGEN_CLANG")
    if env:
        path = shutil.which(env)
        if path is None:
            raise ToolchainMissing(f"TILEGEN_CLANG={env!r} is not an executable; install the "
                                   f"HIP compiler with: {INSTALL_HINT}")
        return Path(path)
    for name in ("clang++-19", "/opt/rocm/llvm/bin/clang++"):
        path = shutil.which(name)
        if path:
            return Path(path)
    path = shutil.which("clang++")
    if path and _major(clang_version(Path(path))) >= 19:
        return Path(path)
    raise ToolchainMissing("clang++-19 (HIP compiler for gfx942) not found; install it with: "
                           f"{INSTALL_HINT}")


def _major(version: str) -> int:
    m = re.match(r"(\d+)", version)
    return int(m.group(1)) if m else 0


def clang_version(clang: Path) -> str:
    """'19.1.7' from `clang++ --version` (the full first line if it has no version number)."""
    try:
        out = subprocess.run([str(clang), "--version"], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise ToolchainMissing(f"{clang} --version failed ({exc}); install the HIP compiler "
                               f"with: {INSTALL_HINT}") from exc
    first = out.strip().splitlines()[0] if out.strip() else ""
    m = re.search(r"clang version (\d+\.\d+\.\d+)", first)
    return m.group(1) if m else first


def hip_flags(arch: str) -> list[str]:
    """Device-only HIP compile to a bare code object (.hsaco, an ELF the runtime loads). The
    toolchain part of the variant key: the ``-I`` of the library's headers is not among them
    (it names a folder, and the source's sha256 already covers the headers' content)."""
    return [
        "-x", "hip", f"--offload-arch={arch}", "--offload-device-only",
        "--no-gpu-bundle-output",  # an ELF code object, not a clang offload bundle
        "-nogpuinc", "-nogpulib",  # self-contained source: no HIP headers, no device libs
        "-O3", "-std=c++17", "-fno-strict-aliasing", "-Wall", "-Wextra",
        "-Rpass-analysis=kernel-resource-usage",
    ]


_REMARK = re.compile(r"remark:\s+(?P<key>[A-Za-z ]+?)(?: \[[^\]]*\])?: (?P<val>\S+) \[-Rpass")


def parse_resource_usage(stderr: str, kernel_name: str = HIP_KERNEL_NAME) -> dict[str, int]:
    """The kernel-resource-usage remarks of `kernel_name` as ints.

    Keys: sgprs, vgprs, agprs, scratch_bytes (per lane), occupancy (waves/SIMD), sgpr_spill,
    vgpr_spill, lds_bytes, dynamic_stack (0/1).
    """
    names = {"SGPRs": "sgprs", "VGPRs": "vgprs", "AGPRs": "agprs", "ScratchSize": "scratch_bytes",
             "Occupancy": "occupancy", "SGPRs Spill": "sgpr_spill", "VGPRs Spill": "vgpr_spill",
             "LDS Size": "lds_bytes", "Dynamic Stack": "dynamic_stack"}
    out: dict[str, int] = {}
    current = None
    for line in stderr.splitlines():
        m = _REMARK.search(line)
        if not m:
            continue
        key, val = m.group("key").strip(), m.group("val")
        if key == "Function Name":
            current = val
            continue
        if current != kernel_name or key not in names:
            continue
        out[names[key]] = int(val == "True") if val in ("True", "False") else int(val)
    return out


def kernel_metadata(hsaco: Path, kernel_name: str = HIP_KERNEL_NAME) -> dict | None:
    """The kernel's entry of the code object's AMDGPU metadata note (kernarg offsets, LDS,
    registers), via llvm-readelf-19; None if llvm-readelf is not installed."""
    readelf = shutil.which("llvm-readelf-19") or shutil.which("llvm-readelf")
    if readelf is None:
        return None
    out = subprocess.run([readelf, "--notes", str(hsaco)], capture_output=True, text=True,
                         check=True).stdout
    return _parse_metadata_yaml(out, kernel_name)


def _parse_metadata_yaml(text: str, kernel_name: str) -> dict | None:
    """Just enough of the metadata YAML: scalar `.key: value` fields and the `.args` list."""
    blocks = re.split(r"\n  - \.", text)
    for block in blocks:
        if not re.search(rf"\.name:\s+{re.escape(kernel_name)}\s*$", block, re.M):
            continue
        meta: dict = {"args": []}
        arg: dict | None = None
        for line in ("." + block).splitlines():
            m = re.match(r"^(\s*)(- )?\.([a-z_]+):\s*(\S*)\s*$", line)
            if not m:
                continue
            indent, dash, key, val = len(m.group(1)), m.group(2), m.group(3), m.group(4)
            value: int | str = int(val) if re.fullmatch(r"-?\d+", val) else val
            if indent >= 6:  # inside .args
                if dash:
                    arg = {}
                    meta["args"].append(arg)
                if arg is not None:
                    arg[key] = value
            elif key != "args":
                meta[key] = value
        return meta
    return None


# -- compilation -------------------------------------------------------------------------------
def hsaco_matrix_ops(clang: Path, version: str, hsaco: Path, arch: str) -> dict[str, int] | None:
    """The code object's MFMA instructions by mnemonic, from the llvm-objdump of clang's LLVM
    (None when that LLVM has none installed)."""
    beside = Path(os.path.realpath(clang)).parent / "llvm-objdump"
    objdump = str(beside) if beside.exists() else shutil.which(f"llvm-objdump-{_major(version)}")
    if objdump is None:
        return None
    proc = subprocess.run([objdump, "-d", f"--mcpu={arch}", str(hsaco)], capture_output=True,
                          text=True)
    return matrix_ops(proc.stdout) if proc.returncode == 0 else None


def toolchain_id(arch: str) -> str:
    """The toolchain part of the variant key: clang's version and the flags of a build."""
    return f"clang={clang_version(find_clang())} {' '.join(hip_flags(arch))}"


def compile_hip(source: Source, out_dir: Path, target: Target,
                variant: str | None = None) -> Artifact:
    """Compile a rendered HIP source into `out_dir/<name>.hsaco`; return its Artifact.

    Cached in the kernel cache under sha256(source and the headers it includes, clang version,
    flags). clang compiles the source's own snapshot of the headers (what its sha256 covers)
    from a temporary folder passed with -I; a plain `Source` gets the current headers. Raises
    ToolchainMissing without clang and CompileError (with clang's stderr) on a rejected source.
    """
    source = as_cxx(source)
    clang = find_clang()
    version = clang_version(clang)
    arch = target.arch
    flags = hip_flags(arch)
    # the variant key's digest (tilegen.identity) names the code object in the cache
    key = variant or cache.key_of(source.sha256, version, " ".join(flags))
    stem = source.name.removesuffix(".hip")
    folder = cache.cache_dir() / "hip" / key[:2] / key
    cached = folder / f"{stem}.hsaco"
    if cached.exists() and (folder / "meta.json").exists():
        meta = json.loads((folder / "meta.json").read_text())
        binary = cached.read_bytes()
    else:
        with tempfile.TemporaryDirectory(prefix="tilegen-hip-") as tmp:
            src = Path(tmp) / source.name
            src.write_text(source.text)
            include = source.write_headers(Path(tmp) / "include")
            obj = Path(tmp) / f"{stem}.hsaco"
            cmd = [str(clang), *flags, "-I", str(include), str(src), "-o", str(obj)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0 or not obj.exists():
                raise CompileError(f"clang++ {version} failed on {source.name} "
                                   f"(exit {proc.returncode}):\n{proc.stderr}")
            binary = obj.read_bytes()
        usage = parse_resource_usage(proc.stderr)
        if not usage:
            raise CompileError(f"no kernel-resource-usage remarks for {HIP_KERNEL_NAME} in "
                               f"clang's output for {source.name}:\n{proc.stderr}")
        warnings = [ln for ln in proc.stderr.splitlines() if "warning:" in ln]
        meta = {"usage": usage, "clang": version, "flags": flags, "warnings": warnings,
                "command": [Path(cmd[0]).name, *flags, "-I",
                            f"{paths.TEMPLATES_DIR.name}/{INCLUDE_SUBDIR}", source.name, "-o",
                            f"{stem}.hsaco"],
                "source_sha256": source.sha256, "stamp": source_stamp(source)}
        cache.store("hip", key, f"{stem}.hsaco", binary, meta=meta)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    src_path = cache.atomic_write(out_dir / source.name, source.text)
    path = cache.atomic_write(out_dir / f"{stem}.hsaco", binary)
    usage = meta["usage"]
    stamp = meta.get("stamp", {})
    return Artifact(
        path=path, kind="hsaco", backend="hip", target=target.name, arch=arch,
        kernel_name=HIP_KERNEL_NAME, source=src_path, source_sha256=source.sha256,
        config=stamp.get("config", ""), registers=usage.get("vgprs"), agprs=usage.get("agprs"),
        shared_bytes=usage.get("lds_bytes"), spill_bytes=usage.get("scratch_bytes"),
        stack_bytes=usage.get("scratch_bytes"),  # private segment: spills + stack
        occupancy=usage.get("occupancy"), threads=stamp.get("threads"),
        compiler={"clang": meta["clang"]}, command=list(meta["command"]),
        matrix_ops=hsaco_matrix_ops(clang, version, path, arch),
    )
