// Division by a launch-constant divisor without the integer division the GPU runs in software
// (about 30 dependent instructions, half on the uniform datapath with R2UR round trips, which a
// block's work decode chained several times: ~1.5k cycles a role on its way into each block).
// The host gives each divisor d >= 1 a multiplier and shift (params.fast_divisor: shift =
// ceil(log2 d), mul = floor(2^32 (2^shift - d) / d) + 1, which fits 32 bits); then for every
// 0 <= n < 2^31, n / d = (umulhi(n, mul) + n) >> shift (Granlund and Montgomery's round-up
// method; umulhi(n, mul) <= n keeps the sum inside 32 bits).
#pragma once
#include <stdint.h>

namespace pfa {

__device__ __forceinline__ int fast_div(int n, uint32_t mul, uint32_t shift) {
  return (int)((__umulhi((uint32_t)n, mul) + (uint32_t)n) >> shift);
}

}  // namespace pfa
