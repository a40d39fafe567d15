"""HIP backend (gfx942): rendering, clang-19 compilation, resources, and the kernel's index math.

No AMD GPU here, so the kernel's host-visible index math (grid, LUT walk, copy chunks, swizzled
LDS layout, pipeline buffers, MFMA lane maps, softmax, wave merge, epilogue) is checked by
`emulate`: a NumPy model of the generated C++ driven by the same `HipPlan` the template is
rendered from, compared with `tilegen.reference`. The rendered source static_asserts that its
own index maps hash to the plan's (see the "plan checks" section of the template), so passing
both means the C++ and the emulated walk agree.
"""

from __future__ import annotations

import itertools
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from tilegen.backends.hip import compile as hipcc
from tilegen.backends.hip import plan as hipp
from tilegen.backends.hip import runtime as hiprt
from tilegen.compile import CompileError, ToolchainMissing
from tilegen.config import KernelConfig, default_config
from tilegen.reference import LOG2E, attention_fp32
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
    assert first == "// " + HEADER.format(template=hipp.HIP_TEMPLATE, spec_hash=spec.hash,
                                          target="gfx942 (gfx942)")
    assert hipp.render_hip(spec, DEFAULT, TARGET).text == src.text
    assert src.name == (f"lut_d{spec.head_dim}_{spec.dtype}_{spec.layout}_vbs_q64k64_"
                        f"{DEFAULT.name}.hip")
    stamp = hipp.source_stamp(src)
    plan = hipp.plan_for(spec, DEFAULT, TARGET)
    assert stamp == {"config": DEFAULT.name, "threads": plan.threads,
                     "lds_bytes": plan.lds_bytes, "mfma": plan.mfma_name}
    # render-time choices leave no trace of the other variants
    other_layout = "bhsd" if spec.layout == "bshd" else "bshd"
    assert f"contiguous {other_layout.upper()}" not in src.text
    assert ("bf16_1k(" in src.text) == (spec.dtype == "bf16")


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
    # A plan that disagrees with the C++ index maps does not compile.
    fp = hipp.plan_for(spec, DEFAULT, TARGET).fingerprints()["acc_rows"]
    broken = Source(src.text.replace(f"{fp}u", f"{fp + 1}u"), "broken.hip", src.template, "hip")
    with pytest.raises(CompileError, match="accumulator lane map"):
        hipcc.compile_hip(broken, hip_cache / "broken", TARGET)
    bad = Source(src.text + "\nthis is not C++;\n", "bad.hip", src.template, "hip")
    with pytest.raises(CompileError, match="error"):
        hipcc.compile_hip(bad, hip_cache / "bad", TARGET)


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


