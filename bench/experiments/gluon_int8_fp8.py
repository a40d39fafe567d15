"""Experiment (issue #19): is an 8-bit Gluon forward (INT8 Q·K, e4m3 P·V, `tilegen.quant`'s
recipe without Q smoothing) worth the family's plumbing? A minimal kernel on the Gluon family's
structure (one consumer warpgroup per query cube, a 1-warp TMA producer, a K ring and a V^T
ring, S of tile j in flight with P·V of tile j-1), LUT encoding, head dim 128, 64-token cubes,
no packed partial cubes, no lse. Not a tilegen family yet: if it measures well, its pieces go
into templates/gluon/lut_ws_kernel.py.j2 as constexpr branches.

    python bench/experiments/gluon_int8_fp8.py --offline          # no GPU: compile for sm_90a,
                                                                   # count IGMMA/QGMMA, spills
    PYTHONPATH=$PWD python3 bench/experiments/gluon_int8_fp8.py --out $OUT/int8_fp8.json

What the kernel reads per tile: the K tile (64 x 128 int8, 8 KB) and the V^T tile (128 x 64
e4m3, 8 KB) against the bf16 kernel's 16 + 16 KB, and 64 K scales (fp32, from L2 by the
consumer, one tile ahead).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import tempfile
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

BLOCK = gl.constexpr(64)
HEAD_DIM = gl.constexpr(128)
P_SCALE = gl.constexpr(448.0)
LOG2_P_SCALE = gl.constexpr(math.log2(448.0))
KV_BYTES = gl.constexpr(64 * 128)  # one 8-bit tile: K (64 x 128) or V^T (128 x 64)
# S = Q8 K8^T accumulates in int32 (8-bit wgmma: K = 32 per instruction); P.V in fp32
S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 64, 32]))
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 128, 32]))
P_SMEM = gl.constexpr(gl.NVMMASharedLayout.get_default_for([64, 64], gl.float8e4nv))
P_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=4))
ROW_S = gl.constexpr(gl.SliceLayout(1, S_LAYOUT))
COL_S = gl.constexpr(gl.SliceLayout(0, S_LAYOUT))
ROW_O = gl.constexpr(gl.SliceLayout(1, O_LAYOUT))
COL_O = gl.constexpr(gl.SliceLayout(0, O_LAYOUT))


@gluon.jit
def _exp2(x):
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _producer(q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty,
              v_ready, v_empty, sidx_ptr, meta_ptr, row, q_row0, kv_row0, col, vt_row0, topk):
    """Q once, then K of tile j and V of tile j-1 (the cube id read from the plan for each)."""
    K_STAGES: gl.constexpr = k_smem.shape[0]
    V_STAGES: gl.constexpr = v_smem.shape[0]
    n_tiles = gl.load(meta_ptr + row * 2)
    sidx_row = sidx_ptr + row.to(gl.int64) * topk
    if n_tiles > 0:
        mbarrier.expect(q_bar, KV_BYTES)
        tma.async_copy_global_to_shared(q_desc, [q_row0, col], q_bar, q_smem)
    for j in range(0, n_tiles + 1):
        if j < n_tiles:
            ks = j % K_STAGES
            mbarrier.wait(k_empty.index(ks), ((j // K_STAGES) & 1) ^ 1)
            cube = gl.load(sidx_row + j)
            mbarrier.expect(k_ready.index(ks), KV_BYTES)
            tma.async_copy_global_to_shared(k_desc, [kv_row0 + cube * BLOCK, col],
                                            k_ready.index(ks), k_smem.index(ks))
        if j > 0:
            jv = j - 1
            vs = jv % V_STAGES
            mbarrier.wait(v_empty.index(vs), ((jv // V_STAGES) & 1) ^ 1)
            cube = gl.load(sidx_row + jv)
            mbarrier.expect(v_ready.index(vs), KV_BYTES)
            tma.async_copy_global_to_shared(vt_desc, [vt_row0, cube * BLOCK],
                                            v_ready.index(vs), v_smem.index(vs))


@gluon.jit
def _to_f32(x, FAST_CVT: gl.constexpr):
    """int32 -> fp32. FAST_CVT: |x| < 2^22 always (128 products of int8 values), so adding the
    bits of 1.5 x 2^23 and subtracting it as a float is exact with two full-rate ops instead of
    a quarter-rate I2F."""
    if FAST_CVT:
        return (x + 0x4B400000).to(gl.float32, bitcast=True) - 12582912.0
    return x.to(gl.float32)


@gluon.jit
def _tile_meta(sidx_row, tinfo_row, ksc_ptr, ks_off, j, n_tiles):
    """K's scales and the fill of tile j (j clamped to the row: a prefetch past the last tile
    reads the last one again)."""
    jc = gl.minimum(j, n_tiles - 1)
    cube = gl.load(sidx_row + jc)
    fill = gl.load(tinfo_row + jc) >> 16
    cols = gl.arange(0, BLOCK, layout=COL_S)
    return gl.load(ksc_ptr + ks_off + cube * BLOCK + cols), fill


@gluon.jit
def _scores(s_int, sq, sk, fill, FAST_CVT: gl.constexpr):
    """fp32 scores of a tile (base-2 logits: qk_scale is folded into sq), keys past the fill
    masked."""
    cols = gl.arange(0, BLOCK, layout=COL_S)
    s = _to_f32(s_int, FAST_CVT) * gl.expand_dims(sq, 1) * gl.expand_dims(sk, 0)
    return gl.where(gl.expand_dims(cols < fill, 0), s, float("-inf"))


@gluon.jit
def _scores_folded(s_int, sk, fill, FAST_CVT: gl.constexpr):
    """FOLD: the scores in K-scaled units, s' = s_int * sk_j, with the keys past the fill at
    -inf, as one FFMA per element (the mask is a per-column bias). The row scale sq_i > 0
    commutes with the row max, so it is applied once, inside the exp2's FFMA."""
    cols = gl.arange(0, BLOCK, layout=COL_S)
    bias = gl.where(cols < fill, 0.0, float("-inf"))
    return _to_f32(s_int, FAST_CVT) * gl.expand_dims(sk, 0) + gl.expand_dims(bias, 0)


