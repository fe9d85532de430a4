// Copies of many strided row blocks in one launch: the device's stand-in for a batch of
// cudaMemcpy2DAsync calls, whose host cost (a few microseconds each) dominates when the blocks are
// small and many, as when a verify step holds each EAGLE sequence's committed tap rows on the
// device (engine/cuda/cuda_held_taps.cc: sequences x tap layers x runs of rows a step).
#ifndef SPECD_KERNELS_CUDA_GATHER_ROWS_H_
#define SPECD_KERNELS_CUDA_GATHER_ROWS_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace specd {
namespace cuda {

// One block of `rows` rows of `GatherRowsParams::width` fp32 each.
struct GatherRowsCopy {
  const float* src = nullptr;  // [rows, src_stride] fp32, device; the first `width` columns read
  float* dst = nullptr;        // [rows, dst_stride] fp32, device; the first `width` written
  int32_t rows = 0;
  int32_t dst_stride = 0;  // elements between the starts of consecutive dst rows
};

// The descriptors travel in the kernel's parameter space (no table to upload and keep alive, and
// the launch can be captured into a graph as is); GatherRowsCuda splits a longer list into launches
// of kMaxCopies each.
struct GatherRowsParams {
  static constexpr int kMaxCopies = 96;  // 96 * 24 bytes + the rest: under the 4 KB of parameters
  GatherRowsCopy copies[kMaxCopies];
  int32_t num_copies = 0;
  int32_t width = 0;       // elements copied per row
  int32_t src_stride = 0;  // elements between the starts of consecutive src rows, every copy
};

// Blocks must not overlap a destination of another copy in the same call (they run in any order).
cudaError_t GatherRowsCuda(const GatherRowsCopy* copies, int64_t num_copies, int64_t width,
                           int64_t src_stride, cudaStream_t stream);

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_GATHER_ROWS_H_
