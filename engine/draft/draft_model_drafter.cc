#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "engine/draft/draft_model_drafter.h"

namespace specd {

namespace {

// NaN sorts as the worst logit so that a broken row cannot break the ordering.
inline float OrderKey(float v) { return std::isnan(v) ? -std::numeric_limits<float>::infinity() : v; }

// The k most likely tokens of `row` ([vocab] fp32 logits, host), best first, lowest id first on
// ties (as greedy SampleToken), with their log-probabilities under softmax(row).
std::vector<std::pair<int32_t, float>> TopKLogProbs(absl::Span<const float> row, int k) {
  const int vocab = static_cast<int>(row.size());
  k = std::min(k, vocab);
  float max_l = -std::numeric_limits<float>::infinity();
  for (float v : row) max_l = std::max(max_l, OrderKey(v));
  double sum = 0;
  for (float v : row) sum += std::exp(static_cast<double>(OrderKey(v)) - max_l);
  const double log_z = max_l + std::log(sum);
  std::vector<int32_t> ids(vocab);
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
    const float la = OrderKey(row[a]), lb = OrderKey(row[b]);
    return la > lb || (la == lb && a < b);
  });
  std::vector<std::pair<int32_t, float>> out(k);
  for (int i = 0; i < k; ++i) {
    out[i] = {ids[i], static_cast<float>(OrderKey(row[ids[i]]) - log_z)};
  }
  return out;
}

struct Node {
  int32_t token = 0;
  int32_t parent = -1;  // index into SeqWork::nodes, -1 for a child of the last fed token
  float logprob = 0;    // cumulative draft log-probability
  int depth = 0;        // 0 for children of the last fed token
  int32_t scratch = -1;  // scratch index in the draft model once fed
};

// Per-sequence state of one Draft() call.
struct SeqWork {
  const DraftRequest* req = nullptr;
  std::vector<Node> nodes;
  int32_t next_scratch = 0;
  std::vector<int> frontier;  // nodes fed in the current level's Forward, in item order
};

// Total order used both for pruning and for the final cut: higher cumulative log-probability
// first, then shallower (so a parent tied with its child comes first), then creation order
// (siblings are created best first).
bool Better(const std::vector<Node>& nodes, int a, int b) {
  const float la = OrderKey(nodes[a].logprob), lb = OrderKey(nodes[b].logprob);
  if (la != lb) return la > lb;
  if (nodes[a].depth != nodes[b].depth) return nodes[a].depth < nodes[b].depth;
  return a < b;
}

// Appends the children of `parent` (-1: the last fed token) from its logits row.
void AddChildren(SeqWork& w, int parent, absl::Span<const float> row) {
  const DraftParams& p = w.req->params;
  const int depth = parent < 0 ? 0 : w.nodes[parent].depth + 1;
  // A child with j better siblings ranks behind them and its `depth` ancestors, so it can
  // only make the final cut when j + depth < max_nodes.
  const int k = std::min(p.top_k, p.max_nodes - depth);
  if (k <= 0) return;
  const float base = parent < 0 ? 0.0f : w.nodes[parent].logprob;
  for (const auto& [token, lp] : TopKLogProbs(row, k)) {
    Node n;
    n.token = token;
    n.parent = parent;
    n.logprob = base + lp;
    n.depth = depth;
    w.nodes.push_back(n);
  }
}

// Picks the nodes of `level` to expand: the level's top_k by cumulative log-probability,
// skipping those already outside the best max_nodes of the whole tree (their descendants
// rank even lower, and the tree only grows).
std::vector<int> PickFrontier(const SeqWork& w, int level) {
  const DraftParams& p = w.req->params;
  std::vector<int> at_level;
  for (int i = 0; i < static_cast<int>(w.nodes.size()); ++i) {
    if (w.nodes[i].depth == level) at_level.push_back(i);
  }
  std::sort(at_level.begin(), at_level.end(),
            [&](int a, int b) { return Better(w.nodes, a, b); });
  if (static_cast<int>(at_level.size()) > p.top_k) at_level.resize(p.top_k);
  std::vector<int> frontier;
  for (int i : at_level) {
    int ahead = 0;  // nodes ranking ahead of i
    for (int j = 0; j < static_cast<int>(w.nodes.size()) && ahead < p.max_nodes; ++j) {
      if (j != i && Better(w.nodes, j, i)) ++ahead;
    }
    if (ahead < p.max_nodes - 1) frontier.push_back(i);  // room for i and at least one child
  }
  return frontier;
}

// The best max_nodes nodes, closed under ancestors, in topological order (by depth, best first
// within a depth, so siblings come best first).
TokenTree SelectTree(const SeqWork& w) {
  const int n = static_cast<int>(w.nodes.size());
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return Better(w.nodes, a, b); });
  std::vector<char> taken(n, 0);
  std::vector<int> chosen;
  for (int i : order) {
    if (static_cast<int>(chosen.size()) >= w.req->params.max_nodes) break;
    const int parent = w.nodes[i].parent;
    if (parent >= 0 && !taken[parent]) continue;  // only reachable with NaN scores
    taken[i] = 1;
    chosen.push_back(i);
  }
  std::stable_sort(chosen.begin(), chosen.end(),
                   [&](int a, int b) { return w.nodes[a].depth < w.nodes[b].depth; });
  std::vector<int32_t> out_index(n, -1);
  TokenTree tree;
  for (int i : chosen) {
    out_index[i] = tree.size();
    const Node& node = w.nodes[i];
    tree.tokens.push_back(node.token);
    tree.parents.push_back(node.parent < 0 ? -1 : out_index[node.parent]);
    tree.draft_logprobs.push_back(node.logprob);
  }
  return tree;
}

}  // namespace

