// Logit transforms of the general prefill kernels (FlashInfer's variants, section 1.2 of the
// semantics notes). Each turns a raw q.k into a logit already in log2 units, so the softmax
// runs with scale 1; the plain path skips this and folds sm_scale * log2(e) into its exp2.
//   soft cap: cap * tanh(sm_scale * x / cap)          (cap acts on the scaled logit)
//   ALiBi:    sm_scale * x + slope[h] * (kv - q_row)  (q_row unshifted, as FlashInfer)
#pragma once
#include "pfa/attention/params.h"
#include "pfa/ptx/math.cuh"

namespace pfa {

constexpr float kLog2e = 1.4426950408889634f;

// sm_scale * log2(e), times the device-side scale when the caller passed one as a tensor
// (PrefillParams::scale_dev: read at launch, so a replayed CUDA graph sees the current value).
__device__ __forceinline__ float logit_scale(const PrefillParams& p) {
  return p.scale_dev != 0 ? p.sm_scale_log2 * *reinterpret_cast<const float*>(p.scale_dev) : p.sm_scale_log2;
}

// The output multiplier: v_scale, times its device-side factor (PrefillParams::v_scale_dev).
__device__ __forceinline__ float output_scale(const PrefillParams& p) {
  return p.v_scale_dev != 0 ? p.v_scale * *reinterpret_cast<const float*>(p.v_scale_dev) : p.v_scale;
}

struct LogitTransform {
  enum Kind { kPlain = 0, kSoftCap = 1, kAlibi = 2 };
  int kind = kPlain;
  float pre = 0.f, post = 0.f, scale = 0.f;

  static __device__ __forceinline__ LogitTransform make(const PrefillParams& p) {
    LogitTransform t;
    t.scale = logit_scale(p);
    if (p.logits_soft_cap > 0.f) {
      t.kind = kSoftCap;
      t.pre = t.scale / kLog2e / p.logits_soft_cap;
      t.post = p.logits_soft_cap * kLog2e;
    } else if (p.alibi_slopes != 0) {
      t.kind = kAlibi;
    }
    return t;
  }

  // tanh(x) = 1 - 2 / (2^(2 x log2 e) + 1): exact at both saturations (inf -> 1, 0 -> -1) and
  // accurate to ~1e-7 absolute, where tanh.approx's ~5e-4 relative error times a cap of 30
  // would move logits by 1e-2.
  static __device__ __forceinline__ float tanh_accurate(float x) {
    // __fdividef: 2 / inf -> 0 (saturates to 1) and ~2 ulp elsewhere, without IEEE division's
    // slow path (which made the soft cap cost half the kernel's throughput).
    return 1.f - __fdividef(2.f, ptx::exp2_approx(2.f * kLog2e * x) + 1.f);
  }

  // slope_log2 = slope * log2(e); dist = kv_idx - q_row.
  __device__ __forceinline__ float apply(float x, float slope_log2, int dist) const {
    if (kind == kSoftCap) return post * tanh_accurate(x * pre);
    return fmaf(slope_log2, static_cast<float>(dist), x * scale);
  }
};

}  // namespace pfa
