// libFuzzer: the router's public request validation on GenerateRequest wire bytes, as a
// request reaches it: parsed strictly, or on failure marked by the lenient parser that names
// the offending field (common/service/lenient_parse.h). Whatever validation accepts must
// resolve to a request the router can schedule.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/service/lenient_parse.h"
#include "common/token_tree.h"
#include "services/router/request_validation.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  specd::v1::GenerateRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) {
    specd::MarkUnparsed(std::string_view(reinterpret_cast<const char*>(data), size), &request);
    if (specd::WireError(request).ok()) __builtin_trap();  // a failed parse must be reported
    return 0;
  }
  specd::RequestLimits limits;
  limits.vocab_size = 320;
  limits.max_context = 64;
  limits.eos_token_ids = {256};
  limits.max_new_tokens_limit = 100;
  limits.default_max_new_tokens = 10;
  if (!specd::ValidateGenerateRequest(request, limits).ok()) return 0;
  const specd::RouterRequest r = specd::ResolveRequest(request, limits, /*random_seed=*/7);
  if (r.max_new_tokens < 1 || r.max_new_tokens > limits.max_new_tokens_limit || r.shape.depth < 1 ||
      r.shape.max_nodes < 1 || r.shape.max_nodes > specd::kMaxTreeNodes ||
      r.request_id.find('\n') != std::string::npos) {
    __builtin_trap();
  }
  return 0;
}
