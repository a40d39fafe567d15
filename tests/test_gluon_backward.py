"""The Gluon backward (issue #18) where the CPU can check it: the dQ pass's plan against the
inverse map, the config's rules, the refusal off the GPU, and the sm_90a build (wgmma count,
registers, no spills in the streaming loop). The kernels' gradients are scored on the GPU by
bench/experiments/h200_gluon_backward.py (Gluon kernels do not run under the interpreter)."""

import os
import subprocess
import sys

import pytest
import torch

import tilegen
from tilegen import KernelConfig, Spec
from tilegen.backends.gluon.backward import dq_plan, slots_of_order
from tilegen.backends.triton.backward import BackwardConfig, backward_maps, inverse_map


def _lut(seed, B=2, H=3, NQ=7, NKV=9, TOPK=4):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(NKV, generator=g)[:TOPK]
                       for _ in range(B * H * NQ)]).view(B, H, NQ, TOPK).to(torch.int32)
    counts = torch.randint(0, TOPK + 1, (B, H, NQ), generator=g, dtype=torch.int32)
    vbs = torch.randint(1, 65, (NKV,), generator=g, dtype=torch.int32)
    return idx, counts, vbs, NKV


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dq_plan_points_every_entry_at_its_pair(seed):
    idx, counts, vbs, nkv = _lut(seed)
    B, H, NQ, TOPK = idx.shape
    offsets, qcubes, order = inverse_map(idx, counts, nkv, return_order=True)
    pos, meta = dq_plan(idx, counts, vbs, nkv, slots_of_order(order))
    pos = pos // 8  # unpacked: the slot, first row 0
    assert pos.shape == idx.shape and meta.shape == (B * H * NQ,)
    assert torch.equal(meta, counts.reshape(-1))  # no bad value here
    for b in range(B):
        for h in range(H):
            bh = b * H + h
            for q in range(NQ):
                for s in range(int(counts[b, h, q])):
                    p = int(pos[b, h, q, s])
                    kv = int(idx[b, h, q, s])
                    first, last = int(offsets[bh * nkv + kv]), int(offsets[bh * nkv + kv + 1])
                    # the slot lies in the pair's CSR segment and names the query cube
                    assert first <= p < last
                    assert int(qcubes[p]) == q
    # every slot of the map is the pair of exactly one real entry
    real = torch.arange(TOPK)[None, None, None, :] < counts[..., None]
    used = pos[real].sort().values
    assert torch.equal(used, torch.arange(int(offsets[-1]), dtype=used.dtype))


def test_dq_plan_marks_rows_with_bad_values():
    idx, counts, vbs, nkv = _lut(3)
    counts[:] = idx.shape[3]
    idx[0, 0, 1, 2] = nkv  # index out of range
    idx[0, 1, 2, 0] = -1
    vbs[int(idx[1, 2, 3, 1])] = 0  # a chosen cube with vbs 0: every row that chose it
    counts[1, 0, 4] = idx.shape[3] + 1  # count past TOPK
    _offsets, _qcubes, order = inverse_map(idx, counts, nkv, return_order=True)
    _pos, meta = dq_plan(idx, counts, vbs, nkv, slots_of_order(order))
    meta = meta.view(counts.shape)
    bad_cube = int(idx[1, 2, 3, 1])
    expect = (idx == bad_cube).any(-1)
    expect[0, 0, 1] = expect[0, 1, 2] = expect[1, 0, 4] = True
    assert torch.equal(meta < 0, expect)
    assert torch.equal(meta[~expect], counts[~expect])


def _lut_case(case):
    idx, counts, vbs, nkv = _lut(5, B=2, H=2, NQ=9, NKV=9, TOPK=5)
    vbs[:] = torch.tensor([64, 32, 16, 8, 64, 4, 48, 32, 16], dtype=torch.int32)
    if case == "bad":
        idx[0, 0, 1, 2] = nkv
        idx[1, 1, 3, 0] = -7
        vbs[int(idx[1, 0, 2, 1])] = 0
        counts[0, 1, 4] = 6
        counts[1, 0, 5] = -1
    elif case == "no_counts":
        counts = None
    elif case == "duplicates":
        idx[0, 1, 2, 3] = idx[0, 1, 2, 1]
        counts[0, 1, 2] = 5
    return idx, counts, vbs, nkv


