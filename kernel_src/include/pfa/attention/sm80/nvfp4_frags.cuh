// NVFP4 K/V straight from the ring into mma.sync fragments, for the one-warp decode tiles
// (PrefillSm80Config::KV_REG_WIDEN; what they share with the fp8 tiles: reg_frags.cuh). A ring
// tile holds BLOCK_N rows of e2m1 code pairs (swizzled for ldmatrix), then BLOCK_N rows of e4m3
// block scales (one per 16 dims, linear). Each lane turns its own codes into fp16 with a byte
// lookup table and multiplies them by their block's scale (exact: 2 x 4 significant bits), and
// both products run as fp16 MMAs.
//
// One 8x8 b16 ldmatrix over 8 code rows of 16 bytes (32 dims) gives lane (r = lane / 4, c =
// lane % 4):
//   plain       row r, codes of dims 8c .. 8c + 7: two k16 steps of K's B fragment (step 2d:
//               mma k 2c, 2c + 1 <- dims 8c, 8c + 1, k 2c + 8, 2c + 9 <- 8c + 2, 8c + 3; step
//               2d + 1: 8c + 4 .. 8c + 7), all in block 2d + c / 2; Q stored to match
//               (prepare_q<4>).
//   transposed  rows 2c and 2c + 1, codes of dims 4r .. 4r + 3 each: V's keys (2c, 2c + 1) at
//               dims 4r + j, j = 0..3, the B fragments of four n8 tiles (logical n = r <- dim
//               4r + j), block 2d + r / 4. O's tiles 4d + j then hold chunk d's dims as
//               8c + 4e + j (element e) per lane, and finish_o restores the usual layout.
#pragma once
#include <stdint.h>

#include "pfa/attention/params.h"
#include "pfa/attention/sm80/fragments.cuh"
#include "pfa/attention/sm80/reg_frags.cuh"
#include "pfa/common/dtypes.cuh"
#include "pfa/ptx/mma_sm80.cuh"

namespace pfa {

template <class Cfg>
struct Nvfp4FragsSm80 {
  static constexpr int MQ = Cfg::MQ, S_NT = Cfg::S_NT, O_DT = Cfg::O_DT;
  static constexpr int BLOCK_N = Cfg::BLOCK_N, KV_CPR = Cfg::KV_CPR, CB = Cfg::CHUNK_BYTES;
  static constexpr int ROWS16_BYTES = 16 * KV_CPR * CB;  // 16 code rows of a ring tile
  static constexpr int SF_ROW = Cfg::SF_ROW_BYTES, SF_OFFSET = Cfg::SF_OFFSET;
  static constexpr unsigned FULL = Cfg::FULL_MASK;
  static_assert(Cfg::KV_REG_WIDEN && Cfg::KV_NVFP4, "the register-widened NVFP4 decode tiles");
  static_assert(O_DT == 4 * KV_CPR, "four n8 tiles of O per 32-dim code chunk");
  static_assert(SF_ROW == 4 || SF_ROW == 8, "hd64 / hd128: a row's block scales in one or two words");
  static constexpr int Q_WORDS_PER_LANE = 4;  // RegFragsSm80::prepare_q's WPL: 8 dims a lane and chunk

  // Block scales of ring row `row` (blocks 0-3 in .x, 4-7 in .y).
  static __device__ __forceinline__ uint2 scale_row(uint32_t s_tile, int row) {
    const uint32_t at = s_tile + SF_OFFSET + row * SF_ROW;
    if constexpr (SF_ROW == 8) {
      return ptx::lds_64(at);
    } else {
      return make_uint2(ptx::lds_32(at), 0u);
    }
  }
  // Byte b (0-7) of a scale row, both lanes of an fp16 pair.
  static __device__ __forceinline__ uint32_t scale_pair(uint2 row, int b) {
    const uint32_t w = b < 4 ? row.x : row.y, bb = b % 4;
    return e4m3x2_to_half2(ptx::prmt(w, 0u, bb | bb << 4));
  }

  // S = Q K^T over the tile's keys (times 2^-e of prepare_q).
  static __device__ __forceinline__ void qk(float (&s)[MQ][S_NT][4], const PrefillParams&, uint32_t sQ_u,
                                            uint32_t sK_u, const uint32_t (&qo)[4], const uint32_t (&kvo)[4]) {
    const int lane = threadIdx.x % 32, half_c = (lane % 4) / 2;  // this lane's block within a 32-dim chunk
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
      for (int nt = 0; nt < S_NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
    for (int np = 0; np < S_NT / 2; ++np) {
      // scale rows of this lane's keys r and 8 + r of the 16-key group
      const uint2 sc[2] = {scale_row(sK_u, np * 16 + lane / 4), scale_row(sK_u, np * 16 + 8 + lane / 4)};
#pragma unroll
      for (int kp = 0; kp < KV_CPR / 2; ++kp) {
        uint32_t a[MQ][4][4];  // Q's A fragments of k steps 4kp .. 4kp + 3 (chunks 2kp, 2kp + 1)
#pragma unroll
        for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
          for (int h = 0; h < 4; ++h) {
            const int ks = 4 * kp + h;
            ptx::ldmatrix_x4(a[mt][h], sQ_u + qo[ks % 4] + (ks / 4) * Cfg::SWIZZLE_BYTES + mt * 16 * Cfg::ROW_BYTES);
          }
        // r[0], r[1]: keys 0-7, 8-15 of the group at chunk 2kp; r[2], r[3]: at chunk 2kp + 1
        uint32_t r[4];
        ptx::ldmatrix_x4(r, sK_u + np * ROWS16_BYTES + kvo[kp % 4] + (kp / 4) * 8 * CB);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int d = 2 * kp + i / 2;  // the code chunk
          const uint4 w = widen_fp4x8<half>(r[i], scale_pair(sc[i % 2], 2 * d + half_c));
#pragma unroll
          for (int mt = 0; mt < MQ; ++mt) {
            ptx::mma_16816<half>(s[mt][2 * np + i % 2], a[mt][2 * (i / 2)], w.x, w.y);
            ptx::mma_16816<half>(s[mt][2 * np + i % 2], a[mt][2 * (i / 2) + 1], w.z, w.w);
          }
        }
      }
    }
  }

