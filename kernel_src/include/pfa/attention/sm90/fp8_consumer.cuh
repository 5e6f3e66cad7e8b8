// A consumer warpgroup of the sm_90a fp8 prefill: ConsumerSm90's tile loop (rows, mask, O rescale,
// turns and Q / K descriptors are its own) on e4m3 operands:
//   S = Q K^T     wgmma m64nNk32 e4m3, A and B from shared memory, K-major
//   softmax       per row its own logit scale: sm_scale * log2 e * scale_q[q head] * scale_k[kv head]
//   O += P V      wgmma m64nNk32 e4m3, P from registers converted to e4m3 (saturating, round to
//                 nearest even), Vt (the transposed V stage, fp8_producer.cuh) as K-major B
//
// Register layouts relied on (PTX ISA 9.7.15.5.1.1 "Register Fragments"; see ptx/wgmma.cuh):
//   S (accumulator): s[4 j + 2 i + e] = row 16 w + l / 4 + 8 i, key 8 j + 2 t + e  (t = l % 4)
//   A of m64nNk32, 8-bit: a[v1 + 2 v2] byte v0 = row 16 w + l / 4 + 8 v1, k 4 t + v0 + 16 v2
// The A fragment wants four consecutive k per register where S holds key pairs 2t, 2t+1 and 8
// apart. Instead of moving bytes between lanes, k is not the key: within each 16-key group the
// Vt stage stores key kk at k = 2 kk and key kk + 8 at k = 2 kk + 1 (fp8_producer.cuh), so k-step
// kk (32 keys), half v2, byte v0 of a thread holds key 32 kk + 16 v2 + {2t, 2t+8, 2t+1, 2t+9}[v0]:
// S values s[4 j0 + 2 i], s[4 j1 + 2 i], s[4 j0 + 2 i + 1], s[4 j1 + 2 i + 1] with j0 = 4 kk + 2 v2,
// j1 = j0 + 1, all the thread's own.
#pragma once
#include <math.h>
#include <stdint.h>

#include <cuda_fp8.h>

#include "pfa/attention/params.h"
#include "pfa/attention/sm90/consumer.cuh"
#include "pfa/attention/sm90/pipeline.cuh"
#include "pfa/attention/softmax_state.cuh"
#include "pfa/attention/variant.cuh"
#include "pfa/attention/work.cuh"
#include "pfa/ptx/sm90.cuh"
#include "pfa/ptx/wgmma.cuh"

