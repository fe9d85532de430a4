// Parser of specd's Jinja engine: tokens to a syntax tree, with jinja2 3.1's grammar and
// operator precedence. It also refuses, with the construct named, everything the interpreter
// would not run as jinja2 does: unknown or unsupported tags, filters, tests, Python methods
// and globals, so a template either renders like jinja2 or fails when it is loaded.
#ifndef SPECD_COMMON_TEXT_JINJA_PARSER_H_
#define SPECD_COMMON_TEXT_JINJA_PARSER_H_

#include <string_view>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/text/jinja/ast.h"

namespace specd::jinja {

// Errors are INVALID_ARGUMENT: "line 4, column 9: '{% call %}' blocks are not supported".
absl::StatusOr<NodeList> ParseTemplate(absl::string_view source);

}  // namespace specd::jinja

#endif  // SPECD_COMMON_TEXT_JINJA_PARSER_H_
