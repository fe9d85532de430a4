#include "common/service/hidden_states_proto.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/io/safetensors.h"

namespace specd {

void HiddenStatesToProto(absl::Span<const float> rows, int64_t tokens, int64_t width,
                         absl::Span<const int> layers, int64_t first_position,
                         v1::TensorDtype dtype, v1::HiddenStates* proto) {
  proto->Clear();
  proto->set_first_position(first_position);
  proto->set_tokens(static_cast<uint32_t>(tokens));
  proto->set_width(static_cast<uint32_t>(width));
  proto->mutable_layers()->Assign(layers.begin(), layers.end());
  proto->set_dtype(dtype);
  const size_t n = static_cast<size_t>(tokens * width);
  std::string* data = proto->mutable_data();
  if (dtype == v1::TENSOR_DTYPE_FP32) {
    // The hosts specd builds for are little-endian, as the wire format is.
    data->resize(n * sizeof(float));
    std::memcpy(data->data(), rows.data(), n * sizeof(float));
    return;
  }
  data->resize(n * sizeof(uint16_t));
  char* out = data->data();
  for (size_t i = 0; i < n; ++i) {
    const uint16_t v = F32ToBF16(rows[i]);
    std::memcpy(out + i * sizeof(uint16_t), &v, sizeof(uint16_t));
  }
}

absl::Status HiddenStatesFromProto(const v1::HiddenStates& proto, int64_t want_width,
                                   const std::string& where, std::vector<float>* rows) {
  const int64_t tokens = proto.tokens(), width = proto.width();
  if (proto.first_position() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".first_position: ", proto.first_position(), " is negative"));
  }
  if (tokens > 0 && want_width > 0 && width != want_width) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".width: ", width, ", expected ",
                                                   want_width, " (the head's feature size)"));
  }
  size_t element = 0;
  switch (proto.dtype()) {
    case v1::TENSOR_DTYPE_BF16:
      element = sizeof(uint16_t);
      break;
    case v1::TENSOR_DTYPE_FP32:
      element = sizeof(float);
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".dtype: unknown value ", static_cast<int>(proto.dtype())));
  }
  const size_t n = static_cast<size_t>(tokens) * static_cast<size_t>(width);
  if (proto.data().size() != n * element) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".data: ", proto.data().size(),
                                                   " bytes, expected tokens x width x ", element,
                                                   " = ", n * element));
  }
  rows->resize(n);
  const char* in = proto.data().data();
  if (element == sizeof(float)) {
    std::memcpy(rows->data(), in, n * sizeof(float));
  } else {
    for (size_t i = 0; i < n; ++i) {
      uint16_t v;
      std::memcpy(&v, in + i * sizeof(uint16_t), sizeof(uint16_t));
      (*rows)[i] = BF16ToF32(v);
    }
  }
  return absl::OkStatus();
}

void AppendHiddenStates(const v1::HiddenStates& next, v1::HiddenStates* acc) {
  if (next.tokens() == 0) return;
  const bool contiguous =
      acc->tokens() > 0 && acc->first_position() + acc->tokens() == next.first_position() &&
      acc->width() == next.width() && acc->dtype() == next.dtype() &&
      acc->layers_size() == next.layers_size() &&
      std::equal(acc->layers().begin(), acc->layers().end(), next.layers().begin());
  if (!contiguous) {
    *acc = next;
    return;
  }
  acc->set_tokens(acc->tokens() + next.tokens());
  acc->mutable_data()->append(next.data());
}

}  // namespace specd
