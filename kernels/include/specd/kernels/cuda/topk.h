// Per-row top-k of next-token log-probabilities on the GPU, with exactly the order of
// engine/topk.h RowTopKLogprobs: higher logit first, lower id first among equal logits, NaN
// ranked as -inf; log-probability = logit - (max + log(sum exp(logit - max))) with the sum in
// fp64. The ids equal the host's exactly; the log-probabilities differ from it only by the
// order of the fp64 sum, which is below fp32 rounding.
//
// One CTA per row: each thread scans a strided slice of the vocabulary keeping its own best k
// in registers (sorted insertion), the CTA's lists go to shared memory, one warp merges them k
// times (each lane owns blockDim / 32 lists and offers its best head; a warp arg-max picks the
// winner, whose list advances), then the CTA sums exp(logit - max) in fp64 over a second pass.
//
// Optionally, per row, the log-probability and rank of one given token (the sampled one: the
// OpenAI API's logprobs, engine/sampling.h ComputeLogprobs in raw mode): rank = 1 + the tokens
// with a strictly larger logit, counted in the same second pass; k may then be 0 (the token only).
//
// Processed mode (engine/sampling.h LogprobsMode::kProcessed of the rows a verify step samples,
// after the logits processors): each row is scaled by 1 / its temperature (greedy rows: 1) and
// normalised over the tokens its sampler kept (SampleParams::kept_lower); the others have
// probability 0, so they are never listed (they would come last with -inf) and never counted
// in a rank, as in engine/sampling.cc ComputeLogprobs.
#ifndef SPECD_KERNELS_CUDA_TOPK_H_
#define SPECD_KERNELS_CUDA_TOPK_H_

#include "specd/kernels/cuda/common.h"
#include "specd/kernels/cuda/sampling.h"

namespace specd {
namespace cuda {

// Largest k TopKLogprobsCuda serves: each thread keeps k candidates in registers (the OpenAI
// API's top_logprobs go up to 20).
inline constexpr int kMaxTopK = 32;

struct TopKLogprobsParams {
  // [num_rows, logits_stride] fp32, device: row r's logits are columns [0, vocab_size) of the
  // row row_index[r] (or r when row_index is null).
  const float* logits = nullptr;
  int64_t logits_stride = 0;
  // [num_rows] int32, device, or null: which logits row each output row reads (rows of a
  // padded step that nobody asked for are skipped this way).
  const int32_t* row_index = nullptr;
  int64_t num_rows = 0;
  int64_t vocab_size = 0;     // >= k, < 2^31
  int k = 0;                  // 1 .. kMaxTopK; 0 .. kMaxTopK with `tokens`
  int32_t* ids = nullptr;     // [num_rows, k] int32, device: best first; may be null when k = 0
  float* logprobs = nullptr;  // [num_rows, k] fp32, device; may be null when k = 0
  // Optional, all three or none: tokens[row_index[r]] (tokens[r] without row_index) is the token
  // of output row r, in [0, vocab_size), whose log-probability and rank are written.
  const int32_t* tokens = nullptr;  // [logits rows] int32, device: indexed like the logits rows
  float* token_logprobs = nullptr;  // [num_rows] fp32, device
  int32_t* token_ranks = nullptr;   // [num_rows] int32, device: 1 = the most likely
  // Optional, both or neither: processed mode. Indexed like the logits rows: each row's
  // sampling (its temperature scales the row) and its kept set's sort-key threshold, as
  // SampleCuda wrote it for the same logits (0: every token).
  const SampleRowParams* sampling = nullptr;  // [logits rows] device
  const uint64_t* kept_lower = nullptr;       // [logits rows] device
};

cudaError_t TopKLogprobsCuda(const TopKLogprobsParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_TOPK_H_
