// tilegen CUDA library, 8-bit block-sparse attention over a tile plan on Hopper (sm_90a): the
// int8_fp8 recipe of tilegen/quant.py (INT8 Q K^T with per-token scales, K smoothed; e4m3 P and
// V^T with per-channel V scales, V smoothed) on lut_attention.cuh's structure: a TMA producer
// warpgroup, kConsumers consumer warpgroups with their own rings, ping-pong, persistent launches
// (their cubes in a static round-robin, or with kDynamicSchedule taken from a global counter).
//
// What differs from the 16-bit kernel:
//   - the plan is the 8-bit Gluon pre-pass's (tilegen/backends/gluon/prepass.py, "halves"):
//     plan[row, 2 t + u] = the first key row (within the batch) of half u of tile t | its fill
//     << 25. A K stage is two 32-row boxes of K8 plus the halves' key scales (a 16-byte bulk
//     copy each: K's scale is one a 32-key half); a V stage is two V^T boxes of (32 keys,
//     kHeadDim rows) under the 32-byte swizzle. With kBulkKv (kv_copies "bulk") each half is
//     one 4 KB bulk copy instead, from K8 and V^T tiles the pre-pass wrote in the shared
//     tile's byte order (quant.k_to_tiles, vt_to_tiles of the slotted V^T): the same bytes,
//     in 8 requests a tile where the boxes are 128 rows of K8 and 512 of V^T.
//   - S = Q8 K8^T is int32 (IGMMA); a half's key scale multiplies its max and, with the row's
//     scale c = q_scale_i sm_scale log2 e, the exponent's coefficient (QuantSoftmax). P's e4m3
//     code comes from ex2 (p_exp "ex2") or straight from the exponent (p_exp "linear"), the row
//     sum from the scores (row_sum "fadd") or from an m64n8 MMA of P against ones ("mma").
//   - P V takes P in e4m3 from registers (QGMMA) into a fresh accumulator each tile, added into
//     O in fp32 (two-level accumulation): O = O alpha_{j-1} + P_{j-1} V_{j-1}, one FFMA an
//     element, where the 16-bit kernel rescales O in place. With kPvParts 2 or 4 the
//     accumulator is that part of O (32 or 16 registers) and P V runs as column parts, each
//     added into O before the next is issued: what lets three consumers (160 registers each)
//     share an SM.
//   - the epilogue applies V's per-channel scale and adds V's mean back (rows with no key
//     stay 0); lse adds each row's q̂.k̄ back (the logits are of the smoothed keys k - k̄).
//   - the Q buffer is 16-bit sized: Q8 fills its first half, the 16-bit O is staged over it.
//     With q_in_kernel (a runtime argument) the producer loads the 16-bit query cube into it
//     and the consumer quantizes it in place with the pre-pass's arithmetic (quantize_q), so
//     the pre-pass reads and writes K and V only.
// Inputs come from the pre-pass in BSHD (q8, k8: (B, S, H, D) int8; v8t: (B, H, D, S) e4m3 with
// its keys permuted within each 32-key half, AttentionMma8::key_of_slot); o is BSHD.
#pragma once

#include <cstdint>
#include <type_traits>

#include "tilegen/cuda/sm90/lut_attention.cuh"
#include "tilegen/cuda/sm90/softmax_8bit.cuh"

namespace tilegen {
namespace sm90 {

// f(std::integral_constant<int, k>) for k = 0 .. N - 1: indices that are constants in the
// source, not after unrolling, so a register array indexed by one never falls to local memory.
template <int N, int K = 0, class F>
__device__ __forceinline__ void constant_for(F&& f) {
  if constexpr (K < N) {
    f(std::integral_constant<int, K>{});
    constant_for<N, K + 1>(f);
  }
}

// Two 16-bit values (one register, the low half first) to fp32, exactly.
template <class Elem>
__device__ __forceinline__ void unpack2(uint32_t r, float& lo, float& hi) {
  if constexpr (std::is_same<Elem, Bf16>::value) {
    lo = __uint_as_float(r << 16);
    hi = __uint_as_float(r & 0xffff0000u);
  } else {
    asm("{\n .reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}\n"
        : "=f"(lo), "=f"(hi)
        : "r"(r));
  }
}

// C provides what WgmmaTraits's C does (kBshd true, kStoreMaxProb false, kHeadDim 128).
template <class C>
struct QuantTraits : C {
  static constexpr int kThreads = 128 * (1 + C::kConsumers);
  static constexpr int kPanelBytes = C::kBlock * 128;            // a 16-bit O panel (staging)
  static constexpr int kQBytes = C::kBlock * C::kHeadDim * 2;    // Q8, then the staged 16-bit O
  static constexpr int kTileKeys = C::kKvTile;                   // keys a tile: 1 or 2 cubes
  static constexpr int kHalves = kTileKeys / 32;                 // the plan's 32-key halves
  static constexpr int kPlanTiles = kHalves / 2;                 // the plan's 64-key tiles
  static constexpr int kTileBytes = kTileKeys * C::kHeadDim;     // K8 tile; V^T tile (halves)
  static constexpr int kHalfBytes = 32 * C::kHeadDim;
  static constexpr int kScaleCopyBytes = kHalves * 16;  // a K stage's key scales (bulk copies)
  // then the halves' fills, stored by the producer from the plan words it reads anyway, so a
  // consumer reads one shared word a half and no plan (session 29: ~40 instructions a tile)
  static constexpr int kFillBytes = 16;
  static constexpr int kScaleBytes = kScaleCopyBytes + kFillBytes;  // a K stage's scale slot
  static_assert(kHalves * 4 <= kFillBytes, "one 32-bit fill a half");
  // rounded up to the 1024-byte swizzle atom, so the next consumer's tiles start on one
  static constexpr int kConsumerBytes = (C::kQBuffers * kQBytes +
                                         (C::kKStages + C::kVStages) * kTileBytes +
                                         C::kKStages * kScaleBytes + 1023) / 1024 * 1024;
  static constexpr int kSmemBytes = C::kConsumers * kConsumerBytes + 1024;
  static constexpr int kBarriers = 2 * C::kQBuffers + 2 * C::kKStages + 2 * C::kVStages;
  static constexpr int kFillShift = 25;  // plan word: key row | fill << 25
  static constexpr bool kBulkKv = C::kBulkKv;
  static constexpr bool kLinearP = C::kLinearP;      // p_exp "linear" (QuantSoftmax)
  static constexpr bool kMmaRowSum = C::kMmaRowSum;  // row_sum "mma" (QuantSoftmax)
  static constexpr bool kDynamicSchedule = C::kDynamicSchedule;  // schedule "dynamic"
  static_assert(C::kBshd && !C::kStoreMaxProb, "the 8-bit pre-pass writes BSHD; no max_prob");
  static_assert(C::kBlock == 64 && C::kHeadDim == 128, "64-token cubes, head_dim 128");
  static_assert(kTileKeys == 64 || kTileKeys == 128, "tiles of one or two 64-key plan tiles");
  static_assert(C::kConsumers >= 1 && C::kConsumers <= 3, "one to three consumer warpgroups");
  static_assert(C::kQBuffers == 1 || C::kQBuffers == 2, "one or two Q buffers");
  static_assert(!C::kPingPong || C::kConsumers == 2, "ping-pong takes two consumers");
  static_assert(C::kPvParts == 1 || (C::kPvParts % 2 == 0 && !C::kPingPong),
                "P V in 2 or 4 parts, without ping-pong");
  static_assert(C::kPvParts > 1 || kTileKeys == 64, "a 128-key tile's P V runs in parts");

