// Token trees: the unit of speculation exchanged between draft, router and verify.
#ifndef SPECD_COMMON_TOKEN_TREE_H_
#define SPECD_COMMON_TOKEN_TREE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace specd {

// Largest tree a drafter may propose and a verifier accepts (docs/architecture.md, wire formats).
inline constexpr int kMaxTreeNodes = 256;

// A draft tree hanging below the last committed token of a sequence.
// Nodes are in topological order: parents[i] < i, or -1 for a child of the last committed
// token. draft_logprobs is empty or holds one cumulative draft log-probability per node.
struct TokenTree {
  std::vector<int32_t> tokens;
  std::vector<int32_t> parents;
  std::vector<float> draft_logprobs;

  int size() const { return static_cast<int>(tokens.size()); }
  bool empty() const { return tokens.empty(); }
};

// INVALID_ARGUMENT "<field>[i]: token id X is outside the vocabulary [0, vocab_size)" for the
// first id of `ids` outside the vocabulary; the one vocabulary check of every service and
// drafter, so that clients see the same message wherever an id is refused.
absl::Status CheckTokenIds(absl::Span<const int32_t> ids, int vocab_size, absl::string_view field);

// Checks shape and topology; names the offending field (tokens, parents, draft_logprobs).
absl::Status ValidateTree(const TokenTree& tree, int vocab_size, int max_nodes = kMaxTreeNodes);

// Depth of each node; roots have depth 0.
std::vector<int> TreeDepths(const TokenTree& tree);

// Longest root-to-leaf path in tokens (0 for an empty tree).
int TreeMaxDepth(const TokenTree& tree);

// A chain tree: tokens[i] is the child of tokens[i-1].
TokenTree ChainTree(const std::vector<int32_t>& tokens);

// Children of each node, and of the virtual root at index -1 (returned as children[size]).
std::vector<std::vector<int32_t>> TreeChildren(const TokenTree& tree);

}  // namespace specd

#endif  // SPECD_COMMON_TOKEN_TREE_H_
