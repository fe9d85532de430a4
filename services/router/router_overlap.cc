// RouterLoop's overlap (docs/architecture.md, the overlapped step): the pre-draft sent to each
// draft service beside the verify step, and its answer. The rest of the loop is router_loop.cc.
#include <algorithm>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "common/logging.h"
#include "common/service/tree_proto.h"
#include "common/token_tree.h"
#include "services/router/router_loop.h"
#include "services/router/router_sequence.h"

namespace specd {

void RouterLoop::PreDraftRequest(uint64_t step_id, const Draft& draft, PreDraftCall* call) {
  v1::DraftStepRequest& request = call->request;
  double* seconds = &call->draft_seconds;
  for (auto& s : running_) {
    if (s->draft.get() != &draft) continue;
    s->pre_sent = false;
    s->ingest_sent = false;
  }
  if (!draft.upstream->up()) return;
  const uint64_t epoch = draft.upstream->epoch();
  if (options_.overlap != OverlapMode::kOff) AddPreDrafts(epoch, draft, call);
  const double token_s = policy_.costs().CatchUpTokenSeconds();
  // The catch-ups the policy moved here (ShapeReason::kCatchUp): each would otherwise stall a
  // draft call, so every one goes.
  for (auto& s : running_) {
    Sequence& seq = *s;
    if (seq.draft.get() != &draft || !seq.ingest_now || !seq.tree.empty() || seq.pre_sent ||
        seq.spec != v1::SPECULATION_DRAFT_MODEL || seq.draft_failed || seq.core->finished()) {
      continue;
    }
    if (seq.ResyncDrafter(epoch)) call->prefill = true;
    AddIngest(epoch, seq, &request);
    *seconds += token_s * static_cast<double>(seq.core->DrafterPending().size());
    call->ingests = true;
  }
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
    for (auto& s : running_) {
      Sequence& seq = *s;
      // An n-gram step's tree is not the drafter's: it is behind as on a plain step.
      if (seq.draft.get() != &draft || (!seq.tree.empty() && !seq.ngram_now) || seq.pre_sent ||
          seq.ingest_sent || seq.spec != v1::SPECULATION_DRAFT_MODEL || seq.draft_failed ||
          seq.draft_down || seq.no_drafter || seq.core->finished()) {
        continue;
      }
      const bool from_start = seq.ResyncDrafter(epoch);
      const absl::Span<const int32_t> fresh = seq.core->DrafterPending();
      if (static_cast<int>(fresh.size()) < options_.draft_ingest_tokens) continue;
      call->prefill = call->prefill || from_start;
      const double cost = token_s * static_cast<double>(fresh.size());
      if (cost > budget) break;
      budget -= cost;
      *seconds += cost;
      call->ingests = true;
      AddIngest(epoch, seq, &request);
    }
    if (request.steps_size() > 0 && *seconds == 0) {
      *seconds = policy_.costs().DraftSeconds(1, 1, 1);  // ingests alone: the call's own cost
    }
  }
  if (request.steps_size() > 0) request.set_step_id(step_id | (uint64_t{1} << 63));
}

void RouterLoop::AddIngest(uint64_t epoch, Sequence& seq, v1::DraftStepRequest* request) {
  const absl::Span<const int32_t> fresh = seq.core->DrafterPending();
  v1::DraftSequenceStep* step = request->add_steps();
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
  seq.pre_fed_to = seq.core->length();
}

