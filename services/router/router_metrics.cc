#include "services/router/router_metrics.h"

#include <algorithm>
#include <string>

#include "common/service/metrics.h"

namespace specd {

RouterMetrics::RouterMetrics(prometheus::Registry& r, const MetricLabels& group)
    : requests_running(AddGauge(r, "specd_requests_running", "Sequences being generated.", group)),
      requests_waiting(
          AddGauge(r, "specd_requests_waiting", "Requests admitted but not yet started.", group)),
      time_to_first_token(AddHistogram(r, "specd_time_to_first_token_seconds",
                                       "Request arrival to first streamed token.",
                                       LatencyBuckets())),
      inter_token_latency(AddHistogram(r, "specd_inter_token_latency_seconds",
                                       "Time between consecutive streamed tokens (per token).",
                                       LatencyBuckets())),
      e2e_request_latency(AddHistogram(r, "specd_e2e_request_latency_seconds",
                                       "Request arrival to last chunk.", LatencyBuckets())),
      queue_time(AddHistogram(r, "specd_queue_time_seconds", "Time waiting before the first step.",
                              LatencyBuckets())),
      prompt_tokens(
          AddCounter(r, "specd_prompt_tokens_total", "Prompt tokens of started requests.")),
      generation_tokens(
          AddCounter(r, "specd_generation_tokens_total", "Generated tokens streamed.")),
      spec_decode_steps(AddCounter(r, "specd_spec_decode_steps_total",
                                   "Verify steps that carried a non-empty draft tree.")),
      spec_decode_draft_tokens(AddCounter(r, "specd_spec_decode_draft_tokens_total",
                                          "Draft tree nodes sent to verify.")),
      spec_decode_accepted_tokens(AddCounter(r, "specd_spec_decode_accepted_tokens_total",
                                             "Draft tokens accepted (bonus tokens not counted).")),
      draft_available(AddGauge(r, "specd_draft_available",
                               "1 while the draft service answers, 0 while the router falls "
                               "back to target-only decoding.",
                               group)),
      verify_available(AddGauge(r, "specd_verify_available",
                                "1 while the verify service answers; without a group label, "
                                "while any verify group does.",
                                group)),
      draft_latency(AddHistogram(r, "specd_draft_latency_seconds",
                                 "Router-observed draft round trip per step.", LatencyBuckets())),
      verify_latency(AddHistogram(r, "specd_verify_latency_seconds",
                                  "Router-observed verify round trip per step.", LatencyBuckets())),
      policy_goodput(AddGauge(r, "specd_policy_predicted_goodput",
                              "Tokens per second the goodput policy predicts for its last step.",
                              group)),
      policy_verify_one_token(
          AddGauge(r, "specd_policy_verify_one_token_seconds",
                   "The policy's estimate of a verify step of one row scoring one token.", group)),
      policy_verify_chain4(AddGauge(
          r, "specd_policy_verify_chain4_seconds",
          "The policy's estimate of a verify step of one row with a 4-token chain.", group)),
      policy_draft_level(AddGauge(r, "specd_policy_draft_level_seconds",
                                  "The policy's estimate of one draft level of one sequence.",
                                  group)),
      step_seconds(AddCounter(r, "specd_router_step_seconds_total",
                              "Wall time of speculation steps, from planning to the verify "
                              "reply.")),
      outcomes_(AddCounterFamily(r, "specd_requests_total", "Finished requests by outcome.")),
      accepted_per_pos_(
          AddCounterFamily(r, "specd_spec_decode_accepted_tokens_per_pos_total",
                           "Speculative steps whose accepted path reached depth position+1.")),
      target_only_(AddCounterFamily(r, "specd_target_only_steps_total",
                                    "Verify steps without a draft tree, by reason.")),
      steps_(AddCounterFamily(r, "specd_spec_steps_total",
                              "Sequence verify steps by draft tree size and by why it had that "
                              "shape.")),
      predraft_(AddCounterFamily(r, "specd_predraft_outcomes_total",
                                 "Pre-drafted sequence steps by accepted draft tokens and whether "
                                 "the guessed outcome hit.")),
      predraft_misses_(AddCounterFamily(r, "specd_predraft_misses_total",
                                        "Missed pre-drafts by how the next step served them.")),
      wait_(AddCounterFamily(r, "specd_router_wait_seconds_total",
                             "Time the router's scheduler blocked waiting on each service.")),
      busy_(AddCounterFamily(r, "specd_service_busy_seconds_total",
                             "Router-observed round-trip time of each service's steps.")) {
  // Zero-valued children up front, so dashboards and alerts see every series from the start.
  for (const char* outcome : {"ok", "invalid_argument", "cancelled", "deadline_exceeded",
                              "resource_exhausted", "error"}) {
    outcomes_.Add({{"outcome", outcome}});
  }
  for (const char* reason : {"off", "draft_unavailable", "no_draft"}) {
    target_only_.Add({{"reason", reason}});
  }
  for (const char* result : {"hit", "miss"}) predraft_.Add({{"position", "0"}, {"result", result}});
  for (const char* served : {"drafted_late", "plain_step"}) {
    predraft_misses_.Add({{"served", served}});
  }
  for (const char* service : {"draft", "verify"}) {
    wait_.Add({{"service", service}});
    busy_.Add({{"service", service}});
  }
}

void RouterMetrics::CountPreDraft(int accepted, bool hit) {
  const std::string position = accepted >= 8 ? "8+" : std::to_string(std::max(accepted, 0));
  predraft_.Add({{"position", position}, {"result", hit ? "hit" : "miss"}}).Increment();
}

void RouterMetrics::CountPreDraftMiss(const char* served) {
  predraft_misses_.Add({{"served", served}}).Increment();
}

void RouterMetrics::CountWait(const char* service, double seconds) {
  wait_.Add({{"service", service}}).Increment(seconds);
}

void RouterMetrics::CountBusy(const char* service, double seconds) {
  busy_.Add({{"service", service}}).Increment(seconds);
}

void RouterMetrics::CountOutcome(grpc::StatusCode code) {
  const char* outcome = "error";
  switch (code) {
    case grpc::StatusCode::OK:
      outcome = "ok";
      break;
    case grpc::StatusCode::INVALID_ARGUMENT:
      outcome = "invalid_argument";
      break;
    case grpc::StatusCode::CANCELLED:
      outcome = "cancelled";
      break;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      outcome = "deadline_exceeded";
      break;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      outcome = "resource_exhausted";
      break;
    default:
      break;
  }
  outcomes_.Add({{"outcome", outcome}}).Increment();
}

void RouterMetrics::CountStep(const char* tree_size, const char* reason) {
  steps_.Add({{"tree_size", tree_size}, {"reason", reason}}).Increment();
}

void RouterMetrics::CountAcceptedPositions(int accepted) {
  if (accepted <= 0) return;
  absl::MutexLock lock(&mu_);
  while (static_cast<int>(per_pos_.size()) < accepted) {
    per_pos_.push_back(&accepted_per_pos_.Add({{"position", std::to_string(per_pos_.size())}}));
  }
  for (int i = 0; i < accepted; ++i) per_pos_[i]->Increment();
}

void RouterMetrics::CountTargetOnlyStep(TargetOnlyReason reason) {
  const char* label = reason == TargetOnlyReason::kOff                ? "off"
                      : reason == TargetOnlyReason::kDraftUnavailable ? "draft_unavailable"
                                                                      : "no_draft";
  target_only_.Add({{"reason", label}}).Increment();
}

}  // namespace specd
