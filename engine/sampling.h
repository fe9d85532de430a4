// Sampling parameters, the logits processors that read a sequence's history, the position-keyed
// sampler shared by target-only decoding and tree verification, and log-probabilities. Randomness
// comes from Philox keyed by (seed, absolute position), so the token drawn at a position depends
// only on the prefix, the seed and the position (docs/architecture.md, lossless verification).
//
// Order of operations, as vLLM's v1 sampler (vllm/v1/sample/sampler.py) applies them, so that
// a request gives what users comparing with vLLM expect:
//   ProcessLogits(), before temperature (these change greedy choices too):
//     1. min_tokens: the EOS and stop ids get -inf while the output has fewer than
//        min_tokens tokens;
//     2. logit_bias: added;
//     3. penalties: repetition (every token of the prompt or the output: positive logits
//        divided by it, negative ones multiplied), then frequency (minus penalty x count in the
//        output), then presence (minus penalty once for a token the output holds);
//   SampleToken():
//     4. greedy (temperature 0): the argmax, here;
//     5. temperature;
//     6. min_p: tokens whose probability is below min_p x that of the most likely go;
//     7. top-k, then 8. top-p over what is left, renormalised;
//     9. a Gumbel-max draw with Philox noise keyed by (seed, position, token).
// vLLM applies min_p before top-k/top-p (it is an argmax-invariant logits processor that runs
// right after temperature); the order matters for top-p, which renormalises what min_p kept.
//
// Under speculation every tree node is sampled with the history of its own path (the committed
// tokens, then its tree ancestors and itself), which is why a verified tree gives the tokens
// target-only decoding gives.
#ifndef SPECD_ENGINE_SAMPLING_H_
#define SPECD_ENGINE_SAMPLING_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/types/span.h"

namespace specd {

struct SamplingParams {
  float temperature = 0.0f;  // 0 = greedy
  int top_k = 0;             // 0 = no limit
  float top_p = 1.0f;        // (0, 1]
  float min_p = 0.0f;        // [0, 1]; 0 = off
  uint64_t seed = 0;

  // Logits processors (steps 1-3 above).
  // (token id, bias in [-100, 100]), distinct ids, any order.
  std::vector<std::pair<int32_t, float>> logit_bias;
  float repetition_penalty = 1.0f;  // > 0; 1 = off; over the prompt and the output
  float presence_penalty = 0.0f;    // [-2, 2]; over the output
  float frequency_penalty = 0.0f;   // [-2, 2]; over the output
  int min_tokens = 0;               // >= 0
  // The ids masked while the output has fewer than min_tokens tokens: the model's EOS ids and
  // the request's stop token ids (vLLM masks EOS even with ignore_eos).
  std::vector<int32_t> min_tokens_stop_ids;

  bool greedy() const { return temperature <= 0.0f; }
  bool has_penalties() const {
    return repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f;
  }
  // Whether ProcessLogits() changes anything: the row may be sampled as it is otherwise.
  bool has_processors() const {
    return has_penalties() || !logit_bias.empty() ||
           (min_tokens > 0 && !min_tokens_stop_ids.empty());
  }
  // Whether ProcessLogits() needs the sequence's TokenHistory.
  bool needs_history() const { return has_penalties() || min_tokens > 0; }
};

// Checks the ranges; errors name the field (temperature, top_k, top_p, min_p, logit_bias[id],
// repetition_penalty, presence_penalty, frequency_penalty, min_tokens,
// min_tokens_stop_ids[i]). Token ids are checked against `vocab_size` when it is > 0.
absl::Status ValidateSamplingParams(const SamplingParams& params, int vocab_size = 0);

// What the penalties and min_tokens see of a sequence: which ids its prompt holds, how often
// each id occurs in its output, and the output's length. Kept by whoever drives the sequence
// (the Generator, the verify service), only for requests whose sampling needs_history().
class TokenHistory {
 public:
  struct Counts {
    bool in_prompt = false;
    int32_t output = 0;  // occurrences in the output
  };

  void AddPrompt(absl::Span<const int32_t> tokens);
  void AddOutput(absl::Span<const int32_t> tokens);
  // Undoes AddOutput(tokens) (a verify step that failed after its pending tokens were added).
  void RemoveOutput(absl::Span<const int32_t> tokens);

  int64_t output_length() const { return output_length_; }
  const absl::flat_hash_map<int32_t, Counts>& tokens() const { return tokens_; }

 private:
  absl::flat_hash_map<int32_t, Counts> tokens_;
  int64_t output_length_ = 0;
};

// Steps 1-3: writes to `out` ([vocab], resized) the logits ([vocab] fp32, host) of a sequence
// whose tokens so far are `history` followed by the output tokens `path` (for a tree node: its
// ancestors in the tree, then itself). `history` may be null only when
// !params.needs_history(). The result does not depend on the order of `path`.
void ProcessLogits(absl::Span<const float> logits, const SamplingParams& params,
                   const TokenHistory* history, absl::Span<const int32_t> path,
                   std::vector<float>* out);

// Steps 4-9: the token at absolute position `position` from `logits` ([vocab] fp32, host:
// ProcessLogits()' output, or the raw row when !params.has_processors()). Greedy: argmax,
// lowest id on ties. Otherwise Gumbel-max over the tokens kept by min-p, top-k and top-p of
// softmax(logits / temperature), with Philox noise keyed by (seed, position, token).
int32_t SampleToken(absl::Span<const float> logits, const SamplingParams& params,
                    int64_t position);

// The distribution SampleToken draws from (after temperature, min-p, top-k, top-p), [vocab];
// for tests.
std::vector<double> TargetDistribution(absl::Span<const float> logits,
                                       const SamplingParams& params);

// Uniform (0, 1) from Philox-4x32-10 keyed by seed at counter (position, index).
double PhiloxUniform(uint64_t seed, uint64_t position, uint32_t index);

// ---------------------------------------------------------------------------------------------
// Log-probabilities of emitted tokens (the OpenAI API's logprobs / top_logprobs).

inline constexpr int kMaxLogprobs = 20;

// Which distribution log-probabilities describe (vLLM's logprobs_mode, whose default is raw):
//   kRaw: the model's own, log_softmax(logits), before every processor, temperature and
//     filter. Independent of the sampling parameters: what lm-eval-style scoring wants.
//   kProcessed: the one the token was drawn from. Greedy: log_softmax of the processed logits
//     (steps 1-3; no temperature, as vLLM). Sampling: after temperature, min-p, top-k and
//     top-p, so tokens outside the kept set have probability 0 and are never listed.
enum class LogprobsMode { kRaw, kProcessed };

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
};

struct TokenLogprobs {
  float logprob = 0.0f;  // of the emitted token
  int32_t rank = 1;      // 1 + the number of tokens with a strictly higher log-probability
  // The n most likely tokens (fewer in processed mode when fewer have a non-zero probability),
  // most likely first, lowest id first on ties.
  std::vector<TokenLogprob> top;
};

// Log-probabilities of `token` and the `n` (0..kMaxLogprobs) most likely tokens. `raw` is the
// model's row ([vocab] fp32, host); `processed` is ProcessLogits()' output for it (the raw row
// again when the sampling has no processors); `params` is only read in processed mode.
TokenLogprobs ComputeLogprobs(absl::Span<const float> raw, absl::Span<const float> processed,
                              const SamplingParams& params, LogprobsMode mode, int32_t token,
                              int n);

}  // namespace specd

#endif  // SPECD_ENGINE_SAMPLING_H_
