// The k most likely next tokens of a logits row with their log-probabilities: what a drafter
// needs from a draft model's forward pass instead of the full [vocab] row.
//
// Order: higher logit first, lower id first among equal logits (greedy SampleToken's tie rule);
// NaN ranks as -inf so that one broken logit cannot break the order. Log-probabilities are
// logit - logsumexp(row): each exponential in fp32 (a polynomial, within 2 ulp), summed in fp64
// in a fixed order of lanes, so a row gives the same bits on every x86 ISA and however it was
// computed, and equals the fp64 sum to fp32 rounding (2 epsilon relative).
#ifndef SPECD_ENGINE_TOPK_H_
#define SPECD_ENGINE_TOPK_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace specd {

// Largest k a backend's native ForwardTopK() serves (kernels/cuda/topk.cu keeps k candidates
// per thread in registers); Backend::ForwardTopK() refuses more.
inline constexpr int kMaxForwardTopK = 16;

// Rows of top-k results, [rows, k] row-major (host).
struct TopKRows {
  int k = 0;  // entries per row: min(requested k, vocab size)
  std::vector<int32_t> ids;
  std::vector<float> logprobs;

  int64_t rows() const { return k == 0 ? 0 : static_cast<int64_t>(ids.size()) / k; }
};

// Writes the min(k, row.size()) best tokens of `row` ([vocab] fp32 logits, host) to `ids` and
// their log-probabilities to `logprobs`, best first. One pass for the selection, one for the
// sum; no allocation.
void RowTopKLogprobs(absl::Span<const float> row, int k, int32_t* ids, float* logprobs);

}  // namespace specd

#endif  // SPECD_ENGINE_TOPK_H_
