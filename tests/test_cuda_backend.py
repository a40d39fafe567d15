"""CUDA C++ backend on a CPU-only machine: render, compile with nvcc, read ptxas's report, and
check the kernel's index math against the reference.

- A rendered kernel is its traits and entry point over the static headers under
  templates/cuda/include (no library text in it); its sha256 covers the headers it includes.

- Every supported variant (head_dim 64/128 x bf16/fp16 x BSHD/BHSD with the target default
  config, plus another block config) compiles for sm_90a and sm_100a; the default config has no
  spills and fits the target's shared memory. Compiles happen once per session (module fixture,
  cache in a tmp dir); nvcc tests skip, saying so, where nvcc is missing.
- The host-side launch math (grid, block, shared memory, argument order) is pure Python and is
  checked against the rendered kernel's signature and the config's own estimate.
- `_emulate` runs the kernel's algorithm lane by lane in numpy: the CTA's cp.async tile copies
  into the swizzled shared-memory layout, the LUT cursor with sub-tile skipping, the stage ring,
  ldmatrix and mma.sync m16n8k16 with the fragment layouts of the PTX ISA, the quad-shuffle
  softmax, P rounded to 16 bits, and the epilogue. It uses the same constants (`cuda_traits`,
  `launch_params`) and the kernel's address formulas, and is compared with `tilegen.reference`.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from tilegen.backends.cuda import nvcc as nv
from tilegen.backends.cuda import runtime as rt
from tilegen.backends.cuda import wgmma
from tilegen.compile import CompileError, ToolchainMissing
from tilegen.config import KernelConfig, default_config
from tilegen.identity import CxxSource, include_closure
from tilegen.reference import LOG2E, attention_fp32
from tilegen.render import HEADER
from tilegen.spec import Spec
from tilegen.targets import get_target

SM90 = get_target("sm_90")

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("sm_90", "sm_100a")
VARIANTS = [Spec(head_dim=d, dtype=dt, layout=lay)
            for d in (64, 128) for dt in ("bf16", "fp16") for lay in ("bshd", "bhsd")]
OTHER_CONFIG = KernelConfig(block_m=64, block_n=32, num_warps=2, num_stages=2)


def _have_nvcc() -> bool:
    try:
        nv.find_nvcc()
        return True
    except ToolchainMissing:
        return False


needs_nvcc = pytest.mark.skipif(
    not _have_nvcc(), reason="nvcc not found: install the CUDA toolkit 12.8+ (nvcc) to compile "
    "the CUDA backend; rendering and host-side tests still run")


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    """Compiled cubins go to a fresh cache for this module (TILEGEN_CACHE_DIR)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILEGEN_CACHE_DIR", str(tmp_path_factory.mktemp("tilegen-cache")))
        yield


def _jobs() -> list[tuple[Spec, KernelConfig, str, bool]]:
    jobs = []
    for target in TARGETS:
        cfg = default_config(get_target(target))
        jobs += [(spec, cfg, target, True) for spec in VARIANTS]
        jobs.append((Spec(), OTHER_CONFIG, target, False))
    return jobs


@pytest.fixture(scope="module")
def artifacts():
    """Every (variant, target) compiled once, two nvcc processes at a time."""
    if not _have_nvcc():
        pytest.skip("nvcc not found: install the CUDA toolkit 12.8+ (nvcc)")
    jobs = _jobs()
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        arts = list(pool.map(lambda j: nv.compile_cuda(
            nv.render_cuda(j[0], j[1], get_target(j[2])), get_target(j[2])), jobs))
    return list(zip(jobs, arts, strict=True))


# -- rendering ---------------------------------------------------------------------------------
def with_header_edit(src: CxxSource, old: str, new: str) -> CxxSource:
    """`src` with `old` replaced by `new` in the one library header that holds it."""
    hits = [rel for rel, data in src.headers if old.encode() in data]
    assert len(hits) == 1, f"{old!r} is in headers {hits}"
    headers = tuple((rel, data.replace(old.encode(), new.encode()) if rel == hits[0] else data)
                    for rel, data in src.headers)
    return replace(src, headers=headers)


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: f"d{s.head_dim}_{s.dtype}_{s.layout}")
def test_header_name_and_choices(spec):
    cfg = default_config(get_target("sm_90"))
    src = nv.render_cuda(spec, cfg, SM90)
    header = "// " + HEADER.format(template=nv.CUDA_TEMPLATE, kernel_hash=spec.kernel_hash,
                                   target="sm_90 (sm_90a)")
    assert src.text.splitlines()[0] == header
    name = nv.kernel_name(spec, cfg)
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name)
    assert f"{name}(" in src.text and 'extern "C" __global__' in src.text
    assert src.name == name.removeprefix("tilegen_cuda_") + ".cu" and src.backend == "cuda"
    # the choices are the traits' types; the instructions they stand for are in the headers
    elem = {"bf16": "Bf16", "fp16": "Fp16"}[spec.dtype]
    assert f"using Elem = tilegen::{elem};" in src.text
    assert f"using Layout = tilegen::{spec.layout.capitalize()};" in src.text
    assert f"static constexpr int kHeadDim = {spec.head_dim};" in src.text
    full = src.expanded()
    mma = {"bf16": "bf16", "fp16": "f16"}[spec.dtype]
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{mma}.{mma}.f32" in full
    assert f"cvt.rn.{mma}x2.f32" in full
    assert "(b * seq_len * num_heads + h) * head_dim" in full
    assert "(b * num_heads + h) * seq_len * head_dim" in full
    assert "{{" not in src.text and "{%" not in src.text


