// Drafters: grow one token tree per sequence per speculation step (docs/architecture.md, the
// cluster).
//
// A drafter keeps its own per-sequence state. Each step the caller feeds it the tokens that
// were appended to the sequence since its previous step (the whole prompt at the first step,
// then the tokens the verifier emitted: accepted drafts and the bonus token); the returned tree
// hangs below the last token of the sequence, exactly where the verifier's VerifyItem::tree
// hangs below the last pending token. A drafter that missed some steps (the router fell back
// to target-only decoding) catches up by being fed everything it has not seen.
//
// One thread drives a drafter (the draft service's model loop or a Generator).
#ifndef SPECD_ENGINE_DRAFT_DRAFTER_H_
#define SPECD_ENGINE_DRAFT_DRAFTER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
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
  // The deepest node of this drafter's previous tree for the sequence that the verifier
  // accepted (-1: none, only the bonus token), or kNoOutcome when unknown. A drafter that keeps
  // the previous step's KV commits that path's tokens instead of feeding them again; it checks
  // them against new_tokens, so a stale or wrong value costs speed, not correctness.
  static constexpr int32_t kNoOutcome = -2;
  int32_t accepted_node = kNoOutcome;
  // Pre-drafting (DraftModelDrafter::PreDraft) only: the target samples (temperature > 0)
  // rather than decoding greedily, which changes which outcome of the tree is most likely.
  bool target_samples = false;
  // Pre-drafting only: how many outcomes to guess, each with its tree, most likely first.
  int fan_out = 1;
  // Pre-drafting a greedy target only: the sequence's measured acceptance, element d - 1 the
  // chance the target's token at depth d is the draft's best there given the path before it was
  // accepted (the last element for deeper levels), each in [0, 1]. With it every outcome is
  // ranked by one estimate of its chance (the draft's own probabilities only spread the
  // rejections), the whole greedy path included; empty: the greedy path first, then the rest by
  // the draft's probabilities.
  std::vector<float> chain_rates;
  // EAGLE drafters: the target's taps of consecutive tokens of the sequence, row r being
  // absolute position taps_first_position + r: [rows, feature size] fp32, host. Rows a drafter
  // already has are skipped, so a resend is harmless. Other drafters ignore them.
  std::vector<float> taps;
  int64_t taps_first_position = 0;
};

// The checks every drafter's CheckRequest makes: the sequence is `known` to it (NOT_FOUND
// naming `kind` otherwise), new_tokens is not empty and within the vocabulary, params valid.
absl::Status CheckDraftRequest(const DraftRequest& request, bool known, int vocab_size,
                               absl::string_view kind);

// What a batched call checks before it changes any state: each request passes `check`, in
// order (its error is returned), and no two requests name the same sequence (INVALID_ARGUMENT
// naming seq).
absl::Status CheckDraftBatch(absl::Span<const DraftRequest> requests,
                             absl::FunctionRef<absl::Status(const DraftRequest&)> check);

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

  // The target's residual-stream taps the drafter reads (VerifyItem::tap_layers), which its
  // caller passes on in DraftRequest::taps; empty for drafters that read tokens only.
  virtual std::vector<int> tap_layers() const { return {}; }

  // The checks Draft() makes on one request before doing any work (unknown sequence, empty or
  // out-of-vocabulary new_tokens, bad params). A service calls it per sequence first so that
  // one bad sequence fails alone instead of failing the whole batch.
  virtual absl::Status CheckRequest(const DraftRequest& request) const = 0;

  // One tree per request, in order; requests name distinct sequences. An empty tree means
  // "nothing worth proposing" (the step becomes target-only). On error the same requests can be
  // retried (no sequence's state changes, or a drafter remembers what it already consumed).
  virtual absl::StatusOr<std::vector<TokenTree>> Draft(absl::Span<const DraftRequest> requests) = 0;
};

}  // namespace specd

#endif  // SPECD_ENGINE_DRAFT_DRAFTER_H_
