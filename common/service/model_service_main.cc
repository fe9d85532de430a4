#include "common/service/model_service_main.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/service/grpc_util.h"
#include "common/logging.h"
#include "common/signals.h"

namespace specd {

int FailStartup(const absl::Status& status) {
  SPECD_LOG(ERROR) << status.message();
  return EXIT_FAILURE;
}

std::string KvCapacityLine(int64_t capacity_tokens, int64_t max_context, int max_sequences) {
  if (capacity_tokens <= 0) {
    return absl::StrCat("no KV cache; at most ", max_sequences, " sequences");
  }
  const int64_t full = capacity_tokens / std::max<int64_t>(max_context, 1);
  return absl::StrCat("KV cache ", capacity_tokens, " tokens = ", full, " sequences of the full ",
                      max_context, "-token context; at most ", max_sequences, " sequences");
}

absl::Status CheckModelServiceOptions(const ModelServiceOptions& options) {
  return ParseHostPort(options.address, "--address").status();
}

int RunModelService(
    const ModelServiceOptions& options,
    const std::function<absl::StatusOr<std::unique_ptr<ModelLoop>>(ModelServiceMetrics*)>&
        create_loop) {
  absl::Notification& stop = WatchTerminationSignals();
  absl::StatusOr<HostPort> host_port = ParseHostPort(options.address, "--address");
  if (!host_port.ok()) return FailStartup(host_port.status());

  auto registry = std::make_shared<prometheus::Registry>();
  ModelServiceMetrics metrics(*registry);
  std::atomic<bool> serving{false};

  GrpcServerOptions server_options;
  server_options.address = options.address;
  server_options.services = {options.service};
  server_options.health_service_names = {options.service_full_name};
  server_options.credentials = options.credentials;
  server_options.reflection = options.reflection;
  absl::StatusOr<std::unique_ptr<GrpcServer>> server = GrpcServer::Start(server_options);
  if (!server.ok()) return FailStartup(server.status());
  MetricsServerOptions metrics_options;
  metrics_options.host = host_port->host.empty() ? "0.0.0.0" : host_port->host;
  metrics_options.port = options.metrics_port;
  if (!options.model.empty()) {
    const MetricLabels labels = {{"model", ModelLabel(options.model)}};
    metrics_options.service_labels = [labels] { return labels; };
  }
  absl::StatusOr<std::unique_ptr<MetricsServer>> metrics_server =
      MetricsServer::Start(metrics_options, registry, [&serving] { return serving.load(); });
  if (!metrics_server.ok()) return FailStartup(metrics_server.status());
  SPECD_LOG(INFO) << options.name << ": gRPC on port " << (*server)->port()
                  << ", metrics on port " << (*metrics_server)->port() << "; loading "
                  << options.loading;

  if (stop.WaitForNotificationWithTimeout(absl::Milliseconds(options.startup_delay_ms))) {
    (*server)->Shutdown(0);
    return EXIT_SUCCESS;
  }
  const absl::Time load_start = absl::Now();
  absl::StatusOr<std::unique_ptr<ModelLoop>> loop = create_loop(&metrics);
  if (!loop.ok()) {
    (*server)->Shutdown(0);
    return FailStartup(loop.status());
  }
  (*server)->SetServing(true);
  serving = true;
  SPECD_LOG(INFO) << options.name << ": serving " << (*loop)->model_name() << " on "
                  << options.device << " (loaded in "
                  << absl::FormatDuration(
                         absl::Trunc(absl::Now() - load_start, absl::Milliseconds(1)))
                  << "); " << (*loop)->CapacitySummary();

  stop.WaitForNotification();
  SPECD_LOG(INFO) << options.name << ": signal " << TerminationSignal() << ", shutting down";
  serving = false;
  (*server)->SetServing(false);
  // Drain: running sequences may finish within the grace period, new ones are refused. Then
  // shut the server down at once: what is left are idle Step streams (a router's stays open
  // between requests) and idle connections, and gRPC's graceful shutdown would wait for those
  // until its deadline. Ending the streams tells each router this service is gone.
  (*loop)->BeginDrain();
  const int64_t live = (*server)->DrainAndShutdown(
      [&] { return (*loop)->LiveSequences(); }, absl::Milliseconds(options.shutdown_grace_ms));
  if (live > 0) {
    SPECD_LOG(WARNING) << options.name << ": " << live << " sequence(s) still running after "
                       << options.shutdown_grace_ms << " ms; cancelling them";
  }
  (*loop)->Stop();
  (*metrics_server)->Stop();
  SPECD_LOG(INFO) << options.name << ": stopped";
  return EXIT_SUCCESS;
}

}  // namespace specd
