// Scalar math instructions shared by every kernel family (no warp-level layout involved).
#pragma once

namespace pfa::ptx {

// 2^x, MUFU.EX2 with flush-to-zero: the softmax runs in the log2 domain so that this is its
// only transcendental.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace pfa::ptx
