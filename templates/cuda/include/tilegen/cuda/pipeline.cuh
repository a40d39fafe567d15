// tilegen CUDA library, pipeline stages: the LUT cursor (which KV sub-tile comes next) and the
// multi-stage cp.async ring of K/V tiles in shared memory. Without variable block sizes
// (T::kVbs false) there is no vbs lookup, no metadata ring and every sub-tile is full.
#pragma once

#include "tilegen/cuda/block_tile.cuh"

namespace tilegen {

// The global tables a cursor reads: the LUT row and, with variable block sizes, vbs. A base class
// rather than a member: without vbs the cursor has no vbs field at all and the other fields keep
// their offsets, so each variant compiles to the code it would get had the field never been
// written (an unused or empty field in the middle renumbers nvcc's registers).
template <bool kVbs>
struct LutTables {
  const int* lut;
  const int* vbs;
};
template <>
struct LutTables<false> {
  const int* lut;
};

// Walks one LUT row: for each selected KV cube its kBlockKV / kBlockN sub-tiles of kBlockN keys,
// skipping (kVbs) sub-tiles that lie wholly past vbs[cube] (sub-tile 0 always holds a key:
// vbs >= 1), or all of them (every cube full). LUT entries are prefetched two ahead and (kVbs)
// vbs one ahead, so advance() never waits on a dependent global load.
template <int kBlockKV, int kBlockN, bool kVbs>
struct LutCursor : LutTables<kVbs> {
  static constexpr int kSubTiles = kBlockKV / kBlockN;
  using LutTables<kVbs>::lut;
  int n;         // LUT entries to walk (counts[row] or topk)
  int i;         // current entry
  int sub;       // current sub-tile of the current cube
  int cube;      // lut[i]
  int n_valid;   // real keys in cube (vbs[cube])
  int cube_n1;   // lut[i + 1]
  int cube_n2;   // lut[i + 2]
  int n_valid_n1;  // vbs[lut[i + 1]] (kVbs only; an unused last field changes nothing)

  __device__ __forceinline__ int entry(int j) const { return j < n ? __ldg(lut + j) : 0; }
  __device__ __forceinline__ int valid_of(int c) const {
    if constexpr (kVbs) {
      return __ldg(this->vbs + c);
    } else {
      return kBlockKV;
    }
  }

  __device__ __forceinline__ void init(const int* lut_row, const int* vbs_, int count) {
    lut = lut_row;
    if constexpr (kVbs) this->vbs = vbs_;
    n = count;
    i = 0;
    sub = 0;
    cube = entry(0);
    n_valid = valid_of(cube);
    cube_n1 = entry(1);
    cube_n2 = entry(2);
    if constexpr (kVbs) n_valid_n1 = valid_of(cube_n1);
  }
  __device__ __forceinline__ bool valid() const { return i < n; }
  // First token row of the current sub-tile within the (b, h) sequence.
  __device__ __forceinline__ long long row() const {
    return static_cast<long long>(cube) * kBlockKV + sub * kBlockN;
  }
  // Real keys in the current sub-tile; >= kBlockN means the sub-tile needs no mask.
  __device__ __forceinline__ int valid_keys() const { return n_valid - sub * kBlockN; }

  __device__ __forceinline__ void advance() {
    ++sub;
    if constexpr (kVbs) {
      if (sub < kSubTiles && sub * kBlockN < n_valid) return;
    } else {
      if (sub < kSubTiles) return;
    }
    sub = 0;
    ++i;
    cube = cube_n1;
    if constexpr (kVbs) n_valid = n_valid_n1;
    cube_n1 = cube_n2;
    if constexpr (kVbs) n_valid_n1 = valid_of(cube_n1);
    cube_n2 = entry(i + 2);
  }
};

// Where the ring's tiles come from and go: the K and V rows of one (b, h), the shared buffers,
// and with variable block sizes the stage metadata (a base class, as LutTables: without vbs the
// pipeline has no metadata field and the others keep their offsets).
struct KvSource {
  unsigned smem;          // shared address of stage 0's K tile
  const elem_t* k;        // k + (b, h) base
  const elem_t* v;
  long long row_stride;
};
template <bool kVbs>
struct KvRing : KvSource {
  int* meta;              // per stage: valid keys of the tile it holds (read by the consumer)
};
template <>
struct KvRing<false> : KvSource {};

// kStages shared-memory buffers of (K tile, V tile). The producer fills buffer
// (tile % kStages) kStages - 1 tiles ahead of the consumer; one cp.async group per tile.
template <class T>
struct KvPipeline : KvRing<T::kVbs> {
  using Copy = TileCopy<T::kBlockN, T::kHeadDim, T::kThreads>;
  using KvSource::k;
  using KvSource::row_stride;
  using KvSource::smem;
  using KvSource::v;
  LutCursor<T::kBlockKV, T::kBlockN, T::kVbs> cursor;
  int produced;           // tiles issued so far

  __device__ __forceinline__ unsigned k_tile(int stage) const {
    return smem + stage * T::kStageBytes;
  }
  __device__ __forceinline__ unsigned v_tile(int stage) const {
    return smem + stage * T::kStageBytes + T::kTileBytes;
  }
  // Real keys of the tile in `stage` (all kBlockN without variable block sizes).
  __device__ __forceinline__ int valid(int stage) const {
    if constexpr (T::kVbs) {
      return this->meta[stage];
    } else {
      return T::kBlockN;
    }
  }

  // Issue the next tile's loads into `stage` (if any tile is left) and close a cp.async group
  // either way, so "tile t landed" is always "at most kStages - 2 groups pending".
  __device__ __forceinline__ void produce(int stage, int tid) {
    if (cursor.valid()) {
      const long long offset = cursor.row() * row_stride;
      Copy::load(k_tile(stage), k + offset, row_stride, tid);
      Copy::load(v_tile(stage), v + offset, row_stride, tid);
      if constexpr (T::kVbs) {
        if (tid == 0) this->meta[stage] = cursor.valid_keys();
      }
      cursor.advance();
      ++produced;
    }
    cp_async_commit();
  }
};

}  // namespace tilegen
