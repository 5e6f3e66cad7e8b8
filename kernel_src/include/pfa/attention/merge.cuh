// Merge split-KV partial states: o = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse),
// lse = max + log2(sum w). All-(-inf) rows (no key anywhere) give o = 0, lse = -inf, never NaN.
#pragma once
#include <math.h>

#include "pfa/attention/params.h"
#include "pfa/common/dtypes.cuh"

namespace pfa {

template <typename T>
struct MergeStates {
  static constexpr int WARPS = 4;
  // One warp per (row, head); each lane owns 4 consecutive columns per 128-column stripe.
  static __device__ __forceinline__ void run(const MergeParams& p) {
    const int lane = threadIdx.x % 32;
    const int64_t pair = (int64_t)blockIdx.x * WARPS + threadIdx.x / 32;
    const int64_t pairs = (int64_t)p.rows * p.num_heads;
    if (pair >= pairs) return;
    const float* lp = reinterpret_cast<const float*>(p.lse_partial);
    const float* op = reinterpret_cast<const float*>(p.o_partial);
    const int row = pair / p.num_heads, head = pair % p.num_heads;
    // Partial state s of this (row, head) lives at index first + s * stride (in (row, head) units).
    int64_t first = pair, stride = pairs;
    int count = p.num_splits;
    if (p.merge_indptr != 0) {
      const int32_t* mi = reinterpret_cast<const int32_t*>(p.merge_indptr);
      count = mi[row + 1] - mi[row];
      if (count == 0) return;  // this row's request was not split: the attention kernel wrote it
      first = (int64_t)mi[row] * p.num_heads + head;
      stride = p.num_heads;
    }

    float mx = -INFINITY;
    for (int s = 0; s < count; ++s) mx = fmaxf(mx, lp[first + s * stride]);
    const float m_use = mx == -INFINITY ? 0.f : mx;
    float denom = 0.f;
    for (int s = 0; s < count; ++s) denom += exp2f(lp[first + s * stride] - m_use);
    const float inv = denom > 0.f ? 1.f / denom : 0.f;

    T* out = reinterpret_cast<T*>(p.o) + row * p.o_stride_n + head * p.o_stride_h;
    for (int c = lane * 4; c < p.head_dim; c += 128) {
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int s = 0; s < count; ++s) {
        const float w = exp2f(lp[first + s * stride] - m_use);
        const float4 v = *reinterpret_cast<const float4*>(op + (first + s * stride) * p.head_dim + c);
        acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w;
      }
      uint2 packed;
      packed.x = Pack2<T>::from(acc.x * inv, acc.y * inv);
      packed.y = Pack2<T>::from(acc.z * inv, acc.w * inv);
      *reinterpret_cast<uint2*>(out + c) = packed;
    }
    if (p.lse != 0 && lane == 0)
      reinterpret_cast<float*>(p.lse)[(int64_t)row * p.num_heads + head] = denom > 0.f ? (m_use + log2f(denom)) * p.lse_scale : -INFINITY;
  }
};

}  // namespace pfa

#define PFA_DEFINE_MERGE(NAME, T)                                                         \
  extern "C" __global__ void __launch_bounds__(pfa::MergeStates<T>::WARPS * 32)          \
      NAME(const __grid_constant__ pfa::MergeParams p) {                                  \
    pfa::MergeStates<T>::run(p);                                                          \
  }
