// fp8 K/V straight from the ring into mma.sync fragments, for the one-warp decode tiles
// (PrefillSm80Config::KV_REG_WIDEN; what they share with the NVFP4 tiles: reg_frags.cuh). Each
// lane widens its own bytes in registers into fp16 (widen_fp8x4<half>: the hardware conversion
// for e4m3 on sm_89+, a byte move for e5m2), and both products run as fp16 MMAs (every fp8 value
// is an fp16), with no widened copy in shared memory and no barrier pair around one.
//
// One 8x8 b16 ldmatrix over 8 fp8 rows of 16 bytes gives lane (r = lane / 4, c = lane % 4):
//   plain       row r, bytes 4c .. 4c + 3 as one word: widened, K's B fragment of one n8 tile and
//               one k16 step (mma k 2c, 2c + 1 <- dims 4c, 4c + 1; k 2c + 8, 2c + 9 <- dims
//               4c + 2, 4c + 3), Q stored to match (prepare_q<2>).
//   transposed  rows 2c and 2c + 1, bytes 2r and 2r + 1 of each: V's keys (2c, 2c + 1) at dim 2r
//               (bytes 0, 2) and at dim 2r + 1 (bytes 1, 3). With the matrix of the next 8 keys,
//               one byte permute each gives chunk d's "even" (dims 2n) and "odd" (dims 2n + 1) B
//               fragments; O's n8 tiles 2d and 2d + 1 then hold chunk d's dims as (4c, 4c + 2 |
//               4c + 1, 4c + 3) per lane, and finish_o restores the usual layout after the loop.
#pragma once
#include <math.h>
#include <stdint.h>

#include "pfa/attention/params.h"
#include "pfa/attention/sm80/fragments.cuh"
#include "pfa/attention/sm80/mainloop.cuh"
#include "pfa/attention/sm80/reg_frags.cuh"
#include "pfa/common/dtypes.cuh"
#include "pfa/ptx/mma_sm80.cuh"

namespace pfa {

template <class Cfg>
struct Fp8FragsSm80 {
  using T = typename Cfg::Elem;
  static constexpr int MQ = Cfg::MQ, S_NT = Cfg::S_NT, O_DT = Cfg::O_DT, KSTEPS = Cfg::KSTEPS;
  static constexpr int BLOCK_N = Cfg::BLOCK_N, KV_CPR = Cfg::KV_CPR, CB = Cfg::CHUNK_BYTES;
  static constexpr int ROW_BYTES = Cfg::ROW_BYTES;      // a row of the 16-bit Q tile
  static constexpr int ROWS16_BYTES = 16 * KV_CPR * CB;  // 16 rows of an fp8 ring tile
  static constexpr unsigned FULL = Cfg::FULL_MASK;
  static_assert(Cfg::KV_REG_WIDEN && Cfg::KV_FP8, "the register-widened fp8 decode tiles");
  static constexpr int HALVES = Cfg::PAIR ? 2 : 1;  // PAIR: O over half the dims, all keys in two halves
  static_assert(O_DT * HALVES == 2 * KV_CPR, "O's n8 tiles pair up per 16-dim chunk");
  static constexpr int Q_WORDS_PER_LANE = 2;  // RegFragsSm80::prepare_q's WPL: 4 dims a lane and chunk

