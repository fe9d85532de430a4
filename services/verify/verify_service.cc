#include "services/verify/verify_service.h"

namespace specd {

void VerifyService::SetInfo(const v1::VerifyInfo& info) {
  absl::MutexLock lock(&mu_);
  info_ = info;
  loaded_ = true;
}

grpc::ServerBidiReactor<v1::VerifyStepRequest, v1::VerifyStepResponse>* VerifyService::Step(
    grpc::CallbackServerContext* /*context*/) {
  return new StepStreamReactor<v1::VerifyStepRequest, v1::VerifyStepResponse>(queue_);
}

grpc::ServerUnaryReactor* VerifyService::GetInfo(grpc::CallbackServerContext* context,
                                                 const v1::VerifyInfoRequest* /*request*/,
                                                 v1::VerifyInfo* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  bool loaded;
  {
    absl::MutexLock lock(&mu_);
    loaded = loaded_;
    if (loaded) *response = info_;
  }
  reactor->Finish(loaded
                      ? grpc::Status::OK
                      : grpc::Status(grpc::StatusCode::UNAVAILABLE, "the model is still loading"));
  return reactor;
}

}  // namespace specd
