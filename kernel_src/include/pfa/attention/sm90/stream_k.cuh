// Stream-K for the persistent sm_90a 16-bit prefill (PrefillParams::sk_tiles): a single request
// whose work items all cost the same (no causal / window range: every block visits sk_tiles KV
// tiles) leaves the grid's last round partly idle when the blocks are not a multiple of the CTAs
// (a power-of-two shape on 132 SMs runs like 128 of them). Here the blocks before sk_first run a
// block a CTA, round by round (k * G + c), and the rest, between one and two rounds' worth, are
// shared out as equal ranges of KV tiles: CTA c takes tiles [c U / G, (c + 1) U / G) of the
// region's U. A range is longer than a block (the host's rule), so an item is split between two
// CTAs at most, at one point:
//  - CTA c + 1 starts its range with the item's later tiles (a "tail" piece, not the item's first
//    key): its consumers leave their unnormalised O, row maxes and row sums in slot c + 1 of
//    sk_partial, in their own register order, and raise its flag;
//  - CTA c ends its range with the item's first tiles (a "head" piece): once its tile loop is done
//    it waits for the flag (raised long before: the tail is its writer's first piece after the
//    whole rounds, the head its reader's last), folds the slot into its registers as one more
//    online-softmax step, lowers the flag for the next launch, and writes the rows through the
//    usual epilogue (LSE, scales, every output format).
// Each consumer warpgroup hands off its own 64 rows (a flag each), through its own named barrier.
// A writer's piece depends on nothing but its own CTA's earlier blocks, so a waiting CTA waits on
// one that runs (or will, once any CTA finishes): no cycle of waits, however few SMs the launch gets.
#pragma once
#include <math.h>
#include <stdint.h>

#include "pfa/attention/params.h"
#include "pfa/attention/work.cuh"
#include "pfa/ptx/mma_sm80.cuh"
#include "pfa/ptx/sm90.cuh"

namespace pfa {

template <class Cfg>
struct StreamK {
  static constexpr int BLOCK_N = Cfg::BLOCK_N;

  // Whether this launch shares blocks out: the one test of the scheduler, the decode and the
  // consumers, each behind `if constexpr (Cfg::STREAM_K)` (a kernel without it compiles none of
  // this: a call left to dead-code elimination still moved those kernels' register allocation).
  static __device__ __forceinline__ bool on(const PrefillParams& p) { return p.sk_tiles != 0; }

  // The tile units of the shared-out region before CTA c's range (c = G: all of them), floor(c R T
  // / G) for R blocks of T tiles, in 32-bit divisions: c R < 2 G^2 and (c R mod G) T < G T.
  static __device__ __forceinline__ int64_t bound(const PrefillParams& p, int blocks, int c, int G) {
    const int cr = c * (blocks - p.sk_first), q = cr / G;
    return (int64_t)q * p.sk_tiles + (cr - q * G) * p.sk_tiles / G;
  }

  // CTA c's k-th block: round k's (k * G + c) before sk_first, then the items its range touches
  // (blocks: none left).
  static __device__ __forceinline__ int block(const PrefillParams& p, int blocks, int k, int c, int G) {
    const int rounds = p.sk_first / G;
    if (k < rounds) return k * G + c;
    const int64_t lo = bound(p, blocks, c, G), hi = bound(p, blocks, c + 1, G);
    const int64_t item = lo / p.sk_tiles + (k - rounds);
    return item * p.sk_tiles < hi ? p.sk_first + (int)item : blocks;
  }

  // Block b's tiles that CTA c visits: all of them before sk_first, else their share of its range.
  static __device__ __forceinline__ void clip(const PrefillParams& p, PrefillWork& w, int blocks, int b, int c,
                                              int G) {
    if (b < p.sk_first) return;
    const int64_t item0 = (int64_t)(b - p.sk_first) * p.sk_tiles;
    const int64_t lo = max(bound(p, blocks, c, G), item0), hi = min(bound(p, blocks, c + 1, G), item0 + p.sk_tiles);
    w.tile_start += (int)(lo - item0) * BLOCK_N;
    w.num_tiles = (int)(hi - lo);
  }

