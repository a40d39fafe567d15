"""The CUDA family's Hopper kernel (``mainloop = "wgmma"``) on a CPU-only machine.

- Rules: which targets, specs and knobs it takes, and the reasons it gives for the others.
- Render: traits and an entry point over the static headers under tilegen/cuda/sm90; the
  signature the launcher packs is the rendered one.
- Compile (nvcc, sm_90a): every variant builds with HGMMA in the SASS, no spills, no stack, no
  wgmma serialized by ptxas (its C7513/C7510 notes), registers moved by setmaxnreg.
- The ping-pong schedule's predicates (pingpong.cuh), compiled for the host by nvcc and replayed
  for every pair of tile counts: each bar.sync has its bar.arrive, nothing deadlocks.
- `_emulate` runs the kernel's algorithm thread by thread in numpy on the Gluon pre-pass's plan
  (run under Triton's interpreter): the producer's TMA boxes into 128-byte-swizzled panels
  (the swizzle applied to shared-memory address bits, as the copy engine does), the wgmma
  operands read back through the kernel's own descriptor encoding (start, leading and stride
  offsets decoded from the 64-bit word, K-major and MN-major canonical layouts), the
  accumulator and A-register fragment layouts of the PTX ISA, the quad-shuffle softmax, P
  packed to 16 bits, the epilogue's hand-swizzled stores read back by the TMA store. It is
  compared with `tilegen.reference.attention_fp32` on partial and packed cubes, counts with
  empty rows, an outlier head and a bad value.

What no CPU can show: that the hardware agrees with this model (the descriptor values match
what Triton 3.6 emits for the same shared-memory tiles: bench/NOTES.md, session 17), the mbarrier
phases under real concurrency, and the speed. bench/experiments/h200_s17_wgmma.py does that on
the GPU.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

# the nvcc probe, its skip mark, the fresh-cache fixture and cvt.rn to 16 bits: the mma.sync
# kernel's test module's (importing the fixture makes it this module's too)
from test_cuda_backend import _cache_dir, _have_nvcc, _round16, needs_nvcc  # noqa: F401

from tilegen.backends.cuda import BACKEND, wgmma
from tilegen.backends.cuda import nvcc as nv
from tilegen.backends.cuda.tensor_map import TileGeometry, tile_geometry
from tilegen.config import KernelConfig
from tilegen.reference import LOG2E, attention_fp32
from tilegen.spec import Spec
from tilegen.targets import get_target

SM90 = get_target("sm_90")
#: the two-consumer ping-pong kernel (session 17's defaults; the H200 measured one consumer
#: faster in session 18, so that is the default now)
PINGPONG = {"consumers": 2, "pingpong": True, "k_stages": 2, "v_stages": 2}
CUOBJDUMP = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / \
    "cuobjdump"


# -- rules ---------------------------------------------------------------------------------------
def test_rules_say_why():
    spec = Spec()
    assert BACKEND.violations(spec, SM90, wgmma.config()) == []
    assert BACKEND.violations(spec, SM90, wgmma.config(consumers=2, pingpong=True,
                                                       k_stages=2)) == []
    assert BACKEND.violations(Spec(dtype="fp16", head_dim=64, layout="bhsd"), SM90,
                              wgmma.config()) == []
    (why,) = BACKEND.violations(spec, get_target("sm_100a"), wgmma.config())
    assert "Hopper" in why and "tcgen05" in why and "mma_sync" in why
    assert "Hopper" in BACKEND.violations(spec, get_target("sm_80"), wgmma.config())[0]
    bad = {
        "pingpong alternates two consumers": dict(consumers=1, pingpong=True),
        "consumers=4": dict(consumers=4),
        "296288 B": dict(consumers=3, k_stages=3, v_stages=2),  # 3 consumers x 6 tiles of 16 KB
        "kv_tile=96": dict(kv_tile=96),
        "8-bit kernel's": dict(kv_tile=128),
        "k_stages=0": dict(k_stages=0),
        "more than the": dict(consumers=2, k_stages=4, v_stages=4),  # 2 x 9 tiles of 16 KB
        "use fewer stages": dict(consumers=1, k_stages=3, v_stages=3),  # 2 CTAs x 7 tiles
    }
    for words, opts in bad.items():
        assert any(words in p for p in BACKEND.violations(spec, SM90, wgmma.config(**opts))), opts
    # three consumers a CTA: the 16-bit kernel with shallow rings, the 8-bit one as it is; the
    # 8-bit kernel's 128-key tiles need a consumer's whole register share
    assert BACKEND.violations(spec, SM90, wgmma.config(consumers=3, k_stages=2,
                                                       v_stages=1)) == []
    q8 = Spec(quant="int8_fp8")
    assert BACKEND.violations(q8, SM90, wgmma.config(**wgmma.defaults_for(q8))) == []
    assert BACKEND.violations(q8, SM90, wgmma.config(consumers=3)) == []
    assert any("64 registers" in p for p in BACKEND.violations(
        q8, SM90, wgmma.config(consumers=3, k_stages=2, v_stages=1, kv_tile=128)))
    with pytest.raises(ValueError, match="unknown option"):
        wgmma.config(ping_pong=True)
    sep = wgmma.config().replace(separate_kv=True)
    assert any("separate K/V" in p for p in BACKEND.violations(spec, SM90, sep))
    launch = KernelConfig(block_m=32, options=wgmma.config().options)
    assert any("block_m=64" in p for p in BACKEND.violations(spec, SM90, launch))
    # the mma.sync kernel takes no options, and a typo'd mainloop is named
    odd = KernelConfig(options={"k_stages": 2})
    assert "belong to mainloop wgmma" in BACKEND.violations(spec, SM90, odd)[0]
    typo = KernelConfig(options={"mainloop": "wgma"})
    assert "mainloop='wgma'" in BACKEND.violations(spec, SM90, typo)[0]


def test_register_split_fills_the_register_file():
    """On sm_90: 168 at entry, 240 a consumer with two; 128 at entry, 232 with one (two CTAs)."""
    for consumers, entry, regs in ((1, 128, 232), (2, 168, 240)):
        opts = wgmma.resolve({"consumers": consumers, "pingpong": consumers == 2})
        assert wgmma.registers_at_entry(opts, SM90) == entry
        assert wgmma.consumer_registers(opts, SM90) == regs
        ctas = wgmma.CTAS_PER_SM[consumers]
        assert entry * wgmma.threads_of(opts, SM90) * ctas <= SM90.registers_per_sm
        moved = (regs - entry) * 128 * consumers
        assert moved == (entry - wgmma.PRODUCER_REGS) * 128  # setmaxnreg moves, never adds


# -- render --------------------------------------------------------------------------------------
def test_rendered_kernel_is_traits_over_the_sm90_headers():
    cfg = wgmma.config(**{**PINGPONG, "k_stages": 3}).replace(store_max_prob=True)
    src = nv.render_cuda(Spec(), cfg, SM90)
    assert src.template == wgmma.TEMPLATE
    assert '#include "tilegen/cuda/sm90/lut_attention.cuh"' in src.text
    assert "asm" not in src.text and src.text.count("\n") < 70
    for line in ("static constexpr int kKStages = 3;", "static constexpr bool kPingPong = true;",
                 "static constexpr bool kStoreMaxProb = true;",
                 "static constexpr int kConsumerRegs = 240;"):
        assert line in src.text
    names = {rel for rel, _ in src.headers}
    assert {"tilegen/cuda/sm90/arch.cuh", "tilegen/cuda/sm90/wgmma.cuh",
            "tilegen/cuda/sm90/pingpong.cuh", "tilegen/cuda/sm90/softmax.cuh",
            "tilegen/cuda/ptx.cuh"} <= names
    assert nv.render_cuda(Spec(), cfg, SM90).text == src.text  # deterministic
    full = src.expanded()
    assert "m64n64k16.f32.\" TYPE" in full and "setmaxnreg.inc" in full
    assert nv.cuda_traits(Spec(), cfg, SM90)["smem_bytes"] == (1 + 3 + 2) * 16384 * 2 + 1024


def test_a_build_of_sm90_renders_both_mainloops():
    from tilegen.build import plan

    items = [i for i in plan(Spec(), SM90) if i.backend == "cuda"]
    assert [i.source.template for i in items] == [nv.CUDA_TEMPLATE, wgmma.TEMPLATE]
    assert [i for i in plan(Spec(), get_target("sm_100a")) if i.backend == "cuda"
            and i.source.template == wgmma.TEMPLATE] == []


def _signature(text: str, name: str) -> list[str]:
    head = text[text.index(f"{name}("):text.index(") {", text.index(f"{name}("))]
    return [re.split(r"\s+", p.strip())[-1].lstrip("*") for p in head.split("(", 1)[1].split(",")]


def test_kernel_args_match_the_rendered_signature():
    cfg = wgmma.config(**PINGPONG)
    src = nv.render_cuda(Spec(), cfg, SM90)
    assert _signature(src.text, wgmma.kernel_name(Spec(), cfg)) == [
        n for n, _ in wgmma.KERNEL_SIGNATURE]
    values = {n: 1 for n, kind in wgmma.KERNEL_SIGNATURE if kind != "ptr"}
    args = wgmma.kernel_args(values)
    assert [a[0] for a in args] == [n for n, _ in wgmma.KERNEL_SIGNATURE]
    assert dict((n, v) for n, _, v in args)["lse"] == 0  # a pointer left out is nullptr
    with pytest.raises(ValueError, match="qk_scale is missing"):
        wgmma.kernel_args({n: v for n, v in values.items() if n != "qk_scale"})
    with pytest.raises(ValueError, match="int32"):
        wgmma.kernel_args({**values, "topk": 2**31})
    opts = wgmma.options_of(cfg)
    assert wgmma.grid(624, 1, 40, opts, SM90) == (312 * 40, 1, 1)  # a CTA per cube pair
    one = wgmma.resolve({"consumers": 1, "pingpong": False})
    assert wgmma.grid(5, 2, 3, one, SM90) == (30, 1, 1)
    persistent = wgmma.resolve({**PINGPONG, "persistent": True})
    assert wgmma.grid(624, 1, 40, persistent, SM90) == (SM90.num_sms, 1, 1)  # one wave
    assert wgmma.grid(624, 1, 40, persistent, SM90, sm_count=114) == (114, 1, 1)
    assert wgmma.grid(624, 1, 40, {**one, "persistent": True}, SM90) == (2 * SM90.num_sms, 1, 1)
    assert wgmma.grid(3, 1, 1, persistent, SM90) == (2, 1, 1)  # no more CTAs than groups


def test_tile_geometry():
    g = tile_geometry((2, 640, 40, 128), "bshd", 64)
    assert g == TileGeometry((5120, 1280), 10240, (64, 64))
    assert tile_geometry((2, 40, 640, 64), "bhsd", 8) == TileGeometry((64, 51200), 128, (64, 8))
    assert TileGeometry((64, 8), 24, (64, 8)).problems()  # stride not a multiple of 16
    assert TileGeometry((32, 8), 64, (64, 8)).problems()  # box wider than the tensor
    assert "swizzle" in TileGeometry((128, 8), 256, (128, 8)).problems()[0]
    with pytest.raises(ValueError, match="'bshd' or 'bhsd'"):
        tile_geometry((1, 64, 1, 64), "sbhd", 64)


def test_op_refuses_what_the_kernel_lacks_before_any_gpu_work():
    from tilegen.backends.cuda.wgmma_op import CudaWgmmaAttention

    op = BACKEND.make_op(Spec(), wgmma.config(), SM90)
    assert isinstance(op, CudaWgmmaAttention) and op.backend == "cuda"
    with pytest.raises(ValueError, match="Hopper"):
        CudaWgmmaAttention(Spec(), wgmma.config(), get_target("sm_100a"))
    q = torch.zeros(1, 128, 1, 128, dtype=torch.bfloat16)
    idx = torch.zeros(1, 1, 2, 1, dtype=torch.int32)
    vbs = torch.full((2,), 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="Hopper GPUs"):
        op(q, q, q, idx, vbs)
    with pytest.raises(ValueError, match="q_vbs"):
        op(q, q, q, idx, vbs, q_vbs=vbs)
    with pytest.raises(TypeError, match="dtype"):
        op(q.float(), q.float(), q.float(), idx, vbs)
    with pytest.raises(NotImplementedError, match="forward only"):
        op.forward_for_grad(q, q, q, idx, vbs)


# -- compile -------------------------------------------------------------------------------------
COMPILED = [
    (Spec(), wgmma.config()),  # three consumers, K ring 2, V ring 1
    (Spec(head_dim=64), wgmma.config()),
    (Spec(), wgmma.config(consumers=1, k_stages=3, v_stages=2)),  # session 18's defaults
    (Spec(), wgmma.config(**PINGPONG)),
    (Spec(), wgmma.config(consumers=2, k_stages=2).replace(store_lse=False,
                                                          store_max_prob=True)),
    (Spec(), wgmma.config(consumers=1, k_stages=2)),
    (Spec(), wgmma.config(**{**PINGPONG, "k_stages": 3, "v_stages": 3})),
    (Spec(dtype="fp16", head_dim=64, layout="bhsd"),
     wgmma.config(**{**PINGPONG, "k_stages": 4, "v_stages": 3})),
    (Spec(), wgmma.config(**{**PINGPONG, "persistent": True, "k_stages": 3})),
    (Spec(), wgmma.config(persistent=True, consumers=1, k_stages=2, v_stages=2)),
]


@needs_nvcc
@pytest.mark.parametrize("spec,cfg", COMPILED, ids=[f"{s.dtype}_d{s.head_dim}_{s.layout}_{c.name}"
                                                    for s, c in COMPILED])
def test_every_variant_compiles_to_chained_hgmma(spec, cfg, tmp_path):
    import json

    art = nv.compile_cuda(nv.render_cuda(spec, cfg, SM90), SM90)
    log = json.loads((art.path.parent / "meta.json").read_text())["ptxas_log"]
    assert art.spill_bytes == 0 and art.stack_bytes == 0, log
    assert not re.search(r"C75(10|13|15)|serialized", log), log  # wgmma kept asynchronous
    assert art.registers == wgmma.registers_at_entry(wgmma.options_of(cfg), SM90)
    assert art.shared_bytes <= SM90.max_shared_bytes
    sass = subprocess.run([str(CUOBJDUMP), "-sass", str(art.path)], capture_output=True,
                          text=True, check=True).stdout
    hgmma = len(re.findall(r"\bHGMMA\.64x", sass))
    arrives = len(re.findall(r"WARPGROUP\.ARRIVE", sass))
    assert art.matrix_ops.get("HGMMA") == hgmma > 0
    # S is head_dim / 16 MMAs and P V four: chained under one arrive, not one each
    assert arrives * 4 <= hgmma, (arrives, hgmma)
    assert "SETMAXREG.TRY_ALLOC" in sass and "SETMAXREG.DEALLOC" in sass
    assert f"HGMMA.64x{spec.head_dim}x16.F32" in sass and "tnspB" in sass
    assert "UTMALDG.2D" in sass and "UTMASTG.2D" in sass


PINGPONG_REPLAY = r"""
#include <cstdio>
#include "tilegen/cuda/sm90/pingpong.cuh"
using P = tilegen::sm90::PingPong<true, 1>;
// Replays two consumers' turns: turn k of consumer c may start once its wait (if any) is
// matched by the partner's release; reports a deadlock or an unmatched release.
int main() {
  for (int n0 = -1; n0 <= 7; ++n0)
    for (int n1 = -1; n1 <= 7; ++n1) {
      const int t[2] = {P::turns(n0), P::turns(n1)};
      int next[2] = {0, 0}, pending[2] = {0, 0};  // releases not yet consumed, per barrier
      bool moved = true;
      while (moved) {
        moved = false;
        for (int c = 0; c < 2; ++c) {
          if (next[c] >= t[c]) continue;
          const int k = next[c];
          if (P::waits(c, k, t[1 - c])) {
            if (pending[c] == 0) continue;
            --pending[c];
          }
          if (P::releases(c, k, t[1 - c])) ++pending[1 - c];
          if (pending[1 - c] > 1) {
            printf("FAIL %d %d: two releases pending\n", n0, n1);
            return 1;
          }
          ++next[c];
          moved = true;
        }
      }
      if (next[0] != t[0] || next[1] != t[1] || pending[0] || pending[1]) {
        printf("FAIL %d %d: stopped at %d/%d, %d/%d, pending %d %d\n", n0, n1, next[0], t[0],
               next[1], t[1], pending[0], pending[1]);
        return 1;
      }
    }
  printf("ok\n");
  return 0;
}
"""


@needs_nvcc
def test_pingpong_schedule_never_deadlocks(tmp_path):
    src = tmp_path / "replay.cu"
    src.write_text(PINGPONG_REPLAY)
    exe = tmp_path / "replay"
    built = subprocess.run([str(nv.find_nvcc()), "-std=c++17", "-I", str(nv.include_dir()),
                            "-o", str(exe), str(src)], capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


# -- the kernel's own address arithmetic, run on the host ----------------------------------------
HOST_TABLES = r"""
#include <cstdio>
#include "tilegen/cuda/sm90/lut_attention.cuh"
template <int D>
struct Config {
  using Elem = tilegen::Bf16;
  static constexpr bool kBshd = true;
  static constexpr int kHeadDim = D, kBlock = 64, kConsumers = 2, kKStages = 2, kVStages = 2,
                       kQBuffers = 1;
  static constexpr bool kPingPong = true, kStoreLse = true, kStoreMaxProb = false;
  static constexpr int kConsumerRegs = 240, kProducerRegs = 24;
};
template <int D>
void tables() {
  using Tr = tilegen::sm90::WgmmaTraits<Config<D>>;
  using Mma = tilegen::sm90::AttentionMma<tilegen::Bf16, D, 64>;
  using F = tilegen::sm90::Fragment;
  for (unsigned base : {0u, 1024u, 50176u})
    for (int t = 0; t < D / 16; ++t)
      printf("qk %d %u %d %llu\n", D, base, t, (unsigned long long)Mma::qk_descriptor(base, t));
  for (unsigned base : {0u, 1024u, 50176u})
    for (int t = 0; t < 4; ++t)
      printf("pv %d %u %d %llu\n", D, base, t, (unsigned long long)Mma::pv_descriptor(base, t));
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < D; ++c)
      printf("off %d %d %d %u\n", D, r, c, tilegen::sm90::Consumer<Tr>::tile_offset(r, c));
}
int main() {
  using F = tilegen::sm90::Fragment;
  for (int t = 0; t < 128; ++t)
    for (int i = 0; i < 64; ++i)
      printf("frag %d %d %d %d\n", t, i, F::row(F::half(i), t / 32, t % 32), F::column(i, t % 32));
  tables<64>();
  tables<128>();
  return 0;
}
"""


@pytest.fixture(scope="module")
def cxx(tmp_path_factory):
    """The kernel's descriptors, fragment layout and tile offsets, computed by its own headers
    (their __host__ __device__ helpers) in a host program nvcc builds."""
    if not _have_nvcc():
        pytest.skip("nvcc not found: the emulation reads the kernel's own address arithmetic")
    tmp = tmp_path_factory.mktemp("host-tables")
    (tmp / "tables.cu").write_text(HOST_TABLES)
    built = subprocess.run([str(nv.find_nvcc()), "-std=c++17", "-I", str(nv.include_dir()),
                            "-o", str(tmp / "tables"), str(tmp / "tables.cu")],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    out = subprocess.run([str(tmp / "tables")], check=True, capture_output=True, text=True,
                         timeout=60).stdout
    tables: dict = {"qk": {}, "pv": {}, "off": {64: np.zeros((64, 64), np.int64),
                                                 128: np.zeros((64, 128), np.int64)},
                    "row": np.zeros((128, 64), np.int64), "col": np.zeros((128, 64), np.int64)}
    for line in out.splitlines():
        kind, *vals = line.split()
        v = [int(x) for x in vals]
        if kind in ("qk", "pv"):
            tables[kind][tuple(v[:3])] = v[3]
        elif kind == "off":
            tables["off"][v[0]][v[1], v[2]] = v[3]
        else:
            tables["row"][v[0], v[1]], tables["col"][v[0], v[1]] = v[2], v[3]
    return tables


@needs_nvcc
def test_host_tables_are_the_ptx_layouts(cxx):
    """The kernel's fragment layout is the PTX ISA's wgmma accumulator layout, its descriptors
    are linear in the tile's address (14-bit start field, shifted by 4) with the values Triton
    3.6 emits for the same tiles (K-major: leading 0, stride 1024; MN-major: leading 8192,
    stride 1024; 128-byte swizzle), and its tile offsets are the TMA swizzle's."""
    row, col = _acc_layout(128)
    assert np.array_equal(cxx["row"], row) and np.array_equal(cxx["col"], col)
    for kind, layout in (("qk", (0, 1024)), ("pv", (8192, 1024))):
        for (d, base, t), desc in cxx[kind].items():
            assert desc == cxx[kind][(d, 0, t)] + (base >> 4)
            assert _decode(desc)[1:] == layout
    for d, off in cxx["off"].items():
        r, c = np.meshgrid(np.arange(64), np.arange(d), indexing="ij")
        assert np.array_equal(off, _swizzle((c // 64) * 8192 + r * 128 + (c % 64) * 2))


# -- thread-level emulation ----------------------------------------------------------------------
def _swizzle(addr: np.ndarray) -> np.ndarray:
    """The 128-byte swizzle on shared-memory byte addresses: the 16-byte chunk (bits 4-6) XOR
    the 128-byte line within its 1024-byte atom (bits 7-9)."""
    return addr ^ (((addr >> 7) & 7) << 4)


T = np.arange(128)
WARP, LANE = T // 32, T % 32


def _acc_layout(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of accumulator register i of each thread of an m64nN wgmma (PTX ISA)."""
    i = np.arange(n // 2)
    row = 16 * WARP[:, None] + LANE[:, None] // 4 + 8 * ((i[None] // 2) % 2)
    col = 8 * (i[None] // 4) + 2 * (LANE[:, None] % 4) + i[None] % 2
    return row, col


def _a_layout() -> tuple[np.ndarray, np.ndarray]:
    """(row, k) of half e of A register j, per thread, of an m64nNk16 wgmma with A in
    registers: shape (128, 4, 2)."""
    j = np.arange(4)[None, :, None]
    e = np.arange(2)[None, None, :]
    row = 16 * WARP[:, None, None] + LANE[:, None, None] // 4 + 8 * (j % 2)
    k = 2 * (LANE[:, None, None] % 4) + 8 * (j // 2) + e
    return np.broadcast_to(row, (128, 4, 2)), np.broadcast_to(k, (128, 4, 2))


def _decode(desc: int) -> tuple[int, int, int]:
    assert desc >> 62 == 1, "128-byte swizzle"
    return ((desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4)


class _Smem:
    """Shared memory, one slot per 16-bit element (NaN until written)."""

    def __init__(self, nbytes: int) -> None:
        self.data = np.full(nbytes // 2, np.nan, np.float32)

    def tma_load(self, dst: int, view: np.ndarray, col: int, row: int, rows: int) -> None:
        """A (64-column, rows) box of a 2-D view, 128-byte swizzled at dst."""
        assert dst % 1024 == 0, "every box starts on a swizzle atom"
        r, c = np.meshgrid(np.arange(rows), np.arange(64), indexing="ij")
        self.data[_swizzle(dst + r * 128 + c * 2) // 2] = view[row + r, col + c]

    def tma_store(self, src: int, view: np.ndarray, col: int, row: int) -> None:
        r, c = np.meshgrid(np.arange(64), np.arange(64), indexing="ij")
        view[row + r, col + c] = self.data[_swizzle(src + r * 128 + c * 2) // 2]

    def k_major(self, desc: int, rows: int) -> np.ndarray:
        """A (rows x 16) operand through a K-major SW128 descriptor."""
        start, _, stride = _decode(desc)
        r, k = np.meshgrid(np.arange(rows), np.arange(16), indexing="ij")
        return self.data[_swizzle(start + (r // 8) * stride + (r % 8) * 128 + k * 2) // 2]

    def mn_major(self, desc: int, n: int) -> np.ndarray:
        """A (16 x n) operand through an MN-major SW128 descriptor (transposed B)."""
        start, leading, stride = _decode(desc)
        k, c = np.meshgrid(np.arange(16), np.arange(n), indexing="ij")
        addr = (start + (c % 8) * 2 + ((c // 8) % 8) * 16 + (c // 64) * leading
                + (k % 8) * 128 + (k // 8) * stride)
        return self.data[_swizzle(addr) // 2]


def _quad(x: np.ndarray, op) -> np.ndarray:
    """x op shfl_xor(x, 1), then op shfl_xor(., 2), over the thread axis (first)."""
    x = op(x, x[T ^ 1])
    return op(x, x[T ^ 2])


class _Consumer:
    """One consumer warpgroup and its producer lane, emulated over the cubes of one CTA: the
    rings' tile counters and the Q buffer run on from one cube into the next (RingCursor)."""

    def __init__(self, spec: Spec, opts: dict, smem: _Smem, base: int, cxx: dict) -> None:
        self.spec, self.opts, self.smem, self.cxx = spec, opts, smem, cxx
        self.D = spec.head_dim
        self.panels = self.D // 64
        self.tile = 64 * self.D * 2
        self.q_buffers = wgmma.q_buffers(opts)
        self.q_tiles = base
        self.k_tiles = base + self.q_buffers * self.tile
        self.v_tiles = self.k_tiles + opts["k_stages"] * self.tile
        self.kt = self.vt = self.cubes = 0  # RingCursor
        # the accumulator fragments, as the kernel's Fragment computes them
        self.s_row, self.s_col = cxx["row"][:, :32], cxx["col"][:, :32]
        self.o_row, self.o_col = cxx["row"][:, :self.D // 2], cxx["col"][:, :self.D // 2]
        self.a_row, self.a_k = _a_layout()

    # producer
    def load_tile(self, view, dst, t, n_big, sidx, tinfo, vbs, row0, col):
        if t < n_big:
            cube = int(sidx[t])
            for p in range(self.panels):
                self.smem.tma_load(dst + p * 8192, view, col + 64 * p, row0 + cube * 64, 64)
            return
        info = int(tinfo[t])
        first, fill, last = info & 0xFFFF, info >> 16, int(tinfo[t + 1]) & 0xFFFF
        off = 0
        for i in range(first, last):
            cube = int(sidx[i])
            size = int(vbs[cube])
            for r in range(0, size, 8):
                for p in range(self.panels):
                    self.smem.tma_load(dst + p * 8192 + (off + r) * 128, view, col + 64 * p,
                                       row0 + cube * 64 + r, 8)
            off += size
        assert off == fill

    # the two MMAs (wgmma.cuh AttentionMma)
    def desc(self, kind: str, tile: int, t: int) -> int:
        """The kernel's descriptor (AttentionMma::qk_descriptor / pv_descriptor) at `tile`."""
        return self.cxx[kind][(self.D, 0, t)] + (tile >> 4)

    def qk(self, k_tile: int) -> np.ndarray:
        s = np.zeros((64, 64), np.float64)
        for t in range(self.D // 16):
            a = self.smem.k_major(self.desc("qk", self.q_tile, t), 64)
            b = self.smem.k_major(self.desc("qk", k_tile, t), 64)
            s += a.astype(np.float64) @ b.astype(np.float64).T
        return s.astype(np.float32)[self.s_row, self.s_col]  # (128, 32) fragment

    def pv(self, o: np.ndarray, p: np.ndarray, v_tile: int) -> np.ndarray:
        """o (128, D/2) += P (the A registers, (128, 16, 2)) V."""
        acc = np.zeros((64, self.D), np.float64)
        for t in range(4):
            a = np.zeros((64, 16), np.float64)
            a[self.a_row, self.a_k] = p[:, 4 * t: 4 * t + 4, :]
            b = self.smem.mn_major(self.desc("pv", v_tile, t), self.D)
            acc += a @ b.astype(np.float64)
        return o + acc.astype(np.float32)[self.o_row, self.o_col]

    def run(self, views, plan_row, vbs, row0, col, q_cube, scale, out, zero_pad):
        """One cube (lut_attention.cuh Consumer::cube) and its epilogue; `out` holds the lse
        and max_prob rows of this cube."""
        sidx, tinfo, (n, n_big) = plan_row
        dtype, ks, vs = self.spec.dtype, self.opts["k_stages"], self.opts["v_stages"]
        self.q_tile = self.q_tiles + (self.cubes % self.q_buffers) * self.tile
        kt0, vt0 = self.kt, self.vt
        o = np.zeros((128, self.D // 2), np.float32)
        m = np.full((128, 2), -np.inf, np.float32)
        l_part = np.zeros((128, 2), np.float32)
        half = (np.arange(32) // 2) % 2
        if n > 0:
            for p in range(self.panels):
                self.smem.tma_load(self.q_tile + p * 8192, views["q"], col + 64 * p,
                                   row0 + q_cube * 64, 64)
        p_regs = None
        for j in range(max(n, 0)):
            k_slot = self.k_tiles + ((kt0 + j) % ks) * self.tile
            self.load_tile(views["k"], k_slot, j, n_big, sidx, tinfo, vbs, row0, col)
            s = self.qk(k_slot)
            if j > 0:  # P_{j-1} V_{j-1}: its V lands after K_j
                v_slot = self.v_tiles + ((vt0 + j - 1) % vs) * self.tile
                self.load_tile(views["v"], v_slot, j - 1, n_big, sidx, tinfo, vbs, row0, col)
                o = self.pv(o, p_regs, v_slot)
            fill = int(tinfo[j]) >> 16
            s = np.where(self.s_col < fill, s, -np.inf).astype(np.float32)  # a select
            alpha = np.zeros((128, 2), np.float32)
            for h in range(2):
                mx = _quad(s[:, half == h].max(axis=1), np.maximum)
                m_new = np.maximum(m[:, h], mx)
                alpha[:, h] = np.exp2((m[:, h] - m_new) * scale)
                m[:, h] = m_new
            shift = m * scale
            e = np.exp2((s.astype(np.float64) * scale - shift[:, half]).astype(np.float32))
            for h in range(2):
                ssum = e[:, half == h].sum(axis=1)
                l_part[:, h] = ssum if j == 0 else l_part[:, h] * alpha[:, h] + ssum
            if j > 0:
                o = o * alpha[:, (np.arange(self.D // 2) // 2) % 2]
            # pack2: register c holds s[2c] (low) and s[2c + 1]
            p_regs = _round16(e, dtype).reshape(128, 16, 2)
        if n > 0:
            v_slot = self.v_tiles + ((vt0 + n - 1) % vs) * self.tile
            self.load_tile(views["v"], v_slot, n - 1, n_big, sidx, tinfo, vbs, row0, col)
            o = self.pv(o, p_regs, v_slot)
            self.kt += n
            self.vt += n
        self.epilogue(o, m, l_part, n < 0, views, row0, col, q_cube, scale, out, zero_pad, vbs)
        self.cubes += 1

    def epilogue(self, o, m, l_part, bad, views, row0, col, q_cube, scale, out, zero_pad, vbs):
        l_row = _quad(l_part, np.add)
        inv = np.where(l_row > 0, 1 / np.where(l_row > 0, l_row, 1), 0).astype(np.float32)
        q_real = int(vbs[q_cube]) if zero_pad else 64
        rows_h = 16 * WARP[:, None] + LANE[:, None] // 4 + 8 * np.arange(2)[None]
        inv = np.where(rows_h >= q_real, 0, inv)
        if bad:
            inv[:] = np.nan
        i = np.arange(self.D // 2)
        h = (i // 2) % 2
        vals = _round16(o * inv[:, h], self.spec.dtype)
        addr = self.q_tile + self.cxx["off"][self.D][self.o_row, self.o_col]  # tile_offset
        self.smem.data[addr // 2] = vals
        for p in range(self.panels):
            self.smem.tma_store(self.q_tile + p * 8192, views["o"], col + 64 * p,
                                row0 + q_cube * 64)
        lse = np.where(l_row > 0, m * scale + np.log2(np.where(l_row > 0, l_row, 1)), -np.inf)
        if bad:
            lse[:] = np.nan
        first = LANE % 4 == 0
        out["lse"][rows_h[first]] = lse[first]
        peak = np.where(l_row > 0, 1 / np.where(l_row > 0, l_row, 1), 0)
        if bad:
            peak[:] = np.nan
        out["max_prob"][rows_h[first]] = peak[first]
        n_real = min(max(int(vbs[q_cube]), 1), 64)
        out["cube"] = float(np.sum(np.where(rows_h[first] < n_real, peak[first], 0))) / n_real


def _views(x: torch.Tensor, layout: str) -> np.ndarray:
    """The 2-D view the tensor maps describe (tensor_map.tile_geometry)."""
    g = tile_geometry(tuple(x.shape), layout, 64)
    return x.float().numpy().reshape(g.dims[1], g.dims[0])


def _emulate(cxx: dict, spec: Spec, opts: dict, q, k, v, idx, vbs, counts, zero_pad=False,
             sm_count: int = 2):
    """Every CTA of the launch, each over its groups of cubes (`sm_count` SMs for a persistent
    grid: few, so each CTA takes many cubes): (o, lse, max_prob, max_prob_cube, err)."""
    from tilegen.backends.gluon.prepass import prepass_buffers, run_prepass

    layout = spec.layout
    if layout == "bshd":
        B, S, H, D = q.shape
    else:
        B, H, S, D = q.shape
    nq, topk = S // 64, idx.shape[-1]
    rows = B * H * nq
    bufs = prepass_buffers("cpu", rows, topk)
    err = torch.zeros(1, dtype=torch.int32)
    run_prepass(idx, vbs, counts, bufs, rows, vbs.shape[0], topk, err,
                pack=opts["pack_partials"])
    views = {n: _views(t, layout) for n, t in (("q", q), ("k", k), ("v", v))}
    views["o"] = np.full_like(views["q"], np.nan)
    lse = np.full((B, H, S), np.nan, np.float32)
    max_prob = np.full((B, H, S), np.nan, np.float32)
    cube_mean = np.full((B, H, nq), np.nan, np.float32)
    scale = np.float32(spec.sm_scale * LOG2E)
    per = wgmma.q_buffers(opts) + opts["k_stages"] + opts["v_stages"]
    consumer_bytes = per * 64 * D * 2
    gx, _, _ = wgmma.grid(nq, B, H, opts, SM90, sm_count)
    n_groups = wgmma.groups(nq, B, H, opts)
    per_bh = -(-nq // opts["consumers"])
    for x in range(gx):
        smem = _Smem(4096 + opts["consumers"] * consumer_bytes)
        base = 1024  # the dynamic segment, aligned up to the swizzle atom
        for c in range(opts["consumers"]):
            # V rings start zeroed (rows past a packed tile's fill must be finite)
            v0 = base + c * consumer_bytes + (per - opts["v_stages"]) * 64 * D * 2
            smem.data[v0 // 2: (v0 + opts["v_stages"] * 64 * D * 2) // 2] = 0
        for c in range(opts["consumers"]):
            consumer = _Consumer(spec, opts, smem, base + c * consumer_bytes, cxx)
            for g in range(x, n_groups, gx):  # Item
                bh, q_cube = g // per_bh, (g % per_bh) * opts["consumers"] + c
                if q_cube >= nq:
                    continue
                b, h = divmod(bh, H)
                row0, col = (b * S, h * D) if layout == "bshd" else ((b * H + h) * S, 0)
                row = bh * nq + q_cube
                plan_row = (bufs["sidx"][row].numpy(), bufs["tinfo"][row].numpy(),
                            tuple(int(t) for t in bufs["meta"][row]))
                out = {"lse": lse[b, h, q_cube * 64:(q_cube + 1) * 64],
                       "max_prob": max_prob[b, h, q_cube * 64:(q_cube + 1) * 64]}
                consumer.run(views, plan_row, vbs.numpy(), row0, col, q_cube, scale, out,
                             zero_pad)
                cube_mean[b, h, q_cube] = out["cube"]
    o = torch.from_numpy(views["o"].reshape(q.shape))
    return o, torch.from_numpy(lse), torch.from_numpy(max_prob), torch.from_numpy(cube_mean), \
        int(err)


def _inputs(spec: Spec, seed: int, with_counts: bool, heads: int = 2):
    """Cubes of every size the plan packs (64, 32, 16, 8) and two it does not (40, 24), random
    LUT rows with no repeats, head 0 an outlier (logits of several hundred)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [64, 32, 16, 8, 40, 64, 16, 24]
    nq, topk, D = len(sizes), 6, spec.head_dim
    shape = (1, nq * 64, heads, D) if spec.layout == "bshd" else (1, heads, nq * 64, D)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]
    q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
    head = (slice(None), slice(None), 0) if spec.layout == "bshd" else (slice(None), 0)
    q[head] = q[head] * 12 + 3
    k[head] = k[head] + 2
    q, k, v = (t.to(dt) for t in (q, k, v))
    idx = torch.stack([torch.randperm(nq, generator=gen)[:topk] for _ in range(heads * nq)])
    idx = idx.reshape(1, heads, nq, topk).to(torch.int32)
    vbs = torch.tensor(sizes, dtype=torch.int32)
    counts = None
    if with_counts:
        counts = torch.randint(0, topk + 1, (1, heads, nq), dtype=torch.int32, generator=gen)
        counts[0, 1, 2] = 0
    return q, k, v, idx, vbs, counts


EMULATED = [
    (Spec(), dict(), False),  # three consumers a CTA: the last group's third cube past the grid
    (Spec(), dict(consumers=1, k_stages=3, v_stages=2), True),
    (Spec(dtype="fp16", layout="bhsd", head_dim=64), dict(k_stages=3, v_stages=1), True),
    (Spec(head_dim=64), dict(consumers=1, pingpong=False, pack_partials=False), True),
    (Spec(), dict(persistent=True, consumers=1, k_stages=3, v_stages=2), True),
    (Spec(head_dim=64, layout="bhsd"), dict(persistent=True, consumers=1, pingpong=False,
                                            v_stages=3), False),
]


@pytest.mark.parametrize("seed,spec,opts,with_counts", [(i, *e) for i, e in enumerate(EMULATED)],
                         ids=[f"{s.dtype}_d{s.head_dim}_{s.layout}_{sorted(o.items())}"
                              for s, o, _ in EMULATED])
def test_emulated_kernel_matches_reference(interpreter, cxx, seed, spec, opts, with_counts):
    q, k, v, idx, vbs, counts = _inputs(spec, seed, with_counts)
    resolved = wgmma.resolve(opts)
    o, lse, mp, cube, err = _emulate(cxx, spec, resolved, q, k, v, idx, vbs, counts)
    assert err == 0
    ref_o, ref_lse, ref_mp = attention_fp32(q, k, v, idx, vbs, counts, layout=spec.layout,
                                            max_prob=True)
    assert torch.isfinite(o).all()
    tol = 3e-2 if spec.dtype == "bf16" else 5e-3  # P and o are rounded to 16 bits
    torch.testing.assert_close(o, ref_o.to(q.dtype).float(), atol=tol, rtol=0)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and empty.any() == with_counts
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(mp, ref_mp, atol=2e-4, rtol=1e-3)
    real = vbs.clamp(1, 64)
    want = torch.stack([ref_mp[..., i * 64:i * 64 + int(r)].mean(-1) for i, r in enumerate(real)],
                       -1)
    torch.testing.assert_close(cube, want, atol=2e-4, rtol=1e-3)


def test_emulated_kernel_pads_zeros_and_poisons_a_bad_row(interpreter, cxx):
    spec = Spec(head_dim=64)
    q, k, v, idx, vbs, _ = _inputs(spec, 7, False)
    bad = idx.clone()
    bad[0, 1, 3, 2] = 99  # out of range: row (h 1, cube 3) must come out NaN, alone
    o, lse, _, _, err = _emulate(cxx, spec, wgmma.resolve({}), q, k, v, bad, vbs, None,
                                 zero_pad=True)
    assert err & 1
    rows = slice(3 * 64, 4 * 64)
    assert torch.isnan(o[0, rows, 1]).all() and torch.isnan(lse[0, 1, rows]).all()
    ok = torch.ones_like(o, dtype=torch.bool)
    ok[0, rows, 1] = False
    assert torch.isfinite(o[ok]).all()
    o_good, _, _, _, _ = _emulate(cxx, spec, wgmma.resolve({}), q, k, v, idx, vbs, None,
                                  zero_pad=True)
    for cube, size in enumerate(vbs.tolist()):  # padded query rows are zeros
        assert (o_good[0, cube * 64 + size:(cube + 1) * 64] == 0).all()
    ref_o, _ = attention_fp32(q, k, v, idx, vbs, None, layout="bshd")
    real = torch.cat([torch.arange(c * 64, c * 64 + s) for c, s in enumerate(vbs.tolist())])
    torch.testing.assert_close(o_good[0, real], ref_o.to(q.dtype).float()[0, real], atol=3e-2,
                               rtol=0)


# -- the GPU script's CPU-side parts -------------------------------------------------------------
def test_gpu_script_cpu_parts():
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "bench" / "experiments" / "h200_s17_wgmma.py"
    spec = importlib.util.spec_from_file_location("h200_s17_wgmma", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["h200_s17_wgmma"] = mod
    spec.loader.exec_module(mod)
    assert mod.parse_variants("consumers=1,pingpong=0;k_stages=3") == [
        ("+consumers1_pingpong0", {}, {"consumers": 1, "pingpong": False}),
        ("+k_stages3", {}, {"k_stages": 3})]
    for label, fields, opts in mod.VARIANTS:  # every config the script builds is valid
        assert BACKEND.violations(Spec(**fields), SM90, wgmma.config(**opts)) == [], label
    o = torch.randn(1, 128, 2, 64)
    ref = o.clone()
    ref[0, 64 + 13, 1, 9] += 1  # cube 1, row 13 (group 1, second half), chunk 1, head 1
    where = mod.diagnose(o, ref, "bshd")
    assert where.startswith("row%64//8 0 1 0") and "row%16>=8 0 1" in where
    assert "chunk 0 1 0" in where and "head 0 1" in where and "cube 0 1" in where
    row = dict(case="small/x", passed=False, score="finite=True", ms=1.5, where=where)
    assert "FAIL" in mod.table([row]) and "where: row%64//8" in mod.table([row])