  // This kernel's tiles of a row whose plan has `plan_tiles` 64-key tiles (-1, a bad row, kept).
  static __host__ __device__ __forceinline__ int tiles(int plan_tiles) {
    return plan_tiles <= 0 ? plan_tiles : (plan_tiles + kPlanTiles - 1) / kPlanTiles;
  }
  // The plan halves of tile j that exist (the last 128-key tile of an odd count has 2).
  static __host__ __device__ __forceinline__ int halves(int plan_tiles, int j) {
    if constexpr (kPlanTiles == 1) return kHalves;
    const int left = 2 * plan_tiles - kHalves * j;
    return left < kHalves ? left : kHalves;
  }
};

struct QuantArgs : LutArgs {  // sidx, tinfo, max_prob unused
  const int* plan;        // (rows, 2 topk)
  const float* q_scale;   // (B, H, S); unread with q_in_kernel
  const float* k_mean;    // (B, H, D): K's smoothing mean, for lse's q̂.k̄ term
  int q_in_kernel;        // q8's map is the 16-bit q's: the consumers quantize Q (quantize_q)
  const float* k_scale;   // (B, H, S): equal within each 32-key half
  const float* v_scale;   // (B, H, D)
  const float* v_mean;    // (B, H, D)
  // o in the model's token order (nullptr: o by TMA in slot order): slot s of batch b is
  // token out_rows[s] of o_tokens (B, out_seq_len, H, D); a slot outside [0, out_seq_len)
  // (a padded one: -1) is not written
  void* o_tokens;
  const int* out_rows;    // (S,)
  int out_seq_len;
  // kBulkKv: K8 (B, H, S / 32, 32, D) and V^T (B, H, S / 32, D, 32) as shared-memory tiles
  const char* k8_tiles;
  const char* vt_tiles;
  // kDynamicSchedule: cubes handed out so far past the first wave's; 0 at the launch
  int* work_counter;
};

struct QuantMaps {
  const TensorMap& q8;  // (H * D, B * S) int8, (128, 64) boxes; with q_in_kernel the 16-bit
                        // q, (64, 64) boxes under the 128-byte swizzle (o's geometry)
  const TensorMap& k8;  // (128, 32) boxes (kBulkKv: q8's map, unused)
  const TensorMap& vt;  // (S, B * H * D) e4m3, (32, D) boxes, 32-byte swizzle (kBulkKv: q8's)
  const TensorMap& o;   // (H * D, B * S) 16-bit, (64, 64) boxes

  __device__ __forceinline__ void prefetch() const {
    prefetch_map(k8);
    prefetch_map(vt);
  }
};

// ---- the producer -------------------------------------------------------------------------------
template <class T>
struct QuantProducer {
  static __device__ __forceinline__ void store_fills(uint32_t slot,
                                                     const int (&fill)[T::kHalves]) {
#pragma unroll
    for (int u = 0; u < T::kHalves; ++u)
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(slot + 4 * u), "r"(fill[u]) : "memory");
  }

