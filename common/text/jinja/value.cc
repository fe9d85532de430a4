#include "common/text/jinja/value.h"

#include <charconv>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace specd::jinja {

const Value* DictData::Find(const Value& key) const {
  for (const auto& [k, v] : items) {
    if (Equals(k, key)) return &v;
  }
  return nullptr;
}

void DictData::Set(Value key, Value value) {
  for (auto& [k, v] : items) {
    if (Equals(k, key)) {
      v = std::move(value);
      return;
    }
  }
  items.emplace_back(std::move(key), std::move(value));
}

Value Value::Undefined(std::string hint) {
  Value v(Kind::kUndefined);
  v.string_ = std::make_shared<const std::string>(std::move(hint));
  return v;
}

Value Value::Bool(bool b) {
  Value v(Kind::kBool);
  v.int_ = b ? 1 : 0;
  return v;
}

Value Value::Int(int64_t i) {
  Value v(Kind::kInt);
  v.int_ = i;
  return v;
}

Value Value::Float(double f) {
  Value v(Kind::kFloat);
  v.float_ = f;
  return v;
}

Value Value::String(std::string s, bool markup) {
  Value v(Kind::kString);
  v.string_ = std::make_shared<const std::string>(std::move(s));
  v.markup_ = markup;
  return v;
}

Value Value::List(std::vector<Value> items) {
  Value v(Kind::kList);
  v.list_ = std::make_shared<const std::vector<Value>>(std::move(items));
  return v;
}

Value Value::Tuple(std::vector<Value> items) {
  Value v(Kind::kTuple);
  v.list_ = std::make_shared<const std::vector<Value>>(std::move(items));
  return v;
}

Value Value::Dict(std::shared_ptr<DictData> dict) {
  Value v(Kind::kDict);
  v.dict_ = std::move(dict);
  return v;
}

Value Value::EmptyDict() { return Dict(std::make_shared<DictData>()); }

Value Value::Namespace(std::shared_ptr<DictData> attributes) {
  Value v(Kind::kNamespace);
  v.dict_ = std::move(attributes);
  return v;
}

Value Value::Callable(std::string name,
                      std::function<absl::StatusOr<Value>(Interpreter&, CallArgs&)> call) {
  Value v(Kind::kCallable);
  v.callable_ =
      std::make_shared<const CallableData>(CallableData{std::move(name), std::move(call)});
  return v;
}

Value Value::Loop(std::shared_ptr<LoopData> loop) {
  Value v(Kind::kLoop);
  v.loop_ = std::move(loop);
  return v;
}

Value Value::Iterator(std::vector<Value> items) {
  Value v(Kind::kIterator);
  v.iterator_ = std::make_shared<IteratorData>();
  v.iterator_->items = std::move(items);
  return v;
}

Value Value::FromJson(const nlohmann::ordered_json& json) {
  switch (json.type()) {
    case nlohmann::json::value_t::null:
      return None();
    case nlohmann::json::value_t::boolean:
      return Bool(json.get<bool>());
    case nlohmann::json::value_t::number_integer:
      return Int(json.get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      const uint64_t u = json.get<uint64_t>();
      // Python ints are unbounded; beyond int64 the value is only ever printed, so a float keeps
      // it meaningful rather than wrapping around.
      if (u > static_cast<uint64_t>(INT64_MAX)) return Float(static_cast<double>(u));
      return Int(static_cast<int64_t>(u));
    }
    case nlohmann::json::value_t::number_float:
      return Float(json.get<double>());
    case nlohmann::json::value_t::string:
      return String(json.get<std::string>());
    case nlohmann::json::value_t::array: {
      std::vector<Value> items;
      items.reserve(json.size());
      for (const nlohmann::ordered_json& item : json) items.push_back(FromJson(item));
      return List(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      auto dict = std::make_shared<DictData>();
      dict->items.reserve(json.size());
      for (const auto& [key, item] : json.items()) {
        dict->items.emplace_back(String(key), FromJson(item));
      }
      return Dict(std::move(dict));
    }
    default:
      return None();
  }
}

double Value::as_double() const {
  return kind_ == Kind::kFloat ? float_ : static_cast<double>(int_);
}

bool Value::Truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
    case Kind::kInt:
      return int_ != 0;
    case Kind::kFloat:
      return float_ != 0;
    case Kind::kString:
      return !string_->empty();
    case Kind::kList:
    case Kind::kTuple:
      return !list_->empty();
    case Kind::kDict:
      return !dict_->items.empty();
    default:
      return true;
  }
}

