// tilegen CUDA library, kernel traits: a rendered kernel names its primary parameters in a
// struct (element type, token layout, head_dim, cube and tile sizes, warps, stages, and the
// compile-time options: variable block sizes, lse, the max_prob signal); KernelTraits adds
// what follows from them and checks the tiling rules. Every tile piece is a template over it.
#pragma once

namespace tilegen {

// C provides:
//   using Elem = Bf16 | Fp16;      the 16-bit element type (its mma.sync and pack)
//   using Layout = Bshd | Bhsd;    where token rows of q, k, v, o live
//   static constexpr int kHeadDim, kBlockQ (query tokens per cube: one LUT row), kBlockKV (key
//     tokens per cube), kBlockM (query rows per CTA), kBlockN (keys per pipeline step), kWarps,
//     kStages (K/V buffers in the cp.async ring);
//   static constexpr bool kVbs (partial cubes: keys past vbs[cube] are masked; off: every cube
//     is full and vbs is never read), kStoreLse (write lse), kStoreMaxProb (write the signal).
template <class C>
struct KernelTraits : C {
  static constexpr int kThreads = C::kWarps * 32;
  static constexpr int kWarpM = C::kBlockM / C::kWarps;  // query rows per warp
  static constexpr int kQBytes = C::kBlockM * C::kHeadDim * 2;
  static constexpr int kTileBytes = C::kBlockN * C::kHeadDim * 2;
  static constexpr int kStageBytes = 2 * kTileBytes;  // K tile + V tile
  static constexpr int kSmemBytes = kQBytes + C::kStages * kStageBytes;
  static_assert(kWarpM % 16 == 0, "each warp owns whole m16 row tiles");
  static_assert(C::kBlockN % 16 == 0 && C::kHeadDim % 16 == 0, "k16 / n16 steps");
  static_assert(C::kBlockQ % C::kBlockM == 0 && C::kBlockKV % C::kBlockN == 0,
                "tiles never straddle cubes");
  static_assert(C::kStages >= 1, "at least one K/V buffer");
};

}  // namespace tilegen
