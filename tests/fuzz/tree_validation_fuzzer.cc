// libFuzzer: a draft tree as the verify service receives it (TokenTree wire bytes) through
// ValidateTree; an accepted tree must be walkable by everything downstream: depths, children
// lists.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/service/tree_proto.h"
#include "common/token_tree.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  specd::v1::TokenTree proto;
  if (!proto.ParseFromArray(data, static_cast<int>(size))) return 0;
  const specd::TokenTree tree = specd::TreeFromProto(proto);
  if (!specd::ValidateTree(tree, /*vocab_size=*/320).ok()) return 0;
  const std::vector<int> depths = specd::TreeDepths(tree);
  const std::vector<std::vector<int32_t>> children = specd::TreeChildren(tree);
  if (depths.size() != tree.tokens.size() || children.size() != tree.tokens.size() + 1) {
    __builtin_trap();
  }
  size_t edges = 0;
  for (const auto& c : children) edges += c.size();
  if (edges != tree.tokens.size()) __builtin_trap();
  for (int i = 0; i < tree.size(); ++i) {
    const int p = tree.parents[i];
    if (depths[i] != (p < 0 ? 0 : depths[p] + 1)) __builtin_trap();
  }
  static volatile int sink;
  sink = specd::TreeMaxDepth(tree);
  return 0;
}
