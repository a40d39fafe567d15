// tilegen CUDA library, block-sparse attention over a tile plan on Hopper (sm_90a): a TMA
// producer warpgroup and kConsumers consumer warpgroups, each consumer on its own query cube
// with its own K and V rings, wgmma for both MMAs, and (kPingPong, two consumers) FA3's
// ping-pong so one consumer's softmax runs under the other's MMAs. A rendered kernel
// (templates/cuda/lut_wgmma_kernel.cu.j2) is its traits and an entry point that calls
// lut_attention.
//
// The plan is the Gluon family's pre-pass output (tilegen/backends/gluon/prepass.py), read as
// is: per LUT row (b, h, query cube) sidx (cube ids: whole-tile cubes first, then the partial
// cubes packed into 64-key tiles), tinfo[t] = first sidx entry of tile t | fill << 16 (tinfo[n]
// the sentinel), meta = (n_tiles or -1 for a row with a bad value, number of one-cube tiles).
//
// Work: groups of kConsumers neighbouring query cubes of one (b, h), consumer c on cube c of
// the group. CTA x takes groups x, x + gridDim.x, ...: one group each with a grid of every
// group, several when the launch is persistent (a grid of one wave), which keeps each
// consumer's rings and two Q buffers (kQBuffers) running from one cube into the next.
// 128 * (1 + kConsumers) threads:
//   warpgroup 0   producer: lowers its registers; warp c's lane 0 loads consumer c's Q of each
//                 cube, then K of tile j and V of tile j - 1 into the rings (a 64-row box per
//                 whole cube, 8-row boxes for packed partial cubes), each slot completing on
//                 its full barrier once its bytes land.
//   warpgroup 1+c consumer c: raises its registers; per tile j: S_j = Q K_j^T and O += P_{j-1}
//                 V_{j-1} issued together (one ping-pong turn), S_j waited for and its K slot
//                 freed, softmax(S_j) while P V runs, then P V waited for, its V slot freed and
//                 O rescaled; finally P V of the last tile, and the epilogue.
// A ring slot is freed by one arrival per consumer warp (count 4) once that warp's wgmma wait
// returned; a Q buffer once the TMA store of the O staged in it has read it. Outputs: o (q's
// dtype and layout) through shared memory and a TMA store, zero in padded query rows when
// asked; with kStoreLse lse fp32 (B, H, S) base 2; with kStoreMaxProb the softmax-normalizer
// signal (max_prob rows = 1 / l, max_prob_cube = its mean over the cube's real rows). A row with
// a bad value comes out NaN; a row with no entry (counts 0) has o = 0, lse = -inf.
#pragma once

#include <cstdint>

#include "tilegen/cuda/ptx.cuh"
#include "tilegen/cuda/sm90/arch.cuh"
#include "tilegen/cuda/sm90/pingpong.cuh"
#include "tilegen/cuda/sm90/softmax.cuh"
#include "tilegen/cuda/sm90/wgmma.cuh"

