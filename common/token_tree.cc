#include "common/token_tree.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace specd {

absl::Status CheckTokenIds(absl::Span<const int32_t> ids, int vocab_size,
                           absl::string_view field) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "]: token id ", ids[i],
                                                     " is outside the vocabulary [0, ",
                                                     vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateTree(const TokenTree& tree, int vocab_size, int max_nodes) {
  const size_t n = tree.tokens.size();
  if (n > static_cast<size_t>(max_nodes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tree.tokens: ", n, " nodes exceed the limit of ", max_nodes));
  }
  if (tree.parents.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("tree.parents: has ", tree.parents.size(),
                                                   " entries for ", n, " tokens"));
  }
  if (!tree.draft_logprobs.empty() && tree.draft_logprobs.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("tree.draft_logprobs: has ",
                                                   tree.draft_logprobs.size(),
                                                   " entries for ", n, " tokens"));
  }
  if (absl::Status s = CheckTokenIds(tree.tokens, vocab_size, "tree.tokens"); !s.ok()) return s;
  for (size_t i = 0; i < n; ++i) {
    if (tree.parents[i] < -1 || tree.parents[i] >= static_cast<int32_t>(i)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tree.parents[", i, "]: ", tree.parents[i],
          " is not -1 or the index of an earlier node (nodes must be in topological order)"));
    }
  }
  return absl::OkStatus();
}

std::vector<int> TreeDepths(const TokenTree& tree) {
  std::vector<int> depth(tree.tokens.size(), 0);
  for (size_t i = 0; i < tree.tokens.size(); ++i) {
    depth[i] = tree.parents[i] < 0 ? 0 : depth[tree.parents[i]] + 1;
  }
  return depth;
}

int TreeMaxDepth(const TokenTree& tree) {
  int max_depth = 0;
  for (int d : TreeDepths(tree)) max_depth = std::max(max_depth, d + 1);
  return max_depth;
}

TokenTree ChainTree(const std::vector<int32_t>& tokens) {
  TokenTree tree;
  tree.tokens = tokens;
  tree.parents.resize(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) tree.parents[i] = static_cast<int32_t>(i) - 1;
  return tree;
}

std::vector<std::vector<int32_t>> TreeChildren(const TokenTree& tree) {
  const int n = tree.size();
  std::vector<std::vector<int32_t>> children(n + 1);
  for (int i = 0; i < n; ++i) {
    const int p = tree.parents[i];
    children[p < 0 ? n : p].push_back(i);
  }
  return children;
}

}  // namespace specd
