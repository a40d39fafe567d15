// tilegen HIP library, softmax stage: the online softmax in base 2 on one slice, as the Triton
// kernel does per sub-tile:
//   s = (K Q^T) * qk_scale (qk_scale = sm_scale * log2 e), masked keys -> -inf
//   m_new = max(m, rowmax(s));  p = exp2(s - m_new);  alpha = exp2(m - m_new)
//   l = l * alpha + rowsum(p);  o = o * alpha (+ P V in the warp tile);  m = m_new
// Subtracting the running max keeps every exp2 argument <= 0, whatever the logits (the outlier
// head's are several hundred). A slice always holds a real key here (slices wholly past vbs
// are skipped), so m_new is finite and exp2(-inf - m_new) = 0. The row max is exact across the
// G lane groups (the same alpha everywhere); the row sum stays per lane until the epilogue.
#pragma once

#include "tilegen/hip/warp_tile.hpp"

namespace tg {

// Across the lane groups of a row (lanes MN apart) of an MN x MN MFMA tile.
template <int MN>
TG_DEVICE float row_max(float x) {
#pragma unroll
  for (int mask = MN; mask < kWave; mask <<= 1) x = __builtin_fmaxf(x, lane_xor(x, mask));
  return x;
}
template <int MN>
TG_DEVICE float row_sum(float x) {
#pragma unroll
  for (int mask = MN; mask < kWave; mask <<= 1) x += lane_xor(x, mask);
  return x;
}

template <class C>
struct SoftmaxStage {
  // valid_keys: keys of the slice before vbs (only read when MASKED; >= 1).
  template <bool MASKED>
  static TG_DEVICE void run(WarpTile<C>& w, float qk_scale, int valid_keys, int lane) {
    typedef WarpTile<C> W;
    typedef typename C::Mfma Mfma;
#pragma unroll
    for (int rm = 0; rm < W::REP_M; ++rm) {
      float mx = kNegInf;
#pragma unroll
      for (int rn = 0; rn < W::REP_N; ++rn)
#pragma unroll
        for (int r = 0; r < Mfma::ACC; ++r) {
          float x = w.s[rn][rm][r] * qk_scale;
          if (MASKED && rn * Mfma::MN + Mfma::acc_row(lane, r) >= valid_keys) x = kNegInf;
          w.s[rn][rm][r] = x;
          mx = __builtin_fmaxf(mx, x);
        }
      const float m_new = __builtin_fmaxf(w.m[rm], row_max<Mfma::MN>(mx));
      const float alpha = __builtin_exp2f(w.m[rm] - m_new);
      float sum = 0.0f;
#pragma unroll
      for (int rn = 0; rn < W::REP_N; ++rn)
#pragma unroll
        for (int r = 0; r < Mfma::ACC; ++r) {
          const float pr = __builtin_exp2f(w.s[rn][rm][r] - m_new);
          w.s[rn][rm][r] = pr;
          sum += pr;
        }
      w.l[rm] = w.l[rm] * alpha + sum;
      w.m[rm] = m_new;
#pragma unroll
      for (int rd = 0; rd < W::REP_D; ++rd) w.o[rd][rm] *= alpha;
    }
  }
};

}  // namespace tg