void RouterLoop::AddPreDrafts(uint64_t epoch, const Draft& draft, PreDraftCall* call) {
  int verify_tokens = 0, tokens = 0, longest = 0;
  std::vector<Sequence*> chosen;
  std::vector<SpecShape> shapes;
  std::vector<const AcceptanceEstimate*> acceptance;
  for (auto& s : running_) {
    Sequence& seq = *s;
    const int row = static_cast<int>(seq.tree.size() + seq.core->TargetPending().size());
    verify_tokens += static_cast<int>(seq.tree.size()) + 1;
    tokens += row;  // as VerifyStep prices the step
    longest = std::max(longest, row);
    if (seq.draft.get() != &draft) continue;
    seq.pre_sent = false;
    if (seq.tree.empty() || seq.mode != v1::SPECULATION_DRAFT_MODEL || !seq.draft_replied ||
        seq.draft_failed || seq.draft_epoch != epoch) {
      continue;
    }
    chosen.push_back(&seq);
    SpecShape planned = seq.core->planned();
    if (seq.on_hit) {
      const SpecShape again =
          GoodputPolicy::CutToDepth(seq.pre_uncut, seq.core->MaxUsefulDraftDepth());
      if (again.depth > planned.depth) planned = again;
    }
    shapes.push_back(planned);
    acceptance.push_back(&seq.core->acceptance());
  }
  if (chosen.empty()) return;
  // How many outcome guesses each sequence gets and how deep the trees below them go: the
  // deepest, then the most, the policy predicts fit in the verify step. With auto, only where
  // OverlapPlanner finds that pays (its probes and refreshes included); with on, at least one;
  // and with on and no policy (fixed shapes), the most allowed at the planned depth for a lone
  // sequence.
  GoodputPolicy::PreDraftPlan plan;
  const int rows = static_cast<int>(running_.size());
  if (options_.overlap == OverlapMode::kOn && !options_.adaptive) {
    // Several sequences save their draft call only when every one hits: one guess each, as the
    // policy's plan gives them (GoodputPolicy::PreDraftFanOut).
    plan.fan_out = chosen.size() > 1 ? 1 : options_.overlap_max_fan_out;
  } else if (options_.overlap == OverlapMode::kAuto) {
    const OverlapPlanner::Plan judged = overlap_planner_.Decide(
        shapes, acceptance, rows,
        VerifyStepTokens(policy_.options().padded_rows, rows, tokens, longest),
        options_.overlap_max_fan_out);
    metrics_->CountOverlapDecision(OverlapWhyName(judged.why));
    if (judged.pre.fan_out == 0) return;  // the step stays sequential
    plan = judged.pre;
    for (size_t i = 0; i < chosen.size(); ++i) chosen[i]->pre_guess_rate = judged.guess_rates[i];
  } else {
    plan = policy_.PlanPreDraft(shapes, rows, verify_tokens, options_.overlap_max_fan_out);
  }
  plan.fan_out = std::max(plan.fan_out, 1);
  const std::vector<SpecShape> uncut = shapes;
  if (plan.depth > 0) {
    for (SpecShape& shape : shapes) shape = GoodputPolicy::CutToDepth(shape, plan.depth);
  }
  v1::DraftStepRequest request;
  for (size_t i = 0; i < chosen.size(); ++i) {
    Sequence& seq = *chosen[i];
    const SpecShape& shape = shapes[i];
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
    if (plan.fan_out > 1) step->set_fan_out(plan.fan_out);
    const AcceptanceEstimate& acceptance = seq.core->acceptance();
    if (seq.request.sampling.temperature <= 0 && acceptance.samples() > 0) {
      // The guesses are then ranked by what this sequence's steps measured, not by the draft's
      // confidence alone: a draft sure of a token the target often rejects would otherwise
      // never guess a rejection early in the chain.
      const int levels = std::min(shape.depth + 1, AcceptanceEstimate::kMaxDepth);
      for (int d = 1; d <= levels; ++d) {
        step->add_chain_rates(
            static_cast<float>(std::clamp(acceptance.ChainRate(d, policy_.options()), 0.0, 1.0)));
      }
    }
    seq.pre_sent = true;
    seq.pre_fed_to = seq.core->length();
    seq.pre_shape = shape;
    seq.pre_uncut = uncut[i];
    seq.pre_reason = seq.core->planned_reason();
  }
  const GoodputPolicy::PreDraftWork one = GoodputPolicy::PreDraftWorkOf(shapes, 1);
  call->request = std::move(request);
  call->draft_seconds = policy_.costs().DraftSeconds(one.drafting, one.levels, one.nodes);
  call->rows = one.drafting * plan.fan_out;
  call->levels = one.levels;
  call->nodes = one.nodes * plan.fan_out;
}

std::vector<std::shared_ptr<RouterLoop::Draft>> RouterLoop::StartPreDrafts(uint64_t step_id) {
  std::vector<std::shared_ptr<Draft>> sent;
  if (options_.overlap == OverlapMode::kOff && options_.draft_ingest_tokens <= 0 &&
      std::none_of(running_.begin(), running_.end(), [](const auto& s) { return s->ingest_now; })) {
    return sent;
  }
  absl::flat_hash_set<const Draft*> seen;
  for (auto& s : running_) {
    const std::shared_ptr<Draft>& d = s->draft;
    // A draft service still answering a late pre-draft gets nothing more until it has.
    if (d == nullptr || !seen.insert(d.get()).second || d->in_flight != nullptr) continue;
    auto call = std::make_unique<PreDraftCall>();
    PreDraftRequest(step_id, *d, call.get());
    if (call->request.steps_size() == 0) continue;
    call->draft = d.get();
    call->epoch = d->upstream->epoch();
    call->start = absl::Now();
    PreDraftCall* c = call.get();
    c->thread = std::thread([this, c] {
      v1::DraftStepResponse response;
      const absl::Status status = c->draft->upstream->RoundTrip(c->request, &response, c->epoch);
      {
        absl::MutexLock lock(&c->mu);
        c->status = status;
        c->response = std::move(response);
        c->seconds = absl::ToDoubleSeconds(absl::Now() - c->start);
        c->done = true;
      }
      Wake();  // a late answer frees the stream for the scheduler's next step
    });
    d->in_flight = std::move(call);
    sent.push_back(d);
  }
  return sent;
}

