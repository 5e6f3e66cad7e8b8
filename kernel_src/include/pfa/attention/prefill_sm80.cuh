// FA2-class prefill for sm_80 and newer (also built for sm_90a, where it is the portable path).
// The entry header the generated translation units include: the kernel's run() and the
// PFA_DEFINE_PREFILL_SM80 macro. The pieces, in the order a CTA runs them:
//   work.cuh            which request, row tile and KV chunk; the key range to visit
//   sm80/tile_loads.cuh Q gather, the cp.async K/V ring (kv_source.cuh addresses the rows)
//   sm80/mainloop.cuh   per KV tile: S = Q K^T, transforms (variant.cuh, rope.cuh), mask
//                       (mask.cuh), online softmax (softmax_state.cuh), O += P V
//   sm80/reg_frags.cuh  S = Q K^T and O += P V of the decode tiles that widen an fp8 / NVFP4
//                       cache in registers (fp8_frags.cuh, nvfp4_frags.cuh)
//   sm80/epilogue.cuh   normalise, then O + LSE or split-KV partials (epilogue.cuh layouts)
// sm80/config.cuh holds the tile shape, the per-shape choices and the shared-memory layout.
#pragma once
#include <stdint.h>

#include <type_traits>

#include "pfa/attention/params.h"
#include "pfa/attention/sm80/config.cuh"
#include "pfa/attention/sm80/epilogue.cuh"
#include "pfa/attention/sm80/fp8_frags.cuh"
#include "pfa/attention/sm80/nvfp4_frags.cuh"
#include "pfa/attention/sm80/reg_frags.cuh"
#include "pfa/attention/sm80/fragments.cuh"
#include "pfa/attention/sm80/mainloop.cuh"
#include "pfa/attention/sm80/tile_loads.cuh"
#include "pfa/attention/work.cuh"
#include "pfa/ptx/mma_sm80.cuh"
#include "pfa/ptx/pdl.cuh"

