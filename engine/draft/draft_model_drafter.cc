#include "engine/draft/draft_model_drafter.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "engine/chunked_forward.h"
#include "engine/draft/tree_builder.h"

namespace specd {

namespace {

using draft_tree::AddChildren;
using draft_tree::ChildCount;
using draft_tree::Node;
using draft_tree::PickFrontier;
using draft_tree::Selected;
using draft_tree::SeqWork;

Selected SelectTree(const SeqWork& w) { return draft_tree::SelectTreeWithGuesses(w); }

// Feeds every work item's chain (`items`: one logit row per work item, in work order) and grows
// each tree level by level: one batched forward per level over every sequence's frontier, whose
// top-k give the next level's children. Work items of one sequence (a pre-draft's guesses) must
// be adjacent and start from the same next_scratch: they share one forward item a level, their
// nodes taking the sequence's scratch indices in turn, and each ends with next_scratch past all
// of them.
absl::Status GrowTrees(
    std::vector<SeqWork>& work, std::vector<ForwardItem>& items,
    absl::FunctionRef<absl::Status(absl::Span<const ForwardItem>, int, TopKRows*)> level_topk) {
  // One more than the most children a row gets: the next token is the row's RunnerUp, which
  // lets a pre-draft guess that the target rejects a top-1 chain's node and emits it instead.
  auto with_runner_up = &DraftModelDrafter::TopKAsked;
  int k = 1;
  for (const SeqWork& w : work) k = std::max(k, ChildCount(w.req->params, 0));
  TopKRows top;
  if (absl::Status s = level_topk(items, with_runner_up(k), &top); !s.ok()) return s;
  if (top.rows() != static_cast<int64_t>(work.size())) {
    return absl::InternalError(
        absl::StrCat("draft model returned ", top.rows(), " top-k rows for ", work.size()));
  }
  for (size_t b = 0; b < work.size(); ++b) AddChildren(work[b], -1, top, b);
  absl::flat_hash_map<SeqId, int32_t> next_scratch;  // per sequence
  for (const SeqWork& w : work) next_scratch.try_emplace(w.req->seq, w.next_scratch);
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
      if (items.empty() || items.back().seq != w.req->seq) items.emplace_back().seq = w.req->seq;
      ForwardItem& item = items.back();
      int32_t& next = next_scratch[w.req->seq];
      for (int node : w.frontier) {
        Node& nd = w.nodes[node];
        nd.scratch = next++;
        item.logit_rows.push_back(static_cast<int32_t>(item.tokens.size()));
        item.tokens.push_back(nd.token);
        item.parents.push_back(nd.parent < 0 ? w.chain_end : w.nodes[nd.parent].scratch);
      }
      rows += static_cast<int64_t>(w.frontier.size());
      k = std::max(k, ChildCount(w.req->params, level + 1));
      item_work.push_back(b);
    }
    if (items.empty()) break;
    if (absl::Status s = level_topk(items, with_runner_up(k), &top); !s.ok()) return s;
    if (top.rows() != rows) {
      return absl::InternalError(
          absl::StrCat("draft model returned ", top.rows(), " top-k rows for ", rows));
    }
    int64_t row = 0;
    for (size_t b : item_work) {
      SeqWork& w = work[b];
      for (int node : w.frontier) AddChildren(w, node, top, row++);
    }
  }
  for (SeqWork& w : work) w.next_scratch = next_scratch[w.req->seq];
  return absl::OkStatus();
}

