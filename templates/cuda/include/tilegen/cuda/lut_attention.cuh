// tilegen CUDA library: block-sparse attention over a LUT, CK-style. The tile pieces (block tile,
// warp tile with mma.sync m16n8k16, pipeline stages with a cp.async K/V ring, softmax stage,
// epilogue) are templates over one KernelTraits; lut_attention<T> is the block pipeline that
// drives them. A rendered kernel (tilegen/backends/cuda/nvcc.py, templates/cuda/lut_kernel.cu.j2)
// is its traits and an extern "C" entry point that calls lut_attention. Valid for sm_90a and
// sm_100a.
//
// Grid (num_q_blocks * kBlockQ / kBlockM, batch * heads), kThreads threads, kSmemBytes of dynamic
// shared memory. Each CTA takes kBlockM rows of one query cube (kWarps warps x kWarpM rows) and
// walks that cube's LUT row: per selected KV cube, kBlockKV / kBlockN sub-tiles of kBlockN keys
// through an online softmax in base 2. With variable block sizes (kVbs), partial cubes
// (vbs < kBlockKV) mask keys past vbs and full sub-tiles take the unmasked path; without, every
// KV cube is full and vbs is ignored.
// Outputs: o (input dtype, q's layout); with kStoreLse, lse fp32 (B, H, S) = max + log2(sum) in
// base-2 units; with kStoreMaxProb, the signal: max_prob fp32 (B, H, S) = 1 / l per row (0 with
// no key) and max_prob_cube fp32 (B, H, NQ) = its mean over the first vbs[q_cube] rows (all rows
// without variable block sizes).
#pragma once

#include "tilegen/cuda/block_tile.cuh"
#include "tilegen/cuda/epilogue.cuh"
#include "tilegen/cuda/kernel_traits.cuh"
#include "tilegen/cuda/pipeline.cuh"
#include "tilegen/cuda/ptx.cuh"
#include "tilegen/cuda/softmax.cuh"
#include "tilegen/cuda/warp_tile.cuh"

