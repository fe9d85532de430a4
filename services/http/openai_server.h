// specd's OpenAI-compatible HTTP edge: a gRPC client of specd-router's Generation API behind a
// cpp-httplib server.
//
//   POST /v1/completions, POST /v1/chat/completions  (JSON, or SSE with "stream": true)
//   POST /tokenize, POST /detokenize, GET /version (vLLM's utility endpoints)
//   GET  /v1/models, GET /v1/models/{id}, GET /health, GET /metrics
//
// Each HTTP connection is served by a thread of its own up to a cap (GuardedHttpServer; a
// stream holds its connection until it ends), over plaintext or HTTPS alike, and each request
// makes one Generate call on the router. The edge keeps no model
// state, so it is scaled and restarted independently of the router. docs/http.md is the user's
// reference; services/http/openai_protocol.h holds the translation rules.
#ifndef SPECD_SERVICES_HTTP_OPENAI_SERVER_H_
#define SPECD_SERVICES_HTTP_OPENAI_SERVER_H_

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/service/metrics.h"
#include "common/service/tls_options.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "services/http/chat_template.h"
#include "services/http/openai_protocol.h"
#include "services/http/tokenize_protocol.h"
#include "specd/v1/generation.grpc.pb.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace specd {

class GenerateCall;

struct OpenAiServerOptions {
  std::string host = "0.0.0.0";
  int port = 8000;             // 0: pick a free port; OpenAiServer::port() tells which
  std::string router_address;  // "host:port" of specd-router's Generation API
  // Reported by /v1/models and accepted in requests' "model". Empty: the last path component of
  // the router's GetModelInfo target_model, fetched on first use.
  std::string model_name;
  // The served model's chat template (null: chat requests are refused with a 400 saying so).
  std::shared_ptr<const ChatTemplate> chat_template;
  // Deadline of each Generate call (propagated by the router to the services); 0 = none.
  absl::Duration request_timeout = absl::ZeroDuration();
  // Connections served at once, one thread each (a stream holds one); more get a 503.
  int threads = 512;
  // A client must send each whole request (head and body) within this, from its first byte.
  absl::Duration request_read_deadline = absl::Seconds(10);
  size_t max_body_bytes = 8 << 20;
  // A streaming response sends an SSE comment after this long without tokens.
  absl::Duration keepalive_interval = absl::Seconds(10);
  uint32_t default_completion_max_tokens = 16;
  // HTTPS when tls.cert is set (tls.client_ca: clients must present a certificate it signed).
  // The files are read again on SIGHUP and when they change; new connections get the new
  // certificate, open ones keep theirs.
  ServerTlsFiles tls;
  // Set: every route but /health and /metrics needs "Authorization: Bearer <token>" (401
  // otherwise). Not owned; must outlive the server.
  BearerTokens* tokens = nullptr;
  // How the edge reaches the router: TLS credentials (null: plaintext) and the token it sends.
  std::shared_ptr<grpc::ChannelCredentials> router_credentials;
  std::shared_ptr<BearerTokens> router_token;
};

class OpenAiServer {
 public:
  // Binds and starts serving from its own threads. Does not wait for the router: /health says
  // 503 and generation requests fail with 503 until it answers.
  static absl::StatusOr<std::unique_ptr<OpenAiServer>> Start(const OpenAiServerOptions& options);

  ~OpenAiServer();
  OpenAiServer(const OpenAiServer&) = delete;
  OpenAiServer& operator=(const OpenAiServer&) = delete;

  int port() const { return port_; }
  std::shared_ptr<prometheus::Registry> registry() { return registry_; }

  // grpc.health.v1 of the router's Generation service says SERVING (1 s deadline).
  bool RouterServing();
  // The `model` label of every specd_ metric this server exports: the served model's name (empty
  // until the router has answered GetModelInfo).
  MetricLabels MetricLabelsNow() { return {{"model", CurrentProtocolOptions().model_name}}; }

  // Cancels running generations (their clients get an error event or a 503), stops listening
  // and joins the threads; idempotent.
  void Stop();

 private:
  explicit OpenAiServer(const OpenAiServerOptions& options);

  void HandleGenerate(Endpoint endpoint, const httplib::Request& req, httplib::Response& res);
  void HandleModels(httplib::Response& res);
  void HandleModel(const std::string& id, httplib::Response& res);
  void HandleTokenize(const httplib::Request& req, httplib::Response& res);
  void HandleDetokenize(const httplib::Request& req, httplib::Response& res);
  void HandleVersion(httplib::Response& res);
  // The router's Tokenize, under the request deadline (and at most kUtilityTimeout).
  absl::StatusOr<std::vector<int32_t>> Tokenize(const std::string& text, bool add_special_tokens);
  // Sends 503 and returns false when the router has not told the model's name yet.
  bool HaveModel(const ProtocolOptions& protocol, httplib::Response& res);
  void HandleHealth(httplib::Response& res);
  void HandleMetrics(httplib::Response& res);
  void SendError(const ApiError& error, httplib::Response& res);
  // Counts a finished HTTP request (called by httplib's logger after the response is written).
  void CountRequest(const httplib::Request& req, const httplib::Response& res);

  // The model name and the names a request may use for it; empty name when the router has not
  // answered GetModelInfo yet.
  ProtocolOptions CurrentProtocolOptions();
  // Asks the router's GetModelInfo now and keeps the answer (the model endpoints call it on
  // every request: the speculation modes follow the draft service's state).
  ProtocolOptions RefreshModelInfo();
  absl::Time Deadline() const;

  const OpenAiServerOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Generation::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_stub_;

  absl::Mutex model_mu_;
  std::string model_name_ ABSL_GUARDED_BY(model_mu_);
  std::vector<std::string> model_aliases_ ABSL_GUARDED_BY(model_mu_);
  uint32_t max_context_ ABSL_GUARDED_BY(model_mu_) = 0;
  ModelFeatures model_features_ ABSL_GUARDED_BY(model_mu_);

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* requests_ = nullptr;
  prometheus::Family<prometheus::Gauge>* in_flight_ = nullptr;
  prometheus::Family<prometheus::Histogram>* duration_ = nullptr;
  prometheus::Counter* stream_disconnects_ = nullptr;

  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;
  std::atomic<bool> listen_returned_{false};
  std::atomic<bool> stopping_{false};
  int port_ = 0;

  // Running Generate calls, so Stop() can cancel them.
  absl::Mutex calls_mu_;
  absl::flat_hash_set<GenerateCall*> calls_ ABSL_GUARDED_BY(calls_mu_);
};

}  // namespace specd

#endif  // SPECD_SERVICES_HTTP_OPENAI_SERVER_H_
