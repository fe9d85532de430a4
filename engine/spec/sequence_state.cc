#include "engine/spec/sequence_state.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace specd {

const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone: return "none";
    case FinishReason::kLength: return "length";
    case FinishReason::kStop: return "stop";
  }
  return "unknown";
}

std::vector<int32_t> StopConditions::ActiveEosIds() const {
  return ignore_eos ? std::vector<int32_t>() : eos_token_ids;
}

void SpecStats::Add(const SpecStats& o) {
  shape_changes += o.shape_changes;
  ngram_steps += o.ngram_steps;
  steps += o.steps;
  draft_steps += o.draft_steps;
  target_only_steps += o.target_only_steps;
  draft_tokens += o.draft_tokens;
  accepted_tokens += o.accepted_tokens;
  if (accepted_per_position.size() < o.accepted_per_position.size()) {
    accepted_per_position.resize(o.accepted_per_position.size(), 0);
  }
  for (size_t i = 0; i < o.accepted_per_position.size(); ++i) {
    accepted_per_position[i] += o.accepted_per_position[i];
  }
}

SequenceState::SequenceState(std::vector<int32_t> prompt, const StopConditions& stop)
    : tokens_(std::move(prompt)), prompt_len_(tokens_.size()), stop_(stop) {}

absl::StatusOr<SequenceState> SequenceState::Create(std::vector<int32_t> prompt,
                                                    const StopConditions& stop, int vocab_size) {
  if (prompt.empty()) return absl::InvalidArgumentError("prompt: empty");
  if (absl::Status s = CheckTokenIds(prompt, vocab_size, "prompt"); !s.ok()) return s;
  if (stop.max_new_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens: ", stop.max_new_tokens, " must be >= 1"));
  }
  if (stop.max_total_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_total_tokens: ", stop.max_total_tokens, " must be >= 0"));
  }
  if (stop.max_total_tokens > 0 && static_cast<int64_t>(prompt.size()) >= stop.max_total_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("prompt: ", prompt.size(),
                                                   " tokens leave no room in the context of ",
                                                   stop.max_total_tokens));
  }
  return SequenceState(std::move(prompt), stop);
}

absl::Span<const int32_t> SequenceState::TargetPending() const {
  return absl::MakeConstSpan(tokens_).subspan(target_cached_);
}

absl::Span<const int32_t> SequenceState::DrafterPending() const {
  return absl::MakeConstSpan(tokens_).subspan(drafter_fed_);
}

int SequenceState::MaxUsefulDraftDepth() const {
  if (finished()) return 0;
  int64_t left = stop_.max_new_tokens - static_cast<int64_t>(output().size());
  if (stop_.max_total_tokens > 0) {
    left = std::min<int64_t>(left, stop_.max_total_tokens - static_cast<int64_t>(tokens_.size()));
  }
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(left - 1, kMaxTreeNodes)));
}

PolicySequence SequenceState::PolicyInput(bool model_draft) const {
  PolicySequence p;
  p.pending = static_cast<int>(std::min<size_t>(TargetPending().size(), 1 << 20));
  p.max_depth = MaxUsefulDraftDepth();
  p.model_draft = model_draft;
  p.acceptance = &acceptance_;
  p.previous = last_planned_;
  p.previous_ngram = last_planned_ngram_;
  p.steps_without_draft = steps_without_draft_;
  p.steps_without_ngram = steps_without_ngram_;
  p.ngram_acceptance = &ngram_acceptance_;
  p.never_drafted = stats_.draft_steps - stats_.ngram_steps == 0 && !probed_;
  p.drafter_unfed = drafter_fed_ == 0;
  p.draft_backlog = static_cast<int>(std::min<size_t>(DrafterPending().size(), 1 << 20));
  p.deferred = deferred_;
  return p;
}

void SequenceState::Plan(const SpecShape& shape, ShapeReason reason, bool ngram) {
  ngram = ngram && !shape.none();
  if (!shape.none() && !ngram) {
    probed_ = true;
    deferred_ = SpecShape();
  }
  planned_ = shape;
  planned_reason_ = reason;
  planned_ngram_ = ngram;
}

std::vector<LevelOutcome> PathLevels(const TokenTree& tree,
                                     absl::Span<const int32_t> accepted_nodes) {
  std::vector<LevelOutcome> levels;
  if (tree.empty()) return levels;
  int32_t parent = -1;  // the path's node at the level above (-1: the tree's top)
  for (size_t level = 0; level <= accepted_nodes.size(); ++level) {
    const int32_t accepted = level < accepted_nodes.size() ? accepted_nodes[level] : -2;
    LevelOutcome out{0, -1};
    // Parents precede their children, so the path's children follow it in the node order.
    for (int32_t i = parent + 1; i < tree.size(); ++i) {
      if (tree.parents[i] != parent) continue;
      if (i == accepted) out.accepted_rank = out.siblings;
      ++out.siblings;
    }
    if (out.siblings == 0) {
      // A leaf: the path reached the bottom of its branch (a level with no candidates, which
      // the estimate counts where the shape is deeper), or the outcome does not fit the tree.
      if (accepted != -2) return {};
      levels.push_back(out);
      break;
    }
    if (accepted != -2 && out.accepted_rank < 0) return {};  // not a child of the path's node
    levels.push_back(out);
    if (accepted == -2) break;
    parent = accepted;
  }
  return levels;
}

