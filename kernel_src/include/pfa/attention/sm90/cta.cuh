// The warp-specialised CTA both sm_90a prefills (16-bit: prefill_sm90.cuh, fp8:
// prefill_sm90_fp8.cuh) run: the work item, the mbarrier ring, then warpgroup 0 produces (with
// its registers given up to the consumers) and warpgroups 1..CONSUMERS consume.
#pragma once
#include <stdint.h>

#include "pfa/attention/params.h"
#include "pfa/attention/sm90/producer.cuh"
#include "pfa/attention/work.cuh"
#include "pfa/ptx/pdl.cuh"
#include "pfa/ptx/sm90.cuh"

namespace pfa {

// produce(w, base, tid): the producer warpgroup; consume(w, base, wg, tid): consumer wg (0 ..
// CONSUMERS - 1), tid its thread within the warpgroup. base: the shared window's address of
// the dynamic shared memory, rounded up to the swizzle atom.
template <class Cfg, class Produce, class Consume>
__device__ __forceinline__ void run_warp_specialized_cta(const PrefillParams& p, char* smem, Produce produce,
                                                         Consume consume) {
  // As the sm80 kernel: the merge may launch early; nothing is read before the grid ahead is done.
  ptx::allow_dependents();
  ptx::wait_prior_grids();
  const uint32_t base = (ptx::smem_u32(smem) + Cfg::ATOM_BYTES - 1) & ~(uint32_t)(Cfg::ATOM_BYTES - 1);
  PrefillWork w;
  // Honours rows_fastest (a head's row tiles together, its K/V shared in L2): the register it
  // costs is no constraint here.
  if (!decode_work<Cfg::BLOCK_M, Cfg::BLOCK_N, Cfg::PAGED, false, true>(p, w)) return;
  const int tid = threadIdx.x, wg = tid / Cfg::WG_THREADS;
  if (tid == 0) init_ring_barriers<Cfg>(base);
  __syncthreads();
  if (wg == 0) {
    ptx::setmaxnreg_dec<Cfg::PRODUCER_REGS>();
    produce(w, base, tid);
  } else {
    ptx::setmaxnreg_inc<Cfg::CONSUMER_REGS>();
    consume(w, base, wg - 1, tid % Cfg::WG_THREADS);
  }
}

}  // namespace pfa
