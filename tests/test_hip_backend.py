"""HIP backend (gfx942): rendering, clang-19 compilation, resources, and the kernel run on a CPU.

No AMD GPU here. The rendered HIP C++ itself (the text `tilegen build --target gfx942` compiles:
the variant's config and entry point over the static headers under templates/hip/include)
is built as host C++ by `tilegen.backends.hip.host` and run on a CPU executor: lanes as fibers,
waves of 64 in lockstep at every cross-lane op, real workgroup barriers, poisoned LDS, MFMAs with
the lane layouts of AMD's matrix instruction calculator. Its output is scored against
`tilegen.reference` with the contract's rule, for every config of the gfx942 tuning space, and
deliberate bugs in the C++ text must make it fail. Nothing here has run on an MI300.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from tilegen import captures
from tilegen import config as cfgmod
from tilegen.backends.hip import compile as hipcc
from tilegen.backends.hip import plan as hipp
from tilegen.backends.hip import runtime as hiprt
from tilegen.compile import CompileError, ToolchainMissing
from tilegen.config import KernelConfig, default_config
from tilegen.identity import CxxSource, include_closure
from tilegen.reference import attention_fp32
from tilegen.render import HEADER, Source
from tilegen.spec import Spec
from tilegen.targets import get_target

TARGET = get_target("gfx942")
DEFAULT = default_config(TARGET)
#: Other block configs: the 32x32x8 MFMA path (2 waves of 32 rows, one LDS stage) and two waves
#: per row group (split keys, merged in the epilogue).
OTHER_CONFIGS = (KernelConfig(block_m=64, block_n=64, num_warps=2, num_stages=1),
                 KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=2))
VARIANTS = [Spec(head_dim=d, dtype=dt, layout=lay)
            for d, dt, lay in itertools.product((64, 128), ("bf16", "fp16"), ("bshd", "bhsd"))]

needs_clang = pytest.mark.skipif(
    shutil.which("clang++-19") is None and shutil.which("/opt/rocm/llvm/bin/clang++") is None,
    reason=f"clang++-19 not installed (install: {hipcc.INSTALL_HINT})")


@pytest.fixture(scope="module")
def hip_cache(tmp_path_factory) -> Path:
    """A private kernel cache for this module (restored afterwards), so the tests can look in."""
    root = tmp_path_factory.mktemp("hip_cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("TILEGEN_CACHE_DIR", str(root / "cache"))
    yield root
    mp.undo()


@pytest.fixture(scope="module")
def compiled(hip_cache):
    """Compile each (spec, config) once per session (only this module compiles HIP)."""
    done: dict = {}

    def get(spec: Spec, cfg: KernelConfig):
        key = (spec, cfg)
        if key not in done:
            src = hipp.render_hip(spec, cfg, TARGET)
            done[key] = hipcc.compile_hip(src, hip_cache / "out", TARGET)
        return done[key]

    return get


# -- rendering ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: f"d{s.head_dim}_{s.dtype}_{s.layout}")
def test_render_header_and_determinism(spec: Spec) -> None:
    src = hipp.render_hip(spec, DEFAULT, TARGET)
    first = src.text.splitlines()[0]
    assert first == "// " + HEADER.format(template=hipp.HIP_TEMPLATE, kernel_hash=spec.kernel_hash,
                                          target="gfx942 (gfx942)")
    assert hipp.render_hip(spec, DEFAULT, TARGET).text == src.text
    assert src.name == (f"lut_d{spec.head_dim}_{spec.dtype}_{spec.layout}_vbs_q64k64_"
                        f"{DEFAULT.name}.hip")
    stamp = hipp.source_stamp(src)
    plan = hipp.plan_for(spec, DEFAULT, TARGET)
    assert stamp == {"config": DEFAULT.name, "threads": plan.threads,
                     "lds_bytes": plan.lds_bytes, "mfma": plan.mfma_name}
    # the render-time choices are the config's types and constants (the headers branch on them)
    assert f"typedef {spec.layout.capitalize()} Layout;" in src.text
    assert f"typedef {'Bf16' if spec.dtype == 'bf16' else 'F16'} Elem;" in src.text
    assert f"static constexpr int MFMA_MN = {plan.mfma_mn};  // {plan.mfma_name}" in src.text
    assert "{{" not in src.text and "{%" not in src.text


def test_rendered_kernel_is_config_over_the_headers() -> None:
    """The .hip holds the config, the plan checks and the entry point; the library is in the
    static headers (no Jinja in them); the source's sha256 covers them."""
    src = hipp.render_hip(Spec(), DEFAULT.replace(store_max_prob=True), TARGET)
    assert '#include "tilegen/hip/lut_attention.hpp"' in src.text
    assert src.text.count("\n") < 80 and "__builtin_amdgcn" not in src.text
    inc = hipp.include_dir()
    on_disk = sorted(p.relative_to(inc).as_posix() for p in inc.rglob("*") if p.is_file())
    assert [rel for rel, _ in src.headers] == on_disk and len(on_disk) >= 5
    for rel, data in src.headers:
        assert rel.startswith("tilegen/hip/") and rel.endswith(".hpp")
        assert b"{{" not in data and b"{%" not in data and b"#pragma once" in data
    assert src.headers == include_closure(src.text, inc)
    full = src.expanded()
    assert full.count("struct WarpTile {") == 1 and "#include" not in full
    assert "atomic_add_f32(max_prob_cube" in full
    # one header byte more: the same text, another sha256 (cached builds and winners follow)
    rel, data = src.headers[0]
    edited = replace(src, headers=((rel, data + b"\n"), *src.headers[1:]))
    assert edited.text == src.text and edited.sha256 != src.sha256
    # the include folder is no part of the toolchain id
    assert "-I" not in hipcc.toolchain_id(TARGET.arch)