  // Q8 of one cube, then per tile j: K8 and key scales of tile j, V^T of tile j - 1, each as
  // the 32-key halves of the plan (two a 64-key tile, four a 128-key one). Where a 128-key
  // tile's second plan tile is absent (an odd count), its halves load the first half's rows
  // again: finite bytes, masked by a fill of 0, so the MMAs need no branch.
  static __device__ __forceinline__ void cube(const QuantMaps& maps, const QuantArgs& a,
                                              const ConsumerRing<T>& ring, RingCursor& at,
                                              const Item<T>& item) {
    const int plan_tiles = item.tiles(a);
    const int n = T::tiles(plan_tiles);
    const int qb = at.q_buffer<T>();
    const uint32_t bit = 1u << qb;
    if (n > 0) {
      if (at.q_used & bit) barrier_wait(ring.q_empty(qb), ((at.q_use_parity & bit) ? 0 : 1));
      const TokenRows<T> rows(item.bh, a);
      const int* plan_row = a.plan + item.row * 2 * a.topk;
      const float* k_scale = a.k_scale + item.bh * a.seq_len;
      const int vt_row = static_cast<int>(item.bh) * T::kHeadDim;
      // kBulkKv: the 32-key half holding key row `key` of this (batch, head), as a tile
      auto half_tile = [&](const char* tiles, int key) {
        return tiles + (item.bh * (a.seq_len / 32) + key / 32) * T::kHalfBytes;
      };
      if (a.q_in_kernel) {  // the 16-bit cube as two panels: the staged O's layout
        barrier_expect_bytes(ring.q_full(qb), T::kQBytes);
#pragma unroll
        for (int p = 0; p < T::kHeadDim / kPanelCols; ++p)
          tma_load(ring.q_tile(qb) + p * T::kPanelBytes, maps.q8, ring.q_full(qb),
                   rows.col + p * kPanelCols, rows.row0 + item.q_cube * T::kBlock);
      } else {
        barrier_expect_bytes(ring.q_full(qb), T::kQBytes / 2);
        tma_load(ring.q_tile(qb), maps.q8, ring.q_full(qb), rows.col,
                 rows.row0 + item.q_cube * T::kBlock);
      }
      at.q_load_parity ^= bit;
      // the plan words of tile j + 1 are loaded while tile j's boxes are issued, and V reuses
      // K's key rows (session 19: as fast as loading each at its tile, with half the loads)
      constexpr int kKeyMask = (1 << T::kFillShift) - 1;
      int word_next[T::kHalves];
      int key_prev[T::kHalves];
      // an absent half: the first half's key rows, fill 0
      auto words_of = [&](int j, int (&word)[T::kHalves]) {
        const int halves = T::halves(plan_tiles, j);
#pragma unroll
        for (int u = 0; u < T::kHalves; ++u)
          word[u] = u < halves ? __ldg(plan_row + T::kHalves * j + u) : word[0] & kKeyMask;
      };
      words_of(0, word_next);
      for (int j = 0; j <= n; ++j) {
        int key_cur[T::kHalves];
        int fill_cur[T::kHalves];
#pragma unroll
        for (int u = 0; u < T::kHalves; ++u) {
          key_cur[u] = word_next[u] & kKeyMask;
          fill_cur[u] = word_next[u] >> T::kFillShift;
        }
        if (j + 1 < n) words_of(j + 1, word_next);
        if (j < n) {
          const int kt = at.k_tiles + j;
          const int s = kt % T::kKStages;
          barrier_wait(ring.k_empty(s), ((kt / T::kKStages) & 1) ^ 1);
          // before the arrive below, which releases them to the consumer with the copies
          store_fills(ring.k_scale(s) + T::kScaleCopyBytes, fill_cur);
          barrier_expect_bytes(ring.k_full(s), T::kTileBytes + T::kScaleCopyBytes);
#pragma unroll
          for (int u = 0; u < T::kHalves; ++u) {
            const int key = key_cur[u];
            if constexpr (T::kBulkKv)
              bulk_load(ring.k_tile(s) + u * T::kHalfBytes, half_tile(a.k8_tiles, key),
                        T::kHalfBytes, ring.k_full(s));
            else
              tma_load(ring.k_tile(s) + u * T::kHalfBytes, maps.k8, ring.k_full(s), rows.col,
                       rows.row0 + key);
            bulk_load(ring.k_scale(s) + u * 16, k_scale + key, 16, ring.k_full(s));
          }
        }
        if (j > 0) {
          const int vt = at.v_tiles + j - 1;
          const int s = vt % T::kVStages;
          barrier_wait(ring.v_empty(s), ((vt / T::kVStages) & 1) ^ 1);
          barrier_expect_bytes(ring.v_full(s), T::kTileBytes);
#pragma unroll
          for (int u = 0; u < T::kHalves; ++u) {
            if constexpr (T::kBulkKv)
              bulk_load(ring.v_tile(s) + u * T::kHalfBytes, half_tile(a.vt_tiles, key_prev[u]),
                        T::kHalfBytes, ring.v_full(s));
            else
              tma_load(ring.v_tile(s) + u * T::kHalfBytes, maps.vt, ring.v_full(s),
                       key_prev[u], vt_row);
          }
        }
#pragma unroll
        for (int u = 0; u < T::kHalves; ++u) key_prev[u] = key_cur[u];
      }
      at.tiles_done(n);
    }
    at.cube_done(bit);
  }
};

// A 32-key by 8-column tile of e4m3 ones (0x38), the B operand of the MMA row sum
// (QuantSoftmax::kRowSumMma): static shared memory, written once before the warpgroups split,
// and none without the row sum (so other builds keep their layout).
template <bool kUsed>
__device__ __forceinline__ uint32_t ones_tile() {
  if constexpr (kUsed) {
    __shared__ __align__(256) uint32_t ones[64];
    return smem_u32(ones);
  } else {
    return 0u;
  }
}

// ---- a consumer warpgroup -----------------------------------------------------------------------
template <class T>
struct QuantConsumer {
  using Mma = AttentionMma8<T::kHeadDim, T::kTileKeys>;
  using Softmax = QuantSoftmax<T::kTileKeys, T::kLinearP, T::kMmaRowSum>;
  using Turns = PingPong<T::kPingPong, 1>;  // named barriers 1, 2
  static constexpr int kEpilogueBarrier = 3;  // + consumer index

  static __device__ __forceinline__ void release(uint32_t bar, int lane) {
    if (lane == 0) barrier_arrive(bar);
  }