def test_rendered_kernel_is_traits_over_the_headers():
    """The .cu holds the traits, the include and the entry point; the library is in the static
    headers (no Jinja in them), and every header is what some kernel includes."""
    cfg = KernelConfig(store_max_prob=True)
    src = nv.render_cuda(Spec(), cfg, SM90)
    assert '#include "tilegen/cuda/lut_attention.cuh"' in src.text
    assert src.text.count("\n") < 60 and "asm" not in src.text and "__shfl" not in src.text
    inc = nv.include_dir()
    assert inc == nv.paths.TEMPLATES_DIR / "cuda" / "include"
    on_disk = sorted(p.relative_to(inc).as_posix() for p in inc.rglob("*") if p.is_file())
    hopper = nv.render_cuda(Spec(), wgmma.config().replace(store_max_prob=True), SM90)
    hopper8 = nv.render_cuda(Spec(quant="int8_fp8"), wgmma.config(), SM90)  # the 8-bit kernel
    included = {rel for s in (src, hopper, hopper8) for rel, _ in s.headers}
    assert sorted(included) == on_disk and len(on_disk) >= 10
    for rel, data in src.headers + hopper.headers + hopper8.headers:
        assert rel.startswith("tilegen/cuda/") and rel.endswith(".cuh")
        text = data.decode()
        # no Jinja ({{ name }}, {% if %}); PTX operand lists like "{%3, %4}" are fine
        assert not re.search(r"\{\{\s*[A-Za-z_]|\{%-?\s+[a-z]", text) and "#pragma once" in text
        assert (inc / rel).read_bytes() == data
    assert src.headers == include_closure(src.text, inc)
    # expanded(): one self-contained text with each header once, as the files used to be
    full = src.expanded()
    assert "#include \"tilegen/" not in full and "#pragma once" not in full
    assert full.count("struct WarpTile {") == 1 and f"{nv.kernel_name(Spec(), cfg)}(" in full
    assert "atomicAdd(max_prob_cube" in full and "kBlockM == T::kBlockQ" in full


def test_source_hash_covers_the_headers(tmp_path, monkeypatch):
    """Editing a header leaves the rendered text alone but changes the source's sha256 and the
    variant key (cached cubins and tuned winners follow it)."""
    from tilegen.backends.cuda import BACKEND

    cfg = default_config(SM90)
    before = nv.render_cuda(Spec(), cfg, SM90)
    shutil.copytree(nv.paths.TEMPLATES_DIR, tmp_path / "templates")
    softmax = tmp_path / "templates" / "cuda" / "include" / "tilegen" / "cuda" / "softmax.cuh"
    softmax.write_text(softmax.read_text() + "\n// an edit to one header\n")
    monkeypatch.setattr(nv.paths, "TEMPLATES_DIR", tmp_path / "templates")
    after = nv.render_cuda(Spec(), cfg, SM90)
    assert after.text == before.text and after.sha256 != before.sha256
    assert BACKEND.variant_key(Spec(), cfg, SM90, after) != BACKEND.variant_key(
        Spec(), cfg, SM90, before)
    changed = [rel for (rel, a), (_, b) in zip(before.headers, after.headers, strict=True)
               if a != b]
    assert changed == ["tilegen/cuda/softmax.cuh"]
    # a source without headers hashes as its text alone (the Triton and Gluon sources)
    import hashlib

    plain = CxxSource(before.text, before.name, before.template, "cuda")
    assert plain.sha256 == hashlib.sha256(before.text.encode()).hexdigest() != before.sha256


def test_render_is_deterministic():
    cfg = KernelConfig()
    a, b = nv.render_cuda(Spec(), cfg, SM90), nv.render_cuda(Spec(), cfg, SM90)
    assert a.text == b.text and a.sha256 == b.sha256
    # and across processes (no dict-order or hash-seed dependence)
    code = ("from tilegen.backends.cuda.nvcc import render_cuda; "
            "from tilegen import Spec, KernelConfig; from tilegen.targets import get_target; "
            "print(render_cuda(Spec(), KernelConfig(), get_target('sm_90')).sha256)")
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True, cwd=ROOT).stdout.strip()
    assert out == a.sha256
    assert nv.render_cuda(Spec(layout="bhsd"), cfg, SM90).sha256 != a.sha256
    assert nv.render_cuda(Spec(), cfg.replace(num_stages=2), SM90).sha256 != a.sha256


