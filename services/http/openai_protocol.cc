#include "services/http/openai_protocol.h"

#include <algorithm>
#include <limits>
#include <string_view>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/service/grpc_util.h"

namespace specd {
namespace {

using nlohmann::json;

absl::Status Invalid(absl::string_view field, absl::string_view reason) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", reason));
}

// Absent and null both mean "not set", as in OpenAI's API.
const json* Field(const json& body, const char* name) {
  const auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::StatusOr<std::optional<double>> OptionalNumber(const json& body, const char* name) {
  const json* v = Field(body, name);
  if (v == nullptr) return std::optional<double>();
  if (!v->is_number()) return Invalid(name, "must be a number");
  return std::optional<double>(v->get<double>());
}

// Integers only; 16.0 is not accepted (OpenAI rejects it too).
absl::StatusOr<std::optional<int64_t>> OptionalInt(const json& body, const char* name,
                                                   absl::string_view field = "") {
  const std::string label = field.empty() ? std::string(name) : std::string(field);
  const json* v = Field(body, name);
  if (v == nullptr) return std::optional<int64_t>();
  if (v->is_number_unsigned()) {
    if (v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Invalid(label, "is too large");
    }
    return std::optional<int64_t>(static_cast<int64_t>(v->get<uint64_t>()));
  }
  if (!v->is_number_integer()) return Invalid(label, "must be an integer");
  return std::optional<int64_t>(v->get<int64_t>());
}

absl::StatusOr<bool> OptionalBool(const json& body, const char* name, bool fallback) {
  const json* v = Field(body, name);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) return Invalid(name, "must be true or false");
  return v->get<bool>();
}

absl::StatusOr<uint32_t> NonNegativeU32(int64_t value, absl::string_view field) {
  if (value < 0) return Invalid(field, absl::StrCat("must be >= 0, got ", value));
  if (value > std::numeric_limits<uint32_t>::max()) return Invalid(field, "is too large");
  return static_cast<uint32_t>(value);
}

absl::StatusOr<int32_t> TokenId(const json& v, absl::string_view field) {
  if (!v.is_number_integer()) return Invalid(field, "token ids must be integers");
  const int64_t id = v.get<int64_t>();
  if (id < std::numeric_limits<int32_t>::min() || id > std::numeric_limits<int32_t>::max()) {
    return Invalid(field, absl::StrCat("token id ", id, " is out of range"));
  }
  return static_cast<int32_t>(id);
}

bool AllIntegers(const json& array) {
  for (const json& v : array) {
    if (!v.is_number_integer()) return false;
  }
  return true;
}

// OpenAI's `prompt`: a string, an array of token ids, or a batch (array of strings or of token
// arrays) of which only a batch of one is served.
absl::Status ParsePrompt(const json& body, v1::GenerateRequest* out) {
  const json* prompt = Field(body, "prompt");
  if (prompt == nullptr) return Invalid("prompt", "required");
  const json* single = prompt;
  if (prompt->is_array() && !prompt->empty() && !AllIntegers(*prompt)) {
    if (prompt->size() > 1) {
      return Invalid("prompt",
                     "batches of several prompts are not supported; send one request per prompt");
    }
    single = &(*prompt)[0];
    if (!single->is_string() && !(single->is_array() && AllIntegers(*single))) {
      return Invalid("prompt", "must be a string, an array of token ids, or a batch of one");
    }
  }
  if (single->is_string()) {
    out->set_prompt(single->get<std::string>());
    return absl::OkStatus();
  }
  if (!single->is_array()) {
    return Invalid("prompt", "must be a string or an array of token ids");
  }
  if (single->empty()) return Invalid("prompt", "must not be empty");
  v1::TokenIds* ids = out->mutable_prompt_ids();
  for (size_t i = 0; i < single->size(); ++i) {
    absl::StatusOr<int32_t> id = TokenId((*single)[i], absl::StrCat("prompt[", i, "]"));
    if (!id.ok()) return id.status();
    ids->add_ids(*id);
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::Speculation> ParseSpeculation(const json& v, absl::string_view field) {
  static constexpr absl::string_view kChoices = "one of auto, off, draft_model, ngram, eagle3";
  if (!v.is_string()) return Invalid(field, absl::StrCat("must be a string: ", kChoices));
  const std::string s = absl::AsciiStrToLower(v.get<std::string>());
  if (s == "auto") return v1::SPECULATION_AUTO;
  if (s == "off") return v1::SPECULATION_OFF;
  if (s == "draft_model") return v1::SPECULATION_DRAFT_MODEL;
  if (s == "ngram") return v1::SPECULATION_NGRAM;
  if (s == "eagle3") return v1::SPECULATION_EAGLE3;
  return Invalid(field, absl::StrCat("'", v.get<std::string>(), "' is not ", kChoices));
}

// The `specd` extension object: {"speculation", "draft_depth", "draft_top_k",
// "draft_max_nodes"}. Strict about unknown keys: it is our own namespace, and a typo silently
// ignored would look like speculation not working.
absl::Status ParseSpecdExtension(const json& body, v1::GenerateRequest* out) {
  const json* ext = Field(body, "specd");
  if (ext == nullptr) return absl::OkStatus();
  if (!ext->is_object()) return Invalid("specd", "must be an object");
  for (const auto& [key, value] : ext->items()) {
    const std::string field = absl::StrCat("specd.", key);
    if (key == "speculation") {
      if (value.is_null()) continue;
      if (Field(body, "speculation") != nullptr) {
        return Invalid(field, "set either speculation or specd.speculation, not both");
      }
      absl::StatusOr<v1::Speculation> s = ParseSpeculation(value, field);
      if (!s.ok()) return s.status();
      out->set_speculation(*s);
    } else if (key == "logprobs_mode") {
      // vLLM's --logprobs-mode names; per request here.
      if (value.is_null()) continue;
      if (value == json("raw_logprobs")) {
        out->set_logprobs_source(v1::LOGPROBS_SOURCE_RAW);
      } else if (value == json("processed_logprobs")) {
        out->set_logprobs_source(v1::LOGPROBS_SOURCE_PROCESSED);
      } else {
        return Invalid(field, "must be raw_logprobs or processed_logprobs");
      }
    } else if (key == "draft_depth" || key == "draft_top_k" || key == "draft_max_nodes") {
      absl::StatusOr<std::optional<int64_t>> v = OptionalInt(*ext, key.c_str(), field);
      if (!v.ok()) return v.status();
      if (!v->has_value()) continue;
      absl::StatusOr<uint32_t> u = NonNegativeU32(**v, field);
      if (!u.ok()) return u.status();
      if (key == "draft_depth") out->set_draft_depth(*u);
      if (key == "draft_top_k") out->set_draft_top_k(*u);
      if (key == "draft_max_nodes") out->set_draft_max_nodes(*u);
    } else {
      return Invalid(field,
                     "unknown field (known: speculation, draft_depth, draft_top_k, "
                     "draft_max_nodes, logprobs_mode)");
    }
  }
  return absl::OkStatus();
}

// RequestFields() as sets, built once.
bool KnownField(Endpoint endpoint, const std::string& key) {
  using Set = absl::flat_hash_set<std::string>;
  auto make = [](Endpoint e) {
    const std::vector<std::string> fields = RequestFields(e);
    return new Set(fields.begin(), fields.end());
  };
  static const Set* const completions = make(Endpoint::kCompletions);
  static const Set* const chat = make(Endpoint::kChatCompletions);
  return (endpoint == Endpoint::kCompletions ? completions : chat)->contains(key);
}

constexpr absl::string_view kLaterWave =
    "structured output and tool calls are not served by specd yet (a later release will); "
    "remove the field";

// Options specd does not implement: rejected when set to anything but their neutral value.
absl::Status RejectUnsupported(Endpoint endpoint, const json& body) {
  for (const auto& [key, value] : body.items()) {
    if (absl::StartsWith(key, "guided_") || key == "structured_outputs") {
      if (value.is_null()) continue;
      return Invalid(key, kLaterWave);
    }
    if (!KnownField(endpoint, key)) {
      return Invalid(key,
                     "unknown field; specd does not honour it (docs/http.md lists the "
                     "fields it does)");
    }
  }
  absl::StatusOr<std::optional<int64_t>> n = OptionalInt(body, "n");
  if (!n.ok()) return n.status();
  if (n->has_value() && **n < 1) return Invalid("n", absl::StrCat("must be >= 1, got ", **n));
  if (absl::StatusOr<std::optional<int64_t>> b = OptionalInt(body, "best_of"); !b.ok()) {
    return b.status();
  } else if (b->has_value() && **b != (n->has_value() ? **n : 1)) {
    return Invalid("best_of", "must equal n: specd returns every sample it generates");
  }
  if (absl::StatusOr<bool> echo = OptionalBool(body, "echo", false); !echo.ok()) {
    return echo.status();
  } else if (*echo) {
    return Invalid("echo", "not supported");
  }
  if (Field(body, "user") != nullptr && !Field(body, "user")->is_string()) {
    return Invalid("user", "must be a string");
  }
  if (endpoint == Endpoint::kCompletions) {
    if (const json* suffix = Field(body, "suffix");
        suffix != nullptr && !(suffix->is_string() && suffix->get<std::string>().empty())) {
      return Invalid("suffix", "not supported");
    }
  } else {
    if (const json* tools = Field(body, "tools");
        tools != nullptr && !(tools->is_array() && tools->empty())) {
      return Invalid("tools", kLaterWave);
    }
    if (const json* choice = Field(body, "tool_choice");
        choice != nullptr && !(choice->is_string() && choice->get<std::string>() == "none")) {
      return Invalid("tool_choice", kLaterWave);
    }
    if (const json* parallel = Field(body, "parallel_tool_calls");
        parallel != nullptr && !parallel->is_boolean()) {
      return Invalid("parallel_tool_calls", "must be true or false");
    }
    if (const json* format = Field(body, "response_format");
        format != nullptr &&
        !(format->is_object() && format->value("type", json()) == json("text"))) {
      return Invalid("response_format", kLaterWave);
    }
  }
  return absl::OkStatus();
}

// OpenAI's logprobs fields: completions `logprobs: N` (the top N, 0 = the token's own only);
// chat `logprobs: true` with `top_logprobs: N`. Up to 20 alternatives, as vLLM's default
// max_logprobs.
absl::Status ParseLogprobs(Endpoint endpoint, const json& body, ParsedRequest* out) {
  constexpr int64_t kMax = 20;
  if (endpoint == Endpoint::kCompletions) {
    absl::StatusOr<std::optional<int64_t>> n = OptionalInt(body, "logprobs");
    if (!n.ok()) return n.status();
    if (!n->has_value()) return absl::OkStatus();
    if (**n < 0 || **n > kMax) {
      return Invalid("logprobs", absl::StrCat("must be in [0, ", kMax, "], got ", **n));
    }
    out->logprobs = static_cast<int>(**n);
  } else {
    absl::StatusOr<bool> wanted = OptionalBool(body, "logprobs", false);
    if (!wanted.ok()) return wanted.status();
    absl::StatusOr<std::optional<int64_t>> top = OptionalInt(body, "top_logprobs");
    if (!top.ok()) return top.status();
    if (top->has_value()) {
      if (**top < 0 || **top > kMax) {
        return Invalid("top_logprobs", absl::StrCat("must be in [0, ", kMax, "], got ", **top));
      }
      if (!*wanted && **top > 0) return Invalid("top_logprobs", "requires logprobs: true");
    }
    if (!*wanted) return absl::OkStatus();
    out->logprobs = top->has_value() ? static_cast<int>(**top) : 0;
  }
  out->generate.set_logprobs(static_cast<uint32_t>(out->logprobs));
  return absl::OkStatus();
}

absl::Status ParseSampling(const json& body, v1::GenerateRequest* out) {
  absl::StatusOr<std::optional<double>> temperature = OptionalNumber(body, "temperature");
  if (!temperature.ok()) return temperature.status();
  if (temperature->has_value()) out->set_temperature(static_cast<float>(**temperature));
  absl::StatusOr<std::optional<double>> top_p = OptionalNumber(body, "top_p");
  if (!top_p.ok()) return top_p.status();
  if (top_p->has_value()) out->set_top_p(static_cast<float>(**top_p));
  absl::StatusOr<std::optional<int64_t>> top_k = OptionalInt(body, "top_k");
  if (!top_k.ok()) return top_k.status();
  // -1 means "no limit" in vLLM's extension of the same name; the router spells that 0.
  if (top_k->has_value() && **top_k != -1) {
    if (**top_k < std::numeric_limits<int32_t>::min() ||
        **top_k > std::numeric_limits<int32_t>::max()) {
      return Invalid("top_k", "is out of range");
    }
    out->set_top_k(static_cast<int32_t>(**top_k));
  }
  for (const char* name :
       {"min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"}) {
    absl::StatusOr<std::optional<double>> v = OptionalNumber(body, name);
    if (!v.ok()) return v.status();
    if (!v->has_value()) continue;
    const float f = static_cast<float>(**v);
    if (std::string_view(name) == "min_p") out->set_min_p(f);
    if (std::string_view(name) == "repetition_penalty") out->set_repetition_penalty(f);
    if (std::string_view(name) == "presence_penalty") out->set_presence_penalty(f);
    if (std::string_view(name) == "frequency_penalty") out->set_frequency_penalty(f);
  }
  if (absl::StatusOr<std::optional<int64_t>> m = OptionalInt(body, "min_tokens"); !m.ok()) {
    return m.status();
  } else if (m->has_value()) {
    absl::StatusOr<uint32_t> u = NonNegativeU32(**m, "min_tokens");
    if (!u.ok()) return u.status();
    out->set_min_tokens(*u);
  }
  // OpenAI's logit_bias: {"token id as a string": bias}. The router checks ids and ranges.
  if (const json* bias = Field(body, "logit_bias"); bias != nullptr) {
    if (!bias->is_object()) return Invalid("logit_bias", "must be an object of token id -> bias");
    for (const auto& [key, value] : bias->items()) {
      int32_t id = 0;
      if (!absl::SimpleAtoi(key, &id)) {
        return Invalid(absl::StrCat("logit_bias[", key, "]"), "keys must be token ids");
      }
      if (!value.is_number()) {
        return Invalid(absl::StrCat("logit_bias[", key, "]"), "must be a number");
      }
      (*out->mutable_logit_bias())[id] = static_cast<float>(value.get<double>());
    }
  }
  if (const json* seed = Field(body, "seed"); seed != nullptr) {
    if (seed->is_number_unsigned()) {
      out->set_seed(seed->get<uint64_t>());
    } else if (seed->is_number_integer()) {
      return Invalid("seed", absl::StrCat("must be >= 0, got ", seed->get<int64_t>()));
    } else {
      return Invalid("seed", "must be an integer");
    }
  }
  return absl::OkStatus();
}

absl::Status ParseStops(const json& body, v1::GenerateRequest* out) {
  if (const json* stop = Field(body, "stop"); stop != nullptr) {
    if (stop->is_string()) {
      out->add_stop(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (size_t i = 0; i < stop->size(); ++i) {
        if (!(*stop)[i].is_string()) {
          return Invalid(absl::StrCat("stop[", i, "]"), "must be a string");
        }
        out->add_stop((*stop)[i].get<std::string>());
      }
    } else {
      return Invalid("stop", "must be a string or an array of strings");
    }
  }
  if (const json* ids = Field(body, "stop_token_ids"); ids != nullptr) {
    if (!ids->is_array()) return Invalid("stop_token_ids", "must be an array of token ids");
    for (size_t i = 0; i < ids->size(); ++i) {
      absl::StatusOr<int32_t> id = TokenId((*ids)[i], absl::StrCat("stop_token_ids[", i, "]"));
      if (!id.ok()) return id.status();
      out->add_stop_token_ids(*id);
    }
  }
  return absl::OkStatus();
}

absl::Status ParseMaxTokens(Endpoint endpoint, const json& body, const ProtocolOptions& options,
                            v1::GenerateRequest* out) {
  const char* name = "max_tokens";
  // Chat's newer name wins when both are given, as in OpenAI's API.
  if (endpoint == Endpoint::kChatCompletions && Field(body, "max_completion_tokens") != nullptr) {
    name = "max_completion_tokens";
  }
  absl::StatusOr<std::optional<int64_t>> max_tokens = OptionalInt(body, name);
  if (!max_tokens.ok()) return max_tokens.status();
  if (!max_tokens->has_value()) {
    if (endpoint == Endpoint::kCompletions) {
      out->set_max_new_tokens(options.default_completion_max_tokens);
    }
    return absl::OkStatus();
  }
  if (**max_tokens < 1) return Invalid(name, absl::StrCat("must be >= 1, got ", **max_tokens));
  absl::StatusOr<uint32_t> u = NonNegativeU32(**max_tokens, name);
  if (!u.ok()) return u.status();
  out->set_max_new_tokens(*u);
  return absl::OkStatus();
}

}  // namespace

// The request fields each endpoint knows. Anything else is a 400 naming it: a field silently
// dropped would return something other than what was asked for (docs/http.md lists them all).
std::vector<std::string> RequestFields(Endpoint endpoint) {
  std::vector<std::string> fields = {"model",
                                     "max_tokens",
                                     "temperature",
                                     "top_p",
                                     "top_k",
                                     "min_p",
                                     "n",
                                     "stream",
                                     "stream_options",
                                     "stop",
                                     "stop_token_ids",
                                     "seed",
                                     "presence_penalty",
                                     "frequency_penalty",
                                     "repetition_penalty",
                                     "logit_bias",
                                     "min_tokens",
                                     "ignore_eos",
                                     "logprobs",
                                     "echo",
                                     "speculation",
                                     "specd",
                                     "user",
                                     "best_of"};
  if (endpoint == Endpoint::kCompletions) {
    fields.insert(fields.end(), {"prompt", "suffix"});
  } else {
    fields.insert(
        fields.end(),
        {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
         "response_format", "add_special_tokens", "add_generation_prompt", "continue_final_message",
         "chat_template_kwargs", "chat_template", "documents", "parallel_tool_calls"});
  }
  return fields;
}

absl::Status CheckModel(const json& body, const ProtocolOptions& options) {
  const json* model = Field(body, "model");
  if (model == nullptr) return absl::OkStatus();
  if (!model->is_string()) return Invalid("model", "must be a string");
  const std::string name = model->get<std::string>();
  if (name.empty() || name == options.model_name) return absl::OkStatus();
  for (const std::string& alias : options.model_aliases) {
    if (name == alias) return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat(
      "model: '", name, "' is not served here; this server serves '", options.model_name, "'"));
}

namespace {

// The field a message's "name: reason" prefix names, or "" when the message has no such prefix.
std::string MessageField(absl::string_view message) {
  const size_t colon = message.find(": ");
  if (colon == absl::string_view::npos || colon == 0) return "";
  const absl::string_view field = message.substr(0, colon);
  for (char c : field) {
    if (!(absl::ascii_isalnum(c) || c == '_' || c == '.' || c == '[' || c == ']')) return "";
  }
  return std::string(field);
}

// A field named in the router's terms (specd.v1.GenerateRequest) -> the HTTP request's name.
// Fields that are already HTTP names pass through.
std::string HttpParamName(const std::string& field, Endpoint endpoint) {
  const size_t end = field.find_first_of(".[");
  const std::string base = field.substr(0, end);
  const bool chat = endpoint == Endpoint::kChatCompletions;
  if (base == "prompt" || base == "prompt_ids") return chat ? "messages" : "prompt";
  if (base == "max_new_tokens") return "max_tokens";
  // "speculation" is not renamed: the HTTP request has a top-level field of that name too, and
  // the router only rejects values this edge never sends.
  if (base == "draft_depth" || base == "draft_top_k" || base == "draft_max_nodes") {
    return "specd." + base;
  }
  if (base == "stop" || base == "stop_token_ids") return base;
  return field;
}

const char* CodeName(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kCancelled: return "cancelled";
    case absl::StatusCode::kInvalidArgument: return "invalid_argument";
    case absl::StatusCode::kDeadlineExceeded: return "deadline_exceeded";
    case absl::StatusCode::kNotFound: return "not_found";
    case absl::StatusCode::kPermissionDenied: return "permission_denied";
    case absl::StatusCode::kResourceExhausted: return "resource_exhausted";
    case absl::StatusCode::kFailedPrecondition: return "failed_precondition";
    case absl::StatusCode::kOutOfRange: return "out_of_range";
    case absl::StatusCode::kUnimplemented: return "unimplemented";
    case absl::StatusCode::kUnavailable: return "unavailable";
    case absl::StatusCode::kUnauthenticated: return "unauthenticated";
    default: return "internal";
  }
}

json UsageJson(const v1::Usage& usage) {
  return {{"prompt_tokens", usage.prompt_tokens()},
          {"completion_tokens", usage.completion_tokens()},
          {"total_tokens", usage.prompt_tokens() + usage.completion_tokens()}};
}

// The `specd` object of a response or chunk: token ids always; for the last chunk also how
// generation ended and the speculation statistics.
json SpecdJson(const std::vector<int32_t>& token_ids, const v1::GenerateResponse* last) {
  json out = {{"token_ids", token_ids}};
  if (last != nullptr) {
    out["finish_detail"] = FinishReasonName(last->finish_reason());
    if (last->finish_reason() == v1::FINISH_REASON_STOP_STRING) {
      out["matched_stop"] = last->matched_stop();
    }
    out["speculation"] = SpeculationJson(last->speculation());
  }
  return out;
}

const char* ObjectName(Endpoint endpoint, bool chunk) {
  if (endpoint == Endpoint::kChatCompletions) {
    return chunk ? "chat.completion.chunk" : "chat.completion";
  }
  return "text_completion";
}

}  // namespace

absl::StatusOr<ParsedRequest> ParseRequest(Endpoint endpoint, absl::string_view body_text,
                                           const ProtocolOptions& options) {
  json body;
  try {
    body = json::parse(body_text);
  } catch (const json::exception& e) {
    // parse_error, or out_of_range for a number beyond a double (found by
    // tests/fuzz/http_json_fuzzer; it escaped as a 500). nlohmann's message names the byte
    // offset and what it expected there.
    return absl::InvalidArgumentError(absl::StrCat("invalid JSON in the request body: ", e.what()));
  }
  if (!body.is_object()) {
    return absl::InvalidArgumentError("the request body must be a JSON object");
  }
  ParsedRequest out;
  v1::GenerateRequest& g = out.generate;
  if (absl::Status s = CheckModel(body, options); !s.ok()) return s;
  if (absl::Status s = RejectUnsupported(endpoint, body); !s.ok()) return s;
  if (endpoint == Endpoint::kCompletions) {
    if (absl::Status s = ParsePrompt(body, &g); !s.ok()) return s;
  } else {
    // Object key order reaches the template (dict iteration, tojson), so the fields it sees are
    // read again in the order of the text.
    absl::StatusOr<ChatTemplate::Request> chat =
        ParseChatTemplateFields(nlohmann::ordered_json::parse(body_text));
    if (!chat.ok()) return chat.status();
    absl::StatusOr<bool> add_special = OptionalBool(body, "add_special_tokens", false);
    if (!add_special.ok()) return add_special.status();
    if (absl::StatusOr<bool> echo = OptionalBool(body, "echo", false); !echo.ok()) {
      return echo.status();
    } else if (*echo) {
      return Invalid("echo", "not supported");
    }
    if (options.chat_template == nullptr) {
      return absl::FailedPreconditionError(
          "the served model has no chat template (tokenizer_config.json's chat_template or "
          "chat_template.jinja); start specd-http with --model_dir, or --chat_template FILE");
    }
    absl::StatusOr<std::string> prompt = options.chat_template->Render(*chat);
    if (!prompt.ok()) return prompt.status();
    g.set_prompt(*std::move(prompt));
    out.tokenize_prompt = true;
    out.add_special_tokens = *add_special;
  }
  if (absl::Status s = ParseMaxTokens(endpoint, body, options, &g); !s.ok()) return s;
  if (absl::Status s = ParseSampling(body, &g); !s.ok()) return s;
  if (absl::Status s = ParseStops(body, &g); !s.ok()) return s;
  absl::StatusOr<bool> ignore_eos = OptionalBool(body, "ignore_eos", false);
  if (!ignore_eos.ok()) return ignore_eos.status();
  g.set_ignore_eos(*ignore_eos);
  if (const json* spec = Field(body, "speculation"); spec != nullptr) {
    absl::StatusOr<v1::Speculation> s = ParseSpeculation(*spec, "speculation");
    if (!s.ok()) return s.status();
    g.set_speculation(*s);
  }
  if (absl::Status s = ParseSpecdExtension(body, &g); !s.ok()) return s;
  if (absl::Status s = ParseLogprobs(endpoint, body, &out); !s.ok()) return s;
  if (absl::StatusOr<std::optional<int64_t>> n = OptionalInt(body, "n"); n.ok() && n->has_value()) {
    // Past 16 the router refuses it, naming n.
    out.n = static_cast<uint32_t>(std::min<int64_t>(**n, std::numeric_limits<uint32_t>::max()));
    g.set_n(out.n);
  }

  absl::StatusOr<bool> stream = OptionalBool(body, "stream", false);
  if (!stream.ok()) return stream.status();
  out.stream = *stream;
  if (const json* so = Field(body, "stream_options"); so != nullptr) {
    if (!out.stream) return Invalid("stream_options", "only allowed when stream is true");
    if (!so->is_object()) return Invalid("stream_options", "must be an object");
    // Each key is honoured or refused, as the top-level fields are: vLLM's
    // continuous_usage_stats (usage in every chunk) is accepted only at its neutral false.
    for (const auto& [key, value] : so->items()) {
      if (key == "include_usage") continue;
      const std::string name = "stream_options." + key;
      if (key == "continuous_usage_stats") {
        if (value.is_null() || (value.is_boolean() && !value.get<bool>())) continue;
        return Invalid(name,
                       "specd does not honour it: usage comes only in the last chunk "
                       "(include_usage); give false or leave it out");
      }
      return Invalid(name, "unknown field; specd honours only stream_options.include_usage");
    }
    const auto usage = so->find("include_usage");
    if (usage != so->end() && !usage->is_null()) {
      if (!usage->is_boolean()) {
        return Invalid("stream_options.include_usage", "must be true or false");
      }
      out.include_usage = usage->get<bool>();
    }
  }
  return out;
}

ApiError ToApiError(const absl::Status& status, Endpoint endpoint) {
  ApiError e;
  e.message = std::string(status.message());
  e.code = CodeName(status.code());
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
      e.http_status = 400;
      e.type = "invalid_request_error";
      break;
    case absl::StatusCode::kNotFound:
      e.http_status = 404;
      e.type = "invalid_request_error";
      break;
    case absl::StatusCode::kResourceExhausted:
      e.http_status = 429;
      e.type = "rate_limit_error";
      break;
    case absl::StatusCode::kUnauthenticated:
      e.http_status = 401;
      e.type = "authentication_error";
      break;
    case absl::StatusCode::kPermissionDenied:
      e.http_status = 403;
      e.type = "permission_error";
      break;
    case absl::StatusCode::kUnimplemented:
      e.http_status = 501;
      e.type = "server_error";
      break;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kCancelled:
      e.http_status = 503;
      e.type = "service_unavailable_error";
      break;
    case absl::StatusCode::kDeadlineExceeded:
      e.http_status = 504;
      e.type = "timeout_error";
      break;
    default:
      e.http_status = 500;
      e.type = "server_error";
      break;
  }
  // Only a request's own content has a field at fault.
  if (e.http_status == 400 || e.http_status == 404) {
    const std::string field = MessageField(e.message);
    if (!field.empty()) e.param = HttpParamName(field, endpoint);
    if (status.code() == absl::StatusCode::kNotFound && e.param == "model") {
      e.code = "model_not_found";
    }
  }
  return e;
}

json ErrorJson(const ApiError& error) {
  return {{"error",
           {{"message", error.message},
            {"type", error.type},
            {"param", error.param.has_value() ? json(*error.param) : json(nullptr)},
            {"code", error.code}}}};
}

const char* OpenAiFinishReason(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_LENGTH:
    case v1::FINISH_REASON_CONTEXT: return "length";
    default: return "stop";
  }
}

