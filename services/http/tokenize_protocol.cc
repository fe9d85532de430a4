#include "services/http/tokenize_protocol.h"

#include <algorithm>
#include <limits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/service/grpc_util.h"

namespace specd {
namespace {

using ojson = nlohmann::ordered_json;

absl::Status Invalid(absl::string_view field, absl::string_view reason) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", reason));
}

absl::StatusOr<ojson> ParseBody(absl::string_view text) {
  ojson body = ojson::parse(text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) {
    return absl::InvalidArgumentError("invalid JSON in the request body");
  }
  if (!body.is_object())
    return absl::InvalidArgumentError("the request body must be a JSON object");
  return body;
}

// Fields not in `known` are refused with their name: nothing a client sends is silently ignored.
absl::Status OnlyKnownFields(const ojson& body, std::initializer_list<absl::string_view> known) {
  for (const auto& [key, value] : body.items()) {
    if (std::find(known.begin(), known.end(), key) == known.end()) {
      return Invalid(key, "unknown field");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> Bool(const ojson& body, const char* name, bool fallback) {
  const auto it = body.find(name);
  if (it == body.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) return Invalid(name, "must be true or false");
  return it->get<bool>();
}

}  // namespace

absl::StatusOr<TokenizeCall> ParseTokenizeRequest(absl::string_view text,
                                                  const ProtocolOptions& options) {
  absl::StatusOr<ojson> body = ParseBody(text);
  if (!body.ok()) return body.status();
  if (absl::Status s = CheckModel(nlohmann::json(*body), options); !s.ok()) return s;
  if (absl::StatusOr<bool> strs = Bool(*body, "return_token_strs", false); !strs.ok()) {
    return strs.status();
  } else if (*strs) {
    return Invalid("return_token_strs", "not supported");
  }
  for (const char* unsupported : {"tools", "mm_processor_kwargs"}) {
    const auto it = body->find(unsupported);
    if (it != body->end() && !it->is_null()) return Invalid(unsupported, "not supported");
  }
  const bool chat = body->contains("messages");
  if (chat && body->contains("prompt"))
    return Invalid("prompt", "give prompt or messages, not both");
  if (!chat && !body->contains("prompt")) return Invalid("prompt", "required (or messages)");
  TokenizeCall call;
  if (!chat) {
    if (absl::Status s =
            OnlyKnownFields(*body, {"model", "prompt", "add_special_tokens", "return_token_strs"});
        !s.ok()) {
      return s;
    }
    const ojson& prompt = (*body)["prompt"];
    if (!prompt.is_string()) return Invalid("prompt", "must be a string");
    call.text = prompt.get<std::string>();
    absl::StatusOr<bool> special = Bool(*body, "add_special_tokens", true);
    if (!special.ok()) return special.status();
    call.add_special_tokens = *special;
    return call;
  }
  if (absl::Status s = OnlyKnownFields(
          *body, {"model", "messages", "add_generation_prompt", "continue_final_message",
                  "add_special_tokens", "chat_template_kwargs", "chat_template", "documents",
                  "tools", "mm_processor_kwargs", "return_token_strs"});
      !s.ok()) {
    return s;
  }
  absl::StatusOr<ChatTemplate::Request> fields = ParseChatTemplateFields(*body);
  if (!fields.ok()) return fields.status();
  if (options.chat_template == nullptr) {
    return absl::FailedPreconditionError(
        "the served model has no chat template (tokenizer_config.json's chat_template or "
        "chat_template.jinja); start specd-http with --model_dir, or --chat_template FILE");
  }
  absl::StatusOr<std::string> prompt = options.chat_template->Render(*fields);
  if (!prompt.ok()) return prompt.status();
  call.text = *std::move(prompt);
  absl::StatusOr<bool> special = Bool(*body, "add_special_tokens", false);
  if (!special.ok()) return special.status();
  call.add_special_tokens = *special;
  return call;
}

nlohmann::json TokenizeResponseJson(const std::vector<int32_t>& tokens, uint32_t max_model_len) {
  return {{"count", tokens.size()},
          {"max_model_len", max_model_len},
          {"tokens", tokens},
          {"token_strs", nullptr}};
}

absl::StatusOr<std::vector<int32_t>> ParseDetokenizeRequest(absl::string_view text,
                                                            const ProtocolOptions& options) {
  absl::StatusOr<ojson> body = ParseBody(text);
  if (!body.ok()) return body.status();
  if (absl::Status s = CheckModel(nlohmann::json(*body), options); !s.ok()) return s;
  if (absl::Status s = OnlyKnownFields(*body, {"model", "tokens"}); !s.ok()) return s;
  const auto it = body->find("tokens");
  if (it == body->end() || it->is_null()) return Invalid("tokens", "required");
  if (!it->is_array()) return Invalid("tokens", "must be an array of token ids");
  std::vector<int32_t> ids;
  for (size_t i = 0; i < it->size(); ++i) {
    const ojson& v = (*it)[i];
    const std::string field = absl::StrCat("tokens[", i, "]");
    if (!v.is_number_integer()) return Invalid(field, "token ids must be integers");
    const int64_t id = v.is_number_unsigned() && v.get<uint64_t>() > INT64_MAX
                           ? std::numeric_limits<int64_t>::max()
                           : v.get<int64_t>();
    if (id < 0 || id > std::numeric_limits<int32_t>::max()) {
      return Invalid(field, absl::StrCat("token id ", id, " is out of range"));
    }
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

nlohmann::json DetokenizeResponseJson(const std::string& text) { return {{"prompt", text}}; }

nlohmann::json ModelJson(const std::string& id, uint32_t max_model_len,
                         const ModelFeatures& features) {
  nlohmann::json model = {{"id", id}, {"object", "model"}, {"created", 0}, {"owned_by", "specd"}};
  if (max_model_len > 0) model["max_model_len"] = max_model_len;
  nlohmann::json modes = nlohmann::json::array();
  for (v1::Speculation mode : features.speculation_modes) modes.push_back(SpeculationName(mode));
  model["specd"] = {
      {"supports_logprobs", features.logprobs},
      {"supports_logits_processors", features.logits_processors},
      {"chat_template",
       features.chat_template.empty() ? nlohmann::json() : nlohmann::json(features.chat_template)},
      {"speculation_modes", std::move(modes)}};
  return model;
}

ApiError ModelNotFound(const std::string& id) {
  ApiError e;
  e.http_status = 404;
  e.type = "invalid_request_error";
  e.message = absl::StrCat("The model '", id, "' does not exist");
  e.param = "model";
  e.code = "model_not_found";
  return e;
}

ApiError TokenizeApiError(const absl::Status& status) {
  ApiError e = ToApiError(status, Endpoint::kCompletions);
  // The router names Detokenize's ids "ids[3]"; this API calls them tokens.
  if (e.param.has_value() && absl::StartsWith(*e.param, "ids")) {
    e.param = "tokens" + e.param->substr(3);
  }
  return e;
}

}  // namespace specd
