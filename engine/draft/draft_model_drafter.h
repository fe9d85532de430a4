// The standalone draft model drafter (engine/draft/drafter.h has the Drafter contract).
#ifndef SPECD_ENGINE_DRAFT_DRAFT_MODEL_DRAFTER_H_
#define SPECD_ENGINE_DRAFT_DRAFT_MODEL_DRAFTER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/backend.h"
#include "engine/draft/drafter.h"
#include "engine/topk.h"

namespace specd {

struct DraftModelDrafterOptions {
  // Take each level's children from Backend::ForwardTopK() (the top-k computed where the
  // logits are) instead of copying full logit rows to the host. Same trees either way.
  bool backend_topk = true;
  // Keep a step's scratch KV until the next step and commit the accepted path from it
  // (DraftRequest::accepted_node) instead of feeding those tokens again. Same trees either way.
  bool reuse_kv = true;
  // The most tokens one forward of the draft model carries: a longer catch-up (the new tokens
  // of several sequences, a prompt) or tree level is fed as consecutive forwards of at most this
  // many (engine/chunked_forward.h), so no forward leaves the GEMM row classes the CUDA warm-up
  // decided. Set it to the backend's cuda_gemm_invariant_rows. < 1: no limit. Same trees
  // either way.
  int64_t max_forward_rows = kDefaultGemmInvariantRows;
};

// EAGLE-2 style dynamic tree over a standalone draft model (any checkpoint with the target's
// vocabulary), on the backend that owns the draft model's weights and KV cache:
//   1. feed the new tokens as a chain (they stay in the draft KV cache);
//   2. the root's top-k children by draft log-probability form the first level;
//   3. per depth level, expand the top-k nodes of that level by cumulative draft
//      log-probability (one batched forward over all sequences per level), each expansion
//      adding the node's top-k children;
//   4. keep the max_nodes best nodes overall by cumulative log-probability. Because a child's
//      cumulative log-probability never exceeds its parent's, the best nodes are closed under
//      ancestors; ties are broken parent first. Nodes that cannot make the final cut are never
//      expanded.
// The returned tree's draft_logprobs are the cumulative log-probabilities; children of a node
// are listed best first.
//
// KV reuse (reuse_kv). The step's scratch region (the fed chain, then every expanded node) stays
// in the draft model until the sequence's next Draft(). That call commits the chain plus the
// expanded prefix of the path to DraftRequest::accepted_node when the path's tokens begin
// new_tokens, and feeds only the rest (the bonus token, and accepted leaves that were never
// expanded); otherwise (no outcome reported, the tokens disagree: a resync after target-only
// steps or a switch of drafter) it commits the chain alone and feeds all of new_tokens. So the
// draft KV holds at most the sequence's tokens plus one step's expanded nodes. A Draft() that
// fails after committing keeps note of the tokens it committed and skips them when retried.
//
// Pre-drafting (PreDraft(), the router's overlap): while the target verifies the kept tree, the
// drafter guesses its outcome and grows the next tree below the guess, appending to the same
// scratch region (the guessed path reuses the kept tree's KV for its expanded part). The guess
// is the outcome the draft model finds most likely: an accepted node a (or none) and a bonus
// token b that is not one of a's children. A greedy target emits its argmax at every position,
// so where the draft agrees with it the outcome is the draft's greedy path: from the root, the
// best child while it is in the tree, then that node's best token as the bonus. A sampling
// target (DraftRequest::target_samples) draws, so the guess is the outcome of highest
// log p(path to a) + log p(b | a), b the best non-child among a's top-k children or, where all
// of them are children (a top-1 chain's inner nodes), the token its row ranked next (each level
// asks for one more than top_k: the runner-up is a guess, never a node), a node never expanded
// scored with the tree's mean best-child log-probability. So a chain's outcomes "accepted up to
// node a, then the target's token is the draft's runner-up there" can be guessed beside the one
// that accepts it whole, which only a fan-out above one reaches. An accepted node never
// expanded gets its best token from one extra forward. The next call resolves
// the guess from its new_tokens: when they begin with the guessed tokens (a hit) the guessed
// path is committed and the pre-drafted tree becomes the kept tree (its scratch KV is dropped by
// that commit, so a later guess below it feeds its path again); otherwise (a miss) the guess is
// forgotten and the kept tree's outcome is applied as usual, dropping the guess's KV.
class DraftModelDrafter : public Drafter {
 public:
  // `model` must outlive the drafter and is driven only by it.
  explicit DraftModelDrafter(Backend* model, DraftModelDrafterOptions options = {});

  absl::Status AddSequence(SeqId seq) override;
  absl::Status Release(SeqId seq) override;
  bool HasSequence(SeqId seq) const override;
  absl::Status CheckRequest(const DraftRequest& request) const override;
  absl::StatusOr<std::vector<TokenTree>> Draft(absl::Span<const DraftRequest> requests) override;
  int vocab_size() const override { return vocab_size_; }

  // The top-k a level asks the model for when its nodes get `children` children: one more, the
  // runner-up (a pre-draft's guess at a node whose top-k are all children), within
  // kMaxForwardTopK. What a draft-level warm-up must ask to warm the same graphs.
  static int TopKAsked(int children) {
    return children < kMaxForwardTopK ? children + 1 : children;
  }

