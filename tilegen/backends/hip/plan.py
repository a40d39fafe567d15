"""CK-style HIP C++ for gfx942: render (`render_hip`) and compile (`compile_hip`) with clang-19.

The rendered ``.hip`` file is the variant's config (`Params`: element type, layout, MFMA size,
block sizes, waves, stages, options) over the static library under
``templates/hip/include/tilegen/hip/`` (plain C++ headers, the tile pieces as templates over the
config), the plan checks and the entry point; it is a `tilegen.identity.CxxSource` (its sha256
covers the headers it includes). The kernel needs only clang's AMDGPU builtins, so it is
compiled with ``-nogpuinc -nogpulib`` (and ``-I`` the include folder) and no ROCm install.
(Triton's wheel ships a partial set of HIP headers under ``triton/backends/amd/include``;
``hip/hip_runtime.h`` from it does not compile with Debian's clang-19, whose CUDA/HIP wrapper
headers expect the full ROCm math headers. The kernel needs none of it: no libm, no
ockl/ocml, only ``__builtin_amdgcn_*`` and the generic ``__builtin_exp2f``/``__builtin_log2f``
that the AMDGPU backend lowers to ``v_exp_f32`` / ``v_log_f32``.)

`HipPlan` holds every number the template bakes in (wave layout, MFMA shape, LDS layout and
size, copy chunks, grid) and the index maps (MFMA lane maps, LDS swizzle, copy chunks). The
template reads the plan; the library re-derives the numbers from the primary parameters and
the rendered file `static_assert`s that they, and fingerprints of the library's index maps,
equal the plan's. The tests run the rendered C++ itself on a CPU executor
(`tilegen.backends.hip.host`).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from tilegen import paths
from tilegen.config import KernelConfig
from tilegen.identity import CxxSource
from tilegen.render import Source, render, spec_basename
from tilegen.spec import Spec
from tilegen.targets import Target

HIP_TEMPLATE = "hip/lut_kernel.hip.j2"
HIP_KERNEL_NAME = "tilegen_block_sparse_attn"
#: where the library's headers are, under the templates folder (`include_dir`)
INCLUDE_SUBDIR = "hip/include"

#: LDS bank conflicts are avoided by an XOR swizzle of 8-byte units (4 elements) inside each LDS
#: row rather than by padding, which keeps the default config's two K/V stages at exactly
#: 32 KiB: two workgroups fit a CU's 64 KiB. See `HipPlan.swizzle`. The bank count and width
#: come from the target (target.toml lds_banks, lds_bank_bytes).
SWIZZLE_UNIT_BYTES = 8


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
    store_max_prob: bool
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
    wave: int  # lanes per wave (target.toml warp_size)
    lds_bank_units: int  # 8-byte swizzle units that span all LDS banks once


    # -- the library's names for the plan's choices (the rendered `Params`) -------------------
    @property
    def elem(self) -> str:
        """The element type (templates/hip/include/tilegen/hip/elem.hpp)."""
        return {"bf16": "Bf16", "fp16": "F16"}[self.dtype]

    @property
    def layout_type(self) -> str:
        """The token layout (block_tile.hpp)."""
        return {"bshd": "Bshd", "bhsd": "Bhsd"}[self.layout]

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
    def swizzle(self, units: int, row: int, unit: int) -> int:
        """Where 8-byte unit `unit` of LDS row `row` goes, in a row of `units` units.

        Rows that start on the same bank (every row when a row spans >= 128 bytes, else every
        (16 / units)-th one) XOR their unit index with a different value, so the 16 rows one
        MFMA operand read touches hit 16 different bank pairs.
        """
        bank_units = self.lds_bank_units
        rows_per_window = 1 if units >= bank_units else bank_units // units
        span = min(units, bank_units)
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

        acc = (self.acc_row(lane, r) for lane in range(self.wave) for r in range(self.acc_regs))
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


def hip_violations(spec: Spec, cfg: KernelConfig, target: Target) -> list[str]:
    """Why the HIP template cannot build (spec, cfg) on `target`; empty when it can."""
    out = []
    if not target.mma_for("mfma", spec.dtype):
        return [f"target {target.name} has no MFMA instruction for {spec.dtype}"]
    if cfg.interp_bf16:
        out.append("interp_bf16 is a Triton-interpreter option, not a HIP one")
    if spec.block_q % cfg.block_m or spec.block_kv % cfg.block_n:
        out.append(f"block_m={cfg.block_m} must divide block_q={spec.block_q} and "
                   f"block_n={cfg.block_n} must divide block_kv={spec.block_kv}")
    wave = target.warp_size
    if cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_warps * wave > target.max_threads_per_block:
        out.append(f"num_warps={cfg.num_warps} must be a power of two with "
                   f"num_warps*{wave} <= {target.max_threads_per_block}")
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
    plan = _derive(spec, cfg, target, warps_m, warps_n)
    if plan.lds_bytes > target.max_shared_bytes:
        out.append(f"needs {plan.lds_bytes} B of LDS, {target.name} has "
                   f"{target.max_shared_bytes}")
    return out


def plan_for(spec: Spec, cfg: KernelConfig, target: Target) -> HipPlan:
    """The `HipPlan` of (spec, cfg); ValueError naming every violated rule if it has none."""
    problems = hip_violations(spec, cfg, target)
    if problems:
        raise ValueError(f"config {cfg.name} cannot be built by the HIP backend: "
                         + "; ".join(problems))
    warps_m = min(cfg.num_warps, cfg.block_m // 16)
    return _derive(spec, cfg, target, warps_m, cfg.num_warps // warps_m)


def _mfma(spec: Spec, target: Target, mn: int) -> str:
    """The target's MFMA for the dtype with an MN x MN tile (target.toml [[mma]])."""
    for m in target.mma_for("mfma", spec.dtype):
        if m.m == m.n == mn:
            return m.name
    raise ValueError(f"target {target.name} has no {mn}x{mn} MFMA for {spec.dtype}")


