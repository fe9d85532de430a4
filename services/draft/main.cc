// specd-draft: the draft model and n-gram drafter behind the specd.v1.Drafter service.
#include <memory>
#include <string>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "common/flag_names.h"
#include "common/service/metrics.h"
#include "common/service/model_service_main.h"
#include "common/service/tls_options.h"
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
ABSL_FLAG(std::string, eagle_head, "",
          "folder of an EAGLE-3 (or EAGLE-1/2) head for the target (docs/eagle.md): serves "
          "DRAFT_METHOD_EAGLE, fed with the target's hidden states; needs --eagle_target");
ABSL_FLAG(std::string, eagle_target, "",
          "Hugging Face folder of the target model the --eagle_head was trained for (its "
          "config and token embedding)");
ABSL_FLAG(std::string, device, "cpu", "cpu, or cuda:N where a CUDA backend is built");
ABSL_FLAG(int, max_sequences, 256, "live sequences held at once; more get RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, kv_capacity_tokens, 1 << 20, "draft KV cache capacity in tokens");
ABSL_FLAG(bool, warmup, true,
          "on a GPU, run one forward at each GEMM row class and the default tree's draft levels "
          "at each batch bucket before serving, so that no request pays for choosing a class's "
          "algorithm or capturing a level's graph (takes a few seconds at startup)");
ABSL_FLAG(int, num_threads, 0, "cpu: worker threads (0 = all cores)");
ABSL_FLAG(int, tree_depth, 4, "tree depth when a step leaves it 0");
ABSL_FLAG(int, tree_top_k, 4, "children per expanded node when a step leaves it 0");
ABSL_FLAG(int, tree_max_nodes, 16, "tree size when a step leaves it 0 (<= 256)");
ABSL_FLAG(int, ngram_min_n, 1, "n-gram drafter: shortest suffix matched");
ABSL_FLAG(int, ngram_max_n, 3, "n-gram drafter: longest suffix matched");
ABSL_FLAG(bool, draft_backend_topk, true,
          "take each tree level's children from the backend's top-k (on the device for CUDA) "
          "instead of copying full logit rows to the host; the same trees either way (an A/B "
          "switch for benchmarks)");
ABSL_FLAG(bool, draft_reuse_kv, true,
          "keep a step's draft KV and commit the accepted path from it instead of feeding the "
          "accepted tokens again; the same trees either way (an A/B switch for benchmarks)");
ABSL_FLAG(int, gather_window_us, 2000,
          "longest wait for other routers' steps once one router's step is queued, so that they "
          "draft as one batch (at most the recent step time; 0 = never wait)");
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
ABSL_FLAG(int, test_only_pre_draft_delay_ms, 0,
          "tests only: answer each step that pre-drafts this much later (a slow draft device)");
ABSL_FLAG(bool, reflection, false,
          "serve gRPC server reflection (lists and describes the API to anyone who connects)");

namespace specd {
namespace {

int Main() {
  ModelServiceOptions service_options;
  service_options.model = absl::GetFlag(FLAGS_model);
  service_options.name = "specd-draft";
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
  DraftLoopOptions options;
  options.model_dir = absl::GetFlag(FLAGS_model);
  options.vocab_size = absl::GetFlag(FLAGS_vocab_size);
  options.eagle_head_dir = absl::GetFlag(FLAGS_eagle_head);
  options.eagle_target_dir = absl::GetFlag(FLAGS_eagle_target);
  options.backend.device = absl::GetFlag(FLAGS_device);
  options.backend.kv_capacity_tokens = absl::GetFlag(FLAGS_kv_capacity_tokens);
  options.backend.num_threads = absl::GetFlag(FLAGS_num_threads);
  options.backend.cuda_warmup = absl::GetFlag(FLAGS_warmup);
  options.max_sequences = absl::GetFlag(FLAGS_max_sequences);
  options.defaults.depth = absl::GetFlag(FLAGS_tree_depth);
  options.defaults.top_k = absl::GetFlag(FLAGS_tree_top_k);
  options.defaults.max_nodes = absl::GetFlag(FLAGS_tree_max_nodes);
  options.ngram.min_n = absl::GetFlag(FLAGS_ngram_min_n);
  options.ngram.max_n = absl::GetFlag(FLAGS_ngram_max_n);
  options.max_gather = absl::Microseconds(absl::GetFlag(FLAGS_gather_window_us));
  options.drafter.backend_topk = absl::GetFlag(FLAGS_draft_backend_topk);
  options.drafter.reuse_kv = absl::GetFlag(FLAGS_draft_reuse_kv);
  options.test_only_pre_draft_delay =
      absl::Milliseconds(absl::GetFlag(FLAGS_test_only_pre_draft_delay_ms));
  if (options.model_dir.empty() && options.eagle_head_dir.empty() && options.vocab_size < 1) {
    return FailStartup(absl::InvalidArgumentError(
        "--model, --eagle_head or --vocab_size: give a draft model folder, an EAGLE head, or "
        "the target's vocabulary size to serve n-gram drafting only"));
  }
  if (!options.eagle_head_dir.empty() && options.eagle_target_dir.empty()) {
    return FailStartup(absl::InvalidArgumentError(
        "--eagle_target: needed with --eagle_head (the head reads the target's embedding)"));
  }
  if (options.max_gather < absl::ZeroDuration()) {
    return FailStartup(absl::InvalidArgumentError("--gather_window_us: must be at least 0"));
  }
  if (options.backend.kv_capacity_tokens < 1) {
    return FailStartup(absl::InvalidArgumentError("--kv_capacity_tokens: must be at least 1"));
  }

  DraftStepQueue queue;
  DraftService service(&queue);
  service_options.service = &service;
  service_options.service_full_name = v1::Drafter::service_full_name();
  service_options.loading =
      options.model_dir.empty() ? std::string("n-gram drafter only") : options.model_dir;
  if (!options.eagle_head_dir.empty()) {
    service_options.loading += " + EAGLE head " + options.eagle_head_dir;
  }
  service_options.device = options.backend.device;
  return RunModelService(
      service_options,
      [&](ModelServiceMetrics* metrics) -> absl::StatusOr<std::unique_ptr<ModelLoop>> {
        absl::StatusOr<std::unique_ptr<DraftLoop>> loop =
            DraftLoop::Create(options, &queue, metrics);
        if (!loop.ok()) {
          queue.CloseAndFail(absl::UnavailableError("the draft model failed to load"));
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
      "Serves the drafters of a specd cluster (specd.v1.Drafter).\n"
      "  specd-draft --model DIR | --vocab_size N [--eagle_head DIR --eagle_target DIR]\n"
      "              [--address HOST:PORT] [--metrics_port N]");
  specd::AcceptDashedFlagNames(argc, argv);
  absl::ParseCommandLine(argc, argv);
  return specd::Main();
}
