// RouterLoop's catch-up of EAGLE taps held in the verify service (FetchHeldTaps): a sequence
// the policy does not draft asks the verify service to hold its taps (VerifyStep sets
// hold_taps), and when the policy drafts it again one verify round trip brings them, so that
// its drafter is fed every pair up to the last token before it drafts. One left undrafted
// long enough stops asking for taps at all, and is woken a step before it drafts again
// (PlanEagleTaps; RouterLoopOptions::eagle_tap_dormant_steps).
#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/service/hidden_states_proto.h"
#include "services/router/router_loop.h"
#include "services/router/router_sequence.h"
#include "services/router/upstream.h"

namespace specd {

bool EagleTapsServed(const v1::DraftInfo& draft, const v1::VerifyInfo& verify) {
  if (draft.eagle_head().empty() || !verify.supports_taps()) return false;
  for (int32_t layer : draft.eagle_tap_layers()) {
    if (layer < 0 || static_cast<uint32_t>(layer) > verify.max_tap_layer()) return false;
  }
  return true;
}

int RouterLoop::EagleBacklog(const Sequence& seq, int backlog) const {
  if (!seq.taps_dormant && seq.taps_from < 0) return backlog;
  // The head restarts after the gap in its taps: the tokens before it cost it nothing, only the
  // rows from the wake on (for a new sequence, that is its whole prompt).
  const int64_t fresh = seq.taps_dormant ? static_cast<int64_t>(seq.core->TargetPending().size())
                                         : seq.core->length() - seq.taps_from;
  return static_cast<int>(std::clamp<int64_t>(fresh, 0, backlog));
}

bool RouterLoop::PlanEagleTaps(Sequence& seq, const SpecShape& shape, ShapeReason reason,
                               bool* head_drafted) {
  // An n-gram step is, for the head, a step without drafts.
  const bool head_drafts = !shape.none() && !seq.ngram_now;
  if (seq.taps_dormant && head_drafts) {
    // A wake: this step asks for the taps it would draft from, and the sequence drafts the
    // chosen shape from the next step (PolicySequence::deferred).
    seq.taps_dormant = false;
    seq.undrafted_steps = 0;
    seq.taps_from = seq.core->length() - static_cast<int64_t>(seq.core->TargetPending().size());
    seq.core->Plan(SpecShape(), ShapeReason::kCatchUp, /*ngram=*/false);
    seq.core->Defer(shape);
    metrics_->eagle_tap_wakes.Increment();
    return true;
  }
  if (head_drafts) {
    *head_drafted = true;
    seq.taps_from = -1;
    seq.undrafted_steps = 0;
  } else if ((reason == ShapeReason::kPolicy || seq.ngram_now) &&
             options_.eagle_tap_dormant_steps > 0 &&
             ++seq.undrafted_steps > options_.eagle_tap_dormant_steps) {
    seq.taps_dormant = true;
  }
  return false;
}

void RouterLoop::FetchHeldTaps() {
  for (const auto& d : Drafts()) d->catch_up_seconds = 0;
  const uint64_t epoch = verify_->epoch();
  v1::VerifyStepRequest request;
  absl::flat_hash_map<uint64_t, Sequence*> by_id;
  for (auto& s : running_) {
    Sequence& seq = *s;
    // Only sequences the verify service holds on this stream (after a reconnect it replays
    // them, and their taps come again from position 0) and whose draft step goes out now.
    if (!seq.taps_held || seq.spec != v1::SPECULATION_EAGLE3 || seq.core->planned().none() ||
        seq.ngram_now || seq.draft == nullptr || !seq.draft->up || seq.draft_failed ||
        seq.draft->in_flight != nullptr || seq.verify_epoch != epoch) {
      continue;
    }
    request.add_send_held_taps(seq.id);
    by_id[seq.id] = &seq;
  }
  if (by_id.empty()) return;
  request.set_step_id(next_step_++);
  v1::VerifyStepResponse response;
  const absl::Time start = absl::Now();
  const absl::Status status = verify_->RoundTrip(request, &response, epoch);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  metrics_->CountWait("verify", seconds);
  metrics_->CountBusy("verify", seconds);
  if (!status.ok()) {
    // The verify step that follows meets the same stream and fails or replays the sequences;
    // until their taps arrive their drafter proposes nothing (lossless).
    SPECD_LOG(WARNING) << "fetching held EAGLE taps: " << status.message();
    return;
  }
  for (const v1::HeldTaps& held : response.held_taps()) {
    auto it = by_id.find(held.seq_id());
    if (it == by_id.end()) continue;
    Sequence& seq = *it->second;
    AppendHiddenStates(held.taps(), &seq.taps);
    metrics_->eagle_held_taps_fetched.Increment(held.taps().tokens());
    seq.taps_held = false;
    seq.draft->catch_up_seconds = seconds;
  }
}

}  // namespace specd