namespace tilegen {
namespace sm90 {

// C provides: using Elem (Bf16 | Fp16); kBshd (token rows of q, k, v, o: BSHD, else BHSD);
// kHeadDim (64, 128), kBlock (64: cube and tile size), kConsumers (1 to 3), kKStages, kVStages,
// kQBuffers (1, or 2 for a persistent launch), kPingPong (needs 2 consumers), kStoreLse,
// kStoreMaxProb, kConsumerRegs, kProducerRegs.
template <class C>
struct WgmmaTraits : C {
  static constexpr int kThreads = 128 * (1 + C::kConsumers);
  static constexpr int kPanels = C::kHeadDim / kPanelCols;
  static constexpr int kPanelBytes = C::kBlock * 128;
  static constexpr int kTileBytes = kPanels * kPanelBytes;
  static constexpr int kQBytes = kTileBytes;  // a Q buffer (and the O staged in it)
  static constexpr int kScaleBytes = 0;       // no key scales (the 8-bit kernel has them)
  static constexpr int kConsumerBytes = (C::kQBuffers + C::kKStages + C::kVStages) * kTileBytes;
  // + 1024: the dynamic segment's start is aligned up to the swizzle atom at run time
  static constexpr int kSmemBytes = C::kConsumers * kConsumerBytes + 1024;
  // barriers of one consumer: Q full and empty per buffer, then K full/empty, V full/empty
  static constexpr int kBarriers = 2 * C::kQBuffers + 2 * C::kKStages + 2 * C::kVStages;
  static constexpr int kPartialRows = 8;  // box height for packed partial cubes
  static_assert(C::kBlock == 64, "64-token cubes and tiles");
  static_assert(C::kConsumers >= 1 && C::kConsumers <= 3, "one to three consumer warpgroups");
  static_assert(C::kQBuffers == 1 || C::kQBuffers == 2, "one or two Q buffers");
  static_assert(!C::kPingPong || C::kConsumers == 2, "ping-pong takes two consumers");
  static_assert(C::kKStages >= 1 && C::kVStages >= 1, "at least one slot a ring");
};

struct LutArgs {
  const int* sidx;   // (rows, topk)
  const int* tinfo;  // (rows, topk + 1)
  const int* meta;   // (rows, 2)
  const int* vbs;    // (num_kv_blocks,)
  float* lse;        // (B, H, S), kStoreLse
  float* max_prob;   // (B, H, S), kStoreMaxProb
  float* max_prob_cube;  // (B, H, NQ), kStoreMaxProb
  int seq_len;
  int num_heads;
  int batch_heads;   // B * H
  int num_q_blocks;
  int topk;
  float qk_scale;  // sm_scale * log2(e)
  int zero_pad_rows;  // write 0 into query rows past vbs[q_cube]
};

struct TensorMaps {
  const TensorMap& q;    // (64-column, 64-row) boxes
  const TensorMap& k;    // whole cubes
  const TensorMap& k8;   // 8-row boxes for packed partial cubes
  const TensorMap& v;
  const TensorMap& v8;
  const TensorMap& o;

  __device__ __forceinline__ void prefetch() const {  // the maps of every tile's loads
    prefetch_map(k);
    prefetch_map(v);
  }
};

// One consumer's barriers, kBarriers 8-byte words from `bars`: Q full and empty per buffer,
// then K full/empty, V full/empty per ring slot.
template <class T>
struct RingBarriers {
  uint32_t bars;

  __device__ __forceinline__ uint32_t q_full(int b) const { return bars + 8 * b; }
  __device__ __forceinline__ uint32_t q_empty(int b) const {
    return bars + 8 * (T::kQBuffers + b);
  }
  __device__ __forceinline__ uint32_t k_full(int s) const {
    return bars + 8 * (2 * T::kQBuffers + s);
  }
  __device__ __forceinline__ uint32_t k_empty(int s) const {
    return bars + 8 * (2 * T::kQBuffers + T::kKStages + s);
  }
  __device__ __forceinline__ uint32_t v_full(int s) const {
    return bars + 8 * (2 * T::kQBuffers + 2 * T::kKStages + s);
  }
  __device__ __forceinline__ uint32_t v_empty(int s) const {
    return bars + 8 * (2 * T::kQBuffers + 2 * T::kKStages + T::kVStages + s);
  }

  // A full barrier completes on its producer lane's arrival and the bytes it announced; an
  // empty one on each consumer warp's arrival (4), or for Q on the O store's issuing thread.
  __device__ __forceinline__ void init() const {
#pragma unroll
    for (int b = 0; b < T::kQBuffers; ++b) {
      barrier_init(q_full(b), 1);
      barrier_init(q_empty(b), 1);
    }
#pragma unroll
    for (int s = 0; s < T::kKStages; ++s) {
      barrier_init(k_full(s), 1);
      barrier_init(k_empty(s), 4);
    }
#pragma unroll
    for (int s = 0; s < T::kVStages; ++s) {
      barrier_init(v_full(s), 1);
      barrier_init(v_empty(s), 4);
    }
  }
};

// One consumer's slice of shared memory, [Q buffers][K ring][V ring][K scales], and its
// barriers; T gives the sizes (kQBytes, kTileBytes, kScaleBytes: 0 in the 16-bit kernel).
template <class T>
struct ConsumerRing : RingBarriers<T> {
  uint32_t q_tiles;
  uint32_t k_tiles;
  uint32_t v_tiles;
  uint32_t k_scales;