void RouterLoop::FinishPreDrafts(const std::vector<std::shared_ptr<Draft>>& drafts,
                                 absl::Duration verify_time, absl::Time verify_done) {
  if (drafts.empty()) return;
  const bool pre_drafted = std::any_of(drafts.begin(), drafts.end(),
                                       [](const auto& d) { return d->in_flight->rows > 0; });
  absl::Time waited_until = verify_done;
  for (const std::shared_ptr<Draft>& d : drafts) {
    PreDraftCall& call = *d->in_flight;
    bool done;
    {
      absl::MutexLock lock(&call.mu);
      // A call of ingests alone has nothing this step needs: it is never waited for (late, it
      // keeps its stream busy, and the sequences drafting there get plain steps until it ends).
      const absl::Time deadline =
          call.rows == 0 ? verify_done
                         : verify_done + absl::Seconds(call.draft_seconds) + verify_time;
      done = call.mu.AwaitWithDeadline(absl::Condition(&call.done), deadline);
    }
    waited_until = std::max(waited_until, absl::Now());
    if (done) {
      call.thread.join();
      metrics_->CountBusy("draft", call.seconds);
      TakePreDrafts(call);
      d->in_flight.reset();
      continue;
    }
    // Serving these sequences as misses now beats waiting any longer; the stream stays busy
    // until the answer comes, which is then taken only for what the service took in.
    call.late = true;
    for (auto& s : running_) {
      if (s->draft != d || !s->pre_sent) continue;
      s->pre_sent = false;
      s->pre_late = true;
    }
    late_drafts_.push_back(d);
  }
  const double waited = absl::ToDoubleSeconds(waited_until - verify_done);
  metrics_->CountWait("draft", waited);
  if (options_.overlap == OverlapMode::kAuto && pre_drafted) overlap_planner_.ObserveWait(waited);
}

void RouterLoop::PollLatePreDrafts() {
  for (auto it = late_drafts_.begin(); it != late_drafts_.end();) {
    PreDraftCall& call = *(*it)->in_flight;
    {
      absl::MutexLock lock(&call.mu);
      if (!call.done) {
        ++it;
        continue;
      }
    }
    call.thread.join();
    metrics_->CountBusy("draft", call.seconds);
    TakePreDrafts(call);
    (*it)->in_flight.reset();
    it = late_drafts_.erase(it);
  }
}

void RouterLoop::JoinLatePreDrafts() {
  for (const std::shared_ptr<Draft>& d : late_drafts_) {
    d->in_flight->thread.join();
    d->in_flight.reset();
  }
  late_drafts_.clear();
}

void RouterLoop::ResolvePreDraft(Sequence& seq, absl::Span<const int32_t> outcome_tokens,
                                 int accepted) {
  bool hit = absl::MakeConstSpan(seq.pre_guess) == outcome_tokens;
  if (seq.pre_late) {
    seq.pre_late = false;
    metrics_->CountPreDraft(accepted, "late");
    overlap_planner_.ObserveOutcome(false, seq.pre_guess_rate);
    seq.missed = true;
    return;
  }
  if (!seq.pre_sent) return;
  seq.pre_sent = false;
  hit = hit && !seq.pre_guess.empty();
  if (!seq.pre_guess.empty()) metrics_->CountPreDraftGuess(0, hit);
  // A further guess (fan-out above one) that came true stands in for the first.
  for (Sequence::Guess& guess : seq.pre_more) {
    const bool this_one = !hit && absl::MakeConstSpan(guess.tokens) == outcome_tokens;
    metrics_->CountPreDraftGuess(guess.rank, this_one);
    if (!this_one) continue;
    hit = true;
    seq.pre_tree = std::move(guess.tree);
  }
  seq.pre_more.clear();
  metrics_->CountPreDraft(accepted, hit ? "hit" : "miss");
  overlap_planner_.ObserveOutcome(hit, seq.pre_guess_rate);
  // A tree deeper than the remaining budget would run past the context: drafted anew.
  if (hit && !seq.core->finished() && !seq.pre_tree.empty() &&
      TreeMaxDepth(seq.pre_tree) <= seq.core->MaxUsefulDraftDepth()) {
    seq.hit_ready = true;
    seq.hit_tree = std::move(seq.pre_tree);
    seq.hit_shape = seq.pre_shape;
    seq.hit_reason = seq.pre_reason;
  } else if (!hit) {
    seq.missed = true;
  }
  seq.pre_tree = TokenTree();
  seq.pre_guess.clear();
}

