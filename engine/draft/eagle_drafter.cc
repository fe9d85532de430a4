#include "engine/draft/eagle_drafter.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/draft/tree_builder.h"
#include "engine/topk.h"

namespace specd {
namespace {

using draft_tree::AddChildren;
using draft_tree::ChildCount;
using draft_tree::PickFrontier;
using draft_tree::SelectTree;
using draft_tree::SeqWork;

// One sequence of one Draft() call.
struct Work {
  SeqWork tree;
  bool ready = false;                           // caught up: the chain's last output is the root
  int chain = 0;                                // pairs fed as this step's chain
  std::vector<float> root;                      // [H] the root's output hidden state
  std::vector<std::vector<float>> node_hidden;  // per tree node once expanded: [H]
};

// Runs `head` over `items` and fills `top` with every requested row's best min(k, draft vocab)
// draft ids, mapped to target ids, and their log-probabilities: through the head's ForwardTopK
// (a device head copies only [rows, k] to the host) when k fits it, else Forward() and a host
// top-k of the logits.
absl::Status HeadTopK(EagleHead& head, absl::Span<const EagleHeadItem> items, int k,
                      EagleHeadOutputs* out, TopKRows* top) {
  if (k <= kMaxForwardTopK) {
    if (absl::Status s = head.ForwardTopK(items, k, out, top); !s.ok()) return s;
  } else {
    if (absl::Status s = head.Forward(items, out); !s.ok()) return s;
    TopKRowsOnHost(out->logits, head.config().draft_vocab_size, k, top);
  }
  const absl::Span<const int32_t> d2t = head.draft_to_target();
  for (int32_t& id : top->ids) id = d2t[id];
  return absl::OkStatus();
}

}  // namespace

EagleDrafter::EagleDrafter(EagleHead* head)
    : head_(head), feature_size_(head->config().feature_size()) {}

absl::Status EagleDrafter::AddSequence(SeqId seq) {
  if (absl::Status s = head_->AddSequence(seq); !s.ok()) return s;
  states_[seq] = SeqState();
  return absl::OkStatus();
}

absl::Status EagleDrafter::Release(SeqId seq) {
  states_.erase(seq);
  return head_->RemoveSequence(seq);
}

bool EagleDrafter::HasSequence(SeqId seq) const { return head_->HasSequence(seq); }

int64_t EagleDrafter::committed(SeqId seq) const {
  auto it = states_.find(seq);
  absl::StatusOr<int64_t> held = head_->CommittedLength(seq);
  if (it == states_.end() || !held.ok()) return -1;
  return it->second.base + *held;
}

absl::Status EagleDrafter::CheckRequest(const DraftRequest& r) const {
  if (absl::Status s = CheckDraftRequest(r, head_->HasSequence(r.seq), vocab_size(), "eagle");
      !s.ok()) {
    return s;
  }
  if (r.taps.size() % static_cast<size_t>(feature_size_) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("taps: ", r.taps.size(),
                                                   " floats are not whole rows of the head's ",
                                                   feature_size_, " (its feature size)"));
  }
  if (r.taps_first_position < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("taps: first position ", r.taps_first_position, " is negative"));
  }
  return absl::OkStatus();
}

void EagleDrafter::Merge(const DraftRequest& r, SeqState& st) const {
  size_t skip = 0;
  if (!st.carried.empty() && st.carried.size() <= r.new_tokens.size() &&
      std::equal(st.carried.begin(), st.carried.end(), r.new_tokens.begin())) {
    skip = st.carried.size();
  }
  st.carried.clear();
  st.tokens.insert(st.tokens.end(), r.new_tokens.begin() + skip, r.new_tokens.end());

  const int64_t f = feature_size_;
  const int64_t rows = static_cast<int64_t>(r.taps.size()) / f;
  const int64_t c = st.base + head_->CommittedLength(r.seq).value_or(0);
  // Rows the head already holds are skipped.
  const int64_t drop = std::max<int64_t>(0, c - r.taps_first_position);
  if (drop >= rows) return;
  const int64_t first = r.taps_first_position + drop, n = rows - drop;
  const float* src = r.taps.data() + drop * f;
  const int64_t have = static_cast<int64_t>(st.taps.size()) / f;
  const int64_t end = st.taps_first + have;
  if (have == 0 || first > end) {
    // Nothing kept, or a gap after what is kept: only the new rows can still be of use.
    st.taps.assign(src, src + n * f);
    st.taps_first = first;
  } else if (first + n > end) {
    st.taps.insert(st.taps.end(), src + (end - first) * f, src + n * f);
  }
}

