// The speculation core: per-sequence bookkeeping of the speculation loop, shared by the
// in-process Generator and the router (which adds only transport and text): which tokens the
// target and the drafter have not seen yet, how deep a draft is still worth making, which tree
// shape this step runs (the goodput policy's input and output, engine/spec/policy.h), applying
// a verify outcome, where the output stops when one verify step emits several tokens at once
// (the one EOS rule), and the statistics. It touches no model and no proto.
#ifndef SPECD_ENGINE_SPEC_SEQUENCE_STATE_H_
#define SPECD_ENGINE_SPEC_SEQUENCE_STATE_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/token_tree.h"
#include "engine/backend.h"
#include "engine/spec/policy.h"

namespace specd {

struct StopConditions {
  int max_new_tokens = 256;  // >= 1
  // A generated token in either list ends the sequence and is the last token of the output
  // (kept in the ids so callers see why it stopped; detokenizers skip special tokens).
  std::vector<int32_t> eos_token_ids;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;  // eos_token_ids do not stop (stop_token_ids still do)
  // Context limit: the sequence ends (kLength) once prompt + output reaches it; 0 = none.
  int64_t max_total_tokens = 0;

  // The eos ids that end the sequence (none with ignore_eos): the one EOS rule, also for the
  // router's text stream.
  std::vector<int32_t> ActiveEosIds() const;
};

enum class FinishReason {
  kNone,    // still running
  kLength,  // max_new_tokens or max_total_tokens reached
  kStop,    // an eos or stop token was generated
};

const char* FinishReasonName(FinishReason reason);  // "none", "length", "stop"

// Speculation counters of one sequence (docs/metrics.md derives the rates from these).
struct SpecStats {
  int64_t steps = 0;              // verify steps
  int64_t draft_steps = 0;        // steps whose tree was not empty
  int64_t target_only_steps = 0;  // steps with an empty tree
  int64_t draft_tokens = 0;       // tree nodes proposed
  int64_t accepted_tokens = 0;    // draft tokens the verifier accepted
  // accepted_per_position[d]: steps whose accepted path reached depth d (0 = first draft
  // token). Counted as the verifier reported, before truncation at a stop.
  std::vector<int64_t> accepted_per_position;
  int64_t shape_changes = 0;  // steps whose tree shape differed from the previous step's
  // Of draft_steps: those whose tree was auto's n-gram proposal rather than the model drafter's
  // (SequenceState::Plan with `ngram`).
  int64_t ngram_steps = 0;

  void Add(const SpecStats& other);
};

// The levels of `tree` that a verify outcome's accepted path (`accepted_nodes`, tree node
// indices in order) reached, as AcceptanceEstimate::Observe takes them: at each level, how many
// children the path's node had and which of them (by rank: siblings are ordered best first)
// was accepted, ending with the level where none was (unless the path reached a leaf). Empty
// when `accepted_nodes` is not a path of `tree` from its top.
std::vector<LevelOutcome> PathLevels(const TokenTree& tree,
                                     absl::Span<const int32_t> accepted_nodes);

class SequenceState {
 public:
  // INVALID_ARGUMENT naming the field for an empty or out-of-vocabulary prompt, max_new_tokens
  // < 1, or a prompt that already fills max_total_tokens.
  static absl::StatusOr<SequenceState> Create(std::vector<int32_t> prompt,
                                              const StopConditions& stop, int vocab_size);

  // Tokens the target has not cached yet, to send as VerifyItem::pending: the prompt at the
  // first step, then the last emitted token.
  absl::Span<const int32_t> TargetPending() const;
  // Tokens the drafter has not been fed yet (DraftRequest::new_tokens); call MarkDrafterFed()
  // once they were handed over. A step without a draft leaves them for the next one.
  absl::Span<const int32_t> DrafterPending() const;
  void MarkDrafterFed() { drafter_fed_ = static_cast<int64_t>(tokens_.size()); }
  // The same for a hand-over whose answer came after more tokens were appended: the first
  // `tokens` of the sequence were fed.
  void MarkDrafterFedThrough(int64_t tokens) { drafter_fed_ = std::max(drafter_fed_, tokens); }
  // Prompt and output tokens so far.
  int64_t length() const { return static_cast<int64_t>(tokens_.size()); }

  // Deepest draft whose tokens could all be kept: a step emits accepted drafts plus one bonus
  // token, so this is the remaining budget minus one (0: draft nothing this step).
  int MaxUsefulDraftDepth() const;