  static __host__ __device__ __forceinline__ ConsumerRing of(uint32_t base, uint32_t bars0,
                                                             int c) {
    ConsumerRing r;
    r.q_tiles = base + c * T::kConsumerBytes;
    r.k_tiles = r.q_tiles + T::kQBuffers * T::kQBytes;
    r.v_tiles = r.k_tiles + T::kKStages * T::kTileBytes;
    r.k_scales = r.v_tiles + T::kVStages * T::kTileBytes;
    r.bars = bars0 + c * T::kBarriers * 8;
    return r;
  }

  __host__ __device__ __forceinline__ uint32_t q_tile(int b) const {
    return q_tiles + b * T::kQBytes;
  }
  __host__ __device__ __forceinline__ uint32_t k_tile(int s) const {
    return k_tiles + s * T::kTileBytes;
  }
  __host__ __device__ __forceinline__ uint32_t v_tile(int s) const {
    return v_tiles + s * T::kTileBytes;
  }
  __host__ __device__ __forceinline__ uint32_t k_scale(int s) const {
    return k_scales + s * T::kScaleBytes;
  }
};

// One consumer's query cube of group g; `live` is false past the last cube of an odd count.
template <class T>
struct Item {
  long long bh;
  int q_cube;
  long long row;  // the plan row (b, h, query cube)
  bool live;

  __device__ __forceinline__ Item(int g, int consumer, const LutArgs& a) {
    const int groups_per_bh = (a.num_q_blocks + T::kConsumers - 1) / T::kConsumers;
    bh = g / groups_per_bh;
    q_cube = (g % groups_per_bh) * T::kConsumers + consumer;
    live = q_cube < a.num_q_blocks;
    row = bh * a.num_q_blocks + q_cube;
  }
  static __device__ __forceinline__ int groups(const LutArgs& a) {
    return a.batch_heads * ((a.num_q_blocks + T::kConsumers - 1) / T::kConsumers);
  }
  __device__ __forceinline__ int tiles(const LutArgs& a) const {
    return live ? __ldg(a.meta + 2 * row) : 0;
  }
};

// Where the token rows of (b, h) start in the 2-D view the tensor maps describe: BSHD is
// (B * S, H * D) with (b, h) at rows b * S, columns h * D; BHSD is (B * H * S, D).
template <class T>
struct TokenRows {
  int row0;
  int col;
  __device__ __forceinline__ TokenRows(long long bh, const LutArgs& a) {
    const int b = static_cast<int>(bh / a.num_heads);
    const int h = static_cast<int>(bh % a.num_heads);
    if constexpr (T::kBshd) {
      row0 = b * a.seq_len;
      col = h * T::kHeadDim;
    } else {
      row0 = (b * a.num_heads + h) * a.seq_len;
      col = 0;
    }
  }
};

// Where one consumer's rings stand, kept alike by it and its producer lane: K and V tiles
// through the rings so far, live cubes so far (Q buffer = cubes % kQBuffers), and per Q buffer
// the parity of its loads and of its uses (bit b: buffer b).
struct RingCursor {
  int k_tiles = 0;
  int v_tiles = 0;
  int cubes = 0;
  uint32_t q_load_parity = 0;
  uint32_t q_use_parity = 0;
  uint32_t q_used = 0;  // bit b: buffer b has staged an O before

  template <class T>
  __device__ __forceinline__ int q_buffer() const {
    return T::kQBuffers == 1 ? 0 : (cubes & 1);
  }