namespace {

void AppendPythonStringRepr(absl::string_view s, std::string* out) {
  const bool has_single = s.find('\'') != absl::string_view::npos;
  const bool has_double = s.find('"') != absl::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  out->push_back(quote);
  for (uint32_t cp : DecodeUtf8(s)) {
    if (cp == static_cast<uint32_t>(quote) || cp == '\\') {
      out->push_back('\\');
      out->push_back(static_cast<char>(cp));
    } else if (cp == '\n') {
      *out += "\\n";
    } else if (cp == '\r') {
      *out += "\\r";
    } else if (cp == '\t') {
      *out += "\\t";
    } else if (cp < 0x20 || (cp >= 0x7F && cp < 0xA1) || cp == 0xAD) {
      // Python escapes what str.isprintable() rejects; below U+0100 that is exactly these.
      absl::StrAppendFormat(out, "\\x%02x", cp);
    } else if ((cp >= 0x2000 && cp <= 0x200F) || (cp >= 0x2028 && cp <= 0x202F) ||
               (cp >= 0x205F && cp <= 0x206F) || cp == 0x1680 || cp == 0x3000 || cp == 0xFEFF ||
               (cp >= 0xD800 && cp <= 0xDFFF) || (cp >= 0xE000 && cp <= 0xF8FF)) {
      // Separators, format characters and private use: not printable either.
      absl::StrAppendFormat(out, "\\u%04x", cp);
    } else {
      AppendUtf8(cp, out);
    }
  }
  out->push_back(quote);
}

void AppendRepr(const Value& v, std::string* out);

void AppendItems(const std::vector<Value>& items, std::string* out) {
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) *out += ", ";
    AppendRepr(items[i], out);
  }
}

void AppendDictItems(const DictData& dict, std::string* out) {
  *out += "{";
  for (size_t i = 0; i < dict.items.size(); ++i) {
    if (i > 0) *out += ", ";
    AppendRepr(dict.items[i].first, out);
    *out += ": ";
    AppendRepr(dict.items[i].second, out);
  }
  *out += "}";
}

void AppendRepr(const Value& v, std::string* out) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      *out += "Undefined";
      return;
    case Value::Kind::kString:
      AppendPythonStringRepr(v.str(), out);
      return;
    case Value::Kind::kList:
      *out += "[";
      AppendItems(v.items(), out);
      *out += "]";
      return;
    case Value::Kind::kTuple:
      *out += "(";
      AppendItems(v.items(), out);
      if (v.items().size() == 1) *out += ",";
      *out += ")";
      return;
    case Value::Kind::kDict:
      AppendDictItems(v.dict(), out);
      return;
    default:
      *out += v.ToStr();
      return;
  }
}

}  // namespace

std::string Value::ToStr() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "";
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return int_ ? "True" : "False";
    case Kind::kInt:
      return absl::StrCat(int_);
    case Kind::kFloat:
      return FormatFloat(float_);
    case Kind::kString:
      return *string_;
    case Kind::kNamespace: {
      std::string out = "<Namespace ";
      AppendDictItems(*dict_, &out);
      return out + ">";
    }
    case Kind::kCallable:
      return absl::StrCat("<function ", callable_->name, ">");
    case Kind::kLoop:
      return absl::StrCat("<LoopContext ", loop_->index0 + 1, "/", loop_->items->size(), ">");
    case Kind::kIterator:
      return "<generator object>";
    default:
      return Repr();
  }
}

std::string Value::Repr() const {
  std::string out;
  AppendRepr(*this, &out);
  return out;
}

const char* Value::TypeName() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return "list";
    case Kind::kTuple:
      return "tuple";
    case Kind::kDict:
      return "dict";
    case Kind::kNamespace:
      return "Namespace";
    case Kind::kCallable:
      return "function";
    case Kind::kLoop:
      return "LoopContext";
    case Kind::kIterator:
      return "generator";
  }
  return "object";
}

bool Value::SameAs(const Value& other) const {
  if (kind_ != other.kind_) return false;
  switch (kind_) {
    case Kind::kList:
    case Kind::kTuple:
      return list_ == other.list_;
    case Kind::kDict:
    case Kind::kNamespace:
      return dict_ == other.dict_;
    case Kind::kCallable:
      return callable_ == other.callable_;
    case Kind::kLoop:
      return loop_ == other.loop_;
    case Kind::kIterator:
      return iterator_ == other.iterator_;
    default:
      return Equals(*this, other);
  }
}

bool Equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return a.as_int() == b.as_int();
    return a.as_double() == b.as_double();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kString:
      return a.str() == b.str();
    case Value::Kind::kList:
    case Value::Kind::kTuple: {
      if (a.items().size() != b.items().size()) return false;
      for (size_t i = 0; i < a.items().size(); ++i) {
        if (!Equals(a.items()[i], b.items()[i])) return false;
      }
      return true;
    }
    case Value::Kind::kDict: {
      if (a.dict().items.size() != b.dict().items.size()) return false;
      for (const auto& [key, value] : a.dict().items) {
        const Value* other = b.dict().Find(key);
        if (other == nullptr || !Equals(value, *other)) return false;
      }
      return true;
    }
    default:
      return a.SameAs(b);
  }
}