  // The fills of a K stage's halves (0 for a half that is absent), as its producer stored them.
  static __device__ __forceinline__ void fills_of(uint32_t k_scale_slot,
                                                  int (&fill)[T::kHalves]) {
    const uint32_t at = k_scale_slot + T::kScaleCopyBytes;
    if constexpr (T::kHalves == 4)
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(fill[0]), "=r"(fill[1]), "=r"(fill[2]), "=r"(fill[3])
                   : "r"(at));
    else
      asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(fill[0]), "=r"(fill[1]) : "r"(at));
  }

  // Byte `col` (a multiple of 16) of row `row` in the Q8 tile: 128-byte rows under the
  // 128-byte swizzle, as q8's TMA box lands.
  static __device__ __forceinline__ uint32_t q8_offset(int row, int col) {
    return row * 128 + (((col / 16) ^ (row % 8)) * 16);
  }

  // q_in_kernel: the 16-bit query cube in the Q buffer (two panels) to int8 in the Q8 tile over
  // its first panel, one scale a row, with the pre-pass's arithmetic bit for bit
  // (quant._int8_per_token): amax / 127 (div.full, Triton's `/`), one IEEE reciprocal, the
  // product rounded to fp32, then to the nearest integer, ties to even. A padded row (at or
  // past q_real) gets scale 0 and q8 0, as the pre-pass's zeroed rows do. Each quad holds its
  // two S rows (a thread 32 columns of each), so the row scales land where the softmax reads
  // them: c[h] = scale qk_scale, as from the pre-pass's q_scale.
  static __device__ __forceinline__ void quantize_q(uint32_t q_tile, int q_real, int consumer,
                                                    int warp, int lane, float qk_scale,
                                                    float (&c)[2]) {
    const int quad = lane & 3;
    uint32_t x[2][16];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = Fragment::row(h, warp, lane);
#pragma unroll
      for (int k = 0; k < 4; ++k)
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(x[h][4 * k]), "=r"(x[h][4 * k + 1]), "=r"(x[h][4 * k + 2]),
                       "=r"(x[h][4 * k + 3])
                     : "r"(q_tile + staged_offset<T>(row, 32 * quad + 8 * k)));
    }
    named_sync(kEpilogueBarrier + consumer, 128);  // every read before Q8 overwrites panel 0
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = Fragment::row(h, warp, lane);
      float v[32];
#pragma unroll
      for (int i = 0; i < 16; ++i) unpack2<typename T::Elem>(x[h][i], v[2 * i], v[2 * i + 1]);
      float amax = 0.f;
#pragma unroll
      for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(v[i]));
      amax = Fragment::quad_max(amax);
      float scale;
      asm("div.full.f32 %0, %1, %2;\n" : "=f"(scale) : "f"(amax), "f"(127.f));
      const bool padded = row >= q_real;
      if (padded) scale = 0.f;
      float inv = 0.f;
      if (scale > 0.f) asm("rcp.rn.f32 %0, %1;\n" : "=f"(inv) : "f"(scale));
      c[h] = fmaxf(scale * qk_scale, Softmax::kMinScale);
      uint32_t w[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        uint32_t word = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          const float y = fminf(fmaxf(v[4 * i + b] * inv, -127.f), 127.f);
          int r;
          asm("cvt.rni.s32.f32 %0, %1;\n" : "=r"(r) : "f"(y));
          word |= (static_cast<uint32_t>(r) & 0xffu) << (8 * b);
        }
        w[i] = padded ? 0u : word;  // the pre-pass zeroes them first (inf, NaN: not -127)
      }
#pragma unroll
      for (int k = 0; k < 2; ++k)
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(
                         q_tile + q8_offset(row, 32 * quad + 16 * k)),
                     "r"(w[4 * k]), "r"(w[4 * k + 1]), "r"(w[4 * k + 2]), "r"(w[4 * k + 3])
                     : "memory");
    }
    fence_proxy_async();  // the S MMAs read Q8 in the async proxy
    named_sync(kEpilogueBarrier + consumer, 128);
  }

  // A thread's 32 channels of K's mean (32 quad ..), for smoothing_terms: loaded before the
  // wait for Q, so that their latency is not on the way to the first S.
  static __device__ __forceinline__ void load_k_mean(const float* k_mean, int lane,
                                                     float4 (&kb)[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      kb[i] = __ldg(reinterpret_cast<const float4*>(k_mean + 32 * (lane & 3) + 4 * i));
  }

  // lse's smoothing term of each row half, c[h] q8_i.k̄ (base 2, as the logits' c), from the
  // Q8 tile: a thread's 32 columns of its two rows, summed over the quad.
  static __device__ __forceinline__ void smoothing_terms(uint32_t q_tile, const float4 (&kb)[8],
                                                         int warp, int lane, const float (&c)[2],
                                                         float (&term)[2]) {
    const int quad = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = Fragment::row(h, warp, lane);
      float sum = 0.f;
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        uint32_t w[4];
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                     : "r"(q_tile + q8_offset(row, 32 * quad + 16 * k)));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float4 m = kb[4 * k + i];
          auto byte = [&](int b) {  // the signed int8 in byte b
            return static_cast<float>(static_cast<signed char>(w[i] >> (8 * b)));
          };
          sum = fmaf(byte(0), m.x, sum);
          sum = fmaf(byte(1), m.y, sum);
          sum = fmaf(byte(2), m.z, sum);
          sum = fmaf(byte(3), m.w, sum);
        }
      }
      term[h] = c[h] * Fragment::quad_sum(sum);
    }
  }

  static __device__ __forceinline__ void cube(const QuantMaps& maps, const QuantArgs& a,
                                              const ConsumerRing<T>& ring, RingCursor& at,
                                              const Turns& turns, int& turn, int consumer,
                                              const Item<T>& item) {
    const int lane = threadIdx.x & 31;
    const int warp = (threadIdx.x >> 5) & 3;
    const int plan_tiles = item.tiles(a);
    const int n = T::tiles(plan_tiles);
    const int qb = at.q_buffer<T>();
    const uint32_t bit = 1u << qb;
    const uint32_t q_tile = ring.q_tile(qb);
    const int kt0 = at.k_tiles;
    const int vt0 = at.v_tiles;
    const int turn0 = turn;

    // each row half's scale: q_scale sm_scale log2 e, floored at Softmax::kMinScale (a padded
    // query row's q_scale is 0)
    // (with q_in_kernel, quantize_q's; a row with no tile keeps qk_scale, finite)
    const long long q_row0 = item.bh * a.seq_len + static_cast<long long>(item.q_cube) * T::kBlock;
    float c[2] = {a.qk_scale, a.qk_scale};
    if (!a.q_in_kernel) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
        c[h] = fmaxf(__ldg(a.q_scale + q_row0 + Fragment::row(h, warp, lane)) * a.qk_scale,
                     Softmax::kMinScale);
    }
    float lse_term[2] = {0.f, 0.f};  // kStoreLse: each row's q̂.k̄ (smoothing_terms)

    float o[Mma::kORegs];
