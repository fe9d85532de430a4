// specd-verify: the target model behind the specd.v1.Verifier service.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/flag_names.h"
#include "common/service/metrics.h"
#include "common/service/model_service_main.h"
#include "common/service/tls_options.h"
#include "services/verify/verify_loop.h"
#include "services/verify/verify_service.h"

ABSL_FLAG(std::string, address, "0.0.0.0:50052", "gRPC listen address, host:port");
ABSL_FLAG(int, metrics_port, 9102,
          "port of the HTTP listener serving /metrics and /health (on the --address host)");
ABSL_FLAG(std::string, model, "", "Hugging Face folder of the target model (required)");
ABSL_FLAG(std::string, device, "cpu", "cpu, or cuda:N where a CUDA backend is built");
ABSL_FLAG(std::string, devices, "",
          "comma-separated GPUs, one per tensor-parallel rank (\"1,2,3\" or \"cuda:1,cuda:2\"), "
          "replacing --device; \"cpu,cpu\" for simulated CPU ranks");
ABSL_FLAG(int, tensor_parallel, 1,
          "ranks the target model is split over, any number: one thread per rank, each on its "
          "own GPU (--devices) or simulated on the CPU");
ABSL_FLAG(int64_t, custom_allreduce_max_bytes, -1,
          "cuda tensor parallel: all-reduces up to this many bytes use the custom one-shot "
          "kernel, larger ones NCCL (-1: every CUDA-graph step, 0: NCCL only)");
ABSL_FLAG(int, max_sequences, 256, "live sequences held at once; more get RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_tap_bytes_per_reply, 0,
          "EAGLE taps one reply carries over its sequences (0: half the message limit); a "
          "sequence's rows past it follow in its next replies (docs/eagle.md)");
ABSL_FLAG(int64_t, max_held_tap_bytes, int64_t{16} << 20,
          "EAGLE taps (fp32 rows) held per sequence while the router does not draft it (on the "
          "GPU with a CUDA backend, 256 MiB for all sequences there, past which in host "
          "memory); past it the older half is dropped and the drafter's head restarts from the "
          "rest (docs/eagle.md)");
ABSL_FLAG(int64_t, kv_capacity_tokens, 1 << 20, "KV cache capacity in tokens over all sequences");
ABSL_FLAG(int, gather_window_us, 2000,
          "longest wait for other routers' steps once one router's step is queued, so that they "
          "verify as one batch (at most the recent step time; 0 = never wait)");
ABSL_FLAG(bool, warmup, true,
          "on a GPU, run one forward at each GEMM row class before serving, so that no request "
          "pays for choosing a class's algorithm (takes a few seconds at startup)");
ABSL_FLAG(int, num_threads, 0, "cpu: worker threads (0 = all cores)");
ABSL_FLAG(int, startup_delay_ms, 0,
          "wait this long before loading the model (to exercise readiness probes in tests)");
ABSL_FLAG(int, shutdown_grace_ms, 5000,
          "on SIGTERM/SIGINT, how long running sequences may go on (new ones are refused) "
          "before they are cancelled; the service stops as soon as none is left");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain: serve gRPC over TLS (with --tls_key); re-read when it changes");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: require clients (the routers) to present a certificate it signed "
          "(mutual TLS)");
ABSL_FLAG(bool, reflection, false,
          "serve gRPC server reflection (lists and describes the API to anyone who connects)");

