// Checks a public GenerateRequest against the router's limits. Every error is
// INVALID_ARGUMENT with a message that starts with the offending field's name, so a client can
// tell exactly what to fix.
#ifndef SPECD_SERVICES_ROUTER_REQUEST_VALIDATION_H_
#define SPECD_SERVICES_ROUTER_REQUEST_VALIDATION_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "services/router/request.h"
#include "specd/v1/generation.pb.h"

namespace specd {

// Checks every field that does not need the tokenizer (sampling, limits, stop conditions, draft
// shape, speculation, and prompt_ids when given).
absl::Status ValidateGenerateRequest(const v1::GenerateRequest& request,
                                     const RequestLimits& limits);

// Checks the tokenized prompt: non-empty, ids inside the vocabulary, and at least one token of
// room left in the context. A request whose prompt fits but whose prompt + max_new_tokens does
// not is accepted; it ends with FINISH_REASON_CONTEXT when the context is full (the proto has a
// finish reason for that, and clients rarely know the exact prompt length in tokens).
absl::Status ValidatePrompt(absl::Span<const int32_t> prompt, const char* field,
                            const RequestLimits& limits);

// Builds the scheduler's request from a validated one; `random_seed` is used when the request
// samples without a seed. Does not fill prompt, arrival or deadline.
RouterRequest ResolveRequest(const v1::GenerateRequest& request, const RequestLimits& limits,
                             uint64_t random_seed);

}  // namespace specd

#endif  // SPECD_SERVICES_ROUTER_REQUEST_VALIDATION_H_
