// Token sampling on the GPU with exactly the semantics of engine/sampling.h SampleToken, so a
// seeded request draws the same tokens on either backend: greedy is the argmax with the lowest
// id on ties; otherwise Gumbel-max over the tokens kept by min-p, then top-k, then top-p of
// softmax(logits / temperature), with noise from Philox keyed by (seed, position, token id)
// (specd/kernels/philox.h), decided in fp64 like the host. Min-p keeps the tokens with
// exp((logit - max) / temperature) >= min_p, in fp64 as the host (a prefix of the sorted order, so
// its threshold is the smallest kept key); a token within an ulp of exp's rounding of that
// boundary may be kept on one side only.
//
// With a workspace, greedy rows and temperature rows without min-p/top-k/top-p are split over the
// vocabulary: CTAs of 4096 tokens each find their chunk's argmax (greedy) or Gumbel-max winner,
// and the last CTA of a row to finish (a ticket counter) reduces the chunks' partials, so one
// launch keeps every SM busy even for a single row. Rows with top-k or top-p (and every row when
// no workspace is given) take one CTA per row: top-k and top-p thresholds are found by a radix
// descent over 64-bit keys (orderable logit, inverted id), i.e. the host's sort order, 4 bits per
// pass with per-thread histograms, stopping as soon as the boundary element is unique. The Gumbel
// pass only draws noise for tokens that can still win (noise lies in [-3.7, 37.5], so a token more
// than 41.2 below the best scaled logit cannot), screens them in fp32 and re-scores the near-best
// in fp64. Top-p's cumulative mass is summed in parallel, so on a boundary closer than ~1e-15 to
// top_p the kept set may differ from the host's sequential sum.
//
// Tensor parallelism splits the vocabulary: a rank holds the logits of ids [vocab_offset,
// vocab_offset + vocab_size), keys the noise by global ids (so a shard scores its tokens exactly
// as the full row does) and, for greedy and plain-temperature rows, reduces its shard to one
// SampleCandidate; ReduceCandidatesCuda picks the row's token from the ranks' candidates, which
// is SampleToken() of the full row (engine/tp/tp_plan.h ShardCandidate / ReduceCandidates).
#ifndef SPECD_KERNELS_CUDA_SAMPLING_H_
#define SPECD_KERNELS_CUDA_SAMPLING_H_

#include "specd/kernels/cuda/common.h"

namespace specd {
namespace cuda {

// One logits row's sampling parameters: engine/sampling.h SamplingParams plus the absolute
// position of the token it draws.
struct SampleRowParams {
  uint64_t seed = 0;
  int64_t position = 0;
  float temperature = 0.0f;  // <= 0: greedy
  float top_p = 1.0f;        // (0, 1]
  int32_t top_k = 0;         // 0: no limit
  float min_p = 0.0f;        // [0, 1]; 0: off
};

// One rank's best token of a vocabulary shard (engine/tp/tp_plan.h VocabCandidate), laid out for
// an all-gather.
struct alignas(16) SampleCandidate {
  double score;   // logit (greedy) or logit / temperature + Gumbel noise, fp64; -inf if none
  int32_t token;  // global token id; -1: no candidate (a row not allowed in candidate mode)
  int32_t pad;
};

struct SampleParams {
  const float* logits = nullptr;  // [num_rows, logits_stride] fp32, device
  int64_t logits_stride = 0;
  const SampleRowParams* rows = nullptr;  // [num_rows] device
  // [num_rows] int32, device: the sampled (global) token ids; unused (may be null) when
  // `candidates` is set.
  int32_t* tokens = nullptr;
  int64_t num_rows = 0;
  int64_t vocab_size = 0;
  // [SampleWorkspaceBytes(num_rows, vocab_size)] bytes, device, 16-byte aligned; null: every
  // row takes the one-CTA-per-row path (same tokens, slower for greedy and plain temperature).
  void* workspace = nullptr;
  // Global id of logits column 0 (tensor-parallel vocabulary shard): Philox noise is keyed by and
  // tokens are reported as global ids. 0 for a full row. vocab_offset + vocab_size <= 2^31.
  int64_t vocab_offset = 0;
  // Optional: instead of tokens, write each row's best (score, global id) over this shard for
  // rows whose sampling is greedy or temperature without filters (top_k == 0, top_p >= 1,
  // min_p == 0:
  // engine/tp/tp_plan.h VocabParallelSamplingSupported), the only rows allowed when set; the row
  // parameters live on the device, so any other row gets token -1 and score -inf. score = logit
  // for greedy, logit / temperature + Gumbel noise otherwise, in fp64, as ShardCandidate.
  SampleCandidate* candidates = nullptr;  // [num_rows] device
  // Optional, [num_rows] device: each row's kept set as a threshold on the 64-bit sort key
  // (orderable fp32 logit bits << 32 | ~token id, kernels/cuda/device_utils.cuh SortKey): the
  // tokens min-p, top-k and top-p keep are exactly those whose key >= kept_lower[row]; 0 when
  // the row keeps every token (greedy, no filter). What processed log-probabilities of sampled
  // rows are normalised over (TopKLogprobsParams::kept_lower). Not with `candidates`.
  uint64_t* kept_lower = nullptr;
};

// Workspace bytes that SampleCuda's split path needs for these sizes.
int64_t SampleWorkspaceBytes(int64_t num_rows, int64_t vocab_size);

cudaError_t SampleCuda(const SampleParams& p, cudaStream_t stream);

struct ReduceCandidatesParams {
  // [world_size, num_rows] device (rank-major, as an all-gather produces).
  const SampleCandidate* candidates = nullptr;
  int world_size = 1;
  int64_t num_rows = 0;
  // [num_rows] int32, device: the highest score, lowest id on ties, skipping token -1
  // (engine/tp/tp_plan.h ReduceCandidates); -1 if every rank's candidate is empty.
  int32_t* tokens = nullptr;
};

cudaError_t ReduceCandidatesCuda(const ReduceCandidatesParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace specd

#endif  // SPECD_KERNELS_CUDA_SAMPLING_H_
