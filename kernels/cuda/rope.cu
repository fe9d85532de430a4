#include "specd/kernels/cuda/rope.h"

#include "kernels/cuda/device_utils.cuh"

namespace specd {
namespace cuda {
namespace {

constexpr int kMaxHalf = 256;  // head_dim <= 512
constexpr int kPairsPerLane = kMaxHalf / 32;
constexpr int kWarps = 4;

// One block per token: the block computes cos/sin of the token's angles once into shared
// memory, then each warp rotates whole heads (lane i handles pairs i, i + 32, ...), so the
// optional per-head norm is a warp reduction.
__global__ void __launch_bounds__(kWarps * 32) RopeKernel(RopeParams p) {
  __shared__ float cos_s[kMaxHalf];
  __shared__ float sin_s[kMaxHalf];
  const int64_t t = blockIdx.x;
  const int half = static_cast<int>(p.head_dim / 2);
  const float pos = static_cast<float>(p.positions[t]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    // fp32 angle as in the reference; sincosf (not __sincosf) keeps full range reduction,
    // which matters at positions of 10^5 and more.
    const float angle = pos * p.inv_freq[i];
    sincosf(angle, &sin_s[i], &cos_s[i]);
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int64_t heads = p.num_q_heads + p.num_k_heads;
  for (int64_t h = warp; h < heads; h += kWarps) {
    const bool is_q = h < p.num_q_heads;
    bf16* x = is_q ? p.q + t * p.q_stride + h * p.head_dim
                   : p.k + t * p.k_stride + (h - p.num_q_heads) * p.head_dim;
    const bf16* norm_w = is_q ? p.q_norm_weight : p.k_norm_weight;
    float x1[kPairsPerLane], x2[kPairsPerLane];
    float sum_sq = 0.0f;
#pragma unroll
    for (int j = 0; j < kPairsPerLane; ++j) {
      const int i = lane + 32 * j;
      x1[j] = x2[j] = 0.0f;
      if (i < half) {
        x1[j] = __bfloat162float(x[i]);
        x2[j] = __bfloat162float(x[i + half]);
        sum_sq += x1[j] * x1[j] + x2[j] * x2[j];
      }
    }
    float inv = 1.0f;
    if (norm_w != nullptr) {
      inv = rsqrtf(internal::WarpSum(sum_sq) / static_cast<float>(p.head_dim) + p.norm_eps);
    }
#pragma unroll
    for (int j = 0; j < kPairsPerLane; ++j) {
      const int i = lane + 32 * j;
      if (i < half) {
        float a = x1[j], b = x2[j];
        if (norm_w != nullptr) {
          a = a * inv * __bfloat162float(norm_w[i]);
          b = b * inv * __bfloat162float(norm_w[i + half]);
        }
        const float c = cos_s[i], s = sin_s[i];
        x[i] = __float2bfloat16(a * c - b * s);
        x[i + half] = __float2bfloat16(b * c + a * s);
      }
    }
  }
}

}  // namespace

cudaError_t RopeCuda(const RopeParams& p, cudaStream_t stream) {
  if (p.num_tokens < 0 || p.head_dim <= 0 || p.head_dim % 2 != 0 || p.head_dim > 2 * kMaxHalf ||
      p.num_q_heads < 0 || p.num_k_heads < 0) {
    return cudaErrorInvalidValue;
  }
  if (p.num_tokens == 0 || p.num_q_heads + p.num_k_heads == 0) return cudaSuccess;
  if (p.positions == nullptr || p.inv_freq == nullptr) return cudaErrorInvalidValue;
  if (p.num_q_heads > 0 && (p.q == nullptr || p.q_stride < p.num_q_heads * p.head_dim)) {
    return cudaErrorInvalidValue;
  }
  if (p.num_k_heads > 0 && (p.k == nullptr || p.k_stride < p.num_k_heads * p.head_dim)) {
    return cudaErrorInvalidValue;
  }
  RopeKernel<<<static_cast<unsigned>(p.num_tokens), kWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace specd