def test_render_differs_per_config_and_rejects_bad_ones() -> None:
    spec = Spec()
    texts = {hipp.render_hip(spec, cfg, TARGET).text for cfg in (DEFAULT, *OTHER_CONFIGS)}
    assert len(texts) == 3
    with pytest.raises(ValueError, match="block_m=48"):
        hipp.render_hip(spec, KernelConfig(block_m=48), TARGET)
    with pytest.raises(ValueError, match="key slices"):
        hipp.render_hip(spec, KernelConfig(block_m=32, block_n=32, num_warps=8), TARGET)
    with pytest.raises(ValueError, match="LDS"):
        hipp.render_hip(spec, KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=3),
                        TARGET)


def test_plan_of_default() -> None:
    plan = hipp.plan_for(Spec(), DEFAULT, TARGET)
    assert (plan.warps_m, plan.warps_n, plan.wave_m, plan.slice_n) == (4, 1, 16, 32)
    assert plan.mfma_name == "v_mfma_f32_16x16x16bf16_1k"
    assert plan.lds_bytes == 2 * 2 * 32 * 128 * 2 == 32768  # 2 stages x (K + V^T): 2 per CU
    assert plan.grid(1, 40, 624) == (624, 40, 1) and plan.block == (256, 1, 1)
    p32 = hipp.plan_for(Spec(), OTHER_CONFIGS[0], TARGET)
    assert (p32.mfma_mn, p32.mfma_k, p32.mfma_name) == (32, 8, "v_mfma_f32_32x32x8bf16_1k")