  // The tree below the guessed outcome of each sequence's kept tree (see above). `new_tokens`
  // may be empty, or the previous guess's tokens exactly (a hit); anything else, no kept tree,
  // or an empty one gives no guess. Never commits a guess. Errors (INVALID_ARGUMENT, NOT_FOUND)
  // are about the requests and leave every sequence as it was; a failing forward leaves the
  // affected sequences without a guess (their kept tree's chain committed) rather than failing.
  // With DraftRequest::fan_out > 1 the next most likely outcomes (by the draft's probabilities,
  // scored as for a sampling target) are guessed too, each with its tree, all grown together
  // (a sequence's guesses share its forwards); the next call confirms at most one of them and
  // drops the others. A greedy target's DraftRequest::chain_rates rank every outcome, the
  // greedy path's included, by one estimate of its chance instead.
  struct PreDraftGuess {
    TokenTree tree;
    std::vector<int32_t> tokens;
    int32_t node = -1;
  };
  struct PreDraftResult {
    TokenTree tree;                     // empty: no guess
    std::vector<int32_t> guess_tokens;  // the accepted path's tokens, then the bonus token
    int32_t guess_node = -1;            // the accepted node in the kept tree, -1 none
    int consumed = 0;                   // leading new_tokens taken in (the hit's), 0 or all
    std::vector<PreDraftGuess> more;    // fan_out > 1: the further guesses, in order
  };
  absl::StatusOr<std::vector<PreDraftResult>> PreDraft(absl::Span<const DraftRequest> requests);

  // Feeds each request's new_tokens into the draft KV without growing a tree: the previous
  // step's outcome is applied as Draft() applies it (the accepted path of a kept tree is
  // committed, not fed again), the rest is fed as a chain and committed. For a sequence the
  // router is not drafting (the goodput policy chose none), so that drafting it again starts
  // from a current state instead of a catch-up that stalls that step. The next Draft()'s
  // new_tokens are the tokens appended after these. Errors as Draft()'s.
  absl::Status Ingest(absl::Span<const DraftRequest> requests);

  // Tokens fed through the draft model so far (chains and expanded nodes of successful
  // forwards): what kept KV saves shows here.
  int64_t fed_tokens() const { return fed_tokens_; }

 private:
  // A sequence's scratch region kept from its last Draft() (reuse_kv).
  struct KeptStep {
    int32_t chain = 0;                  // chain tokens at scratch 0 .. chain - 1
    TokenTree tree;                     // the returned tree
    std::vector<int32_t> tree_scratch;  // per tree node: its scratch index, -1 if not expanded
    int32_t scratch_used = 0;           // scratch nodes appended so far (chain and expanded)
    // For guesses: per tree node the best token below it that is not one of its children and
    // its log-probability given the node (the runner-up where every top-k token is a child),
    // kUnexpanded (never fed: estimate top1_logprob) or kNoBonus (every token its row ranked is
    // a child: not a candidate). root_bonus likewise below the
    // last chain token.
    std::vector<int32_t> bonus;
    std::vector<float> bonus_logprob;
    int32_t root_bonus = -2;
    float root_bonus_logprob = 0;
    float top1_logprob = 0;  // mean best-child log-probability over the expanded rows
  };
  static constexpr int32_t kUnexpanded = -1;
  static constexpr int32_t kNoBonus = -2;
  // A pre-draft's guess, until the next call says whether it was right.
  struct Pending {
    std::vector<int32_t> tokens;  // guessed tokens (accepted path, bonus)
    std::vector<int32_t> path;    // their scratch path, after the kept chain: what a hit commits
    KeptStep next;                // the tree grown below the guess; no scratch after the commit
  };
  struct SeqState {
    std::optional<KeptStep> kept;
    std::vector<Pending> pending;  // one per guess of the last pre-draft
    // A prefix of the next new_tokens that is already committed (a failed Draft() after the
    // outcome was applied).
    std::vector<int32_t> carried;
  };

  // Draft()'s and Ingest()'s start: CheckDraftBatch() of `requests`, then ApplyOutcome() of
  // each; returns how many of each request's new_tokens the draft KV now holds.
  absl::StatusOr<std::vector<int>> CheckAndApplyOutcomes(absl::Span<const DraftRequest> requests);
  // Applies the previous step's outcome to `request`'s sequence and returns how many of its
  // new_tokens the draft KV now holds.
  absl::StatusOr<int> ApplyOutcome(const DraftRequest& request);
  // Resolves a sequence's pending guess against `new_tokens`: a hit when they begin with the
  // guessed tokens and are longer (`exact`: equal). On a hit commits the guessed path, makes
  // the pre-drafted tree the kept one and returns the guess's length; else forgets it, 0.
  absl::StatusOr<int> ResolvePending(SeqId seq, absl::Span<const int32_t> new_tokens, bool exact);
  // The kept step of a selected tree (the .cc's Selected).
  template <typename SelectedTree>
  static KeptStep MakeKept(SelectedTree selected, int32_t chain, int32_t scratch_used);
  // Every row's best `k` (capped at the vocabulary) for one level.
  absl::Status LevelTopK(absl::Span<const ForwardItem> items, int k, TopKRows* out);

  Backend* model_;
  DraftModelDrafterOptions options_;
  int vocab_size_;
  absl::flat_hash_map<SeqId, SeqState> states_;
  std::vector<float> logits_;  // host top-k path only
  int64_t fed_tokens_ = 0;
};

}  // namespace specd

#endif  // SPECD_ENGINE_DRAFT_DRAFT_MODEL_DRAFTER_H_
