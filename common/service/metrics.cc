#include "common/service/metrics.h"

#include <sys/socket.h>

#include <chrono>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/service/guarded_http_server.h"
#include "httplib.h"
#include "prometheus/text_serializer.h"

namespace specd {

prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double decade = 1e-4; decade < 10.0; decade *= 10.0) {
    for (double m : {1.0, 2.5, 5.0}) b.push_back(m * decade);
  }
  for (double s : {10.0, 20.0, 30.0, 60.0}) b.push_back(s);
  return b;
}

prometheus::Histogram::BucketBoundaries BatchSizeBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double v = 1; v <= 1024; v *= 2) b.push_back(v);
  return b;
}

prometheus::Counter& AddCounter(prometheus::Registry& registry, const std::string& name,
                                const std::string& help, const MetricLabels& labels) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(registry).Add(labels);
}

prometheus::Gauge& AddGauge(prometheus::Registry& registry, const std::string& name,
                            const std::string& help, const MetricLabels& labels) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(registry).Add(labels);
}

prometheus::Histogram& AddHistogram(prometheus::Registry& registry, const std::string& name,
                                    const std::string& help,
                                    const prometheus::Histogram::BucketBoundaries& buckets,
                                    const MetricLabels& labels) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(registry).Add(labels, buckets);
}

prometheus::Family<prometheus::Counter>& AddCounterFamily(prometheus::Registry& registry,
                                                          const std::string& name,
                                                          const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(registry);
}

std::string SerializeMetrics(prometheus::Registry& registry, const MetricLabels& service_labels) {
  std::vector<prometheus::MetricFamily> families = registry.Collect();
  if (!service_labels.empty()) {
    for (prometheus::MetricFamily& family : families) {
      if (family.name.rfind("specd_", 0) != 0) continue;
      for (prometheus::ClientMetric& metric : family.metric) {
        for (const auto& [name, value] : service_labels) {
          metric.label.push_back({name, value});
        }
      }
    }
  }
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, families);
  return out.str();
}

std::string ModelLabel(const std::string& model_dir) {
  std::string dir = model_dir;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const size_t slash = dir.rfind('/');
  return slash == std::string::npos ? dir : dir.substr(slash + 1);
}

namespace {

prometheus::Family<prometheus::Counter>& FreedFamily(prometheus::Registry& registry) {
  return AddCounterFamily(registry, "specd_sequences_freed_total",
                          "Sequences released, by reason (finished: release_seq_ids; cancelled: "
                          "cancel_seq_ids, a passed deadline or the end of the router's stream).");
}

prometheus::Family<prometheus::Histogram>& StepSecondsFamily(prometheus::Registry& registry) {
  return prometheus::BuildHistogram()
      .Name("specd_step_seconds")
      .Help(
          "One batched step inside the service (draft: tree growth; verify: forward + accept), "
          "by kind (prefill: the step fed some sequence its prompt; decode: none).")
      .Register(registry);
}

}  // namespace

ModelServiceMetrics::ModelServiceMetrics(prometheus::Registry& registry)
    : sequences(
          AddGauge(registry, "specd_sequences", "Live sequences holding KV in this service.")),
      kv_cache_usage_ratio(
          AddGauge(registry, "specd_kv_cache_usage_ratio", "Cached tokens / KV capacity.")),
      step_batch_size(AddHistogram(registry, "specd_step_batch_size",
                                   "Sequences in one batched step.", BatchSizeBuckets())),
      step_tokens(AddCounter(registry, "specd_step_tokens_total",
                             "Tokens fed through the model (prefill + tree nodes).")),
      merged_steps(AddCounter(registry, "specd_step_merged_streams_total",
                              "Batched steps that served more than one Step stream (the steps "
                              "of several routers run as one).")),
      freed_finished(FreedFamily(registry).Add({{"reason", "finished"}})),
      freed_cancelled(FreedFamily(registry).Add({{"reason", "cancelled"}})),
      graph_captures(AddCounter(registry, "specd_cuda_graph_captures_total",
                                "CUDA graphs captured (a capture costs several steps).")),
      graph_replays(AddCounter(registry, "specd_cuda_graph_replays_total",
                               "Model forwards replayed from a captured CUDA graph.")),
      eager_steps(AddCounter(registry, "specd_eager_steps_total",
                             "Model forwards launched kernel by kernel on a GPU (a shape too "
                             "big for a graph, or a graph bucket's first use).")),
      prefill_step_seconds(
          StepSecondsFamily(registry).Add({{"kind", "prefill"}}, LatencyBuckets())),
      decode_step_seconds(StepSecondsFamily(registry).Add({{"kind", "decode"}}, LatencyBuckets())) {
}

void ModelServiceMetrics::SetExecutionTotals(int64_t captures, int64_t replays, int64_t eager) {
  auto bump = [](prometheus::Counter& c, int64_t total, int64_t* seen) {
    if (total > *seen) c.Increment(static_cast<double>(total - *seen));
    *seen = total;
  };
  bump(graph_captures, captures, &seen_captures_);
  bump(graph_replays, replays, &seen_replays_);
  bump(eager_steps, eager, &seen_eager_);
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const MetricsServerOptions& options, std::shared_ptr<prometheus::Registry> registry,
    std::function<bool()> healthy) {
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->registry_ = std::move(registry);
  server->healthy_ = std::move(healthy);
  server->service_labels_ = options.service_labels;
  // Scrapes and health checks are few; the cap and deadline keep idle or slow connections
  // from starving them.
  GuardedHttpOptions guard;
  guard.max_connections = 64;
  guard.request_read_deadline = absl::Seconds(5);
  auto guarded = std::make_unique<GuardedHttpServer>(guard);
  GuardedHttpServer* guarded_server = guarded.get();
  server->http_ = std::move(guarded);
  // httplib's default also sets SO_REUSEPORT, which would let a second process share the port
  // and silently take half the scrapes; a busy port must be an error.
  server->http_->set_socket_options([](socket_t sock) {
    const int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  MetricsServer* self = server.get();
  server->http_->Get("/metrics", [self](const httplib::Request&, httplib::Response& res) {
    res.set_content(
        SerializeMetrics(*self->registry_,
                         self->service_labels_ ? self->service_labels_() : MetricLabels()),
        "text/plain; version=0.0.4; charset=utf-8");
  });
  server->http_->Get("/health", [self](const httplib::Request&, httplib::Response& res) {
    const bool ok = !self->healthy_ || self->healthy_();
    res.status = ok ? 200 : 503;
    res.set_content(ok ? "ok\n" : "not serving\n", "text/plain");
  });
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics port: ", options.port, " is outside [0, 65535]"));
  }
  if (options.port == 0) {
    server->port_ = server->http_->bind_to_any_port(options.host);
  } else if (server->http_->bind_to_port(options.host, options.port)) {
    server->port_ = options.port;
  } else {
    server->port_ = -1;
  }
  if (server->port_ <= 0) {
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot listen on ", options.host, ":", options.port));
  }
  guarded_server->RaiseListenBacklog();
  server->thread_ = std::thread([self] {
    self->http_->listen_after_bind();
    self->listen_returned_ = true;
  });
  // httplib's stop() is a no-op until the accept loop runs, so Stop() right after Start() would
  // hang; wait for the loop (or for its failure).
  while (!server->http_->is_running() && !server->listen_returned_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!server->http_->is_running()) {
    return absl::UnavailableError(
        absl::StrCat("metrics: listener on ", options.host, ":", server->port_, " failed"));
  }
  return server;
}

MetricsServer::~MetricsServer() { Stop(); }

void MetricsServer::Stop() {
  if (http_ != nullptr) http_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace specd