#pragma unroll
    for (int i = 0; i < Mma::kORegs; ++i) o[i] = 0.f;
    float rs[4] = {0.f, 0.f, 0.f, 0.f};  // Softmax::kRowSumMma: P_{j-1}'s row sums
    const uint32_t ones = ones_tile<Softmax::kRowSumMma>();
    int s[Mma::kSRegs];
    float f[Mma::kSRegs];
    uint32_t p[Mma::kPRegs];
    int fill[T::kHalves];
    float ks[T::kHalves];  // the tile's key scales, one a half
    float mu[2][T::kHalves];  // Softmax::kLinear: the tile's maxima of S (Softmax::scores)
    float alpha[2];
    float alpha_prev[2] = {1.f, 1.f};  // O's rescale for the P V being added (tile j - 1's)
    Softmax softmax;
    softmax.init();

    if (n > 0) {
      float4 k_mean[8];
      if constexpr (T::kStoreLse) load_k_mean(a.k_mean + item.bh * T::kHeadDim, lane, k_mean);
      const int q_real = a.q_in_kernel ? __ldg(a.vbs + item.q_cube) : T::kBlock;
      barrier_wait(ring.q_full(qb), (at.q_load_parity & bit) ? 1 : 0);
      at.q_load_parity ^= bit;
      if (a.q_in_kernel) quantize_q(q_tile, q_real, consumer, warp, lane, a.qk_scale, c);
      if constexpr (T::kStoreLse) smoothing_terms(q_tile, k_mean, warp, lane, c, lse_term);
      {
        const int kst = kt0 % T::kKStages;
        barrier_wait(ring.k_full(kst), (kt0 / T::kKStages) & 1);
        fills_of(ring.k_scale(kst), fill);
        turns.begin(turn0);
        wgmma_fence();
        Mma::qk(s, q_tile, ring.k_tile(kst));
        wgmma_commit();
        turns.end(turn0);
        wgmma_wait<0>();
        fence_operands(s);
        Softmax::key_scales(ring.k_scale(kst), ks);
        Softmax::scores(s, f, fill, lane, mu);
        release(ring.k_empty(kst), lane);  // after its key scales are read
      }
      softmax.template step<true>(f, mu, p, alpha, c, ks);

      // each branch its own accumulator (and the lambdas that use it)
      if constexpr (T::kPvParts > 1) {
        // P V in column parts (a part-sized accumulator: 128-key tiles, or three consumers an
        // SM). Per tile j: S_j and part 0 of P_{j-1} V_{j-1} issued together; S_j's scores and
        // max while part 0 runs; then each part added into O as it lands and the next issued,
        // S_j's exponentials under part 1; last, P_j packed over P_{j-1}. (Session 20: 5.30 ms
        // for 128-key tiles against 5.39 with the exponentials under part 0 and S_j alone.)
        constexpr int kParts = T::kPvParts;
        constexpr int kPartRegs = Mma::kORegs / kParts;
        float acc[kPartRegs];
        auto add_part = [&](int k) {
#pragma unroll
          for (int i = 0; i < kPartRegs; ++i)
            o[k * kPartRegs + i] =
                fmaf(o[k * kPartRegs + i], alpha_prev[Fragment::half(i)], acc[i]);
        };
        auto issue_part = [&](auto part, const uint32_t (&p_in)[Mma::kPRegs],
                              uint32_t v_tile) {
          fence_operands(acc);
          if constexpr (Softmax::kRowSumMma && decltype(part)::value == 0) fence_operands(rs);
          wgmma_fence();
          Mma::template pv_part<kParts, decltype(part)::value>(acc, p_in, v_tile);
          if constexpr (Softmax::kRowSumMma && decltype(part)::value == 0)
            Mma::row_sum(rs, p_in, ones);
          wgmma_commit();
        };
        auto add_sums = [&](int k) {
          if constexpr (Softmax::kRowSumMma) {
            if (k == 0) {
              fence_operands(rs);
              softmax.add_row_sums(rs, alpha_prev);
            }
          }
        };
        auto tile_parts = [&](int j, uint32_t (&p)[Mma::kPRegs]) {
          const int kt = kt0 + j;
          const int vt = vt0 + j - 1;
          const int kst = kt % T::kKStages;
          const int vs = vt % T::kVStages;
          barrier_wait(ring.k_full(kst), (kt / T::kKStages) & 1);
          fills_of(ring.k_scale(kst), fill);
          wgmma_fence();
          Mma::qk(s, q_tile, ring.k_tile(kst));
          wgmma_commit();
          barrier_wait(ring.v_full(vs), (vt / T::kVStages) & 1);  // S_j runs meanwhile
          fence_operands(p);
          issue_part(std::integral_constant<int, 0>{}, p, ring.v_tile(vs));
          wgmma_wait<1>();  // S_j has landed
          fence_operands(s);
          Softmax::key_scales(ring.k_scale(kst), ks);
          Softmax::scores(s, f, fill, lane, mu);
          release(ring.k_empty(kst), lane);
          softmax.template update_max<false>(f, mu, alpha, c, ks);
          constant_for<kParts>([&](auto part) {
            constexpr int k = decltype(part)::value;
            wgmma_wait<0>();
            fence_operands(acc);
            add_part(k);
            add_sums(k);
            if constexpr (k + 1 < kParts)
              issue_part(std::integral_constant<int, k + 1>{}, p, ring.v_tile(vs));
            if constexpr (k == 0) softmax.template exponentiate<false>(f, alpha, c, ks);
          });
          fence_operands(p);
          release(ring.v_empty(vs), lane);
          Softmax::pack(f, p);
          alpha_prev[0] = alpha[0];
          alpha_prev[1] = alpha[1];
        };
        auto last_parts = [&]() {
          const int vt = vt0 + n - 1;
          const int vs = vt % T::kVStages;
          barrier_wait(ring.v_full(vs), (vt / T::kVStages) & 1);
          fence_operands(p);
          constant_for<kParts>([&](auto part) {
            issue_part(part, p, ring.v_tile(vs));
            wgmma_wait<0>();
            fence_operands(acc);
            add_part(decltype(part)::value);
            add_sums(decltype(part)::value);
          });
          fence_operands(p);
          release(ring.v_empty(vs), lane);
        };
        // one P fragment (P_j packed once P_{j-1}'s last part has landed), so the loop is not
        // unrolled: two tiles' bodies in one loop spilled (session 20)
        for (int j = 1; j < n; ++j) tile_parts(j, p);
        last_parts();
      } else {
        float acc[Mma::kORegs];
        uint32_t p_next[Mma::kPRegs];
        auto tile = [&](int j, uint32_t (&p_in)[Mma::kPRegs],
                        uint32_t (&p_out)[Mma::kPRegs]) {
          const int kt = kt0 + j;
          const int vt = vt0 + j - 1;
          const int kst = kt % T::kKStages;
          const int vs = vt % T::kVStages;
          barrier_wait(ring.k_full(kst), (kt / T::kKStages) & 1);
          fills_of(ring.k_scale(kst), fill);
          barrier_wait(ring.v_full(vs), (vt / T::kVStages) & 1);
          turns.begin(turn0 + j);
          fence_operands(acc);
          fence_operands(p_in);
          wgmma_fence();
          Mma::qk(s, q_tile, ring.k_tile(kst));
          wgmma_commit();
          Mma::pv(acc, p_in, ring.v_tile(vs));
          if constexpr (Softmax::kRowSumMma) Mma::row_sum(rs, p_in, ones);
          wgmma_commit();
          turns.end(turn0 + j);
          wgmma_wait<1>();  // S_j has landed; P_{j-1} V_{j-1} may still run
          fence_operands(s);
          Softmax::key_scales(ring.k_scale(kst), ks);
          Softmax::scores(s, f, fill, lane, mu);
          release(ring.k_empty(kst), lane);
          softmax.template step<false>(f, mu, p_out, alpha, c, ks);
          wgmma_wait<0>();
          fence_operands(acc);
          fence_operands(p_in);
          release(ring.v_empty(vs), lane);
#pragma unroll
          for (int i = 0; i < Mma::kORegs; ++i)
            o[i] = fmaf(o[i], alpha_prev[Fragment::half(i)], acc[i]);
          if constexpr (Softmax::kRowSumMma) {
            fence_operands(rs);
            softmax.add_row_sums(rs, alpha_prev);
          }
          alpha_prev[0] = alpha[0];
          alpha_prev[1] = alpha[1];
        };
        auto last = [&](uint32_t (&p_last)[Mma::kPRegs]) {
          const int vt = vt0 + n - 1;
          const int vs = vt % T::kVStages;
          barrier_wait(ring.v_full(vs), (vt / T::kVStages) & 1);
          turns.begin(turn0 + n);
          fence_operands(acc);
          fence_operands(p_last);
          wgmma_fence();
          Mma::pv(acc, p_last, ring.v_tile(vs));
          if constexpr (Softmax::kRowSumMma) Mma::row_sum(rs, p_last, ones);
          wgmma_commit();
          turns.end(turn0 + n);
          wgmma_wait<0>();
          fence_operands(acc);
          fence_operands(p_last);
          release(ring.v_empty(vs), lane);
#pragma unroll
          for (int i = 0; i < Mma::kORegs; ++i)
            o[i] = fmaf(o[i], alpha_prev[Fragment::half(i)], acc[i]);
          if constexpr (Softmax::kRowSumMma) {
            fence_operands(rs);
            softmax.add_row_sums(rs, alpha_prev);
          }
        };
        run_tiles(n, tile, last, p, p_next);
      }
      at.tiles_done(n);
      turn += n + 1;
    }
    epilogue(maps, a, ring.q_empty(qb), q_tile, consumer, o, softmax, c, lse_term, n < 0, item,
             warp, lane);
    at.cube_done(bit);
  }

  // The staged O tile to the token rows out_rows names, 16 bytes a thread a step: a row's
  // 16 chunks are 16 neighbouring threads' (256 contiguous bytes a row and head).
  static __device__ __forceinline__ void store_token_order(const QuantArgs& a, uint32_t q_tile,
                                                           const Item<T>& item, int tid) {
    constexpr int kChunks = T::kHeadDim / 8;
    const int b = static_cast<int>(item.bh / a.num_heads);
    const int h = static_cast<int>(item.bh % a.num_heads);
    const int* slot_rows = a.out_rows + item.q_cube * T::kBlock;
    unsigned short* out = static_cast<unsigned short*>(a.o_tokens);  // o's 16-bit elements
#pragma unroll
    for (int i = tid; i < T::kBlock * kChunks; i += 128) {
      const int row = i / kChunks;
      const int col = (i % kChunks) * 8;
      const int token = __ldg(slot_rows + row);
      if (token < 0 || token >= a.out_seq_len) continue;
      uint4 chunk;
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(chunk.x), "=r"(chunk.y), "=r"(chunk.z), "=r"(chunk.w)
                   : "r"(q_tile + staged_offset<T>(row, col)));
      const long long at =
          ((static_cast<long long>(b) * a.out_seq_len + token) * a.num_heads + h) *
              T::kHeadDim + col;
      *reinterpret_cast<uint4*>(out + at) = chunk;
    }
  }

  // o = (acc / l) v_scale + v_mean (0 for a row with no key or a padded row when asked, NaN for
  // a bad row), staged over the Q buffer and stored by TMA (or in token order, out_rows); lse
  // base 2, of the smoothed keys plus lse_term (q̂.k̄ back).
  static __device__ __forceinline__ void epilogue(const QuantMaps& maps, const QuantArgs& a,
                                                  uint32_t q_empty, uint32_t q_tile,
                                                  int consumer, float (&o)[Mma::kORegs],
                                                  const Softmax& softmax, const float (&c)[2],
                                                  const float (&lse_term)[2], bool bad,
                                                  const Item<T>& item, int warp, int lane) {
    const float nan = __int_as_float(0x7fc00000);
    const int q_real = a.zero_pad_rows ? __ldg(a.vbs + item.q_cube) : T::kBlock;
    float l[2];
    float inv[2];
    float keep[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] = softmax.row_sum(h);
      inv[h] = l[h] > 0.f ? 1.f / l[h] : 0.f;
      keep[h] = l[h] > 0.f ? 1.f : 0.f;
      if (Fragment::row(h, warp, lane) >= q_real) inv[h] = keep[h] = 0.f;
      if (bad) inv[h] = nan;
    }
    const float* v_scale = a.v_scale + item.bh * T::kHeadDim;
    const float* v_mean = a.v_mean + item.bh * T::kHeadDim;
