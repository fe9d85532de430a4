// Warms the GPU's L2 cache with a weight matrix ahead of the GEMM that reads it.
//
// Why: a batch-1 decode step alternates bandwidth-bound GEMMs with short latency-bound kernels
// (RMSNorm, RoPE, attention, SwiGLU) during which HBM sits mostly idle, and the smaller GEMMs
// (o_proj, qkv, down) lose part of their time to ramping up their weight stream. Launched on a
// second stream beside those short kernels, this op asks the copy engines of a few
// multiprocessors (cp.async.bulk.prefetch, sm_90) to bring the next GEMM's weights into L2, so
// the GEMM starts with them at hand. It is a hint: it reads nothing into registers, writes
// nothing, and never changes a result; where L2 does not keep the lines, the GEMM reads HBM as
// before.
//
// What is prefetched: of each of `rows` rows (`pitch_bytes` apart), its first `prefix_bytes`.
// A GEMM streaming W[n, k] reads every row's K range from its start, all tiles at once, so a
// budget smaller than the matrix is best spent on the same leading part of every row (every CTA
// then starts ahead) rather than on the first rows (those CTAs would finish early, the rest
// as late as before). prefix_bytes == pitch_bytes is the whole matrix, taken as one range.
#ifndef SPECD_KERNELS_CUDA_L2_PREFETCH_H_
#define SPECD_KERNELS_CUDA_L2_PREFETCH_H_

#include "specd/kernels/cuda/common.h"

namespace specd {
namespace cuda {

struct L2PrefetchParams {
  // [rows, pitch_bytes] bytes, device, 16-byte aligned; only read by the cache, never by a
  // thread.
  const void* base = nullptr;
  int64_t rows = 0;
  int64_t pitch_bytes = 0;   // multiple of 16
  int64_t prefix_bytes = 0;  // multiple of 16, in (0, pitch_bytes]
  // CTAs issuing the requests (each issue slot is one multiprocessor's copy engine). 0: the
  // launcher's default.
  int ctas = 0;
};

// The prefix that a budget of `budget_bytes` buys on each row of a [rows, pitch_bytes] matrix:
// the whole row when the matrix fits, else the largest multiple of 16 bytes within
// budget / rows (0 when not even 16 bytes a row fit).
int64_t L2PrefetchPrefixBytes(int64_t rows, int64_t pitch_bytes, int64_t budget_bytes);

// cudaErrorInvalidValue for misaligned or inconsistent params; rows == 0 is a no-op.
cudaError_t L2PrefetchCuda(const L2PrefetchParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_L2_PREFETCH_H_
