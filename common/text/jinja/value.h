// Values of specd's Jinja engine: the Python objects a chat template sees (None, bool, int,
// float, str, list, tuple, dict, jinja2's Undefined and Namespace, callables, the loop object),
// with Python's semantics where templates can observe them: truthiness, equality and ordering,
// str() and repr(), code-point indexing of strings, and json.dumps for tojson.
//
// Containers have reference semantics (a list value shares its elements), as in Python; the
// sandbox forbids mutating lists and dicts, so only namespaces and loop state ever change.
#ifndef SPECD_COMMON_TEXT_JINJA_VALUE_H_
#define SPECD_COMMON_TEXT_JINJA_VALUE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace specd::jinja {

class Value;
class Interpreter;

// Python dict: insertion-ordered; keys compare with Python equality (1 == 1.0 == True).
struct DictData {
  std::vector<std::pair<Value, Value>> items;

  const Value* Find(const Value& key) const;
  void Set(Value key, Value value);
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

// A callable: a global function, a bound method, a macro or a loop helper. `call` reports errors
// as jinja2 would raise them.
struct CallableData {
  std::string name;  // for repr() and error messages
  std::function<absl::StatusOr<Value>(Interpreter&, CallArgs&)> call;
};

// A one-shot iterator, as jinja2's map, select, items, reverse... return: iterating it consumes
// it, it is always true and has no len().
struct IteratorData {
  std::vector<Value> items;
  size_t next = 0;
};

// State of one `for` loop, shared by the `loop` value of its iterations.
struct LoopData {
  std::shared_ptr<const std::vector<Value>> items;
  int64_t index0 = 0;
  std::optional<std::vector<Value>> changed_last;  // loop.changed()'s previous arguments
};

class Value {
 public:
  enum class Kind {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kTuple,
    kDict,
    kNamespace,
    kCallable,
    kLoop,
    kIterator,
  };

  Value() : kind_(Kind::kUndefined) {}
  // Undefined; `hint` is the message jinja2 raises when it is used ("'x' is undefined").
  static Value Undefined(std::string hint);
  static Value None() { return Value(Kind::kNone); }
  static Value Bool(bool b);
  static Value Int(int64_t i);
  static Value Float(double f);
  // `markup`: a markupsafe.Markup (from |safe or |escape): `+` with it escapes the other side.
  static Value String(std::string s, bool markup = false);
  static Value List(std::vector<Value> items);
  static Value Tuple(std::vector<Value> items);
  static Value Dict(std::shared_ptr<DictData> dict);
  static Value EmptyDict();
  static Value Namespace(std::shared_ptr<DictData> attributes);
  static Value Callable(std::string name,
                        std::function<absl::StatusOr<Value>(Interpreter&, CallArgs&)> call);
  static Value Loop(std::shared_ptr<LoopData> loop);
  static Value Iterator(std::vector<Value> items);

  // JSON from a request or tokenizer_config.json: objects become dicts (in the order of the
  // text, as Python's json keeps it), arrays lists.
  static Value FromJson(const nlohmann::ordered_json& json);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  // Python's int, which bool is a subclass of.
  bool is_integral() const { return kind_ == Kind::kInt || kind_ == Kind::kBool; }
  bool is_number() const { return is_integral() || kind_ == Kind::kFloat; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_sequence() const { return kind_ == Kind::kList || kind_ == Kind::kTuple; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_namespace() const { return kind_ == Kind::kNamespace; }
  bool is_callable() const { return kind_ == Kind::kCallable; }
  bool markup() const { return markup_; }

  bool as_bool() const { return int_ != 0; }
  int64_t as_int() const { return int_; }                     // kInt, kBool
  double as_double() const;                                   // any number
  const std::string& str() const { return *string_; }         // kString, kUndefined (hint)
  const std::vector<Value>& items() const { return *list_; }  // kList, kTuple
  const std::shared_ptr<const std::vector<Value>>& shared_items() const { return list_; }
  const DictData& dict() const { return *dict_; }         // kDict, kNamespace
  DictData& mutable_namespace() const { return *dict_; }  // kNamespace
  const std::shared_ptr<DictData>& shared_dict() const { return dict_; }
  const CallableData& callable() const { return *callable_; }
  LoopData& loop() const { return *loop_; }
  IteratorData& iterator() const { return *iterator_; }

  // Python's bool(value); Undefined is false.
  bool Truthy() const;
  // Python's str(value), as {{ value }} prints it; Undefined prints as "".
  std::string ToStr() const;
  // Python's repr(value), as str() of a container prints its elements.
  std::string Repr() const;
  // The type name Python puts in error messages ("str", "int", "NoneType", "dict"...).
  const char* TypeName() const;
  // The same object (Python's `is`) for containers and callables, equal values otherwise.
  bool SameAs(const Value& other) const;

 private:
  explicit Value(Kind kind) : kind_(kind) {}

  Kind kind_;
  bool markup_ = false;
  int64_t int_ = 0;
  double float_ = 0;
  std::shared_ptr<const std::string> string_;
  std::shared_ptr<const std::vector<Value>> list_;
  std::shared_ptr<DictData> dict_;
  std::shared_ptr<const CallableData> callable_;
  std::shared_ptr<LoopData> loop_;
  std::shared_ptr<IteratorData> iterator_;
};

// Python's ==.
bool Equals(const Value& a, const Value& b);
// Python's <; TypeError for values Python does not order ("'<' not supported between ...").
absl::StatusOr<bool> LessThan(const Value& a, const Value& b);

// Python's repr(float): the shortest string that reads back as `f` ("0.1", "1e+16", "inf").
std::string FormatFloat(double f);

struct JsonOptions {
  bool ensure_ascii = false;  // transformers' tojson default
  std::optional<std::string> indent;
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};
// Python's json.dumps. TypeError for values JSON cannot hold (Undefined, callables).
absl::StatusOr<std::string> ToJson(const Value& value, const JsonOptions& options);
// Undefined is an error; tuples become arrays; float infinities and NaN become null.
absl::StatusOr<nlohmann::json> ToNlohmann(const Value& value);

// Errors jinja2 would raise, as INVALID_ARGUMENT with Python's wording.
absl::Status TypeError(absl::string_view message);
absl::Status UndefinedError(const Value& undefined);

// UTF-8 helpers with Python's code-point view of str. Invalid bytes count as one code point
// each and are kept as they are.
std::vector<uint32_t> DecodeUtf8(absl::string_view s);
void AppendUtf8(uint32_t cp, std::string* out);
std::string EncodeUtf8(const std::vector<uint32_t>& cps);
size_t CodePointCount(absl::string_view s);
// Python's str.isspace() for one code point (what strip(), split() and \s use).
bool IsPythonSpace(uint32_t cp);

}  // namespace specd::jinja

#endif  // SPECD_COMMON_TEXT_JINJA_VALUE_H_
