// 16-bit element types, the K/V storage types (fp8, NVFP4), the output formats, and the
// conversions the kernels need.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "pfa/ptx/math.cuh"

namespace pfa {

template <typename T>
struct Pack2;  // two fp32 values -> one 32-bit register of two 16-bit elements (low = first)
template <>
struct Pack2<half> {
  static __device__ __forceinline__ uint32_t from(float a, float b) {
    half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
template <>
struct Pack2<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t from(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ half from_float<half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float to_float(half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// One-byte K/V storage (e4m3fn or e5m2: which one is a runtime field, PrefillParams::kv_fp8).
struct fp8_storage {
  uint8_t bits;
};
enum Fp8Format : int { kFp8E4M3 = 1, kFp8E5M2 = 2 };

// Four fp8 values (bytes of x, first in the low byte) -> four T values as two packed pairs,
// exactly (every e4m3/e5m2 value is representable in fp16 and in bf16). Bit moves only: prmt
// puts each byte b in a 16-bit lane as (sign(b) ? 0xFF : 0x00) << 8 | b, one shift of the word
// slides b's exponent+mantissa bits into the target format's fields with a sign copy landing on
// bit 15, one mask drops the other sign copies (and what the low lane shifted into the high
// one), and one packed multiply by 2^(target bias - source bias) rebases the exponent
// (subnormals included, since the multiply normalises them). On sm_89+ fp16 takes the hardware
// conversion instead. fp8 Inf/NaN encodings are not preserved (as FlashInfer's fast
// dequantisation): a KV cache never holds them.
__device__ __forceinline__ uint2 fp8x4_sign_lanes(uint32_t x) {
  return make_uint2(ptx::prmt(x, 0u, 0x9180), ptx::prmt(x, 0u, 0xB3A2));  // bytes 0, 1 | bytes 2, 3
}
// FMT: kFp8E4M3 or kFp8E5M2 (callers branch on PrefillParams::kv_fp8 once, outside their loop).
template <typename T, int FMT>
__device__ __forceinline__ uint2 widen_fp8x4(uint32_t x);
template <>
__device__ __forceinline__ uint2 widen_fp8x4<half, kFp8E5M2>(uint32_t x) {
  // e5m2 is the top byte of an fp16
  return make_uint2(__byte_perm(x, 0u, 0x1404), __byte_perm(x, 0u, 0x3424));
}
template <>
__device__ __forceinline__ uint2 widen_fp8x4<half, kFp8E4M3>(uint32_t x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x & 0xFFFFu), __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x >> 16), __NV_E4M3);
  return make_uint2(static_cast<uint32_t>(lo.x) | static_cast<uint32_t>(lo.y) << 16,
                    static_cast<uint32_t>(hi.x) | static_cast<uint32_t>(hi.y) << 16);
#else
  const uint2 l = fp8x4_sign_lanes(x);
  uint32_t u[2] = {l.x, l.y};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t h = (u[i] << 7) & 0xBF80BF80u;  // e4m3 fields at fp16's (bias 7), then * 2^8
    half2 v = __hmul2(*reinterpret_cast<const half2*>(&h), __halves2half2(__ushort_as_half(0x5C00),
                                                                         __ushort_as_half(0x5C00)));
    u[i] = *reinterpret_cast<uint32_t*>(&v);
  }
  return make_uint2(u[0], u[1]);
#endif
}
template <int FMT>
__device__ __forceinline__ uint2 widen_fp8x4_bf16(uint32_t x) {
  // e4m3 (bias 7): fields at bf16's (shift 4), then * 2^120; e5m2 (bias 15): shift 5, * 2^112.
  constexpr bool E4 = FMT == kFp8E4M3;
  constexpr int SHIFT = E4 ? 4 : 5;
  constexpr uint32_t KEEP = E4 ? 0x87F087F0u : 0x8FE08FE0u;
  const unsigned short rebase = E4 ? 0x7B80 : 0x7780;
  const __nv_bfloat162 k = __halves2bfloat162(__ushort_as_bfloat16(rebase), __ushort_as_bfloat16(rebase));
  const uint2 l = fp8x4_sign_lanes(x);
  uint32_t u[2] = {l.x, l.y};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t b = (u[i] << SHIFT) & KEEP;
    __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&b), k);
    u[i] = *reinterpret_cast<uint32_t*>(&v);
  }
  return make_uint2(u[0], u[1]);
}
template <>
__device__ __forceinline__ uint2 widen_fp8x4<__nv_bfloat16, kFp8E4M3>(uint32_t x) {
  return widen_fp8x4_bf16<kFp8E4M3>(x);
}
template <>
__device__ __forceinline__ uint2 widen_fp8x4<__nv_bfloat16, kFp8E5M2>(uint32_t x) {
  return widen_fp8x4_bf16<kFp8E5M2>(x);
}

