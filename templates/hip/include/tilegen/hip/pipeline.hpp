// tilegen HIP library, pipeline: STAGES LDS buffers for K/V sub-tiles. The prologue fills
// STAGES - 1 of them; each loop step then (1) waits at one barrier, after which tile t is in
// buffer t % STAGES and nobody reads buffer (t - 1) % STAGES any more, (2) issues the global
// loads of tile t + STAGES - 1, (3) runs the MFMAs and softmax of tile t while those loads fly,
// (4) writes the loaded tile into the buffer freed in (1). STAGES = 1 degenerates to load /
// barrier / compute.
#pragma once

#include "tilegen/hip/block_tile.hpp"
#include "tilegen/hip/epilogue.hpp"
#include "tilegen/hip/softmax.hpp"
#include "tilegen/hip/warp_tile.hpp"

namespace tg {

template <class C>
struct FmhaLutPipeline {
  typedef WarpTile<C> W;
  typedef typename C::Layout TokenLayout;

  // One sub-tile through this wave's slice: skipped when wholly past vbs, masked only when vbs
  // cuts it, unmasked otherwise (full cubes never pay for the mask; without variable block
  // sizes every slice is full).
  TG_DEVICE static void compute(W& w, const KvCursor<C>& cur, const u16* stage, int wn,
                                float qk_scale, int lane) {
    const int key0 = wn * C::SLICE_N;  // this wave's first key in the sub-tile
    if constexpr (C::VBS) {
      const int valid_keys = cur.n_valid - (cur.sub * C::BLOCK_N + key0);
      if (valid_keys <= 0) return;
      w.qk(stage, key0, lane);
      if (valid_keys >= C::SLICE_N)
        SoftmaxStage<C>::template run<false>(w, qk_scale, valid_keys, lane);
      else
        SoftmaxStage<C>::template run<true>(w, qk_scale, valid_keys, lane);
      w.pv(stage, key0, lane);
    } else {
      static_cast<void>(cur);
      w.qk(stage, key0, lane);
      SoftmaxStage<C>::template run<false>(w, qk_scale, C::SLICE_N, lane);
      w.pv(stage, key0, lane);
    }
  }

  // max_prob, max_prob_cube: read with STORE_MAX_PROB only (the entry point passes nullptr
  // otherwise).
  TG_DEVICE static void run(u16* smem, const u16* Q, const u16* K, const u16* V, const int* lut,
                            const int* counts, const int* vbs, u16* O, float* lse,
                            float* max_prob, float* max_prob_cube, int seq_len,
                            int num_heads, int num_q_blocks, int topk, float qk_scale) {
    const int tid = thread_id();
    const int lane = lane_id();
    const int wave = wave_id();
    const int wm = wave % C::WARPS_M;
    const int wn = wave / C::WARPS_M;
    const int pid_m = static_cast<int>(__builtin_amdgcn_workgroup_id_x());
    const i64 bh = static_cast<i64>(__builtin_amdgcn_workgroup_id_y());
    const i64 b = bh / num_heads;
    const i64 h = bh % num_heads;
    const int q_cube = pid_m / (C::BLOCK_Q / C::BLOCK_M);
    const i64 base = TokenLayout::base(b, h, seq_len, num_heads, C::HEAD_DIM);
    const i64 row_stride = TokenLayout::row_stride(num_heads, C::HEAD_DIM);
    const int q_row0 = pid_m * C::BLOCK_M + wm * C::WAVE_M;  // this wave's first query row

    W w;
    w.init();
    w.load_q(Q + base + q_row0 * row_stride, row_stride, lane);
    // Let Q land before the loop. Otherwise the waitcnt pass, merging the loop's prefetch and
    // no-prefetch paths, cannot tell Q's loads from the in-flight K/V prefetch and makes the
    // QK MFMAs wait for vmcnt(0): the prefetch would never overlap the MFMAs.
    wait_global_loads();

    const i64 lut_row = (bh * num_q_blocks + q_cube);
    const int n_blocks = counts != nullptr ? counts[lut_row] : topk;  // nullptr: every row has TOPK
    KvCursor<C> next(lut + lut_row * topk, vbs, n_blocks);  // next tile to load
    KvCursor<C> cur = next;                                // tile to compute
    KvBlockTile<C> regs;

#pragma unroll
    for (int s = 0; s + 1 < C::STAGES; ++s) {
      if (next.valid()) {
        regs.load(K, V, base + next.first_token() * row_stride, row_stride, tid);
        regs.store(smem + s * C::STAGE_ELEMS, tid);
        next.advance();
      }
    }
    int buf = 0;
    while (cur.valid()) {
      if constexpr (C::STAGES == 1) {
        block_sync();  // everyone is done reading the previous tile
        regs.load(K, V, base + cur.first_token() * row_stride, row_stride, tid);
        regs.store(smem, tid);
      }
      block_sync();
      const bool prefetch = C::STAGES > 1 && next.valid();
      if (prefetch) regs.load(K, V, base + next.first_token() * row_stride, row_stride, tid);
      compute(w, cur, smem + buf * C::STAGE_ELEMS, wn, qk_scale, lane);
      if (prefetch) {
        regs.store(smem + ((buf + C::STAGES - 1) % C::STAGES) * C::STAGE_ELEMS, tid);
        next.advance();
      }
      cur.advance();
      buf = buf + 1 == C::STAGES ? 0 : buf + 1;
    }

    // real rows of the query cube (vbs[q_cube], clamped: the HIP op checks values eagerly)
    int n_real = 0;
    if constexpr (C::STORE_MAX_PROB) {
      int n_vbs = C::BLOCK_Q;
      if constexpr (C::VBS) n_vbs = vbs[q_cube];
      n_real = n_vbs < 1 ? 1 : (n_vbs > C::BLOCK_Q ? C::BLOCK_Q : n_vbs);
    }
    Epilogue<C>::run(w, reinterpret_cast<float*>(smem), wm, wn, lane,
                     O + base + q_row0 * row_stride, row_stride,
                     lse + bh * seq_len + q_row0,
                     C::STORE_MAX_PROB ? max_prob + bh * seq_len + q_row0 : nullptr,
                     C::STORE_MAX_PROB ? max_prob_cube + lut_row : nullptr,
                     q_row0 - q_cube * C::BLOCK_Q, n_real);
  }
};

}  // namespace tg
