// The persistent sm_90a CTAs' tile scheduler (Cfg::PERSISTENT, sm90/cta.cuh): blocks of the logical
// grid are handed out in the grid's order, each to whichever CTA asks next.
//
// Why dynamic: the logical grid comes heaviest first (causal row tiles, a batch plan's LPT list),
// and in sections of kv heads (PrefillParams::grid_section, LogicalGrid) so that the K/V the CTAs
// in flight read fits L2. A fixed assignment (CTA c takes blocks c, 2G - 1 - c, ...) balances a
// list that only descends, but not one that descends once per section; a CTA that takes the next
// block when it is free balances both (list scheduling), and the blocks still run in the grid's
// order, which is what keeps a section's K/V in L2.
//
// Without counters (PrefillParams::sched 0: single prefill, whose calls have no zeroed memory of
// their own) CTA c takes a fixed share, round k's block k * G + c (G - 1 - c on odd k): the
// boustrophedon evens out one descending list, so the host then keeps one section. Or, where the
// blocks all cost the same (sk_tiles), rounds of k * G + c and then stream-K's ranges of the last
// blocks' tiles (sm90/stream_k.cuh).
//
// How: PrefillParams::sched holds two zeroed int32 counters (next block, CTAs finished). CTA c's
// first block is c itself; each later one comes from atomicAdd(next) + gridDim.x, fetched by the
// producer's thread 0 as soon as the producer starts a block (the producer runs ahead of the
// consumers, so the fetch's latency hides behind their tiles). The index reaches the CTA's threads
// through a two-slot ring in shared memory: slot k & 1 holds block k's index; the producer's named
// barrier hands it to the producer warpgroup (TAIL_WARPS: a shuffle to warp 0, the ring to warps
// 1..3), `full` (one arrival, the fetching thread's) to the consumers, whose `empty` (one arrival
// per reading thread) frees the slot for block k + 2. An index past the grid ends every role's
// walk. The launch's last CTA to finish zeroes both
// counters, so the next launch (a CUDA-graph replay too) finds them as the host left them.
#pragma once
#include <stdint.h>

#include "pfa/attention/params.h"
#include "pfa/attention/sm90/stream_k.cuh"
#include "pfa/ptx/mma_sm80.cuh"
#include "pfa/ptx/sm90.cuh"

namespace pfa {

template <class Cfg>
struct Sm90TileScheduler {
  // shared memory at Cfg::SCHED_OFFSET: full[2], empty[2] (mbarriers), index[2] (int32)
  static constexpr int BYTES = 4 * 8 + 2 * 4;
  static_assert(BYTES == Cfg::SCHED_BYTES, "config.cuh's SCHED_BYTES holds the ring");
  static __device__ __forceinline__ uint32_t full(uint32_t base, int slot) {
    return base + Cfg::SCHED_OFFSET + 8 * slot;
  }
  static __device__ __forceinline__ uint32_t empty(uint32_t base, int slot) {
    return base + Cfg::SCHED_OFFSET + 16 + 8 * slot;
  }
  static __device__ __forceinline__ uint32_t index(uint32_t base, int slot) {
    return base + Cfg::SCHED_OFFSET + 32 + 4 * slot;
  }

  // A slot's readers: every consumer thread, and (TAIL_WARPS) producer warps 1..3.
  static constexpr int READERS = Cfg::CONSUMERS * Cfg::WG_THREADS + (Cfg::TAIL_WARPS ? Cfg::WG_THREADS - 32 : 0);
  static __device__ __forceinline__ void init(uint32_t base) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      ptx::mbar_init(full(base, s), 1);
      ptx::mbar_init(empty(base, s), READERS);
    }
  }

  static __device__ __forceinline__ int blocks(const PrefillParams& p) { return p.grid_x * p.grid_y * p.grid_z; }
  static __device__ __forceinline__ bool stream_k(const PrefillParams& p) {
    if constexpr (Cfg::STREAM_K) return StreamK<Cfg>::on(p);
    return false;
  }

  // The producer's thread 0: fetch block k's index into its slot (and return it).
  static __device__ __forceinline__ int fetch(const PrefillParams& p, uint32_t base, int k) {
    const int slot = k & 1;
    ptx::mbar_wait(empty(base, slot), ((k >> 1) & 1) ^ 1);  // every reader has read block k - 2's index
    const int G = gridDim.x, c = blockIdx.x;
    int b;
    if (stream_k(p))  // (no counters: single prefill)
      b = StreamK<Cfg>::block(p, blocks(p), k, c, G);
    else if (k == 0)
      b = c;
    else if (p.sched != 0)
      b = atomicAdd(reinterpret_cast<int*>(p.sched), 1) + G;
    else  // no counters: a fixed share, round k's blocks boustrophedon (k * G + c, or G - 1 - c on odd k)
      b = k * G + ((k & 1) ? G - 1 - c : c);
    ptx::st_shared_u32(index(base, slot), (uint32_t)b);
    ptx::mbar_arrive(full(base, slot));  // release: the index store before the arrival
    return b;
  }

  // Block k's index (>= blocks(p): the walk is over), once per block of the walk by every thread of
  // its role. The producer warpgroup: thread 0 fetches it, the producer's named barrier passes it
  // on (and orders these reads before thread 0's store of block k + 2's index, after the next
  // barrier). A consumer thread waits for `full`, reads it and frees the slot: its arrival releases
  // its own read (each thread arrives: an arrival orders no other thread's accesses).
  // TAIL_WARPS: warp 0 takes thread 0's index by shuffle and warps 1..3 read the slot as a
  // consumer does, so that warp 0 never waits for them (producer_tma.cuh).
  static __device__ __forceinline__ int produce(const PrefillParams& p, uint32_t base, int k, int tid) {
    if constexpr (Cfg::TAIL_WARPS) {
      if (tid >= 32) return consume(base, k);
      const int b = tid == 0 ? fetch(p, base, k) : 0;
      return __shfl_sync(0xffffffffu, b, 0);
    } else {
      if (tid == 0) fetch(p, base, k);
      ptx::bar_sync(Cfg::PRODUCER_BAR, Cfg::WG_THREADS);
      return (int)ptx::ld_shared_u32(index(base, k & 1));
    }
  }
  // Whether block k's index is in its slot (consume would not wait).
  static __device__ __forceinline__ bool ready(uint32_t base, int k) {
    return ptx::mbar_test(full(base, k & 1), (k >> 1) & 1);
  }
  static __device__ __forceinline__ int consume(uint32_t base, int k) {
    const int slot = k & 1;
    ptx::mbar_wait(full(base, slot), (k >> 1) & 1);
    const int b = (int)ptx::ld_shared_u32(index(base, slot));
    ptx::mbar_arrive(empty(base, slot));
    return b;
  }

  // The producer's thread 0 after its walk's last fetch: the launch's last CTA here zeroes the
  // counters (every CTA's fetches come before its arrival, so none is still fetching).
  static __device__ __forceinline__ void finish(const PrefillParams& p) {
    if (p.sched == 0) return;
    int* counters = reinterpret_cast<int*>(p.sched);
    __threadfence();
    if (atomicAdd(counters + 1, 1) == (int)gridDim.x - 1) {
      __threadfence();
      atomicExch(counters, 0);
      atomicExch(counters + 1, 0);
    }
  }
};

}  // namespace pfa
