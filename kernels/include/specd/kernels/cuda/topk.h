// Per-row top-k of next-token log-probabilities on the GPU, with exactly the order of
// engine/topk.h RowTopKLogprobs: higher logit first, lower id first among equal logits, NaN
// ranked as -inf; log-probability = logit - (max + log(sum exp(logit - max))) with the sum in
// fp64. The ids equal the host's exactly; the log-probabilities differ from it by fp32
// rounding (the host's terms are fp32 exponentials; the order of the sums differs too).
//
// One CTA per row: each thread scans a strided slice of the vocabulary keeping its own best k
// in registers (sorted insertion), the CTA's lists go to shared memory, one warp merges them k
// times (each lane owns blockDim / 32 lists and offers its best head; a warp arg-max picks the
// winner, whose list advances), then the CTA sums exp(logit - max) in fp64 over a second pass.
//
// Split path (a workspace given and TopKChunks() > 1): one CTA a row leaves most of a large GPU
// idle when a draft level ranks a few rows of a large vocabulary (4 rows of 128256 tokens: 4 of
// 132 SMs), so each row's vocabulary is cut into chunks, each ranked by its own CTA as above
// (its best k, its maximum and its fp64 sum of exp(logit - chunk maximum)); a second kernel, one
// warp a row, merges the chunks' sorted lists the same way and rescales their sums to the row's
// maximum. Same ids, same order; the sums differ from the one-CTA path by fp64 rounding only.
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
  // Optional: [workspace_bytes] bytes, device, 16-byte aligned, for the split path; at least
  // TopKWorkspaceBytes(num_rows, vocab_size, k, chunks). Null: one CTA a row. It is written
  // and read within the call's launches only, so one buffer serves every launch of a stream.
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  // Chunks a row: 0 picks TopKChunks(num_rows, vocab_size) (1 without a workspace); 1 forces
  // one CTA a row; 2 .. kMaxTopKChunks forces that split (tests: small vocabularies split too).
  int chunks = 0;
};

// Most chunks a row of the split path (the merging warp owns kMaxTopKChunks / 32 lists a lane).
inline constexpr int kMaxTopKChunks = 64;

// The split TopKLogprobsCuda picks: about 1024 CTAs over all rows (a few per SM of an H200),
// chunks of at least 1024 tokens, at most kMaxTopKChunks; 1 (no split) when that leaves one.
// Depends on the sizes only, so a captured launch keeps its shape.
int TopKChunks(int64_t num_rows, int64_t vocab_size);

// Workspace bytes of the split path for these sizes with `chunks` (0: TopKChunks()); 0 when the
// row is not split. With chunks = 0 the result also covers every smaller num_rows and k, so a
// buffer reserved for a step's largest shape serves all of its buckets.
int64_t TopKWorkspaceBytes(int64_t num_rows, int64_t vocab_size, int k, int chunks = 0);

cudaError_t TopKLogprobsCuda(const TopKLogprobsParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_TOPK_H_
