"""The Gluon backend (warp-specialized Hopper kernel): rendering, AOT compile with no GPU, its
rules, and its GPU pre-pass, which runs here under Triton's interpreter.

The kernel itself needs an sm_90 GPU (TMA, wgmma, mbarriers): its correctness and speed on the
H200 are in bench/RESULTS.md. Here the pre-pass's tile plan is replayed in PyTorch exactly as
the producer and consumer walk it (one-cube tiles, packed 32/16/8 boxes at their row offsets,
fill masks) and must give attention over each row's cubes; bad values must set the error word
and mark the row."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import known_spills
import pytest
import torch

from tilegen import Spec, backends
from tilegen.backends.gluon.prepass import (
    pair_prepass_buffers,
    prepass_buffers,
    run_pair_prepass,
    run_prepass,
    run_window_prepass,
)
from tilegen.config import KernelConfig
from tilegen.targets import get_target

SM90 = get_target("sm_90")
GLUON = backends.get("gluon")


def _tiles_attention(q, k, v, vbs, bufs, scale):
    """Attention computed from the pre-pass's tiles, walked as the kernel walks them."""
    B, S, H, D = q.shape
    nq = S // 64
    o = torch.zeros(B, S, H, D)
    sidx, tinfo, meta = bufs["sidx"], bufs["tinfo"], bufs["meta"]
    for b in range(B):
        for h in range(H):
            for qc in range(nq):
                row = (b * H + h) * nq + qc
                n_tiles, n_big = int(meta[row, 0]), int(meta[row, 1])
                rows = slice(qc * 64, (qc + 1) * 64)
                if n_tiles < 0:
                    o[b, rows, h] = float("nan")
                    continue
                ks, vs, masks = [], [], []
                for t in range(n_tiles):
                    kt, vt = torch.full((64, D), float("nan")), torch.zeros(64, D)
                    if t < n_big:
                        c = int(sidx[row, t])
                        kt[:], vt[:] = k[b, c * 64:(c + 1) * 64, h], v[b, c * 64:(c + 1) * 64, h]
                        fill = int(tinfo[row, t]) >> 16
                        assert fill == int(vbs[c])
                    else:
                        info = int(tinfo[row, t])
                        first, fill = info & 0xFFFF, info >> 16
                        last = int(tinfo[row, t + 1]) & 0xFFFF
                        off = 0
                        for i in range(first, last):
                            c = int(sidx[row, i])
                            size = int(vbs[c])
                            assert size in (32, 16, 8) and off % size == 0 and off + size <= 64
                            kt[off:off + size] = k[b, c * 64:c * 64 + size, h]
                            vt[off:off + size] = v[b, c * 64:c * 64 + size, h]
                            off += size
                        assert off == fill
                    ks.append(kt)
                    vs.append(vt)
                    masks.append(torch.arange(64) < fill)
                if not ks:
                    continue
                s = q[b, rows, h].float() @ torch.cat(ks).T * scale
                s[:, ~torch.cat(masks)] = float("-inf")
                o[b, rows, h] = torch.softmax(s, -1) @ torch.cat(vs)
    return o


