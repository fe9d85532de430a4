// The standalone draft model drafter (engine/draft/drafter.h has the Drafter contract).
#ifndef SPECD_ENGINE_DRAFT_DRAFT_MODEL_DRAFTER_H_
#define SPECD_ENGINE_DRAFT_DRAFT_MODEL_DRAFTER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/backend.h"
#include "engine/draft/drafter.h"

namespace specd {

// EAGLE-2 style dynamic tree over a standalone draft model (any checkpoint with the target's
// vocabulary), on the backend that owns the draft model's weights and KV cache:
//   1. feed the new tokens as a chain (they stay in the draft KV cache);
//   2. the root's top-k children by draft log-probability form the first level;
//   3. per depth level, expand the top-k nodes of that level by cumulative draft
//      log-probability (one batched Forward() over all sequences per level), each expansion
//      adding the node's top-k children;
//   4. keep the max_nodes best nodes overall by cumulative log-probability. Because a child's
//      cumulative log-probability never exceeds its parent's, the best nodes are closed under
//      ancestors; ties are broken parent first. Nodes that cannot make the final cut are never
//      expanded.
// The returned tree's draft_logprobs are the cumulative log-probabilities; children of a node
// are listed best first. The draft tree's scratch KV is dropped at the end of the step.
class DraftModelDrafter : public Drafter {
 public:
  // `model` must outlive the drafter and is driven only by it.
  explicit DraftModelDrafter(Backend* model);

  absl::Status AddSequence(SeqId seq) override;
  absl::Status Release(SeqId seq) override;
  bool HasSequence(SeqId seq) const override;
  absl::Status CheckRequest(const DraftRequest& request) const override;
  absl::StatusOr<std::vector<TokenTree>> Draft(absl::Span<const DraftRequest> requests) override;
  int vocab_size() const override { return vocab_size_; }

 private:
  Backend* model_;
  int vocab_size_;
};

}  // namespace specd

#endif  // SPECD_ENGINE_DRAFT_DRAFT_MODEL_DRAFTER_H_
