// Helpers shared by the builtin filters, tests and methods of specd's Jinja engine.
#ifndef SPECD_COMMON_TEXT_JINJA_METHODS_INTERNAL_H_
#define SPECD_COMMON_TEXT_JINJA_METHODS_INTERNAL_H_

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/text/jinja/value.h"

namespace specd::jinja {

// Binds positional and keyword arguments to `params` (Python's rules); the first `required`
// must be given. Missing optional ones are nullopt.
absl::StatusOr<std::vector<std::optional<Value>>> BindArgs(const CallArgs& args,
                                                           absl::string_view function,
                                                           std::vector<absl::string_view> params,
                                                           size_t required);
absl::StatusOr<std::string> StringArg(const Value& v, absl::string_view what);
absl::StatusOr<int64_t> IntArg(const Value& v, absl::string_view what);

// Bound-method bodies: `self` is the str, list/tuple or dict, `name` the method.
absl::StatusOr<Value> CallStrMethod(const Value& self, const std::string& name, CallArgs& args);
absl::StatusOr<Value> CallSequenceMethod(const Value& self, const std::string& name,
                                         CallArgs& args);
absl::StatusOr<Value> CallDictMethod(const Value& self, const std::string& name, CallArgs& args);

std::string PythonTitle(absl::string_view s);
std::string PythonSwapcase(absl::string_view s);
bool PythonIsUpper(absl::string_view s);
bool PythonIsLower(absl::string_view s);
bool PythonIsAlpha(absl::string_view s);
bool PythonIsDigit(absl::string_view s);
bool PythonIsAlnum(absl::string_view s);

// Python's str.splitlines() (keepends=False).
std::vector<std::string> PythonSplitLines(absl::string_view s);

}  // namespace specd::jinja

#endif  // SPECD_COMMON_TEXT_JINJA_METHODS_INTERNAL_H_
