#include "services/http/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/text/jinja/builtins.h"

namespace specd {
namespace {

using ojson = nlohmann::ordered_json;

absl::Status Invalid(absl::string_view field, absl::string_view reason) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", reason));
}

absl::StatusOr<std::string> ReadText(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path.string(), ": cannot be read"));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A special token as tokenizer_config.json writes it: "<s>" or {"content": "<s>", ...}.
std::optional<std::string> TokenText(const ojson& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) {
    return v["content"].get<std::string>();
  }
  return std::nullopt;
}

// transformers passes its special_tokens_map to the template: these names, when set.
ojson SpecialTokens(const ojson& config) {
  ojson out = ojson::object();
  for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                          "cls_token", "mask_token"}) {
    const auto it = config.find(key);
    if (it == config.end()) continue;
    if (std::optional<std::string> t = TokenText(*it)) out[key] = *t;
  }
  if (const auto it = config.find("additional_special_tokens");
      it != config.end() && it->is_array() && !it->empty()) {
    ojson list = ojson::array();
    for (const ojson& t : *it) {
      if (std::optional<std::string> s = TokenText(t)) list.push_back(*s);
    }
    out["additional_special_tokens"] = std::move(list);
  }
  return out;
}

absl::StatusOr<std::string> MessageContent(const ojson& content, const std::string& field) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) return Invalid(field, "must be a string or an array of text parts");
  std::vector<std::string> texts;
  for (size_t i = 0; i < content.size(); ++i) {
    const ojson& part = content[i];
    const std::string part_field = absl::StrCat(field, "[", i, "]");
    if (!part.is_object()) return Invalid(part_field, "must be an object");
    const auto type = part.find("type");
    if (type == part.end() || !type->is_string() || type->get<std::string>() != "text") {
      return Invalid(absl::StrCat(part_field, ".type"),
                     "only \"text\" content parts are supported");
    }
    const auto text = part.find("text");
    if (text == part.end() || !text->is_string()) {
      return Invalid(absl::StrCat(part_field, ".text"), "must be a string");
    }
    texts.push_back(text->get<std::string>());
  }
  return absl::StrJoin(texts, "\n");
}

// Whether `v` nests arrays and objects deeper than `limit`. The engine converts values
// recursively, so request JSON it renders is kept shallow.
bool DeeperThan(const ojson& v, int limit) {
  if (!v.is_structured()) return false;
  if (limit == 0) return true;
  for (const ojson& child : v) {
    if (DeeperThan(child, limit - 1)) return true;
  }
  return false;
}

constexpr int kMaxKwargsDepth = 32;

}  // namespace

absl::StatusOr<ChatTemplate> ChatTemplate::FromSource(const std::string& source,
                                                      ojson special_tokens, std::string origin) {
  absl::StatusOr<jinja::Template> t = jinja::Template::Parse(source);
  if (!t.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ": the chat template cannot be used: ", t.status().message()));
  }
  return ChatTemplate(*std::move(t), std::move(special_tokens), std::move(origin));
}

