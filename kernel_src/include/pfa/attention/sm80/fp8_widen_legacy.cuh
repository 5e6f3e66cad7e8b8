// A/B hook, not a kernel path: the fp8 widening as it was before the sign-replicating form of
// common/dtypes.cuh (one loop for both formats, the format a runtime value). Only the
// `make TUNE=1` rows with legacy_widen (variants.py) define PFA_FP8_WIDEN_LEGACY and include it,
// so build_tools/ab_decode.py --switch tile can time old against new in one run. Delete this file
// and those rows once the comparison has been recorded in NOTES.md.
#pragma once
#include "pfa/common/dtypes.cuh"

namespace pfa {

template <typename T>
__device__ __forceinline__ uint2 widen_fp8x4_legacy(uint32_t x, int fmt);
template <>
__device__ __forceinline__ uint2 widen_fp8x4_legacy<half>(uint32_t x, int fmt) {
  uint32_t u[2] = {__byte_perm(x, 0u, 0x1404), __byte_perm(x, 0u, 0x3424)};  // byte b -> lane bits 15..8
  if (fmt == kFp8E5M2) return make_uint2(u[0], u[1]);  // e5m2 is the top byte of an fp16
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t h = (u[i] & 0x80008000u) | ((u[i] >> 1) & 0x3F803F80u);  // e4m3 fields at fp16's, bias 7
    half2 v = __hmul2(*reinterpret_cast<const half2*>(&h), __halves2half2(__ushort_as_half(0x5C00),
                                                                         __ushort_as_half(0x5C00)));  // * 2^8
    u[i] = *reinterpret_cast<uint32_t*>(&v);
  }
  return make_uint2(u[0], u[1]);
}
template <>
__device__ __forceinline__ uint2 widen_fp8x4_legacy<__nv_bfloat16>(uint32_t x, int fmt) {
  uint32_t u[2] = {__byte_perm(x, 0u, 0x1404), __byte_perm(x, 0u, 0x3424)};
  // e4m3 (bias 7): fields at bf16's, then * 2^120; e5m2 (bias 15): fields at bf16's, then * 2^112.
  const bool e4 = fmt != kFp8E5M2;
  const int shift = e4 ? 4 : 3;
  const uint32_t field = e4 ? 0x07F007F0u : 0x0FE00FE0u;
  const unsigned short rebase = e4 ? 0x7B80 : 0x7780;
  const __nv_bfloat162 k = __halves2bfloat162(__ushort_as_bfloat16(rebase), __ushort_as_bfloat16(rebase));
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t b = (u[i] & 0x80008000u) | ((u[i] >> shift) & field);
    __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&b), k);
    u[i] = *reinterpret_cast<uint32_t*>(&v);
  }
  return make_uint2(u[0], u[1]);
}

}  // namespace pfa
