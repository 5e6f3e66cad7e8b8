// A consumer warpgroup of the sm_90a prefill: 64 packed query rows. Per K/V tile:
//   S = Q K^T     wgmma, K from shared memory (K-major); Q from registers (Q_REGS: loaded once
//                 per work item) or from shared memory; fp32 S in registers
//   mask          THE mask predicate's key range per row (mask.cuh), only on tiles it clips
//                 (masks_tile: two compares against the keys every row keeps)
//   softmax       online, base 2 (softmax_state.cuh), rows reduced over the lane quad
//   O += P V      wgmma, P from registers (S's accumulator layout is the A fragment's), V from
//                 shared memory read transposed (MN-major)
// and it releases each K and V stage to the producer as soon as its wgmma has read it.
// O's rescale for a tile's max waits for the next tile's turn (RESCALE_IN_TURN) or follows the
// softmax; at the first tile O is still zero and corr is 0 or 1 (Softmax::rescale keeps it finite).
// Skip-softmax (PrefillParams::skip_softmax_factor, SkipSoftmax in softmax_state.cuh), in the SKIP
// twins only, votes per warpgroup, its 64 rows (one bar.red): a skipped tile runs no softmax and
// issues no P V. A wgmma behind a data-dependent branch makes ptxas serialise every wgmma of the
// kernel (C7520), so the kernels without SKIP compile no such branch.
#pragma once
#include <math.h>
#include <stdint.h>

#include "pfa/attention/params.h"
#include "pfa/attention/sm90/config.cuh"
#include "pfa/attention/sm90/pipeline.cuh"
#include "pfa/attention/softmax_state.cuh"
#include "pfa/attention/variant.cuh"
#include "pfa/attention/work.cuh"
#include "pfa/common/dtypes.cuh"
#include "pfa/ptx/mma_sm80.cuh"
#include "pfa/ptx/sm90.cuh"
#include "pfa/ptx/wgmma.cuh"

namespace pfa {

template <class Cfg, bool PINGPONG, bool SKIP>
struct ConsumerSm90 {
  using T = typename Cfg::Elem;
  using TV = typename Cfg::VElem;  // P and V (fp16 under a widened fp8 V, config.cuh)
  static constexpr int BLOCK_M = Cfg::BLOCK_M, BLOCK_N = Cfg::BLOCK_N, HEAD_DIM = Cfg::HEAD_DIM;
  static constexpr int STAGES = Cfg::STAGES, ROW_BYTES = Cfg::ROW_BYTES;
  using MmaS = ptx::Wgmma<T, BLOCK_N>;
  using MmaO = ptx::Wgmma<TV, HEAD_DIM>;
  static constexpr int S_ACC = MmaS::ACC, O_ACC = MmaO::ACC;
  static constexpr int S_COLS = BLOCK_N / 8, O_COLS = HEAD_DIM / 8;  // 8-column blocks per row
  static constexpr int QK_STEPS = HEAD_DIM / 16, PV_STEPS = BLOCK_N / 16;
  static constexpr unsigned FULL = 0xffffffffu;
  // Lazy O rescale (OnlineSoftmax<true>: the running max may lag the true one by 8 log2 units,
  // P <= 256): a tile whose rows' maxes stay within that leaves O as it is, a warp-uniform skip of
  // rescale_o's multiplies (rescale_o_if): fewer issue slots taken from the other consumer's
  // softmax and from a copying producer. ab_kernels (NOTES.md, session 38): hd128 / hd256 single
  // +1-5%, ragged +1.5-2%, paged +0.3-1.4% (fp8 cache +2%); hd64 (three consumers) lost 2.6% and
  // keeps the strict max. Not with skip-softmax, whose vote compares against the strict one.
  static constexpr bool LAZY_O = !SKIP && HEAD_DIM >= 128;
  using Softmax = OnlineSoftmax<LAZY_O>;
  // The quad's max shuffles only where a row's max may move (row_maxes / max_held), on the paged
  // rows: same-process A/B (NOTES.md, session 39, outputs bit-identical) TRT-LLM paged +4.7-5.3%,
  // bench batch paged +0.9-1.9%, where a copying producer's shuffles and cp.async fill the MIO
  // queue the consumers' shuffles wait in; the contiguous / ragged rows moved -1.3 to +1.9% (the
  // skewed batch's short rows move their maxes often: the vote is pure cost there) and the
  // widening (fp8 K/V) rows -0.5 to +0.3%: they keep the shuffles.
  static constexpr bool HELD_MAX = LAZY_O && Cfg::PAGED && !Cfg::KV_FP8;

