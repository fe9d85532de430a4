#include "specd/kernels/cuda/l2_prefetch.h"

#include <algorithm>

#include "kernels/cuda/device_utils.cuh"

namespace specd {
namespace cuda {
namespace {

// One request covers at most this many bytes, so that a long range spreads over the CTAs'
// copy engines instead of queueing on one.
constexpr int64_t kPiece = 64 << 10;
constexpr int kThreads = 32;
constexpr int kDefaultCtas = 16;

__device__ __forceinline__ void BulkPrefetchL2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// Request i covers piece i % pieces_per_row of row i / pieces_per_row (a whole matrix is one
// row). The requests complete on their own: the kernel ends as soon as they are issued.
__global__ void L2PrefetchKernel(const uint8_t* base, int64_t rows, int64_t pitch,
                                 int64_t prefix, int64_t pieces_per_row) {
  const int64_t total = rows * pieces_per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / pieces_per_row;
    const int64_t off = (i % pieces_per_row) * kPiece;
    const int64_t bytes = prefix - off < kPiece ? prefix - off : kPiece;
    BulkPrefetchL2(base + row * pitch + off, static_cast<uint32_t>(bytes));
  }
}

}  // namespace

int64_t L2PrefetchPrefixBytes(int64_t rows, int64_t pitch_bytes, int64_t budget_bytes) {
  if (rows <= 0 || pitch_bytes <= 0 || budget_bytes <= 0) return 0;
  if (rows * pitch_bytes <= budget_bytes) return pitch_bytes;
  return std::min(pitch_bytes, budget_bytes / rows / 16 * 16);
}

cudaError_t L2PrefetchCuda(const L2PrefetchParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.ctas < 0) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  if (p.base == nullptr || !IsAligned(p.base, 16) || p.pitch_bytes <= 0 ||
      p.pitch_bytes % 16 != 0 || p.prefix_bytes <= 0 || p.prefix_bytes % 16 != 0 ||
      p.prefix_bytes > p.pitch_bytes) {
    return cudaErrorInvalidValue;
  }
  int64_t rows = p.rows, pitch = p.pitch_bytes, prefix = p.prefix_bytes;
  if (prefix == pitch) {  // the whole matrix: one contiguous range
    prefix = rows * pitch;
    pitch = prefix;
    rows = 1;
  }
  const int64_t pieces = (prefix + kPiece - 1) / kPiece;
  const int64_t total = rows * pieces;
  const int ctas = static_cast<int>(std::min<int64_t>(
      p.ctas > 0 ? p.ctas : kDefaultCtas, (total + kThreads - 1) / kThreads));
  L2PrefetchKernel<<<ctas, kThreads, 0, stream>>>(static_cast<const uint8_t*>(p.base), rows,
                                                   pitch, prefix, pieces);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace specd
