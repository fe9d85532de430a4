// Embedding gather: out[t] = table[tokens[t]].
#ifndef SPECD_KERNELS_EMBEDDING_H_
#define SPECD_KERNELS_EMBEDDING_H_

#include <stdint.h>

namespace specd {

struct EmbeddingParams {
  const int32_t* tokens = nullptr;  // [num_tokens] int32, host; each in [0, vocab_size)
  const float* table = nullptr;     // [vocab_size, hidden] fp32, host
  float* out = nullptr;             // [num_tokens, hidden] fp32, host
  int64_t num_tokens = 0;
  int64_t vocab_size = 0;
  int64_t hidden = 0;
};

// Token ids must already be validated by the caller (the backend answers INVALID_ARGUMENT);
// an id out of range here is a programmer error and aborts.
void EmbeddingCpu(const EmbeddingParams& p);

}  // namespace specd

#endif  // SPECD_KERNELS_EMBEDDING_H_