// The log-chance, for a greedy target, of each outcome of `tree` (index 0: none accepted, then
// node i at i + 1), an outcome being an accepted node a and a bonus token that is not one of
// its children (`bonus_logprob[a]`, `root_bonus_logprob` below the root: the draft's
// log-probability of that token given a). `rates[d - 1]`: the chance the target's token at
// depth d is the draft's top-1 there, given the path so far was accepted (the sequence's
// measured chain acceptance; the last one for deeper levels). Where the target does not take
// the top-1, its token is spread as the draft's own distribution less the top-1; so the chance
// a path is accepted is the product over its nodes of the rate (a best child: children are
// listed best first) or (1 - rate) p(node) / (1 - p(best sibling)), and the bonus's is the rate
// where a has no children (the bonus is then the draft's top-1) or else the same rest.
std::vector<double> OutcomeLogChances(const TokenTree& tree,
                                      const std::vector<float>& bonus_logprob,
                                      float root_bonus_logprob, const std::vector<float>& rates) {
  const int n = tree.size();
  auto rate = [&](int d) {
    const size_t at = std::min(static_cast<size_t>(std::max(d, 1)), rates.size()) - 1;
    return std::clamp(static_cast<double>(rates[at]), 1e-6, 1 - 1e-6);
  };
  // Log-probability by the draft of node i given its parent (-1: the last fed token).
  auto own = [&](int i) {
    const int parent = tree.parents[i];
    return static_cast<double>(tree.draft_logprobs[i]) -
           (parent < 0 ? 0.0 : static_cast<double>(tree.draft_logprobs[parent]));
  };
  std::vector<int> depth(n, 0), best_child(n + 1, -1);  // best_child[a + 1]
  for (int i = 0; i < n; ++i) {
    const int parent = tree.parents[i];
    depth[i] = parent < 0 ? 1 : depth[parent] + 1;
    if (best_child[parent + 1] < 0) best_child[parent + 1] = i;
  }
  // The chance of a token given the parent `a` was reached: its log-probability by the draft
  // (`logprob`), or the best child's own (`is_best`).
  auto next = [&](int a, bool is_best, double logprob) {
    const double r = rate(a < 0 ? 1 : depth[a] + 1);
    const int best = best_child[a + 1];
    if (is_best || best < 0) return std::log(r);
    const double rest = std::max(1.0 - std::exp(own(best)), 1e-6);
    return std::log1p(-r) + logprob - std::log(rest);
  };
  std::vector<double> reach(n, 0.0);
  for (int i = 0; i < n; ++i) {
    const int parent = tree.parents[i];
    reach[i] =
        (parent < 0 ? 0.0 : reach[parent]) + next(parent, best_child[parent + 1] == i, own(i));
  }
  std::vector<double> chance(n + 1);
  chance[0] = next(-1, false, root_bonus_logprob);
  for (int i = 0; i < n; ++i) chance[i + 1] = reach[i] + next(i, false, bonus_logprob[i]);
  return chance;
}

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

absl::StatusOr<int> DraftModelDrafter::ResolvePending(SeqId seq,
                                                      absl::Span<const int32_t> new_tokens,
                                                      bool exact) {
  SeqState& state = states_[seq];
  if (state.pending.empty()) return 0;
  std::vector<Pending> guesses = std::move(state.pending);
  state.pending.clear();
  auto hit = [&](const Pending& p) {
    return (exact ? new_tokens.size() == p.tokens.size() : new_tokens.size() > p.tokens.size()) &&
           std::equal(p.tokens.begin(), p.tokens.end(), new_tokens.begin());
  };
  auto it = std::find_if(guesses.begin(), guesses.end(), hit);
  // No hit: the kept tree's outcome drops every guess's KV with the rest.
  if (it == guesses.end()) return 0;
  // A hit's commit keeps only its path: the other guesses' KV goes with the scratch region.
  Pending pending = std::move(*it);
  const std::vector<int32_t>& guess = pending.tokens;
  if (absl::Status s = model_->Commit(seq, pending.path); !s.ok()) {
    return absl::InternalError(absl::StrCat(
        "draft model commit of the guessed path failed for sequence ", seq, ": ", s.message()));
  }
  state.kept = std::move(pending.next);
  state.carried.clear();
  return static_cast<int>(guess.size());
}