json SpeculationJson(const v1::SpeculationStats& s) {
  json out = {{"mode", SpeculationName(s.mode())},
              {"steps", s.steps()},
              {"draft_tokens", s.draft_tokens()},
              {"accepted_tokens", s.accepted_tokens()},
              {"accepted_per_position", std::vector<uint64_t>(s.accepted_per_position().begin(),
                                                              s.accepted_per_position().end())},
              {"target_only_steps", s.target_only_steps()}};
  out["acceptance_rate"] =
      s.draft_tokens() > 0
          ? json(static_cast<double>(s.accepted_tokens()) / static_cast<double>(s.draft_tokens()))
          : json(nullptr);
  out["mean_accepted_length"] =
      s.steps() > 0
          ? json(1.0 + static_cast<double>(s.accepted_tokens()) / static_cast<double>(s.steps()))
          : json(nullptr);
  return out;
}

json CompletionResponseJson(Endpoint endpoint, const ResponseIdentity& identity,
                            const Completion& completion) {
  return CompletionResponseJson(endpoint, identity, std::vector<Completion>{completion}, -1);
}

json CompletionResponseJson(Endpoint endpoint, const ResponseIdentity& identity,
                            const std::vector<Completion>& completions, int logprobs) {
  json choices = json::array();
  v1::Usage usage;
  for (size_t i = 0; i < completions.size(); ++i) {
    const Completion& completion = completions[i];
    json choice = {{"index", i}};
    if (endpoint == Endpoint::kChatCompletions) {
      choice["message"] = {{"role", "assistant"}, {"content", completion.text}};
    } else {
      choice["text"] = completion.text;
    }
    size_t offset = 0;
    choice["logprobs"] =
        logprobs >= 0 ? LogprobsJson(endpoint, logprobs, completion.logprobs, &offset) : json();
    choice["finish_reason"] = OpenAiFinishReason(completion.last.finish_reason());
    if (completions.size() > 1) choice["specd"] = SpecdJson(completion.token_ids, &completion.last);
    choices.push_back(std::move(choice));
    usage.set_prompt_tokens(completion.last.usage().prompt_tokens());
    usage.set_completion_tokens(usage.completion_tokens() +
                                completion.last.usage().completion_tokens());
  }
  json out = {{"id", identity.id},
              {"object", ObjectName(endpoint, /*chunk=*/false)},
              {"created", identity.created},
              {"model", identity.model},
              {"choices", std::move(choices)},
              {"usage", UsageJson(usage)}};
  if (!completions.empty()) {
    out["specd"] = SpecdJson(completions[0].token_ids, &completions[0].last);
  }
  return out;
}