namespace specd {
namespace {

int Main() {
  ModelServiceOptions service_options;
  service_options.model = absl::GetFlag(FLAGS_model);
  service_options.name = "specd-verify";
  service_options.address = absl::GetFlag(FLAGS_address);
  service_options.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  service_options.startup_delay_ms = absl::GetFlag(FLAGS_startup_delay_ms);
  service_options.shutdown_grace_ms = absl::GetFlag(FLAGS_shutdown_grace_ms);
  if (absl::Status s = CheckModelServiceOptions(service_options); !s.ok()) return FailStartup(s);
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeServerCredentials({absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                             absl::GetFlag(FLAGS_tls_client_ca)},
                            "--tls_");
  if (!credentials.ok()) return FailStartup(credentials.status());
  service_options.credentials = *std::move(credentials);
  service_options.reflection = absl::GetFlag(FLAGS_reflection);
  if (absl::GetFlag(FLAGS_model).empty()) {
    return FailStartup(
        absl::InvalidArgumentError("--model: required (a Hugging Face model folder)"));
  }
  VerifyLoopOptions options;
  options.model_dir = absl::GetFlag(FLAGS_model);
  options.backend.device = absl::GetFlag(FLAGS_device);
  options.backend.kv_capacity_tokens = absl::GetFlag(FLAGS_kv_capacity_tokens);
  options.backend.num_threads = absl::GetFlag(FLAGS_num_threads);
  options.backend.cuda_warmup = absl::GetFlag(FLAGS_warmup);
  options.backend.tensor_parallel = absl::GetFlag(FLAGS_tensor_parallel);
  options.max_sequences = absl::GetFlag(FLAGS_max_sequences);
  options.max_gather = absl::Microseconds(absl::GetFlag(FLAGS_gather_window_us));
  options.max_tap_bytes_per_reply = absl::GetFlag(FLAGS_max_tap_bytes_per_reply);
  if (options.max_tap_bytes_per_reply < 0) {
    return FailStartup(absl::InvalidArgumentError(absl::StrCat(
        "--max_tap_bytes_per_reply: must be >= 0, got ", options.max_tap_bytes_per_reply)));
  }
  options.max_held_tap_bytes = absl::GetFlag(FLAGS_max_held_tap_bytes);
  if (options.max_held_tap_bytes < 1) {
    return FailStartup(absl::InvalidArgumentError(
        absl::StrCat("--max_held_tap_bytes: must be >= 1, got ", options.max_held_tap_bytes)));
  }
  if (const std::string devices = absl::GetFlag(FLAGS_devices); !devices.empty()) {
    std::vector<std::string> list = absl::StrSplit(devices, ',', absl::SkipEmpty());
    if (static_cast<int>(list.size()) != options.backend.tensor_parallel) {
      return FailStartup(absl::InvalidArgumentError(
          absl::StrCat("--devices: lists ", list.size(), " devices but --tensor_parallel is ",
                       options.backend.tensor_parallel)));
    }
    // "cpu" entries select the simulated CPU ranks; GPUs are "N" or "cuda:N".
    if (list[0] == "cpu") {
      options.backend.device = "cpu";
    } else {
      for (size_t i = 0; i < list.size(); ++i) {
        std::string entry = list[i];
        if (absl::StartsWith(entry, "cuda:")) entry = entry.substr(5);
        int gpu = -1;
        if (!absl::SimpleAtoi(entry, &gpu) || gpu < 0) {
          return FailStartup(absl::InvalidArgumentError(absl::StrCat(
              "--devices: entry ", i, " \"", list[i], "\" is not a GPU index or cuda:N")));
        }
        options.backend.devices.push_back(gpu);
      }
      options.backend.device = absl::StrCat("cuda:", options.backend.devices[0]);
    }
  }
  options.backend.cuda_custom_allreduce_max_bytes = absl::GetFlag(FLAGS_custom_allreduce_max_bytes);
  if (options.backend.kv_capacity_tokens < 1) {
    return FailStartup(absl::InvalidArgumentError("--kv_capacity_tokens: must be at least 1"));
  }
  if (options.max_gather < absl::ZeroDuration()) {
    return FailStartup(absl::InvalidArgumentError("--gather_window_us: must be at least 0"));
  }

  VerifyStepQueue queue;
  VerifyService service(&queue);
  service_options.service = &service;
  service_options.service_full_name = v1::Verifier::service_full_name();
  service_options.loading = options.model_dir;
  service_options.device = options.backend.device;
  return RunModelService(
      service_options,
      [&](ModelServiceMetrics* metrics) -> absl::StatusOr<std::unique_ptr<ModelLoop>> {
        absl::StatusOr<std::unique_ptr<VerifyLoop>> loop =
            VerifyLoop::Create(options, &queue, metrics);
        if (!loop.ok()) {
          queue.CloseAndFail(absl::UnavailableError("the model failed to load"));
          return loop.status();
        }
        service.SetInfo((*loop)->info());
        // The loop outlives the gRPC server (RunModelService stops the server first).
        service.SetLoad([l = loop->get()] {
          v1::ServiceLoad load;
          load.set_running_sequences(static_cast<uint32_t>(l->LiveSequences()));
          load.set_kv_cache_usage_ratio(static_cast<float>(l->KvCacheUsage()));
          return load;
        });
        return std::move(*loop);
      });
}

}  // namespace
}  // namespace specd

int main(int argc, char** argv) {
  specd::SetUsageAndHelpFilter(
      "Serves the target model of a specd cluster (specd.v1.Verifier).\n"
      "  specd-verify --model DIR [--address HOST:PORT] [--metrics_port N] [--device cpu]");
  specd::AcceptDashedFlagNames(argc, argv);
  absl::ParseCommandLine(argc, argv);
  return specd::Main();
}