def test_render_time_options():
    """What the templates decided at render time is now a traits constant the headers branch
    on with `if constexpr`."""
    no_vbs = nv.render_cuda(Spec(variable_block_sizes=False), KernelConfig(), SM90).text
    assert "static constexpr bool kVbs = false;" in no_vbs
    with_vbs = nv.render_cuda(Spec(), KernelConfig(), SM90).text
    assert "static constexpr bool kVbs = true;" in with_vbs
    assert "static constexpr bool kStoreLse = true;" in with_vbs
    no_lse = nv.render_cuda(Spec(), KernelConfig(store_lse=False), SM90).text
    assert "static constexpr bool kStoreLse = false;" in no_lse
    for text, mp in ((with_vbs, False), (nv.render_cuda(Spec(), KernelConfig(
            store_max_prob=True), SM90).text, True)):
        assert f"static constexpr bool kStoreMaxProb = {str(mp).lower()};" in text
        assert ("float* __restrict__ max_prob," in text) == mp


def test_cuda_config_rules():
    spec = Spec()
    assert nv.cuda_violations(spec, KernelConfig(), SM90) == []
    assert nv.cuda_violations(spec, OTHER_CONFIG, SM90) == []
    assert any("16 x num_warps" in p for p in
               nv.cuda_violations(spec, KernelConfig(block_m=32, num_warps=4), SM90))
    assert any("block_n" in p for p in nv.cuda_violations(spec, KernelConfig(block_n=8), SM90))
    assert any("interp_bf16" in p for p in
               nv.cuda_violations(spec, KernelConfig(interp_bf16=True), SM90))
    assert any("registers" in p for p in
               nv.cuda_violations(spec, KernelConfig(block_m=64, block_n=64, num_warps=2), SM90))
    with pytest.raises(ValueError, match="cannot be built as CUDA"):
        nv.render_cuda(spec, KernelConfig(block_m=32, num_warps=4), SM90)


def test_shared_memory_is_one_number():
    """Host (launcher), config predicate and rendered source agree on shared memory."""
    for spec in VARIANTS:
        for cfg in (KernelConfig(), OTHER_CONFIG, KernelConfig(num_stages=1, block_n=16)):
            t = nv.cuda_traits(spec, cfg, SM90)
            assert t["smem_bytes"] == nv.shared_memory_bytes(spec, cfg)
            assert t["smem_bytes"] == 2 * spec.head_dim * (cfg.block_m + 2 * cfg.num_stages
                                                           * cfg.block_n)
            text = nv.render_cuda(spec, cfg, SM90).text
            assert f"#define TILEGEN_DYNAMIC_SMEM_BYTES {t['smem_bytes']}\n" in text
            assert f"#define TILEGEN_THREADS {32 * cfg.num_warps}\n" in text


# -- toolchain ---------------------------------------------------------------------------------
def test_find_nvcc_missing_says_how_to_install(monkeypatch):
    monkeypatch.setenv("TILEGEN_NVCC", "/nonexistent/nvcc")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(nv, "NVCC_FALLBACK_HOMES", ())
    with pytest.raises(ToolchainMissing, match=r"install the CUDA toolkit 12\.8\+ \(nvcc\)"):
        nv.find_nvcc()


def test_parse_ptxas():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kern_a' for 'sm_90a'
ptxas info    : Function properties for kern_a
    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 128 bytes smem, 400 bytes cmem[0]
"""
    assert nv.parse_ptxas(log) == {"kern_a": {"registers": 168, "stack": 16, "spill_stores": 8,
                                              "spill_loads": 12, "smem": 128}}


def test_unknown_target():
    with pytest.raises(ValueError, match="no CUDA backend"):
        nv.arch_of(get_target("gfx942"))


@needs_nvcc
def test_nvcc_command_and_version():
    version = nv.nvcc_version()
    assert re.fullmatch(r"\d+\.\d+(\.\d+)?", version)
    cmd = nv.nvcc_command("nvcc", Path("a.cu"), Path("a.cubin"), "sm_100a", Path("inc"))
    assert cmd[:4] == ["nvcc", "-cubin", "-gencode", "arch=compute_100a,code=sm_100a"]
    assert "--use_fast_math" not in cmd and {"-O3", "-std=c++17", "-v"} <= set(cmd)
    assert cmd[cmd.index("-I") + 1] == "inc"
    # the include folder is no part of the toolchain id (the source's sha256 covers the headers)
    assert "-I" not in nv.toolchain_id()


@needs_nvcc
def test_every_variant_compiles(artifacts):
    version = nv.nvcc_version()
    for (spec, cfg, target, is_default), art in artifacts:
        tgt = get_target(target)
        assert art.path.is_file() and art.path.stat().st_size > 0
        assert art.arch == get_target(target).arch and art.kind == "cubin" and art.backend == "cuda"
        assert art.kernel_name == nv.kernel_name(spec, cfg) and art.config == cfg.name
        assert art.compiler == {"nvcc": version}
        assert f"arch=compute_{art.arch[3:]},code={art.arch}" in art.command
        assert art.command[art.command.index("-I") + 1] == "templates/cuda/include"
        assert 0 < art.registers <= tgt.max_registers_per_thread
        assert art.threads == 32 * cfg.num_warps
        assert art.shared_bytes >= nv.shared_memory_bytes(spec, cfg)
        assert art.occupancy and art.occupancy >= 1
        if is_default:
            assert art.spill_bytes == 0, f"{art.kernel_name} spills on {art.arch}"
            assert art.stack_bytes == 0
            assert art.shared_bytes <= tgt.max_shared_bytes


@needs_nvcc
def test_sass_uses_tensor_cores(artifacts, tmp_path):
    """The default sm_90a cubin runs on HMMA (mma.sync), ldmatrix and cp.async, with no local
    memory traffic."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.is_file():
        pytest.skip("cuobjdump (shipped with Triton) not found")
    (_, art), = [(j, a) for j, a in artifacts
                 if j[3] and j[2] == "sm_90" and j[0] == Spec()]
    sass = subprocess.run([str(cuobjdump), "--dump-sass", str(art.path)], capture_output=True,
                          text=True, check=True).stdout
    assert "HMMA.16816.F32.BF16" in sass
    assert "LDSM.16.M88.4" in sass and "LDSM.16.MT88.4" in sass
    assert "LDGSTS" in sass and "MUFU.EX2" in sass
    assert not re.search(r"\b(LDL|STL)\b", sass)


