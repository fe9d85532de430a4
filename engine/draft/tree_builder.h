// The EAGLE-2 style dynamic tree builder the model drafters share (the standalone draft model,
// engine/draft/draft_model_drafter.h, and the EAGLE head, engine/draft/eagle_drafter.h): per
// level, expand the best top_k nodes of the level by cumulative draft log-probability, each
// getting its top_k children; keep the best max_nodes nodes overall. The drafters differ only
// in how a level's rows are computed.
#ifndef SPECD_ENGINE_DRAFT_TREE_BUILDER_H_
#define SPECD_ENGINE_DRAFT_TREE_BUILDER_H_

#include <cstdint>
#include <vector>

#include "common/token_tree.h"
#include "engine/draft/drafter.h"
#include "engine/topk.h"

namespace specd {
namespace draft_tree {

struct Node {
  int32_t token = 0;
  int32_t parent = -1;   // index into SeqWork::nodes, -1 for a child of the last fed token
  float logprob = 0;     // cumulative draft log-probability
  int depth = 0;         // 0 for children of the last fed token
  int32_t scratch = -1;  // scratch index in the draft model once fed
};

// The best token a parent's top-k row ranked just behind the children it got: never a tree
// node, only a guess of the token a target that rejects every child emits there (pre-drafting,
// DraftModelDrafter::PreDraft). A top-1 chain has no non-child otherwise, so without it the
// only outcome of a chain a pre-draft could guess is the one that accepts it whole.
struct RunnerUp {
  int32_t parent = -1;  // index into SeqWork::nodes, -1 for the last fed token
  int32_t token = 0;
  float logprob = 0;  // its log-probability given the parent (not cumulative)
};

// Per-sequence state of one Draft() call.
struct SeqWork {
  const DraftRequest* req = nullptr;
  std::vector<Node> nodes;
  std::vector<RunnerUp> runner_up;  // at most one per expanded parent
  int32_t next_scratch = 0;
  int32_t chain_end = -1;     // scratch index of the token the tree hangs below
  std::vector<int> frontier;  // nodes fed in the current level's Forward, in item order
};

// Total order used both for pruning and for the final cut: higher cumulative log-probability
// first, then shallower (so a parent tied with its child comes first), then creation order
// (siblings are created best first).
bool Better(const std::vector<Node>& nodes, int a, int b);

// Children a node at `depth` gets: a child with j better siblings ranks behind them and its
// `depth` ancestors, so it can only make the final cut when j + depth < max_nodes.
int ChildCount(const DraftParams& p, int depth);

// Appends the children of `parent` (-1: the last fed token) from row `row` of `top`, and
// where the row ranks more tokens than the parent's ChildCount, the next one as its RunnerUp
// (a drafter that wants runner-ups asks each level for one more than it has children).
void AddChildren(SeqWork& w, int parent, const TopKRows& top, int64_t row);

// Picks the nodes of `level` to expand: the level's top_k by cumulative log-probability,
// skipping those already outside the best max_nodes of the whole tree (their descendants
// rank even lower, and the tree only grows).
std::vector<int> PickFrontier(const SeqWork& w, int level);

// The best max_nodes nodes, closed under ancestors, in topological order (by depth, best first
// within a depth, so siblings come best first); `scratch` gets each tree node's scratch index.
TokenTree SelectTree(const SeqWork& w, std::vector<int32_t>* scratch);

// A selected tree and what a later guess of its outcome needs (pre-drafting,
// DraftModelDrafter::PreDraft): per node its scratch index and its best non-child token.
struct Selected {
  TokenTree tree;
  std::vector<int32_t> scratch;  // per tree node: its scratch index, -1 if not expanded
  // Per tree node: the best token among the children the work grew for it that did not make
  // the tree (the bonus token the target would emit there if it agreed with the draft), or
  // when every grown child was chosen its RunnerUp; -1 when it grew none (unexpanded) and -2
  // when every grown child was chosen and its row ranked nothing behind them.
  std::vector<int32_t> bonus;
  std::vector<float> bonus_logprob;
  int32_t root_bonus = -2;  // the same for the token the tree hangs below
  float root_bonus_logprob = 0;
  float top1_logprob = 0;  // mean log-probability of the draft's best child, over expanded nodes
};

// SelectTree, with the guesses' inputs.
Selected SelectTreeWithGuesses(const SeqWork& w);

}  // namespace draft_tree
}  // namespace specd

#endif  // SPECD_ENGINE_DRAFT_TREE_BUILDER_H_