  // The drafter lost this sequence's state (its stream or process was replaced): the next
  // draft feeds the whole history again.
  void ResetDrafter() { drafter_fed_ = 0; }
  // Likewise for the target: the next verify step feeds the whole history.
  void ResetTarget() { target_cached_ = 0; }

  // What the policy needs to decide this sequence's step. `model_draft`: drafted by the draft
  // model (its levels cost draft time) rather than by n-gram lookup. Its n-gram fields
  // (PolicySequence::ngram_acceptance, previous_ngram, steps_without_ngram) are this sequence's;
  // the caller sets ngram_depth where it has a proposal.
  PolicySequence PolicyInput(bool model_draft) const;
  // Records the shape this step runs (and why) before drafting. `ngram`: the tree will be
  // auto's n-gram proposal (PolicyDecision::ngram), whose outcome updates the n-gram estimate,
  // not the model drafter's; for the model drafter the step is one without drafts.
  void Plan(const SpecShape& shape, ShapeReason reason, bool ngram = false);
  // Records the shape the policy chose for this step before it moved the drafter's catch-up
  // beside verify (PolicyDecision::deferred); kept until the sequence is planned with a tree.
  void Defer(const SpecShape& shape) { deferred_ = shape; }
  const SpecShape& planned() const { return planned_; }
  ShapeReason planned_reason() const { return planned_reason_; }
  bool planned_ngram() const { return planned_ngram_; }
  const AcceptanceEstimate& acceptance() const { return acceptance_; }
  const AcceptanceEstimate& ngram_acceptance() const { return ngram_acceptance_; }

  // INTERNAL when `outcome` cannot come from verifying `tree` (token count, accepted length
  // deeper than the tree, tokens outside the vocabulary): checked before Apply for outcomes
  // that crossed a process boundary.
  static absl::Status CheckOutcome(const VerifyOutcome& outcome, const TokenTree& tree,
                                   int vocab_size);

  // Applies one verify step that fed TargetPending() and `tree` (the planned shape, or less
  // when the drafter proposed less): appends the emitted tokens up to and including the first
  // stop, and no further than the budget; updates the acceptance estimate and the statistics.
  // Returns the tokens appended (what to stream); tokens after the stop are dropped.
  absl::Span<const int32_t> Apply(const VerifyOutcome& outcome, const TokenTree& tree);
  // The same for callers that only know the tree's size (no acceptance update).
  absl::Span<const int32_t> Apply(const VerifyOutcome& outcome, int tree_size);

  bool finished() const { return finish_ != FinishReason::kNone; }
  FinishReason finish_reason() const { return finish_; }
  absl::Span<const int32_t> prompt() const {
    return absl::MakeConstSpan(tokens_).subspan(0, prompt_len_);
  }
  absl::Span<const int32_t> output() const {
    return absl::MakeConstSpan(tokens_).subspan(prompt_len_);
  }
  // The prompt then the output, in one span (what n-gram lookup searches).
  absl::Span<const int32_t> tokens() const { return tokens_; }
  const SpecStats& stats() const { return stats_; }

 private:
  SequenceState(std::vector<int32_t> prompt, const StopConditions& stop);

  bool IsStop(int32_t token) const;

  std::vector<int32_t> tokens_;  // prompt then output
  size_t prompt_len_ = 0;
  StopConditions stop_;
  int64_t target_cached_ = 0;  // tokens whose KV the target holds
  int64_t drafter_fed_ = 0;    // tokens the drafter has been fed
  FinishReason finish_ = FinishReason::kNone;
  SpecStats stats_;
  // Speculation planning.
  SpecShape planned_;
  ShapeReason planned_reason_ = ShapeReason::kPolicy;
  bool planned_ngram_ = false;
  bool last_planned_ngram_ = false;
  SpecShape last_run_;      // the shape the previous step ran (cut to its tree)
  SpecShape last_planned_;  // the shape the previous step was planned with
  // A new sequence counts as long without drafts: its acceptance is unknown, so where the
  // policy would not draft it, its first step probes.
  int steps_without_draft_ = 1 << 20;
  int steps_without_ngram_ = 1 << 20;  // likewise for the n-gram proposal
  bool probed_ = false;  // a step was planned with a model tree (the drafter may have sent none)
  SpecShape deferred_;   // PolicySequence::deferred
  AcceptanceEstimate acceptance_;        // the drafter's (model, EAGLE head, or n-gram mode's)
  AcceptanceEstimate ngram_acceptance_;  // auto's n-gram proposal's
  PolicyOptions acceptance_options_;
};

}  // namespace specd

#endif  // SPECD_ENGINE_SPEC_SEQUENCE_STATE_H_
