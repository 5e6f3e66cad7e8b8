// The warp-specialised CTA both sm_90a prefills (16-bit: prefill_sm90.cuh, fp8:
// prefill_sm90_fp8.cuh) run: the work item(s), the mbarrier ring, then warpgroup 0 produces (with
// its registers given up to the consumers) and warpgroups 1..CONSUMERS consume.
//
// Cfg::PERSISTENT: the launch has at most a CTA per SM, and each CTA walks blocks of the logical
// grid (PrefillParams::grid_x/y/z, in LogicalGrid's order: sections of kv heads, heaviest first
// within) as the tile scheduler hands them out (sm90/tile_scheduler.cuh: the next block to
// whichever CTA asks next). Both roles decode the same blocks and keep their own Sm90Walk; the
// ring and the Q barriers run on across blocks, which is what overlaps one block's epilogue with
// the next one's first loads.
#pragma once
#include <stdint.h>

#include "pfa/attention/params.h"
#include "pfa/attention/sm90/pipeline.cuh"
#include "pfa/attention/sm90/producer.cuh"
#include "pfa/attention/sm90/stream_k.cuh"
#include "pfa/attention/sm90/tile_scheduler.cuh"
#include "pfa/attention/work.cuh"
#include "pfa/ptx/pdl.cuh"
#include "pfa/ptx/sm90.cuh"

namespace pfa {

struct NoWalkDone {
  __device__ __forceinline__ void operator()(int, const Sm90Walk&) const {}
};

// produce(w, base, tid, walk): the producer warpgroup; consume(w, base, wg, tid, walk, ahead):
// consumer wg (0 .. CONSUMERS - 1), tid its thread within the warpgroup, walk its Sm90Walk
// (advanced here after each block), ahead() to be called between the block's tile loop and its
// epilogue (persistent: it takes and decodes the walk's next block); walk_done(wg, walk): consumer
// wg after its CTA's last block. base: the shared window's address of the dynamic shared memory,
// rounded up to the swizzle atom.
template <class Cfg, class Produce, class Consume, class WalkDone = NoWalkDone>
__device__ __forceinline__ void run_warp_specialized_cta(const PrefillParams& p, char* smem, Produce produce,
                                                         Consume consume, WalkDone walk_done = {}) {
  // As the sm80 kernel: the merge may launch early; nothing is read before the grid ahead is done.
  ptx::allow_dependents();
  ptx::wait_prior_grids();
  const uint32_t base = (ptx::smem_u32(smem) + Cfg::ATOM_BYTES - 1) & ~(uint32_t)(Cfg::ATOM_BYTES - 1);
  const int tid = threadIdx.x, wg = tid / Cfg::WG_THREADS;
  // Block b of the logical grid into w (false: nothing to do), for every role and walk below.
  // Honours rows_fastest (a head's row tiles together, its K/V shared in L2): the register it
  // costs is no constraint here.
  // Stream-K (PERSISTENT): a block of the shared-out region to the CTA's part of its tiles.
  auto decode = [&](PrefillWork& w, int b) {
    if (!decode_work<Cfg::BLOCK_M, Cfg::BLOCK_N, Cfg::PAGED, false, true>(p, w, LogicalGrid::at(p, b))) return false;
    if constexpr (Cfg::STREAM_K) {
      if (StreamK<Cfg>::on(p)) StreamK<Cfg>::clip(p, w, p.grid_x * p.grid_y * p.grid_z, b, blockIdx.x, gridDim.x);
    }
    return true;
  };
  if constexpr (!Cfg::PERSISTENT) {
    // A one-dimensional launch over the logical grid (LogicalGrid: in L2 sections): the hardware
    // starts blocks in launch order as CTAs retire, a section's before the next's.
    PrefillWork w;
    if (!decode(w, blockIdx.x)) return;
    if (tid == 0) init_ring_barriers<Cfg>(base);
    __syncthreads();
    Sm90Walk walk;
    if (wg == 0) {
      ptx::setmaxnreg_dec<Cfg::PRODUCER_REGS>();
      produce(w, base, tid, walk);
    } else {
      ptx::setmaxnreg_inc<Cfg::CONSUMER_REGS>();
      consume(w, base, wg - 1, tid % Cfg::WG_THREADS, walk, [] {});
      walk.advance(w.num_tiles);
      walk_done(wg - 1, walk);
    }
  } else {
    using Sched = Sm90TileScheduler<Cfg>;
    if (tid == 0) {
      init_ring_barriers<Cfg>(base);
      Sched::init(base);
      ptx::mbar_fence_init();
    }
    __syncthreads();
    // Each role runs its own loop: code after setmaxnreg that both roles shared would hold them to
    // one register budget (ptxas then ignores setmaxnreg and spills). The producer's thread 0
    // fetches each block's index as the producer starts it (ahead of the consumers).
    auto walk_blocks = [&](auto&& role, bool producer) {
      Sm90Walk walk;
      const int blocks = Sched::blocks(p);
#pragma unroll 1
      for (int k = 0;; ++k) {
        const int b = producer ? Sched::produce(p, base, k, tid) : Sched::consume(base, k);
        if (b >= blocks) break;
        PrefillWork w;
        if (!decode(w, b)) continue;
        role(w, walk);
        walk.advance(w.num_tiles);
      }
      return walk;
    };
    if (wg == 0) {
      ptx::setmaxnreg_dec<Cfg::PRODUCER_REGS>();
      walk_blocks([&](const PrefillWork& w, Sm90Walk& walk) { produce(w, base, tid, walk); }, true);
      if (tid == 0) Sched::finish(p);
      // Every cp.async lands before the CTA exits (the barriers they arrive on live in its shared memory).
      ptx::cp_async_commit();
      ptx::cp_async_wait<0>();
    } else if constexpr (!Cfg::DECODE_AHEAD) {
      ptx::setmaxnreg_inc<Cfg::CONSUMER_REGS>();
      const Sm90Walk walk = walk_blocks(
          [&](const PrefillWork& w, Sm90Walk& walk) {
            consume(w, base, wg - 1, tid % Cfg::WG_THREADS, walk, [] {});
          },
          false);
      walk_done(wg - 1, walk);
    } else {
      ptx::setmaxnreg_inc<Cfg::CONSUMER_REGS>();
      // DECODE_AHEAD: a consumer takes and decodes block k + 1 between block k's tile loop and its
      // epilogue (`ahead`). The index is in the ring by then (the producer fetched it as it
      // finished issuing block k), and the decode's dependent loads (plan item, then indptrs) run
      // under the epilogue instead of between it and the next block's first S. The walk starts
      // from an empty block whose `ahead` takes block 0.
      Sm90Walk walk;
      const int blocks = Sched::blocks(p);
      PrefillWork w;
      bool run = false;
#pragma unroll 1
      for (int k = 0, b = 0; b < blocks; ++k) {
        PrefillWork next;
        bool run_next, taken = false;
        auto take = [&] {
          b = Sched::consume(base, k);
          run_next = b < blocks && decode(next, b);
          taken = true;
        };
        // AHEAD_WHEN_READY: only if the index is there already; else after the epilogue
        auto ahead = [&] {
          if (!Cfg::AHEAD_WHEN_READY || Sched::ready(base, k)) take();
        };
        if (run) {
          consume(w, base, wg - 1, tid % Cfg::WG_THREADS, walk, ahead);
          walk.advance(w.num_tiles);
          if (Cfg::AHEAD_WHEN_READY && !taken) take();
        } else {
          take();
        }
        w = next;
        run = run_next;
      }
      walk_done(wg - 1, walk);
    }
  }
}

}  // namespace pfa
