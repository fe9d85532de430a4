// The standalone draft model drafter (engine/draft/drafter.h has the Drafter contract).
#ifndef SPECD_ENGINE_DRAFT_DRAFT_MODEL_DRAFTER_H_
#define SPECD_ENGINE_DRAFT_DRAFT_MODEL_DRAFTER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/backend.h"
#include "engine/draft/drafter.h"

namespace specd {

struct DraftModelDrafterOptions {
  // Take each level's children from Backend::ForwardTopK() (the top-k computed where the
  // logits are) instead of copying full logit rows to the host. Same trees either way.
  bool backend_topk = true;
  // Keep a step's scratch KV until the next step and commit the accepted path from it
  // (DraftRequest::accepted_node) instead of feeding those tokens again. Same trees either way.
  bool reuse_kv = true;
};

// EAGLE-2 style dynamic tree over a standalone draft model (any checkpoint with the target's
// vocabulary), on the backend that owns the draft model's weights and KV cache:
//   1. feed the new tokens as a chain (they stay in the draft KV cache);
//   2. the root's top-k children by draft log-probability form the first level;
//   3. per depth level, expand the top-k nodes of that level by cumulative draft
//      log-probability (one batched forward over all sequences per level), each expansion
//      adding the node's top-k children;
//   4. keep the max_nodes best nodes overall by cumulative log-probability. Because a child's
//      cumulative log-probability never exceeds its parent's, the best nodes are closed under
//      ancestors; ties are broken parent first. Nodes that cannot make the final cut are never
//      expanded.
// The returned tree's draft_logprobs are the cumulative log-probabilities; children of a node
// are listed best first.
//
// KV reuse (reuse_kv). The step's scratch region (the fed chain, then every expanded node) stays
// in the draft model until the sequence's next Draft(). That call commits the chain plus the
// expanded prefix of the path to DraftRequest::accepted_node when the path's tokens begin
// new_tokens, and feeds only the rest (the bonus token, and accepted leaves that were never
// expanded); otherwise (no outcome reported, the tokens disagree: a resync after target-only
// steps or a switch of drafter) it commits the chain alone and feeds all of new_tokens. So the
// draft KV holds at most the sequence's tokens plus one step's expanded nodes. A Draft() that
// fails after committing keeps note of the tokens it committed and skips them when retried.
class DraftModelDrafter : public Drafter {
 public:
  // `model` must outlive the drafter and is driven only by it.
  explicit DraftModelDrafter(Backend* model, DraftModelDrafterOptions options = {});

  absl::Status AddSequence(SeqId seq) override;
  absl::Status Release(SeqId seq) override;
  bool HasSequence(SeqId seq) const override;
  absl::Status CheckRequest(const DraftRequest& request) const override;
  absl::StatusOr<std::vector<TokenTree>> Draft(absl::Span<const DraftRequest> requests) override;
  int vocab_size() const override { return vocab_size_; }

  // Tokens fed through the draft model so far (chains and expanded nodes of successful
  // forwards): what kept KV saves shows here.
  int64_t fed_tokens() const { return fed_tokens_; }

 private:
  // A sequence's scratch region kept from its last Draft() (reuse_kv).
  struct KeptStep {
    int32_t chain = 0;                  // chain tokens at scratch 0 .. chain - 1
    TokenTree tree;                     // the returned tree
    std::vector<int32_t> tree_scratch;  // per tree node: its scratch index, -1 if not expanded
  };
  struct SeqState {
    std::optional<KeptStep> kept;
    // A prefix of the next new_tokens that is already committed (a failed Draft() after the
    // outcome was applied).
    std::vector<int32_t> carried;
  };

  // Applies the previous step's outcome to `request`'s sequence and returns how many of its
  // new_tokens the draft KV now holds.
  absl::StatusOr<int> ApplyOutcome(const DraftRequest& request);
  // Every row's best `k` (capped at the vocabulary) for one level.
  absl::Status LevelTopK(absl::Span<const ForwardItem> items, int k, TopKRows* out);

  Backend* model_;
  DraftModelDrafterOptions options_;
  int vocab_size_;
  absl::flat_hash_map<SeqId, SeqState> states_;
  std::vector<float> logits_;  // host top-k path only
  int64_t fed_tokens_ = 0;
};

}  // namespace specd

#endif  // SPECD_ENGINE_DRAFT_DRAFT_MODEL_DRAFTER_H_