  // The rows this thread holds (i = 0, 1: rows lane / 4 and lane / 4 + 8 of its warp's 16).
  struct Rows {
    int tile_row[2];  // row within the CTA tile
    int lo[2], hi[2];  // each row's visible key range (the mask predicate's, without custom bits)
    int q_lo, q_hi;    // query rows of the warpgroup's 64
    int keep_lo, keep_hi;  // keys all of them keep (MaskRule::kept_by_all): tiles inside skip mask()
  };

  static __device__ __forceinline__ Rows rows_of(const PrefillParams& p, const PrefillWork& w, int wg, int warp,
                                                 int lane) {
    Rows r;
    const int first = w.r0 + wg * Cfg::WG_ROWS;
    const int last = max(first, min(first + Cfg::WG_ROWS, w.rows_total) - 1);
    r.q_lo = group_div(p, first);
    r.q_hi = group_div(p, last);
    w.rule.kept_by_all(r.q_lo, r.q_hi, r.keep_lo, r.keep_hi);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      r.tile_row[i] = wg * Cfg::WG_ROWS + warp * 16 + lane / 4 + 8 * i;
      const int q = group_div(p, w.r0 + r.tile_row[i]);
      w.rule.row_range(q, r.lo[i], r.hi[i]);
    }
    return r;
  }

  // Descriptor of k-step kk of the warpgroup's Q rows / of a K stage / of a V stage: the tile's
  // base descriptor word (smem_desc_lo of its first k-step) plus the k-step's constant offset
  // (ptx::smem_desc_at), the high word a constant.
  static constexpr uint32_t DESC_HI = ptx::smem_desc_hi(Cfg::ATOM_BYTES);
  static __device__ __forceinline__ uint64_t q_desc(uint32_t s_q, int wg, int kk) {
    return ptx::smem_desc_at(ptx::smem_desc_lo(s_q + wg * Cfg::WG_ROWS * ROW_BYTES, 16),
                             (kk >> 2) * BLOCK_M * ROW_BYTES + (kk & 3) * 32, DESC_HI);
  }
  static __device__ __forceinline__ uint64_t k_desc(uint32_t s_k, int kk) {
    return ptx::smem_desc_at(ptx::smem_desc_lo(s_k, 16), (kk >> 2) * BLOCK_N * ROW_BYTES + (kk & 3) * 32, DESC_HI);
  }
  static __device__ __forceinline__ uint64_t v_desc(uint32_t s_v, int kk) {
    return ptx::smem_desc_at(ptx::smem_desc_lo(s_v, BLOCK_N * ROW_BYTES), kk * 16 * ROW_BYTES, DESC_HI);
  }

  // Whether the tile of keys [n0, n0 + BLOCK_N) needs mask(): == !keeps_all(q_lo, q_hi, ..), the
  // predicate's per-tile test, which compiled to ~60 branchy instructions a tile (~10% of the
  // consumers' samples at 16k, no tile masked).
  static __device__ __forceinline__ bool masks_tile(const Rows& r, int n0) {
    return n0 < r.keep_lo || n0 + BLOCK_N - 1 >= r.keep_hi;
  }