absl::StatusOr<std::optional<ChatTemplate>> ChatTemplate::Load(const std::string& model_dir,
                                                               const std::string& override_file) {
  namespace fs = std::filesystem;
  std::error_code ec;
  ojson special = ojson::object();
  std::optional<std::string> config_template;
  std::string config_origin;
  if (!model_dir.empty()) {
    if (!fs::is_directory(model_dir, ec)) {
      return absl::NotFoundError(absl::StrCat(model_dir, ": not a folder"));
    }
    const fs::path config_path = fs::path(model_dir) / "tokenizer_config.json";
    config_origin = config_path.string();
    if (fs::exists(config_path, ec)) {
      absl::StatusOr<std::string> text = ReadText(config_path);
      if (!text.ok()) return text.status();
      const ojson config = ojson::parse(*text, nullptr, /*allow_exceptions=*/false);
      if (config.is_discarded() || !config.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(config_origin, ": not a JSON object"));
      }
      special = SpecialTokens(config);
      const auto it = config.find("chat_template");
      if (it != config.end() && it->is_string()) {
        config_template = it->get<std::string>();
      } else if (it != config.end() && it->is_array()) {
        // Several named templates: [{"name": "default", "template": "..."}, {"name": "tool_use"}].
        std::vector<std::string> names;
        for (const ojson& entry : *it) {
          if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() ||
              !entry.contains("template") || !entry["template"].is_string()) {
            return absl::InvalidArgumentError(absl::StrCat(
                config_origin, ": chat_template entries must be {\"name\", \"template\"} strings"));
          }
          names.push_back(entry["name"].get<std::string>());
          if (names.back() == "default") config_template = entry["template"].get<std::string>();
        }
        if (!config_template.has_value() && override_file.empty()) {
          return absl::InvalidArgumentError(absl::StrCat(
              config_origin, ": chat_template has no template named \"default\" (it has ",
              absl::StrJoin(names, ", "), "); choose one with --chat_template"));
        }
      } else if (it != config.end() && !it->is_null()) {
        return absl::InvalidArgumentError(
            absl::StrCat(config_origin, ": chat_template is neither a string nor a list"));
      }
    }
  }
  if (!override_file.empty()) {
    absl::StatusOr<std::string> text = ReadText(override_file);
    if (!text.ok()) return text.status();
    absl::StatusOr<ChatTemplate> t = FromSource(*text, std::move(special), override_file);
    if (!t.ok()) return t.status();
    t->source_ = "--chat_template";
    return std::optional<ChatTemplate>(*std::move(t));
  }
  if (!model_dir.empty()) {
    const fs::path jinja_path = fs::path(model_dir) / "chat_template.jinja";
    if (fs::exists(jinja_path, ec)) {
      absl::StatusOr<std::string> text = ReadText(jinja_path);
      if (!text.ok()) return text.status();
      absl::StatusOr<ChatTemplate> t = FromSource(*text, std::move(special), jinja_path.string());
      if (!t.ok()) return t.status();
      t->source_ = "chat_template.jinja";
      return std::optional<ChatTemplate>(*std::move(t));
    }
  }
  if (config_template.has_value()) {
    absl::StatusOr<ChatTemplate> t =
        FromSource(*config_template, std::move(special), config_origin);
    if (!t.ok()) return t.status();
    t->source_ = "tokenizer_config.json";
    return std::optional<ChatTemplate>(*std::move(t));
  }
  return std::optional<ChatTemplate>();
}

absl::StatusOr<std::string> ChatTemplate::Render(const Request& request) const {
  ojson context = {{"messages", request.messages},
                   {"tools", nullptr},
                   {"documents", nullptr},
                   {"add_generation_prompt", request.add_generation_prompt}};
  for (const auto& [k, v] : special_tokens_.items()) context[k] = v;
  for (const auto& [k, v] : request.kwargs.items()) context[k] = v;
  absl::StatusOr<std::string> rendered = template_.Render(context);
  if (!rendered.ok()) {
    return Invalid("messages",
                   absl::StrCat("the chat template failed at ", rendered.status().message()));
  }
  if (!request.continue_final_message) return rendered;
  // transformers leaves the final message open: the text up to the end of its content, with
  // its trailing whitespace when the template kept it.
  const ojson& last = request.messages.back();
  const std::string final_message = last.value("content", "");
  const std::string stripped = jinja::PythonStrip(final_message, nullptr, true, true);
  const size_t at = rendered->rfind(stripped);
  if (at == std::string::npos) {
    return Invalid("continue_final_message",
                   "the final message does not appear in the prompt the chat template renders");
  }
  const std::string lstripped = jinja::PythonStrip(final_message, nullptr, true, false);
  const size_t keep =
      rendered->compare(at, lstripped.size(), lstripped) == 0 ? lstripped.size() : stripped.size();
  return rendered->substr(0, at + keep);
}