absl::StatusOr<bool> LessThan(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return a.as_int() < b.as_int();
    return a.as_double() < b.as_double();
  }
  if (a.is_string() && b.is_string()) return a.str() < b.str();  // UTF-8 order = code points
  if (a.kind() == b.kind() && a.is_sequence()) {
    const std::vector<Value>& x = a.items();
    const std::vector<Value>& y = b.items();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (Equals(x[i], y[i])) continue;
      return LessThan(x[i], y[i]);
    }
    return x.size() < y.size();
  }
  if (a.is_undefined()) return UndefinedError(a);
  if (b.is_undefined()) return UndefinedError(b);
  return TypeError(absl::StrCat("'<' not supported between instances of '", a.TypeName(), "' and '",
                                b.TypeName(), "'"));
}

std::string FormatFloat(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  char buf[64];
  const std::to_chars_result r =
      std::to_chars(buf, buf + sizeof(buf), f, std::chars_format::scientific);
  absl::string_view sci(buf, r.ptr - buf);
  std::string out;
  if (sci.front() == '-') {
    out = "-";
    sci.remove_prefix(1);
  }
  const size_t e_pos = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, e_pos)) {
    if (c != '.') digits.push_back(c);
  }
  int exponent = 0;
  std::from_chars(sci.data() + e_pos + (sci[e_pos + 1] == '+' ? 2 : 1), sci.data() + sci.size(),
                  exponent);
  // repr() switches to exponent notation outside 1e-4 <= |f| < 1e16.
  if (exponent < -4 || exponent >= 16) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) absl::StrAppend(&out, ".", digits.substr(1));
    absl::StrAppendFormat(&out, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    return out;
  }
  const int point = exponent + 1;  // digits before the decimal point
  if (point <= 0) {
    absl::StrAppend(&out, "0.", std::string(-point, '0'), digits);
  } else if (point >= static_cast<int>(digits.size())) {
    absl::StrAppend(&out, digits, std::string(point - digits.size(), '0'), ".0");
  } else {
    absl::StrAppend(&out, digits.substr(0, point), ".", digits.substr(point));
  }
  return out;
}

namespace {

void AppendJsonString(absl::string_view s, bool ensure_ascii, std::string* out) {
  out->push_back('"');
  for (uint32_t cp : DecodeUtf8(s)) {
    switch (cp) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\r':
        *out += "\\r";
        break;
      case '\t':
        *out += "\\t";
        break;
      case '\b':
        *out += "\\b";
        break;
      case '\f':
        *out += "\\f";
        break;
      default:
        if (cp < 0x20) {
          absl::StrAppendFormat(out, "\\u%04x", cp);
        } else if (ensure_ascii && cp > 0x7E) {
          if (cp >= 0x10000) {
            const uint32_t v = cp - 0x10000;
            absl::StrAppendFormat(out, "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
          } else {
            absl::StrAppendFormat(out, "\\u%04x", cp);
          }
        } else {
          AppendUtf8(cp, out);
        }
    }
  }
  out->push_back('"');
}

std::string JsonFloat(double f) {
  if (std::isnan(f)) return "NaN";
  if (std::isinf(f)) return f > 0 ? "Infinity" : "-Infinity";
  return FormatFloat(f);
}

absl::Status NotSerializable(const Value& v) {
  return TypeError(absl::StrCat("Object of type ", v.TypeName(), " is not JSON serializable"));
}

absl::Status AppendJson(const Value& v, const JsonOptions& o, int depth, std::string* out) {
  const auto newline = [&](int level) {
    *out += "\n";
    for (int i = 0; i < level; ++i) *out += *o.indent;
  };
  switch (v.kind()) {
    case Value::Kind::kNone:
      *out += "null";
      return absl::OkStatus();
    case Value::Kind::kBool:
      *out += v.as_bool() ? "true" : "false";
      return absl::OkStatus();
    case Value::Kind::kInt:
      absl::StrAppend(out, v.as_int());
      return absl::OkStatus();
    case Value::Kind::kFloat:
      *out += JsonFloat(v.as_double());
      return absl::OkStatus();
    case Value::Kind::kString:
      AppendJsonString(v.str(), o.ensure_ascii, out);
      return absl::OkStatus();
    case Value::Kind::kList:
    case Value::Kind::kTuple: {
      if (v.items().empty()) {
        *out += "[]";
        return absl::OkStatus();
      }
      *out += "[";
      for (size_t i = 0; i < v.items().size(); ++i) {
        if (i > 0) *out += o.item_separator;
        if (o.indent) newline(depth + 1);
        if (absl::Status s = AppendJson(v.items()[i], o, depth + 1, out); !s.ok()) return s;
      }
      if (o.indent) newline(depth);
      *out += "]";
      return absl::OkStatus();
    }
    case Value::Kind::kDict: {
      if (v.dict().items.empty()) {
        *out += "{}";
        return absl::OkStatus();
      }
      // json.dumps turns the keys it accepts into strings first, then sorts those.
      std::vector<std::pair<std::string, const Value*>> items;
      for (const auto& [key, value] : v.dict().items) {
        std::string k;
        switch (key.kind()) {
          case Value::Kind::kString:
            k = key.str();
            break;
          case Value::Kind::kBool:
            k = key.as_bool() ? "true" : "false";
            break;
          case Value::Kind::kInt:
            k = absl::StrCat(key.as_int());
            break;
          case Value::Kind::kFloat:
            k = JsonFloat(key.as_double());
            break;
          case Value::Kind::kNone:
            k = "null";
            break;
          default:
            return TypeError(
                absl::StrCat("keys must be str, int, float, bool or None, not ", key.TypeName()));
        }
        items.emplace_back(std::move(k), &value);
      }
      if (o.sort_keys) {
        std::stable_sort(items.begin(), items.end(),
                         [](const auto& a, const auto& b) { return a.first < b.first; });
      }
      *out += "{";
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0) *out += o.item_separator;
        if (o.indent) newline(depth + 1);
        AppendJsonString(items[i].first, o.ensure_ascii, out);
        *out += o.key_separator;
        if (absl::Status s = AppendJson(*items[i].second, o, depth + 1, out); !s.ok()) return s;
      }
      if (o.indent) newline(depth);
      *out += "}";
      return absl::OkStatus();
    }
    default:
      return NotSerializable(v);
  }
}

}  // namespace

