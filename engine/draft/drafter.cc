#include "engine/draft/drafter.h"

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace specd {

absl::Status ValidateDraftParams(const DraftParams& p) {
  // A tree holds at most kMaxTreeNodes nodes, so it is never deeper or wider than that; larger
  // values (depth 100000 used to return an empty tree) are mistakes, refused by name.
  if (p.depth < 1 || p.depth > kMaxTreeNodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("depth: ", p.depth, " must be in [1, ", kMaxTreeNodes, "]"));
  }
  if (p.top_k < 1 || p.top_k > kMaxTreeNodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_k: ", p.top_k, " must be in [1, ", kMaxTreeNodes, "]"));
  }
  if (p.max_nodes < 1 || p.max_nodes > kMaxTreeNodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_nodes: ", p.max_nodes, " must be in [1, ", kMaxTreeNodes, "]"));
  }
  return absl::OkStatus();
}

absl::Status CheckDraftRequest(const DraftRequest& r, bool known, int vocab_size,
                               absl::string_view kind) {
  if (!known) {
    return absl::NotFoundError(absl::StrCat("seq: ", kind, " sequence ", r.seq, " does not exist"));
  }
  if (r.new_tokens.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("new_tokens: empty for sequence ", r.seq,
                     "; each step must feed at least the last emitted token"));
  }
  if (absl::Status s = CheckTokenIds(r.new_tokens, vocab_size, "new_tokens"); !s.ok()) return s;
  return ValidateDraftParams(r.params);
}

absl::Status CheckDraftBatch(absl::Span<const DraftRequest> requests,
                             absl::FunctionRef<absl::Status(const DraftRequest&)> check) {
  absl::flat_hash_set<SeqId> seen;
  for (const DraftRequest& r : requests) {
    if (absl::Status s = check(r); !s.ok()) return s;
    if (!seen.insert(r.seq).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("seq: sequence ", r.seq, " appears twice in one draft batch"));
    }
  }
  return absl::OkStatus();
}

}  // namespace specd