  // A cube's `tiles` K and V tiles have gone through the rings.
  __device__ __forceinline__ void tiles_done(int tiles) {
    k_tiles += tiles;
    v_tiles += tiles;
  }

  // A live cube is over: its Q buffer (bit `bit`) has staged its O.
  __device__ __forceinline__ void cube_done(uint32_t bit) {
    q_use_parity ^= bit;
    q_used |= bit;
    ++cubes;
  }
};

// A consumer's tiles 1..n-1 (`tile(j, p_in, p_out)`: S_j with P_{j-1} V_{j-1}) and the last P V
// (`last(p)`), P's two register buffers alternating so no fragment is copied between tiles.
template <class Tile, class Last, class P>
__device__ __forceinline__ void run_tiles(int n, Tile& tile, Last& last, P& p, P& p_next) {
  int j = 1;
  for (; j + 1 < n; j += 2) {
    tile(j, p, p_next);
    tile(j + 1, p_next, p);
  }
  if (j < n) {
    tile(j, p, p_next);
    last(p_next);
  } else {
    last(p);
  }
}

// The turns of every cube this consumer and its partner take in this CTA (the ping-pong
// schedule pairs turns across cubes).
template <class T, class Turns>
__device__ __forceinline__ Turns pingpong_schedule(const LutArgs& a, int consumer) {
  int self = 0;
  int other = 0;
  for (int g = blockIdx.x; g < Item<T>::groups(a); g += gridDim.x) {
    self += Turns::turns(Item<T>(g, consumer, a).tiles(a));
    if constexpr (T::kConsumers == 2) other += Turns::turns(Item<T>(g, 1 - consumer, a).tiles(a));
  }
  Turns turns;
  turns.init(consumer, self, other);
  return turns;
}

// Byte offset of 16-bit element (row, col) in a tile as TMA writes it (the O staged for its
// store): panel col / 64, the 16-byte chunk XOR the row within its 8-row swizzle atom.
template <class T>
__host__ __device__ __forceinline__ uint32_t staged_offset(int row, int col) {
  const int chunk = (col % kPanelCols) / 8;
  return (col / kPanelCols) * T::kPanelBytes + row * 128 + ((chunk ^ (row % 8)) * 16) +
         (col % 8) * 2;
}

// ---- the producer: one lane per consumer ------------------------------------------------------
template <class T>
struct Producer {
  // Issue the boxes of tile t of a plan row into `dst`, completing on `bar`; `big_cube` is
  // sidx_row[t] when t < n_big (loaded a tile ahead by the caller).
  static __device__ __forceinline__ void load_tile(const TensorMap& whole, const TensorMap& part,
                                                   uint32_t dst, uint32_t bar, int t, int n_big,
                                                   int big_cube, const int* sidx_row,
                                                   const int* tinfo_row, const int* vbs,
                                                   int kv_row0, int col) {
    if (t < n_big) {
      barrier_expect_bytes(bar, T::kTileBytes);
#pragma unroll
      for (int p = 0; p < T::kPanels; ++p)
        tma_load(dst + p * T::kPanelBytes, whole, bar, col + p * kPanelCols,
                 kv_row0 + big_cube * T::kBlock);
      return;
    }
    // packed partial cubes (vbs 32, 16, 8; the pre-pass orders them largest first, so each
    // lands at a multiple of its size and every 8-row box stays inside one swizzle atom)
    const int info = __ldg(tinfo_row + t);
    const int first = info & 0xFFFF;
    const int fill = info >> 16;
    const int last = __ldg(tinfo_row + t + 1) & 0xFFFF;
    barrier_expect_bytes(bar, fill * T::kHeadDim * 2);
    int off = 0;
    for (int i = first; i < last; ++i) {
      const int cube = __ldg(sidx_row + i);
      const int size = __ldg(vbs + cube);
      for (int r = 0; r < size; r += T::kPartialRows)
#pragma unroll
        for (int p = 0; p < T::kPanels; ++p)
          tma_load(dst + p * T::kPanelBytes + (off + r) * 128, part, bar, col + p * kPanelCols,
                   kv_row0 + cube * T::kBlock + r);
      off += size;
    }
  }