def _row_attention(q, k, v, idx, vbs, counts, scale):
    B, S, H, D = q.shape
    o = torch.zeros(B, S, H, D)
    for b in range(B):
        for h in range(H):
            for qc in range(S // 64):
                n = idx.shape[3] if counts is None else int(counts[b, h, qc])
                if n == 0:
                    continue
                cubes = idx[b, h, qc, :n].tolist()
                K = torch.cat([k[b, c * 64:c * 64 + int(vbs[c]), h] for c in cubes])
                V = torch.cat([v[b, c * 64:c * 64 + int(vbs[c]), h] for c in cubes])
                s = q[b, qc * 64:(qc + 1) * 64, h] @ K.T * scale
                o[b, qc * 64:(qc + 1) * 64, h] = torch.softmax(s, -1) @ V
    return o


def _lut(gen, B, H, nq, topk):
    return torch.stack([torch.stack([torch.stack([torch.randperm(nq, generator=gen)[:topk]
                                                  for _ in range(nq)]) for _ in range(H)])
                        for _ in range(B)]).int()


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("sizes", [(64, 32, 16, 8), (64, 33, 20, 8, 1, 16, 32, 63)])
def test_prepass_tiles_give_the_rows_attention(interpreter, pack, sizes):
    gen = torch.Generator().manual_seed(len(sizes) + pack)
    B, H, nq, D, topk = 1, 2, 12, 16, 7
    q, k, v = (torch.randn(B, nq * 64, H, D, generator=gen) for _ in range(3))
    order = torch.randperm(nq, generator=gen).tolist()
    vbs = torch.tensor([sizes[i % len(sizes)] for i in order], dtype=torch.int32)
    idx = _lut(gen, B, H, nq, topk)
    counts = torch.randint(0, topk + 1, (B, H, nq), dtype=torch.int32, generator=gen)
    for cnt in (None, counts):
        bufs = prepass_buffers("cpu", B * H * nq, topk)
        err = torch.zeros(1, dtype=torch.int32)
        run_prepass(idx, vbs, cnt, bufs, B * H * nq, nq, topk, err, pack=pack)
        assert int(err) == 0
        got = _tiles_attention(q, k, v, vbs, bufs, D ** -0.5)
        want = _row_attention(q, k, v, idx, vbs, cnt, D ** -0.5)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        if pack and sizes == (64, 32, 16, 8) and cnt is None:  # packing saves tiles
            assert bufs["meta"][:, 0].float().mean() < topk


def _tile_kv(k, v, vbs, sidx_row, tinfo_row, t, n_big, b, h):
    """K/V of tile t as the producer loads it: one cube, or packed 32/16/8 boxes; and its fill."""
    D = k.shape[-1]
    kt, vt = torch.full((64, D), float("nan")), torch.zeros(64, D)
    info = int(tinfo_row[t])
    first, fill = info & 0xFFFF, info >> 16
    if t < n_big:
        c = int(sidx_row[first])
        kt[:], vt[:] = k[b, c * 64:(c + 1) * 64, h], v[b, c * 64:(c + 1) * 64, h]
        assert fill == int(vbs[c])
        return kt, vt, fill
    off = 0
    for i in range(first, int(tinfo_row[t + 1]) & 0xFFFF):
        c = int(sidx_row[i])
        size = int(vbs[c])
        assert size in (32, 16, 8) and off % size == 0 and off + size <= 64
        kt[off:off + size] = k[b, c * 64:c * 64 + size, h]
        vt[off:off + size] = v[b, c * 64:c * 64 + size, h]
        off += size
    assert off == fill
    return kt, vt, fill


def _pair_tiles_attention(q, k, v, vbs, bufs, scale):
    """Attention from the pair pre-pass's union stream, walked as each of the two consumers walks
    it: the tiles with a segment of its own, keys masked to its segments and the fill."""
    B, S, H, D = q.shape
    nq = S // 64
    n_pairs = (nq + 1) // 2
    o = torch.zeros(B, S, H, D)
    col = torch.arange(64)
    for b in range(B):
        for h in range(H):
            for p in range(n_pairs):
                pair = (b * H + h) * n_pairs + p
                n_tiles, n_big = int(bufs["meta"][pair, 0]), int(bufs["meta"][pair, 1])
                tiles = [_tile_kv(k, v, vbs, bufs["sidx"][pair], bufs["tinfo"][pair], t, n_big,
                                  b, h) for t in range(n_tiles)]
                for c in range(2):
                    qc = 2 * p + c
                    if qc >= nq:
                        continue
                    rows = slice(qc * 64, (qc + 1) * 64)
                    if int(bufs["meta"][pair, 2 + c]):
                        o[b, rows, h] = float("nan")
                        continue
                    mine = [(kt, vt, (col < fill) & (((seg >> (col // 8)) & 1) == 1))
                            for t, (kt, vt, fill) in enumerate(tiles)
                            if (seg := (int(bufs["tmask"][pair, t]) >> (8 * c)) & 0xFF)]
                    if not mine:
                        continue
                    s = q[b, rows, h] @ torch.cat([m[0] for m in mine]).T * scale
                    s[:, ~torch.cat([m[2] for m in mine])] = float("-inf")
                    o[b, rows, h] = torch.softmax(s, -1) @ torch.cat([m[1] for m in mine])
    return o


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("nq", [12, 11])
def test_pair_prepass_union_gives_each_rows_attention(interpreter, pack, nq):
    """share_kv: one tile stream for query cubes (2p, 2p+1); a cube both rows chose is one tile,
    and each consumer's segments and fill give exactly its own row's keys (odd NQ included)."""
    gen = torch.Generator().manual_seed(nq + pack)
    B, H, D, topk = 1, 2, 16, 7
    sizes = (64, 33, 20, 8, 1, 16, 32, 63, 64, 32, 16, 8)
    q, k, v = (torch.randn(B, nq * 64, H, D, generator=gen) for _ in range(3))
    vbs = torch.tensor([sizes[i] for i in torch.randperm(nq, generator=gen).tolist()],
                       dtype=torch.int32)
    # neighbouring rows share most cubes, as real selections do: row 2p+1 takes a window of the
    # same permutation shifted by 3, each row in its own order
    idx = torch.empty(B, H, nq, topk, dtype=torch.int32)
    for h in range(H):
        for p in range(0, nq, 2):
            perm = torch.randperm(nq, generator=gen)
            for r in range(p, min(p + 2, nq)):
                row = perm[3 * (r - p):3 * (r - p) + topk]
                idx[0, h, r] = row[torch.randperm(topk, generator=gen)]
    counts = torch.randint(0, topk + 1, (B, H, nq), dtype=torch.int32, generator=gen)
    pairs = B * H * ((nq + 1) // 2)
    for cnt in (None, counts):
        bufs = pair_prepass_buffers("cpu", pairs, topk)
        err = torch.zeros(1, dtype=torch.int32)
        run_pair_prepass(idx, vbs, cnt, bufs, pairs, nq, nq, topk, err, pack=pack)
        assert int(err) == 0
        got = _pair_tiles_attention(q, k, v, vbs, bufs, D ** -0.5)
        want = _row_attention(q, k, v, idx, vbs, cnt, D ** -0.5)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        if cnt is None:  # shared cubes are loaded once
            assert bufs["meta"][:, 0].sum() < 2 * topk * pairs


def test_pair_prepass_flags_bad_values_and_poisons_only_that_row(interpreter):
    gen = torch.Generator().manual_seed(1)
    B, H, nq, topk = 1, 1, 6, 3
    idx = _lut(gen, B, H, nq, topk)
    idx[0, 0, 3, 1] = -1
    vbs = torch.full((nq,), 64, dtype=torch.int32)
    bufs = pair_prepass_buffers("cpu", 3, topk)
    err = torch.zeros(1, dtype=torch.int32)
    run_pair_prepass(idx, vbs, None, bufs, 3, nq, nq, topk, err)
    assert int(err) == 1
    assert bufs["meta"][:, 2:].tolist() == [[0, 0], [0, 1], [0, 0]]


@pytest.mark.parametrize("pack", [True, False])
def test_window_prepass_gives_the_sliding_tile_attention(interpreter, pack):
    """sliding_tile on the Gluon family: the pre-pass computes each row's window from the
    query cube's coordinates (no index tensor); its tiles give attention over exactly the
    cubes of `encodings.window_cubes` (clamped at every face), per-head windows included."""
    from tilegen.encodings import sliding_tile_lut, window_table

    spec = Spec(encoding="sliding_tile", grid=(12, 12, 16), num_heads=2,
                window=((3, 3, 3), (1, 3, 1)))
    gen = torch.Generator().manual_seed(7 + pack)
    B, H, D = 1, 2, 16
    nq = spec.num_cubes  # 3 x 3 x 4 cubes
    sizes = (64, 32, 16, 8, 64, 33)
    vbs = torch.tensor([sizes[i % len(sizes)] for i in range(nq)], dtype=torch.int32)
    q, k, v = (torch.randn(B, nq * 64, H, D, generator=gen) for _ in range(3))
    topk = 27
    bufs = prepass_buffers("cpu", B * H * nq, topk)
    err = torch.zeros(1, dtype=torch.int32)
    run_window_prepass(window_table(spec, H, "cpu"), vbs, bufs, B * H * nq, H, nq,
                       spec.cube_grid, topk, err, pack=pack)
    assert int(err) == 0
    idx, counts = sliding_tile_lut(spec, B, H, "cpu")
    got = _tiles_attention(q, k, v, vbs, bufs, D ** -0.5)
    want = _row_attention(q, k, v, idx, vbs, counts, D ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_prepass_flags_bad_values_and_poisons_their_rows(interpreter):
    gen = torch.Generator().manual_seed(0)
    B, H, nq, topk = 1, 2, 12, 7
    idx = _lut(gen, B, H, nq, topk)
    vbs = torch.full((nq,), 64, dtype=torch.int32)
    bad_idx = idx.clone()
    bad_idx[0, 1, 3, 2] = nq + 5
    bad_vbs = vbs.clone()
    bad_vbs[idx[0, 0, 5, 0]] = 0
    bad_counts = torch.full((B, H, nq), topk, dtype=torch.int32)
    bad_counts[0, 0, 7] = topk + 1
    for lut, sizes, counts, bit in ((bad_idx, vbs, None, 1), (idx, bad_vbs, None, 2),
                                    (idx, vbs, bad_counts, 4)):
        bufs = prepass_buffers("cpu", B * H * nq, topk)
        err = torch.zeros(1, dtype=torch.int32)
        run_prepass(lut, sizes, counts, bufs, B * H * nq, nq, topk, err, pack=True)
        assert int(err) & bit
        assert (bufs["meta"][:, 0] < 0).any()


def test_rules_and_render():
    cfg = GLUON.default_config(Spec(), SM90)
    assert GLUON.violations(Spec(), SM90, cfg) == []
    src = GLUON.render(Spec(), cfg, SM90)
    assert "warp_specialize" in src.text and "target sm_90 (sm_90a)" in src.text.splitlines()[0]
    assert GLUON.violations(Spec(layout="bhsd"), SM90, cfg)
    assert GLUON.violations(Spec(), SM90, cfg.replace(block_n=32))
    # the Hopper default turns on wgmma-consumer knobs: refused on a tcgen05 target, by name
    assert any("wgmma consumer knobs" in p for p in GLUON.violations(
        Spec(), get_target("sm_100a"), cfg))
    assert GLUON.violations(Spec(), get_target("gfx942"), cfg)  # not listed there
    bad = KernelConfig(options={**dict(cfg.options), "num_consumers": 3, "k_stages": 3,
                                "v_stages": 3})
    assert any("shared memory" in p for p in GLUON.violations(Spec(), SM90, bad))
    with pytest.raises(ValueError, match="unknown Gluon"):
        GLUON.render(Spec(), KernelConfig(options={"bogus": 1}), SM90)
    share = {**dict(cfg.options), "share_kv": True, "num_consumers": 2}
    assert GLUON.violations(Spec(), SM90, KernelConfig(options=share)) == []
    assert GLUON.violations(Spec(), SM90, KernelConfig(options={**share, "num_consumers": 1}))
    for knob in ("q_in_regs", "qk_ahead"):  # the pair consumer has one pipeline: no silent no-op
        assert any("share_kv" in p for p in GLUON.violations(
            Spec(), SM90, KernelConfig(options={**share, knob: False})))


def test_knobs_are_constexpr_parameters_of_one_source():
    """Every knob but num_consumers is a constexpr parameter of the kernel (a compile-time `if`
    where it changes the code): the text stays when a knob changes, the file name follows it.
    The kernel's constexprs are what the launch and the AOT compile pass (`render.constexprs`),
    and the AOT signature names every parameter in order (unused pointers: constexpr None)."""
    import ast

    from tilegen.backends.gluon import render as gr
    from tilegen.backends.gluon.launch import signature

    cfg = GLUON.default_config(Spec(), SM90)
    opts = dict(cfg.options)
    base = GLUON.render(Spec(), cfg, SM90)
    for knob, value in (("k_stages", 3), ("v_stages", 3), ("pack_partials", False),
                        ("q_in_regs", False), ("qk_ahead", False), ("fence_wait", False),
                        ("consumer_regs", 200), ("debug", "no_mma")):
        other = GLUON.render(Spec(), cfg.replace(options={**opts, knob: value}), SM90)
        assert other.text == base.text and other.name != base.name, knob
    for other in (cfg.replace(store_lse=False), cfg.replace(store_max_prob=True)):
        assert GLUON.render(Spec(), other, SM90).text == base.text
    two = GLUON.render(Spec(), cfg.replace(options={**opts, "num_consumers": 2}), SM90)
    assert two.text != base.text and "NUM_CONSUMERS = gl.constexpr(2)" in two.text
    assert set(gr.DEFAULTS) - set(gr.CONSTEXPR_NAMES) == {"num_consumers"}
    kernel = next(f for f in ast.parse(base.text).body
                  if isinstance(f, ast.FunctionDef) and f.name == gr.KERNEL_NAME)
    params = [a.arg for a in kernel.args.args]
    constexpr_params = [a.arg for a in kernel.args.args
                        if a.annotation is not None and ast.unparse(a.annotation) == "gl.constexpr"]
    assert constexpr_params == list(gr.constexprs(gr.options_of(cfg)))
    for o in (gr.options_of(cfg), {**gr.options_of(cfg), "pack_partials": False,
                                   "share_kv": True, "store_max_prob": True}):
        sig, consts = signature(o, 128, "bf16")
        assert list(sig) == params
        assert {k for k, v in sig.items() if v == "constexpr"} == set(consts)
        # o32_out is None too: only the forward of a gradient call stores the fp32 O
        assert sum(v is None for v in consts.values()) == (6 * (not o["pack_partials"])
                                                           + (not o["share_kv"])
                                                           + 2 * (not o["store_max_prob"]) + 1)


def test_templates_hold_few_jinja_tags():
    """Issue #24: the language holds its own compile-time branches; Jinja only what Gluon
    cannot express (the consumers' partitions, written out per consumer): at most 30 tags
    ({% ... %}) in each Gluon template."""
    from tilegen.paths import TEMPLATES_DIR

    files = sorted((TEMPLATES_DIR / "gluon").glob("*"))
    assert files and all(p.read_text().count("{%") <= 30 for p in files)


@pytest.mark.parametrize("separate_kv", [False, True], ids=["default", "separate_kv"])
def test_aot_compile_uses_wgmma_without_spills(tmp_path, separate_kv):
    """Compiled for sm_90a in a process without the interpreter (as `tilegen build` does); the
    source of separate K/V (cross-attention, GQA read in place) the same way."""
    code = (
        "from pathlib import Path; import subprocess, os, triton\n"
        "from tilegen import Spec, backends\n"
        "from tilegen.targets import get_target\n"
        "t = get_target('sm_90'); b = backends.get('gluon'); s = Spec()\n"
        f"cfg = b.default_config(s, t).replace(separate_kv={separate_kv})\n"
        f"art = b.compile(s, cfg, t, b.render(s, cfg, t), Path({str(tmp_path)!r}))\n"
        "cu = Path(triton.__file__).parent / 'backends/nvidia/bin/cuobjdump'\n"
        "sass = subprocess.run([str(cu), '--dump-sass', str(art.path)], capture_output=True,"
        " text=True, check=True).stdout\n"
        "print(art.spill_bytes, art.registers, sass.count('HGMMA'), art.matrix_ops['HGMMA'])\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout.split()
    spills, regs, hgmma, reported = (int(x) for x in out)
    name = "gluon forward separate_kv" if separate_kv else "gluon forward"
    assert spills <= known_spills.allowed("sm_90", name), (name, spills)
    assert 0 < regs <= 255 and hgmma > 0 and reported == hgmma


def test_blackwell_rules_and_render():
    """sm_100a renders the tcgen05 consumer (S and P.V in tensor memory) behind the same producer
    and pre-pass; the wgmma knobs and timing experiments are refused there, and so is a CTA
    whose consumers need more tensor memory than an SM has."""
    sm100 = get_target("sm_100a")
    cfg = GLUON.default_config(Spec(), sm100)
    assert GLUON.violations(Spec(), sm100, cfg) == []
    text = GLUON.render(Spec(), cfg, sm100).text
    assert "tcgen05_mma(" in text and "allocate_tensor_memory(" in text
    # one kernel text; its consumer is the target's (a compile-time `if MMA == "tcgen05":`)
    assert 'MMA = gl.constexpr("tcgen05")' in text and "for sm_100a" in text
    assert 'MMA = gl.constexpr("wgmma")' in GLUON.render(Spec(), GLUON.default_config(
        Spec(), SM90), SM90).text
    for knob in ("q_in_regs", "qk_ahead", "fence_wait"):
        assert any(knob in p for p in GLUON.violations(
            Spec(), sm100, KernelConfig(options={**dict(cfg.options), knob: True})))
    assert any("debug" in p for p in GLUON.violations(
        Spec(), sm100, KernelConfig(options={**dict(cfg.options), "debug": "no_mma"})))
    # tensor memory: S and P.V of a 64-row tile share one column range (lane halves), and the
    # allocation is a power of two: 128 columns for one consumer at head_dim 128, 512 for three
    from tilegen.backends.gluon.render import tmem_columns

    assert [tmem_columns({"num_consumers": n}, 64, 128) for n in (1, 2, 3)] == [128, 256, 512]
    assert tmem_columns({"num_consumers": 1}, 64, 64) == 64
    three = KernelConfig(options={**dict(cfg.options), "num_consumers": 3, "k_stages": 1,
                                  "consumer_regs": 160})
    assert GLUON.violations(Spec(), sm100, three) == []
    small = dataclasses.replace(sm100, extra={**sm100.extra, "tensor_memory_columns": 256})
    assert any("tensor memory: 512 columns over the 256" in p
               for p in GLUON.violations(Spec(), small, three))
    # the wgmma-knob refusal names the target's consumer even where share_kv is the other problem
    pair = KernelConfig(options={**dict(cfg.options), "share_kv": True})
    assert any("wgmma consumer knobs" in p for p in GLUON.violations(Spec(), sm100, pair))
    window = Spec(encoding="sliding_tile", window=(3, 3, 3))
    assert GLUON.violations(window, sm100, GLUON.default_config(window, sm100)) == []


def test_blackwell_op_warns_that_it_never_ran(caplog):
    import logging

    from tilegen.backends.gluon import op as gluon_op

    sm100 = get_target("sm_100a")
    gluon_op._warned_unrun.discard(sm100.name)
    with caplog.at_level(logging.WARNING, logger="tilegen"):
        GLUON.make_op(Spec(), GLUON.default_config(Spec(), sm100), sm100)
        GLUON.make_op(Spec(), GLUON.default_config(Spec(), sm100), sm100)  # once per target
    said = [r.getMessage() for r in caplog.records if "never run" in r.getMessage()]
    assert len(said) == 1 and "sm_100a" in said[0] and "backend='triton'" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tilegen"):
        GLUON.make_op(Spec(), GLUON.default_config(Spec(), SM90), SM90)  # Hopper ran: no word
    assert not caplog.records


@pytest.mark.parametrize("encoding", ["lut", "sliding_tile"])
def test_blackwell_aot_compile_uses_tcgen05_without_spills(tmp_path, encoding):
    """The sm_100a build: tcgen05 MMAs (UTCHMMA) and tensor-memory loads in the SASS, no wgmma,
    no spills. Built here only: no B200 ran it."""
    spec = "Spec()" if encoding == "lut" else "Spec(encoding='sliding_tile', window=(3, 3, 3))"
    code = (
        "from pathlib import Path; import subprocess, triton\n"
        "from tilegen import Spec, backends\n"
        "from tilegen.targets import get_target\n"
        f"t = get_target('sm_100a'); b = backends.get('gluon'); s = {spec}\n"
        "cfg = b.default_config(s, t)\n"
        f"art = b.compile(s, cfg, t, b.render(s, cfg, t), Path({str(tmp_path)!r}))\n"
        "cu = Path(triton.__file__).parent / 'backends/nvidia/bin/cuobjdump'\n"
        "sass = subprocess.run([str(cu), '--dump-sass', str(art.path)], capture_output=True,"
        " text=True, check=True).stdout\n"
        "from tilegen.backends.gluon.render import options_of, smem_bytes\n"
        "est = smem_bytes(options_of(cfg), 64, s.head_dim, 'tcgen05')\n"
        "print(art.spill_bytes, art.matrix_ops.get('UTCHMMA', 0), art.matrix_ops.get('HGMMA', 0),"
        " sass.count('LDTM'), int(art.shared_bytes <= est))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout.split()
    spills, utc, hgmma, ldtm, within = (int(x) for x in out)
    assert spills == 0 and utc > 0 and hgmma == 0 and ldtm > 0
    assert within  # the rules' shared-memory estimate bounds what the compiler allocated


def test_op_refuses_cpu_tensors():
    op = GLUON.make_op(Spec(grid=(4, 4, 4), num_heads=1, topk=1),
                       GLUON.default_config(Spec(), SM90), SM90)
    q = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16)
    idx = torch.zeros(1, 1, 1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="CUDA"):
        op(q, q, q, idx, torch.full((1,), 64, dtype=torch.int32))



def test_sliding_tile_op_takes_no_index_and_refuses_what_it_lacks():
    """sliding_tile reaches the Gluon family through the pre-pass: op(q, k, v, vbs); the pair
    pre-pass merges LUT rows, so share_kv is refused for it with the reason."""
    from tilegen.backends.gluon.op import GluonSlidingTileAttention

    spec = Spec(encoding="sliding_tile", grid=(4, 4, 8), num_heads=1, window=(1, 1, 1))
    cfg = GLUON.default_config(spec, SM90)
    assert GLUON.violations(spec, SM90, cfg) == []
    share = cfg.replace(options={**dict(cfg.options), "share_kv": True, "num_consumers": 2})
    assert any("sliding_tile" in p for p in GLUON.violations(spec, SM90, share))
    op = GLUON.make_op(spec, cfg, SM90)
    assert isinstance(op, GluonSlidingTileAttention)
    q = torch.zeros(1, 128, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        op(q, q, q, torch.full((2,), 64, dtype=torch.int32))
    assert "sliding_tile" in GLUON.render(spec, cfg, SM90).name

def test_tuning_space_of_the_family():
    """The family's knobs come from targets/sm_90/target.toml [tunable.gluon]; `--space`
    overrides type option values too; every point round-trips through the space."""
    from tilegen.tune.space import SearchSpace, parse_space_override

    pinned = dict(parse_space_override(t) for t in (
        "num_consumers=1", "q_in_regs=true", "qk_ahead=true", "fence_wait=true"))
    space = SearchSpace.from_target(Spec(), SM90, pinned, "gluon")
    # 3 K depths x 2 V depths x packing x share_kv; share_kv needs two consumers
    assert space.size == 24 and len(space.feasible()) == 12
    assert all(not c.option("share_kv") for c in space.feasible())
    for cfg in space.configs():
        assert space.contains(cfg) and cfg.option("num_consumers") == 1
    three = SearchSpace.from_target(Spec(), SM90, dict([parse_space_override(
        "num_consumers=3")]), "gluon")  # three consumers' rings overflow shared memory
    assert any("shared memory" in " ".join(three.violations(c)) for c in three.configs())
    with pytest.raises(ValueError, match="option of this kernel family"):
        SearchSpace.from_target(Spec(), SM90, dict([parse_space_override("bogus=1")]), "gluon")