#pragma unroll
    for (int i = 0; i < Mma::kORegs; i += 2) {
      const int h = Fragment::half(i);
      const int col = Fragment::column(i, lane);
      const float2 sc = __ldg(reinterpret_cast<const float2*>(v_scale + col));
      const float2 mu = __ldg(reinterpret_cast<const float2*>(v_mean + col));
      const float x0 = fmaf(o[i] * inv[h], sc.x, mu.x * keep[h]);
      const float x1 = fmaf(o[i + 1] * inv[h], sc.y, mu.y * keep[h]);
      const uint32_t addr = q_tile + staged_offset<T>(Fragment::row(h, warp, lane), col);
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(T::Elem::pack2(x0, x1))
                   : "memory");
    }
    fence_proxy_async();
    named_sync(kEpilogueBarrier + consumer, 128);
    const TokenRows<T> rows(item.bh, a);
    if (a.out_rows != nullptr) {
      store_token_order(a, q_tile, item, warp * 32 + lane);
      named_sync(kEpilogueBarrier + consumer, 128);  // every read of the staged O is done
    } else if (warp == 0 && lane == 0) {
#pragma unroll
      for (int p = 0; p < T::kHeadDim / kPanelCols; ++p)
        tma_store(maps.o, q_tile + p * T::kPanelBytes, rows.col + p * kPanelCols,
                  rows.row0 + item.q_cube * T::kBlock);
      tma_store_commit();
    }
    if constexpr (T::kStoreLse) {
      const long long row0 =
          item.bh * a.seq_len + static_cast<long long>(item.q_cube) * T::kBlock;
      if ((lane & 3) == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float lse = l[h] > 0.f
                          ? softmax.lse(h, c[h], l[h]) + lse_term[h]
                          : neg_inf();
          if (bad) lse = nan;
          a.lse[row0 + Fragment::row(h, warp, lane)] = lse;
        }
      }
    }
    if (warp == 0 && lane == 0) {
      tma_store_wait_read();
      barrier_arrive(q_empty);
    }
  }
};

