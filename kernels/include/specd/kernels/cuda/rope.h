// Rotary position embedding on the GPU, rotate-half layout (the CPU reference is
// specd/kernels/rope.h RopeCpu): for each head and i < head_dim/2, with
// a = float(position) * inv_freq[i] in fp32,
//   x'[i] = x[i] cos(a) - x[i + half] sin(a),   x'[i + half] = x[i + half] cos(a) + x[i] sin(a).
// Queries and keys of a token are rotated in one launch. Qwen3's per-head q/k RMSNorm, when its
// weights are given, is applied first, fused (the CPU reference composes RmsNormCpu over
// [tokens * heads, head_dim] with RopeCpu); the normalised values stay fp32 until the rotation.
// Optionally the paged KV-cache write that follows is fused in (KvCacheWriteCuda's contract, bit
// for bit): the rotated keys and the values go straight to their slots, which saves a launch and
// a re-read of the keys per layer.
#ifndef SPECD_KERNELS_CUDA_ROPE_H_
#define SPECD_KERNELS_CUDA_ROPE_H_

#include "specd/kernels/cuda/common.h"

namespace specd {
namespace cuda {

struct RopeParams {
  // [num_tokens, q_stride] bf16, device, rotated in place: head h of token t is the head_dim
  // values at q + t * q_stride + h * head_dim.
  bf16* q = nullptr;
  int64_t q_stride = 0;
  int64_t num_q_heads = 0;
  // [num_tokens, k_stride] bf16, device, in place, same layout; may be null (num_k_heads = 0).
  bf16* k = nullptr;
  int64_t k_stride = 0;
  int64_t num_k_heads = 0;
  const int32_t* positions = nullptr;  // [num_tokens] int32, device: absolute position
  const float* inv_freq = nullptr;     // [head_dim / 2] fp32, device (RopeInvFreq)
  // [head_dim] fp32, device, or null: Qwen3 q_norm / k_norm weights (fp32 as the checkpoint
  // gives them, like RmsNormParams::weight).
  const float* q_norm_weight = nullptr;
  const float* k_norm_weight = nullptr;
  float norm_eps = 1e-6f;
  int64_t num_tokens = 0;
  int64_t head_dim = 0;  // even, at most 512
  // Fused KV-cache write, off while k_cache is null. Token t's rotated keys (also left in place
  // in k) go to k_cache + slots[t] * num_k_heads * head_dim, and its values, read from
  // v + t * v_stride, to v_cache likewise; a negative slot skips the token.
  const bf16* v = nullptr;  // [num_tokens, v_stride] bf16, device: num_k_heads value heads
  int64_t v_stride = 0;
  bf16* k_cache = nullptr;  // [num_slots, num_k_heads * head_dim] bf16, device (one layer)
  bf16* v_cache = nullptr;  // [num_slots, num_k_heads * head_dim] bf16, device
  const int64_t* slots = nullptr;  // [num_tokens] int64, device: physical slot of token t
};

cudaError_t RopeCuda(const RopeParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_ROPE_H_
