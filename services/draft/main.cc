// specd-draft: the draft model and n-gram drafter behind the specd.v1.Drafter service.
#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_util.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/signals.h"
#include "services/draft/draft_loop.h"
#include "services/draft/draft_service.h"

ABSL_FLAG(std::string, address, "0.0.0.0:50051", "gRPC listen address, host:port");
ABSL_FLAG(int, metrics_port, 9101,
          "port of the HTTP listener serving /metrics and /health (on the --address host)");
ABSL_FLAG(std::string, model, "",
          "Hugging Face folder of the draft model (same tokenizer as the target); empty serves "
          "n-gram drafting only");
ABSL_FLAG(int, vocab_size, 0,
          "the target's vocabulary size; required without --model, checked against it with");
ABSL_FLAG(std::string, device, "cpu", "cpu, or cuda:N where a CUDA backend is built");
ABSL_FLAG(int, max_sequences, 256, "live sequences held at once; more get RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, kv_capacity_tokens, 1 << 20, "draft KV cache capacity in tokens");
ABSL_FLAG(int, num_threads, 0, "cpu: worker threads (0 = all cores)");
ABSL_FLAG(int, tree_depth, 4, "tree depth when a step leaves it 0");
ABSL_FLAG(int, tree_top_k, 4, "children per expanded node when a step leaves it 0");
ABSL_FLAG(int, tree_max_nodes, 16, "tree size when a step leaves it 0 (<= 256)");
ABSL_FLAG(int, ngram_min_n, 1, "n-gram drafter: shortest suffix matched");
ABSL_FLAG(int, ngram_max_n, 3, "n-gram drafter: longest suffix matched");
ABSL_FLAG(int, startup_delay_ms, 0,
          "wait this long before loading the model (to exercise readiness probes in tests)");
ABSL_FLAG(int, shutdown_grace_ms, 5000,
          "on SIGTERM/SIGINT, how long running streams may go on before they are cancelled");

namespace specd {
namespace {

int Fail(const absl::Status& status) {
  SPECD_LOG(ERROR) << status.message();
  return EXIT_FAILURE;
}

int Main() {
  absl::Notification& stop = WatchTerminationSignals();
  const std::string address = absl::GetFlag(FLAGS_address);
  absl::StatusOr<HostPort> host_port = ParseHostPort(address, "--address");
  if (!host_port.ok()) return Fail(host_port.status());
  DraftLoopOptions options;
  options.model_dir = absl::GetFlag(FLAGS_model);
  options.vocab_size = absl::GetFlag(FLAGS_vocab_size);
  options.backend.device = absl::GetFlag(FLAGS_device);
  options.backend.kv_capacity_tokens = absl::GetFlag(FLAGS_kv_capacity_tokens);
  options.backend.num_threads = absl::GetFlag(FLAGS_num_threads);
  options.max_sequences = absl::GetFlag(FLAGS_max_sequences);
  options.defaults.depth = absl::GetFlag(FLAGS_tree_depth);
  options.defaults.top_k = absl::GetFlag(FLAGS_tree_top_k);
  options.defaults.max_nodes = absl::GetFlag(FLAGS_tree_max_nodes);
  options.ngram.min_n = absl::GetFlag(FLAGS_ngram_min_n);
  options.ngram.max_n = absl::GetFlag(FLAGS_ngram_max_n);
  if (options.model_dir.empty() && options.vocab_size < 1) {
    return Fail(absl::InvalidArgumentError(
        "--model or --vocab_size: give a draft model folder, or the target's vocabulary size "
        "to serve n-gram drafting only"));
  }
  if (options.backend.kv_capacity_tokens < 1) {
    return Fail(absl::InvalidArgumentError("--kv_capacity_tokens: must be at least 1"));
  }

  DraftStepQueue queue;
  DraftService service(&queue);
  auto registry = std::make_shared<prometheus::Registry>();
  ModelServiceMetrics metrics(*registry);
  std::atomic<bool> serving{false};

  absl::StatusOr<std::unique_ptr<GrpcServer>> server =
      GrpcServer::Start({address, {&service}, {v1::Drafter::service_full_name()}});
  if (!server.ok()) return Fail(server.status());
  absl::StatusOr<std::unique_ptr<MetricsServer>> metrics_server = MetricsServer::Start(
      {host_port->host.empty() ? "0.0.0.0" : host_port->host, absl::GetFlag(FLAGS_metrics_port)},
      registry, [&serving] { return serving.load(); });
  if (!metrics_server.ok()) return Fail(metrics_server.status());
  SPECD_LOG(INFO) << "specd-draft: gRPC on port " << (*server)->port() << ", metrics on port "
                  << (*metrics_server)->port() << "; loading "
                  << (options.model_dir.empty() ? std::string("n-gram drafter only")
                                                : options.model_dir);

  if (stop.WaitForNotificationWithTimeout(
          absl::Milliseconds(absl::GetFlag(FLAGS_startup_delay_ms)))) {
    (*server)->Shutdown(0);
    return EXIT_SUCCESS;
  }
  absl::StatusOr<std::unique_ptr<DraftLoop>> loop = DraftLoop::Create(options, &queue, &metrics);
  if (!loop.ok()) {
    queue.CloseAndFail(absl::UnavailableError("the draft model failed to load"));
    (*server)->Shutdown(0);
    return Fail(loop.status());
  }
  service.SetInfo((*loop)->info());
  (*server)->SetServing(true);
  serving = true;
  SPECD_LOG(INFO) << "specd-draft: serving " << (*loop)->info().model() << " on "
                  << options.backend.device;

  stop.WaitForNotification();
  SPECD_LOG(INFO) << "specd-draft: signal " << TerminationSignal() << ", shutting down";
  serving = false;
  (*server)->SetServing(false);
  (*server)->Shutdown(absl::GetFlag(FLAGS_shutdown_grace_ms));
  (*loop)->Stop();
  (*metrics_server)->Stop();
  SPECD_LOG(INFO) << "specd-draft: stopped";
  return EXIT_SUCCESS;
}

}  // namespace
}  // namespace specd

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Serves the drafters of a specd cluster (specd.v1.Drafter).\n"
      "  specd-draft --model DIR | --vocab_size N [--address HOST:PORT] [--metrics_port N]");
  absl::ParseCommandLine(argc, argv);
  return specd::Main();
}
