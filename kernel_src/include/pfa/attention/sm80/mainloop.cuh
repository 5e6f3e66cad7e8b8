// The mma.sync tile loop of the sm80 prefill: for each BLOCK_N-key tile, S = Q K^T, the score
// transforms, the mask, the online softmax, and O += P V, all on m16n8k16 fragments
// (fragments.cuh). The math of each step lives in the family-neutral headers (variant.cuh,
// mask.cuh, softmax_state.cuh, rope.cuh); this file maps it onto the fragment layout.
//
// Softmax is online in the log2 domain (the scale already carries log2 e); P stays in
// registers (the C fragment of S is exactly the A fragment layout of P V).
//
// PAIR: the two warps of a pair split S by keys and O by head dims (config.cuh). The row max
// and the other half's P cross between them through shared memory, two 64-thread barriers a
// tile.
#pragma once
#include <math.h>
#include <stdint.h>

#include "pfa/attention/mask.cuh"
#include "pfa/attention/params.h"
#include "pfa/attention/rope.cuh"
#include "pfa/attention/sm80/fragments.cuh"
#include "pfa/attention/sm80/tile_loads.cuh"
#include "pfa/attention/softmax_state.cuh"
#include "pfa/attention/variant.cuh"
#include "pfa/attention/work.cuh"
#include "pfa/common/dtypes.cuh"
#include "pfa/ptx/mma_sm80.cuh"

namespace pfa {

template <class Cfg>
struct MainloopSm80 {
  using T = typename Cfg::Elem;
  using Role = WarpRoleSm80<Cfg>;
  using OAcc = typename AccumSm80<Cfg>::O;
  using Rows = typename AccumSm80<Cfg>::Rows;
  using Offsets = LdsmOffsetsSm80<Cfg>;
  using Softmax = OnlineSoftmax<Cfg::LAZY_RESCALE>;
  static constexpr int MQ = Cfg::MQ, S_NT = Cfg::S_NT, O_DT = Cfg::O_DT, KSTEPS = Cfg::KSTEPS;
  static constexpr int BLOCK_N = Cfg::BLOCK_N, ROW_BYTES = Cfg::ROW_BYTES, SWZ_BYTES = Cfg::SWIZZLE_BYTES;
  static constexpr bool PAIR = Cfg::PAIR, GENERAL = Cfg::GENERAL, Q_IN_REGS = Cfg::Q_IN_REGS;
  static constexpr unsigned FULL = Cfg::FULL_MASK;

  // Q fragments kept in registers across the loop (Q_IN_REGS), else a 1-element placeholder.
  using QFrags = uint32_t[Q_IN_REGS ? MQ : 1][Q_IN_REGS ? KSTEPS : 1][4];
  using Scores = float[MQ][S_NT][4];
  using PFrags = uint32_t[MQ][S_NT][2];  // P rounded to 16 bits, packed pairs: the A operand of P V
  using AFrags = uint32_t[MQ][4];        // one k16 step's A fragments, every row tile
  using BFrag = uint32_t[4];             // one ldmatrix.x4 of B (two n8 fragments)

  // GENERAL: per fragment row, the ALiBi slope (log2 units, 0 without ALiBi) and the query
  // index that LogitTransform::apply measures key distances from.
  using AlibiSlopes = float[GENERAL ? MQ : 1][2];
  using AlibiRows = int[GENERAL ? MQ : 1][2];
  static __device__ __forceinline__ void init_alibi(AlibiSlopes& slope, AlibiRows& q_row, const LogitTransform& xf,
                                                    const PrefillParams& p, const PrefillWork& w, const Role& wr) {
    const int r0 = w.r0, rows_total = w.rows_total, group = w.group, kv_head = w.kv_head;
    const int warp_row0 = wr.warp_row0, lane = wr.lane;
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = min(r0 + warp_row0 + mt * 16 + lane / 4 + hf * 8, rows_total - 1);
        q_row[mt][hf] = r / group;
        slope[mt][hf] = xf.kind == LogitTransform::kAlibi
                            ? reinterpret_cast<const float*>(p.alibi_slopes)[kv_head * group + r % group] * kLog2e
                            : 0.f;
      }
  }

