#include "specd/kernels/cuda/rope.h"

#include "kernels/cuda/device_utils.cuh"

namespace specd {
namespace cuda {
namespace {

constexpr int kMaxHalf = 256;  // head_dim <= 512
constexpr int kPairsPerLane = kMaxHalf / 32;
constexpr int kWarps = 4;

// grid = (tokens, head groups): one warp per head (lane i handles pairs i, i + 32, ...), so the
// optional per-head norm is a warp reduction and a decode step's few tokens still spread over
// many SMs. Heads are the token's query heads, then its key heads, then (fused cache write) its
// value heads, which are only copied. Each lane computes the cos/sin of its own pairs: the same
// sincosf of the same fp32 angle for every head, so no shared table and no barrier.
__global__ void __launch_bounds__(kWarps * 32) RopeKernel(RopeParams p) {
  internal::PdlWait();
  internal::PdlTrigger();
  const int64_t t = blockIdx.x;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const bool cache = p.k_cache != nullptr;
  const int64_t h = static_cast<int64_t>(blockIdx.y) * kWarps + warp;
  const int64_t rotated = p.num_q_heads + p.num_k_heads;
  if (h >= rotated + (cache ? p.num_k_heads : 0)) return;
  const int64_t kv_dim = p.num_k_heads * p.head_dim;
  const int64_t slot = cache ? p.slots[t] : -1;
  if (h >= rotated) {  // a value head: copied to its slot
    if (slot < 0) return;
    const int64_t off = (h - rotated) * p.head_dim;
    const bf16* src = p.v + t * p.v_stride + off;
    bf16* dst = p.v_cache + slot * kv_dim + off;
    for (int64_t i = lane; i < p.head_dim; i += 32) dst[i] = src[i];
    return;
  }
  const int half = static_cast<int>(p.head_dim / 2);
  const float pos = static_cast<float>(p.positions[t]);
  const bool is_q = h < p.num_q_heads;
  bf16* x = is_q ? p.q + t * p.q_stride + h * p.head_dim
                 : p.k + t * p.k_stride + (h - p.num_q_heads) * p.head_dim;
  bf16* xc = !is_q && slot >= 0 ? p.k_cache + slot * kv_dim + (h - p.num_q_heads) * p.head_dim
                                : nullptr;
  const float* norm_w = is_q ? p.q_norm_weight : p.k_norm_weight;
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
        a = a * inv * norm_w[i];
        b = b * inv * norm_w[i + half];
      }
      // fp32 angle as in the reference; sincosf (not __sincosf) keeps full range reduction,
      // which matters at positions of 10^5 and more.
      float s, c;
      sincosf(pos * p.inv_freq[i], &s, &c);
      const bf16 lo = __float2bfloat16(a * c - b * s);
      const bf16 hi = __float2bfloat16(b * c + a * s);
      x[i] = lo;
      x[i + half] = hi;
      if (xc != nullptr) {
        xc[i] = lo;
        xc[i + half] = hi;
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
  const bool cache = p.k_cache != nullptr;
  if (cache && (p.num_k_heads == 0 || p.v_cache == nullptr || p.slots == nullptr ||
                p.v == nullptr || p.v_stride < p.num_k_heads * p.head_dim)) {
    return cudaErrorInvalidValue;
  }
  const int64_t heads = p.num_q_heads + p.num_k_heads * (cache ? 2 : 1);
  const dim3 grid(static_cast<unsigned>(p.num_tokens),
                  static_cast<unsigned>((heads + kWarps - 1) / kWarps));
  return LaunchPdl("rope", RopeKernel, grid, dim3(kWarps * 32), 0, stream, p);
}

}  // namespace cuda
}  // namespace specd
