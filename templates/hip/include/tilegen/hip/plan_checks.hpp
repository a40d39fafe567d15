// tilegen HIP library, plan checks: fingerprints of the index maps (every lane x register,
// every LDS unit, every copy chunk), which a rendered kernel compares (static_assert) with the
// ones tilegen's HipPlan computes from its own copy of the maps (HipPlan.fingerprints). The
// launcher uses the plan (grid, block); if the two ever disagree, the kernel does not compile.
#pragma once

#include "tilegen/hip/block_tile.hpp"

namespace tg {

constexpr unsigned fingerprint_step(unsigned h, int x) {
  return h * 1000003u + static_cast<unsigned>(x);
}
template <class C>
constexpr unsigned fingerprint_acc_rows() {
  typedef typename C::Mfma Mfma;
  unsigned h = 0;
  for (int lane = 0; lane < kWave; ++lane)
    for (int r = 0; r < Mfma::ACC; ++r) h = fingerprint_step(h, Mfma::acc_row(lane, r));
  return h;
}
template <class C>
constexpr unsigned fingerprint_lds() {
  unsigned h = 0;
  for (int key = 0; key < C::BLOCK_N; ++key)
    for (int d = 0; d < C::HEAD_DIM; ++d) {
      h = fingerprint_step(h, StageLayout<C>::k(key, d));
      h = fingerprint_step(h, StageLayout<C>::vt(d, key));
    }
  return h;
}
template <class C>
constexpr unsigned fingerprint_copy() {
  typedef KvBlockTile<C> T;
  unsigned h = 0;
  for (int c = 0; c < T::CHUNKS; ++c) {
    h = fingerprint_step(fingerprint_step(h, T::k_key(c)), T::k_d(c));
    h = fingerprint_step(fingerprint_step(h, T::v_key(c)), T::v_d(c));
  }
  return h;
}

}  // namespace tg
