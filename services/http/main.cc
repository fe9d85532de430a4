// specd-http: an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
// /health, /metrics) in front of specd-router's gRPC Generation API. docs/http.md has examples.
//
//   specd-http --address 0.0.0.0:8000 --router 127.0.0.1:50050 [--model_dir models/target]
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "common/flag_names.h"
#include "common/service/grpc_util.h"
#include "common/logging.h"
#include "common/service/metrics.h"
#include "common/signals.h"
#include "services/http/chat_format.h"
#include "services/http/openai_server.h"

ABSL_FLAG(std::string, address, "0.0.0.0:8000", "host:port of the HTTP API");
ABSL_FLAG(std::string, router, "127.0.0.1:50050", "host:port of specd-router's gRPC API");
ABSL_FLAG(std::string, model_name, "",
          "model name /v1/models reports and requests may give; empty = the last path "
          "component of the router's GetModelInfo target_model");
ABSL_FLAG(std::string, model_dir, "",
          "optional Hugging Face folder of the served model; only its tokenizer_config.json is "
          "read, for the chat format (ChatML or Llama 3 when its chat_template is one of those, "
          "else plain \"role: content\" lines)");
ABSL_FLAG(int, metrics_port, -1,
          "serve /metrics and /health on this port too (0 = pick a free one); -1 = only on "
          "--address, next to the API");
ABSL_FLAG(int, request_timeout_ms, 0,
          "deadline of each generation, passed to the router (0 = none)");
ABSL_FLAG(int, threads, 64,
          "HTTP worker threads: the most requests served at once (a stream holds one)");
ABSL_FLAG(int, default_max_tokens, 16,
          "max_tokens of /v1/completions requests that give none (OpenAI's default is 16); "
          "chat requests default to the router's --default_max_new_tokens");

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
  if (const std::string dir = absl::GetFlag(FLAGS_model_dir); !dir.empty()) {
    absl::StatusOr<ChatFormat> format = ChatFormatFromModelDir(dir);
    if (!format.ok()) return Fail(absl::StrCat("--model_dir: ", format.status().ToString()));
    options.chat_format = *format;
  }
  const int timeout_ms = absl::GetFlag(FLAGS_request_timeout_ms);
  if (timeout_ms < 0) return Fail("--request_timeout_ms: must be >= 0");
  options.request_timeout = absl::Milliseconds(timeout_ms);
  options.threads = absl::GetFlag(FLAGS_threads);
  if (options.threads < 1) return Fail("--threads: must be >= 1");
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
    absl::StatusOr<std::unique_ptr<MetricsServer>> m = MetricsServer::Start(
        metrics_options, (*server)->registry(), [s] { return s->RouterServing(); });
    if (!m.ok()) return Fail(absl::StrCat("--metrics_port: ", m.status().ToString()));
    metrics_server = *std::move(m);
  }

  SPECD_LOG(INFO) << "specd-http: HTTP on " << options.host << ":" << (*server)->port()
                  << (metrics_server ? absl::StrCat(", metrics on port ", metrics_server->port())
                                     : std::string())
                  << "; router " << options.router_address << "; chat format "
                  << ChatFormatName(options.chat_format);

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
  absl::SetProgramUsageMessage(
      "specd-http --address HOST:PORT --router HOST:PORT [--model_dir DIR] [--model_name NAME]");
  specd::AcceptDashedFlagNames(argc, argv);
  absl::ParseCommandLine(argc, argv);
  return specd::Main();
}