// ---- the dynamic schedule (kDynamicSchedule) ---------------------------------------------------
// A persistent grid whose consumers take query cubes one at a time from a global counter, so a
// CTA whose cubes are cheap takes more of them (session 35, bench/NOTES.md: the static
// round-robin was 22% ahead of one CTA a cube at TOPK 2 and 3% behind at TOPK 78). Work unit g
// is one query cube, (b, h) = g / num_q_blocks; every consumer's first cube is blockIdx.x *
// kConsumers + its index, the next ones kConsumers * gridDim.x + the counter's count. The
// consumer claims its cubes (the atomic in the producer lane, which has 24 registers, spilled)
// and publishes each as it starts the cube before it, through a two-slot queue in shared
// memory read by its producer lane and by itself: a full barrier (the claiming thread's
// arrival) and an empty one (the producer lane's and every consumer thread's, once each has
// read the slot). A cube past the last one ends both.
template <class T>
struct WorkQueue {
  static constexpr int kReaders = 1 + 128;  // the producer lane and the consumer warpgroup
  uint32_t slots;                            // two ints
  uint32_t bars;                             // full[2], then empty[2]

  // Consumer c's queue, from the CTA's slots (two ints a consumer) and barriers (four a one).
  static __device__ __forceinline__ WorkQueue of(uint32_t slots0, uint32_t bars0, int c) {
    return WorkQueue{slots0 + 8 * c, bars0 + 32 * c};
  }
  __device__ __forceinline__ uint32_t full(int s) const { return bars + 8 * s; }
  __device__ __forceinline__ uint32_t empty(int s) const { return bars + 8 * (2 + s); }
  __device__ __forceinline__ void init() const {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      barrier_init(full(s), 1);
      barrier_init(empty(s), kReaders);
    }
  }
  // The cube claimed at turn i (slot i % 2): wait for it, read it, and let the slot go.
  __device__ __forceinline__ int take(int i) const {
    const int s = i & 1;
    barrier_wait(full(s), (i >> 1) & 1);
    int g;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(g) : "r"(slots + 4 * s) : "memory");
    barrier_arrive(empty(s));
    return g;
  }
  // Publish the cube taken at turn i (one thread), once turn i - 2's readers are done with
  // the slot.
  __device__ __forceinline__ void publish(int i, int g) const {
    const int s = i & 1;
    if (i >= 2) barrier_wait(empty(s), ((i >> 1) - 1) & 1);
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(slots + 4 * s), "r"(g) : "memory");
    barrier_arrive(full(s));
  }
};

