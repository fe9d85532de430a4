// Tensor-core and asynchronous-copy helpers private to kernels/cuda (sm_80+ PTX): cp.async
// 16-byte copies into shared memory, ldmatrix fragment loads and the bf16 m16n8k16 MMA, shared
// by the tensor-core kernels (tree attention); and, sm_90 only, the tensor-memory-accelerator
// (TMA) tile loads with the shared-memory barriers they complete on.
#ifndef SPECD_KERNELS_CUDA_MMA_UTILS_CUH_
#define SPECD_KERNELS_CUDA_MMA_UTILS_CUH_

#include <cuda_bf16.h>
#include <stdint.h>

namespace specd {
namespace cuda {
namespace internal {

using bf16 = __nv_bfloat16;

// 16 bytes global -> shared without a register round trip; `valid` false writes zeros (the
// source is then not read, but must still be a mapped address).
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8x8 bf16 matrices, transposed: lanes 8i..8i+7 give the row addresses of matrix i, and
// register i of lane (g = lane / 4, t = lane % 4) receives its elements [2t][g] and [2t+1][g].
__device__ __forceinline__ void LdMatrixX4Trans(const bf16* smem, uint32_t& r0, uint32_t& r1,
                                                uint32_t& r2, uint32_t& r3) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// Four 8x8 bf16 matrices: lanes 8i..8i+7 give the row addresses of matrix i, and register i of
// lane (g = lane / 4, t = lane % 4) receives its elements [g][2t] and [g][2t+1]. One instruction
// instead of four 32-bit shared loads for the K fragments of two MMA k-steps.
__device__ __forceinline__ void LdMatrixX4(const bf16* smem, uint32_t& r0, uint32_t& r1,
                                           uint32_t& r2, uint32_t& r3) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// D += A * B for one m16n8k16 tile, bf16 inputs, fp32 accumulators. Fragment layouts (PTX ISA,
// "Matrix Fragments for mma.m16n8k16"), with g = lane / 4 and t = lane % 4:
//   A regs: {A[g][2t..2t+1]}, {A[g+8][2t..]}, {A[g][2t+8..]}, {A[g+8][2t+8..]}
//   B regs: {B[2t..2t+1][g]}, {B[2t+8..2t+9][g]}
//   D:      D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The 32-bit shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A shared-memory barrier (mbarrier, 8 bytes) used as a transaction counter: one arrival (the
// thread that issues the loads, announcing their bytes) and the loads' bytes complete a phase.
// Call before any thread uses it, then fence it for the TMA unit (FenceBarrierInit) and sync.
__device__ __forceinline__ void BarrierInit(uint64_t* bar, uint32_t arrivals) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddr(bar)), "r"(arrivals)
               : "memory");
#endif
}

__device__ __forceinline__ void FenceBarrierInit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// Orders this thread's earlier generic-proxy accesses to shared memory (and, after a block
// barrier, the other threads' it synchronized with) before its later async-proxy ones (TMA
// writes): a TMA load into a buffer that cp.async or ld.shared used before.
__device__ __forceinline__ void FenceProxyAsyncShared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// The issuing thread's arrival, announcing `bytes` of TMA loads that will complete the phase.
__device__ __forceinline__ void BarrierArriveExpectTx(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SmemAddr(bar)),
               "r"(bytes)
               : "memory");
#endif
}

// Waits until the phase with the given parity (0 for the barrier's first phase, then 1, 0, ...)
// has completed; its loads' data are then visible to the waiting thread.
__device__ __forceinline__ void BarrierWait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(SmemAddr(bar)), "r"(parity)
        : "memory");
  } while (done == 0);
#endif
}

// One TMA load of a 3-D box (coordinates innermost first, in elements; a box part outside the
// tensor is filled with zeros, negative coordinates included) into shared memory at `smem`,
// completing `bytes` of the barrier's current phase. `map` is a CUtensorMap in parameter,
// constant or global memory (here: a __grid_constant__ kernel parameter).
__device__ __forceinline__ void TmaLoad3d(void* smem, const void* map, uint64_t* bar, int c0,
                                          int c1, int c2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4}], [%5];\n" ::"r"(SmemAddr(smem)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(SmemAddr(bar))
      : "memory");
#endif
}

}  // namespace internal
}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_MMA_UTILS_CUH_