absl::StatusOr<std::vector<TokenTree>> EagleDrafter::Draft(
    absl::Span<const DraftRequest> requests) {
  if (absl::Status s =
          CheckDraftBatch(requests, [this](const DraftRequest& r) { return CheckRequest(r); });
      !s.ok()) {
    return s;
  }
  const int64_t f = feature_size_, h = head_->config().head.hidden_size;

  // Tokens and taps in; a failed chain puts every sequence back as it was.
  std::vector<SeqState> before;
  before.reserve(requests.size());
  for (const DraftRequest& r : requests) {
    SeqState& st = states_[r.seq];
    before.push_back(st);
    Merge(r, st);
  }
  auto restore = [&](const absl::Status& s) {
    for (size_t b = 0; b < requests.size(); ++b) states_[requests[b].seq] = std::move(before[b]);
    return s;
  };

  // The chain: every pair whose taps and next token have arrived.
  std::vector<Work> work(requests.size());
  std::vector<EagleHeadItem> items;
  std::vector<size_t> item_work;
  for (size_t b = 0; b < requests.size(); ++b) {
    const DraftRequest& r = requests[b];
    SeqState& st = states_[r.seq];
    absl::StatusOr<int64_t> committed = head_->CommittedLength(r.seq);
    if (!committed.ok()) return restore(committed.status());
    if (*committed > 0 && !st.taps.empty() && st.taps_first > st.base + *committed) {
      // A gap after the pairs the head holds: the rows between are gone for good (the verify
      // service dropped taps it held past its bound). The head starts again from the rows after
      // the gap, as below, rather than never drafting this sequence again.
      if (absl::Status s = head_->RemoveSequence(r.seq); !s.ok()) return restore(s);
      if (absl::Status s = head_->AddSequence(r.seq); !s.ok()) return restore(s);
      committed = int64_t{0};
    }
    if (*committed == 0 && !st.taps.empty() && st.taps_first > st.base) {
      // The head holds nothing of the sequence and its taps begin mid-sequence (this service
      // took the sequence over while it ran, after a restart): the head's positions start
      // there. RoPE scores depend on differences of positions only, so the head drafts as from
      // a context that begins at that pair.
      st.base = st.taps_first;
    }
    const int64_t c = st.base + *committed;  // sequence position of the next pair
    const int64_t last = static_cast<int64_t>(st.tokens.size()) - 1;  // the tree's root token
    const int64_t rows = static_cast<int64_t>(st.taps.size()) / f;
    int64_t m = st.taps_first == c ? std::min(rows, last - c) : 0;
    m = std::max<int64_t>(0, std::min<int64_t>(m, head_->context_length() - *committed));
    Work& w = work[b];
    w.chain = static_cast<int>(m);
    w.ready = m > 0 && c + m == last && last - st.base + r.params.depth <= head_->context_length();
    if (m == 0) continue;
    EagleHeadItem item;
    item.seq = r.seq;
    item.tokens.assign(st.tokens.begin() + c + 1, st.tokens.begin() + c + 1 + m);
    item.parents.resize(m);
    std::iota(item.parents.begin(), item.parents.end(), -1);
    item.input = EagleInput::kTargetFeatures;
    item.inputs = absl::MakeConstSpan(st.taps).first(static_cast<size_t>(m * f));
    if (w.ready) item.output_rows = {static_cast<int32_t>(m - 1)};
    items.push_back(std::move(item));
    item_work.push_back(b);
  }
  // The roots' children come from the chains' last outputs: their top-k with the chain pass.
  int k = 1;
  for (size_t b = 0; b < requests.size(); ++b) {
    if (work[b].ready) k = std::max(k, ChildCount(requests[b].params, 0));
  }
  EagleHeadOutputs out;
  TopKRows top;
  if (!items.empty()) {
    if (absl::Status s = HeadTopK(*head_, items, k, &out, &top); !s.ok()) return restore(s);
  }
  for (size_t i = 0; i < items.size(); ++i) {
    std::vector<int32_t> path(items[i].tokens.size());
    std::iota(path.begin(), path.end(), 0);
    if (absl::Status s = head_->Commit(items[i].seq, path); !s.ok()) {
      return absl::InternalError(absl::StrCat("EAGLE head commit of the chain failed for sequence ",
                                              items[i].seq, ": ", s.message()));
    }
    fed_tokens_ += static_cast<int64_t>(path.size());
  }
  // From here on the chains are committed: a retry must not merge these new_tokens again.
  for (size_t b = 0; b < requests.size(); ++b) {
    SeqState& st = states_[requests[b].seq];
    const int64_t m = work[b].chain;
    st.taps.erase(st.taps.begin(), st.taps.begin() + m * f);
    st.taps_first += m;
    st.carried = requests[b].new_tokens;
  }

  // The roots' children.
  std::vector<size_t> ready;
  int64_t row = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    Work& w = work[item_work[i]];
    if (!w.ready) continue;
    w.root.assign(out.hidden.begin() + row * h, out.hidden.begin() + (row + 1) * h);
    ++row;
    ready.push_back(item_work[i]);
  }
  auto drop_scratch = [&](const absl::Status& s) {
    for (size_t b : ready) head_->Commit(requests[b].seq, {}).IgnoreError();
    return s;
  };
  for (size_t i = 0; i < ready.size(); ++i) {
    Work& w = work[ready[i]];
    w.tree.req = &requests[ready[i]];
    AddChildren(w.tree, -1, top, i);
  }

  // One batched forward per level, each node fed its parent's output.
  std::vector<std::vector<float>> inputs;
  for (int level = 0;; ++level) {
    items.clear();
    item_work.clear();
    inputs.clear();
    inputs.reserve(ready.size());
    k = 1;
    for (size_t b : ready) {
      Work& w = work[b];
      SeqWork& t = w.tree;
      t.frontier.clear();
      if (level + 1 >= t.req->params.depth) continue;
      t.frontier = PickFrontier(t, level);
      if (t.frontier.empty()) continue;
      EagleHeadItem item;
      item.seq = t.req->seq;
      item.input = EagleInput::kHidden;
      std::vector<float>& in = inputs.emplace_back();
      for (int node : t.frontier) {
        draft_tree::Node& nd = t.nodes[node];
        nd.scratch = t.next_scratch++;
        item.output_rows.push_back(static_cast<int32_t>(item.tokens.size()));
        item.tokens.push_back(nd.token);
        item.parents.push_back(nd.parent < 0 ? -1 : t.nodes[nd.parent].scratch);
        const std::vector<float>& parent = nd.parent < 0 ? w.root : w.node_hidden[nd.parent];
        in.insert(in.end(), parent.begin(), parent.end());
      }
      item.inputs = in;
      k = std::max(k, ChildCount(t.req->params, level + 1));
      items.push_back(std::move(item));
      item_work.push_back(b);
    }
    if (items.empty()) break;
    if (absl::Status s = HeadTopK(*head_, items, k, &out, &top); !s.ok()) {
      return drop_scratch(s);
    }
    fed_tokens_ += static_cast<int64_t>(out.hidden.size() / h);
    row = 0;
    for (size_t b : item_work) {
      Work& w = work[b];
      SeqWork& t = w.tree;
      for (int node : t.frontier) {
        if (w.node_hidden.size() < t.nodes.size()) w.node_hidden.resize(t.nodes.size());
        w.node_hidden[node].assign(out.hidden.begin() + row * h,
                                   out.hidden.begin() + (row + 1) * h);
        AddChildren(t, node, top, row);
        ++row;
      }
    }
  }

  std::vector<TokenTree> trees(requests.size());
  std::vector<int32_t> scratch;
  for (size_t b : ready) trees[b] = SelectTree(work[b].tree, &scratch);
  // The tree's pairs hold the head's own guesses: the committed KV only takes the target's.
  drop_scratch(absl::OkStatus()).IgnoreError();
  for (const DraftRequest& r : requests) states_[r.seq].carried.clear();
  return trees;
}

}  // namespace specd