  // O += P V over the tile's keys (P in fp16; O in the permuted dim order above).
  static __device__ __forceinline__ void pv(float (&o)[MQ][O_DT][4], const uint32_t (&pp)[MQ][S_NT][2],
                                            uint32_t (&)[MQ][S_NT][2], const PrefillParams&, uint32_t sV_u,
                                            const uint32_t (&kvo)[4], const WarpRoleSm80<Cfg>&) {
    const int lane = threadIdx.x % 32, c = lane % 4, rq = lane / 16;  // rq: this lane's block in a chunk
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      uint32_t a[MQ][4];  // P's A fragment of keys 16kk .. 16kk + 15
      RegFragsSm80<Cfg>::p_frag(pp, kk, a);
      // scale rows of keys 2c, 2c + 1 and 8 + 2c, 9 + 2c of the group
      uint2 sc[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) sc[k] = scale_row(sV_u, kk * 16 + (k / 2) * 8 + 2 * c + k % 2);
#pragma unroll
      for (int dp = 0; dp < KV_CPR / 2; ++dp) {
        // r[0], r[1]: keys 0-7, 8-15 of chunk 2dp; r[2], r[3]: of chunk 2dp + 1
        uint32_t r[4];
        ptx::ldmatrix_x4_trans(r, sV_u + kk * ROWS16_BYTES + kvo[dp % 4] + (dp / 4) * 8 * CB);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int d = 2 * dp + h, b = 2 * d + rq;  // chunk, block
          // (scale of key 2c, of key 2c + 1), then of keys 8 + 2c, 9 + 2c
          const uint32_t bb = b % 4;
          const uint32_t s0 = e4m3x2_to_half2(ptx::prmt(b < 4 ? sc[0].x : sc[0].y, b < 4 ? sc[1].x : sc[1].y,
                                                        bb | (4 + bb) << 4));
          const uint32_t s1 = e4m3x2_to_half2(ptx::prmt(b < 4 ? sc[2].x : sc[2].y, b < 4 ? sc[3].x : sc[3].y,
                                                        bb | (4 + bb) << 4));
          uint32_t lo_a, lo_b, hi_a, hi_b;  // codes of key 2c (bytes of *_a) and 2c + 1 (*_b), keys 0-7 / 8-15
          fp4x8_f16_high_bytes(r[2 * h], lo_a, lo_b);
          fp4x8_f16_high_bytes(r[2 * h + 1], hi_a, hi_b);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            constexpr uint32_t KEEP = 0xFF00FF00u;  // the high bytes; the codes' low bytes are 0
            const uint32_t sel = (uint32_t)j << 4 | (uint32_t)(4 + j) << 12;
            const half2 v0 = __hmul2(u32_as_half2(ptx::prmt(lo_a, lo_b, sel) & KEEP), u32_as_half2(s0));
            const half2 v1 = __hmul2(u32_as_half2(ptx::prmt(hi_a, hi_b, sel) & KEEP), u32_as_half2(s1));
#pragma unroll
            for (int mt = 0; mt < MQ; ++mt)
              ptx::mma_16816<half>(o[mt][4 * d + j], a[mt], half2_as_u32(v0), half2_as_u32(v1));
          }
        }
      }
    }
  }
  static __device__ __forceinline__ half2 u32_as_half2(uint32_t u) { return *reinterpret_cast<half2*>(&u); }
  static __device__ __forceinline__ uint32_t half2_as_u32(half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

  // After the tile loop: O in the usual C-fragment layout. Per chunk d and row this lane holds
  // dim 8c + 4e + j in tile 4d + j, element e; it needs dims 8t + 2c + e' (tile 4d + t, element
  // e'), which quad lane t holds in tile 4d + 2 (c % 2) + e', element c / 2.
  static __device__ __forceinline__ void finish_o(float (&o)[MQ][O_DT][4], int lane) {
    const int c = lane % 4, base = lane & ~3;
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
      for (int d = 0; d < KV_CPR; ++d)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          float v[4][2];  // [j][e]: this lane's values of the chunk's row
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) v[j][e] = o[mt][4 * d + j][2 * hf + e];
#pragma unroll
          for (int t = 0; t < 4; ++t)
#pragma unroll
            for (int e2 = 0; e2 < 2; ++e2) {
              // the receiving lane's (c % 2, c / 2) picks one of the four
              const float g00 = __shfl_sync(FULL, v[e2][0], base + t), g01 = __shfl_sync(FULL, v[e2][1], base + t);
              const float g10 = __shfl_sync(FULL, v[2 + e2][0], base + t);
              const float g11 = __shfl_sync(FULL, v[2 + e2][1], base + t);
              o[mt][4 * d + t][2 * hf + e2] = c % 2 ? (c / 2 ? g11 : g10) : (c / 2 ? g01 : g00);
            }
        }
  }
};

}  // namespace pfa
