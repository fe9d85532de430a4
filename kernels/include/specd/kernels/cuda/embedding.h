// Embedding gather on the GPU: out[t] = table[tokens[t]] (the CPU reference is
// specd/kernels/embedding.h EmbeddingCpu).
#ifndef SPECD_KERNELS_CUDA_EMBEDDING_H_
#define SPECD_KERNELS_CUDA_EMBEDDING_H_

#include "specd/kernels/cuda/common.h"

namespace specd {
namespace cuda {

struct EmbeddingParams {
  const int32_t* tokens = nullptr;  // [num_tokens] int32, device
  const bf16* table = nullptr;      // [vocab_size, hidden] bf16, device
  bf16* out = nullptr;              // [num_tokens, hidden] bf16, device
  int64_t num_tokens = 0;
  int64_t vocab_size = 0;
  int64_t hidden = 0;
};

// Ids are validated by the caller; an id outside [0, vocab_size) yields a zero row rather than
// an out-of-bounds read.
cudaError_t EmbeddingCuda(const EmbeddingParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_EMBEDDING_H_
