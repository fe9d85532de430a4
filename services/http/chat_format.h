// Chat messages -> one prompt string for the router, which takes text.
//
// Hugging Face models carry their chat format as a Jinja template in tokenizer_config.json.
// specd does not run Jinja: it recognises the two structural formats most open models use and
// renders them natively, and falls back to a plain, documented format otherwise:
//
//   kChatMl  (template mentions <|im_start|>; Qwen2/2.5/3, many fine-tunes):
//     <|im_start|>{role}\n{content}<|im_end|>\n ... <|im_start|>assistant\n
//   kLlama3  (template mentions <|start_header_id|>; Llama 3, 3.1, 3.2):
//     <|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|> ...
//     <|start_header_id|>assistant<|end_header_id|>\n\n
//   kPlain   (no tokenizer_config.json, no template, or one not recognised):
//     {role}: {content}\n ... assistant:
//
// The beginning-of-sequence token is not rendered: the router tokenizes prompts with
// add_special_tokens, which adds it when the tokenizer asks for it. Template-specific extras
// (Llama 3.1's default "Cutting Knowledge Date" system preamble, tool formats) are not
// reproduced.
#ifndef SPECD_SERVICES_HTTP_CHAT_FORMAT_H_
#define SPECD_SERVICES_HTTP_CHAT_FORMAT_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace specd {

enum class ChatFormat { kPlain, kChatMl, kLlama3 };

const char* ChatFormatName(ChatFormat format);

// The format that `chat_template` (tokenizer_config.json's field, possibly empty) describes.
ChatFormat ChatFormatFromTemplate(absl::string_view chat_template);

// Reads `model_dir`/tokenizer_config.json. A folder without the file, or a file without a
// chat_template, gives kPlain; an unreadable or malformed file is an error naming it.
absl::StatusOr<ChatFormat> ChatFormatFromModelDir(const std::string& model_dir);

// Renders OpenAI chat `messages` (an array of {"role", "content"}; content a string or an array
// of {"type": "text", "text"} parts) followed by the assistant's turn header. Roles: system,
// developer (rendered as system), user, assistant. Errors are INVALID_ARGUMENT naming the
// field, e.g. "messages[2].role: ...".
absl::StatusOr<std::string> RenderChat(const nlohmann::json& messages, ChatFormat format);

}  // namespace specd

#endif  // SPECD_SERVICES_HTTP_CHAT_FORMAT_H_