absl::StatusOr<int> DraftModelDrafter::ApplyOutcome(const DraftRequest& r) {
  absl::StatusOr<int> offset_or = ResolvePending(r.seq, r.new_tokens, /*exact=*/false);
  if (!offset_or.ok()) return offset_or.status();
  const int offset = *offset_or;
  SeqState& state = states_[r.seq];
  if (!state.kept.has_value()) return static_cast<int>(state.carried.size());
  const KeptStep& kept = *state.kept;
  const absl::Span<const int32_t> fresh = absl::MakeConstSpan(r.new_tokens).subspan(offset);
  std::vector<int32_t> path(kept.chain);
  std::iota(path.begin(), path.end(), 0);
  int skip = 0;
  if (r.accepted_node >= -1 && r.accepted_node < kept.tree.size()) {
    std::vector<int32_t> nodes;
    for (int n = r.accepted_node; n >= 0; n = kept.tree.parents[n]) nodes.push_back(n);
    std::reverse(nodes.begin(), nodes.end());
    bool match = nodes.size() < fresh.size();
    for (size_t i = 0; match && i < nodes.size(); ++i) {
      match = kept.tree.tokens[nodes[i]] == fresh[i];
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
  state.carried.assign(r.new_tokens.begin(), r.new_tokens.begin() + offset + skip);
  return offset + skip;
}

template <typename SelectedTree>
DraftModelDrafter::KeptStep DraftModelDrafter::MakeKept(SelectedTree selected, int32_t chain,
                                                        int32_t scratch_used) {
  KeptStep kept;
  kept.chain = chain;
  kept.tree = std::move(selected.tree);
  kept.tree_scratch = std::move(selected.scratch);
  kept.scratch_used = scratch_used;
  kept.bonus = std::move(selected.bonus);
  kept.bonus_logprob = std::move(selected.bonus_logprob);
  kept.root_bonus = selected.root_bonus;
  kept.root_bonus_logprob = selected.root_bonus_logprob;
  kept.top1_logprob = selected.top1_logprob;
  return kept;
}

absl::Status DraftModelDrafter::LevelTopK(absl::Span<const ForwardItem> items, int k,
                                          TopKRows* out) {
  k = std::max(k, 1);
  const int64_t max_rows = options_.max_forward_rows;
  if (options_.backend_topk && k <= kMaxForwardTopK) {
    if (absl::Status s = ChunkedForwardTopK(*model_, items, k, max_rows, out); !s.ok()) return s;
  } else {
    if (absl::Status s = ChunkedForward(*model_, items, max_rows, &logits_); !s.ok()) return s;
    TopKRowsOnHost(logits_, vocab_size_, k, out);
  }
  for (const ForwardItem& it : items) fed_tokens_ += static_cast<int64_t>(it.tokens.size());
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int>> DraftModelDrafter::CheckAndApplyOutcomes(
    absl::Span<const DraftRequest> requests) {
  if (absl::Status s =
          CheckDraftBatch(requests, [this](const DraftRequest& r) { return CheckRequest(r); });
      !s.ok()) {
    return s;
  }
  // The previous steps' outcomes first: from here on each sequence's committed KV matches the
  // first skip[b] of its new_tokens, whatever happens to this step.
  std::vector<int> skip(requests.size());
  for (size_t b = 0; b < requests.size(); ++b) {
    absl::StatusOr<int> n = ApplyOutcome(requests[b]);
    if (!n.ok()) return n.status();
    skip[b] = *n;
  }
  return skip;
}

absl::StatusOr<std::vector<TokenTree>> DraftModelDrafter::Draft(
    absl::Span<const DraftRequest> requests) {
  absl::StatusOr<std::vector<int>> skip_or = CheckAndApplyOutcomes(requests);
  if (!skip_or.ok()) return skip_or.status();
  const std::vector<int>& skip = *skip_or;
  std::vector<SeqWork> work(requests.size());
  // Drops this call's scratch region of every sequence; they stay as ApplyOutcome left them.
  auto fail = [&](const absl::Status& s) {
    for (const DraftRequest& r : requests) model_->Commit(r.seq, {}).IgnoreError();
    return s;
  };

  // Level "-1": the new tokens not yet in the KV as a chain; only the last one's logits are
  // needed.
  std::vector<ForwardItem> items(requests.size());
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
    w.chain_end = n - 1;
  }
  if (absl::Status s = GrowTrees(work, items,
                                 [this](absl::Span<const ForwardItem> it, int k, TopKRows* out) {
                                   return LevelTopK(it, k, out);
                                 });
      !s.ok()) {
    return fail(s);
  }

  std::vector<TokenTree> trees(requests.size());
  for (size_t b = 0; b < requests.size(); ++b) {
    const DraftRequest& r = requests[b];
    SeqState& state = states_[r.seq];
    state.carried.clear();
    const int32_t chain = static_cast<int32_t>(r.new_tokens.size()) - skip[b];
    KeptStep kept = MakeKept(SelectTree(work[b]), chain, work[b].next_scratch);
    trees[b] = kept.tree;
    if (options_.reuse_kv) {
      state.kept = std::move(kept);
      continue;
    }
    std::vector<int32_t> chain_path(chain);
    std::iota(chain_path.begin(), chain_path.end(), 0);
    if (absl::Status s = model_->Commit(r.seq, chain_path); !s.ok()) {
      // Sequences before b already committed their chain; their state moved on, which a
      // retry would double-feed. A failing Commit of a chain just forwarded is a backend bug.
      return absl::InternalError(
          absl::StrCat("draft model commit failed for sequence ", r.seq, ": ", s.message()));
    }
  }
  return trees;
}

absl::Status DraftModelDrafter::Ingest(absl::Span<const DraftRequest> requests) {
  absl::StatusOr<std::vector<int>> skip_or = CheckAndApplyOutcomes(requests);
  if (!skip_or.ok()) return skip_or.status();
  const std::vector<int>& skip = *skip_or;
  std::vector<ForwardItem> items;
  std::vector<size_t> fed;  // request index of each item
  for (size_t b = 0; b < requests.size(); ++b) {
    const DraftRequest& r = requests[b];
    if (skip[b] >= static_cast<int>(r.new_tokens.size())) continue;  // all held already
    ForwardItem& item = items.emplace_back();
    item.seq = r.seq;
    item.tokens.assign(r.new_tokens.begin() + skip[b], r.new_tokens.end());
    item.parents.resize(item.tokens.size());
    std::iota(item.parents.begin(), item.parents.end(), -1);
    // The backend computes logits for the rows asked; one is the least a forward returns.
    item.logit_rows = {static_cast<int32_t>(item.tokens.size()) - 1};
    fed.push_back(b);
  }
  if (!items.empty()) {
    if (absl::Status s = ChunkedForward(*model_, items, options_.max_forward_rows, &logits_);
        !s.ok()) {
      // The outcomes stay applied (ApplyOutcome noted what they committed as carried), so the
      // same requests can be retried; this call's scratch goes.
      for (const ForwardItem& item : items) model_->Commit(item.seq, {}).IgnoreError();
      return s;
    }
    for (const ForwardItem& item : items) fed_tokens_ += static_cast<int64_t>(item.tokens.size());
  }
  for (size_t i = 0; i < items.size(); ++i) {
    std::vector<int32_t> chain(items[i].tokens.size());
    std::iota(chain.begin(), chain.end(), 0);
    if (absl::Status s = model_->Commit(items[i].seq, chain); !s.ok()) {
      return absl::InternalError(
          absl::StrCat("draft model commit of ingested tokens failed for "
                       "sequence ",
                       items[i].seq, ": ", s.message()));
    }
  }
  for (const DraftRequest& r : requests) states_[r.seq].carried.clear();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<DraftModelDrafter::PreDraftResult>> DraftModelDrafter::PreDraft(
    absl::Span<const DraftRequest> requests) {
  // Unlike Draft(), new_tokens may be empty: nothing new since the tree being verified.
  auto check = [this](const DraftRequest& r) -> absl::Status {
    if (!model_->HasSequence(r.seq)) {
      return absl::NotFoundError(absl::StrCat("seq: unknown draft sequence ", r.seq));
    }
    if (absl::Status s = ValidateDraftParams(r.params); !s.ok()) return s;
    return CheckTokenIds(r.new_tokens, vocab_size_, "new_tokens");
  };
  if (absl::Status s = CheckDraftBatch(requests, check); !s.ok()) return s;
  std::vector<PreDraftResult> results(requests.size());
  // What each guess feeds: the unexpanded rest of the guessed path (and its bonus token when
  // known) hanging from `anchor`, and its scratch path so far.
  struct Guess {
    size_t b = 0;
    std::vector<int32_t> path;   // scratch path of the guessed tokens fed so far
    std::vector<int32_t> chain;  // tokens still to feed below the path
    int32_t anchor = -1;         // scratch parent of chain[0]
    bool need_bonus = false;     // the accepted node was never expanded: its top-1 is the bonus
    int rank = 0;                // 0: the likeliest outcome, then DraftRequest::fan_out's order
  };
  // Per sequence: the accepted node of each outcome to guess (-1: the root), most likely first.
  std::vector<std::vector<int>> outcomes(requests.size());
  for (size_t b = 0; b < requests.size(); ++b) {
    const DraftRequest& r = requests[b];
    absl::StatusOr<int> consumed = ResolvePending(r.seq, r.new_tokens, /*exact=*/true);
    if (!consumed.ok()) return consumed.status();
    results[b].consumed = *consumed;
    SeqState& state = states_[r.seq];
    if (results[b].consumed != static_cast<int>(r.new_tokens.size()) || !state.kept.has_value() ||
        state.kept->tree.empty()) {
      continue;
    }
    const KeptStep& kept = *state.kept;
    // An outcome's log-probability by the draft: its path's, then its bonus token's.
    auto score = [&](int i) {
      return i < 0 ? kept.root_bonus_logprob
                   : kept.tree.draft_logprobs[i] +
                         (kept.bonus[i] >= 0 ? kept.bonus_logprob[i] : kept.top1_logprob);
    };
    std::vector<int> candidates;  // outcomes with a bonus token to guess
    if (kept.root_bonus >= 0) candidates.push_back(-1);
    for (int i = 0; i < kept.tree.size(); ++i) {
      if (kept.bonus[i] != kNoBonus) candidates.push_back(i);
    }
    std::vector<int>& chosen = outcomes[b];
    if (!r.target_samples && !r.chain_rates.empty()) {
      // A greedy target with its measured acceptance: every outcome by the same estimate, so
      // that "rejected at the first node" and "all accepted" compare (DraftRequest::chain_rates).
      const std::vector<double> chance =
          OutcomeLogChances(kept.tree, kept.bonus_logprob, kept.root_bonus_logprob, r.chain_rates);
      auto of = [&](int i) { return chance[i + 1]; };
      std::stable_sort(candidates.begin(), candidates.end(),
                       [&](int a, int c) { return of(a) > of(c); });
      for (int c : candidates) {
        if (static_cast<int>(chosen.size()) >= std::max(r.fan_out, 1)) break;
        chosen.push_back(c);
      }
      results[b].more.resize(chosen.empty() ? 0 : chosen.size() - 1);
      continue;
    }
    std::stable_sort(candidates.begin(), candidates.end(),
                     [&](int a, int c) { return score(a) > score(c); });
    if (!r.target_samples) {
      // The most likely outcome of a greedy target follows the draft's best child at every
      // node: children are listed best first, and a best child pruned takes its siblings.
      int best = -1;
      for (int i = 0; i < kept.tree.size(); ++i) {
        if (kept.tree.parents[i] == best) best = i;
      }
      chosen.push_back(best);
    }
    for (int c : candidates) {
      if (static_cast<int>(chosen.size()) >= std::max(r.fan_out, 1)) break;
      if (std::find(chosen.begin(), chosen.end(), c) == chosen.end()) chosen.push_back(c);
    }
    results[b].more.resize(chosen.empty() ? 0 : chosen.size() - 1);
  }
  // Every guess of every sequence grows at once: a sequence's guesses share its forward item at
  // each level (one forward a level, whatever the fan-out), their tokens taking the scratch
  // after the kept tree's in turn. `guesses` is by sequence, then rank, as GrowTrees wants.
  auto slot_tokens = [&](size_t b, int rank) -> std::vector<int32_t>& {
    return rank == 0 ? results[b].guess_tokens : results[b].more[rank - 1].tokens;
  };
  std::vector<Guess> guesses;
  absl::flat_hash_map<SeqId, int32_t> next_scratch;  // per sequence: its next scratch index
  for (size_t b = 0; b < requests.size(); ++b) {
    for (int rank = 0; rank < static_cast<int>(outcomes[b].size()); ++rank) {
      const KeptStep& kept = *states_[requests[b].seq].kept;
      next_scratch.try_emplace(requests[b].seq, kept.scratch_used);
      const int best = outcomes[b][rank];
      Guess g;
      g.b = b;
      g.rank = rank;
      std::vector<int32_t>& tokens = slot_tokens(b, rank);
      std::vector<int32_t> nodes;
      for (int n = best; n >= 0; n = kept.tree.parents[n]) nodes.push_back(n);
      std::reverse(nodes.begin(), nodes.end());
      g.path.resize(kept.chain);
      std::iota(g.path.begin(), g.path.end(), 0);
      g.anchor = kept.chain - 1;
      for (int n : nodes) {
        tokens.push_back(kept.tree.tokens[n]);
        if (kept.tree_scratch[n] >= 0 && g.chain.empty()) {
          g.path.push_back(kept.tree_scratch[n]);
          g.anchor = kept.tree_scratch[n];
        } else {
          g.chain.push_back(kept.tree.tokens[n]);
        }
      }
      const int32_t bonus = best < 0 ? kept.root_bonus : kept.bonus[best];
      g.need_bonus = bonus < 0;
      if (g.need_bonus && g.chain.empty()) {  // an expanded node always knows its bonus
        tokens.clear();
        continue;
      }
      if (!g.need_bonus) {
        g.chain.push_back(bonus);
        tokens.push_back(bonus);
      }
      if (rank == 0) {
        results[b].guess_node = best;
      } else {
        results[b].more[rank - 1].node = best;
      }
      guesses.push_back(std::move(g));
    }
  }
  // Appends `g`'s chain to its sequence's forward item (the last of `items`, or a new one),
  // each token at the sequence's next scratch index, and asks for the last token's logits.
  auto append_chain = [&](Guess& g, std::vector<ForwardItem>* items) {
    const SeqId seq = requests[g.b].seq;
    if (items->empty() || items->back().seq != seq) items->emplace_back().seq = seq;
    ForwardItem& item = items->back();
    int32_t& next = next_scratch[seq];
    for (size_t t = 0; t < g.chain.size(); ++t) {
      item.tokens.push_back(g.chain[t]);
      item.parents.push_back(t == 0 ? g.anchor : next - 1);
      g.path.push_back(next++);
    }
    item.logit_rows.push_back(static_cast<int32_t>(item.tokens.size()) - 1);
  };
  if (!guesses.empty()) {
    // A failed forward leaves unknown nodes in the scratch region: keep only the kept chain
    // (true tokens) and forget the kept tree and every guess, so the next call feeds the
    // outcome afresh.
    auto give_up = [&](const absl::Status& s) {
      for (const Guess& g : guesses) {
        const DraftRequest& r = requests[g.b];
        SeqState& state = states_[r.seq];
        results[g.b].tree = TokenTree();
        results[g.b].guess_tokens.clear();
        results[g.b].guess_node = -1;
        results[g.b].more.clear();
        if (!state.kept.has_value()) continue;  // another guess of the sequence did this
        std::vector<int32_t> chain(state.kept->chain);
        std::iota(chain.begin(), chain.end(), 0);
        if (!model_->Commit(r.seq, chain).ok()) model_->Commit(r.seq, {}).IgnoreError();
        state.kept.reset();
        state.carried.clear();
        state.pending.clear();
      }
      SPECD_LOG(WARNING) << "pre-draft of " << guesses.size() << " guesses failed: " << s;
      return results;
    };
    auto level_topk = [this](absl::Span<const ForwardItem> it, int k, TopKRows* out) {
      return LevelTopK(it, k, out);
    };

    // Accepted nodes never expanded: feed the rest of their path to learn their top-1, the
    // bonus.
    std::vector<ForwardItem> items;
    std::vector<size_t> asked;
    for (size_t i = 0; i < guesses.size(); ++i) {
      if (!guesses[i].need_bonus) continue;
      append_chain(guesses[i], &items);
      asked.push_back(i);
    }
    if (!items.empty()) {
      TopKRows top;
      absl::Status s = level_topk(items, 1, &top);
      if (s.ok() && top.rows() != static_cast<int64_t>(asked.size())) {
        s = absl::InternalError("draft model returned the wrong number of top-k rows");
      }
      if (!s.ok()) return give_up(s);
      for (size_t a = 0; a < asked.size(); ++a) {
        Guess& g = guesses[asked[a]];
        g.anchor = g.path.back();
        const int32_t bonus = top.ids[a * top.k];
        slot_tokens(g.b, g.rank).push_back(bonus);
        g.chain = {bonus};
      }
    }

    // Below each guess: the same growth as Draft(), chained onto the guessed path.
    std::vector<SeqWork> work(guesses.size());
    items.clear();
    for (size_t i = 0; i < guesses.size(); ++i) {
      Guess& g = guesses[i];
      SeqWork& w = work[i];
      w.req = &requests[g.b];
      append_chain(g, &items);
      w.chain_end = g.path.back();
    }
    for (SeqWork& w : work) w.next_scratch = next_scratch[w.req->seq];
    if (absl::Status s = GrowTrees(work, items, level_topk); !s.ok()) return give_up(s);
    for (size_t i = 0; i < guesses.size(); ++i) {
      Guess& g = guesses[i];
      SeqState& state = states_[requests[g.b].seq];
      KeptStep next = MakeKept(SelectTree(work[i]), /*chain=*/0, /*scratch_used=*/0);
      // The hit's commit drops the scratch region, this tree's expanded nodes with it.
      std::fill(next.tree_scratch.begin(), next.tree_scratch.end(), -1);
      (g.rank == 0 ? results[g.b].tree : results[g.b].more[g.rank - 1].tree) = next.tree;
      state.kept->scratch_used = work[i].next_scratch;
      Pending pending;
      pending.tokens = slot_tokens(g.b, g.rank);
      pending.path = std::move(g.path);
      pending.next = std::move(next);
      state.pending.push_back(std::move(pending));
    }
  }
  // Guesses that could not be made (an unexpanded outcome without a bonus) are left out.
  for (PreDraftResult& result : results) {
    result.more.erase(std::remove_if(result.more.begin(), result.more.end(),
                                     [](const PreDraftGuess& g) { return g.tree.empty(); }),
                      result.more.end());
  }
  return results;
}

}  // namespace specd
