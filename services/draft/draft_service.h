// The gRPC face of specd-draft (specd.v1.Drafter): one StepStreamReactor per Step stream,
// feeding the DraftLoop's queue, and GetInfo. Holds no model state of its own.
#ifndef SPECD_SERVICES_DRAFT_DRAFT_SERVICE_H_
#define SPECD_SERVICES_DRAFT_DRAFT_SERVICE_H_

#include "common/service/model_step_service.h"
#include "specd/v1/draft.grpc.pb.h"

namespace specd {

using DraftService =
    ModelStepService<v1::Drafter::CallbackService, v1::DraftStepRequest, v1::DraftStepResponse,
                     v1::DraftInfoRequest, v1::DraftInfo>;

}  // namespace specd

#endif  // SPECD_SERVICES_DRAFT_DRAFT_SERVICE_H_
