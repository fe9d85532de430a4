// RouterLoop's own n-gram drafter (local_ngram_): prompt lookup over a sequence's history in the
// router, microseconds and no state to feed. It serves speculation = ngram while the draft
// service cannot, and gives `auto` a second drafter beside the model drafter: every step the
// plan proposes an n-gram chain for each auto sequence, and the goodput policy takes it where it
// serves the batch better than the model drafter's shapes or none (GoodputPolicy::Decide). A
// step that verifies the proposal is, for the model drafter, a step without drafts: its service
// is not called, the sequence's new tokens wait for its next draft step (or an ingest), and the
// report of the accepted node of its last tree waits with them (ApplyVerifyResult).
#include <algorithm>

#include "common/token_tree.h"
#include "services/router/router_loop.h"
#include "services/router/router_sequence.h"

namespace specd {

void RouterLoop::ProposeNgram(Sequence& seq, PolicySequence* p) const {
  seq.ngram_tree = TokenTree();
  if (local_ngram_ == nullptr || seq.request.speculation != v1::SPECULATION_AUTO ||
      seq.request.shape_explicit || !options_.adaptive || !options_.auto_ngram || seq.hit_ready) {
    return;
  }
  int depth = 0;
  for (const int d : options_.policy.ngram_depths) depth = std::max(depth, d);
  depth = std::min(depth, seq.core->MaxUsefulDraftDepth());
  if (depth <= 0) return;
  // A chain: the policy cuts it to the depth it prices best, which a chain's prefix is.
  seq.ngram_tree = local_ngram_->Propose(seq.core->tokens(), DraftParams{depth, 1, depth});
  p->ngram_depth = TreeMaxDepth(seq.ngram_tree);
}

bool RouterLoop::DraftLocally(Sequence& seq, const SpecShape& shape) {
  if (seq.ngram_now) {
    seq.tree = std::move(seq.ngram_tree);
    const int depth = std::min(shape.depth, seq.tree.size());
    seq.tree.tokens.resize(depth);
    seq.tree.parents.resize(depth);
    if (!seq.tree.draft_logprobs.empty()) seq.tree.draft_logprobs.resize(depth);
    // The response's mode names the model drafter where it drafted.
    if (seq.mode == v1::SPECULATION_OFF) seq.mode = v1::SPECULATION_NGRAM;
    return true;
  }
  if (seq.spec == v1::SPECULATION_NGRAM && (seq.draft == nullptr || !seq.draft->up ||
                                            seq.draft_failed || seq.draft->in_flight != nullptr)) {
    seq.tree = local_ngram_->Propose(seq.core->tokens(),
                                     DraftParams{shape.depth, shape.top_k, shape.max_nodes});
    seq.mode = v1::SPECULATION_NGRAM;
    return true;
  }
  return false;
}

}  // namespace specd
