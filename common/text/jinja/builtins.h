// The filters, tests, Python methods and globals of specd's Jinja engine: what jinja2's
// builtins and Python's str, list and dict offer to a chat template, as far as real templates
// use them. The parser asks these tables so that a template using anything else is refused when
// it is loaded rather than rendered differently.
#ifndef SPECD_COMMON_TEXT_JINJA_BUILTINS_H_
#define SPECD_COMMON_TEXT_JINJA_BUILTINS_H_

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/text/jinja/value.h"

namespace specd::jinja {

enum class Support { kSupported, kUnsupported, kUnknown };

// kUnsupported: jinja2 has it and specd does not; kUnknown: jinja2 has no such thing either.
Support FilterSupport(absl::string_view name);
Support TestSupport(absl::string_view name);
// A method called on a value (x.name(...)): kUnsupported for methods of Python's str, list or
// dict that specd lacks; kUnknown for names that are none of those (the call fails at render
// time, if it is reached, exactly as in jinja2).
Support MethodSupport(absl::string_view name);
// Globals jinja2 defines that specd does not (lipsum, cycler, joiner).
bool IsUnsupportedGlobal(absl::string_view name);

// Applies filter `name` (FilterSupport() == kSupported) to `value`.
absl::StatusOr<Value> ApplyFilter(Interpreter& interp, absl::string_view name, const Value& value,
                                  CallArgs& args);
// Runs test `name` (TestSupport() == kSupported) on `value`.
absl::StatusOr<bool> ApplyTest(Interpreter& interp, absl::string_view name, const Value& value,
                               CallArgs& args);

// `object.name` as jinja2's sandboxed getattr sees it: Python attributes (bound methods of str,
// list and dict) first, then items of dicts; Undefined when there is none. Mutating methods
// (list.append, dict.update, ...) are Undefined with the sandbox's "unsafe" message.
Value GetAttribute(const Value& object, const std::string& name);
// `object[key]`: items first, then attributes, as jinja2's getitem.
absl::StatusOr<Value> GetItem(const Value& object, const Value& key);

// Python's str % args and jinja2's |format.
absl::StatusOr<std::string> PercentFormat(absl::string_view format, const Value& args);

// Python's case mappings (str.upper, lower, title, capitalize) for whole strings.
std::string PythonUpper(absl::string_view s);
std::string PythonLower(absl::string_view s);
// jinja2's |title (words start after whitespace, '-', '(', '{', '[' or '<').
std::string JinjaTitle(absl::string_view s);
std::string PythonCapitalize(absl::string_view s);
// str.strip(chars) / lstrip / rstrip; chars == nullptr strips Python whitespace.
std::string PythonStrip(absl::string_view s, const std::string* chars, bool left, bool right);

// jinja2's globals range(), dict() and namespace() as callables.
Value MakeRange();
Value MakeDict();
Value MakeNamespace();

}  // namespace specd::jinja

#endif  // SPECD_COMMON_TEXT_JINJA_BUILTINS_H_