DraftModelDrafter::DraftModelDrafter(Backend* model)
    : model_(model), vocab_size_(model->config().vocab_size) {}

absl::Status DraftModelDrafter::AddSequence(SeqId seq) { return model_->AddSequence(seq); }

absl::Status DraftModelDrafter::Release(SeqId seq) { return model_->RemoveSequence(seq); }

bool DraftModelDrafter::HasSequence(SeqId seq) const { return model_->HasSequence(seq); }

absl::Status DraftModelDrafter::CheckRequest(const DraftRequest& r) const {
  return CheckDraftRequest(r, model_->HasSequence(r.seq), vocab_size_, "draft");
}

absl::StatusOr<std::vector<TokenTree>> DraftModelDrafter::Draft(
    absl::Span<const DraftRequest> requests) {
  absl::flat_hash_set<SeqId> seen;
  for (const DraftRequest& r : requests) {
    if (absl::Status s = CheckRequest(r); !s.ok()) return s;
    if (!seen.insert(r.seq).second) {
      return absl::InvalidArgumentError(absl::StrCat("seq: sequence ", r.seq,
                                                     " appears twice in one draft batch"));
    }
  }
  std::vector<SeqWork> work(requests.size());
  // Leaves every sequence as it was before the call: drops its whole scratch region, chain
  // included.
  auto fail = [&](const absl::Status& s) {
    for (const DraftRequest& r : requests) model_->Commit(r.seq, {}).IgnoreError();
    return s;
  };

  // Level "-1": the new tokens as a chain; only the last one's logits are needed.
  std::vector<ForwardItem> items(requests.size());
  for (size_t b = 0; b < requests.size(); ++b) {
    SeqWork& w = work[b];
    w.req = &requests[b];
    const int n = static_cast<int>(w.req->new_tokens.size());
    items[b].seq = w.req->seq;
    items[b].tokens = w.req->new_tokens;
    items[b].parents.resize(n);
    std::iota(items[b].parents.begin(), items[b].parents.end(), -1);
    items[b].logit_rows = {n - 1};
    w.next_scratch = n;
  }
  std::vector<float> logits;
  if (absl::Status s = model_->Forward(items, &logits); !s.ok()) return fail(s);
  const size_t vocab = static_cast<size_t>(vocab_size_);
  if (logits.size() != requests.size() * vocab) {
    return fail(absl::InternalError(absl::StrCat("draft model returned ", logits.size(),
                                                 " logits for ", requests.size(), " rows")));
  }
  for (size_t b = 0; b < requests.size(); ++b) {
    AddChildren(work[b], -1, absl::Span<const float>(logits).subspan(b * vocab, vocab));
  }

  // One batched Forward per level: feed each sequence's frontier at `level`, whose logits give
  // the children at level + 1.
  for (int level = 0;; ++level) {
    items.clear();
    std::vector<size_t> item_work;
    for (size_t b = 0; b < work.size(); ++b) {
      SeqWork& w = work[b];
      w.frontier.clear();
      if (level + 1 >= w.req->params.depth) continue;
      w.frontier = PickFrontier(w, level);
      if (w.frontier.empty()) continue;
      ForwardItem item;
      item.seq = w.req->seq;
      const int32_t chain_end = static_cast<int32_t>(w.req->new_tokens.size()) - 1;
      for (int node : w.frontier) {
        Node& nd = w.nodes[node];
        nd.scratch = w.next_scratch++;
        item.logit_rows.push_back(static_cast<int32_t>(item.tokens.size()));
        item.tokens.push_back(nd.token);
        item.parents.push_back(nd.parent < 0 ? chain_end : w.nodes[nd.parent].scratch);
      }
      items.push_back(std::move(item));
      item_work.push_back(b);
    }
    if (items.empty()) break;
    if (absl::Status s = model_->Forward(items, &logits); !s.ok()) return fail(s);
    size_t row = 0;
    for (size_t b : item_work) {
      SeqWork& w = work[b];
      for (int node : w.frontier) {
        if ((row + 1) * vocab > logits.size()) {
          return fail(absl::InternalError("draft model returned too few logit rows"));
        }
        AddChildren(w, node, absl::Span<const float>(logits).subspan(row * vocab, vocab));
        ++row;
      }
    }
  }

  std::vector<TokenTree> trees(requests.size());
  for (size_t b = 0; b < requests.size(); ++b) {
    trees[b] = SelectTree(work[b]);
    std::vector<int32_t> chain(requests[b].new_tokens.size());
    std::iota(chain.begin(), chain.end(), 0);
    if (absl::Status s = model_->Commit(requests[b].seq, chain); !s.ok()) {
      // Sequences before b already committed their chain; their state moved on, which a
      // retry would double-feed. A failing Commit of a chain just forwarded is a backend bug.
      return absl::InternalError(absl::StrCat("draft model commit failed for sequence ",
                                              requests[b].seq, ": ", s.message()));
    }
  }
  return trees;
}

}  // namespace specd