  // Q of one cube, then K of tile j and V of tile j - 1 (the consumer needs K_j before V_{j-1}).
  static __device__ __forceinline__ void cube(const TensorMaps& maps, const LutArgs& a,
                                              const ConsumerRing<T>& ring, RingCursor& at,
                                              const Item<T>& item) {
    const int n = item.tiles(a);
    const int qb = at.q_buffer<T>();
    const uint32_t bit = 1u << qb;
    if (n > 0) {
      if (at.q_used & bit)  // the O staged there by this buffer's last cube has been stored
        barrier_wait(ring.q_empty(qb), ((at.q_use_parity & bit) ? 0 : 1));
      const TokenRows<T> rows(item.bh, a);
      const int n_big = __ldg(a.meta + 2 * item.row + 1);
      const int* sidx_row = a.sidx + item.row * a.topk;
      const int* tinfo_row = a.tinfo + item.row * (a.topk + 1);
      barrier_expect_bytes(ring.q_full(qb), T::kTileBytes);
#pragma unroll
      for (int p = 0; p < T::kPanels; ++p)
        tma_load(ring.q_tile(qb) + p * T::kPanelBytes, maps.q, ring.q_full(qb),
                 rows.col + p * kPanelCols, rows.row0 + item.q_cube * T::kBlock);
      at.q_load_parity ^= bit;
      // the cube id of tile j + 1 is loaded while tile j's boxes are issued, and V reuses K's
      // (session 19: as fast as loading each at its tile, with half the loads)
      int cube_next = n_big > 0 ? __ldg(sidx_row) : 0;
      int cube_prev = 0;
      for (int j = 0; j <= n; ++j) {
        const int cube_cur = cube_next;
        if (j + 1 < n_big) cube_next = __ldg(sidx_row + j + 1);
        if (j < n) {
          const int kt = at.k_tiles + j;
          const int s = kt % T::kKStages;
          barrier_wait(ring.k_empty(s), ((kt / T::kKStages) & 1) ^ 1);
          load_tile(maps.k, maps.k8, ring.k_tile(s), ring.k_full(s), j, n_big, cube_cur,
                    sidx_row, tinfo_row, a.vbs, rows.row0, rows.col);
        }
        if (j > 0) {
          const int vt = at.v_tiles + j - 1;
          const int s = vt % T::kVStages;
          barrier_wait(ring.v_empty(s), ((vt / T::kVStages) & 1) ^ 1);
          load_tile(maps.v, maps.v8, ring.v_tile(s), ring.v_full(s), j - 1, n_big, cube_prev,
                    sidx_row, tinfo_row, a.vbs, rows.row0, rows.col);
        }
        cube_prev = cube_cur;
      }
      at.tiles_done(n);
    }
    // every live cube stages its O in its buffer (an empty or bad row too)
    at.cube_done(bit);
  }
};

// ---- a consumer warpgroup ---------------------------------------------------------------------
template <class T>
struct Consumer {
  using Mma = AttentionMma<typename T::Elem, T::kHeadDim, T::kBlock>;
  using Softmax = OnlineSoftmax<typename T::Elem, T::kBlock>;
  using Turns = PingPong<T::kPingPong, 1>;  // named barriers 1, 2
  static constexpr int kEpilogueBarrier = 3;  // + consumer index: 3, 4

  // Free a ring slot: one arrival per warp, after this warp's wgmma wait.
  static __device__ __forceinline__ void release(uint32_t bar, int lane) {
    if (lane == 0) barrier_arrive(bar);
  }

