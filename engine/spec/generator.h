// In-process speculative generation over a target Backend and an optional Drafter: the
// reference loop that tests and benchmarks run and that the router's loop mirrors across gRPC.
// Each step plans every active sequence's tree shape (the goodput policy for requests with
// auto_shape, the request's own shape otherwise), drafts one tree for every sequence that
// speculates in one Drafter::Draft() call, verifies all of them in one Backend::Verify() call,
// and applies each outcome with SequenceState (stop logic, acceptance, statistics); the next
// draft step reports each tree's accepted node to the drafter, as the router does, so a drafter
// that keeps its KV commits the accepted path instead of feeding it again. Without a
// drafter (or for a request with speculate = false) a step is Verify() with an empty tree: plain
// target-only decoding through the same sampler, which is why speculative output equals
// target-only output token for token (docs/architecture.md, lossless verification).
#ifndef SPECD_ENGINE_SPEC_GENERATOR_H_
#define SPECD_ENGINE_SPEC_GENERATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/backend.h"
#include "engine/draft/drafter.h"
#include "engine/draft/ngram_drafter.h"
#include "engine/sampling.h"
#include "engine/spec/policy.h"
#include "engine/spec/sequence_state.h"

namespace specd {

struct GenerationRequest {
  std::vector<int32_t> prompt;
  // With min_tokens, the generator masks the config's eos ids and stop_token_ids (added to
  // sampling.min_tokens_stop_ids) until min_tokens tokens were generated.
  SamplingParams sampling;
  int max_new_tokens = 64;
  // End the sequence as the target's eos ids do (the config's eos ids apply unless ignore_eos).
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  bool speculate = true;  // false: target-only even when the generator has a drafter
  // true: the generator's goodput policy picks the tree shape every step (down to none);
  // false: every step drafts exactly `draft` (cut to what the budget can still use).
  bool auto_shape = false;
  DraftParams draft;
  // VerifyItem::logprobs and logprobs_mode: -1 none, 0 the emitted tokens', n also the top n.
  int logprobs = -1;
  LogprobsMode logprobs_mode = LogprobsMode::kRaw;
};

struct GenerationResult {
  std::vector<int32_t> tokens;  // generated ids, ending with the stop token when one stopped it
  FinishReason finish_reason = FinishReason::kNone;
  SpecStats stats;
  // One per token when the request asked for logprobs, else empty.
  std::vector<TokenLogprobs> logprobs;
};

// Called after each step with the tokens a request gained (never tokens past its stop).
using TokenCallback = std::function<void(size_t request_index, absl::Span<const int32_t> tokens)>;

struct GeneratorOptions {
  PolicyOptions policy;  // for requests with auto_shape
  // Requests with auto_shape also get n-gram prompt lookup as a second drafter beside the
  // generator's drafter, as the router's auto does: each step the policy may verify the n-gram
  // proposal instead of drafting (PolicySequence::ngram_depth), and the drafter is then not
  // called for that sequence. Off by default, so that the generator's auto measures its
  // drafter alone.
  bool auto_ngram = false;
  NgramOptions ngram;
};

class Generator {
 public:
  // `target` and `drafter` must outlive the generator; `drafter` may be null (speculation
  // off). INVALID_ARGUMENT when the drafter's vocabulary differs from the target's.
  static absl::StatusOr<std::unique_ptr<Generator>> Create(
      Backend* target, Drafter* drafter, GeneratorOptions options = GeneratorOptions());

  // Runs all requests to completion as one continuously batched group and returns their
  // results in order. Sequence ids are allocated internally and released before returning.
  absl::StatusOr<std::vector<GenerationResult>> Generate(
      absl::Span<const GenerationRequest> requests, const TokenCallback& on_tokens = nullptr);

 private:
  Generator(Backend* target, Drafter* drafter, GeneratorOptions options,
            std::unique_ptr<NgramDrafter> ngram)
      : target_(target),
        drafter_(drafter),
        ngram_(std::move(ngram)),
        policy_(std::move(options.policy)) {}

  Backend* target_;
  Drafter* drafter_;
  std::unique_ptr<NgramDrafter> ngram_;  // GeneratorOptions::auto_ngram; null without
  // Keeps its measured costs across Generate() calls.
  GoodputPolicy policy_;
  SeqId next_seq_ = 1;
};

}  // namespace specd

#endif  // SPECD_ENGINE_SPEC_GENERATOR_H_
