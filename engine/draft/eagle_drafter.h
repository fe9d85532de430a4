// The EAGLE drafter (engine/draft/drafter.h has the Drafter contract): an EAGLE head
// (engine/draft/eagle_head.h) fed with the target's hidden states, growing EAGLE-2 dynamic
// trees with the tree builder the draft-model drafter uses (engine/draft/tree_builder.h).
//
// Per sequence the drafter keeps the tokens it was sent and the taps it has not fed yet. The
// head's committed KV holds pairs (target taps at p, token p + 1) for p < c, all from the
// target's real hidden states: a step first feeds, as one chain, every pair whose taps and
// next token have arrived, and commits it. When that reaches the last token (c = tokens - 1),
// the chain's last output is the root: its top-k over the draft vocabulary, mapped to target ids
// by d2t, are the first level, each node being (its parent's output hidden state, its token) at
// position c + depth; deeper levels feed the head's own outputs, one batched Forward() per level
// across sequences. The tree's nodes are dropped from the head's KV afterwards: the next step
// feeds the accepted ones again with the target's taps. A sequence whose taps have not arrived
// yet (the first step, before any verify step) gets an empty tree, which makes its step
// target-only; one whose taps resume after a gap (rows the verify service dropped) restarts its
// head from the rows after it. Lossless either way.
#ifndef SPECD_ENGINE_DRAFT_EAGLE_DRAFTER_H_
#define SPECD_ENGINE_DRAFT_EAGLE_DRAFTER_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/draft/drafter.h"
#include "engine/draft/eagle_head.h"

namespace specd {

class EagleDrafter : public Drafter {
 public:
  // `head` must outlive the drafter and is driven only by it.
  explicit EagleDrafter(EagleHead* head);

  absl::Status AddSequence(SeqId seq) override;
  absl::Status Release(SeqId seq) override;
  bool HasSequence(SeqId seq) const override;
  // Also: taps whose size is not a whole number of feature rows, or a negative first position
  // (INVALID_ARGUMENT naming taps).
  absl::Status CheckRequest(const DraftRequest& request) const override;
  absl::StatusOr<std::vector<TokenTree>> Draft(absl::Span<const DraftRequest> requests) override;
  int vocab_size() const override { return head_->config().vocab_size; }
  std::vector<int> tap_layers() const override { return head_->config().taps; }

  // Pairs fed through the head so far (chains and tree nodes).
  int64_t fed_tokens() const { return fed_tokens_; }
  // The sequence position up to which the head's committed KV holds `seq`'s pairs (its base
  // plus the pairs it holds; for tests), -1 for an unknown sequence.
  int64_t committed(SeqId seq) const;

 private:
  struct SeqState {
    std::vector<int32_t> tokens;  // every token of the sequence received so far
    // Taps not yet fed, for positions [taps_first, taps_first + rows).
    std::vector<float> taps;
    int64_t taps_first = 0;
    // new_tokens of a step that failed after its chain was committed; skipped when resent.
    std::vector<int32_t> carried;
    // The sequence position of the head's position 0: 0, or where the taps began when they
    // began mid-sequence (a draft service that took the sequence over while it ran, after a
    // restart), the head then holding only the pairs from there on.
    int64_t base = 0;
  };

  // Adds `r`'s tokens and taps to its sequence's state.
  void Merge(const DraftRequest& r, SeqState& state) const;

  EagleHead* head_;
  int feature_size_;
  absl::flat_hash_map<SeqId, SeqState> states_;
  int64_t fed_tokens_ = 0;
};

}  // namespace specd

#endif  // SPECD_ENGINE_DRAFT_EAGLE_DRAFTER_H_