  // One cube: its tiles, then the epilogue. `turn` is the consumer's next turn.
  static __device__ __forceinline__ void cube(const TensorMaps& maps, const LutArgs& a,
                                              const ConsumerRing<T>& ring, RingCursor& at,
                                              const Turns& turns, int& turn, int consumer,
                                              const Item<T>& item) {
    const int lane = threadIdx.x & 31;
    const int warp = (threadIdx.x >> 5) & 3;  // within the warpgroup
    const int n = item.tiles(a);
    const int qb = at.q_buffer<T>();
    const uint32_t bit = 1u << qb;
    const uint32_t q_tile = ring.q_tile(qb);
    const int* tinfo_row = a.tinfo + item.row * (a.topk + 1);
    const float scale = a.qk_scale;
    const int kt0 = at.k_tiles;
    const int vt0 = at.v_tiles;
    const int turn0 = turn;

    float o[Mma::kORegs];
#pragma unroll
    for (int i = 0; i < Mma::kORegs; ++i) o[i] = 0.f;
    float s[Mma::kSRegs];
    uint32_t p[Mma::kPRegs];
    uint32_t p_next[Mma::kPRegs];
    float alpha[2];
    Softmax softmax;
    softmax.init();

    if (n > 0) {
      barrier_wait(ring.q_full(qb), (at.q_load_parity & bit) ? 1 : 0);
      at.q_load_parity ^= bit;
      // tile 0: S only
      int fill = __ldg(tinfo_row) >> 16;
      {
        const int ks = kt0 % T::kKStages;
        barrier_wait(ring.k_full(ks), (kt0 / T::kKStages) & 1);
        turns.begin(turn0);
        wgmma_fence();
        Mma::qk(s, q_tile, ring.k_tile(ks));
        wgmma_commit();
        turns.end(turn0);
        wgmma_wait<0>();
        fence_operands(s);
        release(ring.k_empty(ks), lane);
      }
      if (fill < T::kBlock) Softmax::mask(s, fill, lane);
      softmax.template step<true>(s, p, alpha, scale);
      fill = __ldg(tinfo_row + 1) >> 16;  // tinfo[n] is the sentinel: always readable

      // One tile: S_j and P_{j-1} V_{j-1} in one turn, softmax(S_j) into p_out while P V runs.
      // Two P buffers that swap roles each tile (no copy that ptxas could fold into the
      // in-flight operand).
      auto tile = [&](int j, uint32_t (&p_in)[Mma::kPRegs], uint32_t (&p_out)[Mma::kPRegs]) {
        const int kt = kt0 + j;
        const int vt = vt0 + j - 1;
        const int ks = kt % T::kKStages;
        const int vs = vt % T::kVStages;
        const int fill_next = __ldg(tinfo_row + j + 1) >> 16;
        barrier_wait(ring.k_full(ks), (kt / T::kKStages) & 1);
        barrier_wait(ring.v_full(vs), (vt / T::kVStages) & 1);
        turns.begin(turn0 + j);
        fence_operands(o);
        fence_operands(p_in);
        wgmma_fence();
        Mma::qk(s, q_tile, ring.k_tile(ks));
        wgmma_commit();
        Mma::pv(o, p_in, ring.v_tile(vs));
        wgmma_commit();
        turns.end(turn0 + j);
        wgmma_wait<1>();  // S_j has landed; P_{j-1} V_{j-1} may still run
        fence_operands(s);
        release(ring.k_empty(ks), lane);
        if (fill < T::kBlock) Softmax::mask(s, fill, lane);
        softmax.template step<false>(s, p_out, alpha, scale);
        wgmma_wait<0>();
        fence_operands(o);
        fence_operands(p_in);
        release(ring.v_empty(vs), lane);
        Softmax::rescale(o, alpha);
        fill = fill_next;
      };
      // P V of the last tile, P_{n-1} in whichever buffer the tiles left it
      auto last = [&](uint32_t (&p_last)[Mma::kPRegs]) {
        const int vt = vt0 + n - 1;
        const int vs = vt % T::kVStages;
        barrier_wait(ring.v_full(vs), (vt / T::kVStages) & 1);
        turns.begin(turn0 + n);
        fence_operands(o);
        fence_operands(p_last);
        wgmma_fence();
        Mma::pv(o, p_last, ring.v_tile(vs));
        wgmma_commit();
        turns.end(turn0 + n);
        wgmma_wait<0>();
        fence_operands(o);
        fence_operands(p_last);
        release(ring.v_empty(vs), lane);
      };
      run_tiles(n, tile, last, p, p_next);
      at.tiles_done(n);
      turn += n + 1;
    }
    epilogue(maps, a, ring.q_empty(qb), q_tile, consumer, o, softmax, n < 0, item, warp, lane);
    at.cube_done(bit);
  }

