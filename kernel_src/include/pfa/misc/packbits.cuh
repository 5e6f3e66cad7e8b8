// Pack 1-byte truth values into bits, one output byte per thread (FlashInfer's packbits /
// segment_packbits on device arrays). Segments start on byte boundaries in the output; a
// segment's last byte is zero-padded. Bit order: little = element 8*j + i goes to bit i.
#pragma once
#include <stdint.h>

#include "pfa/attention/params.h"

namespace pfa {

struct Packbits {
  static constexpr int THREADS = 256;

  // Grid (ceil(max segment bytes / THREADS), num_segments).
  static __device__ __forceinline__ void run(const PackbitsParams& p) {
    const int seg = blockIdx.y;
    int64_t in_begin = 0, in_end = p.n, out_begin = 0;
    if (p.in_indptr != 0) {
      const int32_t* ii = reinterpret_cast<const int32_t*>(p.in_indptr);
      const int32_t* oi = reinterpret_cast<const int32_t*>(p.out_indptr);
      in_begin = ii[seg];
      in_end = ii[seg + 1];
      out_begin = oi[seg];
    }
    const int64_t byte = (int64_t)blockIdx.x * THREADS + threadIdx.x;
    const int64_t first = in_begin + byte * 8;
    if (first >= in_end) return;
    const uint8_t* x = reinterpret_cast<const uint8_t*>(p.x);
    uint32_t v = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int64_t e = first + i;
      const uint32_t bit = (e < in_end && x[e] != 0) ? 1u : 0u;
      v |= bit << (p.little ? i : 7 - i);
    }
    reinterpret_cast<uint8_t*>(p.y)[out_begin + byte] = static_cast<uint8_t>(v);
  }
};

}  // namespace pfa

#define PFA_DEFINE_PACKBITS(NAME)                                                    \
  extern "C" __global__ void __launch_bounds__(pfa::Packbits::THREADS)              \
      NAME(const __grid_constant__ pfa::PackbitsParams p) {                          \
    pfa::Packbits::run(p);                                                           \
  }