# -- MFMA lane maps and LDS layout ------------------------------------------------------------
@pytest.mark.parametrize("cfg", [DEFAULT, OTHER_CONFIGS[0]], ids=["16x16x16", "32x32x8"])
def test_mfma_lane_maps(cfg: KernelConfig) -> None:
    p = hipp.plan_for(Spec(), cfg, TARGET)
    mn, k = p.mfma_mn, p.mfma_k
    # A (MN x K) / B (K x MN): every element supplied by exactly one (lane, t)
    cells = {(p.operand_row(lane), p.operand_k(lane, t)) for lane in range(64) for t in range(4)}
    assert cells == set(itertools.product(range(mn), range(k)))
    # C: every element held by exactly one (lane, register)
    cells = [(p.acc_row(lane, r), lane % mn) for lane in range(64) for r in range(p.acc_regs)]
    assert sorted(cells) == sorted(itertools.product(range(mn), range(mn)))
    # AMD's documented 32x32x8 layout: rows 8*(r/4) + 4*(lane/32) + r%4; 16x16x16: 4*(lane/16)+r
    for lane, r in itertools.product(range(64), range(p.acc_regs)):
        want = (8 * (r // 4) + 4 * (lane // 32) + r % 4) if mn == 32 else 4 * (lane // 16) + r
        assert p.acc_row(lane, r) == want
    # S^T registers 4s..4s+3 are the B operand (P^T) of PV K-step s
    for lane, s, t in itertools.product(range(64), range(mn // k), range(4)):
        assert p.acc_row(lane, 4 * s + t) == k * s + p.operand_k(lane, t)


@pytest.mark.parametrize("spec,cfg", [(Spec(), DEFAULT), (Spec(head_dim=64), DEFAULT),
                                      (Spec(), OTHER_CONFIGS[0])])
def test_lds_layout_is_a_conflict_free_permutation(spec: Spec, cfg: KernelConfig) -> None:
    p = hipp.plan_for(spec, cfg, TARGET)
    k_offs = {p.k_offset(key, d) for key in range(p.block_n) for d in range(p.head_dim)}
    v_offs = {p.vt_offset(d, key) for key in range(p.block_n) for d in range(p.head_dim)}
    assert k_offs | v_offs == set(range(p.stage_elems)) and not k_offs & v_offs

    def bank_pair(elem_offset: int) -> int:
        return (elem_offset * 2 // 8) % 16  # 8-byte unit -> one of 16 bank pairs

    mn = p.mfma_mn
    for unit in range(p.head_dim // 4):  # a QK A-operand read: 16 consecutive keys, one unit
        assert len({bank_pair(p.k_offset(key, 4 * unit)) for key in range(16)}) == 16
    for unit in range(p.block_n // 4):  # a PV A-operand read: 16 consecutive d, one key unit
        assert len({bank_pair(p.vt_offset(d, 4 * unit)) for d in range(min(16, mn))}) == 16
    chunks = [p.copy_chunk(c) for c in range(p.copy_chunks)]
    assert sorted(kc for kc, _ in chunks) == sorted(vc for _, vc in chunks)
    assert sorted(kc for kc, _ in chunks) == sorted(
        itertools.product(range(p.block_n), range(0, p.head_dim, 8)))


# -- kernarg packing and launch geometry ------------------------------------------------------
def test_pack_kernargs() -> None:
    args = hiprt.kernel_args()
    assert [(a.name, a.offset, a.size) for a in args[:2]] == [("q", 0, 8), ("k", 8, 8)]
    assert [(a.name, a.offset) for a in args[8:]] == [
        ("seq_len", 64), ("num_heads", 68), ("num_q_blocks", 72), ("topk", 76), ("qk_scale", 80)]
    values = {name: i * 0x1000 + 16 for i, (name, _) in enumerate(hiprt.KERNEL_PARAMS)}
    values.update(counts=0, seq_len=39936, num_heads=40, num_q_blocks=624, topk=78,
                  qk_scale=0.125)
    buf = hiprt.pack_kernargs(values)
    assert len(buf) == hiprt.kernarg_size() == 84
    assert int.from_bytes(buf[8:16], "little") == values["k"]
    assert buf[32:40] == bytes(8)  # counts = nullptr
    assert np.frombuffer(buf[64:80], "<i4").tolist() == [39936, 40, 624, 78]
    assert np.frombuffer(buf[80:84], "<f4")[0] == np.float32(0.125)
    with pytest.raises(ValueError, match="missing"):
        hiprt.pack_kernargs({"q": 0})


def test_launch_geometry() -> None:
    shapes = hiprt.Shapes(batch=2, seq_len=4 * 64, heads=3, head_dim=128, num_q_blocks=4,
                          num_kv_blocks=4, topk=2)
    assert hiprt.launch_geometry(hipp.plan_for(Spec(), DEFAULT, TARGET), shapes) == ((4, 6, 1),
                                                                            (256, 1, 1))
    half = KernelConfig(block_m=32, block_n=32, num_warps=2, num_stages=2)
    assert hiprt.launch_geometry(hipp.plan_for(Spec(), half, TARGET), shapes)[0] == (8, 6, 1)


def test_launcher_needs_hip_python() -> None:
    try:
        import hip  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="hip-python"):
            hiprt.HipKernel(b"")
    else:  # pragma: no cover - only on a ROCm machine
        pytest.skip("hip-python is installed")


# -- compilation ------------------------------------------------------------------------------
def test_find_clang_missing(monkeypatch) -> None:
    monkeypatch.setenv("TILEGEN_CLANG", "no-such-clang++")
    with pytest.raises(ToolchainMissing, match="apt-get install -y clang-19 lld-19"):
        hipcc.find_clang()
    monkeypatch.delenv("TILEGEN_CLANG")
    monkeypatch.setattr(hipcc.shutil, "which", lambda name: None)
    with pytest.raises(ToolchainMissing, match="apt-get install -y clang-19 lld-19"):
        hipcc.find_clang()


@needs_clang
@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: f"d{s.head_dim}_{s.dtype}_{s.layout}")
def test_default_variants_compile_within_budget(spec: Spec, compiled) -> None:
    art = compiled(spec, DEFAULT)
    plan = hipp.plan_for(spec, DEFAULT, TARGET)
    assert art.path.exists() and art.path.read_bytes()[:4] == b"\x7fELF"
    assert (art.kind, art.backend, art.target, art.arch) == ("hsaco", "hip", "gfx942", "gfx942")
    assert art.config == DEFAULT.name and art.threads == 256
    assert art.compiler["clang"]
    assert art.spill_bytes == 0 and art.stack_bytes == 0  # no scratch at all
    assert art.shared_bytes == plan.lds_bytes <= TARGET.max_shared_bytes
    assert art.registers is not None and art.registers + (art.agprs or 0) <= 512
    assert art.occupancy is not None and art.occupancy >= 2
    assert art.source.read_text().startswith("// Generated by tilegen")
    # the code object runs on the plan's MFMA and nothing else (llvm-objdump's spelling:
    # v_mfma_f32_16x16x16_bf16 for the plan's v_mfma_f32_16x16x16bf16_1k)
    shape = re.search(r"\d+x\d+x\d+", plan.mfma_name).group(0)
    assert art.matrix_ops is not None, "llvm-objdump-19 not found: apt-get install -y llvm-19"
    assert art.matrix_ops and all(shape in op for op in art.matrix_ops), art.matrix_ops


@needs_clang
@pytest.mark.parametrize("cfg", OTHER_CONFIGS, ids=lambda c: c.name)
def test_other_configs_compile(cfg: KernelConfig, compiled) -> None:
    art = compiled(Spec(), cfg)
    assert art.spill_bytes == 0
    lds = hipp.plan_for(Spec(), cfg, TARGET).lds_bytes
    assert art.shared_bytes == lds <= TARGET.max_shared_bytes


@needs_clang
def test_kernarg_layout_matches_code_object(compiled) -> None:
    art = compiled(Spec(), DEFAULT)
    meta = hipcc.kernel_metadata(art.path)
    if meta is None:
        pytest.skip("llvm-readelf-19 not installed")
    got = [(a["offset"], a["size"]) for a in meta["args"]]
    assert got == [(a.offset, a.size) for a in hiprt.kernel_args()]
    assert meta["kernarg_segment_size"] == hiprt.kernarg_size()
    assert meta["group_segment_fixed_size"] == art.shared_bytes
    assert meta["private_segment_fixed_size"] == 0 and meta["wavefront_size"] == 64
    assert meta["max_flat_workgroup_size"] == art.threads


@needs_clang
def test_cache_and_errors(compiled, hip_cache) -> None:
    spec = Spec()
    art = compiled(spec, DEFAULT)
    again = hipcc.compile_hip(hipp.render_hip(spec, DEFAULT, TARGET), hip_cache / "again", TARGET)
    assert again.path.read_bytes() == art.path.read_bytes()
    assert again.registers == art.registers and again.occupancy == art.occupancy
    entries = list((hip_cache / "cache" / "hip").rglob("meta.json"))
    assert entries and all('"warnings": []' in e.read_text() for e in entries)
    src = hipp.render_hip(spec, DEFAULT, TARGET)
    assert art.command[art.command.index("-I") + 1] == "templates/hip/include"
    # A plan that disagrees with the C++ index maps does not compile.
    fp = hipp.plan_for(spec, DEFAULT, TARGET).fingerprints()["acc_rows"]
    broken = replace(src, text=src.text.replace(f"{fp}u", f"{fp + 1}u"), name="broken.hip")
    with pytest.raises(CompileError, match="accumulator lane map"):
        hipcc.compile_hip(broken, hip_cache / "broken", TARGET)
    bad = replace(src, text=src.text + "\nthis is not C++;\n", name="bad.hip")
    with pytest.raises(CompileError, match="error"):
        hipcc.compile_hip(bad, hip_cache / "bad", TARGET)
    # clang compiles the headers the source carries: a broken header breaks the build, and a
    # plain Source gets the current ones
    header = edit_cxx(src, [("int THREADS = P::WARPS_M", "int THREADS = 2 * P::WARPS_M", 0)])
    assert header.text == src.text and header.sha256 != src.sha256
    with pytest.raises(CompileError, match="threads"):
        hipcc.compile_hip(replace(header, name="header.hip"), hip_cache / "header", TARGET)
    plain = Source(src.text, src.name, src.template, "hip")
    assert hipp.as_cxx(plain) == src
    assert hipcc.compile_hip(plain, hip_cache / "plain", TARGET).path.read_bytes() == \
        art.path.read_bytes()


def test_parse_resource_usage() -> None:
    stderr = "\n".join(
        f"k.hip:1:1: remark: {line} [-Rpass-analysis=kernel-resource-usage]" for line in (
            "Function Name: other", "    VGPRs: 3",
            f"Function Name: {hipp.HIP_KERNEL_NAME}", "    SGPRs: 45", "    VGPRs: 160",
            "    AGPRs: 44", "    ScratchSize [bytes/lane]: 0", "    Dynamic Stack: False",
            "    Occupancy [waves/SIMD]: 2", "    SGPRs Spill: 0", "    VGPRs Spill: 0",
            "    LDS Size [bytes/block]: 32768"))
    assert hipcc.parse_resource_usage(stderr) == {
        "sgprs": 45, "vgprs": 160, "agprs": 44, "scratch_bytes": 0, "dynamic_stack": 0,
        "occupancy": 2, "sgpr_spill": 0, "vgpr_spill": 0, "lds_bytes": 32768}


# -- the rendered C++ itself, run on the CPU executor ------------------------------------------
# tilegen.backends.hip.host compiles the exact text of render_hip(spec, cfg) as host C++ after
# hip_host_runtime.h (fibers for lanes, waves of 64 in lockstep at every cross-lane op, real
# workgroup barriers, poisoned LDS, MFMAs with the lane layouts of AMD's matrix instruction
# calculator) and launches it with the ROCm launcher's kernarg bytes and grid. It replaces the
# NumPy emulation these tests used to drive from the plan. Nothing of that model is kept: every
# index map it checked (LUT walk, copy chunks, LDS layout, lane maps, softmax, wave merge,
# epilogue) is now exercised by running the C++ that contains it.
GRID, HEADS, TOPK = (5, 6, 8), 2, 5  # 8 cubes, vbs {64, 32, 16, 8}; head 1 is an outlier head
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def tuning_configs(spec: Spec) -> list[KernelConfig]:
    """Every config of targets/gfx942/target.toml [tunable] that the tuner may build for the HIP
    backend (the generic rules and the HIP ones)."""
    space = TARGET.tunable
    out = []
    for values in itertools.product(*space.values()):
        cfg = KernelConfig(**dict(zip(space, values, strict=True)))
        if not cfgmod.violations(spec, TARGET, cfg) and not hipp.hip_violations(spec, cfg, TARGET):
            out.append(cfg)
    return out


TUNED = tuning_configs(Spec())
HOST_CASES = [(Spec(), cfg, i % 2 == 0) for i, cfg in enumerate(TUNED)] + [
    # 32x32x8 MFMAs: bf16 (2 waves of 32 rows, one stage) and f16 at head_dim 128
    (Spec(head_dim=64), OTHER_CONFIGS[0], True),
    (Spec(dtype="fp16"), OTHER_CONFIGS[0], False),
    # one wave of 64 rows: two MFMA row tiles per wave (REP_M = 2)
    (Spec(head_dim=64, layout="bhsd"), KernelConfig(block_m=64, block_n=64, num_warps=1,
                                                    num_stages=2), True),
    # 16x16x16: bf16 and f16 (BHSD); two waves per row group (split keys, merged in LDS)
    (Spec(head_dim=64), DEFAULT, True),
    (Spec(head_dim=64, dtype="fp16", layout="bhsd"), DEFAULT, False),
    (Spec(head_dim=64), OTHER_CONFIGS[1], True),
    # full cubes (vbs ignored) and no lse epilogue
    (Spec(head_dim=64, variable_block_sizes=False),
     KernelConfig(block_m=32, block_n=32, num_warps=2, num_stages=1), True),
    (Spec(head_dim=64, dtype="fp16"), DEFAULT.replace(store_lse=False), False),
]


def _case_id(case) -> str:
    spec, cfg, with_counts = case
    return (f"d{spec.head_dim}_{spec.dtype}_{spec.layout}"
            f"{'' if spec.variable_block_sizes else '_full'}-{cfg.name}"
            f"-{'counts' if with_counts else 'topk'}")


@functools.cache
def _capture(head_dim: int, dtype: str, layout: str) -> dict:
    cap = captures.synthesize(seed=0, grid=GRID, heads=HEADS, head_dim=head_dim, topk=TOPK,
                              dtype=DTYPES[dtype], outlier=[1])
    if layout == "bhsd":
        for key in ("q", "k", "v"):
            cap[key] = cap[key].transpose(1, 2).contiguous()
    return cap


def small_problem(spec: Spec, *, with_counts: bool = False) -> dict:
    """A synthesized capture at GRID (partial cubes; head 1 an outlier head whose logits overflow
    fp32 exp without the row max) in the spec's dtype and layout, and counts with empty rows.
    The tensors are shared between tests (cached): never write to them."""
    cap = dict(_capture(spec.head_dim, spec.dtype, spec.layout))
    cap["counts"] = None
    if with_counts:
        g = torch.Generator().manual_seed(0)
        counts = torch.randint(0, TOPK + 1, (1, HEADS, cap["vbs"].numel()), generator=g,
                               dtype=torch.int32)
        counts[0, 0, 0] = 0  # an empty row: o = 0, lse = -inf
        counts[0, 1, :2] = TOPK  # full rows in the outlier head
        cap["counts"] = counts
    return cap


def args_of(cap: dict) -> tuple:
    return cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"], cap["counts"]


def reference(spec: Spec, cap: dict):
    vbs = cap["vbs"] if spec.variable_block_sizes else None
    return attention_fp32(cap["q"], cap["k"], cap["v"], cap["topk_idx"], vbs, cap["counts"],
                          layout=spec.layout, block=spec.block_kv)



@needs_clang
def test_device_guard_around_the_kernel(host_builds) -> None:
    """What the HIP op (and the CUDA op) does on the device with bad values, run here: the guard
    (`tilegen.guard`, Triton under the interpreter) lets the kernel walk nothing of a bad row,
    the rendered C++ (host executor) runs on the counts it wrote with the bad LUT, and the
    post-pass writes NaN into the bad rows. Good rows pass the scoring rule against the fp32
    reference of the same inputs; the error waits for `check()` (no host sync)."""
    from tilegen.guard import ValueGuard
    from tilegen.inputs import validate_inputs

    spec, cfg = Spec(head_dim=64), DEFAULT
    cap = small_problem(spec, with_counts=True)
    q, k, v, idx, vbs, counts = args_of(cap)
    idx, counts, vbs = idx.clone(), counts.clone(), vbs.clone()
    nkv = vbs.numel()
    counts[0, 0, 3] = TOPK
    idx[0, 0, 3, TOPK - 1] = nkv + 5  # past NKV: never an address
    counts[0, 1, 4] = -3  # a negative count
    bad_cube = int(idx[0, 0, 6, 0])
    counts[0, 0, 6] = max(int(counts[0, 0, 6]), 1)
    vbs[bad_cube] = 200  # over the cube size: every row that walks it is bad
    guard = ValueGuard(spec)
    shapes = validate_inputs(spec, q, k, v, idx, vbs, counts, check_values=False)
    walk, marks = guard.before(idx, vbs, counts, shapes)
    o, lse = host_builds.HostKernel(spec, cfg)(q, k, v, idx, vbs, walk, check_values=False)
    guard.after(marks, o, lse, None, shapes)
    bad = marks.bool()
    assert bad[0, 0, 3] and bad[0, 1, 4] and bad[0, 0, 6] and not bad.all()
    rows = bad.repeat_interleave(spec.block_q, dim=2)  # (B, H, S)
    o_bhsd = o.transpose(1, 2)
    assert o_bhsd[rows].isnan().all() and lse[rows].isnan().all()
    assert torch.isfinite(o_bhsd[~rows].float()).all()
    # good rows: the fp32 reference of the same LUT (bad rows walk nothing there)
    in_range = torch.where((idx >= 0) & (idx < nkv), idx, 0)  # the reference gathers all TOPK
    o_ref, _ = attention_fp32(q, k, v, in_range, cap["vbs"], walk, layout="bshd", block=64)
    keep = (~rows).transpose(1, 2)[..., None]  # (B, S, H, 1)
    s = captures.score(torch.where(keep, o, 0), torch.where(keep, o_ref, 0).to(o.dtype))
    assert s.passed, str(s)
    with pytest.raises(ValueError, match="bad value"):
        guard.check()


# Deliberate bugs in the rendered C++ and the headers it includes (never in the plan): (config,
# [(old, new, occurrence)]), applied to render_hip(Spec(head_dim=64), config): each `old` is in
# one file (the rendered text or one header). Each must make the run fail: the scoring rule, or
# the executor (a race between two wave orders, or divergent lanes).
MUTATIONS = {
    # the QK MFMA's A operand (the K tile) read with the lane groups' k index swapped
    "mfma-operand-lane": (DEFAULT, [("const int k0 = 4 * (lane / MN);",
                                     "const int k0 = 4 * ((lane / MN) ^ 1);", 1)]),
    # the accumulator map off by one lane group, with a plan that agrees (fingerprint dropped):
    # only running the C++ against the documented MFMA layout can catch this
    "accumulator-lane-map": (DEFAULT, [
        ("return 4 * G * (r / 4) + 4 * (lane / MN) + r % 4;",
         "return 4 * G * (r / 4) + 4 * ((lane / MN + 1) % G) + r % 4;", 0),
        ("static_assert(fingerprint_acc_rows<Config>() == ",
         "static_assert(0 * fingerprint_acc_rows<Config>() + ", 0)]),
    # the row max reduced with the wrong ds_bpermute partner
    "bpermute-partner": (DEFAULT, [("lane_xor(x, mask)", "lane_xor(x, mask >> 1)", 0)]),
    # the online-softmax rescale with the wrong sign: alpha = exp2(m_new - m)
    "rescale-sign": (DEFAULT, [("__builtin_exp2f(w.m[rm] - m_new)",
                                "__builtin_exp2f(m_new - w.m[rm])", 0)]),
    # the pipeline's barrier dropped (2 stages: the only one in the loop)
    "dropped-barrier": (DEFAULT, [("      block_sync();\n      const bool prefetch",
                                   "      const bool prefetch", 0)]),
    # the epilogue's merge barrier dropped (two waves per row group)
    "dropped-merge-barrier": (OTHER_CONFIGS[1], [("      block_sync();\n      if (wn > 0) return;",
                                                  "      if (wn > 0) return;", 0)]),
}
#: Not a numerical bug: a cross-lane op that only half the lanes of a wave reach.
DIVERGENT = (DEFAULT, [("TG_DEVICE int wave_id() { return __builtin_amdgcn_readfirstlane(",
                        "TG_DEVICE int wave_id() { return lane_id() % 2 ? thread_id() / kWave "
                        ": __builtin_amdgcn_readfirstlane(", 0)])


def _edit(text: str, old: str, new: str, occurrence: int) -> str:
    parts = text.split(old)
    assert len(parts) > occurrence + 1, f"{old!r} occurs fewer than {occurrence + 1} times"
    return old.join(parts[:occurrence + 1]) + new + old.join(parts[occurrence + 1:])


def edit_cxx(src: CxxSource, edits) -> CxxSource:
    """`src` with each (old, new, occurrence) applied to the one file that holds `old`: the
    rendered text or one of its headers."""
    files = {"": src.text, **{rel: data.decode() for rel, data in src.headers}}
    for old, new, occurrence in edits:
        hits = [name for name, text in files.items() if old in text]
        assert len(hits) == 1, f"{old!r} is in {hits or 'no file'}"
        files[hits[0]] = _edit(files[hits[0]], old, new, occurrence)
    text = files.pop("")
    return replace(src, text=text, headers=tuple((rel, t.encode()) for rel, t in files.items()))


def mutated(cfg: KernelConfig, edits) -> CxxSource:
    return edit_cxx(hipp.render_hip(Spec(head_dim=64), cfg, TARGET), edits)


@pytest.fixture(scope="module")
def host_builds(hip_cache):
    """Build every host case's library and every mutation once, on every core (the builds land
    in the module's kernel cache, keyed by the sha256 of source, header, flags and clang
    version); the tests then find them there."""
    from tilegen.backends.hip.host import executor as hostx

    sources = [hipp.render_hip(spec, cfg, TARGET) for spec, cfg, _ in HOST_CASES]
    sources += [mutated(*m) for m in (*MUTATIONS.values(), DIVERGENT)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(hostx.build_library, sources))
    return hostx


def test_host_cases_cover_the_tuning_space_and_every_mfma() -> None:
    assert len(TUNED) == 12 and DEFAULT in TUNED
    assert {hipp.plan_for(spec, cfg, TARGET).mfma_name for spec, cfg, _ in HOST_CASES} == {
        m.name for m in TARGET.mma if m.kind == "mfma"}
    # the capture's vbs drive every compute path of every case: full slices, slices cut by vbs
    # (masked) and, with two waves per row group, slices wholly past vbs (skipped)
    vbs = set(small_problem(Spec(head_dim=64))["vbs"].tolist())
    assert vbs == {64, 32, 16, 8}
    for spec, cfg, _ in HOST_CASES:
        plan = hipp.plan_for(spec, cfg, TARGET)
        assert any(n % plan.slice_n for n in vbs)
        if plan.warps_n > 1:
            assert any(n <= plan.block_n - plan.slice_n for n in vbs)


@needs_clang
@pytest.mark.parametrize("case", HOST_CASES, ids=_case_id)
def test_host_built_kernel_passes_scoring_rule(case, host_builds) -> None:
    spec, cfg, with_counts = case
    cap = small_problem(spec, with_counts=with_counts)
    kernel = host_builds.HostKernel(spec, cfg)
    assert kernel.source.text == hipp.render_hip(spec, cfg, TARGET).text  # the device build's text
    o, lse = kernel(*args_of(cap))  # waves ascending and descending, compared bit for bit
    o_ref, lse_ref = reference(spec, cap)
    s = captures.score(o, o_ref.to(o.dtype), layout=spec.layout)
    assert s.passed, str(s)
    if cfg.store_lse:
        assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
        fin = torch.isfinite(lse_ref)
        assert torch.isfinite(lse[fin]).all()
        torch.testing.assert_close(lse[fin], lse_ref[fin], atol=2e-3, rtol=1e-4)
        assert lse[:, 1].max() > 128  # the outlier head: exp2 of its logits overflows fp32
    else:
        assert lse is None
    if with_counts:  # count-0 rows: o = 0 (and lse = -inf)
        empty = (cap["counts"] == 0).repeat_interleave(spec.block_q, dim=2)  # (B, H, S)
        o_bhsd = o if spec.layout == "bhsd" else o.transpose(1, 2)
        assert empty.any() and (o_bhsd[empty] == 0).all()
        if cfg.store_lse:
            assert torch.isneginf(lse[empty]).all()
    plan = hipp.plan_for(spec, cfg, TARGET)
    st = kernel.stats
    grid = plan.grid(1, HEADS, cap["vbs"].numel())
    assert st.workgroups == grid[0] * grid[1] and st.lds_bytes == plan.lds_bytes
    assert st.readfirstlane == st.workgroups * cfg.num_warps  # wave_id(): once per wave
    assert st.mfma > 0 and st.bpermute > 0 and st.barriers > 0


@needs_clang
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutations_of_the_rendered_cxx_are_caught(name, host_builds) -> None:
    cfg, edits = MUTATIONS[name]
    spec = Spec(head_dim=64)
    cap = small_problem(spec, with_counts=True)
    o_ref = reference(spec, cap)[0].to(DTYPES[spec.dtype])
    good, _ = host_builds.run(spec, cfg, *args_of(cap))  # the render itself passes
    assert captures.score(good, o_ref).passed
    broken = mutated(cfg, edits)
    if "barrier" in name:
        # Deterministic: between barriers each wave runs alone to its next barrier, waves
        # ascending in one run and descending in the other, so a wave reads LDS another wave
        # has not written yet (0xff poison: NaN) or has already overwritten, and the two runs
        # differ. (For the merge barrier the descending order happens to be right: waves
        # wn > 0 write their parts before wave wn = 0 reads them. Hence two orders.)
        with pytest.raises(host_builds.RaceDetected, match="different outputs"):
            host_builds.run(spec, cfg, *args_of(cap), source=broken)
        o, _ = host_builds.HostKernel(spec, cfg, broken)(*args_of(cap),
                                                         schedules=("ascending",))
        assert not captures.score(o, o_ref).finite
    else:  # the same wrong answer in every order: the scoring rule catches it
        o, _ = host_builds.run(spec, cfg, *args_of(cap), source=broken)
        s = captures.score(o, o_ref)
        assert not s.passed, f"mutation {name} was not caught: {s}"


@needs_clang
def test_executor_reports_divergent_lanes(host_builds) -> None:
    """A cross-lane op that only some lanes of a wave reach is an error, not a guess."""
    spec = Spec(head_dim=64)
    with pytest.raises(host_builds.HostExecutionError, match="diverged"):
        host_builds.run(spec, DEFAULT, *args_of(small_problem(spec)),
                        source=mutated(*DIVERGENT))


@needs_clang
def test_executor_checks_the_launch(host_builds) -> None:
    """The executor takes the ROCm launcher's kernarg bytes and block: wrong ones fail."""
    kernel = host_builds.HostKernel(Spec(head_dim=64), DEFAULT)
    assert kernel.flat_work_group_size == (256, 256)
    launch = host_builds._Launch()
    launch.grid[:] = [1, 1, 1]
    launch.block[:] = [100, 1, 1]
    assert kernel.lib.tg_host_run(bytes(8), 8, ctypes.byref(launch)) == 1
    assert b"kernarg buffer has 8 bytes; the kernel's 13 parameters take 84" in launch.error
    args = bytes(hiprt.kernarg_size())
    assert kernel.lib.tg_host_run(args, len(args), ctypes.byref(launch)) == 1
    assert b"block (100, 1, 1)" in launch.error


@needs_clang
def test_load_hip_says_what_has_run(caplog, hip_cache, monkeypatch) -> None:
    """tilegen.load(backend="hip") logs, once per process, what the HIP kernel has run on."""
    import tilegen
    from tilegen.backends import hip as hip_backend

    monkeypatch.setattr(hip_backend, "_noted", set())
    said = ("runs on a CPU executor of the HIP source with ISA-documented MFMA semantics; "
            "never run on an MI300")
    with caplog.at_level(logging.INFO, logger="tilegen"):
        for _ in range(2):
            try:
                tilegen.load(Spec(head_dim=64), DEFAULT, backend="hip")
            except RuntimeError as exc:  # no hip-python here (on a ROCm machine it loads)
                assert "hip-python" in str(exc)
    assert [r.getMessage() for r in caplog.records].count(f"backend='hip': {said}") == 1
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert said in " ".join(readme.split())


def test_triton_gfx942_hsaco_is_inspected_not_run(tmp_path) -> None:
    """The Triton path for gfx942 gives an AMDGCN code object: machine code, which the CPU
    executor (C++ source in, host build out) cannot run. It is compiled and inspected: MFMAs
    present, VGPRs within the budget, no spills (what the README says)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tilegen.cli", "build", "--target", "gfx942",
                           "--backend", "triton", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    art, *backward = json.loads((tmp_path / "manifest.json").read_text())["artifacts"]
    amdgcn = (tmp_path / art["path"]).with_suffix(".amdgcn").read_text()
    assert re.search(r"\bv_mfma_f32_\w+", amdgcn)
    assert art["registers"] and art["registers"] + (art["agprs"] or 0) <= 512
    assert art["spill_bytes"] == 0