@needs_nvcc
def test_compile_cache_hit_skips_nvcc(artifacts, monkeypatch, tmp_path):
    src = nv.render_cuda(Spec(), default_config(SM90), SM90)

    def boom(*a, **k):
        raise AssertionError("nvcc ran although the cubin is cached")

    monkeypatch.setattr(nv, "_run_nvcc", boom)
    art = nv.compile_cuda(src, SM90, tmp_path / "out")
    assert art.path == tmp_path / "out" / f"{Path(src.name).stem}.sm_90a.cubin"
    assert art.source == tmp_path / "out" / src.name and art.source.read_text() == src.text
    assert art.spill_bytes == 0 and art.registers


@needs_nvcc
def test_compile_error_carries_nvcc_output():
    src = nv.render_cuda(Spec(), KernelConfig(), SM90)
    # nvcc compiles the headers the source carries (a broken one breaks the build) ...
    broken = with_header_edit(src, "static_assert(C::kStages >= 1",
                              "static_assert(C::kStages >= 100")
    assert broken.sha256 != src.sha256
    with pytest.raises(CompileError, match="at least one K/V buffer"):
        nv.compile_cuda(broken, SM90)
    # ... and a broken traits struct in the rendered file
    bad = replace(src, text=src.text.replace("kStages = 3;", "kStages = 0;"))
    with pytest.raises(CompileError, match="at least one K/V buffer"):
        nv.compile_cuda(bad, SM90)


# -- host-side launch math ---------------------------------------------------------------------
def _signature(text: str, name: str) -> list[tuple[str, str]]:
    m = re.search(rf"{name}\((.*?)\)\s*{{", text, re.S)
    assert m, "kernel signature not found"
    params = []
    for p in m.group(1).split(","):
        p = p.strip()
        kind = "ptr" if "*" in p else ("f32" if p.startswith("float") else "i32")
        params.append((p.split()[-1], kind))
    return params


def test_kernel_args_match_rendered_signature():
    cfg = KernelConfig()
    for spec in (Spec(), Spec(layout="bhsd", head_dim=64, dtype="fp16")):
        text = nv.render_cuda(spec, cfg, SM90).text
        assert _signature(text, nv.kernel_name(spec, cfg)) == list(
            rt.KERNEL_SIGNATURE)
    args = rt.kernel_args({"q": 1, "k": 2, "v": 3, "lut": 4, "vbs": 6, "o": 7, "lse": 8},
                          39936, 40, 624, 78, 0.125)
    assert [(n, k) for n, k, _ in args] == list(rt.KERNEL_SIGNATURE)
    assert [v for _, _, v in args] == [1, 2, 3, 4, 0, 6, 7, 8, 39936, 40, 624, 78, 0.125]
    array, keep = rt.pack_args(args)
    assert len(array) == len(keep) == 13 and keep[4].value is None and keep[-1].value == 0.125
    with pytest.raises(ValueError, match="int32"):
        rt.kernel_args({}, 2**31, 1, 1, 1, 1.0)


def test_launch_params():
    spec = Spec()
    p = rt.launch_params(spec, KernelConfig(), SM90, batch=1, heads=40, num_q_blocks=624)
    assert p.grid == (624, 40, 1) and p.block == (128, 1, 1)
    assert p.shared_bytes == 2 * 128 * (64 + 3 * 2 * 64) and p.needs_opt_in()
    p = rt.launch_params(spec, KernelConfig(block_m=32, block_n=32, num_warps=2, num_stages=1),
                         SM90, batch=2, heads=3, num_q_blocks=5)
    assert p.grid == (10, 6, 1) and p.block == (64, 1, 1)
    assert p.shared_bytes == 2 * 128 * (32 + 2 * 32) and not p.needs_opt_in()
    assert p.needs_opt_in(static_bytes=48 * 1024)
    with pytest.raises(ValueError, match="grid"):
        rt.launch_params(spec, KernelConfig(), SM90, batch=2, heads=40000, num_q_blocks=1)


