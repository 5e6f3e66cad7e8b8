// What the register-widened decode tiles (PrefillSm80Config::KV_REG_WIDEN: 16 rows a warp,
// fp8 or NVFP4 K/V) share: Q rewritten once as the fp16 operand in the k order their K
// fragments come in, and the ldmatrix lane offsets into their narrow ring tiles. The fragment
// math itself: fp8_frags.cuh, nvfp4_frags.cuh.
//
// Both read a ring tile with ldmatrix as if it held 16-bit elements: lane (r = lane / 4, c =
// lane % 4) of a plain 8x8 b16 matrix gets row r, bytes 4c .. 4c + 3 of a 16-byte chunk, i.e.
// 4 fp8 dims or 8 NVFP4 dims. Widened, those feed one (fp8) or two (NVFP4) k16 steps of an
// mma B fragment with the k order permuted: lane c's mma k (2c, 2c + 1) and (2c + 8, 2c + 9)
// take its own dims. A dot product does not care about the order of its terms, so Q is stored
// in the same order (prepare_q) and a plain ldmatrix of it feeds the A fragments.
#pragma once
#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "pfa/common/dtypes.cuh"

namespace pfa {

template <class Cfg>
struct RegFragsSm80 {
  using T = typename Cfg::Elem;
  static constexpr int KV_CPR = Cfg::KV_CPR, CB = Cfg::CHUNK_BYTES, MQ = Cfg::MQ, S_NT = Cfg::S_NT;
  static constexpr unsigned FULL = Cfg::FULL_MASK;
  // bf16 queries are scaled by 2^-e into fp16 so that their largest magnitude stays below this
  static constexpr float Q_F16_LIMIT = 32768.f;
  static_assert(Cfg::KV_REG_WIDEN && Cfg::MQ == 1, "register-widened decode tiles: 16 rows a warp (or a pair)");

  // 2^n for the scale exponents here (|n| <= 113: normal floats), exactly.
  static __device__ __forceinline__ float pow2(int n) { return __int_as_float((127 + n) << 23); }

  static __device__ __forceinline__ float bf16_absmax2(uint32_t u) {
    return fmaxf(fabsf(__uint_as_float(u << 16)), fabsf(__uint_as_float(u & 0xFFFF0000u)));
  }

  // The Q tile (landed, in shared memory) -> the MMAs' operand, in place. WPL: 32-bit words (dim
  // pairs) a lane takes from one ldmatrix row (fp8 2, NVFP4 4). Each group of 4 WPL words u_i
  // (dims 2i, 2i + 1), WPL / 2 k steps, is stored step s by step as the 16-byte chunks
  // [u_{2s}, u_{WPL + 2s}, u_{2 WPL + 2s}, u_{3 WPL + 2s}] and the same with 2s + 1: lane c's A
  // fragment words are then its K fragment's dims. bf16 queries also become fp16, scaled by 2^-e
  // (e >= 0, the smallest that keeps max |q| below Q_F16_LIMIT): fp16 then holds every bf16 value
  // at or above 2^(e-14) exactly and rounds smaller ones at 2^(e-25), far below bf16's own
  // rounding of the large ones. Returns e (0 for fp16 queries). The swizzle moves whole 16-byte
  // chunks, so each group is rewritten where its chunks lie. Each warp rewrites its own 16 rows
  // (from row0), the only ones it reads, with an e of its own (its logit scale is its own); the
  // two warps of a pair (PAIR) share their rows: both find e, then the writer rewrites them.
  template <int WPL>
  static __device__ __forceinline__ int prepare_q(char* smem, int lane, int row0, bool writer) {
    constexpr int GROUPS_PER_ROW = Cfg::CPR / WPL, GROUPS = 16 * GROUPS_PER_ROW;
    constexpr bool BF16 = !std::is_same<T, half>::value;
    auto chunk = [&](int g, int h) {  // chunk h of group g, through the swizzle
      return reinterpret_cast<uint4*>(smem + Cfg::swz(row0 + g / GROUPS_PER_ROW, (g % GROUPS_PER_ROW) * WPL + h) * CB);
    };
    int e = 0;
    if constexpr (BF16) {
      float mx = 0.f;
      for (int g = lane; g < GROUPS; g += 32)
#pragma unroll
        for (int h = 0; h < WPL; ++h) {
          const uint4 w = *chunk(g, h);
          mx = fmaxf(mx, fmaxf(fmaxf(bf16_absmax2(w.x), bf16_absmax2(w.y)), fmaxf(bf16_absmax2(w.z), bf16_absmax2(w.w))));
        }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, o));
      // mx in [2^k, 2^(k+1)): e = k - 14 keeps mx * 2^-e below 2^15 (bf16's largest finite: e = 113)
      e = mx >= Q_F16_LIMIT ? min(ilogbf(mx), 127) - 14 : 0;
    }
    if constexpr (Cfg::PAIR) __syncthreads();  // the pair's reads of Q are done before it changes
    const float s = pow2(-e);
    auto f16 = [&](uint32_t u) {  // two bf16 -> two fp16, times 2^-e; fp16 as it is
      return BF16 ? Pack2<half>::from(__uint_as_float(u << 16) * s, __uint_as_float(u & 0xFFFF0000u) * s) : u;
    };
    for (int g = writer ? lane : GROUPS; g < GROUPS; g += 32) {
      uint32_t u[4 * WPL];
#pragma unroll
      for (int h = 0; h < WPL; ++h) {
        const uint4 w = *chunk(g, h);
        u[4 * h] = w.x;
        u[4 * h + 1] = w.y;
        u[4 * h + 2] = w.z;
        u[4 * h + 3] = w.w;
      }
#pragma unroll
      for (int h = 0; h < WPL; ++h)  // chunk h: word h of each lane's WPL
        *chunk(g, h) = make_uint4(f16(u[h]), f16(u[WPL + h]), f16(u[2 * WPL + h]), f16(u[3 * WPL + h]));
    }
    if constexpr (Cfg::PAIR) {
      __syncthreads();
    } else {
      __syncwarp();
    }
    return e;
  }

  // P's A fragment of keys 16kk .. 16kk + 15: the C-fragment words of S's n8 tiles 2kk, 2kk + 1
  // (softmax packed them as fp16 pairs).
  static __device__ __forceinline__ void p_frag(const uint32_t (&p)[MQ][S_NT][2], int kk, uint32_t (&a)[MQ][4]) {
#pragma unroll
    for (int mt = 0; mt < MQ; ++mt) {
      a[mt][0] = p[mt][2 * kk][0];
      a[mt][1] = p[mt][2 * kk][1];
      a[mt][2] = p[mt][2 * kk + 1][0];
      a[mt][3] = p[mt][2 * kk + 1][1];
    }
  }

  // Lane offsets of the narrow ring tiles, for pair j of chunks: kv[j % 4] + (j / 4) * 128 (the
  // swizzle touches only a chunk index's low 3 bits). ldmatrix matrix lane / 8 covers rows
  // ((lane / 8) % 2) * 8 .. + 7 of a 16-row group and chunk 2j + lane / 16 (fp8_swz). Q's
  // fragments take the 16-bit tiles' offsets (LdsmOffsetsSm80::q).
  static __device__ __forceinline__ void offsets(int lane, uint32_t (&kv)[4]) {
    const int kvrow = ((lane / 8) % 2) * 8 + lane % 8;
#pragma unroll
    for (int j = 0; j < 4; ++j) kv[j] = (kvrow * KV_CPR + ((2 * j + lane / 16) ^ Cfg::fp8_swz(kvrow))) * CB;
  }
};

}  // namespace pfa