// NVFP4 K/V storage (the kv_dtype=nvfp4 kernels): each byte holds two e2m1 codes, the even
// (first) element in the low nibble; every 16 consecutive head-dim elements of a row share one
// float8_e4m3fn block scale, kept in a tensor of their own (PrefillParams::k_sf / v_sf). The
// global scale of the quantisation is folded into the logit scale (K) and the output scale (V).
struct nvfp4_storage {
  uint8_t bits;
};
template <typename KV>
struct KvStorage {
  static constexpr bool NVFP4 = false;
};
template <>
struct KvStorage<nvfp4_storage> {
  static constexpr bool NVFP4 = true;
};

// A word whose two 16-bit lanes each hold an e4m3 value in their top byte -> the two values in
// T, exactly (the e4m3 case of widen_fp8x4, for the NVFP4 block scales).
template <typename T>
__device__ __forceinline__ uint32_t e4m3_lanes_to(uint32_t u);
template <>
__device__ __forceinline__ uint32_t e4m3_lanes_to<half>(uint32_t u) {
  const uint32_t h = (u & 0x80008000u) | ((u >> 1) & 0x3F803F80u);  // e4m3 fields at fp16's, bias 7
  half2 v = __hmul2(*reinterpret_cast<const half2*>(&h),
                    __halves2half2(__ushort_as_half(0x5C00), __ushort_as_half(0x5C00)));  // * 2^8
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t e4m3_lanes_to<__nv_bfloat16>(uint32_t u) {
  const uint32_t b = (u & 0x80008000u) | ((u >> 4) & 0x07F007F0u);  // e4m3 fields at bf16's, bias 7
  const __nv_bfloat16 k = __ushort_as_bfloat16(0x7B80);  // 2^120
  __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&b), __halves2bfloat162(k, k));
  return *reinterpret_cast<uint32_t*>(&v);
}

// Two e4m3 values (bytes 0 and 1 of x) -> a packed fp16 pair, byte 0 in the low half, exactly:
// the hardware conversion on sm_89+.
__device__ __forceinline__ uint32_t e4m3x2_to_half2(uint32_t x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x & 0xFFFFu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | static_cast<uint32_t>(h.y) << 16;
#else
  return e4m3_lanes_to<half>(__byte_perm(x, 0u, 0x1404));
#endif
}

// Two e4m3 block scales (bytes 0 and 1 of x) -> each as a packed pair of T (both lanes the same
// scale), the multiplier of its block's code pairs.
template <typename T>
__device__ __forceinline__ uint2 nvfp4_scale_pairs(uint32_t x) {
  return make_uint2(e4m3_lanes_to<T>(__byte_perm(x, 0u, 0x0404)), e4m3_lanes_to<T>(__byte_perm(x, 0u, 0x1414)));
}

// Eight e2m1 codes (the nibbles of x, element 0 in the low one) times their block scale
// (`scale`: a packed pair of T, both lanes the scale) -> eight T values as four packed pairs,
// element 0 in the low half of the first word. Exact: an e2m1 value (2 significant bits) times
// an e4m3 scale (4) needs 5 bits, within 2^-10 .. 2688, which fp16 and bf16 both hold.
// The code's magnitude (its low 3 bits) indexes an 8-entry table of its T encoding with one
// byte permute per four codes (fp16: only the high byte is nonzero; bf16: a high- and a
// low-byte table); its sign (bit 3) is spread to the high bytes by a sign-replicating permute.
// Negative codes, -0 included, keep their sign.
// Eight e2m1 codes (the nibbles of x) -> the high bytes of their fp16 encodings (the low bytes
// are 0), sign included: codes 0-3 in the bytes of a, 4-7 in those of b.
__device__ __forceinline__ void fp4x8_f16_high_bytes(uint32_t x, uint32_t& a, uint32_t& b) {
  // fp16 high bytes of 0, .5, 1, 1.5 and 2, 3, 4, 6
  constexpr uint32_t HI_0_3 = 0x3E3C3800u, HI_4_7 = 0x46444240u;
  const uint32_t mag = x & 0x77777777u, y = x << 4;  // y: the even codes' signs at the byte tops
  a = __byte_perm(HI_0_3, HI_4_7, mag) | (ptx::prmt(x, y, 0x9D8C) & 0x80808080u);        // codes 0-3
  b = __byte_perm(HI_0_3, HI_4_7, mag >> 16) | (ptx::prmt(x, y, 0xBFAE) & 0x80808080u);  // 4-7
}
template <typename T>
__device__ __forceinline__ uint4 widen_fp4x8(uint32_t x, uint32_t scale);
template <>
__device__ __forceinline__ uint4 widen_fp4x8<half>(uint32_t x, uint32_t scale) {
  uint32_t a, b;
  fp4x8_f16_high_bytes(x, a, b);
  const half2 s = *reinterpret_cast<const half2*>(&scale);
  uint32_t w[4] = {__byte_perm(a, 0u, 0x1404), __byte_perm(a, 0u, 0x3424), __byte_perm(b, 0u, 0x1404),
                   __byte_perm(b, 0u, 0x3424)};  // each code's byte to the top of its 16-bit lane
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    half2 v = __hmul2(*reinterpret_cast<const half2*>(&w[i]), s);
    w[i] = *reinterpret_cast<uint32_t*>(&v);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}
