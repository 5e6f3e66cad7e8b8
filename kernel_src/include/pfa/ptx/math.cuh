// Scalar math instructions shared by every kernel family (no warp-level layout involved).
#pragma once
#include <stdint.h>

namespace pfa::ptx {

// 2^x, MUFU.EX2 with flush-to-zero: the softmax runs in the log2 domain so that this is its
// only transcendental.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1/x, MUFU.RCP with flush-to-zero (about 1 ulp): no IEEE slow path, whose subroutine call would
// cost registers where it is inlined.
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// prmt.b32, default mode: byte n of the result is byte (sel >> 4n) & 7 of {b, a} (a = bytes
// 0-3), or, where bit 3 of that selector nibble is set, the sign bit of that byte replicated
// (0x00 / 0xFF). __byte_perm is documented without the replication, hence the inline PTX.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

}  // namespace pfa::ptx
