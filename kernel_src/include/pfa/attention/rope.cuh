// RoPE of the general prefill kernels: ROPE_LLAMA (rotate-half), applied to Q and K inside the
// kernel in fp32. Element j < D/2 of a row pairs with j + D/2; the angle of pair j at position
// pos is pos * 2^(-2j/D * log2 theta) / rope_scale. Layout-free: a kernel hands over 16-byte
// chunks (8 pairs) from the two halves of a row, wherever its tiles keep them.
#pragma once
#include <math.h>

#include "pfa/attention/params.h"
#include "pfa/common/dtypes.cuh"

namespace pfa {

// sin/cos of a large angle: Cody-Waite reduction to [-pi, pi] (two-constant 2*pi, exact enough
// for |x| up to ~1e6), then the hardware approximations, which are accurate there (~1e-6
// absolute). Plain __sincosf degrades with |x|; sincosf's slow path is several times slower.
__device__ __forceinline__ void fast_sincos(float x, float& sn, float& cs) {
  constexpr float kInv2Pi = 0.15915494309189535f;
  constexpr float k2PiHi = 6.28318548202514648f;  // 2*pi rounded to float
  constexpr float k2PiLo = -1.7484556e-07f;       // 2*pi - k2PiHi
  const float k = rintf(x * kInv2Pi);
  float r = fmaf(-k, k2PiHi, x);
  r = fmaf(-k, k2PiLo, r);
  __sincosf(r, &sn, &cs);
}

// Rotate, in place, the 8 pairs (lo[i], hi[i]) of one row at position `pos`: lo holds head
// dims 8c .. 8c+7, hi the same dims + HEAD_DIM/2.
template <int HEAD_DIM, typename T>
__device__ __forceinline__ void rope_rotate_chunk(uint4& lo, uint4& hi, int c, float pos, const PrefillParams& p) {
  T* l = reinterpret_cast<T*>(&lo);
  T* h = reinterpret_cast<T*>(&hi);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float inv_freq = exp2f(-(2.f * (c * 8 + i) / HEAD_DIM) * p.rope_log2_theta) * p.rope_rcp_scale;
    float sn, cs;
    fast_sincos(pos * inv_freq, sn, cs);
    const float x0 = to_float(l[i]), x1 = to_float(h[i]);
    l[i] = from_float<T>(x0 * cs - x1 * sn);
    h[i] = from_float<T>(x1 * cs + x0 * sn);
  }
}

}  // namespace pfa
