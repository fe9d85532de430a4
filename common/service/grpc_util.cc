#include "common/service/grpc_util.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/impl/server_builder_plugin.h"

namespace specd {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

const char* SpeculationName(v1::Speculation mode) {
  switch (mode) {
    case v1::SPECULATION_OFF:
      return "off";
    case v1::SPECULATION_DRAFT_MODEL:
      return "draft_model";
    case v1::SPECULATION_NGRAM:
      return "ngram";
    case v1::SPECULATION_EAGLE3:
      return "eagle3";
    default:
      return "auto";
  }
}

const char* FinishReasonName(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_EOS:
      return "eos";
    case v1::FINISH_REASON_STOP_TOKEN:
      return "stop_token";
    case v1::FINISH_REASON_STOP_STRING:
      return "stop_string";
    case v1::FINISH_REASON_CONTEXT:
      return "context";
    default:
      return "unspecified";
  }
}

void ToSequenceError(const absl::Status& status, v1::SequenceError* error) {
  error->set_code(static_cast<int32_t>(status.code()));
  error->set_message(std::string(status.message()));
}

std::string ModelNameFromPath(absl::string_view dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.remove_suffix(1);
  const size_t slash = dir.rfind('/');
  return std::string(slash == absl::string_view::npos ? dir : dir.substr(slash + 1));
}

absl::StatusOr<HostPort> ParseHostPort(absl::string_view address, absl::string_view field) {
  HostPort out;
  absl::string_view port;
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos || close + 1 >= address.size() ||
        address[close + 1] != ':') {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": '", address, "' is not [ipv6]:port"));
    }
    out.host = std::string(address.substr(1, close - 1));
    port = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": '", address, "' has no port (want host:port)"));
    }
    out.host = std::string(address.substr(0, colon));
    if (out.host.find(':') != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": '", address, "': put IPv6 addresses in brackets, [::1]:port"));
    }
    port = address.substr(colon + 1);
  }
  if (!absl::SimpleAtoi(port, &out.port) || out.port < 0 || out.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": port '", port, "' is not a number in [0, 65535]"));
  }
  return out;
}

grpc::ChannelArguments ServiceChannelArguments() {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  return args;
}

std::shared_ptr<grpc::Channel> CreateServiceChannel(
    const std::string& address, std::shared_ptr<grpc::ChannelCredentials> credentials) {
  return grpc::CreateCustomChannel(address,
                                   credentials ? credentials : grpc::InsecureChannelCredentials(),
                                   ServiceChannelArguments());
}

namespace {

// Loading libgrpc++_reflection registers its plugin with every ServerBuilder (a static
// initializer), so reflection would be served wherever the library is linked; this takes the
// plugin out of a builder that should not serve it.
class WithoutReflection : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments* /*args*/) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(),
                                  [](const std::unique_ptr<grpc::ServerBuilderPlugin>& p) {
                                    return p->name() == "proto_server_reflection";
                                  }),
                   plugins->end());
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(const GrpcServerOptions& options) {
  absl::StatusOr<HostPort> hp = ParseHostPort(options.address);
  if (!hp.ok()) return hp.status();
  // Both are process-wide switches read when a builder is made, so set them first. gRPC's own
  // health service is off: it answers SERVING before SetServing(false) can reach it (see
  // common/service/health_service.h); ours is registered below.
  grpc::EnableDefaultHealthCheckService(false);
  if (options.reflection) grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  std::unique_ptr<GrpcServer> out(new GrpcServer());
  out->health_ = std::make_unique<HealthService>(options.health_service_names);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(
      options.address,
      options.credentials ? options.credentials : grpc::InsecureServerCredentials(), &out->port_);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             kServerMinPingIntervalMs);
  // gRPC enables SO_REUSEPORT by default: a second instance on the same port would then share
  // its connections instead of failing to start.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  if (!options.reflection) builder.SetOption(std::make_unique<WithoutReflection>());
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  for (grpc::Service* service : options.services) builder.RegisterService(service);
  builder.RegisterService(out->health_.get());
  out->server_ = builder.BuildAndStart();
  if (out->server_ == nullptr || out->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.address, " (address in use or not local?)"));
  }
  return out;
}

GrpcServer::~GrpcServer() { Shutdown(0); }

void GrpcServer::SetServing(bool serving) { health_->SetServing(serving); }

void GrpcServer::Shutdown(int grace_ms) {
  if (shut_down_ || server_ == nullptr) return;
  shut_down_ = true;
  // NOT_SERVING first, and open Watch streams end now instead of at the deadline.
  health_->Shutdown();
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(grace_ms));
  server_->Wait();
}

int64_t GrpcServer::DrainAndShutdown(const std::function<int64_t()>& in_flight,
                                     absl::Duration grace) {
  const absl::Time end = absl::Now() + grace;
  int64_t left = in_flight();
  while (left > 0 && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(10));
    left = in_flight();
  }
  Shutdown(0);
  return left;
}

}  // namespace specd
