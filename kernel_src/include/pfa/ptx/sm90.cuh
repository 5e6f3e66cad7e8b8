// Thin named wrappers over the sm_90 / sm_90a PTX the Hopper prefill family uses beside wgmma
// (wgmma.cuh): mbarriers (init, arrive, parity wait, cp.async completion arrivals), the
// generic -> async proxy fence, setmaxnreg, stmatrix, and the wgmma shared-memory matrix descriptor.
#pragma once
#include <stdint.h>

namespace pfa::ptx {

// ---- mbarrier ----
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the other threads (and the async proxy) before use.
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.release.cta.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}

// `count` arrivals at once (one thread standing in for others that have nothing to add).
__device__ __forceinline__ void mbar_arrive_count(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// One arrival that also announces `bytes` of asynchronous (TMA) transfers the phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Block until the barrier's phase of parity `parity` has completed (a fresh barrier counts its
// previous phase, parity 1, as complete).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Whether the barrier's phase of parity `parity` has completed, without waiting (mbar_wait's test).
__device__ __forceinline__ bool mbar_test(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.test_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// One arrival on `bar` once every cp.async this thread issued so far has landed (.noinc: the
// arrival is one of the count the barrier was initialised with).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// L2 eviction policies (createpolicy) for the cache-hinted copies below: K/V tiles are re-read by
// every row tile of their head, so they should outlive streaming data (Q, outputs) in L2.
__device__ __forceinline__ uint64_t l2_evict_last() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ uint64_t l2_evict_first() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}

// 16-byte cp.async (as cp_async_16: src_bytes 0 zero-fills) under an L2 eviction policy.
__device__ __forceinline__ void cp_async_16_hint(uint32_t dst, const void* src, bool valid, uint64_t policy) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes), "l"(policy));
}

// Orders this thread's generic-proxy shared-memory accesses (cp.async and ordinary stores are
// generic) before later async-proxy accesses (wgmma operand reads, TMA).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Sixteen zero bytes at a shared-memory address (the TMA producer's zeroed tail rows).
__device__ __forceinline__ void st_shared_zero16(uint32_t addr) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0) : "memory");
}

// Sixteen bytes at a shared-memory address, loaded / stored (the fp8-K/V producer's widening).
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// One 32-bit word at a shared-memory address, stored / loaded (the tile scheduler's index slots).
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

// A flag between CTAs (stream-K's hand-off, sm90/stream_k.cuh): a release store after the writer's
// data, an acquire load before the reader's, both at GPU scope.
__device__ __forceinline__ void st_release_gpu(int* addr, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_acquire_gpu(const int* addr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(addr) : "memory");
  return v;
}

// Arrive on named barrier `id` without waiting (the threads that bar.sync on it wait for
// `threads` arrivals in all). Barrier 0 is __syncthreads'.
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- TMA (the bulk tensor copy engine) ----
// A 3-D tile of the tensor map at `tmap` (a kernel-parameter CUtensorMap) at coordinates
// (c0 innermost, c1, c2) into shared memory at `dst`, completing `bar`'s transaction bytes.
// Elements outside the tensor arrive as zeros.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* tmap, int c0, int c1, int c2, uint32_t bar,
                                            uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint "
      "[%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
      "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "l"(policy)
      : "memory");
}

// The same over a 4-D tensor map (paged K/V: column, page slot, head, page).
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* tmap, int c0, int c1, int c2, int c3,
                                            uint32_t bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint "
      "[%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(dst),
      "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "l"(policy)
      : "memory");
}

// ---- stmatrix (sm_90): four 8 x 8 matrices of b16 from registers to shared memory ----
// Register q of lane l holds elements (row l / 4, columns 2 * (l % 4) and + 1) of matrix q, as
// ldmatrix_x4 delivers them; .trans stores element (r, c) as b16 number r of memory row c, and
// memory row c of matrix q goes to the 16-byte-aligned address lane 8 * q + c passes.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// ---- register reallocation between warpgroups (the kernel needs __launch_bounds__(T, 1)) ----
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

// ---- wgmma shared-memory matrix descriptor ----
// bits 0-13 start address >> 4, 16-29 leading byte offset >> 4, 32-45 stride byte offset >> 4,
// 62-63 swizzle (1 = 128-byte). Tiles are 1024-byte aligned, so the base offset (49-51) is 0.
// With the 128-byte swizzle a tile is stored as column blocks of 64 16-bit elements: each row of
// a block is 128 bytes, its 16-byte chunk c at position c ^ (row % 8), and 8 rows make a
// 1024-byte atom.
//  K-major (Q, K as read by S = Q K^T): lbo unused, sbo = 1024 (next 8 rows); a k-step of 16
//    elements moves the start by 32 bytes inside the block.
//  MN-major (V as read by O += P V, transposed): lbo = bytes between column blocks (the next
//    64 columns of N), sbo = 1024 (next 8 keys); a k-step of 16 keys moves the start 2048 bytes.
constexpr uint64_t kSwizzle128 = 1ull << 62;
// The descriptor in two words, for the k-steps of one tile: the low word of its base
// (smem_desc_lo: start address and leading byte offset) plus a k-step's byte offset / 16, the
// high word (smem_desc_hi: stride byte offset and swizzle) a constant. The start-address field
// (bits 0-13) holds any shared-window address / 16 (below 2^18 bytes), so an offset within the
// CTA's shared memory never carries out of it; addresses and offsets are 16-byte multiples.
// One integer add a wgmma, where the whole descriptor's shifts and masks for every k-step took
// five or six instructions.
__device__ __forceinline__ uint32_t smem_desc_lo(uint32_t addr, uint32_t lbo) {
  return ((addr >> 4) & 0x3FFF) | (((lbo >> 4) & 0x3FFF) << 16);
}
constexpr uint32_t smem_desc_hi(uint32_t sbo) { return (uint32_t)(kSwizzle128 >> 32) | ((sbo >> 4) & 0x3FFF); }
__device__ __forceinline__ uint64_t smem_desc_at(uint32_t lo, uint32_t offset, uint32_t hi) {
  return ((uint64_t)hi << 32) | (uint64_t)(lo + (offset >> 4));
}

}  // namespace pfa::ptx
