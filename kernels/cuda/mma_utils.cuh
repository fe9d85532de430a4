// Tensor-core and asynchronous-copy helpers private to kernels/cuda (sm_80+ PTX): cp.async
// 16-byte copies into shared memory, ldmatrix fragment loads and the bf16 m16n8k16 MMA, shared
// by the tensor-core kernels (tree attention); and, sm_90a only, the warpgroup MMA (wgmma).
#ifndef SPECD_KERNELS_CUDA_MMA_UTILS_CUH_
#define SPECD_KERNELS_CUDA_MMA_UTILS_CUH_

#include <cuda_bf16.h>
#include <stdint.h>

namespace specd {
namespace cuda {
namespace internal {

using bf16 = __nv_bfloat16;

// The 32-bit shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared without a register round trip; `valid` false writes zeros (the
// source is then not read, but must still be a mapped address).
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddr(smem)), "l"(gmem),
               "r"(bytes)
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
  const uint32_t addr = SmemAddr(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// Four 8x8 bf16 matrices: lanes 8i..8i+7 give the row addresses of matrix i, and register i of
// lane (g = lane / 4, t = lane % 4) receives its elements [g][2t] and [g][2t+1]. One instruction
// instead of four 32-bit shared loads for the K fragments of two MMA k-steps.
__device__ __forceinline__ void LdMatrixX4(const bf16* smem, uint32_t& r0, uint32_t& r1,
                                           uint32_t& r2, uint32_t& r3) {
  const uint32_t addr = SmemAddr(smem);
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

// Orders this thread's earlier generic-proxy writes to shared memory (cp.async copies included)
// before async-proxy reads of them (wgmma operands); a block barrier after it extends that to
// every thread's writes.
__device__ __forceinline__ void FenceProxyAsyncShared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// wgmma exists on sm_90a only (the arch-specific target: CMAKE_CUDA_ARCHITECTURES=90a); built for
// plain sm_90 these helpers are empty and kernels take their mma.sync paths instead.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
inline constexpr bool kHasWgmma = true;
#else
inline constexpr bool kHasWgmma = false;
#endif

// A wgmma shared-memory matrix descriptor for a 128-byte-swizzled layout (PTX ISA, "Matrix
// Descriptor Format"): start address, leading- and stride-dimension byte offsets (each >> 4),
// layout type 1 (128-byte swizzle) in bits 62-63, base offset 0 (the swizzle atoms sit on
// 1024-byte boundaries; a k-step inside an atom moves the start address only).
__device__ __forceinline__ uint64_t GmmaDescSw128(uint32_t smem_addr, uint32_t lbo_bytes,
                                                  uint32_t sbo_bytes) {
  return static_cast<uint64_t>((smem_addr & 0x3ffffu) >> 4) |
         (static_cast<uint64_t>((lbo_bytes >> 4) & 0x3fffu) << 16) |
         (static_cast<uint64_t>((sbo_bytes >> 4) & 0x3fffu) << 32) | (uint64_t{1} << 62);
}

// Before a warpgroup's first wgmma that reads registers (accumulators, A) written by ordinary
// instructions.
__device__ __forceinline__ void WgmmaFence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void WgmmaCommit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Keeps the compiler from moving reads or writes of wgmma accumulators across this point (it
// does not know that WgmmaWait is what makes them ready).
template <int kTiles>
__device__ __forceinline__ void WgmmaFenceOperands(float (&d)[kTiles][4]) {
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
  }
}

// D[64 x 64] += A[64 x 16] * B[16 x 64] for the warpgroup (wgmma, bf16 inputs, fp32
// accumulators). A comes from registers: each warp its 16 rows, in m16n8k16's A fragment
// layout. B comes from shared memory through `desc`; kTransB 0: B stored K-major (each
// column's 16 k-values contiguous), 1: MN-major. Per warp, D is m16n8k16's D fragment
// for 8-column tile j at d[j]. Issue between WgmmaFence() and WgmmaCommit(), and touch
// neither d nor a until WgmmaWait<0>() and WgmmaFenceOperands(d).
template <int kTransB>
__device__ __forceinline__ void Wgmma64x64x16(float (&d)[8][4], const uint32_t (&a)[4],
                                              uint64_t desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(kTransB), "r"(1));
#endif
}

// D[64 x 128] += A[64 x 16] * B[16 x 128] for the warpgroup (wgmma, bf16 inputs, fp32
// accumulators). A comes from registers: each warp its 16 rows, in m16n8k16's A fragment
// layout. B comes from shared memory through `desc`; kTransB 0: B stored K-major (each
// column's 16 k-values contiguous), 1: MN-major. Per warp, D is m16n8k16's D fragment
// for 8-column tile j at d[j]. Issue between WgmmaFence() and WgmmaCommit(), and touch
// neither d nor a until WgmmaWait<0>() and WgmmaFenceOperands(d).
template <int kTransB>
__device__ __forceinline__ void Wgmma64x128x16(float (&d)[16][4], const uint32_t (&a)[4],
                                               uint64_t desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %70, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
        "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
        "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
        "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
        "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(kTransB), "r"(1));
#endif
}

}  // namespace internal
}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_MMA_UTILS_CUH_