  static __host__ __device__ __forceinline__ uint32_t tile_offset(int row, int col) {
    return staged_offset<T>(row, col);
  }

  // o = acc / l (NaN for a bad row, 0 in padded query rows when asked) into the Q tile's
  // panels in the swizzled layout, then one TMA store per panel (whose reads done, the buffer
  // is free: q_empty); lse and max_prob by lanes.
  static __device__ __forceinline__ void epilogue(const TensorMaps& maps, const LutArgs& a,
                                                  uint32_t q_empty, uint32_t q_tile,
                                                  int consumer, float (&o)[Mma::kORegs],
                                                  const Softmax& softmax, bool bad,
                                                  const Item<T>& item, int warp, int lane) {
    const float nan = __int_as_float(0x7fc00000);
    const int q_real = a.zero_pad_rows ? __ldg(a.vbs + item.q_cube) : T::kBlock;
    float l[2];
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] = softmax.row_sum(h);
      inv[h] = l[h] > 0.f ? 1.f / l[h] : 0.f;
      if (Fragment::row(h, warp, lane) >= q_real) inv[h] = 0.f;
      if (bad) inv[h] = nan;
    }
#pragma unroll
    for (int i = 0; i < Mma::kORegs; i += 2) {
      const int h = Fragment::half(i);
      const uint32_t addr =
          q_tile + tile_offset(Fragment::row(h, warp, lane), Fragment::column(i, lane));
      const uint32_t packed = T::Elem::pack2(o[i] * inv[h], o[i + 1] * inv[h]);
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(packed) : "memory");
    }
    fence_proxy_async();  // the stores above, then the TMA store's reads
    named_sync(kEpilogueBarrier + consumer, 128);
    const TokenRows<T> rows(item.bh, a);
    if (warp == 0 && lane == 0) {
#pragma unroll
      for (int p = 0; p < T::kPanels; ++p)
        tma_store(maps.o, q_tile + p * T::kPanelBytes, rows.col + p * kPanelCols,
                  rows.row0 + item.q_cube * T::kBlock);
      tma_store_commit();
    }
    const long long row0 = item.bh * a.seq_len + static_cast<long long>(item.q_cube) * T::kBlock;
    if constexpr (T::kStoreLse) {
      if ((lane & 3) == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float lse = l[h] > 0.f ? softmax.m[h] * a.qk_scale + log2f(l[h]) : neg_inf();
          if (bad) lse = nan;
          a.lse[row0 + Fragment::row(h, warp, lane)] = lse;
        }
      }
    }
    if constexpr (T::kStoreMaxProb) {
      // 1 / l is the row's largest softmax weight (0 for a row with no key); the cube's share
      // is its mean over the real rows, vbs[q_cube] (NaN when that value is out of range)
      const int n_real_raw = __ldg(a.vbs + item.q_cube);
      const int n_real = min(max(n_real_raw, 1), T::kBlock);
      float share = 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float peak = l[h] > 0.f ? 1.f / l[h] : 0.f;
        if (bad) peak = nan;
        const int r = Fragment::row(h, warp, lane);
        if ((lane & 3) == 0) {
          a.max_prob[row0 + r] = peak;
          if (r < n_real) share += peak;
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) share += __shfl_xor_sync(0xffffffffu, share, off);
      __shared__ float warp_share[T::kConsumers][4];
      if (lane == 0) warp_share[consumer][warp] = share;
      named_sync(kEpilogueBarrier + consumer, 128);
      if (warp == 0 && lane == 0) {
        float cube = (warp_share[consumer][0] + warp_share[consumer][1] +
                      warp_share[consumer][2] + warp_share[consumer][3]) /
                     static_cast<float>(n_real);
        if (n_real_raw < 1 || n_real_raw > T::kBlock) cube = nan;
        a.max_prob_cube[item.bh * a.num_q_blocks + item.q_cube] = cube;
      }
      named_sync(kEpilogueBarrier + consumer, 128);  // the shares are read before the next cube
    }
    if (warp == 0 && lane == 0) {
      tma_store_wait_read();  // the tile stays until it is read
      barrier_arrive(q_empty);
    }
  }
};