def _derive(spec: Spec, cfg: KernelConfig, target: Target, warps_m: int,
            warps_n: int) -> HipPlan:
    wave_m = cfg.block_m // warps_m
    slice_n = cfg.block_n // warps_n
    # 32x32x8 halves the operand traffic per flop; it needs 32 rows and 32 keys per wave.
    sizes = sorted({m.m for m in target.mma_for("mfma", spec.dtype)})
    mn = max([s for s in sizes if wave_m % s == 0 and slice_n % s == 0] or sizes[:1])
    wave = target.warp_size
    groups = wave // mn
    d = spec.head_dim
    stage_elems = 2 * cfg.block_n * d  # K and V^T
    pipeline_bytes = 2 * cfg.num_stages * stage_elems
    # m and l of every wave's rows, plus the O partials of waves 1.. of each row group.
    merge_bytes = 0 if warps_n == 1 else 4 * (2 * warps_n * cfg.block_m
                                             + (warps_n - 1) * cfg.block_m * d)
    threads = cfg.num_warps * wave
    chunks = cfg.block_n * d // 8
    return HipPlan(
        head_dim=d, block_q=spec.block_q, block_kv=spec.block_kv, dtype=spec.dtype,
        layout=spec.layout, vbs=spec.variable_block_sizes, store_lse=cfg.store_lse,
        store_max_prob=cfg.store_max_prob, block_m=cfg.block_m, block_n=cfg.block_n,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, warps_m=warps_m, warps_n=warps_n, wave_m=wave_m,
        slice_n=slice_n, mfma_mn=mn, mfma_k=4 * groups, lane_groups=groups,
        acc_regs=mn * mn // wave, rep_m=wave_m // mn, rep_n=slice_n // mn, rep_d=d // mn,
        subtiles=spec.block_kv // cfg.block_n, threads=threads, k_units=d // 4,
        v_units=cfg.block_n // 4, stage_elems=stage_elems, pipeline_bytes=pipeline_bytes,
        merge_bytes=merge_bytes, lds_bytes=max(pipeline_bytes, merge_bytes),
        copy_chunks=chunks, copy_steps=-(-chunks // threads),
        mfma_name=_mfma(spec, target, mn), wave=wave,
        lds_bank_units=target.fact("lds_banks") * target.fact("lds_bank_bytes")
        // SWIZZLE_UNIT_BYTES,
    )


# -- rendering ---------------------------------------------------------------------------------
def hip_source_name(spec: Spec, cfg: KernelConfig) -> str:
    """File name with every spec trait and every config trait (launch parameters are baked in)."""
    return f"{spec_basename(spec)}_{cfg.name}.hip"


def include_dir() -> Path:
    """The HIP library's include folder: ``templates/hip/include`` of the checkout, or inside
    the wheel (`tilegen.paths`)."""
    return paths.require(paths.TEMPLATES_DIR / INCLUDE_SUBDIR, "HIP headers")


def render_hip(spec: Spec, cfg: KernelConfig, target: Target) -> CxxSource:
    """The HIP C++ source of (spec, cfg) for gfx942, with the headers it includes. Unlike the
    Triton source, block sizes, waves and stages are C++ template arguments, so each launch
    configuration is one file."""
    plan = plan_for(spec, cfg, target)
    src = render(HIP_TEMPLATE, "hip", spec, cfg, hip_source_name(spec, cfg), HIP_KERNEL_NAME,
                 target=target, p=plan)
    return CxxSource.including(src, include_dir())


def as_cxx(source: Source) -> CxxSource:
    """`source` as compiled: a `CxxSource` as it is, a plain `Source` with the headers it
    includes now (`include_dir`)."""
    return source if isinstance(source, CxxSource) else CxxSource.including(source,
                                                                              include_dir())


_STAMP = re.compile(r"^// tilegen-hip: (\{.*\})$", re.M)


def source_stamp(source: Source) -> dict:
    """The JSON stamp the template writes on its second line: config name, threads, LDS."""
    m = _STAMP.search(source.text)
    return json.loads(m.group(1)) if m else {}


