#include "engine/draft/ngram_drafter.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace specd {

absl::Status ValidateNgramOptions(const NgramOptions& o) {
  if (o.min_n < 1) {
    return absl::InvalidArgumentError(absl::StrCat("min_n: ", o.min_n, " must be >= 1"));
  }
  if (o.max_n < o.min_n) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_n: ", o.max_n, " must be >= min_n (", o.min_n, ")"));
  }
  if (o.max_matches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_matches: ", o.max_matches, " must be >= 1"));
  }
  if (o.max_history < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_history: ", o.max_history, " must be >= 0"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<NgramDrafter>> NgramDrafter::Create(int vocab_size,
                                                                   const NgramOptions& options) {
  if (vocab_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("vocab_size: ", vocab_size, " must be >= 1"));
  }
  if (absl::Status s = ValidateNgramOptions(options); !s.ok()) return s;
  return std::unique_ptr<NgramDrafter>(new NgramDrafter(vocab_size, options));
}

absl::Status NgramDrafter::AddSequence(SeqId seq) {
  if (!history_.emplace(seq, std::vector<int32_t>()).second) {
    return absl::AlreadyExistsError(absl::StrCat("seq: n-gram sequence ", seq, " already exists"));
  }
  return absl::OkStatus();
}

absl::Status NgramDrafter::Release(SeqId seq) {
  if (history_.erase(seq) == 0) {
    return absl::NotFoundError(absl::StrCat("seq: n-gram sequence ", seq, " does not exist"));
  }
  return absl::OkStatus();
}

bool NgramDrafter::HasSequence(SeqId seq) const { return history_.contains(seq); }

absl::Status NgramDrafter::CheckRequest(const DraftRequest& r) const {
  return CheckDraftRequest(r, history_.contains(r.seq), vocab_size_, "n-gram");
}

TokenTree NgramDrafter::Propose(absl::Span<const int32_t> h, const DraftParams& params) const {
  if (options_.max_history > 0 && h.size() > static_cast<size_t>(options_.max_history)) {
    h = h.subspan(h.size() - options_.max_history);
  }
  const int len = static_cast<int>(h.size());
  // Start offsets (into h) of what followed each earlier occurrence of the longest matching
  // suffix, most recent first.
  std::vector<int> starts;
  for (int n = std::min(options_.max_n, len - 1); n >= options_.min_n && starts.empty(); --n) {
    const absl::Span<const int32_t> suffix = h.subspan(len - n, n);
    for (int i = len - n - 1; i >= 0; --i) {
      if (std::equal(suffix.begin(), suffix.end(), h.begin() + i)) {
        starts.push_back(i + n);
        if (static_cast<int>(starts.size()) >= options_.max_matches) break;
      }
    }
  }
  TokenTree tree;
  if (starts.empty()) return tree;
  // A trie of the continuations; counts[i] = occurrences continuing through node i.
  std::vector<int> counts;
  std::vector<int> num_children;
  int root_children = 0;
  for (int start : starts) {
    int node = -1;
    const int end = std::min(len, start + params.depth);
    for (int pos = start; pos < end; ++pos) {
      int next = -1;
      for (int c = node + 1; c < tree.size(); ++c) {
        if (tree.parents[c] == node && tree.tokens[c] == h[pos]) {
          next = c;
          break;
        }
      }
      if (next < 0) {
        int& siblings = node < 0 ? root_children : num_children[node];
        if (tree.size() >= params.max_nodes || siblings >= params.top_k) break;
        ++siblings;
        next = tree.size();
        tree.tokens.push_back(h[pos]);
        tree.parents.push_back(node);
        counts.push_back(0);
        num_children.push_back(0);
      }
      ++counts[next];
      node = next;
    }
  }
  const double total = static_cast<double>(starts.size());
  tree.draft_logprobs.resize(tree.size());
  for (int i = 0; i < tree.size(); ++i) {
    tree.draft_logprobs[i] = static_cast<float>(std::log(counts[i] / total));
  }
  return tree;
}

absl::StatusOr<std::vector<TokenTree>> NgramDrafter::Draft(
    absl::Span<const DraftRequest> requests) {
  if (absl::Status s =
          CheckDraftBatch(requests, [this](const DraftRequest& r) { return CheckRequest(r); });
      !s.ok()) {
    return s;
  }
  std::vector<TokenTree> trees;
  trees.reserve(requests.size());
  for (const DraftRequest& r : requests) {
    std::vector<int32_t>& h = history_[r.seq];
    h.insert(h.end(), r.new_tokens.begin(), r.new_tokens.end());
    trees.push_back(Propose(h, r.params));
  }
  return trees;
}

}  // namespace specd
