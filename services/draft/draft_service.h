// The gRPC face of specd-draft (specd.v1.Drafter): one StepStreamReactor per Step stream,
// feeding the DraftLoop's queue, and GetInfo. Holds no model state of its own.
#ifndef SPECD_SERVICES_DRAFT_DRAFT_SERVICE_H_
#define SPECD_SERVICES_DRAFT_DRAFT_SERVICE_H_

#include "absl/synchronization/mutex.h"
#include "common/step_stream.h"
#include "specd/v1/draft.grpc.pb.h"

namespace specd {

class DraftService final : public v1::Drafter::CallbackService {
 public:
  // `queue` must outlive the server this service is registered with.
  explicit DraftService(StepQueue<v1::DraftStepRequest, v1::DraftStepResponse>* queue)
      : queue_(queue) {}

  // Until called, GetInfo answers UNAVAILABLE (the model is still loading).
  void SetInfo(const v1::DraftInfo& info);

  grpc::ServerBidiReactor<v1::DraftStepRequest, v1::DraftStepResponse>* Step(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* context,
                                    const v1::DraftInfoRequest* request,
                                    v1::DraftInfo* response) override;

 private:
  StepQueue<v1::DraftStepRequest, v1::DraftStepResponse>* const queue_;
  absl::Mutex mu_;
  bool loaded_ ABSL_GUARDED_BY(mu_) = false;
  v1::DraftInfo info_ ABSL_GUARDED_BY(mu_);
};

}  // namespace specd

#endif  // SPECD_SERVICES_DRAFT_DRAFT_SERVICE_H_