void RouterLoop::TakePreDrafts(PreDraftCall& call) {
  // What a pre-draft really costs (a late one included) decides whether auto sends the next.
  if (call.status.ok() && call.rows > 0 && !call.ingests) {
    policy_.costs().ObservePreDraft(call.rows, call.levels, call.nodes, call.seconds);
  }
  if (call.status.ok() && call.rows == 0) {
    // A drafter's prefill moved beside verify is still the drafter's prefill round trip; other
    // ingests are no decode step's, whose latency draft_latency is.
    if (call.prefill) metrics_->draft_latency_prefill.Observe(call.seconds);
    // Ingests alone: a catch-up's price, never a draft level's (CostModel::ObserveIngest).
    int fed = 0;
    for (const v1::DraftSequenceStep& step : call.request.steps()) fed += step.new_tokens_size();
    policy_.costs().ObserveIngest(call.request.steps_size(), fed, call.seconds);
  }
  absl::flat_hash_map<uint64_t, Sequence*> by_id;
  for (auto& s : running_) {
    if (s->draft.get() == call.draft) by_id[s->id] = s.get();
  }
  absl::flat_hash_map<uint64_t, const v1::DraftSequenceStep*> sent;  // by the sequences named
  for (const v1::DraftSequenceStep& step : call.request.steps()) sent[step.seq_id()] = &step;
  auto sequence = [&](uint64_t id) -> Sequence* {
    auto it = by_id.find(id);
    return it == by_id.end() || !sent.contains(id) ? nullptr : it->second;
  };
  if (!call.status.ok()) {
    // The next step's draft sees the service down (or reconnected) and acts on it; an ingest
    // the service may or may not have taken in is sent again whole, on a new stream.
    SPECD_LOG(WARNING) << "pre-draft: " << call.status.message();
    for (const auto& [id, step] : sent) {
      Sequence* seq = sequence(id);
      if (seq == nullptr) continue;
      if (step->ingest_only()) seq->draft_epoch = 0;
      seq->ingest_sent = false;
      seq->pre_sent = false;
    }
    return;
  }
  for (const v1::DraftSequenceResult& result : call.response.results()) {
    Sequence* found = sequence(result.seq_id());
    if (found == nullptr) continue;
    Sequence& seq = *found;
    const bool failed = result.has_error() && result.error().code() != 0;
    const v1::DraftSequenceStep& step = *sent[seq.id];
    if (step.ingest_only()) {
      seq.ingest_sent = false;
      if (failed) {
        // As for a rejected draft: the service's state of it is unknown, so it is not drafted
        // again (target-only from here, the output unchanged).
        SPECD_LOG(WARNING) << "draft service rejected the ingest of sequence " << seq.id << ": "
                           << result.error().message() << "; continuing it target-only";
        seq.draft_failed = true;
        continue;
      }
      metrics_->draft_ingest_tokens.Increment(static_cast<double>(step.new_tokens_size()));
      seq.core->MarkDrafterFedThrough(seq.pre_fed_to);
      continue;
    }
    if (failed) {
      // Not a reason to stop drafting the sequence: its next step drafts after the outcome.
      seq.pre_sent = false;
      continue;
    }
    // The service holds the new tokens it was sent (it takes those of a confirmed guess in, and
    // keeps any others for the next draft), so they are not sent again.
    seq.core->MarkDrafterFedThrough(seq.pre_fed_to);
    // A late answer's sequence was served as a miss; the service resolves its guess against
    // the next draft's new tokens like any other.
    if (call.late) continue;
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
    seq.pre_more.clear();
    int rank = 0;
    for (const v1::PreDraftGuess& guess : result.more_guesses()) {
      ++rank;
      if (rank >= static_cast<int>(step.fan_out())) break;
      TokenTree more = TreeFromProto(guess.tree());
      if (!ValidateTree(more, options_.limits.vocab_size).ok() || more.empty() ||
          TreeMaxDepth(more) > seq.pre_shape.depth) {
        SPECD_LOG(WARNING) << "draft service sent a bad pre-drafted tree for sequence " << seq.id;
        continue;
      }
      seq.pre_more.push_back(
          {{guess.tokens().begin(), guess.tokens().end()}, std::move(more), rank});
    }
  }
}

}  // namespace specd
