// Hopper (sm_90a) prefill: warp-specialised, wgmma, mbarrier-pipelined. The entry header the
// generated translation units include: the kernel's run() and PFA_DEFINE_PREFILL_SM90.
//   sm90/cta.cuh       the warp-specialised CTA (work item, mbarrier ring, the roles)
//   work.cuh           which request, row tile and KV chunk; the key range (shared with sm80)
//   sm90/producer.cuh  warpgroup 0: Q, then the K/V ring by cp.async, completing on mbarriers
//   sm90/producer_tma.cuh  or (TMA) the K/V ring as TMA boxes issued by one warp
//   sm90/widen_producer.cuh  or (KV_FP8) one-byte K/V copied raw, then widened into the ring
//   sm90/consumer.cuh  warpgroups 1..CONSUMERS: 64 rows each, S = Q K^T and O += P V on wgmma,
//                      overlapped with the softmax; PINGPONG alternates the two consumers' GEMMs
//   sm90/epilogue.cuh  normalise, then O + LSE or split-KV partials (epilogue.cuh layouts)
//   sm90/stream_k.cuh  (PERSISTENT) a single request's last blocks shared out as ranges of tiles
// sm90/config.cuh holds the tile shape, register split and shared-memory layout.
// Covered so far: 16-bit Q with 16-bit or (KV_FP8, head_dim <= 128) fp8 K/V, contiguous, ragged or
// paged K/V, causal / window / none, LSE, split KV, sinks; everything else routes to the sm80
// family (variants.py builds only these rows).
#pragma once
#include <stdint.h>

#include "pfa/attention/params.h"
#include "pfa/attention/sm90/config.cuh"
#include "pfa/attention/sm90/consumer.cuh"
#include "pfa/attention/sm90/cta.cuh"
#include "pfa/attention/sm90/epilogue.cuh"
#include "pfa/attention/sm90/producer.cuh"
#include "pfa/attention/sm90/producer_tma.cuh"
#include "pfa/attention/sm90/stream_k.cuh"
#include "pfa/attention/sm90/widen_producer.cuh"
#include "pfa/attention/work.cuh"
#include "pfa/ptx/mma_sm80.cuh"
#include "pfa/ptx/pdl.cuh"
#include "pfa/ptx/sm90.cuh"

namespace pfa {

template <typename T, int HEAD_DIM, int BLOCK_N, int CONSUMERS, int STAGES, bool PINGPONG, bool PAGED, bool TMA,
          bool SKIP, bool PERSISTENT, bool KV_FP8 = false, bool DENSE_KV = false, bool SPAN_KV = false>
struct PrefillSm90
    : PrefillSm90Config<T, HEAD_DIM, BLOCK_N, CONSUMERS, STAGES, PAGED, TMA, PERSISTENT, KV_FP8, DENSE_KV, SPAN_KV> {
  using Cfg = PrefillSm90Config<T, HEAD_DIM, BLOCK_N, CONSUMERS, STAGES, PAGED, TMA, PERSISTENT, KV_FP8, DENSE_KV,
                                SPAN_KV>;
  using Consumer = ConsumerSm90<Cfg, PINGPONG, SKIP>;

  // wg: the consumer's index (0 .. CONSUMERS - 1); tid: the thread's index within its warpgroup.
  // ahead(): run_warp_specialized_cta's, between the tile loop and the epilogue.
  template <class Ahead>
  static __device__ __forceinline__ void consume(const PrefillParams& p, const PrefillWork& w, uint32_t base, int wg,
                                                 int tid, const Sm90Walk& walk, Ahead&& ahead) {
    const int lane = tid % 32, warp = tid / 32;
    const typename Consumer::Rows rows = Consumer::rows_of(p, w, wg, warp, lane);
    float o[Consumer::O_ACC];
#pragma unroll
    for (int i = 0; i < Consumer::O_ACC; ++i) o[i] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    Consumer::mainloop(p, w, rows, base, wg, lane, o, m, l, walk);
    ahead();
    if constexpr (Cfg::STREAM_K) {  // a piece of a shared-out block: hand off, or fold in the rest
      if (StreamK<Cfg>::on(p) && !StreamK<Cfg>::settle(p, w, wg, tid, o, m, l)) return;
    }
    EpilogueSm90<Cfg, Consumer::O_ACC>::run(p, w, rows.tile_row, lane, o, m, l);
  }

  static __device__ __forceinline__ void run(const PrefillParams& p, char* smem) {
    run_warp_specialized_cta<Cfg>(
        p, smem,
        [&](const PrefillWork& w, uint32_t base, int tid, Sm90Walk& walk) {
          if constexpr (Cfg::KV_FP8)
            ProducerSm90Widen<Cfg>::run(p, w, base, tid, walk);
          else if constexpr (Cfg::TMA)
            ProducerSm90Tma<Cfg>::run(p, w, base, tid, walk);
          else
            ProducerSm90<Cfg>::run(p, w, base, tid, walk);
        },
        [&](const PrefillWork& w, uint32_t base, int wg, int tid, const Sm90Walk& walk, auto&& ahead) {
          consume(p, w, base, wg, tid, walk, ahead);
        },
        [&](int wg, const Sm90Walk& walk) { Consumer::walk_done(wg, walk); });
  }
};

}  // namespace pfa

// One extern "C" entry per variant (see PFA_DEFINE_PREFILL_SM80). SMEM: variants.py's smem_bytes,
// checked against the kernel's layout at compile time.
#define PFA_DEFINE_PREFILL_SM90(NAME, T, HD, BN, CONSUMERS, STAGES, PINGPONG, PAGED, TMA, SKIP, PERSISTENT, KV_FP8, \
                                DENSE_KV, SPAN_KV, SMEM)                                                           \
  static_assert(pfa::PrefillSm90<T, HD, BN, CONSUMERS, STAGES, PINGPONG, PAGED, TMA, SKIP, PERSISTENT, KV_FP8,         \
                                 DENSE_KV, SPAN_KV>::SMEM_BYTES == (SMEM),                                           \
                #NAME ": variants.py smem_bytes differs from the kernel's shared-memory layout");                    \
  extern "C" __global__ void __launch_bounds__((CONSUMERS + 1) * 128, 1)                                             \
      NAME(const __grid_constant__ pfa::PrefillParams p) {                                                           \
    extern __shared__ __align__(1024) char smem[];                                                                   \
    pfa::PrefillSm90<T, HD, BN, CONSUMERS, STAGES, PINGPONG, PAGED, TMA, SKIP, PERSISTENT, KV_FP8, DENSE_KV,          \
                     SPAN_KV>::run(p, smem);                                                                         \
  }
