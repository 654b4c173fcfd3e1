// Bulk asynchronous copies between global and shared memory (Hopper's TMA engine, PTX
// cp.async.bulk, sm_90 and later) and the shared-memory barriers that track them (mbarrier).
// One thread issues a whole row (up to ~1 MB) as one instruction and no thread holds its bytes
// in registers: the staged fused kernel (fused_staged.cuh) keeps a token's rows in flight
// this way. Addresses and sizes must be multiples of 16 bytes (the host checks: launch.py,
// fused_staged_applies). Built for older architectures these compile to nothing; no launch picks
// the kernels that use them there (the host asks for compute capability 9.x).
#pragma once

namespace cupyrope {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CUPYROPE_BULK_COPY 1
#else
#define CUPYROPE_BULK_COPY 0
#endif

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// A barrier whose phase completes after `count` arrivals (and every byte it was told to expect).
__device__ __forceinline__ void barrier_init(unsigned long long* bar, unsigned count) {
#if CUPYROPE_BULK_COPY
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(count)
               : "memory");
#endif
}

// Makes the initialised barriers visible to the bulk-copy engine (then a block barrier for the
// threads).
__device__ __forceinline__ void barrier_init_fence() {
#if CUPYROPE_BULK_COPY
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// One arrival that also tells the barrier `bytes` more will land by bulk copies in this phase.
__device__ __forceinline__ void barrier_arrive_expecting(unsigned long long* bar, unsigned bytes) {
#if CUPYROPE_BULK_COPY
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                   shared_address(bar)),
               "r"(bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void barrier_arrive(unsigned long long* bar) {
#if CUPYROPE_BULK_COPY
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
#endif
}

// Waits until the phase of parity `parity` completed (the barrier's phases alternate 0, 1, ...).
__device__ __forceinline__ void barrier_wait(unsigned long long* bar, unsigned parity) {
#if CUPYROPE_BULK_COPY
  unsigned done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
  } while (!done);
#endif
}

// `bytes` from global `src` into shared `dst`; `bar` counts them in on arrival.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes,
                                          unsigned long long* bar) {
#if CUPYROPE_BULK_COPY
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar))
      : "memory");
#endif
}

// `bytes` from shared `src` to global `dst`, in the issuing thread's current bulk group.
__device__ __forceinline__ void bulk_store(void* dst, const void* src, unsigned bytes) {
#if CUPYROPE_BULK_COPY
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(shared_address(src)), "r"(bytes)
               : "memory");
#endif
}

// Closes the issuing thread's current bulk group (the stores since the last commit).
__device__ __forceinline__ void bulk_commit() {
#if CUPYROPE_BULK_COPY
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#endif
}

// Waits until every committed group of the issuing thread has read its shared memory (which
// may then be overwritten; the global writes may still be under way), or with WRITES until each
// is complete, writes included.
template <bool WRITES>
__device__ __forceinline__ void bulk_wait() {
#if CUPYROPE_BULK_COPY
  if constexpr (WRITES) {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  } else {
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  }
#endif
}

// Orders this thread's ordinary shared-memory accesses before later bulk copies of the same
// bytes (the copy engine is another proxy).
__device__ __forceinline__ void fence_for_bulk_copies() {
#if CUPYROPE_BULK_COPY
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

}  // namespace cupyrope