absl::Status SequenceState::CheckOutcome(const VerifyOutcome& outcome, const TokenTree& tree,
                                         int vocab_size) {
  const int accepted = outcome.accepted_draft;
  if (accepted < 0 || static_cast<int>(outcome.tokens.size()) != accepted + 1 ||
      (tree.empty() ? accepted != 0 : accepted > TreeMaxDepth(tree)) ||
      (!outcome.accepted_nodes.empty() &&
       static_cast<int>(outcome.accepted_nodes.size()) != accepted)) {
    return absl::InternalError(absl::StrCat("the verifier returned ", outcome.tokens.size(),
                                            " tokens with ", accepted, " accepted drafts for a ",
                                            tree.size(), "-node tree"));
  }
  for (int32_t t : outcome.tokens) {
    if (t < 0 || t >= vocab_size) {
      return absl::InternalError(
          absl::StrCat("the verifier returned token ", t, " outside the vocabulary"));
    }
  }
  return absl::OkStatus();
}

absl::Span<const int32_t> SequenceState::Apply(const VerifyOutcome& outcome,
                                               const TokenTree& tree) {
  if (finished()) return {};
  // What ran: the planned shape, cut to the tree that arrived.
  SpecShape ran;
  if (!tree.empty()) {
    ran = planned_.none() ? SpecShape{TreeMaxDepth(tree), 1, static_cast<int>(tree.size())}
                          : planned_;
    ran.depth = std::min(ran.depth, TreeMaxDepth(tree));
    ran.max_nodes = static_cast<int>(tree.size());
    if (ran.max_nodes <= ran.depth) ran.top_k = 1;
    // The ranks the path took say whether a tree's siblings or its first children were
    // accepted; an outcome without its nodes is counted as a chain's.
    const std::vector<LevelOutcome> levels = PathLevels(tree, outcome.accepted_nodes);
    // Each drafter's outcomes go to its own estimate.
    AcceptanceEstimate& estimate = planned_ngram_ ? ngram_acceptance_ : acceptance_;
    if (!levels.empty() &&
        static_cast<int>(outcome.accepted_nodes.size()) == outcome.accepted_draft) {
      estimate.Observe(ran, levels, acceptance_options_);
    } else {
      estimate.Observe(ran, outcome.accepted_draft, acceptance_options_);
    }
  }
  // For the model drafter an n-gram step is one without drafts.
  const bool model_tree = !tree.empty() && !planned_ngram_;
  steps_without_draft_ = model_tree ? 0 : steps_without_draft_ + 1;
  steps_without_ngram_ = !tree.empty() && planned_ngram_ ? 0 : steps_without_ngram_ + 1;
  if (!tree.empty() && planned_ngram_) ++stats_.ngram_steps;
  if (stats_.steps > 0 && ran != last_run_) ++stats_.shape_changes;
  last_run_ = ran;
  last_planned_ = planned_;
  last_planned_ngram_ = planned_ngram_;
  planned_ = SpecShape();
  planned_ngram_ = false;
  return Apply(outcome, static_cast<int>(tree.size()));
}

bool SequenceState::IsStop(int32_t token) const {
  if (!stop_.ignore_eos && std::find(stop_.eos_token_ids.begin(), stop_.eos_token_ids.end(),
                                     token) != stop_.eos_token_ids.end()) {
    return true;
  }
  return std::find(stop_.stop_token_ids.begin(), stop_.stop_token_ids.end(), token) !=
         stop_.stop_token_ids.end();
}

absl::Span<const int32_t> SequenceState::Apply(const VerifyOutcome& outcome, int tree_size) {
  if (finished()) return {};
  ++stats_.steps;
  if (tree_size > 0) {
    ++stats_.draft_steps;
    stats_.draft_tokens += tree_size;
  } else {
    ++stats_.target_only_steps;
  }
  const int accepted = outcome.accepted_draft;
  stats_.accepted_tokens += accepted;
  if (static_cast<int>(stats_.accepted_per_position.size()) < accepted) {
    stats_.accepted_per_position.resize(accepted, 0);
  }
  for (int d = 0; d < accepted; ++d) ++stats_.accepted_per_position[d];

  // The verifier cached the pending tokens and the accepted path; the bonus token is pending.
  target_cached_ += static_cast<int64_t>(TargetPending().size()) + accepted;
  const size_t first = tokens_.size();
  for (int32_t token : outcome.tokens) {
    tokens_.push_back(token);
    if (IsStop(token)) {
      finish_ = FinishReason::kStop;
    } else if (static_cast<int64_t>(output().size()) >= stop_.max_new_tokens ||
               (stop_.max_total_tokens > 0 &&
                static_cast<int64_t>(tokens_.size()) >= stop_.max_total_tokens)) {
      finish_ = FinishReason::kLength;
    }
    if (finished()) break;
  }
  return absl::MakeConstSpan(tokens_).subspan(first);
}

}  // namespace specd
