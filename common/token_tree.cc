#include "common/token_tree.h"

#include "absl/strings/str_cat.h"

namespace specd {

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
  for (size_t i = 0; i < n; ++i) {
    if (tree.tokens[i] < 0 || tree.tokens[i] >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("tree.tokens[", i, "]: token id ",
                                                     tree.tokens[i], " outside [0, ",
                                                     vocab_size, ")"));
    }
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