  // S = Q K^T over the tile's keys (times 2^-e of prepare_q).
  template <int FMT>
  static __device__ __forceinline__ void qk_as(float (&s)[MQ][S_NT][4], uint32_t sQ_u, uint32_t sK_u,
                                               const uint32_t (&qo)[4], const uint32_t (&kvo)[4]) {
#pragma unroll
    for (int kp = 0; kp < KSTEPS / 2; ++kp) {
      uint32_t a[MQ][2][4];  // Q's A fragments of k steps 2kp, 2kp + 1 (prepare_q's order)
#pragma unroll
      for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int ks = 2 * kp + h;
          ptx::ldmatrix_x4(a[mt][h], sQ_u + qo[ks % 4] + (ks / 4) * Cfg::SWIZZLE_BYTES + mt * 16 * ROW_BYTES);
        }
#pragma unroll
      for (int np = 0; np < S_NT / 2; ++np) {
        // r[0], r[1]: keys 0-7, 8-15 of the group at k step 2kp; r[2], r[3]: the same at 2kp + 1
        uint32_t r[4];
        ptx::ldmatrix_x4(r, sK_u + np * ROWS16_BYTES + kvo[kp % 4] + (kp / 4) * 8 * CB);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint2 b = widen_fp8x4<half, FMT>(r[i]);
#pragma unroll
          for (int mt = 0; mt < MQ; ++mt) ptx::mma_16816<half>(s[mt][2 * np + i % 2], a[mt][i / 2], b.x, b.y);
        }
      }
    }
  }
  static __device__ __forceinline__ void qk(float (&s)[MQ][S_NT][4], const PrefillParams& p, uint32_t sQ_u,
                                            uint32_t sK_u, const uint32_t (&qo)[4], const uint32_t (&kvo)[4]) {
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
      for (int nt = 0; nt < S_NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
    if (p.kv_fp8 == kFp8E5M2) {
      qk_as<kFp8E5M2>(s, sQ_u, sK_u, qo, kvo);
    } else {
      qk_as<kFp8E4M3>(s, sQ_u, sK_u, qo, kvo);
    }
  }

  // O += P V over the tile's keys (P in fp16; O in the permuted dim order above). PAIR: this
  // warp's head dims (from dcol0) over its own keys with its own P, then over the partner's keys
  // with the partner's P (received into pq), as MainloopSm80::pv.
  template <int FMT>
  static __device__ __forceinline__ void pv_as(float (&o)[MQ][O_DT][4], const uint32_t (&pp)[MQ][S_NT][2],
                                               uint32_t (&pq)[MQ][S_NT][2], uint32_t sV_u, const uint32_t (&kvo)[4],
                                               const WarpRoleSm80<Cfg>& wr) {
#pragma unroll
    for (int hv = 0; hv < HALVES; ++hv) {
      // this half's first key row and this warp's first dim (one byte each)
      const uint32_t sVh = Cfg::PAIR ? sV_u + (hv == 0 ? wr.col0 : BLOCK_N / 2 - wr.col0) * KV_CPR * CB + wr.dcol0
                                     : sV_u;
      if (Cfg::PAIR && hv == 1) MainloopSm80<Cfg>::receive_p(pq, wr);
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / HALVES / 16; ++kk) {
        // P's A fragment of keys 16kk .. 16kk + 15 of this half: RegFragsSm80::p_frag's words, from
        // pp or the partner's pq (calling p_frag here reorders the fp8 kernels' SASS; kept as it
        // was GPU-tested)
        uint32_t a[MQ][4];
#pragma unroll
        for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
          for (int i = 0; i < 4; ++i)  // words (2kk, 0), (2kk, 1), (2kk + 1, 0), (2kk + 1, 1)
            a[mt][i] = hv == 0 ? pp[mt][2 * kk + i / 2][i % 2] : pq[mt][2 * kk + i / 2][i % 2];
        pv_keys<FMT>(o, a, sVh + kk * ROWS16_BYTES, kvo);
      }
    }
  }
  // O += a x (16 keys of V from s_rows, this warp's dims).
  template <int FMT>
  static __device__ __forceinline__ void pv_keys(float (&o)[MQ][O_DT][4], const uint32_t (&a)[MQ][4], uint32_t s_rows,
                                                 const uint32_t (&kvo)[4]) {
#pragma unroll
      for (int dp = 0; dp < O_DT / 4; ++dp) {
        // r[0], r[1]: keys 0-7, 8-15 of chunk 2dp; r[2], r[3]: of chunk 2dp + 1
        uint32_t r[4];
        ptx::ldmatrix_x4_trans(r, s_rows + kvo[dp % 4] + (dp / 4) * 8 * CB);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int d = 2 * dp + h;
          // bytes 0, 2 (dims 2n) / 1, 3 (dims 2n + 1) of keys 0-7, then of keys 8-15
          const uint2 even = widen_fp8x4<half, FMT>(ptx::prmt(r[2 * h], r[2 * h + 1], 0x6420));
          const uint2 odd = widen_fp8x4<half, FMT>(ptx::prmt(r[2 * h], r[2 * h + 1], 0x7531));
#pragma unroll
          for (int mt = 0; mt < MQ; ++mt) {
            ptx::mma_16816<half>(o[mt][2 * d], a[mt], even.x, even.y);
            ptx::mma_16816<half>(o[mt][2 * d + 1], a[mt], odd.x, odd.y);
          }
        }
      }
  }
  static __device__ __forceinline__ void pv(float (&o)[MQ][O_DT][4], const uint32_t (&pp)[MQ][S_NT][2],
                                            uint32_t (&pq)[MQ][S_NT][2], const PrefillParams& p, uint32_t sV_u,
                                            const uint32_t (&kvo)[4], const WarpRoleSm80<Cfg>& wr) {
    if (p.kv_fp8 == kFp8E5M2) {
      pv_as<kFp8E5M2>(o, pp, pq, sV_u, kvo, wr);
    } else {
      pv_as<kFp8E4M3>(o, pp, pq, sV_u, kvo, wr);
    }
  }

  // After the tile loop: O in the usual C-fragment layout.
  // Per chunk and row this lane holds dims 4c (e0), 4c + 1 (d0), 4c + 2 (e1), 4c + 3 (d1); it
  // needs 2c, 2c + 1 (from quad lane c / 2) and 2c + 8, 2c + 9 (from quad lane 2 + c / 2), at
  // positions 2 (c % 2) and 2 (c % 2) + 1 there.
  static __device__ __forceinline__ void finish_o(float (&o)[MQ][O_DT][4], int lane) {
    const int src_lo = (lane & ~3) | (lane % 4) / 2, src_hi = src_lo + 2;
    const bool odd_lane = lane % 2;
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
      for (int d = 0; d < O_DT / 2; ++d)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const float e0 = o[mt][2 * d][2 * hf], e1 = o[mt][2 * d][2 * hf + 1];
          const float d0 = o[mt][2 * d + 1][2 * hf], d1 = o[mt][2 * d + 1][2 * hf + 1];
          const float lo_e0 = __shfl_sync(FULL, e0, src_lo), lo_e1 = __shfl_sync(FULL, e1, src_lo);
          const float lo_d0 = __shfl_sync(FULL, d0, src_lo), lo_d1 = __shfl_sync(FULL, d1, src_lo);
          const float hi_e0 = __shfl_sync(FULL, e0, src_hi), hi_e1 = __shfl_sync(FULL, e1, src_hi);
          const float hi_d0 = __shfl_sync(FULL, d0, src_hi), hi_d1 = __shfl_sync(FULL, d1, src_hi);
          o[mt][2 * d][2 * hf] = odd_lane ? lo_e1 : lo_e0;
          o[mt][2 * d][2 * hf + 1] = odd_lane ? lo_d1 : lo_d0;
          o[mt][2 * d + 1][2 * hf] = odd_lane ? hi_e1 : hi_e0;
          o[mt][2 * d + 1][2 * hf + 1] = odd_lane ? hi_d1 : hi_d0;
        }
  }
};

}  // namespace pfa
