// Hopper (sm_90a) fp8 prefill: e4m3 Q, K and V on e4m3 wgmma (m64nNk32), into a bf16, fp16 or e4m3
// output (PrefillParams::o_format counts from bf16 here). The entry header of the generated
// translation units: PrefillSm90Fp8::run and PFA_DEFINE_PREFILL_SM90_FP8 (the CTA: sm90/cta.cuh).
//   sm90/fp8_config.cuh    tile shape and shared-memory layout (Q, K ring, Vt ring, raw V)
//   sm90/fp8_producer.cuh  warpgroup 0: Q, K tiles, V tiles transposed into the Vt ring (ragged
//                          rows, by cp.async or (TMA) boxes, or PAGED: a paged cache by owned-row copies)
//   sm90/fp8_consumer.cuh  warpgroups 1..CONSUMERS: the 16-bit family's tile loop on e4m3 wgmma
//   sm90/epilogue.cuh      the 16-bit family's epilogue, after O is scaled by scale_v[kv head]
// Scales (FlashInfer's fp8 prefill, semantics 1.9): logits of q head h, kv head g get
// sm_scale * q_scale_heads[h] * k_scale_heads[g] (and the LSE is over those logits); output rows
// of kv head g get v_scale * v_scale_heads[g]. Contiguous, ragged or (PAGED) paged K/V, separate V
// page ids included; causal / window / none, LSE, split KV, sinks, (PAGED) the NVFP4 output; the
// options of the general kernels are refused by the host.
#pragma once
#include <stdint.h>

#include "pfa/attention/params.h"
#include "pfa/attention/sm90/cta.cuh"
#include "pfa/attention/sm90/epilogue.cuh"
#include "pfa/attention/sm90/fp8_config.cuh"
#include "pfa/attention/sm90/fp8_consumer.cuh"
#include "pfa/attention/sm90/fp8_producer.cuh"
#include "pfa/attention/work.cuh"
#include "pfa/ptx/pdl.cuh"
#include "pfa/ptx/sm90.cuh"

namespace pfa {

// What EpilogueSm90 reads of its config: the output's own 16-bit type, the head dim, and whether
// it writes the NVFP4 output (o_format kOutNvfp4): the paged kernels (the TRT-LLM context API runs
// on paged kernels; at every head dim without a spill, unlike the 16-bit hd256 row). variants.py's
// nvfp4_out mirrors the rule; the host routes NVFP4 outputs by it.
template <class Out16, int HD, bool PAGED>
struct Sm90Fp8OutCfg {
  using Elem = Out16;
  static constexpr int HEAD_DIM = HD;
  static constexpr bool NVFP4_OUT = PAGED;
};

template <int HEAD_DIM, int BLOCK_N, int CONSUMERS, int STAGES, bool PINGPONG, bool OVERLAP, bool PAGED,
          bool PERSISTENT, bool TMA, bool DENSE_KV = false>
struct PrefillSm90Fp8 : PrefillSm90Fp8Config<HEAD_DIM, CONSUMERS, STAGES, PAGED, PERSISTENT, TMA, BLOCK_N, DENSE_KV> {
  using Cfg = PrefillSm90Fp8Config<HEAD_DIM, CONSUMERS, STAGES, PAGED, PERSISTENT, TMA, BLOCK_N, DENSE_KV>;
  using Consumer = ConsumerSm90Fp8<Cfg, PINGPONG, OVERLAP>;
  using OutCfg = Sm90Fp8OutCfg<typename Cfg::Out16, HEAD_DIM, PAGED>;

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
    Consumer::unshift_max(m);
    // scale_v of the kv head: O is linear in V, so it scales O here (before the normalisation and
    // any sink factor, which are per row and commute with it; split partials carry it into the merge).
    if (p.v_scale_heads != 0) {
      const float sv = reinterpret_cast<const float*>(p.v_scale_heads)[w.kv_head];
#pragma unroll
      for (int i = 0; i < Consumer::O_ACC; ++i) o[i] *= sv;
    }
    EpilogueSm90<OutCfg, Consumer::O_ACC, false, Cfg::PERMUTED_VT>::run(p, w, rows.tile_row, lane, o, m, l);
  }

  static __device__ __forceinline__ void run(const PrefillParams& p, char* smem) {
    run_warp_specialized_cta<Cfg>(
        p, smem,
        [&](const PrefillWork& w, uint32_t base, int tid, Sm90Walk& walk) {
          ProducerSm90Fp8<Cfg>::run(p, w, base, tid, walk);
        },
        [&](const PrefillWork& w, uint32_t base, int wg, int tid, const Sm90Walk& walk, auto&& ahead) {
          consume(p, w, base, wg, tid, walk, ahead);
        },
        [&](int wg, const Sm90Walk& walk) { Consumer::walk_done(wg, walk); });
  }
};

}  // namespace pfa

// One extern "C" entry per variant (as PFA_DEFINE_PREFILL_SM90). SMEM: variants.py's smem_bytes,
// checked against the kernel's layout at compile time.
#define PFA_DEFINE_PREFILL_SM90_FP8(NAME, HD, BN, CONSUMERS, STAGES, PINGPONG, OVERLAP, PAGED, PERSISTENT, TMA,     \
                                    DENSE_KV, SMEM)                                                             \
  static_assert(pfa::PrefillSm90Fp8<HD, BN, CONSUMERS, STAGES, PINGPONG, OVERLAP, PAGED, PERSISTENT, TMA,          \
                                    DENSE_KV>::SMEM_BYTES == (SMEM),                                            \
                #NAME ": variants.py smem_bytes differs from the kernel's shared-memory layout");               \
  extern "C" __global__ void __launch_bounds__((CONSUMERS + 1) * 128, 1)                                        \
      NAME(const __grid_constant__ pfa::PrefillParams p) {                                                      \
    extern __shared__ __align__(1024) char smem[];                                                              \
    using Kernel =                                                                                              \
        pfa::PrefillSm90Fp8<HD, BN, CONSUMERS, STAGES, PINGPONG, OVERLAP, PAGED, PERSISTENT, TMA, DENSE_KV>;      \
    Kernel::run(p, smem);                                                                                       \
  }
