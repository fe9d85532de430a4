// Between the SDK's plain types (specd/types.h) and the specd.v1 messages.
#ifndef SPECD_CLIENTS_CPP_SRC_CONVERT_H_
#define SPECD_CLIENTS_CPP_SRC_CONVERT_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/support/status.h"
#include "specd/types.h"
#include "specd/v1/generation.pb.h"

namespace specd {
namespace client_internal {

// INVALID_ARGUMENT naming the field for what the client can tell is wrong without asking the
// router (both prompt and prompt_ids); the router checks the rest.
absl::StatusOr<v1::GenerateRequest> ToProto(const GenerateRequest& request);

Chunk FromProto(const v1::GenerateResponse& response);
ModelInfo FromProto(const v1::ModelInfo& info);

// Same code, same message (the two share the google.rpc.Code numbering).
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace client_internal
}  // namespace specd

#endif  // SPECD_CLIENTS_CPP_SRC_CONVERT_H_
