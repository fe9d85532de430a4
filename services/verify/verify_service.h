// The gRPC face of specd-verify (specd.v1.Verifier): one StepStreamReactor per Step stream,
// feeding the VerifyLoop's queue, and GetInfo. Holds no model state of its own.
#ifndef SPECD_SERVICES_VERIFY_VERIFY_SERVICE_H_
#define SPECD_SERVICES_VERIFY_VERIFY_SERVICE_H_

#include "absl/synchronization/mutex.h"
#include "common/step_stream.h"
#include "specd/v1/verify.grpc.pb.h"

namespace specd {

class VerifyService final : public v1::Verifier::CallbackService {
 public:
  // `queue` must outlive the server this service is registered with.
  explicit VerifyService(StepQueue<v1::VerifyStepRequest, v1::VerifyStepResponse>* queue)
      : queue_(queue) {}

  // Until called, GetInfo answers UNAVAILABLE (the model is still loading).
  void SetInfo(const v1::VerifyInfo& info);

  grpc::ServerBidiReactor<v1::VerifyStepRequest, v1::VerifyStepResponse>* Step(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* context,
                                    const v1::VerifyInfoRequest* request,
                                    v1::VerifyInfo* response) override;

 private:
  StepQueue<v1::VerifyStepRequest, v1::VerifyStepResponse>* const queue_;
  absl::Mutex mu_;
  bool loaded_ ABSL_GUARDED_BY(mu_) = false;
  v1::VerifyInfo info_ ABSL_GUARDED_BY(mu_);
};

}  // namespace specd

#endif  // SPECD_SERVICES_VERIFY_VERIFY_SERVICE_H_
