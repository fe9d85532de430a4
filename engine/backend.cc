#include "engine/backend.h"

#include "absl/strings/str_cat.h"

namespace specd {

VerifyOutcome WalkTree(const TokenTree& tree, int64_t first_position,
                       absl::FunctionRef<int32_t(int row, int64_t position)> sample) {
  const std::vector<std::vector<int32_t>> children = TreeChildren(tree);
  VerifyOutcome out;
  int node = -1;  // -1: the last pending token, whose logits are row 0
  for (int64_t pos = first_position;; ++pos) {
    const int32_t y = sample(node + 1, pos);
    out.tokens.push_back(y);
    int next = -1;
    for (int32_t c : children[node < 0 ? tree.size() : node]) {
      if (tree.tokens[c] == y) {
        next = c;
        break;
      }
    }
    if (next < 0) break;
    out.accepted_nodes.push_back(next);
    node = next;
  }
  out.accepted_draft = static_cast<int>(out.accepted_nodes.size());
  return out;
}

VerifyOutcome AcceptTree(const TokenTree& tree, absl::Span<const float> rows, int vocab_size,
                         const SamplingParams& sampling, int64_t first_position) {
  return WalkTree(tree, first_position, [&](int row, int64_t position) {
    return SampleToken(rows.subspan(static_cast<size_t>(row) * vocab_size, vocab_size), sampling,
                       position);
  });
}

absl::StatusOr<int64_t> MakeVerifyForward(const Backend& backend, const VerifyItem& item,
                                          size_t index, ForwardItem* f) {
  if (item.pending.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("verify item ", index, ": no pending token"));
  }
  if (absl::Status s = ValidateTree(item.tree, backend.config().vocab_size); !s.ok()) return s;
  absl::StatusOr<int64_t> len = backend.CommittedLength(item.seq);
  if (!len.ok()) return len.status();
  const int p = static_cast<int>(item.pending.size());
  f->seq = item.seq;
  f->tokens = item.pending;
  f->tokens.insert(f->tokens.end(), item.tree.tokens.begin(), item.tree.tokens.end());
  f->parents.clear();
  for (int i = 0; i < p; ++i) f->parents.push_back(i - 1);
  for (int32_t parent : item.tree.parents) f->parents.push_back(parent < 0 ? p - 1 : parent + p);
  f->logit_rows.clear();
  for (int i = p - 1; i < static_cast<int>(f->tokens.size()); ++i) f->logit_rows.push_back(i);
  return *len + p;
}

std::vector<int32_t> AcceptedScratchPath(int num_pending, const VerifyOutcome& outcome) {
  std::vector<int32_t> path;
  for (int i = 0; i < num_pending; ++i) path.push_back(i);
  for (int32_t n : outcome.accepted_nodes) path.push_back(n + num_pending);
  return path;
}

absl::StatusOr<std::vector<VerifyOutcome>> Backend::Verify(absl::Span<const VerifyItem> items) {
  const int vocab = config().vocab_size;
  std::vector<ForwardItem> forward(items.size());
  std::vector<int64_t> first_position(items.size());
  for (size_t b = 0; b < items.size(); ++b) {
    absl::StatusOr<int64_t> first = MakeVerifyForward(*this, items[b], b, &forward[b]);
    if (!first.ok()) return first.status();
    first_position[b] = *first;
  }
  std::vector<float> logits;
  if (absl::Status s = Forward(forward, &logits); !s.ok()) return s;
  std::vector<VerifyOutcome> outcomes(items.size());
  size_t row = 0;
  for (size_t b = 0; b < items.size(); ++b) {
    const size_t nrows = forward[b].logit_rows.size();
    outcomes[b] = AcceptTree(items[b].tree,
                             absl::Span<const float>(logits).subspan(row * vocab, nrows * vocab),
                             vocab, items[b].sampling, first_position[b]);
    row += nrows;
    const std::vector<int32_t> path =
        AcceptedScratchPath(static_cast<int>(items[b].pending.size()), outcomes[b]);
    if (absl::Status s = Commit(items[b].seq, path); !s.ok()) return s;
  }
  return outcomes;
}

}  // namespace specd