namespace tilegen {

// ---- the block pipeline: Q once, then the K/V ring over the LUT row -----------------------------
// Arguments as in the Triton kernel: q, k, v, lut (B, H, NQ, TOPK) int32, counts (B, H, NQ) int32
// or nullptr (every row walks all topk entries), vbs (NKV,) int32, o, lse (B, H, S) fp32 (read
// with kStoreLse only), max_prob (B, H, S) and max_prob_cube (B, H, NQ) fp32 (kStoreMaxProb
// only), then seq_len, num_heads, num_q_blocks, topk, qk_scale = sm_scale * log2(e).
template <class T>
__device__ __forceinline__ void lut_attention(
    const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
    const int* __restrict__ lut, const int* __restrict__ counts, const int* __restrict__ vbs,
    elem_t* __restrict__ o, float* __restrict__ lse, float* __restrict__ max_prob,
    float* __restrict__ max_prob_cube, int seq_len, int num_heads,
    int num_q_blocks, int topk, float qk_scale) {
  using Warp = WarpTile<T>;
  using Layout = typename T::Layout;
  extern __shared__ __align__(128) unsigned char smem[];  // [Q tile][stage 0: K, V][stage 1 ...]
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp_row0 = (tid >> 5) * T::kWarpM;
  const int pid_m = blockIdx.x;
  const long long bh = blockIdx.y;
  const long long b = bh / num_heads;
  const long long h = bh % num_heads;
  const int q_cube = pid_m / (T::kBlockQ / T::kBlockM);
  const long long base = Layout::base(b, h, seq_len, num_heads, T::kHeadDim);
  const long long row_stride = Layout::row_stride(num_heads, T::kHeadDim);
  const long long q_row0 = static_cast<long long>(pid_m) * T::kBlockM;
  const unsigned s_q = smem_u32(smem);

  // Q rides in the first cp.async group, together with the first K/V tile.
  TileCopy<T::kBlockM, T::kHeadDim, T::kThreads>::load(s_q, q + base + q_row0 * row_stride,
                                                       row_stride, tid);
  const long long lut_row = bh * num_q_blocks + q_cube;
  KvPipeline<T> kv;
  kv.smem = s_q + T::kQBytes;
  kv.k = k + base;  // K and V share Q's shape and layout
  kv.v = v + base;
  kv.row_stride = row_stride;
  if constexpr (T::kVbs) {
    __shared__ int meta[T::kStages];  // per stage: the valid keys of the tile it holds
    kv.meta = meta;
  }
  kv.produced = 0;
  // counts == nullptr: every row walks all topk entries.
  kv.cursor.init(lut + lut_row * topk, vbs, counts != nullptr ? __ldg(counts + lut_row) : topk);

  float acc[Warp::kMTiles][Warp::kDTiles][4];
#pragma unroll
  for (int mt = 0; mt < Warp::kMTiles; ++mt)
#pragma unroll
    for (int dt = 0; dt < Warp::kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][dt][e] = 0.f;
  OnlineSoftmax<T> softmax;
  softmax.init();

  // One pipeline step on the tile in `stage`: S = Q K^T, softmax, O += P V.
  auto consume = [&](int stage, int valid) {
    float s[Warp::kMTiles][Warp::kNTiles][4];
    Warp::qk(s, s_q, kv.k_tile(stage), warp_row0, lane);
    if constexpr (T::kVbs) {
      if (valid >= T::kBlockN) {  // runtime branch: full sub-tiles skip the mask entirely
        softmax.template step<false>(s, acc, qk_scale, T::kBlockN, lane);
      } else {
        softmax.template step<true>(s, acc, qk_scale, valid, lane);
      }
    } else {
      softmax.template step<false>(s, acc, qk_scale, valid, lane);
    }
    Warp::pv(acc, s, kv.v_tile(stage), lane);
  };

  if constexpr (T::kStages == 1) {
    cp_async_commit();  // Q
    while (kv.cursor.valid()) {
      __syncthreads();  // the single buffer is free again
      kv.produce(0, tid);
      cp_async_wait<0>();
      __syncthreads();
      consume(0, kv.valid(0));
    }
  } else {
#pragma unroll
    for (int stage = 0; stage < T::kStages - 1; ++stage) kv.produce(stage, tid);
    int stage = 0;
    // kv.produced runs kStages - 1 tiles ahead until the LUT row is exhausted.
    for (int tile = 0; tile < kv.produced; ++tile) {
      cp_async_wait<T::kStages - 2>();  // tile `tile` has landed (this thread's copies) ...
      __syncthreads();  // ... for every thread, and every warp is done with tile - 1's buffer
      const int valid = kv.valid(stage);
      kv.produce(stage == 0 ? T::kStages - 1 : stage - 1, tid);  // refill tile - 1's buffer
      consume(stage, valid);
      stage = stage == T::kStages - 1 ? 0 : stage + 1;
    }
  }
  cp_async_wait<0>();  // Q has landed even for an empty row; no copy is still writing
  __syncthreads();
  // kStoreMaxProb: real query rows of the cube (vbs[q_cube], clamped: the C++ ops check values
  // eagerly) and this tile's first row in the cube
  int n_real = 0;
  int cube_row0 = 0;
  if constexpr (T::kStoreMaxProb) {
    if constexpr (T::kVbs) {
      n_real = min(max(__ldg(vbs + q_cube), 1), T::kBlockQ);
    } else {
      n_real = T::kBlockQ;
    }
    cube_row0 = (pid_m % (T::kBlockQ / T::kBlockM)) * T::kBlockM;
  }
  Epilogue<T>::store(acc, softmax, smem, o + base + q_row0 * row_stride, row_stride,
                     T::kStoreLse ? lse + bh * seq_len + q_row0 : nullptr,
                     T::kStoreMaxProb ? max_prob + bh * seq_len + q_row0 : nullptr,
                     T::kStoreMaxProb ? max_prob_cube + lut_row : nullptr,
                     n_real - cube_row0, n_real, warp_row0, lane);
}

}  // namespace tilegen
