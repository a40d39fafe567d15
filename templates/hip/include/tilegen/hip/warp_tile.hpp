// tilegen HIP library, warp tile: one wave's share of the block tile and the two GEMMs
// (S^T = K Q^T and O^T += V^T P^T) on register fragments, with the config's MFMA (C::Mfma).
#pragma once

#include "tilegen/hip/block_tile.hpp"
#include "tilegen/hip/elem.hpp"

namespace tg {

// The kernel computes S^T = K Q^T and O^T = V^T P^T rather than S and O (lane maps in
// elem.hpp). Then every register a lane holds belongs to query row l % MN (a C column), so the
// online softmax needs lane shuffles only across the G lane groups of a row and rescales O with
// a per-lane alpha. And the S^T registers 4k .. 4k+3 of a lane are exactly its B operand (P^T)
// for K-step k of the PV MFMA, since acc_row(l, 4k + t) = K * k + 4 * (l / MN) + t: P never
// leaves registers.
//
// Wave (wm, wn) owns query rows [wm * WAVE_M, +WAVE_M) of the block tile and, of each BLOCK_N-key
// sub-tile, the keys [wn * SLICE_N, +SLICE_N). REP_* MFMA tiles cover them.
template <class C>
struct WarpTile {
  typedef typename C::Mfma Mfma;
  typedef typename Mfma::acc acc;
  static constexpr int MN = Mfma::MN;
  static constexpr int REP_M = C::WAVE_M / MN;
  static constexpr int REP_N = C::SLICE_N / MN;
  static constexpr int REP_D = C::HEAD_DIM / MN;
  static constexpr int QK_STEPS = C::HEAD_DIM / Mfma::K;  // K-steps of S^T = K Q^T
  static constexpr int PV_STEPS = MN / Mfma::K;            // K-steps of O^T per MN keys
  static_assert(C::WAVE_M % MN == 0 && C::SLICE_N % MN == 0 && C::HEAD_DIM % MN == 0,
                "the wave tile is a whole number of MFMA tiles");

  u32x2 q[REP_M][QK_STEPS];  // Q^T fragments (B operand), loaded once
  acc s[REP_N][REP_M];       // S^T of the current slice, then P^T
  acc o[REP_D][REP_M];       // O^T accumulator, fp32
  float m[REP_M];            // running row max, base 2, of query row (rm * MN + lane % MN)
  float l[REP_M];            // this lane's part of the running row sum (the G groups add up)

  TG_DEVICE void init() {
#pragma unroll
    for (int rm = 0; rm < REP_M; ++rm) {
      m[rm] = kNegInf;
      l[rm] = 0.0f;
#pragma unroll
      for (int rd = 0; rd < REP_D; ++rd) o[rd][rm] = acc{};
    }
  }

  // q_rows: the wave's first query row in global memory. B operand of S^T = K Q^T:
  // B[k = d][col = query] = Q[query][d], so lane l loads d = 4 * (l / MN) + t of row l % MN:
  // one 8-byte load.
  TG_DEVICE void load_q(const u16* q_rows, i64 row_stride, int lane) {
    const int row = lane % MN;
    const int k0 = 4 * (lane / MN);
#pragma unroll
    for (int rm = 0; rm < REP_M; ++rm)
#pragma unroll
      for (int ks = 0; ks < QK_STEPS; ++ks)
        q[rm][ks] = load_vec<u32x2>(q_rows + (rm * MN + row) * row_stride + ks * Mfma::K + k0);
  }

  // S^T = K_slice Q^T. stage: the LDS stage; key0: the slice's first key in the sub-tile.
  // A[row = key][k = d]: lane l reads d = 4 * (l / MN) + t of key l % MN, one 8-byte unit.
  TG_DEVICE void qk(const u16* stage, int key0, int lane) {
    const int row = lane % MN;
    const int k0 = 4 * (lane / MN);
#pragma unroll
    for (int rn = 0; rn < REP_N; ++rn) {
#pragma unroll
      for (int rm = 0; rm < REP_M; ++rm) s[rn][rm] = acc{};
#pragma unroll
      for (int ks = 0; ks < QK_STEPS; ++ks) {
        const u32x2 a =
            load_vec<u32x2>(stage + StageLayout<C>::k(key0 + rn * MN + row, ks * Mfma::K + k0));
#pragma unroll
        for (int rm = 0; rm < REP_M; ++rm) s[rn][rm] = Mfma::mma(a, q[rm][ks], s[rn][rm]);
      }
    }
  }

  // O^T += V^T P^T. A[row = d][k = key]: lane l reads keys 4 * (l / MN) + t of d row l % MN,
  // one 8-byte unit of V^T. B = P^T: the S^T registers 4 * ps .. 4 * ps + 3 rounded to the
  // element type (the Triton kernel's p.to(v.dtype)).
  TG_DEVICE void pv(const u16* stage, int key0, int lane) {
    const int row = lane % MN;
    const int k0 = 4 * (lane / MN);
#pragma unroll
    for (int rn = 0; rn < REP_N; ++rn) {
#pragma unroll
      for (int ps = 0; ps < PV_STEPS; ++ps) {
        u32x2 b[REP_M];
#pragma unroll
        for (int rm = 0; rm < REP_M; ++rm)
          b[rm] = C::Elem::pack4(s[rn][rm][4 * ps], s[rn][rm][4 * ps + 1], s[rn][rm][4 * ps + 2],
                                 s[rn][rm][4 * ps + 3]);
#pragma unroll
        for (int rd = 0; rd < REP_D; ++rd) {
          const u32x2 a = load_vec<u32x2>(
              stage + StageLayout<C>::vt(rd * MN + row, key0 + rn * MN + ps * Mfma::K + k0));
#pragma unroll
          for (int rm = 0; rm < REP_M; ++rm) o[rd][rm] = Mfma::mma(a, b[rm], o[rd][rm]);
        }
      }
    }
  }
};

}  // namespace tg
