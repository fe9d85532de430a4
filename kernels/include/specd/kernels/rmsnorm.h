// RMSNorm as in Hugging Face Llama/Qwen: out = x / sqrt(mean(x^2) + eps) * weight, with an
// optional fused residual add (the pre-norm transformer's "h = h + sublayer(h); norm(h)").
// Also used for Qwen3's per-head q/k norm by viewing [tokens, heads, head_dim] as
// [tokens * heads, head_dim].
#ifndef SPECD_KERNELS_RMSNORM_H_
#define SPECD_KERNELS_RMSNORM_H_

#include <stdint.h>

namespace specd {

struct RmsNormParams {
  const float* x = nullptr;  // [rows, dim] fp32, host; may alias `out`
  // [rows, dim] fp32, host, or null. When set: residual = x + residual (in place) and the norm
  // is taken of the updated residual, so the caller keeps the residual stream in one buffer.
  float* residual = nullptr;
  const float* weight = nullptr;  // [dim] fp32, host
  float* out = nullptr;           // [rows, dim] fp32, host
  int64_t rows = 0;
  int64_t dim = 0;
  float eps = 1e-5f;
};

// The mean of squares is accumulated in double in index order: the reference is meant to be
// closer to exact than any device kernel compared against it, and independent of batching
// (each row depends only on its own inputs).
void RmsNormCpu(const RmsNormParams& p);

}  // namespace specd

#endif  // SPECD_KERNELS_RMSNORM_H_
