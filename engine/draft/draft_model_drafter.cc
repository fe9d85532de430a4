#include "engine/draft/draft_model_drafter.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "engine/draft/tree_builder.h"

namespace specd {

namespace {

using draft_tree::AddChildren;
using draft_tree::ChildCount;
using draft_tree::Node;
using draft_tree::PickFrontier;
using draft_tree::SelectTree;
using draft_tree::SeqWork;

}  // namespace

DraftModelDrafter::DraftModelDrafter(Backend* model, DraftModelDrafterOptions options)
    : model_(model), options_(options), vocab_size_(model->config().vocab_size) {}

absl::Status DraftModelDrafter::AddSequence(SeqId seq) {
  if (absl::Status s = model_->AddSequence(seq); !s.ok()) return s;
  states_[seq] = SeqState();
  return absl::OkStatus();
}

absl::Status DraftModelDrafter::Release(SeqId seq) {
  states_.erase(seq);
  return model_->RemoveSequence(seq);
}

bool DraftModelDrafter::HasSequence(SeqId seq) const { return model_->HasSequence(seq); }

absl::Status DraftModelDrafter::CheckRequest(const DraftRequest& r) const {
  if (absl::Status s = CheckDraftRequest(r, model_->HasSequence(r.seq), vocab_size_, "draft");
      !s.ok()) {
    return s;
  }
  auto it = states_.find(r.seq);
  if (it != states_.end() && !it->second.kept.has_value()) {
    const std::vector<int32_t>& carried = it->second.carried;
    if (carried.size() >= r.new_tokens.size() ||
        !std::equal(carried.begin(), carried.end(), r.new_tokens.begin())) {
      return absl::FailedPreconditionError(
          absl::StrCat("new_tokens: sequence ", r.seq, " must resend the ", carried.size(),
                       " tokens a failed step already consumed, and at least one more"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int> DraftModelDrafter::ApplyOutcome(const DraftRequest& r) {
  SeqState& state = states_[r.seq];
  if (!state.kept.has_value()) return static_cast<int>(state.carried.size());
  const KeptStep& kept = *state.kept;
  std::vector<int32_t> path(kept.chain);
  std::iota(path.begin(), path.end(), 0);
  int skip = 0;
  if (r.accepted_node >= -1 && r.accepted_node < kept.tree.size()) {
    std::vector<int32_t> nodes;
    for (int n = r.accepted_node; n >= 0; n = kept.tree.parents[n]) nodes.push_back(n);
    std::reverse(nodes.begin(), nodes.end());
    bool match = nodes.size() < r.new_tokens.size();
    for (size_t i = 0; match && i < nodes.size(); ++i) {
      match = kept.tree.tokens[nodes[i]] == r.new_tokens[i];
    }
    // Expanded nodes are closed under ancestors, so the path's expanded part is a prefix.
    for (size_t i = 0; match && i < nodes.size() && kept.tree_scratch[nodes[i]] >= 0; ++i) {
      path.push_back(kept.tree_scratch[nodes[i]]);
      ++skip;
    }
  }
  if (absl::Status s = model_->Commit(r.seq, path); !s.ok()) {
    return absl::InternalError(
        absl::StrCat("draft model commit of the kept path failed for "
                     "sequence ",
                     r.seq, ": ", s.message()));
  }
  state.kept.reset();
  state.carried.assign(r.new_tokens.begin(), r.new_tokens.begin() + skip);
  return skip;
}

absl::Status DraftModelDrafter::LevelTopK(absl::Span<const ForwardItem> items, int k,
                                          TopKRows* out) {
  k = std::max(k, 1);
  if (options_.backend_topk && k <= kMaxForwardTopK) {
    if (absl::Status s = model_->ForwardTopK(items, k, out); !s.ok()) return s;
  } else {
    if (absl::Status s = model_->Forward(items, &logits_); !s.ok()) return s;
    TopKRowsOnHost(logits_, vocab_size_, k, out);
  }
  for (const ForwardItem& it : items) fed_tokens_ += static_cast<int64_t>(it.tokens.size());
  return absl::OkStatus();
}

absl::StatusOr<std::vector<TokenTree>> DraftModelDrafter::Draft(
    absl::Span<const DraftRequest> requests) {
  absl::flat_hash_set<SeqId> seen;
  for (const DraftRequest& r : requests) {
    if (absl::Status s = CheckRequest(r); !s.ok()) return s;
    if (!seen.insert(r.seq).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("seq: sequence ", r.seq, " appears twice in one draft batch"));
    }
  }
  // The previous steps' outcomes first: from here on each sequence's committed KV matches the
  // first skip[b] of its new_tokens, whatever happens to this step.
  std::vector<int> skip(requests.size());
  for (size_t b = 0; b < requests.size(); ++b) {
    absl::StatusOr<int> n = ApplyOutcome(requests[b]);
    if (!n.ok()) return n.status();
    skip[b] = *n;
  }
  std::vector<SeqWork> work(requests.size());
  // Drops this call's scratch region of every sequence; they stay as ApplyOutcome left them.
  auto fail = [&](const absl::Status& s) {
    for (const DraftRequest& r : requests) model_->Commit(r.seq, {}).IgnoreError();
    return s;
  };

  // Level "-1": the new tokens not yet in the KV as a chain; only the last one's logits are
  // needed.
  std::vector<ForwardItem> items(requests.size());
  int k = 1;
  for (size_t b = 0; b < requests.size(); ++b) {
    SeqWork& w = work[b];
    w.req = &requests[b];
    items[b].seq = w.req->seq;
    items[b].tokens.assign(w.req->new_tokens.begin() + skip[b], w.req->new_tokens.end());
    const int n = static_cast<int>(items[b].tokens.size());
    items[b].parents.resize(n);
    std::iota(items[b].parents.begin(), items[b].parents.end(), -1);
    items[b].logit_rows = {n - 1};
    w.next_scratch = n;
    k = std::max(k, ChildCount(w.req->params, 0));
  }
  TopKRows top;
  if (absl::Status s = LevelTopK(items, k, &top); !s.ok()) return fail(s);
  if (top.rows() != static_cast<int64_t>(requests.size())) {
    return fail(absl::InternalError(
        absl::StrCat("draft model returned ", top.rows(), " top-k rows for ", requests.size())));
  }
  for (size_t b = 0; b < requests.size(); ++b) AddChildren(work[b], -1, top, b);

  // One batched forward per level: feed each sequence's frontier at `level`, whose top-k give
  // the children at level + 1.
  for (int level = 0;; ++level) {
    items.clear();
    std::vector<size_t> item_work;
    int64_t rows = 0;
    k = 1;
    for (size_t b = 0; b < work.size(); ++b) {
      SeqWork& w = work[b];
      w.frontier.clear();
      if (level + 1 >= w.req->params.depth) continue;
      w.frontier = PickFrontier(w, level);
      if (w.frontier.empty()) continue;
      ForwardItem item;
      item.seq = w.req->seq;
      const int32_t chain_end = static_cast<int32_t>(w.req->new_tokens.size() - skip[b]) - 1;
      for (int node : w.frontier) {
        Node& nd = w.nodes[node];
        nd.scratch = w.next_scratch++;
        item.logit_rows.push_back(static_cast<int32_t>(item.tokens.size()));
        item.tokens.push_back(nd.token);
        item.parents.push_back(nd.parent < 0 ? chain_end : w.nodes[nd.parent].scratch);
      }
      rows += static_cast<int64_t>(w.frontier.size());
      k = std::max(k, ChildCount(w.req->params, level + 1));
      items.push_back(std::move(item));
      item_work.push_back(b);
    }
    if (items.empty()) break;
    if (absl::Status s = LevelTopK(items, k, &top); !s.ok()) return fail(s);
    if (top.rows() != rows) {
      return fail(absl::InternalError(
          absl::StrCat("draft model returned ", top.rows(), " top-k rows for ", rows)));
    }
    int64_t row = 0;
    for (size_t b : item_work) {
      SeqWork& w = work[b];
      for (int node : w.frontier) AddChildren(w, node, top, row++);
    }
  }

  std::vector<TokenTree> trees(requests.size());
  for (size_t b = 0; b < requests.size(); ++b) {
    const DraftRequest& r = requests[b];
    SeqState& state = states_[r.seq];
    state.carried.clear();
    KeptStep kept;
    kept.chain = static_cast<int32_t>(r.new_tokens.size()) - skip[b];
    kept.tree = SelectTree(work[b], &kept.tree_scratch);
    trees[b] = kept.tree;
    if (options_.reuse_kv) {
      state.kept = std::move(kept);
      continue;
    }
    std::vector<int32_t> chain(kept.chain);
    std::iota(chain.begin(), chain.end(), 0);
    if (absl::Status s = model_->Commit(r.seq, chain); !s.ok()) {
      // Sequences before b already committed their chain; their state moved on, which a
      // retry would double-feed. A failing Commit of a chain just forwarded is a backend bug.
      return absl::InternalError(
          absl::StrCat("draft model commit failed for sequence ", r.seq, ": ", s.message()));
    }
  }
  return trees;
}

}  // namespace specd
