#include "engine/backend.h"

#include "absl/strings/str_cat.h"

namespace specd {

VerifyOutcome AcceptTree(const TokenTree& tree, absl::Span<const float> rows, int vocab_size,
                         const SamplingParams& sampling, int64_t first_position) {
  const std::vector<std::vector<int32_t>> children = TreeChildren(tree);
  VerifyOutcome out;
  int node = -1;  // -1: the last pending token, whose logits are rows[0]
  for (int64_t pos = first_position;; ++pos) {
    const absl::Span<const float> row =
        rows.subspan(static_cast<size_t>(node + 1) * vocab_size, vocab_size);
    const int32_t y = SampleToken(row, sampling, pos);
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

absl::StatusOr<std::vector<VerifyOutcome>> Backend::Verify(absl::Span<const VerifyItem> items) {
  const int vocab = config().vocab_size;
  std::vector<ForwardItem> forward(items.size());
  std::vector<int64_t> first_position(items.size());
  for (size_t b = 0; b < items.size(); ++b) {
    const VerifyItem& it = items[b];
    if (it.pending.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("verify item ", b, ": no pending token"));
    }
    if (absl::Status s = ValidateTree(it.tree, vocab); !s.ok()) return s;
    absl::StatusOr<int64_t> len = CommittedLength(it.seq);
    if (!len.ok()) return len.status();
    const int p = static_cast<int>(it.pending.size());
    ForwardItem& f = forward[b];
    f.seq = it.seq;
    f.tokens = it.pending;
    f.tokens.insert(f.tokens.end(), it.tree.tokens.begin(), it.tree.tokens.end());
    for (int i = 0; i < p; ++i) f.parents.push_back(i - 1);
    for (int32_t parent : it.tree.parents) f.parents.push_back(parent < 0 ? p - 1 : parent + p);
    for (int i = p - 1; i < static_cast<int>(f.tokens.size()); ++i) f.logit_rows.push_back(i);
    first_position[b] = *len + p;
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
    const int p = static_cast<int>(items[b].pending.size());
    std::vector<int32_t> path;
    for (int i = 0; i < p; ++i) path.push_back(i);
    for (int32_t n : outcomes[b].accepted_nodes) path.push_back(n + p);
    if (absl::Status s = Commit(items[b].seq, path); !s.ok()) return s;
  }
  return outcomes;
}

}  // namespace specd
