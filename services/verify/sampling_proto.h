// The engine's sampling parameters and log-probabilities on the wire (specd.v1.SamplingParams
// in tree.proto, TokenLogprobs in verify.proto): what the verify service reads and a router
// writes, one copy for both.
#ifndef SPECD_SERVICES_VERIFY_SAMPLING_PROTO_H_
#define SPECD_SERVICES_VERIFY_SAMPLING_PROTO_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/sampling.h"
#include "specd/v1/tree.pb.h"
#include "specd/v1/verify.pb.h"

namespace specd {

// Reads and validates `proto`; errors are INVALID_ARGUMENT and start with the field's name
// (`top_p: 0 must be in (0, 1]`, `stop_token_ids[1]: ...`). Unset optional fields take their
// "off" value (top_p 1, repetition_penalty 1). With min_tokens, min_tokens_stop_ids becomes
// `eos_token_ids` (the target model's) followed by the request's stop_token_ids.
absl::Status SamplingFromProto(const v1::SamplingParams& proto,
                               absl::Span<const int32_t> eos_token_ids, int vocab_size,
                               SamplingParams* out);

// Writes `params` with the request's `stop_token_ids` (sent only with min_tokens; the EOS ids
// are the verify service's own). params.min_tokens_stop_ids is not written.
void SamplingToProto(const SamplingParams& params, absl::Span<const int32_t> stop_token_ids,
                     v1::SamplingParams* proto);

void LogprobsToProto(const TokenLogprobs& logprobs, v1::TokenLogprobs* proto);
TokenLogprobs LogprobsFromProto(const v1::TokenLogprobs& proto);

}  // namespace specd

#endif  // SPECD_SERVICES_VERIFY_SAMPLING_PROTO_H_
