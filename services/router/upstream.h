// The router's connection to one internal service (draft or verify): one long-lived
// bidirectional Step stream, one request message and one reply per speculation step, plus a
// background thread that (re)connects with exponential backoff.
//
// "Up" means: GetInfo answered (the service has loaded its model), no step has failed since and
// the connection has not gone away. A failed step tears the stream down and marks the upstream
// down; so does the channel leaving READY while up (a service that stops gracefully sends
// GOAWAY), which is seen at once even when no step is running. The connector thread then probes
// GetInfo with backoff and, once it answers, the next step opens a fresh stream. Each time the
// upstream comes up, epoch() increases: the service keeps sequence state per stream, so state
// held under an older epoch is gone, and a stream of an older epoch is never used again (the
// first request after a restart must not die on the stream the old process closed). While the
// service drains, the stream of the current epoch still carries the steps of running sequences.
#ifndef SPECD_SERVICES_ROUTER_UPSTREAM_H_
#define SPECD_SERVICES_ROUTER_UPSTREAM_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/service/grpc_util.h"
#include "grpcpp/grpcpp.h"

namespace specd {

struct UpstreamOptions {
  std::string name;     // "draft" or "verify", for logs and errors
  std::string address;  // host:port
  absl::Duration probe_timeout = absl::Seconds(2);
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(5);
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // null: plaintext
  // With TLS: the name the service's certificate is checked against when it is not the
  // address's host (an address resolved from a DNS name is checked against that name).
  std::string tls_name;
};

// `Service` is a generated gRPC service (v1::Drafter, v1::Verifier) with
//   rpc Step(stream StepReq) returns (stream StepResp);  rpc GetInfo(InfoReq) returns (Info);
template <typename Service, typename StepReq, typename StepResp, typename InfoReq, typename Info>
class Upstream {
 public:
  // `check` vets a fresh GetInfo answer (e.g. the vocabulary matches the router's); an error
  // keeps the upstream down and is logged. `on_change` is called with the new state whenever
  // the upstream goes up or down (from the connector or the stepping thread).
  Upstream(UpstreamOptions options, std::function<absl::Status(const Info&)> check,
           std::function<void(bool up)> on_change)
      : options_(std::move(options)),
        check_(std::move(check)),
        on_change_(std::move(on_change)),
        channel_(CreateChannel(options_)),
        stub_(Service::NewStub(channel_)) {}

  ~Upstream() { Stop(); }

  void Start() {
    connector_ = std::thread([this] { ConnectLoop(); });
  }

  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    if (connector_.joinable()) connector_.join();
    CloseStream(/*cancel=*/true);
  }

  const std::string& address() const { return options_.address; }

  bool up() const {
    absl::MutexLock lock(&mu_);
    return up_;
  }
  uint64_t epoch() const {
    absl::MutexLock lock(&mu_);
    return epoch_;
  }
  Info info() const {
    absl::MutexLock lock(&mu_);
    return info_;
  }

  // One step: writes `request` and reads its reply, on the stream of `epoch` (the epoch() the
  // caller built the request for: which sequences the service holds). Called from one thread
  // only. On failure the upstream is down and the error is UNAVAILABLE naming the service and
  // the cause.
  absl::Status RoundTrip(const StepReq& request, StepResp* response, uint64_t epoch) {
    uint64_t current;
    bool up;
    {
      absl::MutexLock lock(&mu_);
      current = epoch_;
      up = up_;
    }
    if (stream_ != nullptr && stream_epoch_ != current) CloseStream(/*cancel=*/true);
    if (epoch != current || (stream_ == nullptr && !up)) {
      return absl::UnavailableError(
          absl::StrCat(options_.name, " service at ", options_.address, " is not connected"));
    }
    if (stream_ == nullptr) {
      context_ = std::make_unique<grpc::ClientContext>();
      stream_ = stub_->Step(context_.get());
      stream_epoch_ = current;
    }
    std::string cause;
    if (!stream_->Write(request)) {
      cause = "stream closed while sending";
    } else if (!stream_->Read(response)) {
      cause = "stream closed while receiving";
    } else if (response->step_id() != request.step_id()) {
      cause = absl::StrCat("reply to step ", response->step_id(), " where ", request.step_id(),
                           " was expected");
    } else {
      return absl::OkStatus();
    }
    const grpc::Status status = CloseStream(/*cancel=*/true);
    if (!status.ok()) absl::StrAppend(&cause, ": ", status.error_message());
    SetDown();
    return absl::UnavailableError(
        absl::StrCat(options_.name, " service at ", options_.address, " failed: ", cause));
  }

