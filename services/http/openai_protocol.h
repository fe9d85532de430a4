// Translation between OpenAI's HTTP/JSON completion API and specd.v1.Generation: request
// bodies to GenerateRequest, router chunks to OpenAI responses and SSE chunks, and gRPC errors
// to OpenAI error objects with the matching HTTP status. Pure functions, no I/O, so every rule
// here is unit tested without a network.
//
// Errors are absl::Status values whose message starts with the offending field's name
// ("temperature: must be ...", the router's convention too); ToApiError() turns that prefix
// into the OpenAI error's `param`.
#ifndef SPECD_SERVICES_HTTP_OPENAI_PROTOCOL_H_
#define SPECD_SERVICES_HTTP_OPENAI_PROTOCOL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "services/http/chat_template.h"
#include "specd/v1/generation.pb.h"

namespace specd {

enum class Endpoint { kCompletions, kChatCompletions };

struct ProtocolOptions {
  // The name /v1/models reports. A request's `model` must be empty, this, or `model_aliases`.
  std::string model_name;
  std::vector<std::string> model_aliases;
  // max_tokens of /v1/completions requests that set none. OpenAI's legacy completions default
  // to 16; chat completions default to the router's limit (0 here = the router's default).
  uint32_t default_completion_max_tokens = 16;
  // The served model's chat template; null when it has none (chat requests are then refused).
  const ChatTemplate* chat_template = nullptr;
};

struct ParsedRequest {
  v1::GenerateRequest generate;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // Chat requests: generate.prompt() is the prompt the chat template rendered. It already holds
  // the template's special tokens, so it goes to the router as ids from its Tokenize with
  // `add_special_tokens` (false unless the request asks, as in vLLM), not as text, which the
  // router would give a second BOS.
  bool tokenize_prompt = false;
  bool add_special_tokens = false;
  // Alternatives per token the response lists: -1 = no logprobs (completions' `logprobs`,
  // chat's `top_logprobs` with `logprobs: true`).
  int logprobs = -1;
  uint32_t n = 1;  // samples (choices); generate.n() carries it to the router
};

// The top-level request fields ParseRequest() reads for `endpoint`: each is honoured, or
// refused unless it has its neutral value (docs/http.md lists every one and which). Any other
// field, and any guided_* field, is a 400 naming it.
std::vector<std::string> RequestFields(Endpoint endpoint);

// Parses and checks a POST body. Checks the OpenAI-level rules (types, n, logprobs and other
// unsupported options, model name, messages); the numeric ranges of sampling parameters are
// left to the router, which owns them, and come back as INVALID_ARGUMENT naming the field.
// NOT_FOUND (param "model") when the request names another model.
absl::StatusOr<ParsedRequest> ParseRequest(Endpoint endpoint, absl::string_view body,
                                           const ProtocolOptions& options);

// A request's `model`: absent, null, empty, the served name or an alias; else NOT_FOUND naming
// the field.
absl::Status CheckModel(const nlohmann::json& body, const ProtocolOptions& options);

// An OpenAI error object and the HTTP status that carries it.
struct ApiError {
  int http_status = 500;
  std::string message;
  std::string type;                  // invalid_request_error, rate_limit_error, server_error...
  std::optional<std::string> param;  // the request field at fault, in the API's own names
  std::string code;                  // e.g. invalid_argument, model_not_found, unavailable
};

// INVALID_ARGUMENT/OUT_OF_RANGE/FAILED_PRECONDITION -> 400, NOT_FOUND -> 404,
// RESOURCE_EXHAUSTED -> 429, UNAVAILABLE and CANCELLED -> 503, DEADLINE_EXCEEDED -> 504,
// UNIMPLEMENTED -> 501, UNAUTHENTICATED -> 401, PERMISSION_DENIED -> 403, others -> 500.
// `param` comes from the message's "field:" prefix, renamed from the gRPC request's field names
// to the HTTP request's (max_new_tokens -> max_tokens, prompt -> messages for chat, ...).
ApiError ToApiError(const absl::Status& status, Endpoint endpoint);

// {"error": {"message", "type", "param", "code"}}.
nlohmann::json ErrorJson(const ApiError& error);

// "stop" or "length" (the OpenAI finish reasons; the context filling up counts as length).
const char* OpenAiFinishReason(v1::FinishReason reason);

// The speculation statistics of a finished request, with acceptance rate and mean acceptance
// length derived as in docs/metrics.md.
nlohmann::json SpeculationJson(const v1::SpeculationStats& stats);

// What the router streamed for one request, gathered for a non-streaming response.
struct Completion {
  std::string text;
  std::vector<int32_t> token_ids;
  std::vector<v1::TokenLogprob> logprobs;  // one per token id when the request asked
  v1::GenerateResponse last;               // the chunk with finish_reason, usage and speculation
};

// Identity of one response, shared by all its chunks.
struct ResponseIdentity {
  std::string id;       // cmpl-... or chatcmpl-...
  int64_t created = 0;  // Unix seconds
  std::string model;
};

// The whole non-streaming response body.
nlohmann::json CompletionResponseJson(Endpoint endpoint, const ResponseIdentity& identity,
                                      const Completion& completion);
// The same for n choices (choices[i] = completions[i]); `logprobs` as ParsedRequest's. usage
// counts the prompt once and every choice's completion tokens; each choice carries its own
// `specd` object when there are several.
nlohmann::json CompletionResponseJson(Endpoint endpoint, const ResponseIdentity& identity,
                                      const std::vector<Completion>& completions, int logprobs);

// A choice's `logprobs` in OpenAI's shape. Completions: {tokens, token_logprobs, top_logprobs
// (the top `top` and the chosen token, by text), text_offset}; chat: {content: [{token, logprob,
// bytes, top_logprobs: [{token, logprob, bytes}]}]}. `text_offset` is where the first token's
// text starts in the choice's text, advanced past these tokens.
nlohmann::json LogprobsJson(Endpoint endpoint, int top,
                            const std::vector<v1::TokenLogprob>& logprobs, size_t* text_offset);

// One streamed chunk's JSON (the part after "data: "). `text` is the new text; `role` sets
// delta.role (the first chat chunk); `last` is the router's final chunk, which adds
// finish_reason and the specd statistics. With include_usage every chunk carries
// "usage": null, as OpenAI's do.
nlohmann::json StreamChunkJson(Endpoint endpoint, const ResponseIdentity& identity,
                               absl::string_view text, const std::vector<int32_t>& token_ids,
                               bool role, const v1::GenerateResponse* last, bool include_usage,
                               uint32_t index = 0,
                               const nlohmann::json& logprobs = nlohmann::json(nullptr));

// The extra chunk OpenAI sends after the last one when stream_options.include_usage is set:
// empty choices and the usage of the whole request.
nlohmann::json UsageChunkJson(Endpoint endpoint, const ResponseIdentity& identity,
                              const v1::Usage& usage);

// Compact JSON text. Invalid UTF-8 (from a client's stop string echoed in matched_stop, say) is
// replaced with U+FFFD rather than thrown on.
std::string DumpJson(const nlohmann::json& value);

// "data: <json>\n\n".
std::string SseEvent(const nlohmann::json& data);
inline constexpr absl::string_view kSseDone = "data: [DONE]\n\n";

}  // namespace specd

#endif  // SPECD_SERVICES_HTTP_OPENAI_PROTOCOL_H_