// Work unit g's Item: the group and consumer index that Item's constructor maps to cube g.
template <class T>
__device__ __forceinline__ Item<T> cube_item(int g, const LutArgs& a) {
  const int groups_per_bh = (a.num_q_blocks + T::kConsumers - 1) / T::kConsumers;
  const int bh = g / a.num_q_blocks;
  const int q_cube = g % a.num_q_blocks;
  return Item<T>(bh * groups_per_bh + q_cube / T::kConsumers, q_cube % T::kConsumers, a);
}

template <class T, class ProducerT, class ConsumerT>
__device__ __forceinline__ void run_warpgroups_dynamic(const QuantMaps& maps, const QuantArgs& a,
                                                       uint32_t base, uint32_t bars0,
                                                       uint32_t queue_slots, uint32_t queue_bars) {
  static_assert(T::kQBuffers == 2 && !T::kPingPong,
                "a dynamic schedule is a persistent launch's, without ping-pong");
  const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) >> 5, 0);
  const int warpgroup = warp >> 2;
  const int lane = threadIdx.x & 31;
  const int cubes = a.batch_heads * a.num_q_blocks;
  const int first_claim = T::kConsumers * static_cast<int>(gridDim.x);
  if (warpgroup == 0) {
    lower_registers<T::kProducerRegs>();
    if (warp < T::kConsumers && lane == 0) {
      if (warp == 0) maps.prefetch();
      const ConsumerRing<T> ring = ConsumerRing<T>::of(base, bars0, warp);
      const WorkQueue<T> queue = WorkQueue<T>::of(queue_slots, queue_bars, warp);
      RingCursor at;
      int g = static_cast<int>(blockIdx.x) * T::kConsumers + warp;
      for (int i = 0; g < cubes; ++i) {
        ProducerT::cube(maps, a, ring, at, cube_item<T>(g, a));
        g = queue.take(i);
      }
    }
  } else {
    raise_registers<T::kConsumerRegs>();
    const int consumer = warpgroup - 1;
    const ConsumerRing<T> ring = ConsumerRing<T>::of(base, bars0, consumer);
    const WorkQueue<T> queue = WorkQueue<T>::of(queue_slots, queue_bars, consumer);
    using Turns = typename ConsumerT::Turns;
    Turns turns;
    turns.init(consumer, 0, 0);  // no ping-pong (QuantTraits)
    RingCursor at;
    int turn = 0;
    int g = static_cast<int>(blockIdx.x) * T::kConsumers + consumer;
    // claims run a cube ahead: the one published at a cube's start was claimed at the previous
    // cube's, so no warp waits for the atomic (measured level with claiming at the cube's
    // start, on an H100: session 35)
    const bool claims = warp % 4 == 0 && lane == 0;
    int claimed = claims && g < cubes ? atomicAdd(a.work_counter, 1) + first_claim : cubes;
    for (int i = 0; g < cubes; ++i) {
      if (claims) {
        queue.publish(i, claimed);
        if (claimed < cubes) claimed = atomicAdd(a.work_counter, 1) + first_claim;
      }
      ConsumerT::cube(maps, a, ring, at, turns, turn, consumer, cube_item<T>(g, a));
      g = queue.take(i);
    }
  }
}

// ---- the kernel body ---------------------------------------------------------------------------
template <class T>
__device__ __forceinline__ void lut_attention_8bit(const QuantMaps& maps, const QuantArgs& a) {
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t bars[T::kConsumers][T::kBarriers];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t bars0 = smem_u32(&bars[0][0]);
  init_barriers<T, ConsumerRing<T>>(base, bars0);
  if constexpr (QuantConsumer<T>::Softmax::kRowSumMma) {
    if (threadIdx.x < 64)
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(ones_tile<true>() + 4 * threadIdx.x),
                   "r"(0x38383838u) : "memory");
    fence_proxy_async();  // the MMAs read it in the async proxy
  }
  if constexpr (T::kDynamicSchedule) {
    __shared__ __align__(8) uint64_t queue_bars[T::kConsumers][4];
    __shared__ __align__(8) int queue_slots[T::kConsumers][2];
    const uint32_t slots0 = smem_u32(&queue_slots[0][0]);
    const uint32_t queue_bars0 = smem_u32(&queue_bars[0][0]);
    if (threadIdx.x == 0) {
#pragma unroll
      for (int c = 0; c < T::kConsumers; ++c) WorkQueue<T>::of(slots0, queue_bars0, c).init();
      fence_barrier_init();
    }
    __syncthreads();  // as below, and the queues' barriers are initialised
    run_warpgroups_dynamic<T, QuantProducer<T>, QuantConsumer<T>>(maps, a, base, bars0, slots0,
                                                                  queue_bars0);
  } else {
    __syncthreads();  // every V^T slot a half reads is written by its own copy (padded keys: 0)
    run_warpgroups<T, ConsumerRing<T>, QuantProducer<T>, QuantConsumer<T>>(maps, a, base, bars0);
  }
}

}  // namespace sm90
}  // namespace tilegen
