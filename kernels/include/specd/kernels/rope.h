// Rotary position embedding in the rotate-half layout of Hugging Face Llama: for each head and
// i < head_dim/2, with a = float(position) * inv_freq[i] (computed in fp32, as transformers does),
//   x'[i]        = x[i] * cos(a) - x[i + half] * sin(a)
//   x'[i + half] = x[i + half] * cos(a) + x[i] * sin(a).
// inv_freq comes from engine/model_config.h RopeInvFreq (llama3/linear scaling already applied).
#ifndef SPECD_KERNELS_ROPE_H_
#define SPECD_KERNELS_ROPE_H_

#include <stdint.h>

namespace specd {

struct RopeParams {
  // [num_tokens, row_stride] fp32, host, rotated in place; token t's heads are the
  // num_heads * head_dim values starting at x + t * row_stride, head-major.
  float* x = nullptr;
  const int32_t* positions = nullptr;  // [num_tokens] int32, host: absolute position of token t
  const float* inv_freq = nullptr;     // [head_dim / 2] fp32, host
  int64_t num_tokens = 0;
  int64_t num_heads = 0;
  int64_t head_dim = 0;    // even
  int64_t row_stride = 0;  // elements between consecutive tokens; >= num_heads * head_dim
};

void RopeCpu(const RopeParams& p);

}  // namespace specd

#endif  // SPECD_KERNELS_ROPE_H_
