#include "services/draft/draft_service.h"

namespace specd {

void DraftService::SetInfo(const v1::DraftInfo& info) {
  absl::MutexLock lock(&mu_);
  info_ = info;
  loaded_ = true;
}

grpc::ServerBidiReactor<v1::DraftStepRequest, v1::DraftStepResponse>* DraftService::Step(
    grpc::CallbackServerContext* /*context*/) {
  return new StepStreamReactor<v1::DraftStepRequest, v1::DraftStepResponse>(queue_);
}

grpc::ServerUnaryReactor* DraftService::GetInfo(grpc::CallbackServerContext* context,
                                                const v1::DraftInfoRequest* /*request*/,
                                                v1::DraftInfo* response) {
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
