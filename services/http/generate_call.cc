#include "services/http/generate_call.h"

#include <algorithm>
#include <utility>

namespace specd {

GenerateCall::GenerateCall(v1::Generation::Stub* stub, v1::GenerateRequest request,
                           absl::Time deadline)
    : request_(std::move(request)) {
  if (deadline != absl::InfiniteFuture()) context_.set_deadline(absl::ToChronoTime(deadline));
  stub->async()->Generate(&context_, &request_, this);
  StartRead(&incoming_);
  StartCall();
}

GenerateCall::~GenerateCall() {
  absl::MutexLock lock(&mu_);
  // After the last chunk only the OK status is still to come; cancelling then could make the
  // router count a finished request as cancelled.
  if (!done_ && !saw_last_) context_.TryCancel();
  // gRPC may still call OnReadDone/OnDone until OnDone has run; the object must outlive that.
  mu_.Await(absl::Condition(&done_));
}

void GenerateCall::OnReadDone(bool ok) {
  // !ok: the stream ended (or failed); OnDone follows with the status.
  if (!ok) return;
  {
    absl::MutexLock lock(&mu_);
    // With n samples, each ends with a chunk of its own that carries a finish reason.
    if (incoming_.finish_reason() != v1::FINISH_REASON_UNSPECIFIED &&
        ++finished_samples_ >= std::max<uint32_t>(1, request_.n())) {
      saw_last_ = true;
    }
    queue_.push_back(std::move(incoming_));
  }
  incoming_.Clear();
  StartRead(&incoming_);
}

void GenerateCall::OnDone(const grpc::Status& status) {
  absl::MutexLock lock(&mu_);
  status_ = status;
  done_ = true;
}

GenerateCall::Event GenerateCall::Next(absl::Duration timeout, v1::GenerateResponse* chunk) {
  absl::MutexLock lock(&mu_);
  // Called by the mutex with mu_ held.
  auto ready = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return !queue_.empty() || done_; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&ready), timeout)) return Event::kTimeout;
  if (!queue_.empty()) {
    *chunk = std::move(queue_.front());
    queue_.pop_front();
    return Event::kChunk;
  }
  return Event::kDone;
}

grpc::Status GenerateCall::status() {
  absl::MutexLock lock(&mu_);
  return status_;
}

}  // namespace specd
