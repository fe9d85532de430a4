// Embedding gather on the GPU: out[t] = table[tokens[t]] (the CPU reference is
// specd/kernels/embedding.h EmbeddingCpu). Under tensor parallelism a rank's table holds a
// contiguous vocabulary shard and gives zero rows for the other ranks' tokens, so the ranks'
// outputs sum (all-reduce) to the full gather exactly.
#ifndef SPECD_KERNELS_CUDA_EMBEDDING_H_
#define SPECD_KERNELS_CUDA_EMBEDDING_H_

#include "specd/kernels/cuda/common.h"

namespace specd {
namespace cuda {

struct EmbeddingParams {
  const int32_t* tokens = nullptr;  // [num_tokens] int32, device
  // [vocab_size, hidden] bf16, device: rows of token ids [vocab_offset, vocab_offset + vocab_size).
  const bf16* table = nullptr;
  bf16* out = nullptr;  // [num_tokens, hidden] bf16, device
  int64_t num_tokens = 0;
  int64_t vocab_size = 0;
  int64_t hidden = 0;
  // Global id of table row 0 (tensor-parallel vocabulary shard); 0 for the full table.
  int64_t vocab_offset = 0;
};

// Ids are validated by the caller; an id outside [vocab_offset, vocab_offset + vocab_size) yields
// a zero row rather than an out-of-bounds read (for a shard: a token another rank holds).
cudaError_t EmbeddingCuda(const EmbeddingParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_EMBEDDING_H_
