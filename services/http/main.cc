// specd-http: an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
// /tokenize, /detokenize, /version, /health, /metrics) in front of specd-router's gRPC
// Generation API. docs/http.md has examples.
//
//   specd-http --address 0.0.0.0:8000 --router 127.0.0.1:50050 [--model_dir models/target]
//       [--chat_template FILE]
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "common/flag_names.h"
#include "common/logging.h"
#include "common/service/grpc_util.h"
#include "common/service/metrics.h"
#include "common/service/tls_options.h"
#include "common/signals.h"
#include "services/http/chat_template.h"
#include "services/http/openai_server.h"

ABSL_FLAG(std::string, address, "0.0.0.0:8000", "host:port of the HTTP API");
ABSL_FLAG(std::string, router, "127.0.0.1:50050", "host:port of specd-router's gRPC API");
ABSL_FLAG(std::string, model_name, "",
          "model name /v1/models reports and requests may give; empty = the last path "
          "component of the router's GetModelInfo target_model");
ABSL_FLAG(std::string, model_dir, "",
          "Hugging Face folder of the served model; its chat template (chat_template.jinja, or "
          "tokenizer_config.json's chat_template) and special tokens (bos_token, eos_token...) "
          "are read from it. Without a template, chat requests are refused");
ABSL_FLAG(std::string, chat_template, "",
          "a file with the Jinja chat template to use instead of the model's own");
ABSL_FLAG(int, metrics_port, -1,
          "serve /metrics and /health on this port too (0 = pick a free one); -1 = only on "
          "--address, next to the API");
ABSL_FLAG(int, request_timeout_ms, 0,
          "deadline of each generation, passed to the router (0 = none)");
ABSL_FLAG(int, threads, 512,
          "HTTP connections served at once, one thread each (a stream holds one); more are "
          "answered 503");
ABSL_FLAG(int, request_read_timeout_ms, 10000,
          "a client must send each whole request (headers and body) within this, from its "
          "first byte; slower connections are closed");
ABSL_FLAG(int, default_max_tokens, 16,
          "max_tokens of /v1/completions requests that give none (OpenAI's default is 16); "
          "chat requests default to the router's --default_max_new_tokens");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain: serve HTTPS (with --tls_key). Read again (with the key and "
          "--tls_client_ca) when the files change and on SIGHUP, for new connections");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: require HTTPS clients to present a certificate it signed");
ABSL_FLAG(std::string, token_file, "",
          "file with the API keys accepted as \"Authorization: Bearer <key>\", one per line "
          "(like vLLM's --api-key); set: other requests get 401, /health and /metrics stay "
          "open. Read again when it changes and on SIGHUP");
ABSL_FLAG(std::string, router_tls_ca, "",
          "PEM CA bundle that signs the router's certificate: reach the router over TLS");
ABSL_FLAG(std::string, router_tls_cert, "",
          "PEM client certificate for a router that requires one (with --router_tls_key)");
ABSL_FLAG(std::string, router_tls_key, "", "PEM private key of --router_tls_cert");
ABSL_FLAG(std::string, router_token_file, "",
          "file whose first token is sent to the router as \"authorization: Bearer <token>\"");