def test_runtime_imports_without_gpu_and_explains_what_is_missing():
    assert rt.target_for_capability(9, 0).name == "sm_90"
    assert rt.target_for_capability(10, 0).name == "sm_100a"
    with pytest.raises(rt.CudaRuntimeMissing, match="8.6"):
        rt.target_for_capability(8, 6)
    if importlib.util.find_spec("cuda") is None:
        with pytest.raises(rt.CudaRuntimeMissing, match="cuda-bindings"):
            rt.driver()
    op = rt.CudaBlockSparseAttention(Spec(head_dim=64))
    q = torch.zeros(1, 128, 1, 64, dtype=torch.bfloat16)
    idx = torch.zeros(1, 1, 2, 1, dtype=torch.int32)
    vbs = torch.full((2,), 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        op(q, q, q, idx, vbs)
    with pytest.raises(TypeError, match="dtype"):  # validation comes first
        op(q.half(), q.half(), q.half(), idx, vbs)


# -- lane-level emulation of the kernel --------------------------------------------------------
def _round16(x: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 -> bf16 / fp16 -> fp32, round to nearest even (cvt.rn)."""
    x = np.asarray(x, np.float32)
    if dtype == "fp16":
        return x.astype(np.float16).astype(np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


LANE = np.arange(32)
G, C = LANE // 4, LANE % 4  # mma groupID, thread-in-group


def _offset(row, chunk, head_dim):
    """SwizzledTile::offset (bytes)."""
    return row * head_dim * 2 + ((chunk ^ (row & 7)) << 4)


def _ldmatrix_x4(smem: np.ndarray, addr: np.ndarray, trans: bool) -> np.ndarray:
    """PTX ldmatrix .x4 .b16: lanes 8j..8j+7 give the row addresses of matrix j. Returns
    (32 lanes, 4 regs, 2 halves): reg j = M_j[l/4][2(l%4) + e], or M_j[2(l%4) + e][l/4] with
    .trans."""
    mats = np.stack([np.stack([smem[addr[8 * j + r] // 2: addr[8 * j + r] // 2 + 8]
                               for r in range(8)]) for j in range(4)])  # (4, 8, 8)
    out = np.empty((32, 4, 2), np.float32)
    for e in range(2):
        if trans:
            out[:, :, e] = mats[:, 2 * C + e, G].T
        else:
            out[:, :, e] = mats[:, G, 2 * C + e].T
    return out


def _mma(d: np.ndarray, a: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> np.ndarray:
    """PTX mma.m16n8k16 row.col with fp32 accumulation: fragments (32, 4), (32, 4, 2),
    (32, 2), (32, 2) -> D (32, 4)."""
    A = np.zeros((16, 16), np.float32)
    B = np.zeros((16, 8), np.float32)
    for e in range(2):
        A[G, 2 * C + e] = a[:, 0, e]
        A[G + 8, 2 * C + e] = a[:, 1, e]
        A[G, 2 * C + 8 + e] = a[:, 2, e]
        A[G + 8, 2 * C + 8 + e] = a[:, 3, e]
        B[2 * C + e, G] = b0[:, e]
        B[2 * C + 8 + e, G] = b1[:, e]
    D = A.astype(np.float64) @ B.astype(np.float64)
    out = d.copy()
    for e in range(2):
        out[:, e] += D[G, 2 * C + e].astype(np.float32)
        out[:, 2 + e] += D[G + 8, 2 * C + e].astype(np.float32)
    return out


def _quad(x: np.ndarray, op) -> np.ndarray:
    """x op shfl_xor(x, 1), then op shfl_xor(., 2), over the lane axis (last)."""
    x = op(x, x[..., LANE ^ 1])
    return op(x, x[..., LANE ^ 2])


class _Cta:
    """One CTA of the kernel, emulated: shared memory, the K/V stage ring and per-warp state.

    Shapes and byte offsets come from `cuda_traits`; the address arithmetic is the template's
    (TileCopy, SwizzledTile::offset, WarpTile's ldmatrix lane addresses, the epilogue)."""

    def __init__(self, spec: Spec, t: dict, smem_bytes: int, gmem: dict, base: int,
                 stride: int, q_row0: int) -> None:
        self.spec, self.t, self.gmem = spec, t, gmem
        self.D, self.BM, self.BN = t["head_dim"], t["block_m"], t["block_n"]
        self.base, self.stride, self.q_row0 = base, stride, q_row0
        self.q_bytes = self.BM * self.D * 2
        self.tile_bytes = self.BN * self.D * 2
        self.smem = np.full(smem_bytes // 2, np.nan, np.float32)  # one slot per 16-bit element
        self.meta: list[int | None] = [None] * t["stages"]
        self.tiles: list[tuple[int, int]] = []
        self.produced = 0
        W, mt_n, dt_n = t["num_warps"], t["m_tiles"], self.D // 8
        self.acc = np.zeros((W, mt_n, dt_n, 32, 4), np.float32)
        self.m = np.full((W, mt_n, 2, 32), -np.inf, np.float32)
        self.lsum = np.zeros((W, mt_n, 2, 32), np.float32)

    def tile_copy(self, base_byte: int, src: np.ndarray, row0: int, rows: int) -> None:
        """TileCopy::load: chunk c of the tile by thread c % threads, 16 bytes each."""
        threads, cpr = self.t["threads"], self.D // 8
        chunks = rows * cpr
        for tid in range(threads):
            for step in range(-(-chunks // threads)):
                c = tid + step * threads
                if c < chunks:
                    row, chunk = divmod(c, cpr)
                    dst = (base_byte + _offset(row, chunk, self.D)) // 2
                    g = row0 + row * self.stride + chunk * 8
                    self.smem[dst:dst + 8] = src[g:g + 8]

    def walk_lut(self, lut_row: np.ndarray, n: int, vbs: np.ndarray) -> None:
        """LutCursor: (first key row, valid keys) per sub-tile, wholly-padded ones skipped."""
        bkv, BN = self.spec.block_kv, self.BN
        for i in range(n):
            cube = int(lut_row[i])
            n_valid = int(vbs[cube]) if self.spec.variable_block_sizes else bkv
            for sub in range(self.t["n_sub"]):
                if sub * BN >= n_valid:
                    break
                self.tiles.append((cube * bkv + sub * BN, n_valid - sub * BN))

    def produce(self, stage: int) -> None:
        """KvPipeline::produce."""
        if self.produced < len(self.tiles):
            r0, valid = self.tiles[self.produced]
            k_tile = self.q_bytes + stage * 2 * self.tile_bytes
            g = self.base + r0 * self.stride
            self.tile_copy(k_tile, self.gmem["k"], g, self.BN)
            self.tile_copy(k_tile + self.tile_bytes, self.gmem["v"], g, self.BN)
            self.meta[stage] = valid
            self.produced += 1

    def consume(self, stage: int, valid: int, qk_scale: np.float32) -> None:
        """WarpTile::qk, OnlineSoftmax::step (masked when valid < BLOCK_N), WarpTile::pv."""
        D, BN, smem = self.D, self.BN, self.smem
        mt_n, nt_n, dt_n = self.t["m_tiles"], BN // 8, D // 8
        s_k = self.q_bytes + stage * 2 * self.tile_bytes
        s_v = s_k + self.tile_bytes
        for w in range(self.t["num_warps"]):
            wr0 = w * self.t["warp_m"]
            s = np.zeros((mt_n, nt_n, 32, 4), np.float32)
            for kk in range(D // 16):
                a = [_ldmatrix_x4(smem, _offset(wr0 + mt * 16 + (LANE & 15),
                                                2 * kk + (LANE >> 4), D), False)
                     for mt in range(mt_n)]
                for np_ in range(nt_n // 2):
                    bf = _ldmatrix_x4(smem, s_k + _offset(
                        np_ * 16 + ((LANE >> 4) << 3) + (LANE & 7),
                        2 * kk + ((LANE >> 3) & 1), D), False)
                    for mt in range(mt_n):
                        s[mt, 2 * np_] = _mma(s[mt, 2 * np_], a[mt], bf[:, 0], bf[:, 1])
                        s[mt, 2 * np_ + 1] = _mma(s[mt, 2 * np_ + 1], a[mt], bf[:, 2], bf[:, 3])
            s = s * qk_scale
            if valid < BN:  # the masked path
                key = (np.arange(nt_n)[:, None, None] * 8 + (C * 2)[None, :, None]
                       + (np.arange(4) & 1)[None, None, :])
                s = np.where(key[None] < valid, s, -np.inf).astype(np.float32)
            for mt in range(mt_n):
                for r in range(2):
                    cols = s[mt][:, :, 2 * r: 2 * r + 2]  # (nt, 32 lanes, 2)
                    mx = _quad(cols.max(axis=(0, 2)), np.maximum)
                    m_new = np.maximum(self.m[w, mt, r], mx)
                    m_use = np.where(m_new == -np.inf, 0, m_new).astype(np.float32)
                    alpha = np.exp2(self.m[w, mt, r] - m_use)
                    self.m[w, mt, r] = m_new
                    pr = np.exp2(cols - m_use[None, :, None]).astype(np.float32)
                    s[mt][:, :, 2 * r: 2 * r + 2] = pr
                    self.lsum[w, mt, r] = self.lsum[w, mt, r] * alpha + pr.sum(axis=(0, 2))
                    self.acc[w, mt, :, :, 2 * r: 2 * r + 2] *= alpha[None, :, None]
            for kk in range(BN // 16):
                pa = [_round16(np.stack([s[mt, 2 * kk][:, 0:2], s[mt, 2 * kk][:, 2:4],
                                         s[mt, 2 * kk + 1][:, 0:2], s[mt, 2 * kk + 1][:, 2:4]],
                                        axis=1), self.spec.dtype)  # pack2 (cvt.rn)
                      for mt in range(mt_n)]
                for dp in range(dt_n // 2):
                    bf = _ldmatrix_x4(smem, s_v + _offset(
                        kk * 16 + (((LANE >> 3) & 1) << 3) + (LANE & 7),
                        2 * dp + (LANE >> 4), D), True)
                    for mt in range(mt_n):
                        acc = self.acc[w, mt]
                        acc[2 * dp] = _mma(acc[2 * dp], pa[mt], bf[:, 0], bf[:, 1])
                        acc[2 * dp + 1] = _mma(acc[2 * dp + 1], pa[mt], bf[:, 2], bf[:, 3])

    def run(self, qk_scale: np.float32) -> None:
        """The block pipeline's loop (one buffer, or the kStages ring)."""
        stages = self.t["stages"]
        if stages == 1:
            while self.produced < len(self.tiles):
                self.produce(0)
                self.consume(0, self.meta[0], qk_scale)
            return
        for st in range(stages - 1):
            self.produce(st)
        tile, stage = 0, 0
        while tile < self.produced:
            valid = self.meta[stage]
            self.produce(stages - 1 if stage == 0 else stage - 1)
            self.consume(stage, valid, qk_scale)
            stage = 0 if stage == stages - 1 else stage + 1
            tile += 1

    def epilogue(self, o: np.ndarray, lse: np.ndarray, lse_row0: int) -> None:
        """Epilogue::store: rows through the warp's Q rows in shared memory, then 16 bytes out."""
        D, warp_m, smem = self.D, self.t["warp_m"], self.smem
        for w in range(self.t["num_warps"]):
            wr0 = w * warp_m
            for mt in range(self.t["m_tiles"]):
                for r in range(2):
                    lrow = _quad(self.lsum[w, mt, r], np.add)
                    safe = np.where(lrow > 0, lrow, 1)
                    inv = np.where(lrow > 0, 1 / safe, 0)
                    rows = wr0 + mt * 16 + G + 8 * r
                    for dt in range(D // 8):
                        vals = _round16(self.acc[w, mt, dt][:, 2 * r: 2 * r + 2] * inv[:, None],
                                        self.spec.dtype)
                        off = (_offset(rows, dt, D) + C * 4) // 2
                        smem[off], smem[off + 1] = vals[:, 0], vals[:, 1]
                    value = np.where(lrow > 0, self.m[w, mt, r] + np.log2(safe), -np.inf)
                    lse[lse_row0 + rows[C == 0]] = value[C == 0]
            for step in range(warp_m * (D // 8) // 32):
                c = LANE + step * 32
                rows, chunks = wr0 + c // (D // 8), c % (D // 8)
                for lane in range(32):
                    src = _offset(rows[lane], chunks[lane], D) // 2
                    dst = self.base + (self.q_row0 + rows[lane]) * self.stride + chunks[lane] * 8
                    o[dst: dst + 8] = smem[src: src + 8]


def _emulate(spec: Spec, cfg: KernelConfig, q, k, v, lut, counts, vbs, sm_scale):
    """Run every CTA of the launch grid; returns (o, lse) as fp32 tensors."""
    t = nv.cuda_traits(spec, cfg, SM90)
    if spec.layout == "bshd":
        B_, SEQ, H, D = q.shape
    else:
        B_, H, SEQ, D = q.shape
    nq, topk = SEQ // spec.block_q, lut.shape[-1]
    p = rt.launch_params(spec, cfg, SM90, B_, H, nq)
    assert p.block == (t["threads"], 1, 1)
    assert p.shared_bytes == t["block_m"] * D * 2 + t["stages"] * 2 * t["block_n"] * D * 2
    gmem = {name: x.float().numpy().reshape(-1) for name, x in (("q", q), ("k", k), ("v", v))}
    lut_flat, vbs_np = lut.numpy().reshape(-1), vbs.numpy()
    cnt = counts.numpy().reshape(-1) if counts is not None else None
    o = np.zeros_like(gmem["q"])
    lse = np.full(B_ * H * SEQ, np.nan, np.float32)
    qk_scale = np.float32(sm_scale * LOG2E)
    for bh in range(p.grid[1]):
        b, h = divmod(bh, H)
        # TokenLayout::base / row_stride
        base = (b * SEQ * H + h) * D if spec.layout == "bshd" else (b * H + h) * SEQ * D
        stride = H * D if spec.layout == "bshd" else D
        for pid_m in range(p.grid[0]):
            q_cube = pid_m // (spec.block_q // t["block_m"])
            q_row0 = pid_m * t["block_m"]
            cta = _Cta(spec, t, p.shared_bytes, gmem, base, stride, q_row0)
            cta.tile_copy(0, gmem["q"], base + q_row0 * stride, t["block_m"])
            row = bh * nq + q_cube
            cta.walk_lut(lut_flat[row * topk: (row + 1) * topk],
                         int(cnt[row]) if cnt is not None else topk, vbs_np)
            cta.run(qk_scale)
            cta.epilogue(o, lse, bh * SEQ + q_row0)
    return torch.from_numpy(o.reshape(q.shape)), torch.from_numpy(lse.reshape(B_, H, SEQ))


def _tiny_inputs(spec: Spec, seed: int, counts: bool):
    """2 heads, 3 cubes with vbs 64, 40 (partial sub-tile) and 12 (sub-tiles skipped)."""
    gen = torch.Generator().manual_seed(seed)
    H, nq, topk, D = 2, 3, 2, spec.head_dim
    shape = (1, nq * 64, H, D) if spec.layout == "bshd" else (1, H, nq * 64, D)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]
    q, k, v = (torch.randn(shape, generator=gen).to(dt) for _ in range(3))
    q = q * 4  # large logits: the running max has to do its job
    lut = torch.stack([torch.randperm(nq, generator=gen)[:topk] for _ in range(H * nq)])
    lut = lut.reshape(1, H, nq, topk).to(torch.int32)
    vbs = torch.tensor([64, 40, 12], dtype=torch.int32)
    cnt = torch.tensor([[[2, 0, 1], [1, 2, 0]]], dtype=torch.int32) if counts else None
    return q, k, v, lut, vbs, cnt


EMULATED = [
    (Spec(head_dim=64), KernelConfig(), False),
    (Spec(head_dim=64, dtype="fp16", layout="bhsd"), KernelConfig(block_m=64, block_n=32,
                                                                  num_warps=2, num_stages=2), True),
    (Spec(head_dim=64), KernelConfig(block_m=32, block_n=16, num_warps=2, num_stages=1), True),
    (Spec(head_dim=64, variable_block_sizes=False, layout="bhsd"),
     KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=3), False),
]


@pytest.mark.parametrize("seed,spec,cfg,counts", [(i, *e) for i, e in enumerate(EMULATED)],
                         ids=[f"{s.dtype}_{s.layout}_{c.name}_{'counts' if n else 'topk'}"
                              for s, c, n in EMULATED])
def test_emulated_kernel_matches_reference(seed, spec, cfg, counts):
    q, k, v, lut, vbs, cnt = _tiny_inputs(spec, seed=seed, counts=counts)
    o, lse = _emulate(spec, cfg, q, k, v, lut, cnt, vbs, spec.sm_scale)
    ref_o, ref_lse = attention_fp32(q, k, v, lut, vbs if spec.variable_block_sizes else None,
                                    cnt, layout=spec.layout)
    assert torch.isfinite(o).all()
    tol = 2e-2 if spec.dtype == "bf16" else 4e-3  # P and o are rounded to 16 bits
    torch.testing.assert_close(o, ref_o.to(q.dtype).float(), atol=tol, rtol=0)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty)
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], atol=1e-4, rtol=1e-5)
    if cnt is not None:  # rows of an empty LUT row: o = 0 exactly, lse = -inf
        o_bhsd = o.transpose(1, 2) if spec.layout == "bshd" else o
        assert empty.any() and torch.all(o_bhsd[empty] == 0)


# -- the GPU check script's CPU-side parts -----------------------------------------------------
def _gpu_check_module():
    path = ROOT / "bench" / "experiments" / "cuda_gpu_check.py"
    spec = importlib.util.spec_from_file_location("cuda_gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["cuda_gpu_check"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_script_cpu_parts():
    mod = _gpu_check_module()
    args = mod.parse_args([])
    names = [c.name for c in mod.cases(args)]
    assert "mid_d128_bf16_bshd_h4" in names and not any(n.startswith("full") for n in names)
    assert sum(n.startswith("small_d") for n in names) == 8
    full = mod.cases(mod.parse_args(["--full", "--no-small"]))
    assert [c.heads for c in full if c.name.startswith("full")] == [40]
    assert all(c.topk == 78 and c.grid == (21, 30, 52) for c in full)
    sweep = mod.cases(mod.parse_args(["--sweep", "--no-small", "--only", "sweep"]))
    assert sweep and all(nv.cuda_violations(c.spec, c.config, SM90) == [] for c in sweep)
    for case in mod.cases(args):  # every config the script builds is valid for sm_90
        if case.config is not None:
            assert nv.cuda_violations(case.spec, case.config, SM90) == []

    case = next(c for c in mod.cases(args) if c.name == "small_counts_bn32_d64_fp16_bhsd")
    x = mod.make_inputs(case, "cpu")
    assert x["q"].dtype == torch.float16 and x["q"].shape == (1, 2, 768, 64)
    assert x["q"].is_contiguous() and x["counts"].shape == (1, 2, 12)
    assert (x["counts"] == 0).any() and x["outlier_heads"]
    from tilegen.inputs import validate_inputs

    validate_inputs(case.spec, x["q"], x["k"], x["v"], x["topk_idx"], x["vbs"], x["counts"])
    assert set(x["vbs"].tolist()) > {64} and x["vbs"].min() >= 1

    finite, cos, mx, mean = mod.score(x["q"], x["q"], "bhsd")
    assert finite and cos == pytest.approx(1.0, abs=1e-4) and mx == 0 and mean == 0
    row = mod.Row(case, passed=True, finite=True, min_cos=1.0, max_abs=0.0, mean_abs=0.0,
                  lse_abs=0.0, cuda_ms=1.25)
    assert "small_counts_bn32_d64_fp16_bhsd" in mod.table([row]) and "PASS" in mod.table([row])
    lse = torch.tensor([0.5, float("-inf")])
    assert mod.lse_error(lse, lse) == 0 and mod.lse_error(lse, torch.tensor([0.5, 1.0])) == (
        float("inf"))


@needs_nvcc
def test_a_source_whose_name_nvcc_cannot_take_compiles_under_its_key():
    """nvcc names its intermediates tmpxft_<...>_<stem>.cudafe1.gpu, so a stem of 218
    characters (a config with many named knobs, session 34) made it fail with "File name too
    long"; such a source is compiled under its variant key and cached under its own name."""
    long_stem = "k_" + "x" * 216  # the length of that config's stem
    assert len(long_stem) > nv.MAX_NVCC_STEM
    text = ('extern "C" __global__ void long_named(float* out) { out[threadIdx.x] = 1.0f; }\n')
    src = CxxSource(text, f"{long_stem}.cu", "none", "cuda")
    art = nv.compile_cuda(src, SM90)
    assert art.kernel_name == "long_named" and art.path.name == f"{long_stem}.sm_90a.cubin"
    assert art.path.is_file() and art.spill_bytes == 0