@gluon.jit
def _p_folded(s, sq, m):
    """FOLD: P x P_SCALE = exp2(sq (s' - m') + log2 P_SCALE), one FFMA and the MUFU."""
    c = LOG2_P_SCALE - sq * m
    return _exp2(s * gl.expand_dims(sq, 1) + gl.expand_dims(c, 1))


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, p_smem, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc,
              sidx_ptr, tinfo_ptr, meta_ptr, vbs_ptr, qsc_ptr, ksc_ptr, vsc_ptr, vmean_ptr,
              row, q_row0, col, sc_off, q_cube, vd_off, topk, qk_scale,
              FAST_CVT: gl.constexpr, PREFETCH: gl.constexpr, TWO_LEVEL: gl.constexpr,
              REG_P: gl.constexpr, FOLD: gl.constexpr, ACC_FMA: gl.constexpr):
    K_STAGES: gl.constexpr = k_smem.shape[0]
    V_STAGES: gl.constexpr = v_smem.shape[0]
    n_tiles = gl.load(meta_ptr + row * 2)
    sidx_row = sidx_ptr + row.to(gl.int64) * topk
    tinfo_row = tinfo_ptr + row.to(gl.int64) * (topk + 1)
    rows_s = gl.arange(0, BLOCK, layout=ROW_S)
    sq = gl.load(qsc_ptr + sc_off + q_cube * BLOCK + rows_s) * qk_scale
    if FOLD:  # a padded row's scale is 0: any positive one keeps its (discarded) values finite
        sq = gl.where(sq > 0.0, sq, qk_scale)
    acc = gl.zeros([BLOCK, HEAD_DIM], gl.float32, O_LAYOUT)
    zero_o = gl.zeros([BLOCK, HEAD_DIM], gl.float32, O_LAYOUT)
    zero_s = gl.zeros([BLOCK, BLOCK], gl.int32, S_LAYOUT)
    m_i = gl.full([BLOCK], float("-inf"), gl.float32, ROW_S)
    l_i = gl.full([BLOCK], 0.0, gl.float32, ROW_S)
    # ACC_FMA: O is rescaled one tile late, so that the rescale and the two-level add are one
    # FFMA: acc = acc * alpha_{j-1} + pv_{j-1}
    alpha_prev = gl.full([BLOCK], 1.0, gl.float32, ROW_O)
    if n_tiles > 0:
        mbarrier.wait(q_bar, 0)
        mbarrier.wait(k_ready.index(0), 0)
        s_int = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False)
        mbarrier.arrive(k_empty.index(0), count=1)
        sk, fill = _tile_meta(sidx_row, tinfo_row, ksc_ptr, sc_off, 0, n_tiles)
        if FOLD:
            s = _scores_folded(s_int, sk, fill, FAST_CVT)
        else:
            s = _scores(s_int, sq, sk, fill, FAST_CVT)
        if PREFETCH:  # the next tile's scales and fill, a whole iteration ahead
            sk_next, fill_next = _tile_meta(sidx_row, tinfo_row, ksc_ptr, sc_off, 1, n_tiles)
        m_i = gl.max(s, 1)
        if FOLD:
            p8 = _p_folded(s, sq, m_i)
            l_i = gl.sum(p8, 1)
        else:
            p = _exp2(s - gl.expand_dims(m_i, 1))
            l_i = gl.sum(p, 1)
            p8 = p * P_SCALE
        # P goes through shared memory (two slots): the wait of an async wgmma cannot keep
        # 8-bit register operands alive
        if REG_P:
            p_op = gl.convert_layout(p8.to(gl.float8e4nv), P_LAYOUT)
        else:
            p_smem.index(0).store(p8.to(gl.float8e4nv))
            fence_async_shared()
        for j in range(1, n_tiles):
            ks = j % K_STAGES
            jv = j - 1
            vs = jv % V_STAGES
            if PREFETCH:
                sk = sk_next
                fill = fill_next
                sk_next, fill_next = _tile_meta(sidx_row, tinfo_row, ksc_ptr, sc_off, j + 1,
                                                n_tiles)
            mbarrier.wait(k_ready.index(ks), (j // K_STAGES) & 1)
            s_tok = warpgroup_mma(q_smem, k_smem.index(ks).permute((1, 0)), zero_s,
                                  use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(vs), (jv // V_STAGES) & 1)
            if REG_P:
                # P from registers: a synchronous P.V (an async wait cannot keep 8-bit register
                # operands alive), which also completes S_j
                if TWO_LEVEL:
                    acc = acc + warpgroup_mma(p_op, v_smem.index(vs).permute((1, 0)), zero_o,
                                              use_acc=False)
                else:
                    acc = warpgroup_mma(p_op, v_smem.index(vs).permute((1, 0)), acc)
                mbarrier.arrive(v_empty.index(vs), count=1)
                s_int = warpgroup_mma_wait(0, deps=[s_tok])
            else:
                # TWO_LEVEL: each tile's P.V into a fresh fp32 accumulator, added to O after;
                # otherwise the MMA accumulates onto O (rescaled before)
                if TWO_LEVEL:
                    pv_tok = warpgroup_mma(p_smem.index(jv % 2),
                                           v_smem.index(vs).permute((1, 0)), zero_o,
                                           use_acc=False, is_async=True)
                else:
                    pv_tok = warpgroup_mma(p_smem.index(jv % 2),
                                           v_smem.index(vs).permute((1, 0)), acc, is_async=True)
                s_int = warpgroup_mma_wait(1, deps=[s_tok])
            mbarrier.arrive(k_empty.index(ks), count=1)
            if not PREFETCH:
                sk, fill = _tile_meta(sidx_row, tinfo_row, ksc_ptr, sc_off, j, n_tiles)
            if FOLD:
                s = _scores_folded(s_int, sk, fill, FAST_CVT)
                m_new = gl.maximum(m_i, gl.max(s, 1))
                alpha = _exp2((m_i - m_new) * sq)
                p8 = _p_folded(s, sq, m_new)
                l_i = l_i * alpha + gl.sum(p8, 1)
            else:
                s = _scores(s_int, sq, sk, fill, FAST_CVT)
                m_new = gl.maximum(m_i, gl.max(s, 1))
                alpha = _exp2(m_i - m_new)
                p = _exp2(s - gl.expand_dims(m_new, 1))
                l_i = l_i * alpha + gl.sum(p, 1)
                p8 = p * P_SCALE
            m_i = m_new
            alpha_o = gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
            if REG_P:
                p_op = gl.convert_layout(p8.to(gl.float8e4nv), P_LAYOUT)
                acc = acc * alpha_o
            else:
                # slot j % 2 was read by the P.V of tile j - 2, waited for last iteration
                p_smem.index(j % 2).store(p8.to(gl.float8e4nv))
                fence_async_shared()
                pv = warpgroup_mma_wait(0, deps=[pv_tok])
                mbarrier.arrive(v_empty.index(vs), count=1)
                if ACC_FMA:
                    acc = acc * gl.expand_dims(alpha_prev, 1) + pv
                    alpha_prev = gl.convert_layout(alpha, ROW_O)
                else:
                    if TWO_LEVEL:
                        pv = acc + pv
                    acc = pv * alpha_o
        jv = n_tiles - 1
        vs = jv % V_STAGES
        mbarrier.wait(v_ready.index(vs), (jv // V_STAGES) & 1)
        if REG_P:
            p_last = p_op
        else:
            p_last = p_smem.index(jv % 2)
        if ACC_FMA:
            pv = warpgroup_mma(p_last, v_smem.index(vs).permute((1, 0)), zero_o, use_acc=False)
            acc = acc * gl.expand_dims(alpha_prev, 1) + pv
        elif TWO_LEVEL:
            acc = acc + warpgroup_mma(p_last, v_smem.index(vs).permute((1, 0)), zero_o,
                                      use_acc=False)
        else:
            acc = warpgroup_mma(p_last, v_smem.index(vs).permute((1, 0)), acc)
        mbarrier.arrive(v_empty.index(vs), count=1)
    _epilogue(acc, l_i, n_tiles, k_smem, o_desc, vsc_ptr, vmean_ptr, vbs_ptr, vd_off, q_cube,
              q_row0, col, FOLD)


@gluon.jit
def _epilogue(acc, l_i, n_tiles, k_smem, o_desc, vsc_ptr, vmean_ptr, vbs_ptr, vd_off, q_cube,
              q_row0, col, L_SCALED: gl.constexpr = False):
    """o = acc / l x v_scale / P_SCALE + v_mean; padded rows 0; a bad row NaN; TMA store.
    L_SCALED: l summed P x P_SCALE, so P_SCALE is in it already."""
    l_safe = gl.where(l_i > 0.0, l_i, 1.0)
    cols_o = gl.arange(0, HEAD_DIM, layout=COL_O)
    if L_SCALED:
        v_scale = gl.load(vsc_ptr + vd_off + cols_o)
    else:
        v_scale = gl.load(vsc_ptr + vd_off + cols_o) * (1.0 / P_SCALE)
    v_mean = gl.load(vmean_ptr + vd_off + cols_o)
    o = acc * gl.expand_dims(gl.convert_layout(1.0 / l_safe, ROW_O), 1)
    seen = gl.expand_dims(gl.convert_layout(l_i > 0.0, ROW_O), 1)  # v̄ only with weights
    o = o * gl.expand_dims(v_scale, 0) + gl.where(seen, gl.expand_dims(v_mean, 0), 0.0)
    rows_o = gl.arange(0, BLOCK, layout=ROW_O)
    q_valid = gl.load(vbs_ptr + q_cube)
    o = gl.where(gl.expand_dims(rows_o < q_valid, 1), o, 0.0)
    if n_tiles < 0:
        o = o + float("nan")
    # the K ring is idle after the last S: two of its 8 KB slots hold the bf16 O tile
    o_smem = k_smem._reinterpret(gl.bfloat16, [BLOCK, HEAD_DIM], o_desc.layout)
    o_smem.store(o.to(gl.bfloat16))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row0, col], o_smem)
    tma.store_wait(0)


@gluon.jit
def _pair_scores(s_a, s_b, sq, sidx_row, tinfo_row, ksc_ptr, ks_off, a, has_b, n_tiles,
                 FAST_CVT: gl.constexpr):
    sk_a, fill_a = _tile_meta(sidx_row, tinfo_row, ksc_ptr, ks_off, a, n_tiles)
    sk_b, fill_b = _tile_meta(sidx_row, tinfo_row, ksc_ptr, ks_off, a + 1, n_tiles)
    fill_b = gl.where(has_b, fill_b, 0)  # no tile b: every key masked (P_b = 0)
    return (_scores(s_a, sq, sk_a, fill_a, FAST_CVT), _scores(s_b, sq, sk_b, fill_b, FAST_CVT))


@gluon.jit
def _pair_consumer(q_smem, k_smem, v_smem, p_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                   o_desc, sidx_ptr, tinfo_ptr, meta_ptr, vbs_ptr, qsc_ptr, ksc_ptr, vsc_ptr,
                   vmean_ptr, row, q_row0, col, sc_off, q_cube, vd_off, topk, qk_scale,
                   FAST_CVT: gl.constexpr):
    """Two KV cubes (tiles a = 2i and b = 2i + 1) per softmax step: two S MMAs in flight, one
    rescale of O per 128 keys, the two P.V of the step before chained into one fp32 accumulator
    (two-level). An odd last tile pairs with itself, fully masked (its slot is waited for and
    released once)."""
    K_STAGES: gl.constexpr = k_smem.shape[0]
    V_STAGES: gl.constexpr = v_smem.shape[0]
    n_tiles = gl.load(meta_ptr + row * 2)
    sidx_row = sidx_ptr + row.to(gl.int64) * topk
    tinfo_row = tinfo_ptr + row.to(gl.int64) * (topk + 1)
    rows_s = gl.arange(0, BLOCK, layout=ROW_S)
    sq = gl.load(qsc_ptr + sc_off + q_cube * BLOCK + rows_s) * qk_scale
    acc = gl.zeros([BLOCK, HEAD_DIM], gl.float32, O_LAYOUT)
    zero_o = gl.zeros([BLOCK, HEAD_DIM], gl.float32, O_LAYOUT)
    zero_s = gl.zeros([BLOCK, BLOCK], gl.int32, S_LAYOUT)
    m_i = gl.full([BLOCK], float("-inf"), gl.float32, ROW_S)
    l_i = gl.full([BLOCK], 0.0, gl.float32, ROW_S)
    n_steps = (n_tiles + 1) // 2
    if n_tiles > 0:
        mbarrier.wait(q_bar, 0)
        # step 0: tiles 0 and 1 (tile 0 with itself, masked, when there is one tile)
        has_b = 1 < n_tiles
        kb = gl.where(has_b, 1, 0)
        mbarrier.wait(k_ready.index(0), 0)
        sa_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False,
                               is_async=True)
        if has_b:
            mbarrier.wait(k_ready.index(1), 0)
        sb_tok = warpgroup_mma(q_smem, k_smem.index(kb).permute((1, 0)), zero_s, use_acc=False,
                               is_async=True)
        s_a, s_b = warpgroup_mma_wait(0, deps=[sa_tok, sb_tok])
        mbarrier.arrive(k_empty.index(0), count=1)
        if has_b:
            mbarrier.arrive(k_empty.index(1), count=1)
        s_a, s_b = _pair_scores(s_a, s_b, sq, sidx_row, tinfo_row, ksc_ptr, sc_off, 0, has_b,
                                n_tiles, FAST_CVT)
        m_i = gl.maximum(gl.max(s_a, 1), gl.max(s_b, 1))
        p_a = _exp2(s_a - gl.expand_dims(m_i, 1))
        p_b = _exp2(s_b - gl.expand_dims(m_i, 1))
        l_i = gl.sum(p_a, 1) + gl.sum(p_b, 1)
        p_smem.index(0).store((p_a * P_SCALE).to(gl.float8e4nv))
        p_smem.index(1).store((p_b * P_SCALE).to(gl.float8e4nv))
        fence_async_shared()
        for i in range(1, n_steps):
            a = 2 * i
            has_b = a + 1 < n_tiles
            b = gl.where(has_b, a + 1, a)
            ka = a % K_STAGES
            kb = b % K_STAGES
            mbarrier.wait(k_ready.index(ka), (a // K_STAGES) & 1)
            sa_tok = warpgroup_mma(q_smem, k_smem.index(ka).permute((1, 0)), zero_s,
                                   use_acc=False, is_async=True)
            if has_b:
                mbarrier.wait(k_ready.index(kb), (b // K_STAGES) & 1)
            sb_tok = warpgroup_mma(q_smem, k_smem.index(kb).permute((1, 0)), zero_s,
                                   use_acc=False, is_async=True)
            # the step before (always two tiles): its two P.V chained into one accumulator
            pa = a - 2
            pb = a - 1
            va = pa % V_STAGES
            vb = pb % V_STAGES
            slot = ((i - 1) % 2) * 2
            mbarrier.wait(v_ready.index(va), (pa // V_STAGES) & 1)
            mbarrier.wait(v_ready.index(vb), (pb // V_STAGES) & 1)
            pv_tok = warpgroup_mma(p_smem.index(slot), v_smem.index(va).permute((1, 0)), zero_o,
                                   use_acc=False, is_async=True)
            pv_tok = warpgroup_mma(p_smem.index(slot + 1), v_smem.index(vb).permute((1, 0)),
                                   pv_tok, is_async=True)
            s_a, s_b = warpgroup_mma_wait(2, deps=[sa_tok, sb_tok])
            mbarrier.arrive(k_empty.index(ka), count=1)
            if has_b:
                mbarrier.arrive(k_empty.index(kb), count=1)
            s_a, s_b = _pair_scores(s_a, s_b, sq, sidx_row, tinfo_row, ksc_ptr, sc_off, a,
                                    has_b, n_tiles, FAST_CVT)
            m_new = gl.maximum(m_i, gl.maximum(gl.max(s_a, 1), gl.max(s_b, 1)))
            alpha = _exp2(m_i - m_new)
            p_a = _exp2(s_a - gl.expand_dims(m_new, 1))
            p_b = _exp2(s_b - gl.expand_dims(m_new, 1))
            l_i = l_i * alpha + gl.sum(p_a, 1) + gl.sum(p_b, 1)
            m_i = m_new
            nslot = (i % 2) * 2  # read by the P.V of step i - 2, waited for last step
            p_smem.index(nslot).store((p_a * P_SCALE).to(gl.float8e4nv))
            p_smem.index(nslot + 1).store((p_b * P_SCALE).to(gl.float8e4nv))
            fence_async_shared()
            pv = warpgroup_mma_wait(0, deps=[pv_tok])
            mbarrier.arrive(v_empty.index(va), count=1)
            mbarrier.arrive(v_empty.index(vb), count=1)
            acc = (acc + pv) * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
        # the last step's P.V
        i = n_steps - 1
        a = 2 * i
        has_b = a + 1 < n_tiles
        va = a % V_STAGES
        slot = (i % 2) * 2
        mbarrier.wait(v_ready.index(va), (a // V_STAGES) & 1)
        pv = warpgroup_mma(p_smem.index(slot), v_smem.index(va).permute((1, 0)), zero_o,
                           use_acc=False)
        mbarrier.arrive(v_empty.index(va), count=1)
        if has_b:
            vb = (a + 1) % V_STAGES
            mbarrier.wait(v_ready.index(vb), ((a + 1) // V_STAGES) & 1)
            pv = warpgroup_mma(p_smem.index(slot + 1), v_smem.index(vb).permute((1, 0)), pv)
            mbarrier.arrive(v_empty.index(vb), count=1)
        acc = acc + pv
    _epilogue(acc, l_i, n_tiles, k_smem, o_desc, vsc_ptr, vmean_ptr, vbs_ptr, vd_off, q_cube,
              q_row0, col)


@gluon.jit
def int8_fp8_kernel(q_desc, k_desc, vt_desc, o_desc, sidx_ptr, tinfo_ptr, meta_ptr, vbs_ptr,
                    qsc_ptr, ksc_ptr, vsc_ptr, vmean_ptr, seq_len, num_heads, num_q_blocks,
                    topk, qk_scale, FAST_CVT: gl.constexpr, PREFETCH: gl.constexpr,
                    TWO_LEVEL: gl.constexpr, REG_P: gl.constexpr, PAIR: gl.constexpr,
                    FOLD: gl.constexpr, ACC_FMA: gl.constexpr,
                    K_STAGES: gl.constexpr = 4, V_STAGES: gl.constexpr = 2):
    q_cube = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // num_heads
    h = bh - b * num_heads
    col = h * HEAD_DIM
    row0 = b * seq_len
    row = bh * num_q_blocks + q_cube
    q_row0 = row0 + q_cube * BLOCK
    sc_off = bh.to(gl.int64) * seq_len
    q_smem = gl.allocate_shared_memory(gl.int8, [BLOCK, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.int8, [K_STAGES, BLOCK, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [V_STAGES, HEAD_DIM, BLOCK],
                                       vt_desc.layout)
    p_smem = gl.allocate_shared_memory(gl.float8e4nv, [4 if PAIR else 2, BLOCK, BLOCK], P_SMEM)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)
    fence_async_shared()
    vd_off = bh.to(gl.int64) * HEAD_DIM
    if PAIR:
        gl.warp_specialize([
            (_pair_consumer, (q_smem, k_smem, v_smem, p_smem, q_bar, k_ready, k_empty, v_ready,
                              v_empty, o_desc, sidx_ptr, tinfo_ptr, meta_ptr, vbs_ptr, qsc_ptr,
                              ksc_ptr, vsc_ptr, vmean_ptr, row, q_row0, col, sc_off, q_cube,
                              vd_off, topk, qk_scale, FAST_CVT)),
            (_producer, (q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_bar, k_ready,
                         k_empty, v_ready, v_empty, sidx_ptr, meta_ptr, row, q_row0, row0, col,
                         bh * HEAD_DIM, topk)),
        ], [1], [24])
    else:
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, p_smem, q_bar, k_ready, k_empty, v_ready,
                         v_empty, o_desc, sidx_ptr, tinfo_ptr, meta_ptr, vbs_ptr, qsc_ptr,
                         ksc_ptr, vsc_ptr, vmean_ptr, row, q_row0, col, sc_off, q_cube, vd_off,
                         topk, qk_scale, FAST_CVT, PREFETCH, TWO_LEVEL, REG_P, FOLD,
                         ACC_FMA)),
            (_producer, (q_desc, k_desc, vt_desc, q_smem, k_smem, v_smem, q_bar, k_ready,
                         k_empty, v_ready, v_empty, sidx_ptr, meta_ptr, row, q_row0, row0, col,
                         bh * HEAD_DIM, topk)),
        ], [1], [24])


# ---------------------------------------------------------------------------------- the host
def _layouts():
    return {"q": gl.NVMMASharedLayout.get_default_for([64, 128], gl.int8),
            "vt": gl.NVMMASharedLayout.get_default_for([128, 64], gl.float8e4nv),
            "o": gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)}




#: (constexprs, maxnreg): maxnreg 128 gives the consumer 232 registers (2 CTAs per SM; fewer
#: for 3 CTAs per SM does not compile: ptxas needs 90+ for the m64n128 wgmma)
#: the variants measured (bench/NOTES.md, issue #19): the scales a tile ahead (PREFETCH), the
#: int32 -> fp32 conversion without I2F (FAST_CVT), P.V onto O directly (TWO_LEVEL False: fails
#: by precision), P from registers with a synchronous P.V (REG_P)
_BASE = dict(FAST_CVT=False, PREFETCH=True, TWO_LEVEL=True, REG_P=False, PAIR=False,
             FOLD=False, ACC_FMA=False, K_STAGES=4, V_STAGES=2)
VARIANTS = {
    "v1": ({**_BASE, "PREFETCH": False}, 128),
    "prefetch": (_BASE, 128),
    "prefetch+cvt": ({**_BASE, "FAST_CVT": True}, 128),
    "one-level": ({**_BASE, "FAST_CVT": True, "TWO_LEVEL": False}, 128),
    "regP": ({**_BASE, "FAST_CVT": True, "REG_P": True}, 128),
    "pair": ({**_BASE, "PAIR": True}, 128),
    "pair+cvt": ({**_BASE, "PAIR": True, "FAST_CVT": True}, 128),
    # session 13: the scales, the mask and P's 448 folded into two FFMAs per score (FOLD), and
    # O's rescale one tile late so that it and the two-level add are one FFMA (ACC_FMA)
    "fold": ({**_BASE, "FOLD": True}, 128),
    "fma": ({**_BASE, "ACC_FMA": True}, 128),
    "fold+fma": ({**_BASE, "FOLD": True, "ACC_FMA": True}, 128),
    "fold+fma+cvt": ({**_BASE, "FOLD": True, "ACC_FMA": True, "FAST_CVT": True}, 128),
    # deeper rings (8 KB a tile: two CTAs a SM still fit): the producer issues K_j only once
    # V_{j-1}'s slot is free, so the V ring bounds how far ahead both are loaded
    "fold+fma_k4v4": ({**_BASE, "FOLD": True, "ACC_FMA": True, "V_STAGES": 4}, 128),
    "fold+fma_k6v4": ({**_BASE, "FOLD": True, "ACC_FMA": True, "K_STAGES": 6,
                       "V_STAGES": 4}, 128),
    "fold+fma_k5v5": ({**_BASE, "FOLD": True, "ACC_FMA": True, "K_STAGES": 5,
                       "V_STAGES": 5}, 128),
}


def run(qi, vbs, topk_idx, counts, sm_scale: float, variant: str = "prefetch"
        ) -> torch.Tensor:
    """The kernel on `tilegen.quant.quantize` output (mode "int8_fp8", no Q smoothing)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from tilegen.backends.gluon.prepass import prepass_buffers, run_prepass

    B, S, H, D = qi.q8.shape
    nq, nkv, topk = S // 64, vbs.shape[0], topk_idx.shape[3]
    rows = B * H * nq
    bufs = prepass_buffers(qi.q8.device, rows, topk)
    err = torch.zeros(1, dtype=torch.int32, device=qi.q8.device)
    run_prepass(topk_idx, vbs, counts, bufs, rows, nkv, topk, err, pack=False)
    lay = _layouts()
    o = torch.empty((B, S, H, D), dtype=torch.bfloat16, device=qi.q8.device)

    def desc(t, box, layout):
        rows_, cols_ = t.shape
        return TensorDescriptor(t, [rows_, cols_], [cols_, 1], box, layout)

    q_desc = desc(qi.q8.view(B * S, H * D), [64, 128], lay["q"])
    k_desc = desc(qi.k8.view(B * S, H * D), [64, 128], lay["q"])
    vt_desc = desc(qi.v8t.view(B * H * D, S), [128, 64], lay["vt"])
    o_desc = desc(o.view(B * S, H * D), [64, 128], lay["o"])
    int8_fp8_kernel[(nq, B * H)](
        q_desc, k_desc, vt_desc, o_desc, bufs["sidx"], bufs["tinfo"], bufs["meta"], vbs,
        qi.q_scale, qi.k_scale, qi.v_scale, qi.v_mean, S, H, nq, topk,
        float(sm_scale) * math.log2(math.e), **VARIANTS[variant][0], num_warps=4,
        maxnreg=VARIANTS[variant][1])
    return o


def compile_offline(variant: str):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    lay = _layouts()

    def td(dt, box, layout):
        return f"tensordesc<{dt}[{box[0]}, {box[1]}],{layout!r}>"

    sig = {"q_desc": td("i8", [64, 128], lay["q"]), "k_desc": td("i8", [64, 128], lay["q"]),
           "vt_desc": td("fp8e4nv", [128, 64], lay["vt"]),
           "o_desc": td("bf16", [64, 128], lay["o"]), "sidx_ptr": "*i32", "tinfo_ptr": "*i32",
           "meta_ptr": "*i32", "vbs_ptr": "*i32", "qsc_ptr": "*fp32", "ksc_ptr": "*fp32",
           "vsc_ptr": "*fp32", "vmean_ptr": "*fp32", "seq_len": "i32", "num_heads": "i32",
           "num_q_blocks": "i32", "topk": "i32", "qk_scale": "fp32"}
    consts, maxnreg = VARIANTS[variant]
    sig.update({k: "constexpr" for k in consts})
    ck = triton.compile(GluonASTSource(int8_fp8_kernel, sig, dict(consts)),
                        target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 4, "maxnreg": maxnreg})
    cubin = Path(tempfile.mkdtemp()) / "k.cubin"
    cubin.write_bytes(ck.asm["cubin"])
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    sass = subprocess.run([str(cuobjdump), "--dump-sass", str(cubin)], capture_output=True,
                          text=True, check=True).stdout
    from tilegen.cubin import cubin_matrix_ops, cubin_resources

    return {"variant": variant, "matrix_ops": cubin_matrix_ops(cubin),
            "resources": cubin_resources(cubin), "shared": ck.metadata.shared,
            "STL": sass.count("STL"), "LDL": sass.count("LDL"), "I2F": sass.count("I2F"),
            "loop": main_loop_counts(sass)}


def main_loop_counts(sass: str) -> dict:
    """The instructions of the innermost loop that holds the P.V matmul (QGMMA): the smallest
    [target, branch] range of a backward BRA that contains one. Returns the total and the
    opcodes that make it up (the per-tile, per-thread issue count of bench/NOTES.md)."""
    import re

    ins = []  # (address, opcode, text)
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(3), m.group(4)))
    best = None
    for addr, op, rest in ins:
        if not op.startswith("BRA"):
            continue
        t = re.search(r"0x([0-9a-f]+)", rest)
        if not t or int(t.group(1), 16) >= addr:
            continue
        lo = int(t.group(1), 16)
        body = [o for a, o, _ in ins if lo <= a <= addr]
        if any(o.startswith("QGMMA") or o.startswith("HGMMA") for o in body):
            if best is None or len(body) < len(best):
                best = body
    if best is None:
        return {}
    body = [o for o in best if o != "NOP"]
    hist: dict[str, int] = {}
    for o in body:
        key = o.split(".")[0] if not o.startswith("STS") else o
        hist[key] = hist.get(key, 0) + 1
    top = dict(sorted(hist.items(), key=lambda kv: -kv[1])[:14])
    return {"instructions": len(body), "top": top}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--offline", action="store_true")
    ap.add_argument("--out", default="int8_fp8.json")
    ap.add_argument("--small-only", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated names of VARIANTS to check and time")
    ap.add_argument("--with-prepass", default="prefetch",
                    help="the variant timed with the pre-pass in the call")
    ap.add_argument("--prepass-warps", default="4",
                    help="comma-separated num_warps of the pre-pass to time")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if args.offline:
        for variant in variants:
            print(compile_offline(variant), flush=True)
        return 0
    from triton.testing import do_bench

    from tilegen import captures, quant
    from tilegen.ops import block_sparse_attention
    from tilegen.reference import attention_fp32
    from tilegen.spec import Spec

    dev = "cuda"
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "checks": [], "timing": {}}

    def check(grid, heads, topk, seed):
        cap = captures.synthesize(seed=seed, grid=grid, heads=heads, head_dim=128, topk=topk)
        call_cpu = (cap["q"], cap["k"], cap["v"], cap["topk_idx"], cap["vbs"])
        q, k, v, idx, vbs = (t.to(dev) for t in call_cpu)
        qi = quant.quantize(q, k, v, vbs, "int8_fp8")
        outs = {name: run(qi, vbs, idx, None, 128 ** -0.5, name) for name in variants}
        torch.cuda.synchronize()
        o32, _ = attention_fp32(*call_cpu)
        qi_cpu = type(qi)(**{f: (getattr(qi, f).cpu() if isinstance(getattr(qi, f),
                             torch.Tensor) else getattr(qi, f)) for f in qi.__dataclass_fields__})
        oe = quant.emulate(*call_cpu, mode="int8_fp8", quantized=qi_cpu)
        for name, o in outs.items():
            s = captures.quant_score(o.cpu(), o32.to(torch.bfloat16), oe, o32, vbs=cap["vbs"])
            row = {"grid": grid, "heads": heads, "topk": topk, "seed": seed, "variant": name,
                   "score": str(s), "passed": s.passed}
            out["checks"].append(row)
            print(row, flush=True)
        return q, k, v, idx, vbs

    check((8, 12, 16), 2, 6, 0)
    check((6, 7, 9), 2, 3, 1)
    if not args.small_only:
        spec = Spec()
        check(spec.grid, 4, spec.topk, 0)
        cap = captures.synthesize(seed=0, grid=spec.grid, heads=spec.num_heads, head_dim=128,
                                  topk=spec.topk)
        q, k, v, idx, vbs = (cap[n].to(dev) for n in ("q", "k", "v", "topk_idx", "vbs"))
        qi = quant.quantize(q, k, v, vbs, "int8_fp8")
        t = out["timing"]
        t["bf16_op"] = do_bench(lambda: block_sparse_attention(q, k, v, idx, vbs), rep=300)
        import dataclasses

        import tilegen

        win = tilegen.load(spec)
        cfg = win.config
        unpacked = dataclasses.replace(cfg, options=tuple(sorted(
            {**dict(cfg.options), "pack_partials": False}.items())))
        op_u = tilegen.load(spec, config=unpacked, backend="gluon")
        t["bf16_gluon_winner"] = do_bench(lambda: win(q, k, v, idx, vbs), rep=300)
        t["bf16_gluon_unpacked"] = do_bench(lambda: op_u(q, k, v, idx, vbs), rep=300)
        out["bf16_configs"] = [cfg.name, unpacked.name]
        for name in variants:
            t[f"int8_fp8_{name}"] = do_bench(
                lambda n=name: run(qi, vbs, idx, None, 128 ** -0.5, n), rep=300)
        for nw in (int(w) for w in args.prepass_warps.split(",")):
            t[f"prepass_w{nw}"] = do_bench(lambda nw=nw: quant.quantize_triton(
                q, k, v, vbs, "int8_fp8", num_warps=nw), rep=300)
        wp = args.with_prepass
        t[f"int8_fp8_{wp}_with_prepass"] = do_bench(lambda: run(
            quant.quantize(q, k, v, vbs, "int8_fp8"), vbs, idx, None, 128 ** -0.5, wp), rep=300)
        t["bf16_op_again"] = do_bench(lambda: block_sparse_attention(q, k, v, idx, vbs), rep=300)
        for name, ms in t.items():
            print(f"{name}: {ms:.3f} ms", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
