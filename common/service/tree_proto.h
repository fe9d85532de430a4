// Conversion between the engine's TokenTree and the wire's specd.v1.TokenTree, the one copy
// the router, the draft service and the verify service share.
#ifndef SPECD_COMMON_SERVICE_TREE_PROTO_H_
#define SPECD_COMMON_SERVICE_TREE_PROTO_H_

#include "common/token_tree.h"
#include "specd/v1/tree.pb.h"

namespace specd {

// Copies the fields as they are; ValidateTree() is the caller's to run.
TokenTree TreeFromProto(const v1::TokenTree& proto);
void TreeToProto(const TokenTree& tree, v1::TokenTree* proto);

}  // namespace specd

#endif  // SPECD_COMMON_SERVICE_TREE_PROTO_H_
