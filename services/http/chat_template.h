// The served model's chat template: where specd-http finds it, and how OpenAI chat messages
// become a prompt through it, as vLLM's OpenAI server does it with transformers.
//
// The template is Jinja, rendered by specd's engine (common/text/jinja), which reproduces
// jinja2 in transformers' environment byte for byte on real templates. The rendered prompt
// already carries the template's special tokens (Llama's and Mistral's templates write
// {{ bos_token }}), so it is tokenized without adding any: vLLM's `add_special_tokens` default of
// false for chat requests.
#ifndef SPECD_SERVICES_HTTP_CHAT_TEMPLATE_H_
#define SPECD_SERVICES_HTTP_CHAT_TEMPLATE_H_

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/text/jinja/template.h"
#include "nlohmann/json.hpp"

namespace specd {

class ChatTemplate {
 public:
  // Finds the template, highest priority first: `override_file` (--chat_template; a file of
  // Jinja text), `model_dir`/chat_template.jinja (transformers' newer layout, which wins over the
  // config as it does in transformers), `model_dir`/tokenizer_config.json's `chat_template` (a
  // string, or a list of {"name", "template"} of which "default" is used). The special tokens
  // (bos_token, eos_token, ...) come from tokenizer_config.json, as a string or an
  // {"content": ...} object. Either argument may be empty.
  //
  // nullopt when there is no template; an error for a file that cannot be read, malformed JSON,
  // a list without "default", or a template the engine cannot run (the construct is named).
  static absl::StatusOr<std::optional<ChatTemplate>> Load(const std::string& model_dir,
                                                          const std::string& override_file);

  // A template from its text; `special_tokens` is a JSON object of the variables bos_token,
  // eos_token... the template sees; `origin` names it in errors and logs.
  static absl::StatusOr<ChatTemplate> FromSource(const std::string& source,
                                                 nlohmann::ordered_json special_tokens,
                                                 std::string origin);

  // Where the template came from ("models/x/tokenizer_config.json", a file name).
  const std::string& origin() const { return origin_; }
  // Which of Load's places it came from: "--chat_template", "chat_template.jinja" or
  // "tokenizer_config.json"; empty for a template made by FromSource.
  const std::string& source() const { return source_; }

  struct Request {
    nlohmann::ordered_json messages;  // as NormalizeMessages returns them
    bool add_generation_prompt = true;
    bool continue_final_message = false;
    nlohmann::ordered_json kwargs = nlohmann::ordered_json::object();  // chat_template_kwargs
  };

  // The prompt: the template rendered with messages, add_generation_prompt, the special tokens,
  // tools and documents null (as transformers passes them without tools) and the kwargs; with
  // continue_final_message, cut after the last message's text as transformers cuts it.
  // INVALID_ARGUMENT "messages: the chat template failed at line N: ..." when the template
  // raises (for instance on roles that do not alternate).
  absl::StatusOr<std::string> Render(const Request& request) const;

 private:
  ChatTemplate(jinja::Template t, nlohmann::ordered_json special_tokens, std::string origin)
      : template_(std::move(t)),
        special_tokens_(std::move(special_tokens)),
        origin_(std::move(origin)) {}

  jinja::Template template_;
  nlohmann::ordered_json special_tokens_;
  std::string origin_;
  std::string source_;
};

// OpenAI chat `messages` as templates see them: [{"role", "content"[, "name"]}], content a string
// (text parts joined by "\n", as vLLM's string content format does), "developer" renamed
// "system". Roles: system, developer, user, assistant. Errors are INVALID_ARGUMENT naming the
// field ("messages[2].role: ..."); fields the edge cannot honour (tool_calls, tool_call_id,
// non-text parts, unknown keys) are rejected rather than dropped.
absl::StatusOr<nlohmann::ordered_json> NormalizeMessages(const nlohmann::ordered_json& messages);

// The chat-template fields of a chat completion or a /tokenize request body: messages,
// add_generation_prompt (default true), continue_final_message, chat_template_kwargs; the
// per-request `chat_template` and `documents` are refused.
absl::StatusOr<ChatTemplate::Request> ParseChatTemplateFields(const nlohmann::ordered_json& body);

}  // namespace specd

#endif  // SPECD_SERVICES_HTTP_CHAT_TEMPLATE_H_
