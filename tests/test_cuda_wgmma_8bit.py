"""The CUDA family's 8-bit Hopper kernel (``Spec(quant="int8_fp8")`` on the wgmma mainloop) on a
CPU-only machine: its rules and the reasons it gives, the render (traits over
tilegen/cuda/sm90/lut_attention_8bit.cuh, the launcher's signature), the sm_90a build (IGMMA
and QGMMA, wgmma kept asynchronous, register split, spills no more than known), and the layout
identity its P.V rests on: S's int32 accumulator fragment, packed to e4m3 by the kernel's
register order, is wgmma's 8-bit A fragment over V^T whose keys the pre-pass put in MMA slot
order (`tilegen.quant.vt_slot_keys`, the header's `AttentionMma8::key_of_slot`).

What no CPU shows: the kernel's numbers on the GPU (bench/experiments/h200_quant_op.py
--backend cuda checks it with the quantized rule and check 4, and times it).
"""

from __future__ import annotations

import json
import re
import subprocess

import known_spills
import numpy as np
import pytest
import torch
from test_cuda_backend import _cache_dir, _have_nvcc, needs_nvcc  # noqa: F401
from test_cuda_wgmma import CUOBJDUMP, SM90, _acc_layout, _signature

import tilegen
from tilegen import quant
from tilegen.backends.cuda import BACKEND, wgmma
from tilegen.backends.cuda import nvcc as nv
from tilegen.backends.cuda.tensor_map import byte_geometry
from tilegen.spec import Spec
from tilegen.targets import get_target

Q8 = Spec(quant="int8_fp8")
#: ptxas's notes that it made the MMAs synchronous (C7510/13/14/15) or injected a
#: warpgroup.arrive around one (C7519)
_SERIALIZED = re.compile(r"C75(10|13|14|15|19)|serialized")


def _ptxas_log(art) -> str:
    return json.loads((art.path.parent / "meta.json").read_text())["ptxas_log"]


def test_rules_say_why():
    cfg = wgmma.config()
    assert wgmma.violations(Q8.kernel_spec, cfg, SM90) == []
    why = " ".join(wgmma.violations(Spec(quant="int8_fp8", head_dim=64), cfg, SM90))
    assert "head_dim 128" in why
    assert "BSHD" in " ".join(wgmma.violations(Spec(quant="int8_fp8", layout="bhsd"), cfg, SM90))
    assert "max_prob" in " ".join(
        wgmma.violations(Q8.kernel_spec, cfg.replace(store_max_prob=True), SM90))
    for target in ("sm_80", "sm_100a"):  # the mma.sync kernel is 16-bit: said, not built
        t = get_target(target)
        why = " ".join(BACKEND.violations(Q8, t, BACKEND.default_config(Q8, t)))
        assert "wgmma mainloop" in why and "16-bit" in why
    assert "no quant='int8' kernel" in " ".join(
        BACKEND.spec_violations(Spec(quant="int8"), SM90))


def test_load_takes_the_faster_family_where_it_builds(caplog):
    """`load` without a backend takes the CUDA 8-bit kernel (measured faster than the Gluon one
    in session 20) at its 8-bit defaults (128-key tiles), and the Gluon kernel for what the
    CUDA one does not build (head_dim 64)."""
    assert tilegen.backends.with_quant("int8_fp8") == ["cuda", "gluon"]
    op = tilegen.load(Q8, target="sm_90")
    assert "GPU check" not in caplog.text  # checked on an H100 in session 19
    assert type(op).__name__ == "CudaWgmmaQuantAttention"
    assert wgmma.mainloop_of(op.config) == "wgmma" and not op.provides_max_prob
    assert wgmma.options_of(op.config)["kv_tile"] == 128
    small = tilegen.load(Q8.replace(head_dim=64), target="sm_90")
    assert type(small).__name__ == "GluonQuantAttention"
    # no target on this CPU: refused by name, never the family's 16-bit op for an 8-bit spec
    for backend in (None, "cuda"):
        with pytest.raises(ValueError, match=r"needs a target with Hopper's wgmma \(\['sm_90'\]\)"):
            tilegen.load(Q8, backend=backend)
    q = torch.zeros(1, 128, 1, 128, dtype=torch.bfloat16)
    idx = torch.zeros(1, 1, 2, 1, dtype=torch.int32)
    vbs = torch.full((2,), 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="one shape"):
        op(q, q[:, :64], q, idx, vbs)
    with pytest.raises(ValueError, match="with_q"):
        op.quantize(q, q, q, vbs, with_q=False)
    with pytest.raises(ValueError, match="forward only"):
        op.forward_for_grad(q, q, q, idx, vbs)
    # o in token order (out_rows): checked on the host before any launch; the Gluon op refuses
    qi = op.quantize(q, q, q, vbs)
    assert op.writes_token_order and not small.writes_token_order
    rows = torch.arange(128, dtype=torch.int32)
    with pytest.raises(ValueError, match="out_len goes with out_rows"):
        op.from_quantized(qi, idx, vbs, out_len=128)
    with pytest.raises(ValueError, match="contiguous int32"):
        op.from_quantized(qi, idx, vbs, out_rows=rows.long(), out_len=128)
    with pytest.raises(ValueError, match="out_len must be"):
        op.from_quantized(qi, idx, vbs, out_rows=rows, out_len=0)
    with pytest.raises(ValueError, match="stores o in slot order"):
        small.from_quantized(qi, idx, vbs, out_rows=rows, out_len=128)


