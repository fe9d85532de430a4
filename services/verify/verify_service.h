// The gRPC face of specd-verify (specd.v1.Verifier): one StepStreamReactor per Step stream,
// feeding the VerifyLoop's queue, and GetInfo. Holds no model state of its own.
#ifndef SPECD_SERVICES_VERIFY_VERIFY_SERVICE_H_
#define SPECD_SERVICES_VERIFY_VERIFY_SERVICE_H_

#include "common/service/model_step_service.h"
#include "specd/v1/verify.grpc.pb.h"

namespace specd {

using VerifyService =
    ModelStepService<v1::Verifier::CallbackService, v1::VerifyStepRequest,
                     v1::VerifyStepResponse, v1::VerifyInfoRequest, v1::VerifyInfo>;

}  // namespace specd

#endif  // SPECD_SERVICES_VERIFY_VERIFY_SERVICE_H_
