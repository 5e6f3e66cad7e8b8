// fp8 K/V straight from the ring into mma.sync fragments, for the one-warp decode tiles
// (PrefillSm80Config::KV_REG_WIDEN): ldmatrix reads the one-byte tiles as if they held 16-bit
// elements, and each thread widens its own bytes in registers into fp16 (widen_fp8x4<half>: the
// hardware conversion for e4m3 on sm_89+, a byte move for e5m2). Both products run as fp16 MMAs
// (every fp8 value is an fp16; bf16 queries are rewritten as fp16 once, in prepare_q), with no
// widened copy in shared memory and no barrier pair around one.
//
// One 8x8 b16 ldmatrix over 8 fp8 rows of 16 bytes gives lane (r = lane / 4, c = lane % 4):
//   plain       row r, bytes 4c .. 4c + 3 as one word: widened, K's B fragment of one n8 tile and
//               one k16 step with the k order permuted (mma k 2c, 2c + 1 <- dims 4c, 4c + 1; k
//               2c + 8, 2c + 9 <- dims 4c + 2, 4c + 3). A dot product does not care about the
//               order of its terms, so Q is stored in the same order once (prepare_q) and read
//               with the usual ldmatrix.
//   transposed  rows 2c and 2c + 1, bytes 2r and 2r + 1 of each: V's keys (2c, 2c + 1) at dim 2r
//               (bytes 0, 2) and at dim 2r + 1 (bytes 1, 3). With the matrix of the next 8 keys,
//               one byte permute each gives chunk d's "even" (dims 2n) and "odd" (dims 2n + 1) B
//               fragments; O's n8 tiles 2d and 2d + 1 then hold chunk d's dims as (4c, 4c + 2 |
//               4c + 1, 4c + 3) per lane, and finish_o restores the usual layout after the loop.
// The ring tiles are swizzled for these reads (PrefillSm80Config::ring_off / fp8_swz).
#pragma once
#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "pfa/attention/params.h"
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
  // bf16 queries are scaled by 2^-e into fp16 so that their largest magnitude stays below this
  static constexpr float Q_F16_LIMIT = 32768.f;
  static_assert(Cfg::KV_REG_WIDEN && !Cfg::PAIR && Cfg::NUM_WARPS == 1, "the one-warp fp8 decode tiles");
  static_assert(O_DT == 2 * KV_CPR, "O's n8 tiles pair up per 16-dim chunk");

  // 2^n for the scale exponents here (|n| <= 113: normal floats), exactly.
  static __device__ __forceinline__ float pow2(int n) { return __int_as_float((127 + n) << 23); }

  // The Q tile (landed, in shared memory) -> the MMAs' operand, in place: each 16-dim k step
  // (32-bit words u0 .. u7, dims 2i, 2i + 1 in u_i) stored as [u0 u2 u4 u6 | u1 u3 u5 u7], so
  // that a plain ldmatrix gives lane c the dims the K fragments pair it with (4c, 4c + 1 and
  // 4c + 2, 4c + 3: see the top of this file). bf16 queries also become fp16, scaled by 2^-e
  // (e >= 0, the smallest that keeps max |q| below Q_F16_LIMIT): fp16 then holds every bf16
  // value at or above 2^(e-14) exactly and rounds smaller ones at 2^(e-25), far below bf16's own
  // rounding of the large ones. Returns e (0 for fp16 queries).
  static __device__ __forceinline__ int prepare_q(char* smem, int lane) {
    constexpr int STEPS = Cfg::BLOCK_M * KSTEPS;  // (row, k step) pairs: two 16-byte chunks each
    constexpr bool BF16 = !std::is_same<T, half>::value;
    auto chunk = [&](int i, int h) {  // chunk h of pair i, through the swizzle
      return reinterpret_cast<uint4*>(smem + Cfg::swz(i / KSTEPS, 2 * (i % KSTEPS) + h) * CB);
    };
    int e = 0;
    if constexpr (BF16) {
      float mx = 0.f;
      for (int i = lane; i < STEPS; i += 32)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint4 w = *chunk(i, h);
          mx = fmaxf(mx, fmaxf(fmaxf(bf16_absmax2(w.x), bf16_absmax2(w.y)), fmaxf(bf16_absmax2(w.z), bf16_absmax2(w.w))));
        }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, o));
      // mx in [2^k, 2^(k+1)): e = k - 14 keeps mx * 2^-e below 2^15 (bf16's largest finite: e = 113)
      e = mx >= Q_F16_LIMIT ? min(ilogbf(mx), 127) - 14 : 0;
    }
    const float s = pow2(-e);
    auto f16 = [&](uint32_t u) {  // two bf16 -> two fp16, times 2^-e; fp16 as it is
      return BF16 ? Pack2<half>::from(__uint_as_float(u << 16) * s, __uint_as_float(u & 0xFFFF0000u) * s) : u;
    };
    for (int i = lane; i < STEPS; i += 32) {
      uint4* lo = chunk(i, 0);
      uint4* hi = chunk(i, 1);
      const uint4 a = *lo, b = *hi;
      *lo = make_uint4(f16(a.x), f16(a.z), f16(b.x), f16(b.z));
      *hi = make_uint4(f16(a.y), f16(a.w), f16(b.y), f16(b.w));
    }
    __syncthreads();
    return e;
  }
  static __device__ __forceinline__ float bf16_absmax2(uint32_t u) {
    return fmaxf(fabsf(__uint_as_float(u << 16)), fabsf(__uint_as_float(u & 0xFFFF0000u)));
  }

  // Lane offsets of the fp8 ring tiles, for pair j of chunks: kv[j % 4] + (j / 4) * 128 (the
  // swizzle touches only a chunk index's low 3 bits). ldmatrix matrix lane / 8 covers rows
  // ((lane / 8) % 2) * 8 .. + 7 of a 16-row group and chunk 2j + lane / 16 (fp8_swz). Q's
  // fragments take the 16-bit tiles' offsets (LdsmOffsetsSm80::q).
  static __device__ __forceinline__ void offsets(int lane, uint32_t (&kv)[4]) {
    const int kvrow = ((lane / 8) % 2) * 8 + lane % 8;
#pragma unroll
    for (int j = 0; j < 4; ++j) kv[j] = (kvrow * KV_CPR + ((2 * j + lane / 16) ^ Cfg::fp8_swz(kvrow))) * CB;
  }

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
  static __device__ __forceinline__ void qk(float (&s)[MQ][S_NT][4], int kv_fp8, uint32_t sQ_u, uint32_t sK_u,
                                            const uint32_t (&qo)[4], const uint32_t (&kvo)[4]) {
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
      for (int nt = 0; nt < S_NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
    if (kv_fp8 == kFp8E5M2) {
      qk_as<kFp8E5M2>(s, sQ_u, sK_u, qo, kvo);
    } else {
      qk_as<kFp8E4M3>(s, sQ_u, sK_u, qo, kvo);
    }
  }

  // O += P V over the tile's keys (P in fp16; O in the permuted dim order above).
  template <int FMT>
  static __device__ __forceinline__ void pv_as(float (&o)[MQ][O_DT][4], const uint32_t (&pp)[MQ][S_NT][2],
                                               uint32_t sV_u, const uint32_t (&kvo)[4]) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      uint32_t a[MQ][4];  // P's A fragment of keys 16kk .. 16kk + 15
#pragma unroll
      for (int mt = 0; mt < MQ; ++mt) {
        a[mt][0] = pp[mt][2 * kk][0];
        a[mt][1] = pp[mt][2 * kk][1];
        a[mt][2] = pp[mt][2 * kk + 1][0];
        a[mt][3] = pp[mt][2 * kk + 1][1];
      }
#pragma unroll
      for (int dp = 0; dp < KV_CPR / 2; ++dp) {
        // r[0], r[1]: keys 0-7, 8-15 of chunk 2dp; r[2], r[3]: of chunk 2dp + 1
        uint32_t r[4];
        ptx::ldmatrix_x4_trans(r, sV_u + kk * ROWS16_BYTES + kvo[dp % 4] + (dp / 4) * 8 * CB);
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
  }
  static __device__ __forceinline__ void pv(float (&o)[MQ][O_DT][4], const uint32_t (&pp)[MQ][S_NT][2], int kv_fp8,
                                            uint32_t sV_u, const uint32_t (&kvo)[4]) {
    if (kv_fp8 == kFp8E5M2) {
      pv_as<kFp8E5M2>(o, pp, sV_u, kvo);
    } else {
      pv_as<kFp8E4M3>(o, pp, sV_u, kvo);
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
      for (int d = 0; d < KV_CPR; ++d)
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