  // ROPE_LLAMA of ROWS rows of a swizzled 16-bit tile, in place; pos_of(row) = its position.
  template <int ROWS, typename PosFn>
  static __device__ __forceinline__ void rope_tile(T* tile, const PrefillParams& p, int tid, PosFn pos_of) {
    constexpr int HALF = Cfg::CPR / 2;
    for (int item = tid; item < ROWS * HALF; item += Cfg::THREADS) {
      const int row = item / HALF, c = item % HALF;
      uint4* lo_p = reinterpret_cast<uint4*>(tile + Cfg::swz(row, c) * 8);
      uint4* hi_p = reinterpret_cast<uint4*>(tile + Cfg::swz(row, c + HALF) * 8);
      uint4 lo = *lo_p, hi = *hi_p;
      rope_rotate_chunk<Cfg::HEAD_DIM, T>(lo, hi, c, static_cast<float>(pos_of(row)), p);
      *lo_p = lo;
      *hi_p = hi;
    }
  }

  // S = Q K^T for this warp's rows and keys; a, b: fragment scratch of the caller's frame.
  static __device__ __forceinline__ void qk(Scores& s, AFrags& a, BFrag& b, const QFrags& qf, uint32_t sQ_u,
                                            uint32_t sK_u, const Offsets& off) {
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
      for (int nt = 0; nt < S_NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
      for (int mt = 0; mt < MQ; ++mt) {
        if constexpr (Q_IN_REGS) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a[mt][i] = qf[mt][ks][i];
        } else {
          ptx::ldmatrix_x4(a[mt], sQ_u + off.q[ks % 4] + mt * 16 * ROW_BYTES + (ks / 4) * SWZ_BYTES);
        }
      }
#pragma unroll
      for (int np = 0; np < S_NT / 2; ++np) {
        ptx::ldmatrix_x4(b, sK_u + off.k[ks % 4] + np * 16 * ROW_BYTES + (ks / 4) * SWZ_BYTES);
        mma_n16<Cfg>(s, np, a, b);
      }
    }
  }

  // GENERAL: soft cap / ALiBi on every score (variant.cuh).
  static __device__ __forceinline__ void transform_scores(Scores& s, const LogitTransform& xf,
                                                          const AlibiSlopes& slope, const AlibiRows& q_row, int n0,
                                                          const Role& wr) {
    if (xf.kind == LogitTransform::kPlain) return;
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
      for (int nt = 0; nt < S_NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          s[mt][nt][e] = xf.apply(s[mt][nt][e], slope[mt][e >> 1],
                                  n0 + wr.col0 + nt * 8 + (wr.lane % 4) * 2 + (e & 1) - q_row[mt][e >> 1]);
  }

  // Mask the scores of tile n0 through THE predicate (MaskRule). Only tiles that are not fully
  // kept pay for the per-element test; its form is the one Cfg picks per shape (config.cuh).
  // The rule and the tile's rows come by value: read through PrefillWork, the compiler keeps
  // reloading them around the custom-mask byte loads.
  static __device__ __forceinline__ void mask_scores(Scores& s, const MaskRule rule, int q_lo, int q_hi, int r0,
                                                     int group, int n0, const Role& wr) {
    if (rule.template keeps_all<Cfg::ROW_RANGE_MASK>(q_lo, q_hi, n0, n0 + BLOCK_N - 1)) return;
    const int lane = wr.lane;
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        // Query index of the C-fragment row this thread holds (only masked tiles need it).
        const int qi = (r0 + wr.warp_row0 + mt * 16 + lane / 4 + hf * 8) / group;
        // ROW_RANGE_MASK: the row's key range relative to this thread's first column.
        int lo = 0, hi = 0;
        if constexpr (Cfg::ROW_RANGE_MASK) {
          rule.row_range(qi, lo, hi);
          const int cbase = n0 + wr.col0 + (lane % 4) * 2;
          lo -= cbase;
          hi -= cbase;
        }
        if ((GENERAL || Cfg::SPEC_MASK) && rule.bits != nullptr) {
          // keep() for the row's 64 keys as one word (custom bits AND structural range), shifted
          // so that this thread's element (nt, e) is bit 8 nt + e: a constant position.
          static_assert(BLOCK_N <= 64, "row_keep_bits covers 64 keys");
          const uint64_t bits = rule.row_keep_bits(qi, n0) >> (wr.col0 + (lane % 4) * 2);
          const uint32_t w_lo = (uint32_t)bits, w_hi = (uint32_t)(bits >> 32);
#pragma unroll
          for (int nt = 0; nt < S_NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const uint32_t word = nt < 4 ? w_lo : w_hi;
              if (!((word >> ((nt % 4) * 8 + e)) & 1u)) s[mt][nt][2 * hf + e] = -INFINITY;
            }
        } else {
#pragma unroll
          for (int nt = 0; nt < S_NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              if constexpr (Cfg::ROW_RANGE_MASK) {
                if (nt * 8 + e < lo || nt * 8 + e >= hi) s[mt][nt][2 * hf + e] = -INFINITY;
              } else {
                const int kv = n0 + wr.col0 + nt * 8 + (lane % 4) * 2 + e;
                if (Cfg::ROW_END_MASK && !rule.has_left()) {  // no window / chunk: only the row's end (kv >= 0)
                  if (kv >= rule.row_end(qi)) s[mt][nt][2 * hf + e] = -INFINITY;
                } else if (!rule.keep(qi, kv)) {
                  s[mt][nt][2 * hf + e] = -INFINITY;
                }
              }
            }
        }
      }
  }

  // Max of row (mt, hf) over this warp's keys of the tile: the quad that shares the row.
  static __device__ __forceinline__ float row_max(const Scores& s, int mt, int hf) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < S_NT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 1));
    return fmaxf(mx, __shfl_xor_sync(FULL, mx, 2));
  }

  // Skip-softmax (Cfg::SKIP_SOFTMAX, on): whether every row of this warp (its pair: the pair's
  // maxes, so both warps agree) has a negligible max in this tile; padding rows do not vote. The
  // threshold and the row bounds are recomputed here, not held in registers across the loop.
  static __device__ __forceinline__ bool negligible_tile(const Scores& s, const Rows& m, const float (&pair_mx)[4],
                                                         float scale_eff, const PrefillParams& p,
                                                         const PrefillWork& w, const Role& wr) {
    const SkipSoftmax skip = SkipSoftmax::make(p.skip_softmax_factor, w.kv_len);
    const int row_limit = w.rows_total - (w.r0 + wr.warp_row0 + wr.lane / 4);  // rows mt * 16 + hf * 8 below it
    bool all = true;
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const float mx = PAIR ? pair_mx[2 * mt + hf] : row_max(s, mt, hf);
        all &= mt * 16 + hf * 8 >= row_limit || skip.negligible(mx, scale_eff, m[mt][hf]);
      }
    return __all_sync(FULL, all);
  }

  // Online softmax of one tile (softmax_state.cuh on the fragment rows): P into pp, m and l
  // updated, O rescaled; corr receives each row's rescale factor. pair_mx: PAIR scratch for the
  // exchanged row maxes, zeroed by the caller (see PrefillSm80::run on why scratch lives there).
  // Returns true, touching nothing, when skip-softmax skips the tile (then no P V either).
  static __device__ __forceinline__ bool softmax(Scores& s, PFrags& pp, OAcc& o, Rows& m, Rows& l, Rows& corr,
                                                 float (&pair_mx)[4], float scale_eff, const PrefillParams& p,
                                                 const PrefillWork& w, const Role& wr) {
    bool moved = false;  // did any row max of this thread move (corr != 1)?
    // PAIR: a warp's row max covers its own keys; both warps of the pair take the larger of
    // the two (fmaxf is symmetric, so they agree bit for bit and their halves of O match).
    if constexpr (PAIR) {
#pragma unroll
      for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) pair_mx[2 * mt + hf] = row_max(s, mt, hf);
      wr.xch_max[wr.warp * 32 + wr.lane] = make_float4(pair_mx[0], pair_mx[1], pair_mx[2], pair_mx[3]);
      ptx::bar_sync(wr.pair_bar, Cfg::PAIR_THREADS);
      const float4 x = wr.xch_max[wr.partner * 32 + wr.lane];
      pair_mx[0] = fmaxf(pair_mx[0], x.x);
      pair_mx[1] = fmaxf(pair_mx[1], x.y);
      pair_mx[2] = fmaxf(pair_mx[2], x.z);
      pair_mx[3] = fmaxf(pair_mx[3], x.w);
    }
    // lazy rescale keeps a stale max; skip-softmax compares against the true one
    bool lazy = true;
    if constexpr (Cfg::SKIP_SOFTMAX) {
      if (p.skip_softmax_factor > 0.f) {
        if (negligible_tile(s, m, pair_mx, scale_eff, p, w, wr)) return true;
        lazy = false;
      }
    }
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const float mx = PAIR ? pair_mx[2 * mt + hf] : row_max(s, mt, hf);
        const float m_use = Softmax::rescale(m[mt][hf], mx, scale_eff, corr[mt][hf], lazy);
        moved |= corr[mt][hf] != 1.f;
        float rs = 0.f;
