// Which mbarrier hand-offs compute-sanitizer's racecheck understands (a diagnostic, not built by
// make). A producer warp fills a 512-byte shared buffer (mode bit 0: cp.async +
// cp.async.mbarrier.arrive, or st.shared + mbarrier.arrive) and a consumer warp waits on the full
// barrier, reads the buffer by ldmatrix and frees it (mode bit 1: every lane arrives on the empty
// barrier, or __syncwarp and lane 0 alone), 64 rounds. Both forms are ordered by the PTX memory
// model; racecheck (CUDA 13.0, H100) reports hazards for syncwarp + one arrival (modes 0, 1) and
// none when each reading thread arrives itself (modes 2, 3). Hence the sm90 consumers' q_empty
// arrival by every thread (ConsumerSm90::release_q; NOTES.md, session 24).
//   nvcc -std=c++17 -O3 -Ikernel_src/include -gencode=arch=compute_90a,code=sm_90a \
//        build_tools/racecheck_probe.cu -o /tmp/racecheck_probe
//   for m in 0 1 2 3; do compute-sanitizer --tool racecheck /tmp/racecheck_probe $m; done
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include "pfa/ptx/sm90.cuh"
#include "pfa/ptx/mma_sm80.cuh"
using namespace pfa::ptx;
__global__ void probe(const uint4* src, uint32_t* out, int mode, int rounds) {
  __shared__ alignas(128) uint8_t buf[512];
  __shared__ alignas(8) uint64_t bars[2];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const uint32_t b = (uint32_t)__cvta_generic_to_shared(buf);
  const uint32_t full = (uint32_t)__cvta_generic_to_shared(&bars[0]), empty = full + 8;
  const bool all_arrive = mode & 2;
  if (threadIdx.x == 0) { mbar_init(full, 32); mbar_init(empty, all_arrive ? 32 : 1); mbar_fence_init(); }
  __syncthreads();
  uint32_t acc = 0;
  for (int r = 0; r < rounds; ++r) {
    if (warp == 0) {
      mbar_wait(empty, (r & 1) ^ 1);
      if (mode & 1) {  // st.shared + release arrive
        uint4 v = src[(r * 32 + lane) % 1024];
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(b + lane * 16), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
        mbar_arrive(full);
      } else {
        cp_async_16_hint(b + lane * 16, src + (r * 32 + lane) % 1024, true, l2_evict_last());
        cp_async_mbar_arrive(full);
      }
    } else {
      mbar_wait(full, r & 1);
      uint32_t x[4];
      ldmatrix_x4(x, b + lane * 16);
      acc += x[0] ^ x[1] ^ x[2] ^ x[3];
      if (all_arrive) mbar_arrive(empty);
      else { __syncwarp(); if (lane == 0) mbar_arrive(empty); }
    }
  }
  if (warp == 0) asm volatile("cp.async.wait_all;\n" ::: "memory");
  out[threadIdx.x] = acc;
}
int main(int argc, char** argv) {
  const int m0 = argc > 1 ? atoi(argv[1]) : 0, m1 = argc > 1 ? m0 + 1 : 4;
  uint4* src; uint32_t* out;
  cudaMalloc(&src, 1024 * 16); cudaMemset(src, 1, 1024 * 16); cudaMalloc(&out, 64 * 4);
  for (int mode = m0; mode < m1; ++mode) {
    probe<<<1, 64>>>(src, out, mode, 64);
    cudaError_t e = cudaDeviceSynchronize();
    printf("mode %d (%s, %s): %s\n", mode, mode & 1 ? "st.shared+arrive" : "cp.async+cp.async.mbarrier.arrive",
           mode & 2 ? "32 arrivals" : "syncwarp+1 arrival", cudaGetErrorString(e));
    fflush(stdout);
  }
  return 0;
}
