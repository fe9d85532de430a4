// The router's metrics, exactly the "router" table of docs/metrics.md. Updated from the
// scheduler thread and from gRPC reactors; prometheus-cpp metrics are internally synchronised.
#ifndef SPECD_SERVICES_ROUTER_ROUTER_METRICS_H_
#define SPECD_SERVICES_ROUTER_ROUTER_METRICS_H_

#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "common/service/metrics.h"
#include "grpcpp/support/status.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace specd {

enum class TargetOnlyReason { kOff, kDraftUnavailable, kDraftBusy, kNoDraft };

class RouterMetrics {
 public:
  // `group_labels` label the gauges that describe one scheduler (requests running and waiting,
  // draft and verify availability, the policy's estimates): with several verify groups each
  // group's loop has its own series ({verify_group="N"}) beside the router's totals (no label).
  // Counters and histograms are shared by every RouterMetrics of one registry.
  explicit RouterMetrics(prometheus::Registry& registry, const MetricLabels& group_labels = {});

  // specd_requests_total{outcome} for a request that ended with `code`.
  void CountOutcome(grpc::StatusCode code);
  // specd_spec_decode_accepted_tokens_per_pos_total{position} for positions [0, accepted).
  void CountAcceptedPositions(int accepted);
  void CountTargetOnlyStep(TargetOnlyReason reason);
  // specd_spec_steps_total{tree_size, reason}: one sequence's verify step, by the tree size
  // bucket it carried (engine/spec/policy.h TreeSizeBucket) and why it had that shape. Both
  // must be static strings (as TreeSizeBucket and ShapeReasonName return): each pair's child
  // is looked up once and kept by the strings' addresses, since the router counts every
  // sequence of every step and a family lookup builds and hashes a label map.
  void CountStep(const char* tree_size, const char* reason);
  // Overlap: specd_predraft_outcomes_total{position, result}: a pre-drafted sequence's verify
  // outcome, by its accepted draft tokens (capped at "8+") and `result`: "hit", "miss", or
  // "late" (the pre-draft outlasted the router's wait; served as a miss).
  void CountPreDraft(int accepted, const char* result);
  // specd_predraft_guesses_total{guess} and, when `hit`, specd_predraft_guess_hits_total{guess}:
  // one outcome guess of a pre-drafted sequence whose verify outcome is known, by its rank in the
  // draft service's order (0 the most likely, up to the fan-out - 1). Per-rank hit rates say
  // whether a further guess earns the draft work it costs.
  void CountPreDraftGuess(int rank, bool hit);
  // specd_predraft_misses_total{served}: how a missed sequence's next step was served
  // ("drafted_late" or "plain_step").
  void CountPreDraftMiss(const char* served);
  // specd_overlap_decisions_total{decision}: one --overlap=auto judgement of a draft service's
  // step (OverlapWhyName: pays, no_fit, no_gain, probe, refresh, nothing).
  void CountOverlapDecision(const char* decision);
  // specd_router_wait_seconds_total{service}: time the scheduler blocked on that service.
  void CountWait(const char* service, double seconds);
  // specd_service_busy_seconds_total{service}: that service's round trips (overlapping ones
  // counted once each), for idle fractions against specd_router_step_seconds_total.
  void CountBusy(const char* service, double seconds);
  // specd_requests_finished_total{finish_reason}: one request that ended normally, with
  // `finish_reason` one of length, eos, stop_token, stop_string, context.
  void CountFinish(const char* finish_reason);

  prometheus::Gauge& requests_running;
  prometheus::Gauge& requests_waiting;
  prometheus::Histogram& time_to_first_token;
  prometheus::Histogram& inter_token_latency;
  prometheus::Histogram& e2e_request_latency;
  prometheus::Histogram& queue_time;
  prometheus::Counter& prompt_tokens;
  prometheus::Counter& generation_tokens;
  // Per request: prompt tokens at admission, generated tokens (stop tokens included) at the end.
  prometheus::Histogram& request_prompt_tokens;
  prometheus::Histogram& request_generation_tokens;
  prometheus::Counter& spec_decode_steps;
  prometheus::Counter& spec_decode_draft_tokens;
  prometheus::Counter& spec_decode_accepted_tokens;
  prometheus::Gauge& draft_available;
  prometheus::Gauge& draft_services_up;
  // Set by GroupPool: 1 while the verify service answers (per group; unlabelled: any group).
  prometheus::Gauge& verify_available;
  // Round trips by kind: kind="decode" (draft_latency, verify_latency) for steps that feed no
  // sequence from its start, kind="prefill" for those that do (a first step or a resync), whose
  // cost would otherwise inflate the mean decode step.
  prometheus::Histogram& draft_latency;
  prometheus::Histogram& draft_latency_prefill;
  prometheus::Histogram& verify_latency;
  prometheus::Histogram& verify_latency_prefill;
  // The goodput policy's current estimates.
  prometheus::Gauge& policy_goodput;
  prometheus::Gauge& policy_verify_one_token;
  prometheus::Gauge& policy_verify_chain4;
  prometheus::Gauge& policy_draft_level;
  prometheus::Counter& step_seconds;  // wall time of speculation steps (plan to verify reply)
  prometheus::Counter& draft_ingest_tokens;
  prometheus::Counter& eagle_held_taps_fetched;  // rows (tokens) FetchHeldTaps brought
  prometheus::Counter& eagle_tap_wakes;          // dormant EAGLE sequences asked for taps again
  // specd_auto_drafter_switches_total{to}: auto sequence steps drafted by the other drafter
  // than the sequence's previous drafted step (to = ngram: the router's n-gram proposal after
  // the model drafter; to = model: back).
  prometheus::Counter* switches_to_ngram = nullptr;
  prometheus::Counter* switches_to_model = nullptr;

 private:
  prometheus::Family<prometheus::Counter>& outcomes_;
  prometheus::Family<prometheus::Counter>& accepted_per_pos_;
  prometheus::Family<prometheus::Counter>& target_only_;
  prometheus::Family<prometheus::Counter>& steps_;
  prometheus::Family<prometheus::Counter>& predraft_;
  prometheus::Family<prometheus::Counter>& predraft_misses_;
  prometheus::Family<prometheus::Counter>& predraft_guesses_;
  prometheus::Family<prometheus::Counter>& predraft_guess_hits_;
  prometheus::Family<prometheus::Counter>& overlap_decisions_;
  prometheus::Family<prometheus::Counter>& wait_;
  prometheus::Family<prometheus::Counter>& busy_;
  prometheus::Family<prometheus::Counter>& finished_;
  prometheus::Family<prometheus::Counter>& switches_;
  absl::Mutex mu_;
  // Children of accepted_per_pos_ by position, created on first use.
  std::vector<prometheus::Counter*> per_pos_ ABSL_GUARDED_BY(mu_);
  // Children of steps_ by the addresses of their (static) labels, created on first use.
  absl::flat_hash_map<std::pair<const char*, const char*>, prometheus::Counter*> step_children_
      ABSL_GUARDED_BY(mu_);
  // Children of target_only_ by TargetOnlyReason.
  prometheus::Counter* target_only_children_[4] = {};
};

}  // namespace specd

#endif  // SPECD_SERVICES_ROUTER_ROUTER_METRICS_H_