@pytest.mark.parametrize("case", ["clean", "bad", "no_counts", "duplicates"])
def test_device_maps_equal_the_torch_models(case):
    """The GPU maps (maps.py: Triton kernels, here under the interpreter) are the torch models'
    tensors bit for bit: offsets, qcubes, the plan's pos and meta, with counts, bad values, no
    counts, and a row that names a cube twice."""
    from tilegen.backends.gluon.backward import slots_of_order
    from tilegen.backends.triton.maps import device_maps

    idx, counts, vbs, nkv = _lut_case(case)
    offsets, qcubes, order = inverse_map(idx, counts, nkv, return_order=True)
    pos, meta = dq_plan(idx, counts, vbs, nkv, slots_of_order(order))
    (g_offsets, g_qcubes), (g_pos, g_meta) = device_maps(idx, counts, vbs, nkv)
    assert torch.equal(g_offsets, offsets) and torch.equal(g_meta, meta)
    assert torch.equal(g_qcubes, qcubes)
    assert torch.equal(g_pos, pos)
    assert device_maps(idx, counts, vbs, nkv, with_plan=False)[1] is None


@pytest.mark.parametrize("gluon", [False, True])
@pytest.mark.parametrize("case", ["clean", "bad", "no_counts", "duplicates"])
def test_device_packed_maps_equal_the_torch_models(case, gluon):
    """The packed inverse map and its plan on the device (maps.py) against `pack_tiles`
    (`packed_inverse_map`) and `dq_plan` of its entry tiles, bit for bit, for the Triton
    kernel's classes (every size from 1 row, rounded up) and the Gluon kernel's (exact sizes of
    8 to 32 rows)."""
    from tilegen.backends.triton.backward import packed_inverse_map
    from tilegen.backends.triton.maps import device_maps

    idx, counts, vbs, nkv = _lut_case(case)
    min_rows = 8 if gluon else 1
    packed, slot, row = packed_inverse_map(idx, counts, vbs, nkv, 64, entry_tiles=True,
                                           min_rows=min_rows, exact=gluon)
    pos, meta = dq_plan(idx, counts, vbs, nkv, slot, 64, row if gluon else None)
    got, plan = device_maps(idx, counts, vbs, nkv, pack=True, min_rows=min_rows, exact=gluon,
                            with_plan=gluon)
    for name in ("offsets", "items", "tile_start", "tile_meta", "count", "min_rows", "exact"):
        assert torch.equal(torch.as_tensor(getattr(got, name)),
                           torch.as_tensor(getattr(packed, name))), name
    assert (plan is None) == (not gluon)
    if gluon:  # the plan's codes name 8-row granules: the Gluon classes only
        assert torch.equal(plan[0], pos) and torch.equal(plan[1], meta)


def test_maps_refuse_what_their_int32_codes_cannot_hold():
    """The packed classes are powers of two in 1..block; the plan's codes (tile * 8 + first row
    / 8) need classes of 8+ rows and 8 codes per entry in int32, the maps alone one index."""
    from tilegen.backends.triton.backward import packed_inverse_map
    from tilegen.backends.triton.maps import device_maps

    idx, counts, vbs, nkv = _lut_case("clean")
    for bad in (0, 12, 128):
        with pytest.raises(ValueError, match="power of two"):
            packed_inverse_map(idx, counts, vbs, nkv, 64, min_rows=bad)
        with pytest.raises(ValueError, match="power of two"):
            device_maps(idx, counts, vbs, nkv, pack=True, min_rows=bad, with_plan=False)
    with pytest.raises(ValueError, match="steps of 8"):
        device_maps(idx, counts, vbs, nkv, pack=True, min_rows=4)
    # shapes past the int32 codes, as views (nothing allocated before the check)
    huge = torch.zeros(1, 1, 1, 1, dtype=torch.int32).expand(1, 1, 2**14, 2**14 + 1)
    with pytest.raises(ValueError, match="int32"):
        device_maps(huge, None, vbs, nkv)  # 2**28 + 2**14 entries, 8 codes each
    huge = torch.zeros(1, 1, 1, 1, dtype=torch.int32).expand(1, 2, 2**15, 2**15)
    with pytest.raises(ValueError, match="int32"):
        device_maps(huge, None, vbs, nkv, with_plan=False)  # 2**31 entries