  // Keys outside each row's range -> -inf.
  static __device__ __forceinline__ void mask(float (&s)[S_ACC], const Rows& r, int n0, int lane) {
#pragma unroll
    for (int j = 0; j < S_COLS; ++j)
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int kv = n0 + 8 * j + 2 * (lane % 4) + e;
          if (kv < r.lo[i] || kv >= r.hi[i]) s[4 * j + 2 * i + e] = -INFINITY;
        }
  }

  // Whether every row of the warp keeps its running max m on this tile by the lazy rule
  // (SoftmaxT::holds, the consumer's OnlineSoftmax) judged on each thread's own keys (mx before the
  // quad's shuffles): if every thread's share holds, so does the row's max, and m stays with corr
  // exactly 1, the result bit for bit the rescale's. The warp then skips
  // the max's shuffles (four a tile, on the softmax's path: behind a copying producer's shuffles
  // and cp.async in the MIO queue they were 5.6% of the paged consumers' ncu samples against 2.8%
  // on the ragged cp.async row, NOTES.md session 39) and the rescale's exponent. A row that has
  // seen no key (m = -inf) never passes. Shared by the fp8 consumer (a scale per row).
  template <class SoftmaxT, class Scale>
  static __device__ __forceinline__ bool max_held(const float (&mx)[2], const float (&m)[2], const Scale& scale) {
    static_assert(SoftmaxT::LAZY, "a held max is the lazy rule's");
    bool keeps = true;
#pragma unroll
    for (int i = 0; i < 2; ++i) keeps &= SoftmaxT::holds(mx[i], row_scale(scale, i), m[i]);
    return __all_sync(FULL, keeps);
  }
  static __device__ __forceinline__ float row_scale(float scale, int) { return scale; }
  static __device__ __forceinline__ float row_scale(const float (&scale)[2], int i) { return scale[i]; }
  // The max of row i (0, 1) over this thread's keys, and over the lane quad's.
  static __device__ __forceinline__ float thread_row_max(const float (&s)[S_ACC], int i) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < S_COLS; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * i], s[4 * j + 2 * i + 1]));
    return mx;
  }
  static __device__ __forceinline__ float quad_max(float mx) {
    mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 1));
    return fmaxf(mx, __shfl_xor_sync(FULL, mx, 2));
  }
  // The tile's row maxes (raw, before the scale) into mx. HELD: first on the thread's own keys, and
  // over the quad only where the warp's maxes may move (max_held false); returns max_held (false
  // without HELD). HELD needs the lazy max (SoftmaxT: OnlineSoftmax<true, ..>).
  template <bool HELD, class SoftmaxT, class Scale>
  static __device__ __forceinline__ bool row_maxes(const float (&s)[S_ACC], float (&mx)[2], const float (&m)[2],
                                                   const Scale& scale) {
    if constexpr (HELD) {
#pragma unroll
      for (int i = 0; i < 2; ++i) mx[i] = thread_row_max(s, i);
      if (max_held<SoftmaxT>(mx, m, scale)) return true;
#pragma unroll
      for (int i = 0; i < 2; ++i) mx[i] = quad_max(mx[i]);
    } else {
#pragma unroll
      for (int i = 0; i < 2; ++i) mx[i] = quad_max(thread_row_max(s, i));
    }
    return false;
  }

  // Online softmax of one tile: s becomes P (unnormalised), l rescaled, corr = the factor for
  // each row's O (applied by rescale_o, once no wgmma writes O); moved: whether either of the
  // thread's rows moved its max (else corr is exactly 1, or 0 for a row that has seen no key yet,
  // whose O is still zero). With skip-softmax on (vote), the
  // warpgroup first votes on the row maxes (SkipSoftmax: every row's max negligible against its
  // running max, padding rows not voting; the 128 threads AND their votes on the consumer's own
  // named barrier): true = the tile is skipped, m and l untouched, corr = 1.
  static __device__ __forceinline__ bool softmax(float (&s)[S_ACC], float (&m)[2], float (&l)[2], float (&corr)[2],
                                                 bool& moved, float scale, bool vote, const SkipSoftmax& skip,
                                                 const PrefillWork& w, const Rows& r, int wg) {
    moved = false;
    if constexpr (!SKIP) {
      softmax_rows<HELD_MAX, !Cfg::PAGED, Softmax>(s, m, l, corr, scale, moved);
      return false;
    }
    float mx[2];
    const bool held = row_maxes<HELD_MAX, Softmax>(s, mx, m, scale);
    if (vote) {
      bool all = true;
#pragma unroll
      for (int i = 0; i < 2; ++i) all &= w.r0 + r.tile_row[i] >= w.rows_total || skip.negligible(mx[i], scale, m[i]);
      if (ptx::bar_red_and(Cfg::SKIP_VOTE_BAR + wg, Cfg::WG_THREADS, all)) {
        corr[0] = corr[1] = 1.f;  // O stays as it is (rescale_o runs all the same: no branch round it)
        return true;
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) exp_row<Softmax>(s, i, mx[i], held, m[i], l[i], corr[i], scale, moved);
    return false;
  }

  // A tile's online softmax rows without a vote (SoftmaxT, HELD and P_SHIFT as row_maxes and
  // exp_row take them): HELD, both maxes first (max_held votes on them), then each row's
  // exponents; else BY_ROW, row by row, max then exponents (row 1's shuffles under row 0's
  // exponents), or both maxes first. Measured (H200, NOTES.md session 41): by row +0.5-0.8% on the
  // contiguous / ragged 16-bit rows, -2.3% on the hd64 paged ones at pages 32 / 64; on the fp8
  // hd128 rows both maxes first was 2-6% slower. Shared by both consumers' softmax.
  template <bool HELD, bool BY_ROW, class SoftmaxT, int P_SHIFT = 0, class Scale>
  static __device__ __forceinline__ void softmax_rows(float (&s)[S_ACC], float (&m)[2], float (&l)[2],
                                                      float (&corr)[2], const Scale& scale, bool& moved) {
    if constexpr (BY_ROW && !HELD) {
#pragma unroll
      for (int i = 0; i < 2; ++i)
        exp_row<SoftmaxT, P_SHIFT>(s, i, quad_max(thread_row_max(s, i)), false, m[i], l[i], corr[i],
                                   row_scale(scale, i), moved);
    } else {
      float mx[2];
      const bool held = row_maxes<HELD, SoftmaxT>(s, mx, m, scale);
#pragma unroll
      for (int i = 0; i < 2; ++i)
        exp_row<SoftmaxT, P_SHIFT>(s, i, mx[i], held, m[i], l[i], corr[i], row_scale(scale, i), moved);
    }
  }

  // Row i (0, 1) of a tile's online softmax, its max mx known: m rescaled (held: m stays, corr = 1),
  // the row's scores into unnormalised P = 2^(s * scale - m + P_SHIFT) (the fp8 consumer's P is
  // shifted up, fp8_consumer.cuh; 0 here), l = l * corr + their sum; moved |= whether m moved.
  template <class SoftmaxT, int P_SHIFT = 0>
  static __device__ __forceinline__ void exp_row(float (&s)[S_ACC], int i, float mx, bool held, float& m, float& l,
                                                 float& corr, float scale, bool& moved) {
    const float m_old = m;
    float m_use = m;
    if (held)
      corr = 1.f;
    else
      m_use = SoftmaxT::rescale(m, mx, scale, corr);
    if constexpr (P_SHIFT != 0) m_use -= (float)P_SHIFT;
    moved |= m != m_old;  // (-inf kept is not a move: corr is 0 then, on a row whose O is zero)
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < S_COLS; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = SoftmaxT::prob(s[4 * j + 2 * i + e], scale, m_use);
        s[4 * j + 2 * i + e] = x;
        sum += x;
      }
    l = fmaf(l, corr, sum);
  }

  static __device__ __forceinline__ void rescale_o(float (&o)[O_ACC], const float (&corr)[2]) {
#pragma unroll
    for (int j = 0; j < O_COLS; ++j)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        o[4 * j + 2 * i] *= corr[i];
        o[4 * j + 2 * i + 1] *= corr[i];
      }
  }
  // rescale_o; LAZY: only where some row of the warp moved its max (a warp-uniform branch: past a
  // row's first tiles most skip it).
  template <bool LAZY>
  static __device__ __forceinline__ void rescale_o_if(float (&o)[O_ACC], const float (&corr)[2], bool moved) {
    if (!LAZY || __any_sync(FULL, moved)) rescale_o(o, corr);
  }

  // P as the A fragments of the P V k-steps: k-step kk covers S columns 16 kk .. 16 kk + 15.
  static __device__ __forceinline__ void p_frags(const float (&s)[S_ACC], uint32_t (&a)[PV_STEPS][4]) {
#pragma unroll
    for (int kk = 0; kk < PV_STEPS; ++kk) {
      a[kk][0] = Pack2<TV>::from(s[8 * kk + 0], s[8 * kk + 1]);
      a[kk][1] = Pack2<TV>::from(s[8 * kk + 2], s[8 * kk + 3]);
      a[kk][2] = Pack2<TV>::from(s[8 * kk + 4], s[8 * kk + 5]);
      a[kk][3] = Pack2<TV>::from(s[8 * kk + 6], s[8 * kk + 7]);
    }
  }

  // Q in registers (Q_REGS, head_dim <= 128): the S GEMM takes Q as A fragments from registers
  // (wgmma RS, as P V takes P) instead of re-reading the warpgroup's Q rows from shared memory on
  // every tile. Shared memory's bandwidth is shared by both consumers' S and P V operands and the
  // producer's K / V writes (~110 of its 128 B a clock at the tensor cores' peak, hd128); Q is
  // ~20% of the reads. The fragments replace the S GEMM's 8 Q descriptors; the Q tile is free for
  // the next work item's Q once the item's first S GEMM has read them (release_q).
  // Three consumers (160 registers) spill; so do S, P, O and Q's fragments of a longer tile (176
  // keys: 88 + 44 + 64 + 32 of 232, and ptxas serialises the wgmma).
  static constexpr bool Q_REGS = HEAD_DIM <= 128 && Cfg::CONSUMERS == 2 && BLOCK_N <= 128;
  using QFrags = uint32_t[Q_REGS ? QK_STEPS : 1][4];

  // FlashAttention-3's order inside a turn: the S GEMM issued, then O's rescale (for the previous
  // tile's max) and V's wait, then the P V GEMM. The rescale's multiplies run under the S GEMM
  // instead of in the stretch after the softmax, where the tensor pipe idles unless the other
  // consumer issues. hd128 / hd256 single and ragged measured 1.01-1.035x (NOTES.md, session 28);
  // the paged rows, 0.98x then (their copies filled V late in the turn), have had it since their
  // producer copies a tile in page runs a tile ahead: TRT-LLM's paged HND +1.4-1.7%, bench batch's
  // NHD page 16 even (session 33). Not hd64, whose rescale is short (0.995x), nor the fp8-K/V rows,
  // whose producer widens V last in the turn.
  static constexpr bool RESCALE_IN_TURN = !Cfg::KV_FP8 && HEAD_DIM >= 128;

  // The warpgroup's Q rows as the A fragments of the S GEMM's k-steps (ldmatrix from the
  // 128-byte-swizzled tile: chunk c of row t at c ^ (t % 8), column blocks of 128 bytes), a k-step
  // 32 bytes: 16 elements of a 16-bit Q, 32 of an e4m3 one (whose A fragment, four e4m3 a
  // register, is the same bytes). row0: this warp's first row in the CTA tile.
  template <int STEPS>
  static __device__ __forceinline__ void load_q(uint32_t (&qf)[STEPS][4], uint32_t s_q, int row0, int lane) {
    const int t = row0 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < STEPS; ++kk) {
      const int c = (kk & 3) * 2 + (lane >> 4);
      ptx::ldmatrix_x4(qf[kk], s_q + (kk >> 2) * BLOCK_M * ROW_BYTES + t * ROW_BYTES + ((c ^ (t & 7)) << 4));
    }
  }

  // S = Q K^T of one K stage, issued (not waited for).
  static __device__ __forceinline__ void issue_qk(float (&s)[S_ACC], uint32_t s_q, uint32_t s_k, int wg,
                                                  const QFrags& qf) {
#pragma unroll
    for (int kk = 0; kk < QK_STEPS; ++kk) {
      if constexpr (Q_REGS)
        MmaS::template rs<0>(s, qf[kk], k_desc(s_k, kk), kk > 0);  // K K-major
      else
        MmaS::ss(s, q_desc(s_q, wg, kk), k_desc(s_k, kk), kk > 0);
    }
  }
  // O += P V of one V stage, issued (not waited for): a's registers stay read until it completes.
  static __device__ __forceinline__ void issue_pv(float (&o)[O_ACC], const uint32_t (&a)[PV_STEPS][4], uint32_t s_v) {
#pragma unroll
    for (int kk = 0; kk < PV_STEPS; ++kk) MmaO::rs(o, a[kk], v_desc(s_v, kk), 1);
  }

  // Ping-pong between the consumer warpgroups (PINGPONG): each issues its wgmma while holding a
  // turn that passes round them in order (0, 1, .., 0), so one's softmax runs under the others'
  // GEMMs instead of all contending for the tensor cores at once. Named barrier 1 + c is consumer
  // c's turn: c waits on it, its predecessor arrives on it.
  struct Turns {
    int wg;
    __device__ __forceinline__ void take() const {
      if constexpr (PINGPONG) ptx::bar_sync(1 + wg, 2 * Cfg::WG_THREADS);
    }
    __device__ __forceinline__ void pass() const {
      if constexpr (PINGPONG) ptx::bar_arrive(1 + (wg + 1) % Cfg::CONSUMERS, 2 * Cfg::WG_THREADS);
    }
  };

  // PERSISTENT: every consumer thread releases Q (q_empty) once the work item's S GEMMs are done
  // with it (tile it == n - 1; Q_REGS: after the first S, the fragments holding Q since), so the
  // producer loads the next item's Q while this one's last tiles and epilogue run. Every thread
  // arrives, not one a warp: under Q_REGS each lane reads Q itself (ldmatrix), and an arrival
  // releases its own thread's reads. (A __syncwarp before lane 0's arrival orders them too by the
  // memory model, but compute-sanitizer's racecheck models only each thread's own arrival and
  // reports the producer's next Q copies against those reads: NOTES.md, session 24.) Once a work
  // item: the 32-lane arrive costs nothing measurable.
  static __device__ __forceinline__ void release_q(uint32_t base, int it, int n) {
    if constexpr (Cfg::PERSISTENT) {
      if (it == n - 1) ptx::mbar_arrive(Cfg::q_empty(base));
    }
  }

  // The tile loop. o, m, l: this thread's rows' unnormalised output, max and sum.
  //
  // Tile it's S = Q K^T is issued together with tile it-1's O += P V, and its softmax runs while
  // that P V is still on the tensor cores (FlashAttention-3's intra-warpgroup overlap): S of one
  // tile and P of the previous are live at once. Each tile then waits for its K stage; its V stage
  // is waited for one tile later.
  //
  // walk: where the CTA stands in the ring (sm90/pipeline.cuh): stage and phase of each tile, and
  // the Q's phase. PERSISTENT: Q released after the last tile's S (release_q).
  static __device__ __forceinline__ void mainloop(const PrefillParams& p, const PrefillWork& w, const Rows& r,
                                                  uint32_t base, int wg, int lane, float (&o)[O_ACC], float (&m)[2],
                                                  float (&l)[2], const Sm90Walk& walk) {
    const float scale = logit_scale(p);  // honours scale_dev (a tensor bmm1_scale, read at launch)
    const uint32_t s_q = base + Cfg::Q_OFFSET;
    const Turns turn{wg};
    const int n = w.num_tiles;
    if (n == 0) return;
    // consumer 0 takes the walk's first turn, given by the last one; later blocks' first turns
    // come from the last consumer's last pass of the block before (see walk_done)
    if (PINGPONG && wg == Cfg::CONSUMERS - 1 && walk.q_round == 0) ptx::bar_arrive(1, 2 * Cfg::WG_THREADS);
    // No proxy fence after the waits: a cp.async's arrival on an mbarrier (cp_async_mbar_arrive)
    // makes its writes visible to the waiting threads' wgmma, as FlashAttention-3's cp.async
    // producer relies on.
    ptx::mbar_wait(Cfg::q_full(base), walk.q_round & 1);
    QFrags qf;
    if constexpr (Q_REGS) load_q(qf, s_q, r.tile_row[0] - lane / 4, lane);
    float s[S_ACC];
    uint32_t a[PV_STEPS][4];
    float corr[2];
    const int st0 = walk.stage<STAGES>(0);
    ptx::mbar_wait(Cfg::k_full(base, st0), walk.phase<STAGES>(0));
    turn.take();
    ptx::wgmma_fence();
    issue_qk(s, s_q, base + Cfg::K_OFFSET + st0 * Cfg::KV_TILE_BYTES, wg, qf);
    ptx::wgmma_commit();
    turn.pass();
    ptx::wgmma_wait<0>();
    ptx::wgmma_fence_regs(s);
    if (lane == 0) ptx::mbar_arrive(Cfg::k_empty(base, st0));
    // Q_REGS: the first S GEMM has read the fragments, so the Q tile can take the next item's Q
    release_q(base, Q_REGS ? n - 1 : 0, n);
    if (masks_tile(r, w.tile_start)) mask(s, r, w.tile_start, lane);
    const SkipSoftmax skip = SkipSoftmax::make(p.skip_softmax_factor, w.kv_len);
    bool moved;
    softmax(s, m, l, corr, moved, scale, false, skip, w, r, wg);
    p_frags(s, a);
    // The first tile is never skipped (every running max is -inf before it); a skipped tile's P V
    // is left out, its commit group empty, so the waits below count groups as before.
    bool pv_prev = true;  // tile it - 1 has a P V to issue
    for (int it = 1; it < n; ++it) {
      const int st = walk.stage<STAGES>(it), prev = walk.stage<STAGES>(it - 1);
      const int n0 = w.tile_start + it * BLOCK_N;
      ptx::mbar_wait(Cfg::k_full(base, st), walk.phase<STAGES>(it));
      if constexpr (!RESCALE_IN_TURN) ptx::mbar_wait(Cfg::v_full(base, prev), walk.phase<STAGES>(it - 1));
      turn.take();
      ptx::wgmma_fence();
      issue_qk(s, s_q, base + Cfg::K_OFFSET + st * Cfg::KV_TILE_BYTES, wg, qf);
      ptx::wgmma_commit();
      if constexpr (RESCALE_IN_TURN) {
        rescale_o_if<LAZY_O>(o, corr, moved);
        ptx::mbar_wait(Cfg::v_full(base, prev), walk.phase<STAGES>(it - 1));
        ptx::wgmma_fence();  // the rescaled O before the P V wgmma accumulates into it
      }
      if (!SKIP || pv_prev) issue_pv(o, a, base + Cfg::V_OFFSET + prev * Cfg::KV_TILE_BYTES);
      ptx::wgmma_commit();
      turn.pass();
      ptx::wgmma_wait<1>();  // S of this tile (groups complete in order); P V still running
      ptx::wgmma_fence_regs(s);
      if (lane == 0) ptx::mbar_arrive(Cfg::k_empty(base, st));
      if constexpr (!Q_REGS) release_q(base, it, n);
      if (masks_tile(r, n0)) mask(s, r, n0, lane);
      const bool skipped = softmax(s, m, l, corr, moved, scale, SKIP && skip.on(), skip, w, r, wg);
      ptx::wgmma_wait<0>();
      ptx::wgmma_fence_regs(o);
      ptx::wgmma_keep_regs(a);
      if (lane == 0) ptx::mbar_arrive(Cfg::v_empty(base, prev));
      if constexpr (!RESCALE_IN_TURN) rescale_o_if<LAZY_O>(o, corr, moved);
      p_frags(s, a);  // a skipped tile's too (never issued): a's live range stays the loop's own
      pv_prev = !skipped;
    }
    const int last = walk.stage<STAGES>(n - 1);
    if constexpr (!RESCALE_IN_TURN) ptx::mbar_wait(Cfg::v_full(base, last), walk.phase<STAGES>(n - 1));
    turn.take();
    if constexpr (RESCALE_IN_TURN) {
      rescale_o_if<LAZY_O>(o, corr, moved);
      ptx::mbar_wait(Cfg::v_full(base, last), walk.phase<STAGES>(n - 1));
    }
    ptx::wgmma_fence();
    if (!SKIP || pv_prev) issue_pv(o, a, base + Cfg::V_OFFSET + last * Cfg::KV_TILE_BYTES);
    ptx::wgmma_commit();
    turn.pass();  // the last consumer's: consumer 0's first turn of the next block (walk_done)
    ptx::wgmma_wait<0>();
    ptx::wgmma_fence_regs(o);
    ptx::wgmma_keep_regs(a);
    if (lane == 0) ptx::mbar_arrive(Cfg::v_empty(base, last));
  }

  // After the CTA's last block. The turn runs on across blocks: the last consumer passes it on
  // after each block's last P V, so consumer 0 can issue the next block's first S while the others
  // finish this one (before, the last consumer gave it only once into the next block: consumer 0
  // waited for its epilogue and work decode). Consumer 0 takes the walk's last pass here, so
  // every arrival on a turn's barrier meets its wait.
  static __device__ __forceinline__ void walk_done(int wg, const Sm90Walk& walk) {
    if (PINGPONG && wg == 0 && walk.q_round > 0) Turns{0}.take();
  }
};

}  // namespace pfa
