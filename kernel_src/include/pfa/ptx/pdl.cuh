// Programmatic dependent launch (sm_90+): a kernel launched with programmatic stream
// serialization may start while the kernel before it on the stream is still running.
// wait_prior_grids() blocks until that kernel has completed and its writes are visible: call it
// before reading anything it produced. allow_dependents() lets the next kernel (if launched
// that way) start early; it has to wait_prior_grids() itself. Both are no-ops without such a
// launch, and compile to nothing before sm_90.
#pragma once

namespace pfa::ptx {

__device__ __forceinline__ void wait_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace pfa::ptx