namespace pfa {

// OVERLAP: S of tile it issued with P V of tile it - 1 (ConsumerSm90's loop), so S, P and O are
// live together; without it (hd256, where O alone is 128 registers) each tile runs S, softmax, then
// P V, and the overlap comes from the other consumer's turn only.
template <class Cfg, bool PINGPONG, bool OVERLAP>
struct ConsumerSm90Fp8 : ConsumerSm90<Cfg, PINGPONG, false> {
  using Base = ConsumerSm90<Cfg, PINGPONG, false>;  // no skip-softmax for fp8 q (refused on the host)
  using typename Base::Rows;
  using typename Base::Turns;
  using E4M3 = __nv_fp8_e4m3;
  static constexpr int BLOCK_N = Cfg::BLOCK_N, HEAD_DIM = Cfg::HEAD_DIM, STAGES = Cfg::STAGES;
  using MmaS = ptx::Wgmma<E4M3, BLOCK_N>;
  using MmaO = ptx::Wgmma<E4M3, HEAD_DIM>;
  static constexpr int S_ACC = MmaS::ACC, O_ACC = MmaO::ACC;
  static_assert(S_ACC == Base::S_ACC && O_ACC == Base::O_ACC, "one accumulator layout for every input type");
  static constexpr int S_COLS = BLOCK_N / 8;
  static constexpr int QK_STEPS = HEAD_DIM / MmaS::K, PV_STEPS = BLOCK_N / MmaO::K;
  static constexpr unsigned FULL = 0xffffffffu;
  // Lazy rescale (OnlineSoftmax<true>): the running max m may lag the true one by up to the slack,
  // so that a tile whose rows' maxes all stay within it leaves O as it is (a warp-uniform skip of
  // rescale_o's 64 multiplies a tile, 12% of the hd128 tile loop's instructions). Where the
  // consumers share the issue slots with the paged rows' copying producer, and in the serial loop
  // (hd256), that gained 3-4% (NOTES.md, session 38); the contiguous overlapped rows (TMA, K and V
  // from one producer thread) lost 1-9% with it and keep the strict max. No fp8 call takes
  // skip-softmax or softmax stats, which need the strict one.
  static constexpr bool LAZY_O = (Cfg::PAGED && Cfg::CONSUMERS == 2) || !OVERLAP;
  // P is formed as 2^(x - m + P_LOG2_OFFSET), up to 2^8 (lazy: 2^(7 + 1.75) ~ 430, under e4m3's
  // largest finite value 448 = 2^8.81) instead of 1: e4m3 keeps 3 mantissa bits down to 2^-6 and
  // flushes below 2^-9, so unshifted probabilities under ~2^-6 would lose precision (and under
  // 2^-10 vanish) in the P V product. l sums the same shifted values, so O / l is unchanged; the
  // epilogue gets m - P_LOG2_OFFSET (unshift_max) for the LSE.
  static constexpr int P_LOG2_SHIFT = LAZY_O ? 7 : 8;
  static constexpr float P_LOG2_OFFSET = P_LOG2_SHIFT;
  using Softmax = OnlineSoftmax<LAZY_O, 7>;  // (lazy: slack 1.75)
  static_assert(!LAZY_O || P_LOG2_OFFSET + Softmax::RESCALE_SLACK < 8.807f, "P stays under e4m3's 448");
  // ConsumerSm90::HELD_MAX on the paged overlapped rows (hd128: TRT-LLM paged e4m3 +1.0-2.0%,
  // NOTES.md session 39); the serial hd256 rows moved -0.6 to +2.2% and keep the shuffles.
  static constexpr bool HELD_MAX = LAZY_O && Cfg::PAGED && OVERLAP;

  // Each row's logit scale (log2 units): the kernel's (logit_scale: sm_scale * log2 e, times a
  // device-side bmm1 scale) times the per-head fp8 dequantisation scales, when given.
  static __device__ __forceinline__ void row_scales(const PrefillParams& p, const PrefillWork& w, const Rows& r,
                                                    float (&scale)[2]) {
    float base = logit_scale(p);
    if (p.k_scale_heads != 0) base *= reinterpret_cast<const float*>(p.k_scale_heads)[w.kv_head];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int head = packed_row(p, w, w.r0 + r.tile_row[i]).head;
      scale[i] = p.q_scale_heads != 0 ? base * reinterpret_cast<const float*>(p.q_scale_heads)[head] : base;
    }
  }

  // Whether the tile of keys [n0, n0 + BLOCK_N) needs mask(): ConsumerSm90::masks_tile's two
  // compares, but on the overlapped two-consumer rows (hd128) the predicate's per-tile keeps_all.
  // Measured: the two compares hd64 (three consumers) 2-7% faster (H100, NOTES.md session 23),
  // the serial hd256 rows +2.0-2.5% at 8k, the overlapped hd128 rows 2-3% slower (H200, session 41).
  static __device__ __forceinline__ bool masks_tile(const PrefillWork& w, const Rows& r, int n0) {
    if constexpr (Cfg::CONSUMERS > 2 || !OVERLAP) return Base::masks_tile(r, n0);
    else return !w.rule.keeps_all(r.q_lo, r.q_hi, n0, n0 + BLOCK_N - 1);
  }

