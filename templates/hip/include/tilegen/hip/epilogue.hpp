// tilegen HIP library, epilogue: o = O / l in the element type; with C::STORE_LSE, lse =
// m + log2(l) (fp32, base 2). A row that saw no key (count 0) has l = 0: it writes o = 0 and
// lse = -inf, never 0/0.
//
// With C::STORE_MAX_PROB, the signal: max_prob = 1 / l per row (the row's largest softmax
// weight; 0 with no key) and the query cube's mean over its real rows: each row-owning wave sums
// its real rows across its lanes and adds sum / n_real to the cube atomically (the op zeroes the
// buffer; the order of the waves' adds may change the last bits of the mean, never max_prob).
//
// With WARPS_N > 1 waves sharing each row group, each with its own (m, l, O) over its key
// slices, they meet in LDS (reusing the pipeline buffers): every wave writes m and l; waves
// wn > 0 write O in their register order (lane-major: conflict-free, and wave 0 reads its own
// positions); wave wn = 0 rescales each part by exp2(m_w - m) with m the max over the waves and
// stores.
#pragma once

#include "tilegen/hip/softmax.hpp"

namespace tg {

template <class C>
struct Epilogue {
  typedef WarpTile<C> W;
  typedef typename C::Mfma Mfma;

  // max_prob_rows, max_prob_cube, cube_row0 (this wave's first row in the cube) and n_real
  // (real rows of the cube) are read with STORE_MAX_PROB only.
  TG_DEVICE static void run(W& w, float* lds, int wm, int wn, int lane, u16* o_rows,
                            i64 row_stride, float* lse_rows, float* max_prob_rows,
                            float* max_prob_cube, int cube_row0, int n_real) {
    const int row = lane % Mfma::MN;
    float l_row[W::REP_M];
#pragma unroll
    for (int rm = 0; rm < W::REP_M; ++rm) l_row[rm] = row_sum<Mfma::MN>(w.l[rm]);
    if constexpr (C::WARPS_N > 1) {
      // [m | l] x WARPS_N x BLOCK_M, then O parts [(wn - 1), wm, rd, rm, r, lane].
      float* ml = lds;
      float* part = lds + 2 * C::WARPS_N * C::BLOCK_M;
      constexpr int PART = W::REP_D * W::REP_M * Mfma::ACC * kWave;
      block_sync();  // every wave is done with the pipeline's LDS
#pragma unroll
      for (int rm = 0; rm < W::REP_M; ++rm) {
        const int r_blk = wm * C::WAVE_M + rm * Mfma::MN + row;
        if (lane < Mfma::MN) {
          ml[wn * C::BLOCK_M + r_blk] = w.m[rm];
          ml[(C::WARPS_N + wn) * C::BLOCK_M + r_blk] = l_row[rm];
        }
      }
      if (wn > 0) {
        float* mine = part + ((wn - 1) * C::WARPS_M + wm) * PART;
#pragma unroll
        for (int rd = 0; rd < W::REP_D; ++rd)
#pragma unroll
          for (int rm = 0; rm < W::REP_M; ++rm)
#pragma unroll
            for (int r = 0; r < Mfma::ACC; ++r)
              mine[((rd * W::REP_M + rm) * Mfma::ACC + r) * kWave + lane] = w.o[rd][rm][r];
      }
      block_sync();
      if (wn > 0) return;
#pragma unroll
      for (int rm = 0; rm < W::REP_M; ++rm) {
        const int r_blk = wm * C::WAVE_M + rm * Mfma::MN + row;
        float m_all = kNegInf;
#pragma unroll
        for (int v = 0; v < C::WARPS_N; ++v)
          m_all = __builtin_fmaxf(m_all, ml[v * C::BLOCK_M + r_blk]);
        // Every wave empty (count 0): scale by exp2(-inf - 0) = 0 instead of exp2(-inf + inf).
        const float base = m_all == kNegInf ? 0.0f : m_all;
        const float c0 = __builtin_exp2f(w.m[rm] - base);
        float l_all = l_row[rm] * c0;
#pragma unroll
        for (int rd = 0; rd < W::REP_D; ++rd) w.o[rd][rm] *= c0;
#pragma unroll
        for (int v = 1; v < C::WARPS_N; ++v) {
          const float cv = __builtin_exp2f(ml[v * C::BLOCK_M + r_blk] - base);
          l_all += cv * ml[(C::WARPS_N + v) * C::BLOCK_M + r_blk];
          const float* theirs = part + ((v - 1) * C::WARPS_M + wm) * PART;
#pragma unroll
          for (int rd = 0; rd < W::REP_D; ++rd)
#pragma unroll
            for (int r = 0; r < Mfma::ACC; ++r)
              w.o[rd][rm][r] += cv * theirs[((rd * W::REP_M + rm) * Mfma::ACC + r) * kWave + lane];
        }
        w.m[rm] = m_all;
        l_row[rm] = l_all;
      }
    } else {
      static_cast<void>(lds);
      static_cast<void>(wm);
      static_cast<void>(wn);
    }
#pragma unroll
    for (int rm = 0; rm < W::REP_M; ++rm) {
      const float l_safe = l_row[rm] > 0.0f ? l_row[rm] : 1.0f;
      u16* o_row = o_rows + (rm * Mfma::MN + row) * row_stride;
      // Registers 4j .. 4j+3 of an O^T tile are d = acc_row(lane, 4j) + 0..3: one 8-byte store.
#pragma unroll
      for (int rd = 0; rd < W::REP_D; ++rd)
#pragma unroll
        for (int j = 0; j < Mfma::ACC / 4; ++j) {
          const int d = rd * Mfma::MN + Mfma::acc_row(lane, 4 * j);
          store_vec<u32x2>(o_row + d, C::Elem::pack4(w.o[rd][rm][4 * j] / l_safe,
                                                     w.o[rd][rm][4 * j + 1] / l_safe,
                                                     w.o[rd][rm][4 * j + 2] / l_safe,
                                                     w.o[rd][rm][4 * j + 3] / l_safe));
        }
      if constexpr (C::STORE_LSE) {
        if (lane < Mfma::MN)  // one lane group writes each row's lse
          lse_rows[rm * Mfma::MN + row] =
              l_row[rm] > 0.0f ? w.m[rm] + __builtin_log2f(l_safe) : kNegInf;
      }
    }
    if constexpr (!C::STORE_LSE) static_cast<void>(lse_rows);
    if constexpr (C::STORE_MAX_PROB) {
      float share = 0.0f;  // sum of max_prob over this wave's real rows (lanes of one group)
#pragma unroll
      for (int rm = 0; rm < W::REP_M; ++rm) {
        const float l = l_row[rm];
        const float peak = l > 0.0f ? 1.0f / l : (l == 0.0f ? 0.0f : l);  // NaN stays NaN
        if (lane < Mfma::MN) max_prob_rows[rm * Mfma::MN + row] = peak;
        if (cube_row0 + rm * Mfma::MN + row < n_real) share += peak;
      }
#pragma unroll
      for (int mask = 1; mask < Mfma::MN; mask <<= 1) share += lane_xor(share, mask);
      if (lane == 0) atomic_add_f32(max_prob_cube, share / static_cast<float>(n_real));
    } else {
      static_cast<void>(max_prob_rows);
      static_cast<void>(max_prob_cube);
      static_cast<void>(cube_row0);
      static_cast<void>(n_real);
    }
  }
};

}  // namespace tg
