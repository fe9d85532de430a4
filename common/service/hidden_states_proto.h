// specd.v1.HiddenStates (the EAGLE taps on the wire) to and from fp32 rows on the host, and the
// router's appending of consecutive chunks. The one conversion the verify service, the router
// and the draft service share.
#ifndef SPECD_COMMON_SERVICE_HIDDEN_STATES_PROTO_H_
#define SPECD_COMMON_SERVICE_HIDDEN_STATES_PROTO_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "specd/v1/tree.pb.h"

namespace specd {

// Fills `proto` with `rows` ([tokens, width] fp32, host) in `dtype` (bf16: round to nearest
// even; fp32: the bits as they are).
void HiddenStatesToProto(absl::Span<const float> rows, int64_t tokens, int64_t width,
                         absl::Span<const int> layers, int64_t first_position,
                         v1::TensorDtype dtype, v1::HiddenStates* proto);

// The rows of `proto` as fp32 ([tokens, width]). INVALID_ARGUMENT naming the field (`where` is
// its path, e.g. "steps[2].taps") when the sizes disagree, the dtype is unknown, the width is
// not `want_width` (when > 0) or first_position is negative.
absl::Status HiddenStatesFromProto(const v1::HiddenStates& proto, int64_t want_width,
                                   const std::string& where, std::vector<float>* rows);

// Appends `next` to `acc` when it starts where `acc` ends (same layers, width and dtype);
// otherwise `acc` becomes `next` (the older rows can no longer be used without a gap). An
// empty `acc` (tokens == 0) takes `next` as it is.
void AppendHiddenStates(const v1::HiddenStates& next, v1::HiddenStates* acc);

}  // namespace specd

#endif  // SPECD_COMMON_SERVICE_HIDDEN_STATES_PROTO_H_