template <>
__device__ __forceinline__ uint4 widen_fp4x8<__nv_bfloat16>(uint32_t x, uint32_t scale) {
  // bf16 encodings of 0, .5, 1, 1.5, 2, 3, 4, 6: 0000 3F00 3F80 3FC0 4000 4040 4080 40C0
  constexpr uint32_t HI_0_3 = 0x3F3F3F00u, HI_4_7 = 0x40404040u, LO_0_3 = 0xC0800000u, LO_4_7 = 0xC0804000u;
  const uint32_t mag = x & 0x77777777u, y = x << 4;
  const uint32_t ha = __byte_perm(HI_0_3, HI_4_7, mag) | (ptx::prmt(x, y, 0x9D8C) & 0x80808080u);  // codes 0-3
  const uint32_t hb = __byte_perm(HI_0_3, HI_4_7, mag >> 16) | (ptx::prmt(x, y, 0xBFAE) & 0x80808080u);  // 4-7
  const uint32_t la = __byte_perm(LO_0_3, LO_4_7, mag), lb = __byte_perm(LO_0_3, LO_4_7, mag >> 16);
  const __nv_bfloat162 s = *reinterpret_cast<const __nv_bfloat162*>(&scale);
  uint32_t w[4] = {__byte_perm(la, ha, 0x5140), __byte_perm(la, ha, 0x7362), __byte_perm(lb, hb, 0x5140),
                   __byte_perm(lb, hb, 0x7362)};  // (low byte, high byte) of each code's lane
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]), s);
    w[i] = *reinterpret_cast<uint32_t*>(&v);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The output's element format (PrefillParams / MergeParams::o_format). A runtime field rather
// than kernel variants: only the stores that write a finished row look at it, so every kernel
// writes every format without one more instantiation per output dtype.
// kOutNvfp4: e2m1 code pairs with e4m3 block scales (pfa/attention/nvfp4_out.cuh), written only by
// the kernels that compile it in (the host routes that format there).
enum OutFormat : int { kOutElem = 0, kOutOther16 = 1, kOutE4M3 = 2, kOutNvfp4 = 3 };

template <typename T>
struct Other16;  // the other 16-bit type: fp16 <-> bf16
template <>
struct Other16<half> {
  using type = __nv_bfloat16;
};
template <>
struct Other16<__nv_bfloat16> {
  using type = half;
};

// Two fp32 values in output format fmt (first in the low bits): two 16-bit elements, or two
// e4m3 bytes in the low half. e4m3 saturates to +-448 and rounds to nearest even, like
// FlashInfer's fp8 outputs (one cvt instruction on sm_89+, emulated on sm_80).
template <typename T>
__device__ __forceinline__ uint32_t pack_out2(float a, float b, int fmt) {
  if (fmt == kOutE4M3) return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  if (fmt == kOutOther16) return Pack2<typename Other16<T>::type>::from(a, b);
  return Pack2<T>::from(a, b);
}

// Eight e4m3 values staged as pack_out2 words (two bytes in the low half of each 32-bit word)
// -> eight contiguous bytes.
__device__ __forceinline__ uint2 compact_fp8x8(uint4 staged) {
  return make_uint2(__byte_perm(staged.x, staged.y, 0x5410), __byte_perm(staged.z, staged.w, 0x5410));
}

}  // namespace pfa
