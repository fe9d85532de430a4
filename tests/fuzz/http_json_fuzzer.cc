// libFuzzer: POST bodies of the HTTP edge (/v1/completions, /v1/chat/completions, /tokenize,
// /detokenize) through the OpenAI protocol parsers; the first byte picks the endpoint. A parsed
// request must carry a prompt the router can be sent.
#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "services/http/openai_protocol.h"
#include "services/http/tokenize_protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const absl::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
  specd::ProtocolOptions options;
  options.model_name = "m";
  options.model_aliases = {"alias"};
  switch (data[0] % 4) {
    case 0:
    case 1: {
      const auto endpoint =
          data[0] % 4 == 0 ? specd::Endpoint::kCompletions : specd::Endpoint::kChatCompletions;
      auto parsed = specd::ParseRequest(endpoint, body, options);
      if (parsed.ok() &&
          parsed->generate.input_case() == specd::v1::GenerateRequest::INPUT_NOT_SET) {
        __builtin_trap();
      }
      if (!parsed.ok()) {
        static volatile size_t sink;
        sink =
            specd::DumpJson(specd::ErrorJson(specd::ToApiError(parsed.status(), endpoint))).size();
      }
      break;
    }
    case 2: {
      auto call = specd::ParseTokenizeRequest(body, options);
      (void)call;
      break;
    }
    default: {
      auto ids = specd::ParseDetokenizeRequest(body, options);
      (void)ids;
      break;
    }
  }
  return 0;
}
