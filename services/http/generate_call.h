// One Generate call on the router, consumed by one HTTP worker thread.
//
// The gRPC side runs on the callback API (its reactor never blocks: it only queues chunks); the
// HTTP thread waits on the queue with a timeout. The timeout is what lets a streaming response
// send SSE keep-alive comments while the router is quiet (queueing, long prefill), and a failed
// write of one of those is how a client that went away is noticed between tokens.
#ifndef SPECD_SERVICES_HTTP_GENERATE_CALL_H_
#define SPECD_SERVICES_HTTP_GENERATE_CALL_H_

#include <deque>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "specd/v1/generation.grpc.pb.h"

namespace specd {

class GenerateCall final : public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  // Starts the call. `deadline` absl::InfiniteFuture() = none. `stub` must outlive the call.
  GenerateCall(v1::Generation::Stub* stub, v1::GenerateRequest request, absl::Time deadline);

  // Cancels the call if it has not delivered its last chunk, and waits for gRPC to finish
  // with it.
  ~GenerateCall() override;

  GenerateCall(const GenerateCall&) = delete;
  GenerateCall& operator=(const GenerateCall&) = delete;

  enum class Event { kChunk, kDone, kTimeout };

  // Waits up to `timeout` for the next chunk (kChunk, moved into `chunk`) or for the end of the
  // call after the last chunk (kDone; see status()).
  Event Next(absl::Duration timeout, v1::GenerateResponse* chunk);

  // The call's final status; valid once Next() returned kDone.
  grpc::Status status();

  // Cancels the call: the router sees CANCELLED and frees the sequence. Safe to call any time,
  // from any thread, more than once.
  void Cancel() { context_.TryCancel(); }

 private:
  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

  grpc::ClientContext context_;
  const v1::GenerateRequest request_;
  v1::GenerateResponse incoming_;  // written by gRPC between StartRead and OnReadDone

  absl::Mutex mu_;
  std::deque<v1::GenerateResponse> queue_ ABSL_GUARDED_BY(mu_);
  uint32_t finished_samples_ ABSL_GUARDED_BY(mu_) = 0;
  bool saw_last_ ABSL_GUARDED_BY(mu_) = false;  // every sample's last chunk arrived
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace specd

#endif  // SPECD_SERVICES_HTTP_GENERATE_CALL_H_