// ---- the kernel body ---------------------------------------------------------------------------
// What the 16- and 8-bit kernels share: the barriers, then the producer warpgroup (lane 0 of
// warp c loads consumer c's tiles) and the consumer warpgroups over the CTA's groups.
template <class T, class Ring>
__device__ __forceinline__ void init_barriers(uint32_t base, uint32_t bars0) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int c = 0; c < T::kConsumers; ++c) Ring::of(base, bars0, c).init();
    fence_barrier_init();
  }
}

template <class T, class Ring, class ProducerT, class ConsumerT, class Maps, class Args>
__device__ __forceinline__ void run_warpgroups(const Maps& maps, const Args& a, uint32_t base,
                                               uint32_t bars0) {
  const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) >> 5, 0);
  const int warpgroup = warp >> 2;
  const int lane = threadIdx.x & 31;
  if (warpgroup == 0) {
    lower_registers<T::kProducerRegs>();
    if (warp < T::kConsumers && lane == 0) {
      if (warp == 0) maps.prefetch();
      const Ring ring = Ring::of(base, bars0, warp);
      RingCursor at;
      for (int g = blockIdx.x; g < Item<T>::groups(a); g += gridDim.x) {
        const Item<T> item(g, warp, a);
        if (item.live) ProducerT::cube(maps, a, ring, at, item);
      }
    }
  } else {
    raise_registers<T::kConsumerRegs>();
    const int consumer = warpgroup - 1;
    const Ring ring = Ring::of(base, bars0, consumer);
    using Turns = typename ConsumerT::Turns;
    const Turns turns = pingpong_schedule<T, Turns>(a, consumer);
    RingCursor at;
    int turn = 0;
    for (int g = blockIdx.x; g < Item<T>::groups(a); g += gridDim.x) {
      const Item<T> item(g, consumer, a);
      if (item.live) ConsumerT::cube(maps, a, ring, at, turns, turn, consumer, item);
    }
  }
}

template <class T>
__device__ __forceinline__ void lut_attention(const TensorMaps& maps, const LutArgs& a) {
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t bars[T::kConsumers][T::kBarriers];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t bars0 = smem_u32(&bars[0][0]);
  init_barriers<T, ConsumerRing<T>>(base, bars0);
  // V rows past a packed tile's fill keep what an earlier tile left there; zero them once so
  // that is never NaN (P is 0 there, and 0 * NaN would be NaN)
  {
    const uint4 zero = make_uint4(0, 0, 0, 0);
    constexpr int kChunks = T::kVStages * T::kTileBytes / 16;
    for (int c = 0; c < T::kConsumers; ++c)
      for (int i = threadIdx.x; i < kChunks; i += T::kThreads)
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(
                         ConsumerRing<T>::of(base, bars0, c).v_tiles + 16 * i),
                     "r"(zero.x), "r"(zero.y), "r"(zero.z), "r"(zero.w)
                     : "memory");
    fence_proxy_async();
  }
  __syncthreads();
  run_warpgroups<T, ConsumerRing<T>, Producer<T>, Consumer<T>>(maps, a, base, bars0);
}

}  // namespace sm90
}  // namespace tilegen
