#include "common/service/tree_proto.h"

namespace specd {

TokenTree TreeFromProto(const v1::TokenTree& proto) {
  TokenTree tree;
  tree.tokens.assign(proto.tokens().begin(), proto.tokens().end());
  tree.parents.assign(proto.parents().begin(), proto.parents().end());
  tree.draft_logprobs.assign(proto.draft_logprobs().begin(), proto.draft_logprobs().end());
  return tree;
}

void TreeToProto(const TokenTree& tree, v1::TokenTree* proto) {
  proto->mutable_tokens()->Assign(tree.tokens.begin(), tree.tokens.end());
  proto->mutable_parents()->Assign(tree.parents.begin(), tree.parents.end());
  proto->mutable_draft_logprobs()->Assign(tree.draft_logprobs.begin(), tree.draft_logprobs.end());
}

}  // namespace specd
