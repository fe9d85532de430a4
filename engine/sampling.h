// Sampling parameters and the position-keyed sampler shared by target-only decoding and tree
// verification. Randomness comes from Philox keyed by (seed, absolute position), so the token
// drawn at a position depends only on the prefix, the seed and the position (DESIGN.md).
#ifndef SPECD_ENGINE_SAMPLING_H_
#define SPECD_ENGINE_SAMPLING_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace specd {

struct SamplingParams {
  float temperature = 0.0f;  // 0 = greedy
  int top_k = 0;             // 0 = no limit
  float top_p = 1.0f;        // (0, 1]
  uint64_t seed = 0;

  bool greedy() const { return temperature <= 0.0f; }
};

// Checks the ranges; errors name the field (temperature, top_k, top_p).
absl::Status ValidateSamplingParams(const SamplingParams& params);

// Draws the token at absolute position `position` from `logits` ([vocab] fp32, host).
// Greedy: argmax, lowest id on ties. Otherwise Gumbel-max over the tokens kept by top-k and
// top-p of softmax(logits / temperature), with Philox noise keyed by (seed, position, token).
int32_t SampleToken(absl::Span<const float> logits, const SamplingParams& params,
                    int64_t position);

// The distribution SampleToken draws from (after temperature, top-k, top-p), [vocab]; for tests.
std::vector<double> TargetDistribution(absl::Span<const float> logits,
                                       const SamplingParams& params);

// Uniform (0, 1) from Philox-4x32-10 keyed by seed at counter (position, index).
double PhiloxUniform(uint64_t seed, uint64_t position, uint32_t index);

}  // namespace specd

#endif  // SPECD_ENGINE_SAMPLING_H_