absl::StatusOr<std::string> ToJson(const Value& value, const JsonOptions& options) {
  std::string out;
  if (absl::Status s = AppendJson(value, options, 0, &out); !s.ok()) return s;
  return out;
}

absl::StatusOr<nlohmann::json> ToNlohmann(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kNone:
      return nlohmann::json(nullptr);
    case Value::Kind::kBool:
      return nlohmann::json(value.as_bool());
    case Value::Kind::kInt:
      return nlohmann::json(value.as_int());
    case Value::Kind::kFloat:
      return std::isfinite(value.as_double()) ? nlohmann::json(value.as_double())
                                              : nlohmann::json(nullptr);
    case Value::Kind::kString:
      return nlohmann::json(value.str());
    case Value::Kind::kList:
    case Value::Kind::kTuple: {
      nlohmann::json out = nlohmann::json::array();
      for (const Value& item : value.items()) {
        absl::StatusOr<nlohmann::json> j = ToNlohmann(item);
        if (!j.ok()) return j.status();
        out.push_back(*std::move(j));
      }
      return out;
    }
    case Value::Kind::kDict:
    case Value::Kind::kNamespace: {
      nlohmann::json out = nlohmann::json::object();
      for (const auto& [key, item] : value.dict().items) {
        absl::StatusOr<nlohmann::json> j = ToNlohmann(item);
        if (!j.ok()) return j.status();
        out[key.ToStr()] = *std::move(j);
      }
      return out;
    }
    default:
      return NotSerializable(value);
  }
}

absl::Status TypeError(absl::string_view message) { return absl::InvalidArgumentError(message); }

absl::Status UndefinedError(const Value& undefined) {
  return absl::InvalidArgumentError(undefined.str());
}

std::vector<uint32_t> DecodeUtf8(absl::string_view s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    int len = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      len = 1;
      cp = c;
    } else if ((c & 0xE0) == 0xC0 && c >= 0xC2) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0 && c <= 0xF4) {
      len = 4;
      cp = c & 0x07;
    }
    bool ok = len > 0 && i + len <= s.size();
    for (int k = 1; ok && k < len; ++k) {
      const unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) ok = false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (ok && ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)))) {
      ok = false;  // overlong or out of range
    }
    if (!ok) {
      // A byte that is not UTF-8 stays itself, tagged above the code point range.
      out.push_back(0x80000000u | c);
      ++i;
      continue;
    }
    out.push_back(cp);
    i += len;
  }
  return out;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp & 0x80000000u) {
    out->push_back(static_cast<char>(cp & 0xFF));
  } else if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string EncodeUtf8(const std::vector<uint32_t>& cps) {
  std::string out;
  out.reserve(cps.size());
  for (uint32_t cp : cps) AppendUtf8(cp, &out);
  return out;
}

size_t CodePointCount(absl::string_view s) {
  bool ascii = true;
  for (char c : s) ascii &= static_cast<unsigned char>(c) < 0x80;
  return ascii ? s.size() : DecodeUtf8(s).size();
}

bool IsPythonSpace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

}  // namespace specd::jinja
