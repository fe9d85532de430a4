#include <algorithm>

#include "kernels/cuda/device_utils.cuh"
#include "specd/kernels/cuda/gather_rows.h"

namespace specd {
namespace cuda {
namespace {

// blockIdx.y picks the copy; the x blocks stride over its rows * width / kVec vectors.
template <int kVec>
__global__ void GatherRowsKernel(const __grid_constant__ GatherRowsParams p) {
  internal::PdlWait();  // the sources are an earlier kernel's outputs
  internal::PdlTrigger();
  const GatherRowsCopy& c = p.copies[blockIdx.y];
  const int64_t per_row = p.width / kVec;
  const int64_t total = static_cast<int64_t>(c.rows) * per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < total;
       v += stride) {
    const int64_t r = v / per_row;
    const int64_t col = (v % per_row) * kVec;
    const float* src = c.src + r * p.src_stride + col;
    float* dst = c.dst + r * c.dst_stride + col;
    if constexpr (kVec == 4) {
      *reinterpret_cast<float4*>(dst) = *reinterpret_cast<const float4*>(src);
    } else {
      *dst = *src;
    }
  }
}

}  // namespace

cudaError_t GatherRowsCuda(const GatherRowsCopy* copies, int64_t num_copies, int64_t width,
                           int64_t src_stride, cudaStream_t stream) {
  if (num_copies < 0 || width <= 0 || src_stride < width || width > INT32_MAX ||
      src_stride > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  constexpr int kThreads = 256;
  for (int64_t first = 0; first < num_copies; first += GatherRowsParams::kMaxCopies) {
    GatherRowsParams p;
    p.num_copies =
        static_cast<int32_t>(std::min<int64_t>(GatherRowsParams::kMaxCopies, num_copies - first));
    p.width = static_cast<int32_t>(width);
    p.src_stride = static_cast<int32_t>(src_stride);
    // Rows start 16-byte aligned when the strides are multiples of 4 floats and the bases are.
    bool vec = width % 4 == 0 && src_stride % 4 == 0;
    int32_t max_rows = 0;
    for (int32_t i = 0; i < p.num_copies; ++i) {
      const GatherRowsCopy& c = copies[first + i];
      if (c.src == nullptr || c.dst == nullptr || c.rows < 0 || c.dst_stride < width) {
        return cudaErrorInvalidValue;
      }
      p.copies[i] = c;
      max_rows = std::max(max_rows, c.rows);
      vec = vec && c.dst_stride % 4 == 0 && IsAligned(c.src, 16) && IsAligned(c.dst, 16);
    }
    if (max_rows == 0) continue;
    const int64_t items = static_cast<int64_t>(max_rows) * (vec ? width / 4 : width);
    const dim3 grid(
        static_cast<unsigned>(std::min<int64_t>((items + kThreads - 1) / kThreads, 256)),
        static_cast<unsigned>(p.num_copies));
    const cudaError_t e = LaunchPdl("gather_rows", vec ? GatherRowsKernel<4> : GatherRowsKernel<1>,
                                    grid, dim3(kThreads), 0, stream, p);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace specd
