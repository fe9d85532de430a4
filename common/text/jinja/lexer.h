// Tokenizer of specd's Jinja engine. It splits a template the way jinja2 3.1's lexer does with
// the environment transformers renders chat templates in (trim_blocks=True, lstrip_blocks=True,
// keep_trailing_newline=False): whitespace control with `-` and `+`, comments, raw blocks, and
// the expression tokens inside {{ }} and {% %}.
#ifndef SPECD_COMMON_TEXT_JINJA_LEXER_H_
#define SPECD_COMMON_TEXT_JINJA_LEXER_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace specd::jinja {

enum class TokenType {
  kData,           // template text, already trimmed as the whitespace rules say
  kVariableBegin,  // {{
  kVariableEnd,    // }}
  kBlockBegin,     // {%
  kBlockEnd,       // %}
  kName,           // identifiers and keywords (if, in, not, ...)
  kString,         // text = the literal's value, escapes decoded
  kInteger,
  kFloat,
  kOperator,  // text = the operator: + - * / // % ** ~ == != < <= > >= = . , : | ( ) [ ] { } ;
  kEof,
};

struct Token {
  TokenType type;
  std::string text;
  int64_t int_value = 0;
  double float_value = 0;
  int line = 1;
  int column = 1;
};

// Errors name the line and column: "line 3, column 14: unexpected '}'".
absl::StatusOr<std::vector<Token>> Tokenize(absl::string_view source);

}  // namespace specd::jinja

#endif  // SPECD_COMMON_TEXT_JINJA_LEXER_H_
