// specd-router: the public Generation API in front of a draft and a verify service.
//
//   specd-router --model models/pycoder-target --verify_address 127.0.0.1:50052 \
//       --draft_address 127.0.0.1:50051 --address 0.0.0.0:50050 --metrics_port 9100
#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/flag_names.h"
#include "common/logging.h"
#include "common/service/grpc_util.h"
#include "common/service/metrics.h"
#include "common/service/tls_options.h"
#include "common/signals.h"
#include "common/text/tokenizer.h"
#include "common/token_tree.h"
#include "engine/model_config.h"
#include "services/router/group_pool.h"
#include "services/router/router_metrics.h"
#include "services/router/router_service.h"

ABSL_FLAG(std::string, address, "0.0.0.0:50050", "host:port of the public Generation API");
ABSL_FLAG(int, metrics_port, 9100, "port of the /metrics HTTP listener (0 = pick a free one)");
ABSL_FLAG(std::string, model, "",
          "Hugging Face folder of the target model: tokenizer.json, config.json and "
          "generation_config.json (vocabulary, context, EOS); the weights stay with the verify "
          "service");
ABSL_FLAG(std::string, verify_address, "127.0.0.1:50052",
          "host:port of specd-verify, or a comma-separated list of verify groups; an entry "
          "dns:///name:port stands for every address the name resolves to (e.g. the headless "
          "Service of the verify StatefulSet), resolved again every --dns_refresh_seconds. Each "
          "new sequence goes to the least-loaded group that is up");
ABSL_FLAG(std::string, draft_address, "",
          "host:port of specd-draft, or a comma-separated list (dns:///name:port entries as for "
          "--verify_address); each new sequence drafts through the least-loaded draft service, "
          "whatever its verify group. Empty = no draft service (target-only decoding)");
ABSL_FLAG(double, dns_refresh_seconds, 10,
          "how often dns:/// entries of --verify_address and --draft_address are resolved "
          "again: new addresses get new sequences, gone ones close once drained");
ABSL_FLAG(int, max_batch, 32, "most sequences in one speculation step");
ABSL_FLAG(int, max_queue, 256,
          "most requests waiting to start; more are refused with RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_new_tokens_limit, 4096, "largest max_new_tokens a request may ask for");
ABSL_FLAG(int, default_max_new_tokens, 256, "max_new_tokens of requests that set none");
ABSL_FLAG(int, draft_depth, 4, "default draft tree depth");
ABSL_FLAG(int, draft_top_k, 4, "default children per expanded draft node");
ABSL_FLAG(int, draft_max_nodes, 16, "default nodes per draft tree (<= 256)");
ABSL_FLAG(std::string, default_speculation, "auto",
          "what SPECULATION_AUTO requests use: auto (EAGLE-3 when the draft service has an "
          "EAGLE head, else the draft model, when the draft service is up), off, draft_model, "
          "ngram or eagle3");
ABSL_FLAG(std::string, speculation_policy, "goodput",
          "tree shape of requests that name none: goodput (every step, per sequence, the shape "
          "that maximises the batch's predicted tokens/s from measured costs and acceptance, "
          "down to none) or fixed (--draft_depth/--draft_top_k/--draft_max_nodes every step)");
ABSL_FLAG(int, draft_ingest_tokens, 0,
          "feed a sequence the policy is not drafting to the draft service once it is this many "
          "tokens behind (beside the verify step, while it fits in it), so that drafting it "
          "again needs no catch-up; 0: never. For a draft service on its own GPU (e.g. 16): on "
          "the verify service's GPU the ingest slows verify");
ABSL_FLAG(bool, auto_ngram, true,
          "auto requests (under the goodput policy) also get n-gram prompt lookup in the router "
          "as a second drafter: every step, per sequence, the policy may verify its n-gram "
          "proposal instead of the draft service's tree, also while that service is down "
          "(false: the draft service's drafter alone; an A/B switch)");
ABSL_FLAG(bool, eagle_hold_taps, true,
          "EAGLE sequences: the verify service holds the taps of steps the policy does not "
          "draft and sends them when it drafts the sequence again (false: every step sends its "
          "taps; an A/B switch for benchmarks)");
ABSL_FLAG(int, eagle_tap_dormant_steps, 32,
          "EAGLE sequences the policy has not drafted for this many steps in a row stop asking "
          "the verify service for taps (their steps are plain steps); drafted again, they ask "
          "for one step's taps first and the head restarts from them. New EAGLE sequences start "
          "so while none has been drafted for this many steps. 0: never (taps held however long)");
ABSL_FLAG(std::string, overlap, "off",
          "pre-draft while verify runs: on (each step that verifies draft-model trees also asks "
          "the draft service for the next trees below each tree's most likely outcome; a hit "
          "skips the next step's draft), auto (only where the pre-draft fits inside the verify "
          "step and the hits it can expect pay for what it costs the step, as measured: verify "
          "slowed beside it, waits past verify) or off (draft, then verify)");
ABSL_FLAG(int, overlap_max_fan_out, 4,
          "with --overlap: at most this many outcome guesses per sequence, each with its tree "
          "(1 to 8; beyond the likeliest, e.g. a chain rejected at a node where the target emits "
          "the draft's runner-up); the goodput policy's cost model picks how many fit in the "
          "verify step (at least one with --overlap=on; with --overlap=on and "
          "--speculation_policy=fixed, this many for a lone sequence); several sequences "
          "pre-drafting together get one each");
ABSL_FLAG(std::string, metrics_address, "",
          "host:port of the /metrics + /health HTTP listener, e.g. a private interface; empty = "
          "the --address host and --metrics_port");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain: serve the public API over TLS (with --tls_key); re-read when "
          "it changes");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: require API clients to present a certificate it signed (mutual TLS)");