#pragma unroll
        for (int nt = 0; nt < S_NT; ++nt) {
          s[mt][nt][2 * hf] = Softmax::prob(s[mt][nt][2 * hf], scale_eff, m_use);
          s[mt][nt][2 * hf + 1] = Softmax::prob(s[mt][nt][2 * hf + 1], scale_eff, m_use);
          rs += s[mt][nt][2 * hf] + s[mt][nt][2 * hf + 1];
        }
        l[mt][hf] = l[mt][hf] * corr[mt][hf] + rs;
        // Round P to 16 bits now: the packed copy is all P V needs, so the fp32 S registers
        // die here instead of living through the P V loop.
#pragma unroll
        for (int nt = 0; nt < S_NT; ++nt)
          pp[mt][nt][hf] = Pack2<typename Cfg::PElem>::from(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]);
        if constexpr (!Cfg::LAZY_RESCALE) {
#pragma unroll
          for (int d = 0; d < O_DT; ++d) {
            o[mt][d][2 * hf] *= corr[mt][hf];
            o[mt][d][2 * hf + 1] *= corr[mt][hf];
          }
        }
      }
    // LAZY_RESCALE: rescale O only when some row max of the warp moved; past the first few
    // tiles of a long row it rarely does, and the multiplies (one per O register) are a
    // noticeable share of a tile's issue. Whether the vote and branch pay off depends on the
    // register allocation they lead to, so the variant table decides per shape.
    if (Cfg::LAZY_RESCALE && __any_sync(FULL, moved)) {
#pragma unroll
      for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
        for (int d = 0; d < O_DT; ++d) {
          o[mt][d][0] *= corr[mt][0];
          o[mt][d][1] *= corr[mt][0];
          o[mt][d][2] *= corr[mt][1];
          o[mt][d][3] *= corr[mt][1];
        }
    }
    return false;
  }

  // Word k of a P fragment array, in the order the exchange slots hold them.
  static __device__ __forceinline__ uint32_t& p_word(PFrags& a, int k) {
    return a[k / (2 * S_NT)][(k / 2) % S_NT][k % 2];
  }

  // PAIR: hand this warp's P to its partner (same lane, same rows, the other keys), so both can
  // run P V over the whole tile for their own head dims. The pair meets only when the partner's
  // half of P V starts (the own half hides the wait), and the partner's P never lives next to
  // this warp's own. The slot is rewritten next tile only after the tile's __syncthreads, which
  // the partner reaches after reading it.
  static __device__ __forceinline__ void send_p(PFrags& pp, const Role& wr) {
#pragma unroll
    for (int i = 0; i < Cfg::XCH_P_WORDS / 4; ++i)
      wr.xch_p[(wr.warp * (Cfg::XCH_P_WORDS / 4) + i) * 32 + wr.lane] =
          make_uint4(p_word(pp, 4 * i), p_word(pp, 4 * i + 1), p_word(pp, 4 * i + 2), p_word(pp, 4 * i + 3));
  }

  // PAIR: the partner's P (send_p) into pq, once the pair meets.
  static __device__ __forceinline__ void receive_p(PFrags& pq, const Role& wr) {
    ptx::bar_sync(wr.pair_bar, Cfg::PAIR_THREADS);
#pragma unroll
    for (int i = 0; i < Cfg::XCH_P_WORDS / 4; ++i) {
      const uint4 x = wr.xch_p[(wr.partner * (Cfg::XCH_P_WORDS / 4) + i) * 32 + wr.lane];
      p_word(pq, 4 * i) = x.x;
      p_word(pq, 4 * i + 1) = x.y;
      p_word(pq, 4 * i + 2) = x.z;
      p_word(pq, 4 * i + 3) = x.w;
    }
  }

  // O += P V (PAIR: this warp's keys with its own P, then the partner's, received into pq).
  // a, b: fragment scratch of the caller's frame.
  static __device__ __forceinline__ void pv(OAcc& o, PFrags& pp, PFrags& pq, AFrags& a, BFrag& b, uint32_t sV_u,
                                            const Offsets& off, const Role& wr) {
    constexpr int HALVES = PAIR ? 2 : 1;
#pragma unroll
    for (int hv = 0; hv < HALVES; ++hv) {
      const uint32_t sVh = PAIR ? sV_u + (hv == 0 ? wr.col0 : BLOCK_N / 2 - wr.col0) * ROW_BYTES : sV_u;
      if (PAIR && hv == 1) receive_p(pq, wr);
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / HALVES / 16; ++kk) {
#pragma unroll
        for (int mt = 0; mt < MQ; ++mt) {
          const uint32_t(&src)[S_NT][2] = hv == 0 ? pp[mt] : pq[mt];
          a[mt][0] = src[2 * kk][0];
          a[mt][1] = src[2 * kk][1];
          a[mt][2] = src[2 * kk + 1][0];
          a[mt][3] = src[2 * kk + 1][1];
        }
#pragma unroll
        for (int dp = 0; dp < O_DT / 2; ++dp) {
          ptx::ldmatrix_x4_trans(b, sVh + off.v[dp % 4] + kk * 16 * ROW_BYTES + (dp / 4) * SWZ_BYTES);
          mma_n16<Cfg>(o, dp, a, b);
        }
      }
    }
  }

  // GENERAL, RoPE on: rotate in shared memory right after the tiles land (Q on the first tile,
  // K every tile), then make the rotated values visible before any ldmatrix reads them.
  static __device__ __forceinline__ void rope_tiles(const PrefillParams& p, const PrefillWork& w, char* smem,
                                                    uint32_t sQ_u, uint32_t sK_u, int it, int n0, int tid) {
    if (it == 0)
      rope_tile<Cfg::BLOCK_M>(reinterpret_cast<T*>(smem), p, tid,
                              [&](int row) { return (w.r0 + row) / w.group + w.kv_len - w.qo_len; });
    rope_tile<BLOCK_N>(reinterpret_cast<T*>(smem + (sK_u - sQ_u)), p, tid, [&](int row) { return n0 + row; });
    __syncthreads();
  }

  // Q_IN_REGS: Q's A fragments, loaded once for the whole loop.
  static __device__ __forceinline__ void load_q_frags(QFrags& qf, uint32_t sQ_u, const Offsets& off) {
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks)
        ptx::ldmatrix_x4(qf[mt][ks], sQ_u + off.q[ks % 4] + mt * 16 * ROW_BYTES + (ks / 4) * SWZ_BYTES);
  }
};

}  // namespace pfa