# -- NumPy emulation of the kernel ------------------------------------------------------------
def to_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 -> 16-bit patterns, as Elem::from_f32 (bf16: RNE by hand, NaN kept quiet)."""
    x = np.asarray(x, np.float32)
    if dtype == "fp16":
        return x.astype(np.float16).view(np.uint16)
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)


def from_bits(b: np.ndarray, dtype: str) -> np.ndarray:
    b = np.asarray(b, np.uint16)
    if dtype == "fp16":
        return b.view(np.float16).astype(np.float32)
    return (b.astype(np.uint32) << 16).view(np.float32)


class Emulator:
    """The generated kernel, structure for structure, on flat arrays (global memory as 16-bit
    patterns, LDS as a 16-bit array with a 32-bit view for the merge)."""

    def __init__(self, plan: hipp.HipPlan) -> None:
        self.p = plan
        lanes = np.arange(64)
        mn = plan.mfma_mn
        self.lanes = lanes
        self.op_row = lanes % mn
        self.op_k = 4 * (lanes // mn)[:, None] + np.arange(4)[None, :]
        self.acc = np.array([[plan.acc_row(lane, r) for r in range(plan.acc_regs)]
                             for lane in lanes])
        self.paths: Counter[str] = Counter()  # which compute paths the walk took

    # one MFMA on register fragments: A and B as (64, 4) values, C as (64, ACC)
    def mma(self, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
        mn, k = self.p.mfma_mn, self.p.mfma_k
        am = np.zeros((mn, k), np.float32)
        bm = np.zeros((k, mn), np.float32)
        am[self.op_row[:, None], self.op_k] = a
        bm[self.op_k, self.op_row[:, None]] = b
        cm = np.zeros((mn, mn), np.float32)
        cm[self.acc, self.op_row[:, None]] = c
        d = am.astype(np.float64) @ bm.astype(np.float64) + cm
        return d.astype(np.float32)[self.acc, self.op_row[:, None]]

    def group_reduce(self, x: np.ndarray, op) -> np.ndarray:
        mask = self.p.mfma_mn
        while mask < 64:
            x = op(x, x[self.lanes ^ mask])
            mask <<= 1
        return x

    def run(self, q, k, v, lut, counts, vbs, shapes, qk_scale):
        """q, k, v: flat uint16 arrays in the spec's layout; returns flat o bits and lse."""
        p = self.p
        o = np.full(q.shape, 0x7FC0, np.uint16)  # NaN: rows nobody writes stay visible
        lse = np.full(shapes.batch * shapes.heads * shapes.seq_len, np.nan, np.float32)
        gx, gy, gz = p.grid(shapes.batch, shapes.heads, shapes.num_q_blocks)
        assert gz == 1
        for pid_m, bh in itertools.product(range(gx), range(gy)):
            self.workgroup(pid_m, bh, q, k, v, lut, counts, vbs, o, lse, shapes, qk_scale)
        return o, lse

    def base_and_stride(self, b: int, h: int, shapes) -> tuple[int, int]:
        p = self.p
        if p.layout == "bshd":
            return (b * shapes.seq_len * shapes.heads + h) * p.head_dim, shapes.heads * p.head_dim
        return (b * shapes.heads + h) * shapes.seq_len * p.head_dim, p.head_dim

    def cursor(self, lut_row, vbs, n_blocks):
        """KvCursor: yields (first_token, sub, n_valid) in walk order."""
        p = self.p
        slot = 0
        while slot < n_blocks:
            cube = int(lut_row[slot])
            n_valid = int(vbs[cube]) if p.vbs else p.block_kv
            sub = 0
            while True:
                yield cube * p.block_kv + sub * p.block_n, sub, n_valid
                sub += 1
                if sub == p.subtiles or sub * p.block_n >= n_valid:
                    break
            slot += 1

    def copy_tile(self, k, v, row0, row_stride, lds, stage):
        """KvBlockTile::load + store by all threads (chunk c on thread c % THREADS)."""
        p = self.p
        base = stage * p.stage_elems
        for c in range(p.copy_chunks):
            (kk, kd), (vk, vd) = p.copy_chunk(c)
            kv_ = k[row0 + kk * row_stride + kd: row0 + kk * row_stride + kd + 8]
            vv = v[row0 + vk * row_stride + vd: row0 + vk * row_stride + vd + 8]
            for e in range(8):
                lds[base + p.k_offset(kk, kd + e)] = kv_[e]
                lds[base + p.vt_offset(vd + e, vk)] = vv[e]

    def workgroup(self, pid_m, bh, q, k, v, lut, counts, vbs, o, lse, shapes, qk_scale):
        p = self.p
        mn, kstep, dt = p.mfma_mn, p.mfma_k, p.dtype
        b, h = divmod(bh, shapes.heads)
        q_cube = pid_m // (p.block_q // p.block_m)
        base, row_stride = self.base_and_stride(b, h, shapes)
        lds = np.zeros(p.lds_bytes // 2, np.uint16)
        waves = [(wm, wn) for wn in range(p.warps_n) for wm in range(p.warps_m)]
        st = {}
        for wm, wn in waves:
            q_row0 = pid_m * p.block_m + wm * p.wave_m
            qf = [[None] * (p.head_dim // kstep) for _ in range(p.rep_m)]
            for rm, ks in itertools.product(range(p.rep_m), range(p.head_dim // kstep)):
                rows = q_row0 + rm * mn + self.op_row
                qf[rm][ks] = from_bits(q[base + rows[:, None] * row_stride + ks * kstep
                                         + self.op_k], dt)
            st[wm, wn] = {
                "q": qf, "q_row0": q_row0,
                "m": [np.full(64, -np.inf, np.float32) for _ in range(p.rep_m)],
                "l": [np.zeros(64, np.float32) for _ in range(p.rep_m)],
                "o": [[np.zeros((64, p.acc_regs), np.float32) for _ in range(p.rep_m)]
                      for _ in range(p.rep_d)]}
        lut_row_idx = bh * shapes.num_q_blocks + q_cube
        n_blocks = int(counts.reshape(-1)[lut_row_idx]) if counts is not None else shapes.topk
        lut_row = lut.reshape(-1)[lut_row_idx * shapes.topk:(lut_row_idx + 1) * shapes.topk]
        tiles = list(self.cursor(lut_row, vbs, n_blocks))
        # pipeline: prologue fills STAGES - 1 buffers, step t computes buffer t % STAGES and
        # refills buffer (t + STAGES - 1) % STAGES after the compute
        stages = p.num_stages
        for s in range(min(stages - 1, len(tiles))):
            self.copy_tile(k, v, base + tiles[s][0] * row_stride, row_stride, lds, s)
        buf = 0
        for t, (_, sub, n_valid) in enumerate(tiles):
            if stages == 1:
                self.copy_tile(k, v, base + tiles[t][0] * row_stride, row_stride, lds, 0)
            for wm, wn in waves:
                self.compute(st[wm, wn], lds, buf, sub, n_valid, wn, qk_scale)
            if stages > 1 and t + stages - 1 < len(tiles):
                nxt = tiles[t + stages - 1][0]
                self.copy_tile(k, v, base + nxt * row_stride, row_stride, lds,
                               (buf + stages - 1) % stages)
            buf = 0 if buf + 1 == stages else buf + 1
        self.epilogue(st, lds, waves, base, row_stride, bh, o, lse, shapes)

    def compute(self, w, lds, buf, sub, n_valid, wn, qk_scale):
        p = self.p
        mn, kstep, dt = p.mfma_mn, p.mfma_k, p.dtype
        stage = buf * p.stage_elems
        key0 = wn * p.slice_n
        valid = n_valid - (sub * p.block_n + key0)
        if p.vbs and valid <= 0:
            self.paths["skipped"] += 1
            return
        masked = p.vbs and valid < p.slice_n
        self.paths["masked" if masked else "unmasked"] += 1
        # S^T = K Q^T
        s = [[None] * p.rep_m for _ in range(p.rep_n)]
        for rn in range(p.rep_n):
            accs = [np.zeros((64, p.acc_regs), np.float32) for _ in range(p.rep_m)]
            for ks in range(p.head_dim // kstep):
                keys = key0 + rn * mn + self.op_row
                offs = np.vectorize(p.k_offset)(keys[:, None], ks * kstep + self.op_k)
                a = from_bits(lds[stage + offs], dt)
                for rm in range(p.rep_m):
                    accs[rm] = self.mma(a, w["q"][rm][ks], accs[rm])
            s[rn] = accs
        # softmax stage
        new_m, new_l = list(w["m"]), list(w["l"])
        for rm in range(p.rep_m):
            mx = np.full(64, -np.inf, np.float32)
            for rn in range(p.rep_n):
                x = (s[rn][rm] * np.float32(qk_scale)).astype(np.float32)
                if masked:
                    x = np.where(rn * mn + self.acc >= valid, np.float32(-np.inf), x)
                s[rn][rm] = x
                mx = np.maximum(mx, x.max(axis=1))
            m_new = np.maximum(w["m"][rm], self.group_reduce(mx, np.maximum))
            alpha = np.exp2(w["m"][rm] - m_new).astype(np.float32)
            total = np.zeros(64, np.float32)
            for rn in range(p.rep_n):
                pr = np.exp2(s[rn][rm] - m_new[:, None]).astype(np.float32)
                s[rn][rm] = pr
                total = total + pr.sum(axis=1, dtype=np.float32)
            new_l[rm] = (w["l"][rm] * alpha + total).astype(np.float32)
            new_m[rm] = m_new
            for rd in range(p.rep_d):
                w["o"][rd][rm] = w["o"][rd][rm] * alpha[:, None]
        w["m"], w["l"] = new_m, new_l
        # O^T += V^T P^T
        for rn, ps in itertools.product(range(p.rep_n), range(mn // kstep)):
            bfr = [from_bits(to_bits(s[rn][rm][:, 4 * ps:4 * ps + 4], dt), dt)
                   for rm in range(p.rep_m)]
            for rd in range(p.rep_d):
                keys = key0 + rn * mn + ps * kstep + self.op_k
                offs = np.vectorize(p.vt_offset)((rd * mn + self.op_row)[:, None], keys)
                a = from_bits(lds[stage + offs], dt)
                for rm in range(p.rep_m):
                    w["o"][rd][rm] = self.mma(a, bfr[rm], w["o"][rd][rm])

    def epilogue(self, st, lds, waves, base, row_stride, bh, o, lse, shapes):
        p = self.p
        mn = p.mfma_mn
        lds32 = lds.view(np.float32)
        part_len = p.rep_d * p.rep_m * p.acc_regs * 64
        l_rows = {key: [self.group_reduce(w["l"][rm], np.add) for rm in range(p.rep_m)]
                  for key, w in st.items()}
        if p.warps_n > 1:
            ml, part = 0, 2 * p.warps_n * p.block_m
            for (wm, wn), w in st.items():
                for rm in range(p.rep_m):
                    r_blk = wm * p.wave_m + rm * mn + self.op_row[:mn]
                    lds32[ml + wn * p.block_m + r_blk] = w["m"][rm][:mn]
                    lds32[ml + (p.warps_n + wn) * p.block_m + r_blk] = l_rows[wm, wn][rm][:mn]
                if wn > 0:
                    mine = part + ((wn - 1) * p.warps_m + wm) * part_len
                    for rd, rm, r in itertools.product(range(p.rep_d), range(p.rep_m),
                                                       range(p.acc_regs)):
                        at = mine + ((rd * p.rep_m + rm) * p.acc_regs + r) * 64
                        lds32[at:at + 64] = w["o"][rd][rm][:, r]
            for (wm, wn), w in st.items():
                if wn:
                    continue
                for rm in range(p.rep_m):
                    r_blk = wm * p.wave_m + rm * mn + self.op_row
                    m_all = np.max([lds32[ml + v * p.block_m + r_blk] for v in range(p.warps_n)],
                                   axis=0)
                    basev = np.where(m_all == -np.inf, np.float32(0), m_all)
                    c0 = np.exp2(w["m"][rm] - basev).astype(np.float32)
                    l_all = l_rows[wm, wn][rm] * c0
                    for rd in range(p.rep_d):
                        w["o"][rd][rm] = w["o"][rd][rm] * c0[:, None]
                    for vv in range(1, p.warps_n):
                        cv = np.exp2(lds32[ml + vv * p.block_m + r_blk] - basev)
                        l_all = l_all + cv * lds32[ml + (p.warps_n + vv) * p.block_m + r_blk]
                        theirs = part + ((vv - 1) * p.warps_m + wm) * part_len
                        for rd, r in itertools.product(range(p.rep_d), range(p.acc_regs)):
                            at = theirs + ((rd * p.rep_m + rm) * p.acc_regs + r) * 64
                            w["o"][rd][rm][:, r] += cv * lds32[at:at + 64]
                    w["m"][rm] = m_all
                    l_rows[wm, wn][rm] = l_all.astype(np.float32)
        for (wm, wn), w in st.items():
            if wn:
                continue
            for rm in range(p.rep_m):
                l_row = l_rows[wm, wn][rm]
                l_safe = np.where(l_row > 0, l_row, np.float32(1))
                rows = w["q_row0"] + rm * mn + self.op_row
                for rd, j in itertools.product(range(p.rep_d), range(p.acc_regs // 4)):
                    d = rd * mn + self.acc[:, 4 * j]
                    vals = w["o"][rd][rm][:, 4 * j:4 * j + 4] / l_safe[:, None]
                    offs = base + rows[:, None] * row_stride + d[:, None] + np.arange(4)
                    o[offs] = to_bits(vals, p.dtype)
                if p.store_lse:
                    val = np.where(l_row > 0, w["m"][rm] + np.log2(l_safe), -np.inf)
                    lse[bh * shapes.seq_len + rows[:mn]] = val[:mn]


def make_problem(spec: Spec, *, seed: int = 0, batch: int = 1, heads: int = 2, cubes: int = 4,
                 topk: int = 3, outlier: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    s = cubes * spec.block_q
    shape = (batch, s, heads, spec.head_dim) if spec.layout == "bshd" else \
        (batch, heads, s, spec.head_dim)
    dtype = torch.bfloat16 if spec.dtype == "bf16" else torch.float16
    q, k, v = (torch.randn(shape, generator=g).to(dtype) for _ in range(3))
    if outlier:  # one head with logits of several hundred: needs the running max
        hsel = (slice(None), slice(None), 1) if spec.layout == "bshd" else (slice(None), 1)
        q[hsel] = (q[hsel].float() * outlier).to(dtype)
        k[hsel] = (k[hsel].float() * outlier).to(dtype)
    lut = torch.stack([torch.randperm(cubes, generator=g)[:topk]
                       for _ in range(batch * heads * cubes)]).reshape(batch, heads, cubes, topk)
    vbs = torch.tensor([64, 33, 8, 1][:cubes] + [64] * max(0, cubes - 4), dtype=torch.int32)
    counts = torch.randint(0, topk + 1, (batch, heads, cubes), generator=g, dtype=torch.int32)
    counts[0, 0, 0] = 0
    counts[0, -1, -1] = topk
    return q, k, v, lut.to(torch.int32).contiguous(), vbs, counts


def emulate(spec: Spec, cfg: KernelConfig, q, k, v, lut, vbs, counts,
            paths: Counter | None = None):
    plan = hipp.plan_for(spec, cfg, TARGET)
    shapes = hiprt.validate_inputs(spec, q, k, v, lut, vbs, counts)
    bits = [t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)
            for t in (q, k, v)]
    emu = Emulator(plan)
    o_bits, lse = emu.run(*bits, lut.numpy(), None if counts is None else counts.numpy(),
                          vbs.numpy(), shapes, spec.sm_scale * LOG2E)
    if paths is not None:
        paths.update(emu.paths)
    o = torch.from_numpy(from_bits(o_bits, spec.dtype).reshape(q.shape))
    return o, torch.from_numpy(lse.reshape(shapes.batch, shapes.heads, shapes.seq_len))


EMULATED = [
    (Spec(head_dim=64), DEFAULT),
    (Spec(head_dim=64, layout="bhsd", dtype="fp16"), DEFAULT),
    (Spec(head_dim=64), OTHER_CONFIGS[0]),
    (Spec(head_dim=64, dtype="fp16"), OTHER_CONFIGS[1]),
    (Spec(head_dim=64, layout="bhsd"), KernelConfig(block_m=32, block_n=64, num_warps=8,
                                                    num_stages=3)),
    (Spec(head_dim=64, variable_block_sizes=False), KernelConfig(block_m=32, block_n=32,
                                                                 num_warps=2, num_stages=1)),
    (Spec(head_dim=128), DEFAULT),
]


def _variant_id(x: Spec | KernelConfig) -> str:
    if isinstance(x, KernelConfig):
        return x.name
    return f"d{x.head_dim}_{x.dtype}_{x.layout}_{'vbs' if x.variable_block_sizes else 'full'}"


@pytest.mark.parametrize("spec,cfg", EMULATED, ids=_variant_id)
@pytest.mark.parametrize("with_counts", [True, False], ids=["counts", "topk"])
def test_emulated_kernel_matches_reference(spec: Spec, cfg: KernelConfig,
                                           with_counts: bool) -> None:
    heads = 1 if spec.head_dim == 128 else 2
    q, k, v, lut, vbs, counts = make_problem(spec, heads=heads, outlier=0 if heads == 1 else 12)
    counts = counts if with_counts else None
    paths: Counter = Counter()
    o, lse = emulate(spec, cfg, q, k, v, lut, vbs, counts, paths)
    # the problem's vbs (64, 33, 8, 1) drive every path: full, cut and (split keys) empty slices
    assert paths["unmasked"] and (paths["masked"] > 0) == spec.variable_block_sizes
    plan = hipp.plan_for(spec, cfg, TARGET)
    assert (paths["skipped"] > 0) == (spec.variable_block_sizes and plan.warps_n > 1)
    o_ref, lse_ref = attention_fp32(q, k, v, lut, vbs if spec.variable_block_sizes else None,
                                    counts, layout=spec.layout, block=spec.block_kv)
    assert torch.isfinite(o).all(), "a row was not written or overflowed"
    tol = 2e-2 if spec.dtype == "bf16" else 4e-3
    torch.testing.assert_close(o, o_ref.to(o.dtype).float(), atol=tol, rtol=tol)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    fin = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[fin], lse_ref[fin], atol=2e-3, rtol=1e-4)
    if counts is not None:  # count-0 rows: o = 0, lse = -inf
        empty = (counts == 0).repeat_interleave(spec.block_q, dim=2)  # (B, H, S)
        o_bhsd = o if spec.layout == "bhsd" else o.transpose(1, 2)
        assert (o_bhsd[empty] == 0).all() and (lse[empty] == -np.inf).all()


def test_emulation_catches_a_wrong_lane_map(monkeypatch) -> None:
    """The emulated check has teeth: a kernel whose MFMA lane map were off would fail it."""
    spec = Spec(head_dim=64)
    q, k, v, lut, vbs, counts = make_problem(spec, heads=1, cubes=2, topk=2)
    good, _ = emulate(spec, DEFAULT, q, k, v, lut, vbs, counts)
    monkeypatch.setattr(hipp.HipPlan, "acc_row",
                        lambda self, lane, r: (4 * (lane // self.mfma_mn) + r + 4) % 16)
    bad, _ = emulate(spec, DEFAULT, q, k, v, lut, vbs, counts)
    assert not torch.allclose(good, bad, atol=1e-2)
