// N-gram prompt lookup, a drafter without a model (engine/draft/drafter.h has the contract).
#ifndef SPECD_ENGINE_DRAFT_NGRAM_DRAFTER_H_
#define SPECD_ENGINE_DRAFT_NGRAM_DRAFTER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/draft/drafter.h"

namespace specd {

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
  // Only the last this many tokens of the history are searched (0: all of it). A lookup scans
  // the history for the suffix, so without a bound its cost grows with the context: the router
  // looks every auto sequence up every step.
  int max_history = 0;
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

#endif  // SPECD_ENGINE_DRAFT_NGRAM_DRAFTER_H_
