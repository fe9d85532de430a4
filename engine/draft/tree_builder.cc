#include "engine/draft/tree_builder.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

namespace specd {
namespace draft_tree {
namespace {

// NaN sorts as the worst logit so that a broken row cannot break the ordering.
inline float OrderKey(float v) {
  return std::isnan(v) ? -std::numeric_limits<float>::infinity() : v;
}

}  // namespace

bool Better(const std::vector<Node>& nodes, int a, int b) {
  const float la = OrderKey(nodes[a].logprob), lb = OrderKey(nodes[b].logprob);
  if (la != lb) return la > lb;
  if (nodes[a].depth != nodes[b].depth) return nodes[a].depth < nodes[b].depth;
  return a < b;
}

int ChildCount(const DraftParams& p, int depth) { return std::min(p.top_k, p.max_nodes - depth); }

void AddChildren(SeqWork& w, int parent, const TopKRows& top, int64_t row) {
  const int depth = parent < 0 ? 0 : w.nodes[parent].depth + 1;
  const int k = std::min(ChildCount(w.req->params, depth), top.k);
  if (k <= 0) return;
  const float base = parent < 0 ? 0.0f : w.nodes[parent].logprob;
  for (int j = 0; j < k; ++j) {
    Node n;
    n.token = top.ids[row * top.k + j];
    n.parent = parent;
    n.logprob = base + top.logprobs[row * top.k + j];
    n.depth = depth;
    w.nodes.push_back(n);
  }
  if (k < top.k) {
    w.runner_up.push_back({parent, top.ids[row * top.k + k], top.logprobs[row * top.k + k]});
  }
}

std::vector<int> PickFrontier(const SeqWork& w, int level) {
  const DraftParams& p = w.req->params;
  std::vector<int> at_level;
  for (int i = 0; i < static_cast<int>(w.nodes.size()); ++i) {
    if (w.nodes[i].depth == level) at_level.push_back(i);
  }
  std::sort(at_level.begin(), at_level.end(), [&](int a, int b) { return Better(w.nodes, a, b); });
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

namespace {

// The best non-child below `parent` (-1: the chain end) among the children the work grew for
// it (its top-k, best first), else its runner-up: -1 when it grew none, -2 when all were chosen
// and it has no runner-up.
void BestNonChild(const SeqWork& w, int parent, const std::vector<char>& taken, int32_t* token,
                  float* logprob, double* top1_sum, int* top1_count) {
  const float base = parent < 0 ? 0.0f : w.nodes[parent].logprob;
  bool any = false;
  *token = -1;
  for (int j = 0; j < static_cast<int>(w.nodes.size()); ++j) {
    if (w.nodes[j].parent != parent) continue;
    if (!any) {
      *top1_sum += w.nodes[j].logprob - base;
      ++*top1_count;
    }
    any = true;
    if (!taken[j]) {
      *token = w.nodes[j].token;
      *logprob = w.nodes[j].logprob - base;
      return;
    }
  }
  *token = any ? -2 : -1;
  if (!any) return;
  for (const RunnerUp& r : w.runner_up) {
    if (r.parent != parent) continue;
    *token = r.token;
    *logprob = r.logprob;
    return;
  }
}

}  // namespace

Selected SelectTreeWithGuesses(const SeqWork& w) {
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
  Selected out;
  double top1_sum = 0;
  int top1_count = 0;
  BestNonChild(w, -1, taken, &out.root_bonus, &out.root_bonus_logprob, &top1_sum, &top1_count);
  for (int i : chosen) {
    out_index[i] = out.tree.size();
    const Node& node = w.nodes[i];
    out.tree.tokens.push_back(node.token);
    out.tree.parents.push_back(node.parent < 0 ? -1 : out_index[node.parent]);
    out.tree.draft_logprobs.push_back(node.logprob);
    out.scratch.push_back(node.scratch);
    int32_t bonus = -1;
    float logprob = 0;
    BestNonChild(w, i, taken, &bonus, &logprob, &top1_sum, &top1_count);
    out.bonus.push_back(bonus);
    out.bonus_logprob.push_back(logprob);
  }
  out.top1_logprob = top1_count > 0 ? static_cast<float>(top1_sum / top1_count) : 0.0f;
  return out;
}

TokenTree SelectTree(const SeqWork& w, std::vector<int32_t>* scratch) {
  Selected selected = SelectTreeWithGuesses(w);
  *scratch = std::move(selected.scratch);
  return std::move(selected.tree);
}

}  // namespace draft_tree
}  // namespace specd