namespace {

json TokenBytes(const std::string& text) {
  json bytes = json::array();
  for (unsigned char c : text) bytes.push_back(static_cast<int>(c));
  return bytes;
}

}  // namespace

json LogprobsJson(Endpoint endpoint, int top, const std::vector<v1::TokenLogprob>& logprobs,
                  size_t* text_offset) {
  if (endpoint == Endpoint::kChatCompletions) {
    json content = json::array();
    for (const v1::TokenLogprob& lp : logprobs) {
      json alternatives = json::array();
      for (int k = 0; k < lp.top_logprobs_size() && k < top; ++k) {
        const v1::TopLogprob& t = lp.top_logprobs(k);
        alternatives.push_back(
            {{"token", t.token()}, {"logprob", t.logprob()}, {"bytes", TokenBytes(t.token())}});
      }
      content.push_back({{"token", lp.token()},
                         {"logprob", lp.logprob()},
                         {"bytes", TokenBytes(lp.token())},
                         {"top_logprobs", std::move(alternatives)}});
      *text_offset += lp.token().size();
    }
    return {{"content", std::move(content)}};
  }
  json tokens = json::array(), token_logprobs = json::array(), tops = json::array(),
       offsets = json::array();
  for (const v1::TokenLogprob& lp : logprobs) {
    tokens.push_back(lp.token());
    token_logprobs.push_back(lp.logprob());
    // As vLLM: the top alternatives and the chosen token, keyed by text (tokens with the same
    // text share a key, a limit of OpenAI's shape).
    json alternatives = json::object();
    for (int k = 0; k < lp.top_logprobs_size() && k < top; ++k) {
      alternatives[lp.top_logprobs(k).token()] = lp.top_logprobs(k).logprob();
    }
    alternatives[lp.token()] = lp.logprob();
    tops.push_back(std::move(alternatives));
    offsets.push_back(*text_offset);
    *text_offset += lp.token().size();
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(token_logprobs)},
          {"top_logprobs", std::move(tops)},
          {"text_offset", std::move(offsets)}};
}

