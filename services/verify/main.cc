// specd-verify: the target model behind the specd.v1.Verifier service.
#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_util.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/signals.h"
#include "services/verify/verify_loop.h"
#include "services/verify/verify_service.h"

ABSL_FLAG(std::string, address, "0.0.0.0:50052", "gRPC listen address, host:port");
ABSL_FLAG(int, metrics_port, 9102,
          "port of the HTTP listener serving /metrics and /health (on the --address host)");
ABSL_FLAG(std::string, model, "", "Hugging Face folder of the target model (required)");
ABSL_FLAG(std::string, device, "cpu", "cpu, or cuda:N where a CUDA backend is built");
ABSL_FLAG(std::string, devices, "",
          "comma-separated devices, one per tensor-parallel rank; replaces --device");
ABSL_FLAG(int, tensor_parallel, 1,
          "ranks the target model is split over: any number on the CPU (one thread per rank); "
          "1 on CUDA for now");
ABSL_FLAG(int, max_sequences, 256, "live sequences held at once; more get RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, kv_capacity_tokens, 1 << 20, "KV cache capacity in tokens over all sequences");
ABSL_FLAG(int, num_threads, 0, "cpu: worker threads (0 = all cores)");
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
  if (absl::GetFlag(FLAGS_model).empty()) {
    return Fail(absl::InvalidArgumentError("--model: required (a Hugging Face model folder)"));
  }
  VerifyLoopOptions options;
  options.model_dir = absl::GetFlag(FLAGS_model);
  options.backend.device = absl::GetFlag(FLAGS_device);
  options.backend.kv_capacity_tokens = absl::GetFlag(FLAGS_kv_capacity_tokens);
  options.backend.num_threads = absl::GetFlag(FLAGS_num_threads);
  options.backend.tensor_parallel = absl::GetFlag(FLAGS_tensor_parallel);
  options.max_sequences = absl::GetFlag(FLAGS_max_sequences);
  if (const std::string devices = absl::GetFlag(FLAGS_devices); !devices.empty()) {
    std::vector<std::string> list = absl::StrSplit(devices, ',', absl::SkipEmpty());
    if (static_cast<int>(list.size()) != options.backend.tensor_parallel) {
      return Fail(absl::InvalidArgumentError(absl::StrCat("--devices: lists ", list.size(),
                                                          " devices but --tensor_parallel is ",
                                                          options.backend.tensor_parallel)));
    }
    options.backend.device = list[0];
  }
  if (options.backend.kv_capacity_tokens < 1) {
    return Fail(absl::InvalidArgumentError("--kv_capacity_tokens: must be at least 1"));
  }

  VerifyStepQueue queue;
  VerifyService service(&queue);
  auto registry = std::make_shared<prometheus::Registry>();
  ModelServiceMetrics metrics(*registry);
  std::atomic<bool> serving{false};

  absl::StatusOr<std::unique_ptr<GrpcServer>> server =
      GrpcServer::Start({address, {&service}, {v1::Verifier::service_full_name()}});
  if (!server.ok()) return Fail(server.status());
  absl::StatusOr<std::unique_ptr<MetricsServer>> metrics_server = MetricsServer::Start(
      {host_port->host.empty() ? "0.0.0.0" : host_port->host, absl::GetFlag(FLAGS_metrics_port)},
      registry, [&serving] { return serving.load(); });
  if (!metrics_server.ok()) return Fail(metrics_server.status());
  SPECD_LOG(INFO) << "specd-verify: gRPC on port " << (*server)->port() << ", metrics on port "
                  << (*metrics_server)->port() << "; loading " << options.model_dir;

  if (stop.WaitForNotificationWithTimeout(
          absl::Milliseconds(absl::GetFlag(FLAGS_startup_delay_ms)))) {
    (*server)->Shutdown(0);
    return EXIT_SUCCESS;
  }
  absl::StatusOr<std::unique_ptr<VerifyLoop>> loop = VerifyLoop::Create(options, &queue, &metrics);
  if (!loop.ok()) {
    queue.CloseAndFail(absl::UnavailableError("the model failed to load"));
    (*server)->Shutdown(0);
    return Fail(loop.status());
  }
  service.SetInfo((*loop)->info());
  (*server)->SetServing(true);
  serving = true;
  SPECD_LOG(INFO) << "specd-verify: serving " << (*loop)->info().model() << " on "
                  << options.backend.device;

  stop.WaitForNotification();
  SPECD_LOG(INFO) << "specd-verify: signal " << TerminationSignal() << ", shutting down";
  serving = false;
  (*server)->SetServing(false);
  (*server)->Shutdown(absl::GetFlag(FLAGS_shutdown_grace_ms));
  (*loop)->Stop();
  (*metrics_server)->Stop();
  SPECD_LOG(INFO) << "specd-verify: stopped";
  return EXIT_SUCCESS;
}

}  // namespace
}  // namespace specd

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Serves the target model of a specd cluster (specd.v1.Verifier).\n"
      "  specd-verify --model DIR [--address HOST:PORT] [--metrics_port N] [--device cpu]");
  absl::ParseCommandLine(argc, argv);
  return specd::Main();
}