def test_packed_plan_points_every_entry_at_its_tile_column():
    """With dkdv_pack (the Gluon classes), each real entry's code names a tile of its KV cube's
    list that holds its query cube at that first row, and each tile's rows hold its items in
    order."""
    from tilegen.backends.triton.backward import packed_inverse_map

    idx, counts, vbs, nkv = _lut_case("clean")
    B, H, NQ, TOPK = idx.shape
    packed, slot, row = packed_inverse_map(idx, counts, vbs, nkv, 64, entry_tiles=True,
                                           min_rows=8, exact=True)
    pos, _meta = dq_plan(idx, counts, vbs, nkv, slot, 64, row)
    seen = 0
    for b in range(B):
        for h in range(H):
            bh = b * H + h
            for q in range(NQ):
                for s in range(int(counts[b, h, q])):
                    code = int(pos[b, h, q, s])
                    tile, first_row = code // 8, code % 8 * 8
                    owner = bh * nkv + int(idx[b, h, q, s])
                    o0 = int(packed.offsets[owner])
                    assert o0 <= tile < o0 + int(packed.count[owner])
                    meta = int(packed.tile_meta[tile])
                    lg, n = meta & 0xFF, meta >> 8
                    rows = int(vbs[q])
                    shared = rows in (8, 16, 32)  # exact classes share tiles, others own one
                    assert lg == (rows.bit_length() - 1 if shared else 6)
                    assert first_row % (1 << lg) == 0
                    k = first_row >> lg
                    assert k < n and int(packed.items[int(packed.tile_start[tile]) + k]) == q
                    seen += 1
    assert seen == int(counts.sum())


def test_backward_maps_build_the_plan_for_ds_store():
    idx, counts, vbs, nkv = _lut(4)
    maps = backward_maps(idx, counts, vbs, nkv, 64, BackwardConfig(gluon=True, ds_store=True))
    assert maps.dq_plan is not None
    assert backward_maps(idx, counts, vbs, nkv, 64, BackwardConfig(gluon=True)).dq_plan is None


def test_gluon_backward_config_rules():
    lut = Spec()
    assert BackwardConfig(gluon=True, ds_store=True).violations(lut) == []
    assert "needs gluon" in " ".join(BackwardConfig(ds_store=True).violations(lut))
    # the Gluon dK/dV kernel packs query tiles too; a spec without vbs has nothing to pack
    assert BackwardConfig(gluon=True, ds_store=True, dkdv_pack=True).violations(lut) == []
    assert "dkdv_pack" in " ".join(BackwardConfig(gluon=True, dkdv_pack=True).violations(
        Spec(variable_block_sizes=False)))
    assert "dq_atomic" in " ".join(BackwardConfig(gluon=True, dq_atomic=True).violations(lut))
    why = " ".join(BackwardConfig(gluon=True).violations(Spec(layout="bhsd")))
    assert "BSHD" in why
    why = " ".join(BackwardConfig(gluon=True).violations(Spec(encoding="sliding_tile")))
    assert "LUT" in why
    assert BackwardConfig(gluon=True, ds_store=True).name.endswith("_gluon2_ds3")


