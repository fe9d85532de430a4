// vLLM's utility endpoints on specd-http, as pure translations (the server makes the calls):
//
//   POST /tokenize    {"prompt": "..."[, "add_special_tokens": true]}
//                     {"messages": [...][, "add_generation_prompt": true,
//                      "continue_final_message", "chat_template_kwargs",
//                      "add_special_tokens": false]}
//                  -> {"count", "max_model_len", "tokens", "token_strs": null}
//   POST /detokenize  {"tokens": [...]} -> {"prompt": "..."}
//   GET  /version     -> {"version": "..."}
//   GET  /v1/models/{id} -> the model object, or 404 model_not_found
#ifndef SPECD_SERVICES_HTTP_TOKENIZE_PROTOCOL_H_
#define SPECD_SERVICES_HTTP_TOKENIZE_PROTOCOL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "services/http/openai_protocol.h"
#include "specd/v1/generation.pb.h"

namespace specd {

// What the router's Tokenize is asked for.
struct TokenizeCall {
  std::string text;  // the prompt, or the prompt the chat template renders from `messages`
  bool add_special_tokens = true;
};

// A /tokenize body. `prompt` defaults to add_special_tokens true, `messages` to false (the
// template wrote the special tokens), as in vLLM. Unknown fields and return_token_strs are 400s.
absl::StatusOr<TokenizeCall> ParseTokenizeRequest(absl::string_view body,
                                                  const ProtocolOptions& options);
nlohmann::json TokenizeResponseJson(const std::vector<int32_t>& tokens, uint32_t max_model_len);

// A /detokenize body: its token ids (checked against the vocabulary by the router).
absl::StatusOr<std::vector<int32_t>> ParseDetokenizeRequest(absl::string_view body,
                                                            const ProtocolOptions& options);
nlohmann::json DetokenizeResponseJson(const std::string& text);

// What the model's verify backend honours (the router's ModelInfo.supports_*), the chat
// template this server renders, and the speculation modes the cluster serves.
struct ModelFeatures {
  bool logprobs = false;
  bool logits_processors = false;  // min_p, logit_bias, min_tokens and the penalties
  // Where specd-http's chat template came from: "--chat_template", "chat_template.jinja" or
  // "tokenizer_config.json" (ChatTemplate::source()); empty: none (chat requests are 400s).
  std::string chat_template;
  std::vector<v1::Speculation> speculation_modes;  // the router's ModelInfo.speculation_modes
};

// OpenAI's model object (the entry of /v1/models, and /v1/models/{id}) with vLLM's
// max_model_len, and `features` under "specd": supports_logprobs, supports_logits_processors (a
// request for a feature the backend lacks is a 501 naming the field), chat_template (its source,
// or null) and speculation_modes (names as the "specd.speculation" request field takes them).
nlohmann::json ModelJson(const std::string& id, uint32_t max_model_len,
                         const ModelFeatures& features);
// 404 for GET /v1/models/{id} of a model not served here.
ApiError ModelNotFound(const std::string& id);

// The router's errors on these endpoints in the HTTP request's terms (its `ids` are `tokens`).
ApiError TokenizeApiError(const absl::Status& status);

}  // namespace specd

#endif  // SPECD_SERVICES_HTTP_TOKENIZE_PROTOCOL_H_