  // ConsumerSm90::softmax with a scale per row, P shifted by P_LOG2_OFFSET, the max lazy where
  // LAZY_O. Returns whether either of the thread's rows moved its max (else corr is exactly 1, or
  // 0 for a row that has seen no key yet, whose O is still zero).
  static __device__ __forceinline__ bool softmax(float (&s)[S_ACC], float (&m)[2], float (&l)[2], float (&corr)[2],
                                                 const float (&scale)[2]) {
    bool moved = false;  // HELD_MAX: the quad's shuffles and the rescale only where a max may move
    Base::template softmax_rows<HELD_MAX, true, Softmax, P_LOG2_SHIFT>(s, m, l, corr, scale, moved);
    return moved;
  }

  // After the tile loop: the row maxes the epilogue's LSE needs (l holds sums of shifted P).
  static __device__ __forceinline__ void unshift_max(float (&m)[2]) {
    m[0] -= P_LOG2_OFFSET;  // -inf (a row with no visible key) stays -inf
    m[1] -= P_LOG2_OFFSET;
  }

  // Two floats -> two e4m3 bytes, lo in the low byte.
  static __device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
    return (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
  }

  // P as the e4m3 A fragments of the P V k-steps, in the Vt stage's key order (header comment).
  static __device__ __forceinline__ void p_frags(const float (&s)[S_ACC], uint32_t (&a)[PV_STEPS][4]) {
#pragma unroll
    for (int kk = 0; kk < PV_STEPS; ++kk)
#pragma unroll
      for (int v2 = 0; v2 < 2; ++v2)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int j0 = 4 * kk + 2 * v2, j1 = j0 + 1;
          a[kk][i + 2 * v2] = e4m3x2(s[4 * j0 + 2 * i], s[4 * j1 + 2 * i]) |
                              (e4m3x2(s[4 * j0 + 2 * i + 1], s[4 * j1 + 2 * i + 1]) << 16);
        }
  }

  // Vt stage, k-step kk (32 keys): K-major B, HEAD_DIM rows of 128 bytes (8-row atoms 1024 apart)
  // in column block kk / 4 (fp8_config.cuh: 128 keys a block).
  static __device__ __forceinline__ uint64_t vt_desc(uint32_t s_vt, int kk) {
    return ptx::smem_desc_at(ptx::smem_desc_lo(s_vt, 16), (kk >> 2) * Cfg::VT_BLOCK_BYTES + (kk & 3) * 32,
                             Base::DESC_HI);
  }

  // Q in registers for the S GEMM, as ConsumerSm90::Q_REGS, on the overlapped two-consumer rows
  // (hd128: 16 registers of e4m3 fragments for its 4 Q descriptors).
  static constexpr bool Q_REGS = OVERLAP && Cfg::CONSUMERS == 2;
  using QFrags = uint32_t[Q_REGS ? QK_STEPS : 1][4];

  static __device__ __forceinline__ void issue_qk(float (&s)[S_ACC], uint32_t s_q, uint32_t s_k, int wg,
                                                  const QFrags& qf) {
#pragma unroll
    for (int kk = 0; kk < QK_STEPS; ++kk) {
      if constexpr (Q_REGS)
        MmaS::rs(s, qf[kk], Base::k_desc(s_k, kk), kk > 0);  // e4m3 rs: B K-major
      else
        MmaS::ss(s, Base::q_desc(s_q, wg, kk), Base::k_desc(s_k, kk), kk > 0);
    }
  }
  static __device__ __forceinline__ void issue_pv(float (&o)[O_ACC], const uint32_t (&a)[PV_STEPS][4], uint32_t s_vt) {
#pragma unroll
    for (int kk = 0; kk < PV_STEPS; ++kk) MmaO::rs(o, a[kk], vt_desc(s_vt, kk), 1);
  }

  static __device__ __forceinline__ void mainloop(const PrefillParams& p, const PrefillWork& w, const Rows& r,
                                                  uint32_t base, int wg, int lane, float (&o)[O_ACC], float (&m)[2],
                                                  float (&l)[2], const Sm90Walk& walk) {
    float scale[2];
    row_scales(p, w, r, scale);
    if constexpr (OVERLAP)
      overlapped(p, w, r, base, wg, lane, o, m, l, scale, walk);
    else
      serial(w, r, base, wg, lane, o, m, l, scale, walk);
  }

  // Without the overlap: per tile S, mask, softmax, O rescale, then P V, each GEMM in its turn.
  // walk: where the CTA stands in the ring (sm90/pipeline.cuh): each tile's stage and phase, Q's.
  static __device__ __forceinline__ void serial(const PrefillWork& w, const Rows& r, uint32_t base, int wg, int lane,
                                                float (&o)[O_ACC], float (&m)[2], float (&l)[2],
                                                const float (&scale)[2], const Sm90Walk& walk) {
    const uint32_t s_q = base + Cfg::Q_OFFSET;
    const Turns turn{wg};
    const int n = w.num_tiles;
    if (n == 0) return;
    // the walk's first turn (later blocks': the last consumer's last pass before, Base::walk_done)
    if (PINGPONG && wg == Cfg::CONSUMERS - 1 && walk.q_round == 0) ptx::bar_arrive(1, 2 * Cfg::WG_THREADS);
    ptx::mbar_wait(Cfg::q_full(base), walk.q_round & 1);
    static_assert(!Q_REGS, "Q in registers is the overlapped loop's; this one reads Q from shared memory");
    const QFrags qf{};  // (unread: issue_qk takes Q's descriptors)
    for (int it = 0; it < n; ++it) {
      const int st = walk.stage<STAGES>(it), n0 = w.tile_start + it * BLOCK_N;
      const uint32_t parity = walk.phase<STAGES>(it);
      float s[S_ACC];
      uint32_t a[PV_STEPS][4];
      float corr[2];
      ptx::mbar_wait(Cfg::k_full(base, st), parity);
      turn.take();
      ptx::wgmma_fence();
      issue_qk(s, s_q, base + Cfg::K_OFFSET + st * Cfg::K_TILE_BYTES, wg, qf);
      ptx::wgmma_commit();
      turn.pass();
      ptx::wgmma_wait<0>();
      ptx::wgmma_fence_regs(s);
      if (lane == 0) ptx::mbar_arrive(Cfg::k_empty(base, st));
      Base::release_q(base, it, n);
      if (masks_tile(w, r, n0)) Base::mask(s, r, n0, lane);
      const bool moved = softmax(s, m, l, corr, scale);
      if (it > 0) Base::template rescale_o_if<LAZY_O>(o, corr, moved);  // the first tile's O is still zero
      p_frags(s, a);
      ptx::mbar_wait(Cfg::v_full(base, st), parity);
      if constexpr (!Cfg::S_TURN_ONLY) turn.take();
      ptx::wgmma_fence();
      issue_pv(o, a, base + Cfg::V_OFFSET + st * Cfg::VT_TILE_BYTES);
      ptx::wgmma_commit();
      if constexpr (!Cfg::S_TURN_ONLY) turn.pass();  // the last consumer's last: consumer 0's first turn of the next block
      ptx::wgmma_wait<0>();
      ptx::wgmma_fence_regs(o);
      ptx::wgmma_keep_regs(a);
      if (lane == 0) ptx::mbar_arrive(Cfg::v_empty(base, st));
    }
  }

  // ConsumerSm90::mainloop (intra-warpgroup overlap of S of tile it with P V of tile it - 1, the
  // turns, the stage releases) on the fp8 operands.
  static __device__ __forceinline__ void overlapped(const PrefillParams& p, const PrefillWork& w, const Rows& r,
                                                    uint32_t base, int wg, int lane, float (&o)[O_ACC], float (&m)[2],
                                                    float (&l)[2], const float (&scale)[2], const Sm90Walk& walk) {
    const uint32_t s_q = base + Cfg::Q_OFFSET;
    const Turns turn{wg};
    const int n = w.num_tiles;
    if (n == 0) return;
    // the walk's first turn (later blocks': the last consumer's last pass before, Base::walk_done)
    if (PINGPONG && wg == Cfg::CONSUMERS - 1 && walk.q_round == 0) ptx::bar_arrive(1, 2 * Cfg::WG_THREADS);
    ptx::mbar_wait(Cfg::q_full(base), walk.q_round & 1);
    QFrags qf;
    if constexpr (Q_REGS) Base::load_q(qf, s_q, r.tile_row[0] - lane / 4, lane);
    float s[S_ACC];
    uint32_t a[PV_STEPS][4];
    float corr[2];
    const int st0 = walk.stage<STAGES>(0);
    ptx::mbar_wait(Cfg::k_full(base, st0), walk.phase<STAGES>(0));
    turn.take();
    ptx::wgmma_fence();
    issue_qk(s, s_q, base + Cfg::K_OFFSET + st0 * Cfg::K_TILE_BYTES, wg, qf);
    ptx::wgmma_commit();
    turn.pass();
    ptx::wgmma_wait<0>();
    ptx::wgmma_fence_regs(s);
    if (lane == 0) ptx::mbar_arrive(Cfg::k_empty(base, st0));
    Base::release_q(base, Q_REGS ? n - 1 : 0, n);  // Q_REGS: the first S has read the fragments
    if (masks_tile(w, r, w.tile_start))
      Base::mask(s, r, w.tile_start, lane);
    softmax(s, m, l, corr, scale);
    p_frags(s, a);
    for (int it = 1; it < n; ++it) {
      const int st = walk.stage<STAGES>(it), prev = walk.stage<STAGES>(it - 1);
      const int n0 = w.tile_start + it * BLOCK_N;
      ptx::mbar_wait(Cfg::k_full(base, st), walk.phase<STAGES>(it));
      ptx::mbar_wait(Cfg::v_full(base, prev), walk.phase<STAGES>(it - 1));
      turn.take();
      ptx::wgmma_fence();
      issue_qk(s, s_q, base + Cfg::K_OFFSET + st * Cfg::K_TILE_BYTES, wg, qf);
      ptx::wgmma_commit();
      issue_pv(o, a, base + Cfg::V_OFFSET + prev * Cfg::VT_TILE_BYTES);
      ptx::wgmma_commit();
      turn.pass();
      ptx::wgmma_wait<1>();  // S of this tile; P V still running
      ptx::wgmma_fence_regs(s);
      if (lane == 0) ptx::mbar_arrive(Cfg::k_empty(base, st));
      if constexpr (!Q_REGS) Base::release_q(base, it, n);
      if (masks_tile(w, r, n0)) Base::mask(s, r, n0, lane);
      const bool moved = softmax(s, m, l, corr, scale);
      ptx::wgmma_wait<0>();
      ptx::wgmma_fence_regs(o);
      ptx::wgmma_keep_regs(a);
      if (lane == 0) ptx::mbar_arrive(Cfg::v_empty(base, prev));
      Base::template rescale_o_if<LAZY_O>(o, corr, moved);
      p_frags(s, a);
    }
    const int last = walk.stage<STAGES>(n - 1);
    ptx::mbar_wait(Cfg::v_full(base, last), walk.phase<STAGES>(n - 1));
    turn.take();
    ptx::wgmma_fence();
    issue_pv(o, a, base + Cfg::V_OFFSET + last * Cfg::VT_TILE_BYTES);
    ptx::wgmma_commit();
    turn.pass();  // the last consumer's: consumer 0's first turn of the next block
    ptx::wgmma_wait<0>();
    ptx::wgmma_fence_regs(o);
    ptx::wgmma_keep_regs(a);
    if (lane == 0) ptx::mbar_arrive(Cfg::v_empty(base, last));
  }
};

}  // namespace pfa
