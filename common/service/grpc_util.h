// gRPC plumbing shared by the specd services and their clients: status mapping at the service
// edge, one way to build servers (health + reflection + keepalive), one way to make channels,
// and "host:port" parsing.
#ifndef SPECD_COMMON_SERVICE_GRPC_UTIL_H_
#define SPECD_COMMON_SERVICE_GRPC_UTIL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/service/health_service.h"
#include "grpcpp/grpcpp.h"
#include "specd/v1/generation.pb.h"
#include "specd/v1/tree.pb.h"

namespace specd {

// Same code, same message (absl::StatusCode and grpc::StatusCode share the google.rpc.Code
// numbering).
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

// A per-sequence error inside a batched reply (code and message of `status`, not OK).
void ToSequenceError(const absl::Status& status, v1::SequenceError* error);

// The wire name of a speculation mode, as the CLI and the HTTP edge print it: "off",
// "draft_model", "ngram", "eagle3", or "auto" (unspecified).
const char* SpeculationName(v1::Speculation mode);

// The name of a finish reason, as the SDKs, the HTTP edge and the metrics say it: "length",
// "eos", "stop_token", "stop_string", "context", or "unspecified".
const char* FinishReasonName(v1::FinishReason reason);

// The model name services report in GetInfo: the last component of the model folder's path.
std::string ModelNameFromPath(absl::string_view dir);

struct HostPort {
  std::string host;  // without brackets for IPv6 literals
  int port = 0;
};

// Parses "host:port", "[v6addr]:port" or ":port" (host empty). The port must be in
// [0, 65535]; errors name `field` (e.g. "--address").
absl::StatusOr<HostPort> ParseHostPort(absl::string_view address,
                                       absl::string_view field = "address");

// Keepalive, identical on servers and clients so neither side rejects the other's pings:
//   keepalive time 20 s, timeout 10 s, pings allowed without calls and without data, and
//   servers accept pings as often as every 10 s (less than the 20 s clients send at).
// Why: the router holds one long-lived stream per service. When a router dies without closing
// its TCP connection (host lost, kill -9 behind NAT), a service learns it within ~30 s, the
// stream fails and the service frees every sequence the stream created; in the other direction
// the router notices a dead draft service and falls back to target-only decoding.
inline constexpr int kKeepaliveTimeMs = 20000;
inline constexpr int kKeepaliveTimeoutMs = 10000;
inline constexpr int kServerMinPingIntervalMs = 10000;
// Batched steps carry whole prompts and, for EAGLE, hidden states.
inline constexpr int kMaxMessageBytes = 256 << 20;

// Channel arguments for clients of the specd services (keepalive, message size).
grpc::ChannelArguments ServiceChannelArguments();

// A channel to `address` ("host:port") with ServiceChannelArguments(); plaintext unless
// `credentials` is given (see common/service/tls_options.h).
std::shared_ptr<grpc::Channel> CreateServiceChannel(
    const std::string& address, std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr);

struct GrpcServerOptions {
  std::string address;                   // "host:port"; port 0 picks a free one
  std::vector<grpc::Service*> services;  // not owned; must outlive the server
  // Full names whose health status follows SetServing(), besides "" (the whole server), e.g.
  // specd::v1::Verifier::service_full_name().
  std::vector<std::string> health_service_names;
  // Null: plaintext. See MakeServerCredentials() in common/service/tls_options.h.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // Serve grpc.reflection (lets anyone who reaches the port list and describe its API).
  // Process-wide once on: gRPC's reflection plugin applies to every server built after it.
  bool reflection = false;
};

// A started server with the grpc.health.v1 health service (common/service/health_service.h) and,
// when asked, server reflection. Health answers NOT_SERVING from its first call; call
// SetServing(true) once the model is loaded.
class GrpcServer {
 public:
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(const GrpcServerOptions& options);

  ~GrpcServer();

  int port() const { return port_; }
  grpc::Server* server() { return server_.get(); }

  // Sets the health status of "" and of every name in options.health_service_names.
  void SetServing(bool serving);

  // Stops accepting calls, lets running calls end for up to `grace_ms`, then cancels them.
  void Shutdown(int grace_ms);

  // Drains, then shuts down at once: polls `in_flight` (every 10 ms) until it returns 0 or
  // `grace` has passed, then Shutdown(0). A stopping service counts the work it lets finish
  // (running sequences, open Generate streams); whatever else is open -- idle streams and
  // connections -- would otherwise hold a graceful shutdown to its deadline. Returns in_flight's
  // last value: the work cut off.
  int64_t DrainAndShutdown(const std::function<int64_t()>& in_flight, absl::Duration grace);

 private:
  GrpcServer() = default;

  // Declared before server_ so that it outlives the server's calls into it.
  std::unique_ptr<HealthService> health_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  bool shut_down_ = false;
};

}  // namespace specd

#endif  // SPECD_COMMON_SERVICE_GRPC_UTIL_H_