  // The slot values of one warpgroup: O_ACC + 4 floats a thread (O, then m[0], m[1], l[0], l[1]),
  // as float4 vectors, vector v of thread t at [v][t] (every store and load a whole 512 bytes a warp).
  template <int O_ACC>
  static __device__ __forceinline__ float4* slot(const PrefillParams& p, int s, int wg) {
    constexpr int VECS = O_ACC / 4 + 1;
    return reinterpret_cast<float4*>(p.sk_partial) + ((int64_t)s * Cfg::CONSUMERS + wg) * VECS * Cfg::WG_THREADS;
  }
  static __device__ __forceinline__ int* flag(const PrefillParams& p, int s, int wg) {
    return reinterpret_cast<int*>(p.sk_flags) + s * Cfg::CONSUMERS + wg;
  }

  // After consumer wg's tile loop of block w: false where the rows are another CTA's to finish (a
  // tail piece, now handed off); true where the epilogue writes them (a whole item, or a head piece
  // with the tail's part folded in).
  template <int O_ACC>
  static __device__ __forceinline__ bool settle(const PrefillParams& p, const PrefillWork& w, int wg, int tid,
                                                float (&o)[O_ACC], float (&m)[2], float (&l)[2]) {
    static_assert(O_ACC % 4 == 0, "whole float4 vectors");
    constexpr int VECS = O_ACC / 4 + 1;
    const bool first = w.tile_start == w.kv_lo / BLOCK_N * BLOCK_N;
    const bool last = w.tile_start + w.num_tiles * BLOCK_N >= w.kv_hi;
    if (first && last) return true;
    const int c = blockIdx.x;
    if (!first) {  // a tail piece: CTA c's first after its whole rounds, into slot c
      float4* dst = slot<O_ACC>(p, c, wg) + tid;
#pragma unroll
      for (int v = 0; v < O_ACC / 4; ++v)
        __stcg(dst + v * Cfg::WG_THREADS, make_float4(o[4 * v], o[4 * v + 1], o[4 * v + 2], o[4 * v + 3]));
      __stcg(dst + (VECS - 1) * Cfg::WG_THREADS, make_float4(m[0], m[1], l[0], l[1]));
      ptx::bar_sync(Cfg::WG_BAR + wg, Cfg::WG_THREADS);  // every thread's stores before the flag
      if (tid == 0) {
        __threadfence();
        ptx::st_release_gpu(flag(p, c, wg), 1);
      }
      return false;
    }
    // a head piece: CTA c's last; the item's later tiles are in slot c + 1
    int* f = flag(p, c + 1, wg);
    if (tid == 0) {
      while (ptx::ld_acquire_gpu(f) == 0) __nanosleep(256);
    }
    ptx::bar_sync(Cfg::WG_BAR + wg, Cfg::WG_THREADS);
    if (tid == 0) *f = 0;  // (read once: the next launch finds it lowered)
    const float4* src = slot<O_ACC>(p, c + 1, wg) + tid;
    const float4 st = __ldcg(src + (VECS - 1) * Cfg::WG_THREADS);
    const float mw[2] = {st.x, st.y}, lw[2] = {st.z, st.w};
    float a[2], b[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // one online-softmax step: both parts against the larger max
      const float mx = fmaxf(m[i], mw[i]);
      const float mu = mx == -INFINITY ? 0.f : mx;
      a[i] = exp2f(m[i] - mu);
      b[i] = exp2f(mw[i] - mu);
      l[i] = l[i] * a[i] + lw[i] * b[i];
      m[i] = mx;
    }
#pragma unroll
    for (int v = 0; v < O_ACC / 4; ++v) {  // o[4 v + e]: row (e >> 1) of the thread's two
      const float4 x = __ldcg(src + v * Cfg::WG_THREADS);
      o[4 * v] = o[4 * v] * a[0] + x.x * b[0];
      o[4 * v + 1] = o[4 * v + 1] * a[0] + x.y * b[0];
      o[4 * v + 2] = o[4 * v + 2] * a[1] + x.z * b[1];
      o[4 * v + 3] = o[4 * v + 3] * a[1] + x.w * b[1];
    }
    return true;
  }
};

}  // namespace pfa
