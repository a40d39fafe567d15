"""CK-style HIP C++ for gfx942: render (`render_hip`) and compile (`compile_hip`) with clang-19.

The kernel source is self-contained: it needs only clang's AMDGPU builtins, so it is compiled
with ``-nogpuinc -nogpulib`` and no ROCm install. (Triton's wheel ships a partial set of HIP
headers under ``triton/backends/amd/include``; ``hip/hip_runtime.h`` from it does not compile
with Debian's clang-19, whose CUDA/HIP wrapper headers expect the full ROCm math headers. The
kernel needs none of it: no libm, no ockl/ocml, only ``__builtin_amdgcn_*`` and the generic
``__builtin_exp2f``/``__builtin_log2f`` that the AMDGPU backend lowers to ``v_exp_f32`` /
``v_log_f32``.)

`HipPlan` holds every number the template bakes in (wave layout, MFMA shape, LDS layout and
size, copy chunks, grid) and the index maps (MFMA lane maps, LDS swizzle, copy chunks). The
template reads the plan; the C++ re-derives the numbers from the primary parameters and
`static_assert`s that they, and fingerprints of its own index maps, equal the plan's; the tests
drive a NumPy emulation of the kernel's tile walk from the same plan.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from tilegen import cache
from tilegen.compile import Artifact, CompileError, ToolchainMissing
from tilegen.config import KernelConfig
from tilegen.render import Source, render, spec_basename
from tilegen.spec import Spec
from tilegen.targets import get_target

HIP_TEMPLATE = "hip/lut_kernel.hip.j2"
HIP_KERNEL_NAME = "tilegen_block_sparse_attn"
HIP_ARCH = "gfx942"
INSTALL_HINT = "apt-get install -y clang-19 lld-19"
WAVE = 64  # gfx942 (CDNA3) runs wave64 only

#: LDS bank conflicts are avoided by an XOR swizzle of 8-byte units (4 elements) inside each LDS
#: row rather than by padding, which keeps the default config's two K/V stages at exactly
#: 32 KiB: two workgroups fit a CU's 64 KiB. See `HipPlan.swizzle`.
LDS_BANK_UNITS = 16  # 32 banks x 4 bytes = 16 units of 8 bytes

#: MFMA instructions the template can use: (dtype, MN) -> name. Both shapes take four 16-bit
#: values per lane per operand (K = 4 * lane groups: 8 for 32x32, 16 for 16x16).
MFMA_NAMES = {
    ("bf16", 32): "v_mfma_f32_32x32x8bf16_1k",
    ("bf16", 16): "v_mfma_f32_16x16x16bf16_1k",
    ("fp16", 32): "v_mfma_f32_32x32x8f16",
    ("fp16", 16): "v_mfma_f32_16x16x16f16",
}


@dataclass(frozen=True)
class HipPlan:
    """Everything the HIP template bakes in for one (spec, config), derived in one place.

    Wave layout: ``warps_m`` waves split the BLOCK_M query rows (``wave_m`` each), ``warps_n``
    waves split each BLOCK_N-key sub-tile (``slice_n`` keys each) and keep their own online
    softmax state, merged through LDS in the epilogue (a split-K merge, as in flash decoding).
    Waves go to rows first: ``warps_n`` is 1 whenever BLOCK_M has 16 rows for every wave.
    """

    head_dim: int
    block_q: int
    block_kv: int
    dtype: str
    layout: str
    vbs: bool
    store_lse: bool
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    warps_m: int
    warps_n: int
    wave_m: int
    slice_n: int
    mfma_mn: int
    mfma_k: int
    lane_groups: int
    acc_regs: int
    rep_m: int
    rep_n: int
    rep_d: int
    subtiles: int
    threads: int
    k_units: int
    v_units: int
    stage_elems: int
    pipeline_bytes: int
    merge_bytes: int
    lds_bytes: int
    copy_chunks: int
    copy_steps: int
    mfma_name: str

    # -- lane maps of one MFMA (wave64; AMD matrix instruction calculator conventions) --------
    def operand_row(self, lane: int) -> int:
        """Row of A (column of B) that `lane` supplies: lane % MN."""
        return lane % self.mfma_mn

    def operand_k(self, lane: int, t: int) -> int:
        """k index of value t (0..3) that `lane` supplies to A and B: 4 * (lane / MN) + t."""
        return 4 * (lane // self.mfma_mn) + t

    def acc_row(self, lane: int, r: int) -> int:
        """Row of the MN x MN accumulator held in register r of `lane` (its column is
        lane % MN): 4 * G * (r / 4) + 4 * (lane / MN) + r % 4, G = 64 / MN lane groups."""
        return 4 * self.lane_groups * (r // 4) + 4 * (lane // self.mfma_mn) + r % 4

    # -- LDS layout (what KvBlockTile writes and WarpTile reads) -------------------------------
    @staticmethod
    def swizzle(units: int, row: int, unit: int) -> int:
        """Where 8-byte unit `unit` of LDS row `row` goes, in a row of `units` units.

        Rows that start on the same bank (every row when a row spans >= 128 bytes, else every
        (16 / units)-th one) XOR their unit index with a different value, so the 16 rows one
        MFMA operand read touches hit 16 different bank pairs.
        """
        rows_per_window = 1 if units >= LDS_BANK_UNITS else LDS_BANK_UNITS // units
        span = min(units, LDS_BANK_UNITS)
        return unit ^ ((row // rows_per_window) % span)

    def k_offset(self, key: int, d: int) -> int:
        """Element offset of K[key][d] in a stage: row-major [BLOCK_N][HEAD_DIM], swizzled."""
        u = self.swizzle(self.k_units, key, d // 4)
        return key * self.head_dim + 4 * u + d % 4

    def vt_offset(self, d: int, key: int) -> int:
        """Element offset of V[key][d] in a stage: transposed [HEAD_DIM][BLOCK_N] after the K
        tile, swizzled."""
        u = self.swizzle(self.v_units, d, key // 4)
        return self.block_n * self.head_dim + d * self.block_n + 4 * u + key % 4

    def copy_chunk(self, c: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """16-byte chunk c of the K/V copy: ((K key, first d), (V key, first d)). K chunks run
        along rows (coalesced reads); V chunks run down the keys, so the transposed 2-byte LDS
        writes of one wave land on consecutive addresses."""
        row_chunks = self.head_dim // 8
        return ((c // row_chunks, 8 * (c % row_chunks)),
                (c % self.block_n, 8 * (c // self.block_n)))

    def fingerprints(self) -> dict[str, int]:
        """Hashes of the index maps, in the order the template's constexpr twins walk them;
        the rendered source static_asserts that both sides agree."""
        def fold(values) -> int:
            h = 0
            for x in values:
                h = (h * 1000003 + x) & 0xFFFFFFFF
            return h

        acc = (self.acc_row(lane, r) for lane in range(WAVE) for r in range(self.acc_regs))
        lds = (x for key in range(self.block_n) for d in range(self.head_dim)
               for x in (self.k_offset(key, d), self.vt_offset(d, key)))
        copy = (x for c in range(self.copy_chunks) for pair in self.copy_chunk(c)
                for x in pair)
        return {"acc_rows": fold(acc), "lds": fold(lds), "copy": fold(copy)}

    # -- launch geometry ---------------------------------------------------------------------
    def grid(self, batch: int, heads: int, num_q_blocks: int) -> tuple[int, int, int]:
        """Workgroups: (query cubes * block_q / block_m, batch * heads, 1)."""
        return (num_q_blocks * (self.block_q // self.block_m), batch * heads, 1)

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)

    def to_dict(self) -> dict:
        return asdict(self)


def hip_violations(spec: Spec, cfg: KernelConfig) -> list[str]:
    """Why the HIP template cannot build (spec, cfg) on gfx942; empty when it can."""
    target = get_target(HIP_ARCH)
    out = []
    if cfg.interp_bf16:
        out.append("interp_bf16 is a Triton-interpreter option, not a HIP one")
    if spec.block_q % cfg.block_m or spec.block_kv % cfg.block_n:
        out.append(f"block_m={cfg.block_m} must divide block_q={spec.block_q} and "
                   f"block_n={cfg.block_n} must divide block_kv={spec.block_kv}")
    if cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_warps * WAVE > target.max_threads_per_block:
        out.append(f"num_warps={cfg.num_warps} must be a power of two with "
                   f"num_warps*64 <= {target.max_threads_per_block}")
    if cfg.block_m % 16 or cfg.block_n % 16:
        out.append(f"block_m={cfg.block_m} and block_n={cfg.block_n} must be multiples of 16 "
                   "(the smallest MFMA tile is 16x16)")
    if cfg.num_stages < 1:
        out.append(f"num_stages={cfg.num_stages} must be >= 1 (LDS buffers for K/V)")
    if out:
        return out
    warps_m = min(cfg.num_warps, cfg.block_m // 16)
    warps_n = cfg.num_warps // warps_m
    if cfg.block_n % (16 * warps_n):
        out.append(f"num_warps={cfg.num_warps} puts {warps_n} waves on each {cfg.block_m}-row "
                   f"tile; their key slices of block_n={cfg.block_n} must be >= 16 keys")
        return out
    plan = _derive(spec, cfg, warps_m, warps_n)
    if plan.lds_bytes > target.max_shared_bytes:
        out.append(f"needs {plan.lds_bytes} B of LDS, gfx942 has {target.max_shared_bytes}")
    return out


def plan_for(spec: Spec, cfg: KernelConfig) -> HipPlan:
    """The `HipPlan` of (spec, cfg); ValueError naming every violated rule if it has none."""
    problems = hip_violations(spec, cfg)
    if problems:
        raise ValueError(f"config {cfg.name} cannot be built by the HIP backend: "
                         + "; ".join(problems))
    warps_m = min(cfg.num_warps, cfg.block_m // 16)
    return _derive(spec, cfg, warps_m, cfg.num_warps // warps_m)


def _derive(spec: Spec, cfg: KernelConfig, warps_m: int, warps_n: int) -> HipPlan:
    wave_m = cfg.block_m // warps_m
    slice_n = cfg.block_n // warps_n
    # 32x32x8 halves the operand traffic per flop; it needs 32 rows and 32 keys per wave.
    mn = 32 if wave_m % 32 == 0 and slice_n % 32 == 0 else 16
    groups = WAVE // mn
    d = spec.head_dim
    stage_elems = 2 * cfg.block_n * d  # K and V^T
    pipeline_bytes = 2 * cfg.num_stages * stage_elems
    # m and l of every wave's rows, plus the O partials of waves 1.. of each row group.
    merge_bytes = 0 if warps_n == 1 else 4 * (2 * warps_n * cfg.block_m
                                             + (warps_n - 1) * cfg.block_m * d)
    threads = cfg.num_warps * WAVE
    chunks = cfg.block_n * d // 8
    return HipPlan(
        head_dim=d, block_q=spec.block_q, block_kv=spec.block_kv, dtype=spec.dtype,
        layout=spec.layout, vbs=spec.variable_block_sizes, store_lse=cfg.store_lse,
        block_m=cfg.block_m, block_n=cfg.block_n, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, warps_m=warps_m, warps_n=warps_n, wave_m=wave_m,
        slice_n=slice_n, mfma_mn=mn, mfma_k=4 * groups, lane_groups=groups,
        acc_regs=mn * mn // WAVE, rep_m=wave_m // mn, rep_n=slice_n // mn, rep_d=d // mn,
        subtiles=spec.block_kv // cfg.block_n, threads=threads, k_units=d // 4,
        v_units=cfg.block_n // 4, stage_elems=stage_elems, pipeline_bytes=pipeline_bytes,
        merge_bytes=merge_bytes, lds_bytes=max(pipeline_bytes, merge_bytes),
        copy_chunks=chunks, copy_steps=-(-chunks // threads),
        mfma_name=MFMA_NAMES[(spec.dtype, mn)],
    )


# -- rendering ---------------------------------------------------------------------------------
def hip_source_name(spec: Spec, cfg: KernelConfig) -> str:
    """File name with every spec trait and every config trait (launch parameters are baked in)."""
    return f"{spec_basename(spec)}_{cfg.name}.hip"


def render_hip(spec: Spec, cfg: KernelConfig) -> Source:
    """The HIP C++ source of (spec, cfg) for gfx942. Unlike the Triton source, block sizes,
    waves and stages are C++ template arguments, so each launch configuration is one file."""
    plan = plan_for(spec, cfg)
    return render(HIP_TEMPLATE, "hip", spec, cfg, hip_source_name(spec, cfg), HIP_KERNEL_NAME,
                  p=plan)


_STAMP = re.compile(r"^// tilegen-hip: (\{.*\})$", re.M)


def source_stamp(source: Source) -> dict:
    """The JSON stamp the template writes on its second line: config name, threads, LDS."""
    m = _STAMP.search(source.text)
    return json.loads(m.group(1)) if m else {}


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


def hip_flags(arch: str = HIP_ARCH) -> list[str]:
    """Device-only HIP compile to a bare code object (.hsaco, an ELF the runtime loads)."""
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
def compile_hip(source: Source, out_dir: Path, *, arch: str = HIP_ARCH) -> Artifact:
    """Compile a rendered HIP source into `out_dir/<name>.hsaco`; return its Artifact.

    Cached in the kernel cache under sha256(source, clang version, flags). Raises
    ToolchainMissing without clang and CompileError (with clang's stderr) on a rejected source.
    """
    clang = find_clang()
    version = clang_version(clang)
    flags = hip_flags(arch)
    key = cache.key_of(source.text, version, " ".join(flags))
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
            obj = Path(tmp) / f"{stem}.hsaco"
            cmd = [str(clang), *flags, str(src), "-o", str(obj)]
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
                "command": [Path(cmd[0]).name, *flags, source.name, "-o", f"{stem}.hsaco"],
                "source_sha256": source.sha256, "stamp": source_stamp(source)}
        cache.store("hip", key, f"{stem}.hsaco", binary, meta=meta)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    src_path = cache.atomic_write(out_dir / source.name, source.text)
    path = cache.atomic_write(out_dir / f"{stem}.hsaco", binary)
    usage = meta["usage"]
    stamp = meta.get("stamp", {})
    return Artifact(
        path=path, kind="hsaco", backend="hip", target=arch, arch=arch,
        kernel_name=HIP_KERNEL_NAME, source=src_path, source_sha256=source.sha256,
        config=stamp.get("config", ""), registers=usage.get("vgprs"), agprs=usage.get("agprs"),
        shared_bytes=usage.get("lds_bytes"), spill_bytes=usage.get("scratch_bytes"),
        stack_bytes=usage.get("scratch_bytes"),  # private segment: spills + stack
        occupancy=usage.get("occupancy"), threads=stamp.get("threads"),
        compiler={"clang": meta["clang"]}, command=list(meta["command"]),
    )


def build_hip(spec: Spec, cfg: KernelConfig, out_dir: Path) -> Artifact:
    """Render and compile in one step (what `tilegen build --target gfx942` needs)."""
    return compile_hip(render_hip(spec, cfg), out_dir)
