// tilegen CUDA library, ping-pong between two consumer warpgroups (sm_90a, FA3's scheduling):
// each consumer's issue of its MMAs is a "turn", and turns alternate 0, 1, 0, 1, ... on two
// named barriers, so one warpgroup's softmax runs while the tensor cores work through the
// other's MMAs instead of both bursting on the same units at once.
//
// The two consumers walk different LUT rows, so their turn counts differ. Both know both counts
// (over every cube each takes in the CTA: turns(n) = n + 1 for a cube of n >= 1 tiles, S of
// each tile and P V of the last; 0 otherwise), and a turn waits only on a partner turn that
// exists: consumer 0's turn k (k >= 1) waits for
// consumer 1's turn k - 1, consumer 1's turn k for consumer 0's turn k. Every bar.sync has
// exactly one matching bar.arrive, and once one consumer runs out of turns the other runs free.
#pragma once

#include "tilegen/cuda/sm90/arch.cuh"

namespace tilegen {
namespace sm90 {

// kBarrier0: the named barrier consumer 0 waits on (consumer 1's is kBarrier0 + 1).
template <bool kEnabled, int kBarrier0>
struct PingPong {
  static constexpr int kThreads = 256;  // two warpgroups meet at each barrier
  int self;        // 0 or 1
  int turns_self;  // turns of this consumer
  int turns_other;

  // The turns each consumer takes, over all its cubes (`turns` of each cube's tile count).
  __device__ __forceinline__ void init(int consumer, int self_turns, int other_turns) {
    self = consumer;
    turns_self = self_turns;
    turns_other = other_turns;
  }

  // A cube of `tiles` tiles takes one turn per tile (its S, with the previous tile's P V) and
  // one for the last P V; none without a tile (or with a bad value, tiles -1).
  static __host__ __device__ __forceinline__ int turns(int tiles) {
    return tiles >= 1 ? tiles + 1 : 0;
  }

  // The schedule, as pure predicates (a host test replays them: tests/test_cuda_wgmma.py).
  // Whether consumer `self`'s turn k waits on its barrier for the partner's previous turn ...
  static __host__ __device__ __forceinline__ bool waits(int self, int k, int turns_other) {
    return self == 0 ? (k >= 1 && k <= turns_other) : k < turns_other;
  }
  // ... and whether its turn k, once issued, lets the partner's next turn go.
  static __host__ __device__ __forceinline__ bool releases(int self, int k, int turns_other) {
    return self == 0 ? k < turns_other : k + 1 < turns_other;
  }

  // Before issuing turn k's MMAs: wait for the partner's turn before it, if there is one.
  __device__ __forceinline__ void begin(int k) const {
    if constexpr (kEnabled) {
      if (waits(self, k, turns_other)) named_sync(kBarrier0 + self, kThreads);
    }
  }

  // After issuing turn k's MMAs: let the partner's next turn go, if it has one waiting on it.
  __device__ __forceinline__ void end(int k) const {
    if constexpr (kEnabled) {
      if (releases(self, k, turns_other)) named_arrive(kBarrier0 + 1 - self, kThreads);
    }
  }
};

}  // namespace sm90
}  // namespace tilegen
