// tilegen HIP library, kernel config: a rendered kernel names its primary parameters in a struct
// P; KernelConfig<P> adds what follows from them. Every tile piece is a template over it.
#pragma once

#include "tilegen/hip/elem.hpp"

namespace tg {

// P provides:
//   typedef Bf16 | F16 Elem;        the 16-bit element type
//   typedef Bshd | Bhsd Layout;     where token rows of q, k, v, o live
//   static constexpr int MFMA_MN    32 (v_mfma_f32_32x32x8*) or 16 (v_mfma_f32_16x16x16*),
//     HEAD_DIM, BLOCK_Q, BLOCK_KV (tokens per query / key cube), BLOCK_M, BLOCK_N (query rows
//     and keys per workgroup step), STAGES (LDS buffers for K/V), WARPS_M, WARPS_N (waves over
//     the rows and over the keys of a sub-tile);
//   static constexpr bool VBS (partial cubes: keys past vbs[cube] are masked; off: every cube
//     is full and vbs is never read), STORE_LSE (write lse), STORE_MAX_PROB (write the signal).
template <class P>
struct KernelConfig : P {
  typedef MfmaTile<typename P::Elem, P::MFMA_MN> Mfma;
  static constexpr int THREADS = P::WARPS_M * P::WARPS_N * kWave;
  static constexpr int WAVE_M = P::BLOCK_M / P::WARPS_M;
  static constexpr int SLICE_N = P::BLOCK_N / P::WARPS_N;
  static constexpr int SUBTILES = P::BLOCK_KV / P::BLOCK_N;
  // K and V^T, swizzled, no padding
  static constexpr int STAGE_ELEMS = 2 * P::BLOCK_N * P::HEAD_DIM;
  static constexpr int PIPELINE_BYTES = 2 * P::STAGES * STAGE_ELEMS;
  static constexpr int MERGE_BYTES =
      P::WARPS_N == 1 ? 0
                      : 4 * (2 * P::WARPS_N * P::BLOCK_M
                             + (P::WARPS_N - 1) * P::BLOCK_M * P::HEAD_DIM);
  static constexpr int LDS_BYTES = PIPELINE_BYTES > MERGE_BYTES ? PIPELINE_BYTES : MERGE_BYTES;
  static_assert(LDS_BYTES <= 65536, "gfx942 has 64 KiB of LDS per workgroup");
  static_assert(P::HEAD_DIM % 8 == 0 && P::BLOCK_N % 16 == 0,
                "16-byte copy chunks and whole 8-byte LDS units per row");
  static_assert(P::BLOCK_Q % P::BLOCK_M == 0 && P::BLOCK_KV % P::BLOCK_N == 0,
                "tiles never straddle two cubes");
};

}  // namespace tg
