#include "specd/kernels/cuda/rmsnorm.h"

#include "kernels/cuda/device_utils.cuh"

namespace specd {
namespace cuda {
namespace {

using internal::Bf16x8ToFloat;
using internal::BlockSum;
using internal::FloatToBf16x8;

// One block per row. Pass 1 forms h (updating the residual) and the sum of squares; pass 2
// re-reads h (from the residual, or x) -- each thread touches only its own elements, so `out`
// may alias `x`, and the second read hits L1/L2.
template <int kVec>
__global__ void RmsNormKernel(RmsNormParams p) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const bf16* x = p.x + r * p.dim;
  float* res = p.residual != nullptr ? p.residual + r * p.dim : nullptr;
  bf16* out = p.out + r * p.dim;
  float sum_sq = 0.0f;
  if constexpr (kVec == 8) {
    for (int64_t i = threadIdx.x * 8; i < p.dim; i += blockDim.x * 8) {
      float h[8];
      Bf16x8ToFloat(*reinterpret_cast<const uint4*>(x + i), h);
      if (res != nullptr) {
        float4* rv = reinterpret_cast<float4*>(res + i);
        if (!p.residual_init) {
          const float4 a = rv[0], b = rv[1];
          h[0] += a.x;
          h[1] += a.y;
          h[2] += a.z;
          h[3] += a.w;
          h[4] += b.x;
          h[5] += b.y;
          h[6] += b.z;
          h[7] += b.w;
        }
        rv[0] = make_float4(h[0], h[1], h[2], h[3]);
        rv[1] = make_float4(h[4], h[5], h[6], h[7]);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) sum_sq += h[j] * h[j];
    }
  } else {
    for (int64_t i = threadIdx.x; i < p.dim; i += blockDim.x) {
      float h = __bfloat162float(x[i]);
      if (res != nullptr) {
        if (!p.residual_init) h += res[i];
        res[i] = h;
      }
      sum_sq += h * h;
    }
  }
  sum_sq = BlockSum(sum_sq, scratch);
  const float inv = rsqrtf(sum_sq / static_cast<float>(p.dim) + p.eps);
  if constexpr (kVec == 8) {
    for (int64_t i = threadIdx.x * 8; i < p.dim; i += blockDim.x * 8) {
      float h[8], w[8];
      if (res != nullptr) {
        const float4* rv = reinterpret_cast<const float4*>(res + i);
        const float4 a = rv[0], b = rv[1];
        h[0] = a.x;
        h[1] = a.y;
        h[2] = a.z;
        h[3] = a.w;
        h[4] = b.x;
        h[5] = b.y;
        h[6] = b.z;
        h[7] = b.w;
      } else {
        Bf16x8ToFloat(*reinterpret_cast<const uint4*>(x + i), h);
      }
      Bf16x8ToFloat(*reinterpret_cast<const uint4*>(p.weight + i), w);
#pragma unroll
      for (int j = 0; j < 8; ++j) h[j] = h[j] * inv * w[j];
      *reinterpret_cast<uint4*>(out + i) = FloatToBf16x8(h);
    }
  } else {
    for (int64_t i = threadIdx.x; i < p.dim; i += blockDim.x) {
      const float h = res != nullptr ? res[i] : __bfloat162float(x[i]);
      out[i] = __float2bfloat16(h * inv * __bfloat162float(p.weight[i]));
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
  // Enough threads that each handles a few 16-byte vectors of a typical row (4096: 4 each).
  int threads = 32;
  while (threads < 1024 && threads * 8 * 2 < p.dim) threads *= 2;
  if (vec) {
    RmsNormKernel<8><<<static_cast<unsigned>(p.rows), threads, 0, stream>>>(p);
  } else {
    RmsNormKernel<1><<<static_cast<unsigned>(p.rows), threads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace specd