namespace pfa {

template <typename T, typename KV, int HEAD_DIM, int NUM_WARPS, int MQ, int BLOCK_N, bool Q_IN_REGS,
          int KV_STAGES, bool GENERAL, bool PAGED, bool LAZY_RESCALE = false, bool PAIR = false>
struct PrefillSm80 : PrefillSm80Config<T, KV, HEAD_DIM, NUM_WARPS, MQ, BLOCK_N, Q_IN_REGS, KV_STAGES, GENERAL, PAGED,
                                       LAZY_RESCALE, PAIR> {
  using Cfg = PrefillSm80Config<T, KV, HEAD_DIM, NUM_WARPS, MQ, BLOCK_N, Q_IN_REGS, KV_STAGES, GENERAL, PAGED,
                                LAZY_RESCALE, PAIR>;
  using Mainloop = MainloopSm80<Cfg>;
  // KV_REG_WIDEN: the register-widened K/V fragments (reg_frags.cuh)
  using RegFrags = typename std::conditional<Cfg::KV_NVFP4, Nvfp4FragsSm80<Cfg>, Fp8FragsSm80<Cfg>>::type;

  static __device__ __forceinline__ void run(const PrefillParams& p, char* smem) {
    // The split-KV merge after this kernel is launched programmatically: it may start (and
    // park in wait_prior_grids) as soon as every CTA here has started, hiding its launch.
    // And when this kernel itself was launched that way, nothing is read before the kernel
    // ahead of it on the stream is done.
    ptx::allow_dependents();
    ptx::wait_prior_grids();
    const uint32_t sQ_u = ptx::smem_u32(smem);
    const int tid = threadIdx.x, lane = tid % Cfg::WARP_SIZE, warp = tid / Cfg::WARP_SIZE;

    PrefillWork w;
    if (!decode_work<Cfg::BLOCK_M, BLOCK_N, PAGED, GENERAL, Cfg::ROWS_FASTEST, Cfg::SPEC_MASK>(p, w)) return;
    load_q_tile<Cfg>(p, w, smem, sQ_u, tid);
    // KV_REG_WIDEN: Q is a cp.async group of its own, rewritten while tile 0 lands
    if constexpr (Cfg::KV_REG_WIDEN) ptx::cp_async_commit();
    const KvRingSm80<Cfg> ring = make_kv_ring<Cfg>(p, w, smem, sQ_u, tid);
    ring.prologue(w);
    // KV_REG_WIDEN: Q reordered for the narrow K fragments (bf16: as fp16, its logits times
    // 2^-q_log2, undone in the logit scale; reg_frags.cuh).
    int q_log2 = 0;
    if constexpr (Cfg::KV_REG_WIDEN) {
      ptx::cp_async_wait<KV_STAGES - 1>();
      __syncthreads();
      q_log2 = RegFragsSm80<Cfg>::template prepare_q<RegFrags::Q_WORDS_PER_LANE>(
          smem, lane, (PAIR ? warp / 2 : warp) * Cfg::MMA_M, !PAIR || warp % 2 == 0);
    }

    const WarpRoleSm80<Cfg> wr(lane, warp, smem);
    float o[MQ][Cfg::O_DT][4];
    float m[MQ][2], l[MQ][2];
    AccumSm80<Cfg>::init(o, m, l);
    typename Mainloop::QFrags qf;
    // A device-side logit scale (scale_dev) is honoured by the general kernels and the decode
    // tiles (the manifest's device_scale): reading it costs the 128-row lean kernels a register
    // across the tile loop, and spills there.
    float scale = Cfg::DEVICE_SCALE ? logit_scale(p) : p.sm_scale_log2;
    if constexpr (Cfg::KV_REG_WIDEN) scale *= RegFragsSm80<Cfg>::pow2(q_log2);
    // GENERAL: score transforms that leave logits in log2 units, so softmax then uses scale 1.
    const LogitTransform xf = GENERAL ? LogitTransform::make(p) : LogitTransform{};
    const float scale_eff = xf.kind == LogitTransform::kPlain ? scale : 1.f;
    typename Mainloop::AlibiSlopes alibi_slope;
    typename Mainloop::AlibiRows alibi_q;
    if constexpr (GENERAL) Mainloop::init_alibi(alibi_slope, alibi_q, xf, p, w, wr);
    const LdsmOffsetsSm80<Cfg> off(wr);
    // KV_REG_WIDEN: the narrow ring tiles' ldmatrix lane offsets
    uint32_t narrow_kv[4];
    if constexpr (Cfg::KV_REG_WIDEN) RegFragsSm80<Cfg>::offsets(lane, narrow_kv);

    // The tile loop, and every fragment array of a tile, stay in this frame, next to the
    // accumulators the loop carries: the compiler orders the loop-carried registers by the
    // local arrays of the function that holds the loop, so a loop body in a function of its
    // own, or a step owning its scratch arrays, changes the register allocation of the loop.
    for (int it = 0; it < w.num_tiles; ++it) {
      const int n0 = w.tile_start + it * BLOCK_N;
      const int stage = KV_STAGES > 1 ? it % KV_STAGES : 0;
      // The tiles the MMAs read: the ring stage itself, or (fp8, NVFP4 widened in shared memory)
      // the widened tile(s).
      const uint32_t sK_u = Cfg::KV_WIDEN ? ring.s_wide : ring.s_ring + 2 * stage * Cfg::RING_TILE_BYTES;
      const uint32_t sV_u = Cfg::SPLIT_WIDEN ? sK_u : sK_u + (Cfg::KV_WIDEN ? Cfg::TILE_BYTES : Cfg::RING_TILE_BYTES);
      ring.begin_tile(w, it, n0, stage);
      if constexpr (GENERAL) {
        if (p.rope) Mainloop::rope_tiles(p, w, smem, sQ_u, sK_u, it, n0, tid);
      }
      if constexpr (Q_IN_REGS) {
        if (it == 0) Mainloop::load_q_frags(qf, sQ_u, off);
      }
      float s[MQ][Cfg::S_NT][4];
      uint32_t qk_a[MQ][4];
      uint32_t qk_b[4];
      if constexpr (Cfg::KV_REG_WIDEN) {
        // PAIR: this warp's keys start at col0
        RegFrags::qk(s, p, sQ_u, sK_u + (PAIR ? wr.col0 * Cfg::KV_CPR * Cfg::CHUNK_BYTES : 0), off.q, narrow_kv);
      } else {
        Mainloop::qk(s, qk_a, qk_b, qf, sQ_u, sK_u, off);
      }
      if constexpr (GENERAL) Mainloop::transform_scores(s, xf, alibi_slope, alibi_q, n0, wr);
      Mainloop::mask_scores(s, w.rule, w.q_lo, w.q_hi, w.r0, w.group, n0, wr);
      uint32_t pp[MQ][Cfg::S_NT][2];
      float corr[MQ][2];
      float pair_mx[4] = {0.f, 0.f, 0.f, 0.f};
      // skipped (skip-softmax): no P V for the tile; the warp (pair) still keeps the CTA's ring going
      const bool skipped = Mainloop::softmax(s, pp, o, m, l, corr, pair_mx, scale_eff, p, w, wr);
      uint32_t pq[MQ][Cfg::S_NT][2];
      if constexpr (PAIR) {
        if (!skipped) Mainloop::send_p(pp, wr);
      }
      ring.mid_tile(w, it, n0, stage);
      uint32_t pv_a[MQ][4];
      uint32_t pv_b[4];
      if constexpr (Cfg::KV_REG_WIDEN) {
        if (!skipped) RegFrags::pv(o, pp, pq, p, sV_u, narrow_kv, wr);
      } else {
        if (!skipped) Mainloop::pv(o, pp, pq, pv_a, pv_b, sV_u, off, wr);
      }
    }
    if constexpr (Cfg::KV_REG_WIDEN) RegFrags::finish_o(o, lane);
    ptx::cp_async_wait<0>();
    __syncthreads();  // with zero tiles, other threads' Q copies may still target this warp's rows

    float lse_v[MQ][2];
    EpilogueSm80<Cfg>::normalize(p, wr, lane, warp, o, m, l, lse_v);
    EpilogueSm80<Cfg>::store(p, w, smem, wr, lane, o, m, lse_v);
  }
};

}  // namespace pfa