def test_render_and_signature():
    cfg = wgmma.config(consumers=2, pingpong=True, k_stages=3, v_stages=2)
    src = nv.render_cuda(Q8, cfg, SM90)
    assert src.template == wgmma.QUANT_TEMPLATE
    assert '#include "tilegen/cuda/sm90/lut_attention_8bit.cuh"' in src.text
    assert "asm" not in src.text
    name = wgmma.kernel_name(Q8, cfg)
    assert "_int8_fp8_" in name and name != wgmma.kernel_name(Spec(), cfg)
    assert _signature(src.text, name) == [n for n, _ in wgmma.QUANT_KERNEL_SIGNATURE]
    values = {n: 1 for n, kind in wgmma.QUANT_KERNEL_SIGNATURE if kind != "ptr"}
    args = wgmma.kernel_args(values, quant=True)
    assert [a[0] for a in args] == [n for n, _ in wgmma.QUANT_KERNEL_SIGNATURE]
    # Q buffers 16-bit (O staged there), K and V tiles of bytes, 256 B of key scales a K stage
    opts = wgmma.options_of(cfg)
    # each consumer's slice rounded up to 1024 B: the second consumer's tiles start on a
    # swizzle atom (unaligned, its TMA boxes and descriptors disagree: its cubes came out wrong
    # on the H200 in session 18 while the first consumer's were right)
    per = -(-(16384 + (3 + 2) * 8192 + 3 * 256) // 1024) * 1024
    assert per % 1024 == 0 and per > 16384 + 5 * 8192 + 3 * 256
    assert nv.cuda_traits(Q8, cfg, SM90)["smem_bytes"] == 2 * per + 1024 == \
        wgmma.smem_bytes(opts, 128, True)


def test_byte_maps():
    g = byte_geometry(40 * 128, 2 * 640, (128, 64), 128)
    assert g.dims == (5120, 1280) and g.row_stride_bytes == 5120 and g.elem_bytes == 1
    assert byte_geometry(640, 80 * 128, (32, 128), 32).swizzle_bytes == 32
    with pytest.raises(ValueError, match="wider than the 32-byte swizzle"):
        byte_geometry(640, 128, (64, 128), 32)


@needs_nvcc
@pytest.mark.parametrize("opts", [
    wgmma.QUANT_DEFAULTS,  # one consumer, 128-key tiles
    {"consumers": 1, "k_stages": 3, "v_stages": 2},  # 64-key tiles
    {"consumers": 2, "pingpong": True, "k_stages": 2, "v_stages": 2},
    {"consumers": 2, "persistent": True, "k_stages": 3, "v_stages": 2},
    {"consumers": 3, "k_stages": 3, "v_stages": 2},
    {"kv_tile": 128, "consumers": 2, "k_stages": 2, "v_stages": 1}])
def test_the_8bit_kernel_compiles_to_igmma_and_qgmma(opts):
    cfg = wgmma.config(**opts)
    art = nv.compile_cuda(nv.render_cuda(Q8, cfg, SM90), SM90)
    log = _ptxas_log(art)
    # wgmma kept asynchronous, and no warpgroup.arrive injected around an MMA (C7519)
    assert not _SERIALIZED.search(log), log
    assert art.spill_bytes <= known_spills.allowed("sm_90", art.path.name), log
    assert art.registers == wgmma.registers_at_entry(wgmma.options_of(cfg), SM90)
    assert art.shared_bytes <= SM90.max_shared_bytes
    sass = subprocess.run([str(CUOBJDUMP), "-sass", str(art.path)], capture_output=True,
                          text=True, check=True).stdout
    t = nv.cuda_traits(Q8, cfg, SM90)
    s_cols, o_cols = t["kv_tile"], 128 // t["pv_parts"]  # S: a tile's keys; P V: O's part
    assert len(re.findall(rf"\bIGMMA\.64x{s_cols}x32\.S8\.S8", sass)) == \
        art.matrix_ops["IGMMA"] > 0
    assert len(re.findall(rf"\bQGMMA\.64x{o_cols}x32\.F32\.E4M3\.E4M3", sass)) == \
        art.matrix_ops["QGMMA"] > 0
    assert "HGMMA" not in art.matrix_ops
    assert "USETMAXREG" in sass and "UBLKCP" in sass  # the key scales' bulk copies


HOST_TABLES = r"""
#include <cstdio>
#include "tilegen/cuda/sm90/lut_attention_8bit.cuh"
struct Wide {  // 128-key tiles
  using Elem = tilegen::Bf16;
  static constexpr bool kBshd = true, kPingPong = false, kStoreLse = true, kStoreMaxProb = false;
  static constexpr int kHeadDim = 128, kBlock = 64, kConsumers = 1, kKStages = 2, kVStages = 2;
  static constexpr int kQBuffers = 1, kConsumerRegs = 232, kProducerRegs = 24, kPvParts = 2;
  static constexpr int kKvTile = 128;
  static constexpr bool kBulkKv = false;
};
int main() {
  using W = tilegen::sm90::QuantTraits<Wide>;
  for (int n = -1; n <= 7; ++n) {
    printf("tiles %d %d\n", n, W::tiles(n));
    for (int j = 0; j < W::tiles(n); ++j) printf("halves %d %d\n", 16 * n + j, W::halves(n, j));
  }
  using M = tilegen::sm90::AttentionMma8<128, 64>;
  for (int kk = 0; kk < 32; ++kk) printf("slot %d %d\n", kk, M::key_of_slot(kk));
  for (int t = 0; t < 4; ++t)
    printf("qk %d %llu\n", t, (unsigned long long)M::qk_descriptor(M::word(4096), t));
  for (int t = 0; t < 2; ++t)
    printf("pv %d %llu\n", t, (unsigned long long)M::pv_descriptor(M::word(8192), t));
  return 0;
}
"""


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    if not _have_nvcc():
        pytest.skip("nvcc not found: the tables come from the kernel's own headers")
    tmp = tmp_path_factory.mktemp("host-tables-8bit")
    (tmp / "t.cu").write_text(HOST_TABLES)
    subprocess.run([str(nv.find_nvcc()), "-std=c++17", "-I", str(nv.include_dir()), "-o",
                    str(tmp / "t"), str(tmp / "t.cu")], check=True, capture_output=True,
                   timeout=300)
    out: dict = {"slot": {}, "qk": {}, "pv": {}, "tiles": {}, "halves": {}}
    for line in subprocess.run([str(tmp / "t")], check=True, capture_output=True, text=True,
                               timeout=60).stdout.splitlines():
        kind, a, b = line.split()
        out[kind][int(a)] = int(b)
    return out


@needs_nvcc
def test_128_key_tiles_take_the_plan_tiles_in_pairs(tables):
    """A 128-key tile is two of the plan's 64-key tiles (four 32-key halves); an odd count's
    last tile has two halves (the producer loads the first half's rows again for the other two,
    the consumer masks them); a bad row (-1) and an empty one (0) stay as they are."""
    for n, tiles in tables["tiles"].items():
        assert tiles == (n if n <= 0 else (n + 1) // 2), n
        for j in range(max(tiles, 0)):
            want = 2 if (n % 2 and j == tiles - 1) else 4
            assert tables["halves"][16 * n + j] == want, (n, j)


def _decode(desc: int) -> tuple[int, int, int, int]:
    """(layout type, start, leading, stride) of a wgmma descriptor."""
    return (desc >> 62, (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4,
            ((desc >> 32) & 0x3FFF) << 4)


@needs_nvcc
def test_descriptors_and_slot_order_are_the_headers(tables):
    """The header's slot order is the pre-pass's; Q8/K8 steps walk 32 bytes along 128-byte
    swizzled lines (layout 1, 8-row groups 1024 B apart), V^T steps take one 32-byte-swizzled
    half each (layout 3, 8-row groups 256 B apart): the values Triton 3.6 emits for the same
    tiles in the Gluon 8-bit kernel."""
    assert [tables["slot"][kk] for kk in range(32)] == quant.vt_slot_keys()
    assert [_decode(tables["qk"][t]) for t in range(4)] == [(1, 4096 + 32 * t, 0, 1024)
                                                            for t in range(4)]
    assert [_decode(tables["pv"][t]) for t in range(2)] == [(3, 8192 + 4096 * t, 0, 256)
                                                            for t in range(2)]


def _a8_layout() -> tuple[np.ndarray, np.ndarray]:
    """(row, k) of byte b of A register j, per thread, of an m64nNk32 wgmma with 8-bit A in
    registers (PTX ISA): each register is 8 rows x 16 bytes shared by a warp, 4 bytes a thread;
    registers 0, 1 rows r, r + 8 at k 0..15, registers 2, 3 the same rows at k 16..31."""
    t = np.arange(128)[:, None, None]
    j = np.arange(4)[None, :, None]
    b = np.arange(4)[None, None, :]
    row = 16 * (t // 32) + (t % 32) // 4 + 8 * (j % 2)
    k = 4 * ((t % 32) % 4) + 16 * (j // 2) + b
    return np.broadcast_to(row, (128, 4, 4)), np.broadcast_to(k, (128, 4, 4))


def test_p_fragment_times_slot_ordered_vt_is_pv():
    """The kernel's register order (QuantSoftmax::step: register 4t + 2hi + h of k-step t packs
    S's groups 4t + 2hi and 4t + 2hi + 1 of row half h, two columns each) placed by the PTX
    8-bit A layout, times V^T with its keys in slot order, is P V: no data moves in the kernel."""
    rng = np.random.default_rng(0)
    p = rng.random((64, 64))
    v = rng.standard_normal((64, 128))
    s_row, s_col = _acc_layout(64)  # S's fragment: (128 threads, 32 values)
    frag = p[s_row, s_col]
    a_row, a_k = _a8_layout()
    slots = quant.vt_slot_keys()
    out = np.zeros((64, 128))
    for t in range(2):  # k-steps: V^T halves of 32 keys
        a = np.full((64, 32), np.nan)
        regs = np.zeros((128, 4, 4))
        for hi in range(2):
            for h in range(2):
                g = 4 * t + 2 * hi
                regs[:, 2 * hi + h] = np.stack([frag[:, 4 * g + 2 * h], frag[:, 4 * g + 2 * h + 1],
                                                frag[:, 4 * g + 4 + 2 * h],
                                                frag[:, 4 * g + 5 + 2 * h]], axis=-1)
        a[a_row, a_k] = regs
        assert not np.isnan(a).any()
        vt_half = v[32 * t:32 * t + 32][slots]  # (slot, d): V^T's columns in slot order
        out += a @ vt_half
    np.testing.assert_allclose(out, p @ v, rtol=1e-12, atol=1e-12)


def test_vt_slots_round_trip_and_rules():
    q = torch.randn(1, 128, 2, 128, dtype=torch.bfloat16)
    vbs = torch.tensor([64, 40], dtype=torch.int32)
    plain = quant.quantize(q, q, q, vbs, "int8_fp8")
    slotted = quant.quantize(q, q, q, vbs, "int8_fp8", vt_slots=True)
    assert slotted.vt_slots and not plain.vt_slots
    assert torch.equal(quant.vt_natural(slotted).view(torch.uint8), plain.v8t.view(torch.uint8))
    keys = torch.tensor(quant.vt_slot_keys())
    assert torch.equal(slotted.v8t.view(torch.uint8)[..., 32 + 5],
                       plain.v8t.view(torch.uint8)[..., 32 + int(keys[5])])
    both = quant.quantize(q, q, q, vbs, "int8_fp8", vt_tiles=True, vt_slots=True)
    assert torch.equal(both.v8t.view(torch.uint8), quant.vt_to_tiles(slotted.v8t).view(torch.uint8))
    assert torch.equal(quant.vt_natural(both).view(torch.uint8), plain.v8t.view(torch.uint8))
    with pytest.raises(ValueError, match="vt_slots"):
        quant.quantize(q, q, q, vbs, "int8", vt_slots=True)


RING_LAYOUT = r"""
#include <cstdio>
#include "tilegen/cuda/sm90/lut_attention_8bit.cuh"
template <int kC, int kQ, int kK, int kV, int kKv>
struct Cfg {
  using Elem = tilegen::Bf16;
  static constexpr bool kBshd = true;
  static constexpr int kHeadDim = 128;
  static constexpr int kBlock = 64;
  static constexpr int kConsumers = kC;
  static constexpr int kKStages = kK;
  static constexpr int kVStages = kV;
  static constexpr int kQBuffers = kQ;
  static constexpr bool kPingPong = kC == 2 && kKv == 64;
  static constexpr bool kStoreLse = true;
  static constexpr bool kStoreMaxProb = false;
  static constexpr int kConsumerRegs = 240;
  static constexpr int kProducerRegs = 24;
  static constexpr int kPvParts = kKv == 128 || kC == 3 ? 2 : 1;  // (ping-pong: whole)
  static constexpr int kKvTile = kKv;
  static constexpr bool kBulkKv = false;
};
// every tile of every consumer, from a 1024-aligned base: kind, address, the dynamic bytes, the
// tile's bytes
template <class T, class Ring>
void rings(const char* name) {
  for (int c = 0; c < T::kConsumers; ++c) {
    const Ring r = Ring::of(0, 0, c);
    for (int b = 0; b < T::kQBuffers; ++b)
      printf("%s q %u %d %d\n", name, r.q_tile(b), T::kSmemBytes, T::kQBytes);
    for (int s = 0; s < T::kKStages; ++s)
      printf("%s k %u %d %d\n", name, r.k_tile(s), T::kSmemBytes, T::kTileBytes);
    for (int s = 0; s < T::kVStages; ++s)
      printf("%s v %u %d %d\n", name, r.v_tile(s), T::kSmemBytes, T::kTileBytes);
  }
}
template <int kC, int kQ, int kK, int kV, int kKv = 64>
void both() {
  using Q = tilegen::sm90::QuantTraits<Cfg<kC, kQ, kK, kV, kKv>>;
  rings<Q, tilegen::sm90::ConsumerRing<Q>>("8bit");
  if constexpr (kKv == 64) {
    using W = tilegen::sm90::WgmmaTraits<Cfg<kC, kQ, kK, kV, kKv>>;
    rings<W, tilegen::sm90::ConsumerRing<W>>("16bit");
  }
}
int main() {
  both<1, 1, 2, 2>(); both<1, 1, 3, 2>(); both<2, 1, 2, 2>(); both<2, 1, 3, 3>();
  both<2, 2, 3, 2>(); both<2, 1, 4, 4>(); both<1, 2, 5, 3>(); both<3, 1, 2, 1>();
  both<3, 1, 3, 2>(); both<1, 1, 3, 2, 128>(); both<2, 1, 2, 1, 128>(); both<1, 2, 2, 2, 128>();
  return 0;
}
"""


@needs_nvcc
def test_every_tile_starts_on_its_swizzle_atom(tmp_path):
    """Each ring's tiles, for every consumer, start where TMA's and wgmma's swizzles agree:
    Q, K and the 16-bit V tiles on 1024 bytes (the 128-byte swizzle's atom), the 8-bit V^T on 256
    (the 32-byte swizzle's), all inside the dynamic shared memory (less the 1024 bytes the base
    may be moved by). The first 8-bit H200 run broke this for its second consumer."""
    (tmp_path / "r.cu").write_text(RING_LAYOUT)
    subprocess.run([str(nv.find_nvcc()), "-std=c++17", "-I", str(nv.include_dir()), "-o",
                    str(tmp_path / "r"), str(tmp_path / "r.cu")], check=True,
                   capture_output=True, timeout=300)
    out = subprocess.run([str(tmp_path / "r")], check=True, capture_output=True, text=True,
                         timeout=60).stdout.splitlines()
    assert len(out) > 100
    for line in out:
        kernel, kind, addr, smem, tile = line.split()
        atom = 256 if (kernel, kind) == ("8bit", "v") else 1024
        assert int(addr) % atom == 0, line
        assert int(tile) in (64 * 128 * 2, 128 * 128) or kernel == "8bit" and kind != "q", line
        assert int(addr) + int(tile) <= int(smem) - 1024, line


def test_pre_quantized_inputs_with_per_key_scales_are_refused():
    """The CUDA 8-bit kernel reads one K scale a 32-key half (`quant.K_SCALE_GROUP`, session 21):
    `from_quantized` refuses inputs whose scales were made another way (``k_scale_group`` 1, the
    default of a hand-made `QuantizedInputs`), by name, before any launch; the pre-pass's own
    output records its group."""
    import dataclasses

    from tilegen import quant

    op = tilegen.load(Q8, target="sm_90")
    q = torch.randn(1, 128, 1, 128).to(torch.bfloat16)
    vbs = torch.full((2,), 64, dtype=torch.int32)
    qi = op.quantize(q, q, q, vbs)
    assert qi.k_scale_group == quant.K_SCALE_GROUP == 32 and qi.vt_slots
    idx = torch.zeros(1, 1, 2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="one K scale a 32-key half"):
        op.from_quantized(dataclasses.replace(qi, k_scale_group=1), idx, vbs)


def test_kv_copies_is_named_only_when_bulk():
    """``kv_copies`` (session 28): "tma" (the boxes) is the default and leaves every config's
    name as it was, so shipped winners keep their keys; "bulk" is named, builds the bulk copies
    (traits), and is refused for the 16-bit kernel and for an unknown value, with the reason."""
    plain = wgmma.config(**wgmma.QUANT_DEFAULTS)
    assert "kv_copies" not in plain.name
    assert wgmma.config(**wgmma.QUANT_DEFAULTS, kv_copies="tma") == plain
    bulk = wgmma.config(**wgmma.QUANT_DEFAULTS, kv_copies="bulk")
    assert "kv_copiesbulk" in bulk.name
    assert nv.cuda_traits(Q8, bulk, SM90)["bulk_kv"] and \
        not nv.cuda_traits(Q8, plain, SM90)["bulk_kv"]
    assert "16-bit kernel" in " ".join(wgmma.violations(Spec(), wgmma.config(kv_copies="bulk"),
                                                        SM90))
    assert "kv_copies='dma'" in " ".join(
        wgmma.violations(Q8.kernel_spec, wgmma.config(kv_copies="dma"), SM90))
    # the search space may search it; its points name it only where it is not "tma"
    from tilegen.tune.space import SearchSpace

    space = SearchSpace.from_target(Q8, SM90, {"kv_copies": ("tma", "bulk")}, backend="cuda")
    names = [c.name for c in space.feasible()]
    assert len(names) == 2 * sum("kv_copies" not in n for n in names) > 0
    assert all(space.contains(c) for c in space.feasible())


def test_bulk_copies_read_tiles_and_refuse_other_layouts():
    """With ``kv_copies="bulk"`` the op's pre-pass writes K8 and V^T as tiles (`quant.k_to_tiles`,
    tiles of the slotted V^T); inputs quantized for the boxes are refused by name before any
    launch, and the boxes' config refuses the tiles."""
    ops = {c: tilegen.load(Q8, wgmma.config(**wgmma.QUANT_DEFAULTS, kv_copies=c),
                           backend="cuda", target="sm_90") for c in ("tma", "bulk")}
    q = torch.randn(1, 128, 1, 128).to(torch.bfloat16)
    vbs = torch.full((2,), 64, dtype=torch.int32)
    idx = torch.zeros(1, 1, 2, 1, dtype=torch.int32)
    tiles = ops["bulk"].quantize(q, q, q, vbs)
    boxes = ops["tma"].quantize(q, q, q, vbs)
    assert tiles.k_tiles and tiles.vt_tiles and tiles.vt_slots
    assert not boxes.k_tiles and not boxes.vt_tiles and boxes.vt_slots
    assert tiles.k8.shape == (1, 1, 4, 32, 128) and tiles.v8t.shape == (1, 1, 4, 128, 32)
    with pytest.raises(ValueError, match="k_tiles=True"):
        ops["bulk"].from_quantized(boxes, idx, vbs)
    with pytest.raises(ValueError, match="k_tiles=False"):
        ops["tma"].from_quantized(tiles, idx, vbs)
    import dataclasses

    cut = dataclasses.replace(tiles, v8t=tiles.v8t[:, :, :3])  # bytes the copies would overrun
    with pytest.raises(ValueError, match="contiguous tiles of shape"):
        ops["bulk"].from_quantized(cut, idx, vbs)


@needs_nvcc
def test_bulk_copies_compile_without_k_and_v_tensor_loads():
    """The bulk copies' build: the same MMAs as the boxes', K8 and V^T by UBLKCP (no tensor
    load but Q's), no spill."""
    counts = {}
    for copies in ("tma", "bulk"):
        cfg = wgmma.config(**wgmma.QUANT_DEFAULTS, kv_copies=copies)
        art = nv.compile_cuda(nv.render_cuda(Q8, cfg, SM90), SM90)
        assert art.spill_bytes == 0
        sass = subprocess.run([str(CUOBJDUMP), "-sass", str(art.path)], capture_output=True,
                              text=True, check=True).stdout
        counts[copies] = (art.matrix_ops, len(re.findall(r"\bUTMALDG\b", sass)),
                          len(re.findall(r"\bUBLKCP\b", sass)))
    (mma_t, tensor_t, bulk_t), (mma_b, tensor_b, bulk_b) = counts["tma"], counts["bulk"]
    assert mma_t == mma_b
    assert tensor_b < tensor_t and bulk_b > bulk_t


def test_q_in_kernel_is_named_only_when_set_and_is_the_same_kernel():
    """``q_in_kernel`` (session 30): the op passes the 16-bit q and each consumer quantizes its
    cube. Off is the default and leaves every name as it was; on is named, refused for the
    16-bit kernel and for a non-bool, and renders the same kernel text but for its name (the
    choice is the kernel's runtime argument, so `from_quantized` runs Q8 through the same
    build)."""
    plain = wgmma.config(**wgmma.QUANT_DEFAULTS)
    assert "q_in_kernel" not in plain.name
    assert wgmma.config(**wgmma.QUANT_DEFAULTS, q_in_kernel=False) == plain
    inside = wgmma.config(**wgmma.QUANT_DEFAULTS, q_in_kernel=True)
    assert "q_in_kernel" in inside.name
    assert not wgmma.violations(Q8.kernel_spec, inside, SM90)
    texts = [nv.render_cuda(Q8, c, SM90).text.replace(c.name, "CFG") for c in (plain, inside)]
    assert texts[0] == texts[1]
    assert "16-bit kernel reads q" in " ".join(
        wgmma.violations(Spec(), wgmma.config(q_in_kernel=True), SM90))
    assert "q_in_kernel=1" in " ".join(
        wgmma.violations(Q8.kernel_spec, wgmma.config(**wgmma.QUANT_DEFAULTS, q_in_kernel=1),
                         SM90))
    # the kernel's last two arguments: K's mean (lse's q.k̄ term, added in the kernel) and the
    # flag; the template declares them in that order
    assert wgmma.QUANT_KERNEL_SIGNATURE[-2:] == (("k_mean", "ptr"), ("q_in_kernel", "i32"))
    text = texts[0]
    assert text.index("const float* __restrict__ k_mean") < text.index("int q_in_kernel)")


def test_p_exp_and_row_sum_are_named_only_when_set_and_refused_where_they_cannot_build():
    """``row_sum`` ("fadd" | "mma") and ``p_exp`` ("ex2" | "linear"), session 32: the defaults
    leave every name as it was (so shipped winners keep their keys); set, they are named and
    reach the template's traits; "linear" takes the MMA row sum; neither is the 16-bit
    kernel's; unknown values are refused with the choices."""
    plain = wgmma.config(**wgmma.QUANT_DEFAULTS)
    assert wgmma.config(**wgmma.QUANT_DEFAULTS, p_exp="ex2", row_sum="fadd") == plain
    assert "p_exp" not in plain.name and "row_sum" not in plain.name
    linear = wgmma.config(**wgmma.QUANT_DEFAULTS, p_exp="linear", row_sum="mma")
    assert "p_explinear" in linear.name and "row_summma" in linear.name
    assert not wgmma.violations(Q8.kernel_spec, linear, SM90)
    traits = nv.cuda_traits(Q8, linear, SM90)
    assert traits["linear_p"] and traits["mma_row_sum"]
    assert not any(nv.cuda_traits(Q8, plain, SM90)[k] for k in ("linear_p", "mma_row_sum"))
    text = nv.render_cuda(Q8, linear, SM90).text
    assert "kLinearP = true" in text and "kMmaRowSum = true" in text

    def problems(spec, **knobs):
        return " ".join(wgmma.violations(spec, wgmma.config(**knobs), SM90))

    assert "takes row_sum 'mma'" in problems(Q8.kernel_spec, **wgmma.QUANT_DEFAULTS,
                                             p_exp="linear")
    assert "16-bit" in problems(Spec(), p_exp="linear", row_sum="mma")
    assert "16-bit" in problems(Spec(), row_sum="mma")
    assert "one of ['ex2', 'linear']" in problems(Q8.kernel_spec, **wgmma.QUANT_DEFAULTS,
                                                  p_exp="poly")
    assert "one of ['fadd', 'mma']" in problems(Q8.kernel_spec, **wgmma.QUANT_DEFAULTS,
                                                row_sum="tree")


@needs_nvcc
def test_linear_p_compiles_without_an_exponential_a_score():
    """The three softmax builds at the 8-bit defaults: none spills; the MMA row sum adds m64n8
    QGMMAs and drops the scores' FADDs; the linear P drops MUFU.EX2 to the few that rescale O
    (two a tile, not one a score), rounds and clamps its codes two at a time in f16 (HMNMX2)
    and takes the row max on S with DPX three-way maxima (VIMNMX3), so fewer FMNMX."""
    counts = {}
    for knobs in ({}, {"row_sum": "mma"}, {"p_exp": "linear", "row_sum": "mma"}):
        cfg = wgmma.config(**wgmma.QUANT_DEFAULTS, **knobs)
        art = nv.compile_cuda(nv.render_cuda(Q8, cfg, SM90), SM90)
        assert art.spill_bytes == 0, knobs
        sass = subprocess.run([str(CUOBJDUMP), "-sass", str(art.path)], capture_output=True,
                              text=True, check=True).stdout
        counts[knobs.get("p_exp", "ex2"), knobs.get("row_sum", "fadd")] = {
            op: len(re.findall(rf"\b{op}\b", sass))
            for op in ("MUFU.EX2", "FADD", "FMNMX", "HMNMX2", "VIMNMX3",
                       "QGMMA.64x8x32.F32.E4M3.E4M3")}
    base, rowsum, linear = (counts[k] for k in (("ex2", "fadd"), ("ex2", "mma"),
                                                ("linear", "mma")))
    assert base["QGMMA.64x8x32.F32.E4M3.E4M3"] == 0 < rowsum["QGMMA.64x8x32.F32.E4M3.E4M3"]
    assert rowsum["FADD"] < base["FADD"] / 4
    assert linear["MUFU.EX2"] < base["MUFU.EX2"] / 4
    assert base["HMNMX2"] == base["VIMNMX3"] == 0 < linear["HMNMX2"] and linear["VIMNMX3"] > 0
    assert linear["FMNMX"] < base["FMNMX"]


@needs_nvcc
def test_the_shipped_8bit_winners_keep_their_mmas_asynchronous(monkeypatch):
    """ptxas makes every GMMA of a kernel synchronous (a DEPBAR after each) when it finds one
    register hazard inside a pipeline stage, and says so only in its log (C7513 / C7514:
    session 33's S-ahead probe, bench/NOTES.md): each shipped CUDA 8-bit winner, H200 and
    H100, TOPK 78 and 31, builds without such a note and without spills."""
    from tilegen import winners
    from tilegen.paths import ROOT

    monkeypatch.setattr(winners, "SHIPPED_DIR", ROOT / "tuning_db")
    built = set()
    for topk in (78, 31):
        for device in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
            w = winners.find_winner(Q8.replace(topk=topk), SM90, backend="cuda",
                                    device_name=device)
            assert w.hit, (topk, device)
            if w.config.name in built:
                continue
            built.add(w.config.name)
            art = nv.compile_cuda(nv.render_cuda(Q8, w.config, SM90), SM90)
            log = _ptxas_log(art)
            assert not _SERIALIZED.search(log), (w.config.name, log)
            assert art.spill_bytes == 0, w.config.name
    assert len(built) == 3  # H200's; H100's at TOPK 78 and at 31


def test_q_in_kernel_quantizes_with_the_prepass_arithmetic():
    """The consumer's quantization of Q (quantize_q) names the pre-pass's instructions, so its
    Q8 and scales are the pre-pass's bit for bit (checked on the GPU by
    bench/experiments/gpu_s30_check.py): amax / 127 by div.full.f32 (what Triton's `/`
    lowers to in `quant._int8_per_token`), one IEEE reciprocal, the clamp, then round to
    nearest even."""
    header = (nv.include_dir() / "tilegen/cuda/sm90/lut_attention_8bit.cuh").read_text()
    body = header[header.index("void quantize_q("):header.index("void smoothing_terms(")]
    for needle in ("div.full.f32", "rcp.rn.f32", "fminf(fmaxf(", "cvt.rni.s32.f32"):
        assert needle in body, needle
    import inspect

    from tilegen import quant

    src = inspect.getsource(quant._int8_per_token.fn)
    assert "/ 127.0" in src and "div_rn(1.0" in src and "_round_half_even" in src


def test_pre_quantized_inputs_with_a_wrong_k_mean_are_refused():
    """The kernel reads K's mean itself (lse's q.k̄ term), 16 bytes at a time: inputs whose
    k_mean is not (B, H, D) are refused by name before any launch."""
    import dataclasses

    op = tilegen.load(Q8, wgmma.config(**wgmma.QUANT_DEFAULTS), backend="cuda", target="sm_90")
    q = torch.randn(1, 128, 1, 128).to(torch.bfloat16)
    vbs = torch.full((2,), 64, dtype=torch.int32)
    idx = torch.zeros(1, 1, 2, 1, dtype=torch.int32)
    qi = op.quantize(q, q, q, vbs)
    with pytest.raises(ValueError, match=r"k_mean must be \(1, 1, 128\)"):
        op.from_quantized(dataclasses.replace(qi, k_mean=qi.k_mean[..., :64]), idx, vbs)


def test_schedule_is_named_only_when_dynamic_and_refused_where_it_cannot_run():
    """``schedule`` ("static" | "dynamic"), session 35: "static" leaves every name and source as
    it was; "dynamic" is named, takes a persistent 8-bit grid without ping-pong, adds the work
    counter as the kernel's last parameter (the launcher refuses to launch without one), and
    its queue's barriers count in the static shared memory."""
    persistent = {**wgmma.QUANT_DEFAULTS, "k_stages": 2, "v_stages": 2, "persistent": True}
    static = wgmma.config(**persistent)
    assert wgmma.config(**persistent, schedule="static") == static
    assert "schedule" not in static.name
    dynamic = wgmma.config(**persistent, schedule="dynamic")
    assert "scheduledynamic" in dynamic.name
    assert not wgmma.violations(Q8.kernel_spec, dynamic, SM90)
    assert nv.cuda_traits(Q8, dynamic, SM90)["schedule"] == "dynamic"
    static_text = nv.render_cuda(Q8, static, SM90).text
    text = nv.render_cuda(Q8, dynamic, SM90).text
    assert "kDynamicSchedule = false" in static_text
    assert "args.work_counter = nullptr;" in static_text
    assert "kDynamicSchedule = true" in text and "args.work_counter = work_counter;" in text
    names = [n for n, _ in wgmma.QUANT_KERNEL_SIGNATURE]
    assert _signature(static_text, wgmma.kernel_name(Q8, static)) == names
    assert _signature(text, wgmma.kernel_name(Q8, dynamic)) == names + ["work_counter"]
    assert (wgmma.static_smem_bytes(wgmma.options_of(dynamic))
            > wgmma.static_smem_bytes(wgmma.options_of(static)))

    values = {name: 1 for name, _ in wgmma.QUANT_KERNEL_SIGNATURE}
    assert [n for n, _, _ in wgmma.kernel_args(values, quant=True)] == \
        [n for n, _ in wgmma.QUANT_KERNEL_SIGNATURE]
    with pytest.raises(ValueError, match="work counter"):
        wgmma.kernel_args(values, quant=True, dynamic=True)
    args = wgmma.kernel_args({**values, "work_counter": 7}, quant=True, dynamic=True)
    assert args[-1] == ("work_counter", "ptr", 7)

    def problems(spec, **knobs):
        return " ".join(wgmma.violations(spec, wgmma.config(**knobs), SM90))

    assert "needs persistent true" in problems(Q8.kernel_spec, **wgmma.QUANT_DEFAULTS,
                                               schedule="dynamic")
    assert "8-bit kernel" in problems(Spec(), persistent=True, schedule="dynamic")
    assert "ping-pong" in problems(Q8.kernel_spec, **{**wgmma.QUANT_DEFAULTS, "consumers": 2,
                                                      "kv_tile": 64, "persistent": True,
                                                      "pingpong": True}, schedule="dynamic")
    assert "one of ['static', 'dynamic']" in problems(Q8.kernel_spec, **persistent,
                                                      schedule="greedy")


@needs_nvcc
def test_the_dynamic_schedule_compiles_without_spills_and_keeps_its_mmas_asynchronous():
    """The dynamic schedule's producer lane runs on 24 registers: an atomic there spilled ~400
    bytes (session 35), so the consumer claims the next cube and the lane only reads it from
    shared memory. One and two consumers a CTA build without spills, with every MMA kept
    asynchronous, and with two global atomics (the first claim, and the loop's, a cube
    ahead)."""
    for knobs in ({"v_stages": 2}, {"consumers": 2, "v_stages": 1}):
        cfg = wgmma.config(**{**wgmma.QUANT_DEFAULTS, "k_stages": 2, "kv_copies": "bulk",
                              "q_in_kernel": True, "p_exp": "linear", "row_sum": "mma",
                              "persistent": True, "schedule": "dynamic", **knobs})
        art = nv.compile_cuda(nv.render_cuda(Q8, cfg, SM90), SM90)
        assert art.spill_bytes == 0, knobs
        assert not _SERIALIZED.search(_ptxas_log(art)), knobs
        sass = subprocess.run([str(CUOBJDUMP), "-sass", str(art.path)], capture_output=True,
                              text=True, check=True).stdout
        assert len(re.findall(r"\bATOMG\.E\.ADD", sass)) == 2, knobs
