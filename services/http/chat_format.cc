#include "services/http/chat_format.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace specd {

using nlohmann::json;

const char* ChatFormatName(ChatFormat format) {
  switch (format) {
    case ChatFormat::kChatMl:
      return "chatml";
    case ChatFormat::kLlama3:
      return "llama3";
    case ChatFormat::kPlain:
      break;
  }
  return "plain";
}

ChatFormat ChatFormatFromTemplate(absl::string_view chat_template) {
  if (absl::StrContains(chat_template, "<|im_start|>")) return ChatFormat::kChatMl;
  if (absl::StrContains(chat_template, "<|start_header_id|>")) return ChatFormat::kLlama3;
  return ChatFormat::kPlain;
}

absl::StatusOr<ChatFormat> ChatFormatFromModelDir(const std::string& model_dir) {
  const std::filesystem::path path = std::filesystem::path(model_dir) / "tokenizer_config.json";
  std::error_code ec;
  if (!std::filesystem::is_directory(model_dir, ec)) {
    return absl::NotFoundError(absl::StrCat(model_dir, ": not a folder"));
  }
  if (!std::filesystem::exists(path, ec)) return ChatFormat::kPlain;
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path.string(), ": cannot be read"));
  std::stringstream text;
  text << in.rdbuf();
  const json config = json::parse(text.str(), /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": not a JSON object"));
  }
  const auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return ChatFormat::kPlain;
  if (it->is_string()) return ChatFormatFromTemplate(it->get<std::string>());
  // Some models ship several named templates: [{"name": "default", "template": "..."}, ...].
  if (it->is_array()) {
    for (const json& entry : *it) {
      if (entry.is_object() && entry.value("name", "") == "default" && entry.contains("template") &&
          entry["template"].is_string()) {
        return ChatFormatFromTemplate(entry["template"].get<std::string>());
      }
    }
    return ChatFormat::kPlain;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(path.string(), ": chat_template is neither a string nor a list"));
}

namespace {

absl::StatusOr<std::string> MessageContent(const json& content, const std::string& field) {
  if (content.is_string()) return content.get<std::string>();
  if (content.is_array()) {
    std::string out;
    for (size_t i = 0; i < content.size(); ++i) {
      const json& part = content[i];
      const std::string part_field = absl::StrCat(field, "[", i, "]");
      if (!part.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(part_field, ": must be an object"));
      }
      const auto type = part.find("type");
      if (type == part.end() || !type->is_string() || type->get<std::string>() != "text") {
        return absl::InvalidArgumentError(
            absl::StrCat(part_field, ".type: only \"text\" content parts are supported"));
      }
      const auto text = part.find("text");
      if (text == part.end() || !text->is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(part_field, ".text: must be a string"));
      }
      out += text->get<std::string>();
    }
    return out;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": must be a string or an array of text parts"));
}

}  // namespace

absl::StatusOr<std::string> RenderChat(const json& messages, ChatFormat format) {
  if (!messages.is_array()) {
    return absl::InvalidArgumentError("messages: must be an array of {role, content} objects");
  }
  if (messages.empty()) return absl::InvalidArgumentError("messages: must not be empty");
  std::string out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    const std::string field = absl::StrCat("messages[", i, "]");
    if (!m.is_object())
      return absl::InvalidArgumentError(absl::StrCat(field, ": must be an object"));
    const auto role_it = m.find("role");
    if (role_it == m.end() || !role_it->is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".role: must be a string"));
    }
    std::string role = role_it->get<std::string>();
    // OpenAI's newer name for the system role.
    if (role == "developer") role = "system";
    if (role != "system" && role != "user" && role != "assistant") {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".role: '", role, "' is not one of system, developer, user, assistant"));
    }
    const auto content_it = m.find("content");
    if (content_it == m.end() || content_it->is_null()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".content: required"));
    }
    absl::StatusOr<std::string> content =
        MessageContent(*content_it, absl::StrCat(field, ".content"));
    if (!content.ok()) return content.status();
    switch (format) {
      case ChatFormat::kChatMl:
        absl::StrAppend(&out, "<|im_start|>", role, "\n", *content, "<|im_end|>\n");
        break;
      case ChatFormat::kLlama3:
        absl::StrAppend(&out, "<|start_header_id|>", role, "<|end_header_id|>\n\n", *content,
                        "<|eot_id|>");
        break;
      case ChatFormat::kPlain:
        absl::StrAppend(&out, role, ": ", *content, "\n");
        break;
    }
  }
  switch (format) {
    case ChatFormat::kChatMl:
      out += "<|im_start|>assistant\n";
      break;
    case ChatFormat::kLlama3:
      out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    case ChatFormat::kPlain:
      out += "assistant:";
      break;
  }
  return out;
}

}  // namespace specd