namespace specd {
namespace {

int Fail(const std::string& message) {
  SPECD_LOG(ERROR) << message;
  return 1;
}

int Main() {
  OpenAiServerOptions options;
  absl::StatusOr<HostPort> address = ParseHostPort(absl::GetFlag(FLAGS_address), "--address");
  if (!address.ok()) return Fail(address.status().ToString());
  options.host = address->host.empty() ? "0.0.0.0" : address->host;
  options.port = address->port;
  options.router_address = absl::GetFlag(FLAGS_router);
  if (absl::StatusOr<HostPort> r = ParseHostPort(options.router_address, "--router"); !r.ok()) {
    return Fail(r.status().ToString());
  }
  options.model_name = absl::GetFlag(FLAGS_model_name);
  {
    absl::StatusOr<std::optional<ChatTemplate>> chat_template =
        ChatTemplate::Load(absl::GetFlag(FLAGS_model_dir), absl::GetFlag(FLAGS_chat_template));
    if (!chat_template.ok()) {
      return Fail(
          absl::StrCat("--model_dir / --chat_template: ", chat_template.status().ToString()));
    }
    if (chat_template->has_value()) {
      options.chat_template = std::make_shared<const ChatTemplate>(**std::move(chat_template));
    }
  }
  options.tls = {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                 absl::GetFlag(FLAGS_tls_client_ca)};
  if (absl::Status s = CheckServerTlsFiles(options.tls, "--tls_"); !s.ok()) {
    return Fail(std::string(s.message()));
  }
  std::unique_ptr<BearerTokens> tokens;
  if (const std::string path = absl::GetFlag(FLAGS_token_file); !path.empty()) {
    absl::StatusOr<std::unique_ptr<BearerTokens>> t = BearerTokens::Load(path, "--token_file");
    if (!t.ok()) return Fail(std::string(t.status().message()));
    tokens = *std::move(t);
    options.tokens = tokens.get();
  }
  {
    absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> router_credentials =
        MakeChannelCredentials(
            {absl::GetFlag(FLAGS_router_tls_ca), absl::GetFlag(FLAGS_router_tls_cert),
             absl::GetFlag(FLAGS_router_tls_key)},
            "--router_tls_");
    if (!router_credentials.ok()) return Fail(std::string(router_credentials.status().message()));
    options.router_credentials = *std::move(router_credentials);
  }
  if (const std::string path = absl::GetFlag(FLAGS_router_token_file); !path.empty()) {
    absl::StatusOr<std::unique_ptr<BearerTokens>> t =
        BearerTokens::Load(path, "--router_token_file");
    if (!t.ok()) return Fail(std::string(t.status().message()));
    options.router_token = *std::move(t);
  }
  const int timeout_ms = absl::GetFlag(FLAGS_request_timeout_ms);
  if (timeout_ms < 0) return Fail("--request_timeout_ms: must be >= 0");
  options.request_timeout = absl::Milliseconds(timeout_ms);
  options.threads = absl::GetFlag(FLAGS_threads);
  if (options.threads < 1) return Fail("--threads: must be >= 1");
  const int read_timeout_ms = absl::GetFlag(FLAGS_request_read_timeout_ms);
  if (read_timeout_ms < 1) return Fail("--request_read_timeout_ms: must be >= 1");
  options.request_read_deadline = absl::Milliseconds(read_timeout_ms);
  const int default_max_tokens = absl::GetFlag(FLAGS_default_max_tokens);
  if (default_max_tokens < 1) return Fail("--default_max_tokens: must be >= 1");
  options.default_completion_max_tokens = static_cast<uint32_t>(default_max_tokens);
  const int metrics_port = absl::GetFlag(FLAGS_metrics_port);
  if (metrics_port < -1 || metrics_port > 65535) {
    return Fail("--metrics_port: -1 (off) or a port in [0, 65535]");
  }

  absl::StatusOr<std::unique_ptr<OpenAiServer>> server = OpenAiServer::Start(options);
  if (!server.ok()) return Fail(absl::StrCat("--address: ", server.status().ToString()));

  std::unique_ptr<MetricsServer> metrics_server;
  if (metrics_port >= 0) {
    MetricsServerOptions metrics_options;
    metrics_options.host = options.host;
    metrics_options.port = metrics_port;
    OpenAiServer* s = server->get();
    metrics_options.service_labels = [s] { return s->MetricLabelsNow(); };
    absl::StatusOr<std::unique_ptr<MetricsServer>> m = MetricsServer::Start(
        metrics_options, (*server)->registry(), [s] { return s->RouterServing(); });
    if (!m.ok()) return Fail(absl::StrCat("--metrics_port: ", m.status().ToString()));
    metrics_server = *std::move(m);
  }

  SPECD_LOG(INFO) << "specd-http: HTTP on " << options.host << ":" << (*server)->port()
                  << (metrics_server ? absl::StrCat(", metrics on port ", metrics_server->port())
                                     : std::string())
                  << "; router " << options.router_address << "; chat template "
                  << (options.chat_template ? options.chat_template->origin()
                                            : std::string("none (chat requests are refused)"));

  WatchTerminationSignals().WaitForNotification();
  SPECD_LOG(INFO) << "specd-http: signal " << TerminationSignal() << ", shutting down";
  (*server)->Stop();
  if (metrics_server) metrics_server->Stop();
  SPECD_LOG(INFO) << "specd-http: stopped";
  return 0;
}

}  // namespace
}  // namespace specd

int main(int argc, char** argv) {
  specd::WatchTerminationSignals();
  specd::SetUsageAndHelpFilter(
      "specd-http --address HOST:PORT --router HOST:PORT [--model_dir DIR] [--chat_template FILE] "
      "[--model_name NAME] [--tls_cert FILE --tls_key FILE] [--token_file FILE]");
  specd::AcceptDashedFlagNames(argc, argv);
  absl::ParseCommandLine(argc, argv);
  return specd::Main();
}
