#include "specd/kernels/cuda/rmsnorm.h"

#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/rmsnorm_row.cuh"

namespace specd {
namespace cuda {
namespace {

using internal::Bf16x8ToFloat;
using internal::BlockSum;
using internal::RmsNormRow8;
using internal::RowResidual;
using internal::RmsNormThreads;

// One block per row. Pass 1 forms h (updating the residual) and the sum of squares; pass 2
// re-reads h (from the residual, or x) -- each thread touches only its own elements, so `out`
// may alias `x`, and the second read hits L1/L2.
template <int kVec>
__global__ void RmsNormKernel(RmsNormParams p) {
  __shared__ float scratch[32];
  internal::PdlWait();
  internal::PdlTrigger();
  const int64_t r = blockIdx.x;
  const bf16* x = p.x + r * p.dim;
  float* res = p.residual != nullptr ? p.residual + r * p.dim : nullptr;
  bf16* out = p.out + r * p.dim;
  if constexpr (kVec == 8) {
    const auto load = [x](int64_t i, float* h) {
      Bf16x8ToFloat(*reinterpret_cast<const uint4*>(x + i), h);
    };
    RmsNormRow8<RowResidual::kIfGiven>(p.dim, load, res, p.residual_init, p.weight, p.eps, out, scratch);
  } else {
    float sum_sq = 0.0f;
    for (int64_t i = threadIdx.x; i < p.dim; i += blockDim.x) {
      float h = __bfloat162float(x[i]);
      if (res != nullptr) {
        if (!p.residual_init) h += res[i];
        res[i] = h;
      }
      sum_sq += h * h;
    }
    sum_sq = BlockSum(sum_sq, scratch);
    const float inv = rsqrtf(sum_sq / static_cast<float>(p.dim) + p.eps);
    for (int64_t i = threadIdx.x; i < p.dim; i += blockDim.x) {
      const float h = res != nullptr ? res[i] : __bfloat162float(x[i]);
      out[i] = __float2bfloat16(h * inv * p.weight[i]);
    }
  }
}

}  // namespace

cudaError_t RmsNormCuda(const RmsNormParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.dim <= 0 || !(p.eps >= 0.0f)) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  if (p.x == nullptr || p.weight == nullptr || p.out == nullptr) return cudaErrorInvalidValue;
  const bool vec = p.dim % 8 == 0 && IsAligned(p.x, 16) && IsAligned(p.weight, 16) &&
                   IsAligned(p.out, 16) && (p.residual == nullptr || IsAligned(p.residual, 16));
  const int threads = RmsNormThreads(p.dim);
  return LaunchPdl("rmsnorm", vec ? RmsNormKernel<8> : RmsNormKernel<1>,
                   dim3(static_cast<unsigned>(p.rows)), dim3(threads), 0,
                   stream, p);
}

}  // namespace cuda
}  // namespace specd