ABSL_FLAG(std::string, upstream_tls_ca, "",
          "PEM CA bundle that signs the draft and verify services' certificates: connect to "
          "them over TLS");
ABSL_FLAG(std::string, upstream_tls_cert, "",
          "PEM client certificate chain the router presents to draft and verify (mutual TLS, "
          "with --upstream_tls_key)");
ABSL_FLAG(std::string, upstream_tls_key, "", "PEM private key of --upstream_tls_cert");
ABSL_FLAG(std::string, token_file, "",
          "file with the bearer tokens the public API accepts, one per line; set: calls without "
          "\"authorization: Bearer <token>\" get UNAUTHENTICATED (health stays open). Read "
          "again when it changes and on SIGHUP");
ABSL_FLAG(bool, reflection, true, "serve gRPC server reflection on the public port");
ABSL_FLAG(int, shutdown_grace_seconds, 30,
          "on SIGTERM/SIGINT: health turns NOT_SERVING and new requests get UNAVAILABLE at "
          "once; streams already running may finish for this long, then they are cancelled");

namespace specd {
namespace {

int Fail(const std::string& message) {
  SPECD_LOG(ERROR) << message;
  return 1;
}

int Main() {
  const std::string model_dir = absl::GetFlag(FLAGS_model);
  if (model_dir.empty()) return Fail("--model: required (the target model's folder)");
  const int max_batch = absl::GetFlag(FLAGS_max_batch);
  const int max_queue = absl::GetFlag(FLAGS_max_queue);
  const int limit = absl::GetFlag(FLAGS_max_new_tokens_limit);
  const int default_new = absl::GetFlag(FLAGS_default_max_new_tokens);
  if (max_batch < 1) return Fail("--max_batch: must be >= 1");
  if (max_queue < 0) return Fail("--max_queue: must be >= 0");
  if (limit < 1) return Fail("--max_new_tokens_limit: must be >= 1");
  if (default_new < 1 || default_new > limit) {
    return Fail("--default_max_new_tokens: must be in [1, --max_new_tokens_limit]");
  }
  DraftShape shape;
  shape.depth = absl::GetFlag(FLAGS_draft_depth);
  shape.top_k = absl::GetFlag(FLAGS_draft_top_k);
  shape.max_nodes = absl::GetFlag(FLAGS_draft_max_nodes);
  if (shape.depth < 1 || shape.depth > kMaxTreeNodes) return Fail("--draft_depth: 1..256");
  if (shape.top_k < 1 || shape.top_k > kMaxTreeNodes) return Fail("--draft_top_k: 1..256");
  if (shape.max_nodes < 1 || shape.max_nodes > kMaxTreeNodes) {
    return Fail("--draft_max_nodes: 1..256");
  }
  const std::string spec = absl::AsciiStrToLower(absl::GetFlag(FLAGS_default_speculation));
  v1::Speculation default_speculation;
  if (spec == "auto") {
    default_speculation = v1::SPECULATION_AUTO;
  } else if (spec == "off") {
    default_speculation = v1::SPECULATION_OFF;
  } else if (spec == "draft_model") {
    default_speculation = v1::SPECULATION_DRAFT_MODEL;
  } else if (spec == "ngram") {
    default_speculation = v1::SPECULATION_NGRAM;
  } else if (spec == "eagle3") {
    default_speculation = v1::SPECULATION_EAGLE3;
  } else {
    return Fail("--default_speculation: one of auto, off, draft_model, ngram, eagle3");
  }

  const int grace_seconds = absl::GetFlag(FLAGS_shutdown_grace_seconds);
  if (grace_seconds < 0) return Fail("--shutdown_grace_seconds: must be >= 0");
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> server_credentials =
      MakeServerCredentials({absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                             absl::GetFlag(FLAGS_tls_client_ca)},
                            "--tls_");
  if (!server_credentials.ok()) return Fail(std::string(server_credentials.status().message()));
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> upstream_credentials =
      MakeChannelCredentials(
          {absl::GetFlag(FLAGS_upstream_tls_ca), absl::GetFlag(FLAGS_upstream_tls_cert),
           absl::GetFlag(FLAGS_upstream_tls_key)},
          "--upstream_tls_");
  if (!upstream_credentials.ok()) {
    return Fail(std::string(upstream_credentials.status().message()));
  }
  std::unique_ptr<BearerTokens> tokens;
  if (const std::string path = absl::GetFlag(FLAGS_token_file); !path.empty()) {
    absl::StatusOr<std::unique_ptr<BearerTokens>> loaded = BearerTokens::Load(path, "--token_file");
    if (!loaded.ok()) return Fail(std::string(loaded.status().message()));
    tokens = *std::move(loaded);
  }

  absl::StatusOr<ModelConfig> config = LoadModelConfig(model_dir);
  if (!config.ok()) return Fail(absl::StrCat("--model: ", config.status().ToString()));
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromModelDir(model_dir);
  if (!tokenizer.ok()) return Fail(absl::StrCat("--model: ", tokenizer.status().ToString()));

  RequestLimits limits;
  limits.vocab_size = config->vocab_size;
  limits.max_context = config->max_position_embeddings;
  limits.eos_token_ids = config->eos_token_ids;
  if (limits.eos_token_ids.empty() && (*tokenizer)->eos_id().has_value()) {
    limits.eos_token_ids.push_back(*(*tokenizer)->eos_id());
  }
  limits.max_new_tokens_limit = limit;
  limits.default_max_new_tokens = default_new;
  limits.default_shape = shape;
  limits.default_speculation = default_speculation;

  auto registry = std::make_shared<prometheus::Registry>();
  RouterMetrics metrics(*registry);

  GroupPoolOptions pool_options;
  RouterLoopOptions& loop_options = pool_options.loop;
  pool_options.verify_addresses =
      absl::StrSplit(absl::GetFlag(FLAGS_verify_address), ',', absl::SkipWhitespace());
  pool_options.draft_addresses =
      absl::StrSplit(absl::GetFlag(FLAGS_draft_address), ',', absl::SkipWhitespace());
  if (pool_options.verify_addresses.empty()) return Fail("--verify_address: required");
  loop_options.max_batch = max_batch;
  loop_options.max_queue = max_queue;
  loop_options.limits = limits;
  const std::string policy = absl::AsciiStrToLower(absl::GetFlag(FLAGS_speculation_policy));
  if (policy != "goodput" && policy != "fixed") {
    return Fail("--speculation_policy: one of goodput, fixed");
  }
  loop_options.adaptive = policy == "goodput";
  loop_options.draft_ingest_tokens = absl::GetFlag(FLAGS_draft_ingest_tokens);
  loop_options.eagle_hold_taps = absl::GetFlag(FLAGS_eagle_hold_taps);
  loop_options.eagle_tap_dormant_steps = absl::GetFlag(FLAGS_eagle_tap_dormant_steps);
  if (loop_options.eagle_tap_dormant_steps < 0) return Fail("--eagle_tap_dormant_steps: >= 0");
  loop_options.auto_ngram = absl::GetFlag(FLAGS_auto_ngram);
  if (loop_options.draft_ingest_tokens < 0) return Fail("--draft_ingest_tokens: must be >= 0");
  const std::string overlap = absl::AsciiStrToLower(absl::GetFlag(FLAGS_overlap));
  if (overlap == "on") {
    loop_options.overlap = OverlapMode::kOn;
  } else if (overlap == "auto") {
    loop_options.overlap = OverlapMode::kAuto;
  } else if (overlap != "off") {
    return Fail("--overlap: one of on, auto, off");
  }
  loop_options.overlap_max_fan_out = absl::GetFlag(FLAGS_overlap_max_fan_out);
  if (loop_options.overlap_max_fan_out < 1 || loop_options.overlap_max_fan_out > 8) {
    return Fail("--overlap_max_fan_out: 1 to 8");
  }
  loop_options.upstream_credentials = *upstream_credentials;
  for (auto [list, flag] : {std::pair{&pool_options.verify_addresses, "--verify_address"},
                            std::pair{&pool_options.draft_addresses, "--draft_address"}}) {
    for (std::string& address : *list) {
      address = std::string(absl::StripAsciiWhitespace(address));
      absl::string_view host_port = address;
      const bool dns = absl::ConsumePrefix(&host_port, kDnsScheme);
      absl::StatusOr<HostPort> hp = ParseHostPort(host_port, flag);
      if (!hp.ok()) return Fail(hp.status().ToString());
      if (dns && hp->host.empty()) {
        return Fail(absl::StrCat(flag, ": ", address, " names no host (dns:///name:port)"));
      }
    }
  }
  const double refresh = absl::GetFlag(FLAGS_dns_refresh_seconds);
  if (!(refresh > 0)) return Fail("--dns_refresh_seconds: must be positive");
  pool_options.resolve_interval = absl::Seconds(refresh);

  // The health status follows the verify services: SERVING while at least one is up.
  std::atomic<GrpcServer*> server_ptr{nullptr};
  std::atomic<bool> serving{false};
  std::atomic<bool> draining{false};
  GroupPool loop(pool_options, tokenizer->get(), registry.get(), &metrics, [&](bool up) {
    if (draining.load()) return;
    serving = up;
    if (GrpcServer* s = server_ptr.load()) s->SetServing(up);
  });

  RouterServiceOptions service_options;
  service_options.limits = limits;
  service_options.target_model = model_dir;
  service_options.chat_template_source = ChatTemplateSourceOf(model_dir);
  service_options.tokens = tokens.get();
  RouterService service(service_options, tokenizer->get(), &loop, &metrics);

  GrpcServerOptions server_options;
  server_options.address = absl::GetFlag(FLAGS_address);
  server_options.services = {&service};
  server_options.health_service_names = {v1::Generation::service_full_name()};
  server_options.credentials = *server_credentials;
  server_options.reflection = absl::GetFlag(FLAGS_reflection);
  absl::StatusOr<std::unique_ptr<GrpcServer>> server = GrpcServer::Start(server_options);
  if (!server.ok()) return Fail(absl::StrCat("--address: ", server.status().ToString()));
  server_ptr = server->get();
  (*server)->SetServing(serving.load());

  MetricsServerOptions metrics_options;
  // Metrics listen where the gRPC API listens (loopback stays loopback).
  absl::StatusOr<HostPort> api = ParseHostPort(server_options.address, "--address");
  if (api.ok() && !api->host.empty()) metrics_options.host = api->host;
  metrics_options.port = absl::GetFlag(FLAGS_metrics_port);
  if (const std::string address = absl::GetFlag(FLAGS_metrics_address); !address.empty()) {
    absl::StatusOr<HostPort> hp = ParseHostPort(address, "--metrics_address");
    if (!hp.ok()) return Fail(std::string(hp.status().message()));
    metrics_options.host = hp->host.empty() ? "0.0.0.0" : hp->host;
    metrics_options.port = hp->port;
  }
  const MetricLabels model_label = {{"model", ModelLabel(model_dir)}};
  metrics_options.service_labels = [model_label] { return model_label; };
  absl::StatusOr<std::unique_ptr<MetricsServer>> metrics_server =
      MetricsServer::Start(metrics_options, registry, [&] { return serving.load(); });
  if (!metrics_server.ok()) {
    return Fail(absl::StrCat("--metrics_port: ", metrics_server.status().ToString()));
  }

  loop.Start();
  SPECD_LOG(INFO) << "specd-router: gRPC on port " << (*server)->port() << ", metrics on port "
                  << (*metrics_server)->port() << "; model " << model_dir << ", verify "
                  << absl::StrJoin(pool_options.verify_addresses, ",") << ", draft "
                  << (pool_options.draft_addresses.empty()
                          ? "(none)"
                          : absl::StrJoin(pool_options.draft_addresses, ","));

  WatchTerminationSignals().WaitForNotification();
  SPECD_LOG(INFO) << "specd-router: signal " << TerminationSignal() << ", shutting down";
  // Drain: NOT_SERVING at once (load balancers and readiness probes stop sending), new
  // Generate calls get UNAVAILABLE (clients retry elsewhere), running streams may finish.
  draining = true;
  serving = false;
  server_ptr = nullptr;
  (*server)->SetServing(false);
  service.BeginDrain();
  const absl::Time drain_end = absl::Now() + absl::Seconds(grace_seconds);
  while (service.OpenGenerateStreams() > 0 && absl::Now() < drain_end) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  if (const int left = service.OpenGenerateStreams(); left > 0) {
    SPECD_LOG(WARNING) << "specd-router: " << left << " stream(s) still running after "
                       << grace_seconds << " s; cancelling them";
  }
  // Stopping the scheduler ends every stream still open. Once their last chunks are written
  // (up to 2 s for slow readers), shut the server down at once: gRPC's graceful shutdown would
  // otherwise also wait its whole deadline for idle client connections.
  loop.Stop();
  (*server)->DrainAndShutdown([&] { return service.OpenGenerateStreams(); }, absl::Seconds(2));
  (*metrics_server)->Stop();
  return 0;
}

}  // namespace
}  // namespace specd

int main(int argc, char** argv) {
  // Before any thread starts, so a signal during startup is not lost.
  specd::WatchTerminationSignals();
  specd::SetUsageAndHelpFilter(
      "specd-router --model DIR --verify_address HOST:PORT [--draft_address HOST:PORT] "
      "[--tls_cert FILE --tls_key FILE] [--token_file FILE]");
  specd::AcceptDashedFlagNames(argc, argv);
  absl::ParseCommandLine(argc, argv);
  return specd::Main();
}