def test_gluon_backward_refuses_the_cpu(interpreter):
    spec = Spec(grid=(2, 4, 8), num_heads=1, head_dim=64, topk=1)
    op = tilegen.load(spec, KernelConfig(), target=None)
    op.backward_config = BackwardConfig(gluon=True)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 256, 1, 64, generator=g).to(torch.bfloat16).requires_grad_(True)
               for _ in range(3))
    idx = torch.zeros(1, 1, 4, 1, dtype=torch.int32)
    vbs = torch.full((4,), 64, dtype=torch.int32)
    o = op(q, k, v, idx, vbs, return_lse=False)
    with pytest.raises(ValueError, match="CUDA devices with wgmma"):
        o.backward(torch.ones_like(o))


def test_gluon_backward_builds_for_sm90a_with_wgmma():
    """The sm_90a build, in a process without the interpreter (as `tilegen build` compiles):
    the dK/dV kernel issues S^T and dP^T (8 k-steps each), dV and dK (4 each) as wgmma, the dQ
    kernel dQ and the row sums (4 each); no local memory, and in the dK/dV kernel only the few
    values ptxas parks around the partial-cube masking and the producer's staging of the row
    statistics (`stats_smem`: 8-9 spilled words, measured faster than 5-6 without it:
    bench/NOTES.md); shared memory for two CTAs per SM. The GQA source (`separate_kv`) builds
    the same way."""
    code = (
        "import subprocess, tempfile, triton\n"
        "from pathlib import Path\n"
        "from tilegen import Spec\n"
        "from tilegen.backends.gluon.backward import compile_offline\n"
        "from tilegen.cubin import cubin_matrix_ops, cubin_resources\n"
        "from tilegen.targets import get_target\n"
        "out = compile_offline(Spec(), get_target('sm_90'), {'ds_store': True})\n"
        "out['dkdv_pack'] = compile_offline(Spec(), get_target('sm_90'), {'ds_store': True,"
        " 'dkdv_pack': True})['dkdv']\n"
        "out['dq_dsum'] = compile_offline(Spec(), get_target('sm_90'), {'ds_store': True},"
        " has_dsum=True)['dq']\n"
        "gqa = compile_offline(Spec(), get_target('sm_90'), {'ds_store': True, 'dkdv_pack': True},"
        " separate_kv=True)\n"
        "out['dkdv_gqa'], out['dq_gqa'] = gqa['dkdv'], gqa['dq']\n"
        "cu = Path(triton.__file__).parent / 'backends/nvidia/bin/cuobjdump'\n"
        "d = Path(tempfile.mkdtemp())\n"
        "for k, ck in out.items():\n"
        "    p = d / f'{k}.cubin'; p.write_bytes(ck.asm['cubin'])\n"
        "    sass = subprocess.run([str(cu), '--dump-sass', str(p)], capture_output=True,"
        " text=True, check=True).stdout\n"
        "    print(k, cubin_matrix_ops(p)['HGMMA'], cubin_resources(p)['local_bytes'],"
        " sass.count('STL '), ck.metadata.shared)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, check=True).stdout.split("\n")
    got = {ln.split()[0]: [int(x) for x in ln.split()[1:]] for ln in lines if ln.strip()}
    assert set(got) == {"dkdv", "dq", "dq_dsum", "dkdv_pack", "dkdv_gqa", "dq_gqa"}
    # GQA (K and V read at the group's KV head): the same matmuls and no local memory
    assert got["dkdv_gqa"][:2] == [24, 0] and got["dkdv_gqa"][2] <= 10, got
    assert got["dq_gqa"][:3] == [8, 0, 0], got
    hgmma, local, stl, shared = got["dkdv"]
    assert (hgmma, local) == (24, 0) and stl <= 10, got
    # packed query tiles: the same matmuls, the producer's box per cube (its 24 registers
    # park a few scalars), the consumer's masks from one threshold per tile
    hgmma, local, stl, shared_pack = got["dkdv_pack"]
    assert (hgmma, local) == (24, 0) and stl <= 10, got
    hgmma, local, stl, shared_dq = got["dq"]
    assert (hgmma, local, stl) == (8, 0, 0), got
    assert got["dq_dsum"][:3] == [8, 0, 0], got  # the dQ kernel of a gradient through lse
    from tilegen.targets import get_target

    sm90 = get_target("sm_90")  # two CTAs per SM: half the SM's shared memory, less the reserve
    per_cta = sm90.shared_per_sm // 2 - sm90.reserved_shared_per_block
    assert max(shared, shared_dq, shared_pack) <= per_cta, got


def test_hopper_trains_on_the_gluon_kernels_by_default():
    """On a wgmma target the default backward is the Gluon one with the stored dS^T (and
    packed query tiles for a spec with partial cubes) and the forward of a gradient call is
    the Gluon winner's; elsewhere the Triton kernels."""
    from tilegen.backends.gluon.op import GluonBlockSparseAttention
    from tilegen.backends.triton.op import BlockSparseAttention
    from tilegen.targets import get_target

    hopper, blackwell = get_target("sm_90"), get_target("sm_100a")
    assert BackwardConfig.default_for(hopper, Spec()) == BackwardConfig(
        gluon=True, ds_store=True, dkdv_pack=True)  # partial cubes: packed query tiles
    assert BackwardConfig.default_for(hopper, Spec(variable_block_sizes=False)) == (
        BackwardConfig(gluon=True, ds_store=True))
    for target, spec in ((blackwell, Spec()), (hopper, Spec(layout="bhsd")),
                         (hopper, Spec(encoding="sliding_tile")), (None, Spec())):
        assert not BackwardConfig.default_for(target, spec).gluon, (target, spec)
    assert BackwardConfig.default_for(hopper) == BackwardConfig()  # no spec: no claim
    op = BlockSparseAttention(Spec(), KernelConfig(), hopper, "default")
    assert op.backward_config.gluon and op.backward_config.ds_store
    assert isinstance(op.grad_forward(), GluonBlockSparseAttention)
    pinned = BlockSparseAttention(Spec(), KernelConfig(), hopper, "default")
    pinned.grad_forward_family = "triton"
    assert pinned.grad_forward() is None
    # an explicit config pins its variant, the forward for gradients included
    assert BlockSparseAttention(Spec(), KernelConfig(), hopper,
                                "explicit").grad_forward() is None
    assert BlockSparseAttention(Spec(), KernelConfig(), blackwell,
                                "default").grad_forward() is None


def test_backward_winner_key_names_the_gluon_source(monkeypatch):
    """A triton_bwd winner with gluon goes stale when the Gluon backward's source changes,
    one without it does not."""
    from tilegen import backends
    from tilegen.backends.gluon import backward as gb
    from tilegen.targets import get_target

    impl, target, spec = backends.get("triton_bwd"), get_target("sm_90"), Spec()
    gluon = BackwardConfig(gluon=True, ds_store=True).to_kernel_config()
    plain = BackwardConfig().to_kernel_config()
    before = (impl.variant_key(spec, gluon, target), impl.variant_key(spec, plain, target))
    assert before[0].source_sha256 != before[1].source_sha256
    real = gb.render_backward

    def edited(spec, target):
        src = real(spec, target)
        return type(src)(src.text + "# an edit\n", src.name, src.template, src.backend)

    monkeypatch.setattr(gb, "render_backward", edited)
    after = (impl.variant_key(spec, gluon, target), impl.variant_key(spec, plain, target))
    assert after[0] != before[0] and after[1] == before[1]


def test_gluon_family_builds_its_backward_on_hopper_only():
    from tilegen import backends
    from tilegen.backends.gluon.backward import TEMPLATE, spec_problem
    from tilegen.targets import get_target

    impl = backends.get("gluon")
    for name, with_backward in (("sm_90", True), ("sm_100a", False)):
        target = get_target(name)
        cfg = impl.default_config(Spec(), target)
        templates = [s.template for s in impl.sources(Spec(), cfg, target)]
        assert (TEMPLATE in templates) == with_backward, name
    why = spec_problem(Spec(), get_target("sm_100a"))
    assert "wgmma" in why and "Triton backward" in why


def test_forward_for_grad_store_compiles_without_spills():
    """STORE_O32 (the fp32 O of a gradient call, or its rounding residual) adds the stores and
    leaves the matmuls:
    one TMA store staged in the K ring for a consumer with a ring of its own (the default), 64
    two-element stores per thread and consumer where the ring is shared (share_kv). Every
    variant without it compiles as before (bench/NOTES.md: the winners' SASS)."""
    code = (
        "import subprocess, tempfile, triton\n"
        "from pathlib import Path\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.experimental.gluon._runtime import GluonASTSource\n"
        "from tilegen import Spec, backends\n"
        "from tilegen.backends.gluon import launch, render as R\n"
        "from tilegen.cubin import cubin_matrix_ops, cubin_resources\n"
        "from tilegen.targets import get_target\n"
        "t = get_target('sm_90'); b = backends.get('gluon'); s = Spec()\n"
        "base = b.default_config(s, t).replace(store_lse=True)\n"
        "cu = Path(triton.__file__).parent / 'backends/nvidia/bin/cuobjdump'\n"
        "for share in (False, True):\n"
        "    extra = {'share_kv': True, 'num_consumers': 2} if share else {}\n"
        "    cfg = base.replace(options={**dict(base.options), **extra})\n"
        "    opts = R.options_of(cfg); fn = launch.load_kernel(b.render(s, cfg, t))\n"
        "    for o32, res in ((False, False), (True, False), (True, True)):\n"
        "        sig, consts = launch.signature(opts, 128, 'bf16', store_o32=o32, residual=res)\n"
        "        ck = triton.compile(GluonASTSource(fn, sig, consts), target=GPUTarget('cuda',"
        " 90, 32), options={'num_warps': 4, 'maxnreg': R.maxnreg_for(opts, t)})\n"
        "        p = Path(tempfile.mkdtemp()) / 'k.cubin'; p.write_bytes(ck.asm['cubin'])\n"
        "        sass = subprocess.run([str(cu), '--dump-sass', str(p)], capture_output=True,"
        " text=True, check=True).stdout\n"
        "        print(int(share), int(o32) + int(res), R.o32_store_kind(opts, res),"
        " cubin_matrix_ops(p)['HGMMA'],"
        " cubin_resources(p)['local_bytes'], sass.count('STG.'), sass.count('UTMASTG'))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, check=True).stdout.split("\n")
    got = {tuple(int(x) for x in ln.split()[:2]): [int(x) for x in ln.split()[2:]]
           for ln in lines if ln.strip()}
    for share, kind, consumers in ((0, 2, 1), (1, 1, 2)):
        (_, mma0, local0, stg0, tma0), (k1, mma1, local1, stg1, tma1) = (got[share, 0],
                                                                        got[share, 1])
        assert k1 == kind and mma0 == mma1 and local0 == local1 == 0
        if kind == 2:  # the fp32 tile leaves by TMA: one more bulk store, no 64 STG per thread
            assert tma1 == tma0 + 1 and stg1 - stg0 < 64
        else:  # 64 x 128 fp32 per consumer: 64 two-element stores per thread
            assert tma1 == tma0 and stg1 - stg0 == 64 * consumers
    # the rounding residual in 16 bits (STORE_O32 3) where the ring is the consumer's own: one
    # more bulk store, the same matmuls; a shared ring keeps the fp32 O (kind 1)
    k2, mma2, local2, stg2, tma2 = got[0, 2]
    assert k2 == 3 and mma2 == got[0, 0][1] and local2 == 0 and tma2 == got[0, 0][4] + 1
    assert got[1, 2][0] == 1


def test_head_groups_fit_the_budget_and_int32_rows():
    from tilegen.backends.gluon.backward import GluonBackward

    gb = GluonBackward.__new__(GluonBackward)  # the grouping rule alone: no kernels to load
    gb.opts = {"ds_store": True, "scratch_bytes": 4 << 30}
    per_head = 624 * 78 * 64 * 64 * 2
    assert gb.heads_per_group(40, 624, 78) == (4 << 30) // per_head == 10
    gb.opts["scratch_bytes"] = 1 << 50  # a budget past int32 rows
    group = gb.heads_per_group(1000, 624, 78)
    assert group * 624 * 78 * 64 <= 2**31 - 1 < (group + 1) * 624 * 78 * 64
    gb.opts["scratch_bytes"] = 1
    assert gb.heads_per_group(40, 624, 78) == 1
    gb.opts["ds_store"] = False
    assert gb.heads_per_group(40, 624, 78) == 40


def test_lanes_share_the_scratch_budget():
    """With group_streams lanes each lane holds its own scratch: together they stay inside
    scratch_bytes (two lanes of the 4 GiB default: groups of 5 heads at the default workload;
    `run` takes fewer lanes when the budget does not hold a head per lane)."""
    from tilegen.backends.gluon.backward import DEFAULTS, GluonBackward

    assert DEFAULTS["group_streams"] == 2
    gb = GluonBackward.__new__(GluonBackward)
    gb.opts = {"ds_store": True, "scratch_bytes": 4 << 30}
    per_head = 624 * 78 * 64 * 64 * 2
    for lanes in (1, 2, 3, 4):
        group = gb.heads_per_group(40, 624, 78, lanes)
        assert group * per_head * lanes <= 4 << 30 < (group + 1) * per_head * lanes
    assert gb.heads_per_group(40, 624, 78, 2) == 5
    from tilegen.backends.gluon.backward import resolve

    with pytest.raises(ValueError, match="group_streams must be an int >= 1"):
        resolve({"group_streams": 0})


def test_unused_fields_are_refused():
    """One kernel, one name: a field the chosen kernels do not read must stay at its default
    (the tuner's space would otherwise time the same kernel under several names)."""
    why = " ".join(BackwardConfig(gluon=True, dkdv_warps=8).violations(Spec()))
    assert "dkdv_warps" in why and "Gluon backward" in why
    why = " ".join(BackwardConfig(gluon=True, ds_store=True, dq_stages=4).violations(Spec()))
    assert "dq_stages" in why
    assert "gluon_dq_stages" in " ".join(BackwardConfig(gluon_dq_stages=4).violations(Spec()))
    assert BackwardConfig(gluon=True, dq_stages=4, gluon_dq_stages=3).violations(Spec()) == []


def test_hopper_target_trains_on_the_cpu_through_the_triton_kernels(interpreter):
    """An op for sm_90 (its default backward names the Gluon kernels) on CPU tensors under the
    interpreter: the forward and the backward take the Triton kernels, gradients pass."""
    from tilegen import captures
    from tilegen.backends.triton.op import BlockSparseAttention
    from tilegen.reference import attention_grads_fp32
    from tilegen.targets import get_target

    spec = Spec(grid=(2, 4, 8), num_heads=1, head_dim=64, topk=2)
    cap = captures.synthesize(seed=0, grid=(2, 4, 8), heads=1, head_dim=64, topk=2,
                              outlier=False)
    op = BlockSparseAttention(spec, KernelConfig(interp_bf16=True), get_target("sm_90"),
                              "default")
    assert op.backward_config.gluon
    q, k, v = (cap[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    o = op(q, k, v, cap["topk_idx"], cap["vbs"], return_lse=False)
    o.backward(do)
    ref = attention_grads_fp32(cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"], None,
                               do)
    for g, r in zip((q.grad, k.grad, v.grad), ref, strict=True):
        assert captures.grad_score(g, r).passed
