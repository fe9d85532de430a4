// Prometheus metrics for the specd services: a thin layer over prometheus-cpp core (registry,
// metric families, TextSerializer) plus our own HTTP listener for GET /metrics and GET /health.
// prometheus-cpp's civetweb Exposer is not used: it cannot start in a process that links
// cuBLASLt, whose ~94 KB of static thread-local storage leaves civetweb's small worker-thread
// stacks no room ("null context when constructing CivetServer"). Metric names are the contract in
// docs/metrics.md.
#ifndef SPECD_COMMON_SERVICE_METRICS_H_
#define SPECD_COMMON_SERVICE_METRICS_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace httplib {
class Server;
}

namespace specd {

using MetricLabels = std::map<std::string, std::string>;

// Bucket boundaries in seconds from 100 µs to 60 s, roughly three per decade (1, 2.5, 5), for
// step, round-trip and request latencies.
prometheus::Histogram::BucketBoundaries LatencyBuckets();

// Bucket boundaries for counts such as sequences per batched step or tree sizes: powers of two
// from 1 to 1024.
prometheus::Histogram::BucketBoundaries BatchSizeBuckets();

// Registers a family and returns its one child with `labels` (usually none). The registry owns
// both, so the references live as long as the registry.
prometheus::Counter& AddCounter(prometheus::Registry& registry, const std::string& name,
                                const std::string& help, const MetricLabels& labels = {});
prometheus::Gauge& AddGauge(prometheus::Registry& registry, const std::string& name,
                            const std::string& help, const MetricLabels& labels = {});
prometheus::Histogram& AddHistogram(prometheus::Registry& registry, const std::string& name,
                                    const std::string& help,
                                    const prometheus::Histogram::BucketBoundaries& buckets,
                                    const MetricLabels& labels = {});

// Families whose children are added per label value (outcome, reason, position).
prometheus::Family<prometheus::Counter>& AddCounterFamily(prometheus::Registry& registry,
                                                          const std::string& name,
                                                          const std::string& help);

// The registry's current state in the Prometheus text exposition format (version 0.0.4), with
// `service_labels` added to every sample of every specd_ family (the `model` label each service
// puts on all its metrics, as vLLM's model_name, so that several models scraped by one
// Prometheus stay apart).
std::string SerializeMetrics(prometheus::Registry& registry,
                             const MetricLabels& service_labels = {});

// The `model` label of a service serving the Hugging Face folder `model_dir`: its last path
// component ("/models/Llama-3.1-8B/" -> "Llama-3.1-8B").
std::string ModelLabel(const std::string& model_dir);

// The metrics the draft and verify services share (docs/metrics.md, "draft and verify").
// Updated only by the loop thread that owns the model; scraped from the HTTP thread, which is
// safe because prometheus-cpp metrics are internally synchronised.
struct ModelServiceMetrics {
  explicit ModelServiceMetrics(prometheus::Registry& registry);

  prometheus::Gauge& sequences;             // specd_sequences
  prometheus::Gauge& kv_cache_usage_ratio;  // specd_kv_cache_usage_ratio
  prometheus::Histogram& step_batch_size;   // specd_step_batch_size
  prometheus::Counter& step_tokens;         // specd_step_tokens_total
  prometheus::Counter& merged_steps;        // specd_step_merged_streams_total
  prometheus::Counter& freed_finished;      // specd_sequences_freed_total{reason="finished"}
  prometheus::Counter& freed_cancelled;     // specd_sequences_freed_total{reason="cancelled"}
  prometheus::Counter& graph_captures;      // specd_cuda_graph_captures_total
  prometheus::Counter& graph_replays;       // specd_cuda_graph_replays_total
  prometheus::Counter& eager_steps;         // specd_eager_steps_total

  // specd_step_seconds by kind: a step that feeds any sequence its prompt (its first step, or a
  // resync) costs far more than a decode step, so the two are kept apart; a mean over both
  // weighs prefill by how few steps the decode needed.
  prometheus::Histogram& prefill_step_seconds;  // specd_step_seconds{kind="prefill"}
  prometheus::Histogram& decode_step_seconds;   // specd_step_seconds{kind="decode"}

  // Brings the three execution counters up to the backend's cumulative totals.
  void SetExecutionTotals(int64_t captures, int64_t replays, int64_t eager);

 private:
  int64_t seen_captures_ = 0, seen_replays_ = 0, seen_eager_ = 0;
};

struct MetricsServerOptions {
  std::string host = "0.0.0.0";
  int port = 0;  // 0: pick a free port; MetricsServer::port() tells which
  // Labels added to every specd_ sample at each scrape (SerializeMetrics); null: none.
  std::function<MetricLabels()> service_labels;
};

// Serves GET /metrics (text format of `registry`) and GET /health (200 "ok" while `healthy`
// returns true or is empty, 503 otherwise) from its own threads until destroyed.
class MetricsServer {
 public:
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const MetricsServerOptions& options, std::shared_ptr<prometheus::Registry> registry,
      std::function<bool()> healthy = nullptr);

  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  int port() const { return port_; }

  // Stops listening and joins the listener thread; idempotent.
  void Stop();

 private:
  MetricsServer() = default;

  std::shared_ptr<prometheus::Registry> registry_;
  std::function<bool()> healthy_;
  std::function<MetricLabels()> service_labels_;
  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;
  std::atomic<bool> listen_returned_{false};
  int port_ = 0;
};

}  // namespace specd

#endif  // SPECD_COMMON_SERVICE_METRICS_H_
