// RouterLoop's overlap (docs/architecture.md, the overlapped step): the pre-draft sent to each
// draft service beside the verify step, and its answer. The rest of the loop is router_loop.cc.
#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "common/logging.h"
#include "common/service/tree_proto.h"
#include "common/token_tree.h"
#include "services/router/router_loop.h"
#include "services/router/router_sequence.h"

namespace specd {

v1::DraftStepRequest RouterLoop::PreDraftRequest(uint64_t step_id, const Draft& draft) {
  v1::DraftStepRequest request;
  for (auto& s : running_) {
    if (s->draft.get() != &draft) continue;
    s->pre_sent = false;
    s->ingest_sent = false;
  }
  if (!draft.upstream->up()) return request;
  const uint64_t epoch = draft.upstream->epoch();
  if (options_.overlap != OverlapMode::kOff) AddPreDrafts(epoch, draft, &request);
  if (options_.draft_ingest_tokens > 0) {
    // Verify runs this step's rows meanwhile; an ingest that outlasted it would delay the next
    // step's draft, so they are taken in order while their catch-up fits in the verify step.
    int verify_tokens = 0;
    for (auto& s : running_) verify_tokens += static_cast<int>(s->tree.size()) + 1;
    // The call's own cost (a one-token draft call stands for its round trip) counts too: where
    // verify is quicker than a draft round trip (a tiny target) nothing is ingested.
    double budget =
        policy_.costs().VerifySeconds(static_cast<int>(running_.size()), verify_tokens) -
        policy_.costs().DraftSeconds(1, 1, 1);
    const double token_s = policy_.costs().CatchUpTokenSeconds();
    for (auto& s : running_) {
      Sequence& seq = *s;
      if (seq.draft.get() != &draft || !seq.tree.empty() || seq.pre_sent ||
          seq.spec != v1::SPECULATION_DRAFT_MODEL || seq.draft_failed || seq.draft_down ||
          seq.no_drafter || seq.core->finished()) {
        continue;
      }
      if (seq.draft_epoch != epoch) seq.core->ResetDrafter();
      const absl::Span<const int32_t> fresh = seq.core->DrafterPending();
      if (static_cast<int>(fresh.size()) < options_.draft_ingest_tokens) continue;
      const double cost = token_s * static_cast<double>(fresh.size());
      if (cost > budget) break;
      budget -= cost;
      v1::DraftSequenceStep* step = request.add_steps();
      step->set_seq_id(seq.id);
      step->mutable_new_tokens()->Assign(fresh.begin(), fresh.end());
      step->set_method(v1::DRAFT_METHOD_MODEL);
      step->set_ingest_only(true);
      step->set_deadline_unix_ms(ToUnixMillisOrZero(seq.request.deadline));
      if (seq.draft_report >= -1 && seq.draft_epoch == epoch) {
        step->set_accepted_node(seq.draft_report);
      }
      seq.draft_report = -2;
      seq.draft_epoch = epoch;
      seq.ingest_sent = true;
    }
  }
  if (request.steps_size() > 0) request.set_step_id(step_id | (uint64_t{1} << 63));
  return request;
}

void RouterLoop::AddPreDrafts(uint64_t epoch, const Draft& draft, v1::DraftStepRequest* out) {
  v1::DraftStepRequest request;
  int rows = 0, levels = 0, nodes = 0, verify_tokens = 0;
  for (auto& s : running_) {
    Sequence& seq = *s;
    verify_tokens += static_cast<int>(seq.tree.size()) + 1;
    if (seq.draft.get() != &draft) continue;
    seq.pre_sent = false;
    if (seq.tree.empty() || seq.mode != v1::SPECULATION_DRAFT_MODEL || !seq.draft_replied ||
        seq.draft_failed || seq.draft_epoch != epoch) {
      continue;
    }
    const SpecShape shape = seq.core->planned();
    v1::DraftSequenceStep* step = request.add_steps();
    step->set_seq_id(seq.id);
    // Empty after this step's draft, or the tokens of the last guess when it hit.
    const absl::Span<const int32_t> fresh = seq.core->DrafterPending();
    step->mutable_new_tokens()->Assign(fresh.begin(), fresh.end());
    step->set_method(v1::DRAFT_METHOD_MODEL);
    step->set_depth(shape.depth);
    step->set_top_k(shape.top_k);
    step->set_max_nodes(shape.max_nodes);
    step->set_deadline_unix_ms(ToUnixMillisOrZero(seq.request.deadline));
    step->set_pre_draft(true);
    step->set_target_samples(seq.request.sampling.temperature > 0);
    seq.pre_sent = true;
    seq.pre_shape = shape;
    seq.pre_reason = seq.core->planned_reason();
    ++rows;
    levels = std::max(levels, shape.depth + 1);
    nodes += shape.max_nodes + shape.depth + 1;
  }
  if (rows == 0) return;
  if (options_.overlap == OverlapMode::kAuto &&
      policy_.costs().DraftSeconds(rows, levels, nodes) >
          policy_.costs().VerifySeconds(static_cast<int>(running_.size()), verify_tokens)) {
    // The pre-draft would outlast verify: the step stays sequential.
    for (auto& s : running_) {
      if (s->draft.get() == &draft) s->pre_sent = false;
    }
    return;
  }
  *out = std::move(request);
}

void RouterLoop::TakePreDrafts(const Draft& draft, const absl::Status& status,
                               const v1::DraftStepResponse& response) {
  absl::flat_hash_map<uint64_t, Sequence*> by_id;
  for (auto& s : running_) {
    if ((s->pre_sent || s->ingest_sent) && s->draft.get() == &draft) by_id[s->id] = s.get();
  }
  if (!status.ok()) {
    // The next step's draft sees the service down (or reconnected) and acts on it; an ingest
    // the service may or may not have taken in is sent again whole, on a new stream.
    SPECD_LOG(WARNING) << "pre-draft: " << status.message();
    for (auto& [id, seq] : by_id) {
      seq->pre_sent = false;
      if (seq->ingest_sent) seq->draft_epoch = 0;
      seq->ingest_sent = false;
    }
    return;
  }
  for (const v1::DraftSequenceResult& result : response.results()) {
    auto it = by_id.find(result.seq_id());
    if (it == by_id.end()) continue;
    Sequence& seq = *it->second;
    if (seq.ingest_sent) {
      seq.ingest_sent = false;
      if (result.has_error() && result.error().code() != 0) {
        // As for a rejected draft: the service's state of it is unknown, so it is not drafted
        // again (target-only from here, the output unchanged).
        SPECD_LOG(WARNING) << "draft service rejected the ingest of sequence " << seq.id << ": "
                           << result.error().message() << "; continuing it target-only";
        seq.draft_failed = true;
        continue;
      }
      metrics_->draft_ingest_tokens.Increment(
          static_cast<double>(seq.core->DrafterPending().size()));
      seq.core->MarkDrafterFed();
      continue;
    }
    if (result.has_error() && result.error().code() != 0) {
      // Not a reason to stop drafting the sequence: its next step drafts after the outcome.
      seq.pre_sent = false;
      continue;
    }
    // The service holds the new tokens it was sent (it takes those of a confirmed guess in, and
    // keeps any others for the next draft), so they are not sent again.
    seq.core->MarkDrafterFed();
    TokenTree tree = TreeFromProto(result.tree());
    if (absl::Status valid = ValidateTree(tree, options_.limits.vocab_size);
        !valid.ok() || TreeMaxDepth(tree) > seq.pre_shape.depth) {
      SPECD_LOG(WARNING) << "draft service sent a bad pre-drafted tree for sequence " << seq.id;
      tree = TokenTree();
    }
    seq.pre_tree = std::move(tree);
    if (!seq.pre_tree.empty()) {
      seq.pre_guess.assign(result.guess_tokens().begin(), result.guess_tokens().end());
    }
    seq.pre_node = result.guess_node();
  }
}

}  // namespace specd
