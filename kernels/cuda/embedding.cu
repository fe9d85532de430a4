#include "specd/kernels/cuda/embedding.h"

#include "kernels/cuda/device_utils.cuh"

namespace specd {
namespace cuda {
namespace {

// One block per token; kVec = 8 moves 16 bytes per access when rows allow it.
template <int kVec>
__global__ void EmbeddingKernel(EmbeddingParams p) {
  internal::PdlWait();
  internal::PdlTrigger();
  const int64_t t = blockIdx.x;
  const int64_t id = static_cast<int64_t>(p.tokens[t]) - p.vocab_offset;  // table row
  const bool valid = id >= 0 && id < p.vocab_size;
  bf16* out = p.out + t * p.hidden;
  const bf16* row = p.table + (valid ? id : 0) * p.hidden;
  if constexpr (kVec == 8) {
    const uint4* src = reinterpret_cast<const uint4*>(row);
    uint4* dst = reinterpret_cast<uint4*>(out);
    for (int64_t i = threadIdx.x; i < p.hidden / 8; i += blockDim.x) {
      dst[i] = valid ? src[i] : make_uint4(0, 0, 0, 0);
    }
  } else {
    for (int64_t i = threadIdx.x; i < p.hidden; i += blockDim.x) {
      out[i] = valid ? row[i] : __float2bfloat16(0.0f);
    }
  }
}

}  // namespace

cudaError_t EmbeddingCuda(const EmbeddingParams& p, cudaStream_t stream) {
  if (p.num_tokens < 0 || p.hidden <= 0 || p.vocab_size <= 0 || p.vocab_offset < 0) {
    return cudaErrorInvalidValue;
  }
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.tokens == nullptr || p.table == nullptr || p.out == nullptr) return cudaErrorInvalidValue;
  const bool vec = p.hidden % 8 == 0 && IsAligned(p.table, 16) && IsAligned(p.out, 16);
  const int threads = 128;
  return LaunchPdl("embedding", vec ? EmbeddingKernel<8> : EmbeddingKernel<1>,
                   dim3(static_cast<unsigned>(p.num_tokens)), dim3(threads), 0,
                   stream, p);
}

}  // namespace cuda
}  // namespace specd