  // Half-closes the stream so the service frees the stream's sequences; for shutdown.
  void CloseGracefully() {
    if (stream_ != nullptr) {
      stream_->WritesDone();
      CloseStream(/*cancel=*/false);
    }
  }

 private:
  // The usual service channel, but gRPC's own reconnect backoff (1 s initial, growing to 120 s)
  // would hide a restarted service for longer than our probes' backoff: cap it at ours.
  static std::shared_ptr<grpc::Channel> CreateChannel(const UpstreamOptions& options) {
    grpc::ChannelArguments args = ServiceChannelArguments();
    const int initial_ms = static_cast<int>(absl::ToInt64Milliseconds(options.initial_backoff));
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, initial_ms);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, initial_ms);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
                static_cast<int>(absl::ToInt64Milliseconds(options.max_backoff)));
    // Leaving READY means the service went away; an idle timeout must not look like that.
    args.SetInt(GRPC_ARG_CLIENT_IDLE_TIMEOUT_MS, std::numeric_limits<int>::max());
    if (options.credentials && !options.tls_name.empty()) {
      args.SetSslTargetNameOverride(options.tls_name);
    }
    return grpc::CreateCustomChannel(
        options.address,
        options.credentials ? options.credentials : grpc::InsecureChannelCredentials(), args);
  }

  grpc::Status CloseStream(bool cancel) {
    grpc::Status status;
    if (stream_ != nullptr) {
      if (cancel) context_->TryCancel();
      status = stream_->Finish();
      stream_.reset();
      context_.reset();
    }
    return status;
  }

  void SetDown() {
    {
      absl::MutexLock lock(&mu_);
      if (!up_) return;
      up_ = false;
    }
    SPECD_LOG(WARNING) << options_.name << " service at " << options_.address
                       << " is down; reconnecting in the background";
    if (on_change_) on_change_(false);
  }

  // While up: returns once the upstream is down or stopping, marking it down when its channel
  // leaves READY (the service closed the connection, e.g. GOAWAY on a graceful stop).
  void WatchWhileUp() {
    grpc_connectivity_state state = channel_->GetState(/*try_to_connect=*/false);
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        if (stopping_ || !up_) return;
      }
      if (state != GRPC_CHANNEL_READY) {
        SPECD_LOG(WARNING) << options_.name << " service at " << options_.address
                           << " closed the connection";
        SetDown();
        return;
      }
      // Wakes on a state change, or after a short wait to look at stopping_ and up_ again.
      if (channel_->WaitForStateChange(state, absl::ToChronoTime(absl::Now() + kWatchPoll))) {
        state = channel_->GetState(/*try_to_connect=*/false);
      }
    }
  }

  void ConnectLoop() {
    absl::Duration backoff = options_.initial_backoff;
    std::string last_error;
    while (true) {
      WatchWhileUp();
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) return;
      }
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.probe_timeout));
      InfoReq req;
      Info info;
      const grpc::Status status = stub_->GetInfo(&ctx, req, &info);
      absl::Status ok = FromGrpcStatus(status);
      if (ok.ok() && check_) ok = check_(info);
      if (ok.ok()) {
        {
          absl::MutexLock lock(&mu_);
          info_ = info;
          up_ = true;
          ++epoch_;
        }
        SPECD_LOG(INFO) << options_.name << " service at " << options_.address << " is up";
        last_error.clear();
        backoff = options_.initial_backoff;
        if (on_change_) on_change_(true);
        continue;
      }
      if (ok.ToString() != last_error) {
        last_error = ok.ToString();
        SPECD_LOG(WARNING) << options_.name << " service at " << options_.address
                           << " not ready: " << last_error;
      }
      absl::MutexLock lock(&mu_);
      auto stopping = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
      mu_.AwaitWithTimeout(absl::Condition(&stopping), backoff);
      backoff = std::min(backoff * 2, options_.max_backoff);
    }
  }

  const UpstreamOptions options_;
  const std::function<absl::Status(const Info&)> check_;
  const std::function<void(bool)> on_change_;
  static constexpr absl::Duration kWatchPoll = absl::Milliseconds(200);

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<typename Service::Stub> stub_;

  mutable absl::Mutex mu_;
  bool up_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  Info info_ ABSL_GUARDED_BY(mu_);
  std::thread connector_;

  // Owned by the stepping thread.
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<StepReq, StepResp>> stream_;
  uint64_t stream_epoch_ = 0;
};

}  // namespace specd

#endif  // SPECD_SERVICES_ROUTER_UPSTREAM_H_