json StreamChunkJson(Endpoint endpoint, const ResponseIdentity& identity, absl::string_view text,
                     const std::vector<int32_t>& token_ids, bool role,
                     const v1::GenerateResponse* last, bool include_usage, uint32_t index,
                     const json& logprobs) {
  json choice = {{"index", index}};
  if (endpoint == Endpoint::kChatCompletions) {
    json delta = json::object();
    if (role) delta["role"] = "assistant";
    if (role || !text.empty()) delta["content"] = std::string(text);
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = std::string(text);
  }
  choice["logprobs"] = logprobs;
  choice["finish_reason"] =
      last != nullptr ? json(OpenAiFinishReason(last->finish_reason())) : json(nullptr);
  json out = {{"id", identity.id},
              {"object", ObjectName(endpoint, /*chunk=*/true)},
              {"created", identity.created},
              {"model", identity.model},
              {"choices", json::array({choice})}};
  if (include_usage) out["usage"] = nullptr;
  out["specd"] = SpecdJson(token_ids, last);
  return out;
}

json UsageChunkJson(Endpoint endpoint, const ResponseIdentity& identity, const v1::Usage& usage) {
  return {{"id", identity.id},           {"object", ObjectName(endpoint, /*chunk=*/true)},
          {"created", identity.created}, {"model", identity.model},
          {"choices", json::array()},    {"usage", UsageJson(usage)}};
}

std::string DumpJson(const json& value) {
  return value.dump(-1, ' ', /*ensure_ascii=*/false, json::error_handler_t::replace);
}

std::string SseEvent(const json& data) {
  // dump() escapes newlines inside strings, so the event is a single data line.
  return absl::StrCat("data: ", DumpJson(data), "\n\n");
}

}  // namespace specd
