// Drafters: grow one token tree per sequence per speculation step (DESIGN.md, draft service).
//
// A drafter keeps its own per-sequence state. Each step the caller feeds it the tokens that
// were appended to the sequence since its previous step (the whole prompt at the first step,
// then the tokens the verifier emitted: accepted drafts and the bonus token); the returned tree
// hangs below the last token of the sequence, exactly where the verifier's VerifyItem::tree
// hangs below the last pending token. A drafter that missed some steps (the router fell back
// to target-only decoding) catches up by being fed everything it has not seen.
//
// One thread drives a drafter (the draft service's model loop or a Generator).
#ifndef SPECD_ENGINE_DRAFTER_H_
#define SPECD_ENGINE_DRAFTER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/token_tree.h"
#include "engine/backend.h"

namespace specd {

// Shape of the tree one step may propose.
struct DraftParams {
  int depth = 4;       // longest root-to-leaf path, in tokens (>= 1)
  int top_k = 4;       // children per expanded node (>= 1)
  int max_nodes = 16;  // nodes in the returned tree, 1..kMaxTreeNodes
};

// INVALID_ARGUMENT naming the field (depth, top_k, max_nodes) when out of range.
absl::Status ValidateDraftParams(const DraftParams& params);

struct DraftRequest {
  SeqId seq = 0;
  // Tokens appended to the sequence since this drafter's last step for it; never empty (the
  // tree hangs below the last of them).
  std::vector<int32_t> new_tokens;
  DraftParams params;
};

class Drafter {
 public:
  virtual ~Drafter() = default;

  // ALREADY_EXISTS for a live id; RESOURCE_EXHAUSTED when a model drafter has no KV left.
  virtual absl::Status AddSequence(SeqId seq) = 0;
  // Frees the sequence's state; NOT_FOUND for an unknown id.
  virtual absl::Status Release(SeqId seq) = 0;
  virtual bool HasSequence(SeqId seq) const = 0;

  // Token ids the drafter accepts and proposes; must equal the target's vocab_size.
  virtual int vocab_size() const = 0;

  // The checks Draft() makes on one request before doing any work (unknown sequence, empty or
  // out-of-vocabulary new_tokens, bad params). A service calls it per sequence first so that
  // one bad sequence fails alone instead of failing the whole batch.
  virtual absl::Status CheckRequest(const DraftRequest& request) const = 0;

  // One tree per request, in order; requests name distinct sequences. An empty tree means
  // "nothing worth proposing" (the step becomes target-only). On error no sequence's state
  // changes, so the same requests can be retried.
  virtual absl::StatusOr<std::vector<TokenTree>> Draft(absl::Span<const DraftRequest> requests) = 0;
};

// EAGLE-2 style dynamic tree over a standalone draft model (any checkpoint with the target's
// vocabulary), on the backend that owns the draft model's weights and KV cache:
//   1. feed the new tokens as a chain (they stay in the draft KV cache);
//   2. the root's top-k children by draft log-probability form the first level;
//   3. per depth level, expand the top-k nodes of that level by cumulative draft
//      log-probability (one batched Forward() over all sequences per level), each expansion
//      adding the node's top-k children;
//   4. keep the max_nodes best nodes overall by cumulative log-probability. Because a child's
//      cumulative log-probability never exceeds its parent's, the best nodes are closed under
//      ancestors; ties are broken parent first. Nodes that cannot make the final cut are never
//      expanded.
// The returned tree's draft_logprobs are the cumulative log-probabilities; children of a node
// are listed best first. The draft tree's scratch KV is dropped at the end of the step.
class DraftModelDrafter : public Drafter {
 public:
  // `model` must outlive the drafter and is driven only by it.
  explicit DraftModelDrafter(Backend* model);

  absl::Status AddSequence(SeqId seq) override;
  absl::Status Release(SeqId seq) override;
  bool HasSequence(SeqId seq) const override;
  absl::Status CheckRequest(const DraftRequest& request) const override;
  absl::StatusOr<std::vector<TokenTree>> Draft(absl::Span<const DraftRequest> requests) override;
  int vocab_size() const override { return vocab_size_; }

 private:
  Backend* model_;
  int vocab_size_;
};

// N-gram prompt lookup (no model): match the last n tokens of the sequence's history (prompt
// and output) against earlier occurrences, longest n first (max_n down to min_n), and propose
// what followed them. With several earlier occurrences whose continuations differ, the
// continuations become branches of one tree (most recent occurrence first, at most top_k
// children a node, at most max_nodes nodes, paths at most depth long). draft_logprobs are
// log(share of the matched occurrences that continue through the node), so they are
// cumulative and non-increasing along paths.
struct NgramOptions {
  int min_n = 1;
  int max_n = 3;
  // Most recent matching occurrences considered per step; bounds the work on long histories.
  int max_matches = 64;
};

absl::Status ValidateNgramOptions(const NgramOptions& options);

class NgramDrafter : public Drafter {
 public:
  // `vocab_size` bounds the token ids it accepts (the target's vocabulary).
  static absl::StatusOr<std::unique_ptr<NgramDrafter>> Create(int vocab_size,
                                                              const NgramOptions& options);

  absl::Status AddSequence(SeqId seq) override;
  absl::Status Release(SeqId seq) override;
  bool HasSequence(SeqId seq) const override;
  absl::Status CheckRequest(const DraftRequest& request) const override;
  absl::StatusOr<std::vector<TokenTree>> Draft(absl::Span<const DraftRequest> requests) override;
  int vocab_size() const override { return vocab_size_; }

  // The tree proposed for a whole token history; Draft() calls it after appending new_tokens.
  TokenTree Propose(absl::Span<const int32_t> history, const DraftParams& params) const;

 private:
  NgramDrafter(int vocab_size, const NgramOptions& options)
      : vocab_size_(vocab_size), options_(options) {}

  int vocab_size_;
  NgramOptions options_;
  absl::flat_hash_map<SeqId, std::vector<int32_t>> history_;
};

}  // namespace specd

#endif  // SPECD_ENGINE_DRAFTER_H_