absl::StatusOr<ojson> NormalizeMessages(const ojson& messages) {
  if (!messages.is_array()) return Invalid("messages", "must be an array of {role, content}");
  if (messages.empty()) return Invalid("messages", "must not be empty");
  ojson out = ojson::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    const ojson& m = messages[i];
    const std::string field = absl::StrCat("messages[", i, "]");
    if (!m.is_object()) return Invalid(field, "must be an object");
    ojson n = ojson::object();
    for (const auto& [key, value] : m.items()) {
      const std::string f = absl::StrCat(field, ".", key);
      if (key == "role") {
        if (!value.is_string()) return Invalid(f, "must be a string");
        std::string role = value.get<std::string>();
        if (role == "developer") role = "system";  // OpenAI's newer name for it
        if (role != "system" && role != "user" && role != "assistant") {
          return Invalid(f, absl::StrCat("'", value.get<std::string>(),
                                         "' is not one of system, developer, user, assistant"));
        }
        n["role"] = role;
      } else if (key == "content") {
        if (value.is_null()) continue;
        absl::StatusOr<std::string> content = MessageContent(value, f);
        if (!content.ok()) return content.status();
        n["content"] = *std::move(content);
      } else if (key == "name" || key == "reasoning_content") {
        if (value.is_null()) continue;
        if (!value.is_string()) return Invalid(f, "must be a string");
        n[key] = value;
      } else if (key == "tool_calls" || key == "function_call") {
        if (value.is_null() || (value.is_array() && value.empty())) continue;
        return Invalid(f, "tool calls are not supported");
      } else if (key == "tool_call_id") {
        if (!value.is_null()) return Invalid(f, "tool messages are not supported");
      } else if (!value.is_null()) {
        return Invalid(f, "unknown field (known: role, content, name, reasoning_content)");
      }
    }
    if (!n.contains("role")) return Invalid(absl::StrCat(field, ".role"), "required");
    if (!n.contains("content")) return Invalid(absl::StrCat(field, ".content"), "required");
    // Templates read role and content first; keep that order whatever the client sent.
    ojson ordered = {{"role", n["role"]}, {"content", n["content"]}};
    for (const auto& [k, v] : n.items()) {
      if (k != "role" && k != "content") ordered[k] = v;
    }
    out.push_back(std::move(ordered));
  }
  return out;
}

absl::StatusOr<ChatTemplate::Request> ParseChatTemplateFields(const ojson& body) {
  auto field = [&](const char* name) -> const ojson* {
    const auto it = body.find(name);
    if (it == body.end() || it->is_null()) return nullptr;
    return &*it;
  };
  ChatTemplate::Request r;
  const ojson* messages = field("messages");
  if (messages == nullptr) return Invalid("messages", "required");
  absl::StatusOr<ojson> normalized = NormalizeMessages(*messages);
  if (!normalized.ok()) return normalized.status();
  r.messages = *std::move(normalized);
  for (auto [name, out] :
       {std::pair<const char*, bool*>{"add_generation_prompt", &r.add_generation_prompt},
        {"continue_final_message", &r.continue_final_message}}) {
    if (const ojson* v = field(name)) {
      if (!v->is_boolean()) return Invalid(name, "must be true or false");
      *out = v->get<bool>();
    }
  }
  if (r.continue_final_message && r.add_generation_prompt) {
    return Invalid("continue_final_message",
                   "cannot be true together with add_generation_prompt (set it to false)");
  }
  if (const ojson* kwargs = field("chat_template_kwargs")) {
    if (!kwargs->is_object()) return Invalid("chat_template_kwargs", "must be an object");
    if (DeeperThan(*kwargs, kMaxKwargsDepth)) {
      return Invalid("chat_template_kwargs",
                     absl::StrCat("nests deeper than ", kMaxKwargsDepth, " levels"));
    }
    for (const auto& [k, v] : kwargs->items()) {
      if (k == "messages" || k == "tools" || k == "documents" || k == "add_generation_prompt" ||
          k == "continue_final_message") {
        return Invalid(absl::StrCat("chat_template_kwargs.", k),
                       "is set by the request itself, not through chat_template_kwargs");
      }
    }
    r.kwargs = *kwargs;
  }
  if (field("chat_template") != nullptr) {
    return Invalid("chat_template",
                   "per-request chat templates are not accepted; start specd-http with "
                   "--chat_template FILE");
  }
  if (const ojson* documents = field("documents");
      documents != nullptr && !(documents->is_array() && documents->empty())) {
    return Invalid("documents", "not supported");
  }
  return r;
}

}  // namespace specd