// One extern "C" entry per variant: a stable name for the manifest and cuLibraryGetKernel.
// SMEM is the dynamic shared memory the host launches with (variants.py's smem_bytes) and ROWSF
// the manifest's rows_fastest: both checked against the kernel at compile time, so the two sides
// can never drift apart.
#define PFA_DEFINE_PREFILL_SM80(NAME, T, KV, HD, NW, MQ, BN, QREGS, STAGES, MINB, GENERAL, PAGED, LAZY, PAIR, SMEM, \
                                ROWSF)                                                                       \
  static_assert(pfa::PrefillSm80<T, KV, HD, NW, MQ, BN, QREGS, STAGES, GENERAL, PAGED, LAZY, PAIR>::SMEM_BYTES == (SMEM), \
                #NAME ": variants.py smem_bytes differs from the kernel's shared-memory layout");             \
  static_assert(pfa::PrefillSm80<T, KV, HD, NW, MQ, BN, QREGS, STAGES, GENERAL, PAGED, LAZY, PAIR>::ROWS_FASTEST == (ROWSF), \
                #NAME ": the manifest's rows_fastest differs from what the kernel honours");                  \
  extern "C" __global__ void __launch_bounds__(NW * 32, MINB)                                                \
      NAME(const __grid_constant__ pfa::PrefillParams p) {                                                    \
    extern __shared__ __align__(128) char smem[];                                                             \
    pfa::PrefillSm80<T, KV, HD, NW, MQ, BN, QREGS, STAGES, GENERAL, PAGED, LAZY, PAIR>::run(p, smem);               \
  }
