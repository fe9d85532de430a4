// The RMSNorm row arithmetic private to kernels/cuda, shared by RmsNormCuda (rmsnorm.cu) and
// the fused all-reduce (allreduce.cu). The fused all-reduce promises bits identical to
// RmsNormCuda's on the same summed row, so both run this one piece of code: the block size
// (it fixes how the sum of squares is split over threads), the residual update and the
// normalisation.
#ifndef SPECD_KERNELS_CUDA_RMSNORM_ROW_CUH_
#define SPECD_KERNELS_CUDA_RMSNORM_ROW_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/device_utils.cuh"

namespace specd {
namespace cuda {
namespace internal {

// Threads of the block that normalises one row of `dim`: enough that each handles a few
// 16-byte vectors of a typical row (4096: 4 each).
inline int RmsNormThreads(int64_t dim) {
  int threads = 32;
  while (threads < 1024 && threads * 8 * 2 < dim) threads *= 2;
  return threads;
}

// Whether RmsNormRow8 updates a residual stream: decided per call from `res`, or always.
enum class RowResidual { kIfGiven, kAlways };

// One row by the whole block, 8 elements a thread at a time (dim % 8 == 0, 16-byte aligned
// pointers). load(i, h) puts the row's input elements [i, i + 8) into h as fp32: a bf16 row, or
// the sum of the tensor-parallel ranks' partials. With `res` ([dim] fp32) the row becomes
// h = input + res (or input alone when residual_init), is stored back to res, and is what gets
// normalised; without it the input itself is normalised (and load is called twice per element).
// kAlways promises a non-null `res`, so the code for the other case is not even compiled.
// out = h / sqrt(mean(h^2) + eps) * weight ([dim] fp32), rounded to bf16. Pass 2 reads only the
// elements a thread wrote in pass 1, so `out` may alias the input. `scratch` holds 32 floats; BlockSum
// begins with a __syncthreads, so a block may call this for one row after another.
template <RowResidual kResidual, typename Load8>
__device__ __forceinline__ void RmsNormRow8(int64_t dim, Load8 load, float* res,
                                            bool residual_init, const float* weight,
                                            float eps, __nv_bfloat16* out, float* scratch) {
  const bool has_res = kResidual == RowResidual::kAlways || res != nullptr;
  float sum_sq = 0.0f;
  for (int64_t i = threadIdx.x * 8; i < dim; i += blockDim.x * 8) {
    float h[8];
    load(i, h);
    if (has_res) {
      if (!residual_init) {
        float r[8];
        LoadFloat8(res + i, r);
#pragma unroll
        for (int j = 0; j < 8; ++j) h[j] += r[j];
      }
      float4* rv = reinterpret_cast<float4*>(res + i);
      rv[0] = make_float4(h[0], h[1], h[2], h[3]);
      rv[1] = make_float4(h[4], h[5], h[6], h[7]);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) sum_sq += h[j] * h[j];
  }
  sum_sq = BlockSum(sum_sq, scratch);
  const float inv = rsqrtf(sum_sq / static_cast<float>(dim) + eps);
  for (int64_t i = threadIdx.x * 8; i < dim; i += blockDim.x * 8) {
    float h[8], w[8];
    if (has_res) {
      LoadFloat8(res + i, h);
    } else {
      load(i, h);
    }
    LoadFloat8(weight + i, w);
#pragma unroll
    for (int j = 0; j < 8; ++j) h[j] = h[j] * inv * w[j];
    *reinterpret_cast<uint4*>(out + i) = FloatToBf16x8(h);
  }
}

}  // namespace internal
}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_RMSNORM_ROW_CUH_
