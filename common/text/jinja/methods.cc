// Attribute and item access, the methods of Python's str, list and dict that chat templates
// call, Python's case mappings and %-formatting, and the globals range, dict and namespace.
#include <locale.h>
#include <wctype.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/text/jinja/builtins.h"
#include "common/text/jinja/interpreter.h"
#include "common/text/jinja/methods_internal.h"

namespace specd::jinja {
namespace {

// C.UTF-8 is built into glibc since 2.35, so the wide-character classes are Unicode's.
locale_t Utf8Locale() {
  static const locale_t locale = newlocale(LC_CTYPE_MASK, "C.UTF-8", static_cast<locale_t>(0));
  return locale;
}

bool Tagged(uint32_t cp) { return (cp & 0x80000000u) != 0; }

uint32_t UpperOf(uint32_t cp) {
  if (cp < 0x80) return cp >= 'a' && cp <= 'z' ? cp - 32 : cp;
  if (Tagged(cp) || Utf8Locale() == static_cast<locale_t>(0)) return cp;
  return towupper_l(cp, Utf8Locale());
}

uint32_t LowerOf(uint32_t cp) {
  if (cp < 0x80) return cp >= 'A' && cp <= 'Z' ? cp + 32 : cp;
  if (Tagged(cp) || Utf8Locale() == static_cast<locale_t>(0)) return cp;
  return towlower_l(cp, Utf8Locale());
}

bool IsCased(uint32_t cp) { return UpperOf(cp) != cp || LowerOf(cp) != cp; }
bool IsUpperChar(uint32_t cp) { return LowerOf(cp) != cp; }
bool IsLowerChar(uint32_t cp) { return UpperOf(cp) != cp; }
bool IsAlphaChar(uint32_t cp) {
  if (cp < 0x80) return (cp | 32) >= 'a' && (cp | 32) <= 'z';
  return !Tagged(cp) && Utf8Locale() != static_cast<locale_t>(0) && iswalpha_l(cp, Utf8Locale());
}
bool IsDigitChar(uint32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  return !Tagged(cp) && Utf8Locale() != static_cast<locale_t>(0) && iswalnum_l(cp, Utf8Locale()) &&
         !iswalpha_l(cp, Utf8Locale());
}

// Full upper-case mappings that are longer than one character (Unicode's SpecialCasing).
void AppendUpper(uint32_t cp, std::string* out) {
  switch (cp) {
    case 0xDF:
      *out += "SS";
      return;
    case 0x149:
      *out += "\u02BCN";
      return;
    case 0xFB00:
      *out += "FF";
      return;
    case 0xFB01:
      *out += "FI";
      return;
    case 0xFB02:
      *out += "FL";
      return;
    case 0xFB03:
      *out += "FFI";
      return;
    case 0xFB04:
      *out += "FFL";
      return;
    case 0xFB05:
    case 0xFB06:
      *out += "ST";
      return;
    default:
      AppendUtf8(UpperOf(cp), out);
  }
}

void AppendTitle(uint32_t cp, std::string* out) {
  switch (cp) {
    case 0xDF:
      *out += "Ss";
      return;
    case 0xFB00:
      *out += "Ff";
      return;
    case 0xFB01:
      *out += "Fi";
      return;
    case 0xFB02:
      *out += "Fl";
      return;
    case 0x1C4:
    case 0x1C5:
    case 0x1C6:
      *out += "\u01C5";
      return;
    case 0x1C7:
    case 0x1C8:
    case 0x1C9:
      *out += "\u01C8";
      return;
    case 0x1CA:
    case 0x1CB:
    case 0x1CC:
      *out += "\u01CB";
      return;
    case 0x1F1:
    case 0x1F2:
    case 0x1F3:
      *out += "\u01F2";
      return;
    default:
      AppendUpper(cp, out);
  }
}

// Lower case of cps[i], with Greek final sigma and the dotted capital I.
void AppendLower(const std::vector<uint32_t>& cps, size_t i, std::string* out) {
  const uint32_t cp = cps[i];
  if (cp == 0x130) {
    *out += "i\u0307";
  } else if (cp == 0x3A3 && i > 0 && IsCased(cps[i - 1]) &&
             (i + 1 == cps.size() || !IsCased(cps[i + 1]))) {
    AppendUtf8(0x3C2, out);
  } else {
    AppendUtf8(LowerOf(cp), out);
  }
}

Value Bound(const Value& self, const std::string& name,
            absl::StatusOr<Value> (*method)(const Value&, const std::string&, CallArgs&)) {
  return Value::Callable(name, [self, name, method](Interpreter&, CallArgs& args) {
    return method(self, name, args);
  });
}

std::string TypeObject(const Value& v) {
  if (v.is_none()) return "None";
  return absl::StrCat(v.TypeName(), " object");
}

Value NoAttribute(const Value& v, const std::string& name) {
  return Value::Undefined(absl::StrCat("'", TypeObject(v), "' has no attribute '", name, "'"));
}

Value Unsafe(const Value& v, const std::string& name) {
  return Value::Undefined(
      absl::StrCat("access to attribute '", name, "' of '", v.TypeName(), "' object is unsafe."));
}

const absl::flat_hash_set<std::string>& StrMethods() {
  static const auto* s = new absl::flat_hash_set<std::string>{
      "strip",        "lstrip",       "rstrip",   "startswith", "endswith",  "split",
      "rsplit",       "splitlines",   "replace",  "upper",      "lower",     "title",
      "capitalize",   "swapcase",     "casefold", "find",       "rfind",     "index",
      "rindex",       "count",        "join",     "isdigit",    "isdecimal", "isnumeric",
      "isalpha",      "isalnum",      "isspace",  "isupper",    "islower",   "istitle",
      "removeprefix", "removesuffix", "center",   "ljust",      "rjust",     "zfill",
      "partition",    "rpartition",   "format",   "isascii"};
  return *s;
}

// Every other method of Python 3's str, list and dict: a template calling one is refused.
const absl::flat_hash_set<std::string>& UnsupportedPythonMethods() {
  static const auto* s = new absl::flat_hash_set<std::string>{
      "encode",      "expandtabs", "format_map", "isidentifier",
      "isprintable", "maketrans",  "translate",  "fromkeys"};
  return *s;
}

const absl::flat_hash_set<std::string>& MutatingMethods(const Value& v) {
  static const auto* list = new absl::flat_hash_set<std::string>{
      "append", "clear", "extend", "insert", "pop", "remove", "reverse", "sort"};
  static const auto* dict =
      new absl::flat_hash_set<std::string>{"clear", "pop", "popitem", "setdefault", "update"};
  static const auto* none = new absl::flat_hash_set<std::string>{};
  if (v.kind() == Value::Kind::kList) return *list;
  if (v.is_dict()) return *dict;
  return *none;
}

Value LoopAttribute(const Value& loop_value, const std::string& name) {
  LoopData& loop = loop_value.loop();
  const int64_t n = static_cast<int64_t>(loop.items->size());
  const int64_t i = loop.index0;
  if (name == "index0") return Value::Int(i);
  if (name == "index") return Value::Int(i + 1);
  if (name == "revindex") return Value::Int(n - i);
  if (name == "revindex0") return Value::Int(n - i - 1);
  if (name == "first") return Value::Bool(i == 0);
  if (name == "last") return Value::Bool(i == n - 1);
  if (name == "length") return Value::Int(n);
  if (name == "depth") return Value::Int(1);
  if (name == "depth0") return Value::Int(0);
  if (name == "previtem") {
    return i > 0 ? (*loop.items)[i - 1] : Value::Undefined("there is no previous item");
  }
  if (name == "nextitem") {
    return i + 1 < n ? (*loop.items)[i + 1] : Value::Undefined("there is no next item");
  }
  if (name == "cycle") {
    return Value::Callable(
        "cycle", [loop_value](Interpreter&, CallArgs& args) -> absl::StatusOr<Value> {
          if (args.positional.empty()) return TypeError("no items for cycling given");
          return args.positional[loop_value.loop().index0 % args.positional.size()];
        });
  }
  if (name == "changed") {
    return Value::Callable(
        "changed", [loop_value](Interpreter&, CallArgs& args) -> absl::StatusOr<Value> {
          LoopData& l = loop_value.loop();
          bool same =
              l.changed_last.has_value() && l.changed_last->size() == args.positional.size();
          for (size_t k = 0; same && k < args.positional.size(); ++k) {
            same = Equals((*l.changed_last)[k], args.positional[k]);
          }
          l.changed_last = args.positional;
          return Value::Bool(!same);
        });
  }
  return NoAttribute(loop_value, name);
}

}  // namespace

// ---- argument binding ----

absl::StatusOr<std::vector<std::optional<Value>>> BindArgs(const CallArgs& args,
                                                           absl::string_view function,
                                                           std::vector<absl::string_view> params,
                                                           size_t required) {
  std::vector<std::optional<Value>> out(params.size());
  if (args.positional.size() > params.size()) {
    return TypeError(absl::StrCat(function, "() takes at most ", params.size(), " argument(s) (",
                                  args.positional.size(), " given)"));
  }
  for (size_t i = 0; i < args.positional.size(); ++i) out[i] = args.positional[i];
  for (const auto& [name, value] : args.keyword) {
    const auto it = std::find(params.begin(), params.end(), name);
    if (it == params.end()) {
      return TypeError(
          absl::StrCat(function, "() got an unexpected keyword argument '", name, "'"));
    }
    const size_t i = it - params.begin();
    if (out[i].has_value()) {
      return TypeError(absl::StrCat(function, "() got multiple values for argument '", name, "'"));
    }
    out[i] = value;
  }
  for (size_t i = 0; i < required; ++i) {
    if (!out[i].has_value()) {
      return TypeError(absl::StrCat(function, "() missing required argument '", params[i], "'"));
    }
  }
  return out;
}

absl::StatusOr<std::string> StringArg(const Value& v, absl::string_view what) {
  if (v.is_undefined()) return UndefinedError(v);
  if (!v.is_string()) {
    return TypeError(absl::StrCat(what, " must be str, not ", v.TypeName()));
  }
  return v.str();
}

absl::StatusOr<int64_t> IntArg(const Value& v, absl::string_view what) {
  if (v.is_undefined()) return UndefinedError(v);
  if (!v.is_integral()) {
    return TypeError(
        absl::StrCat(what, ": '", v.TypeName(), "' object cannot be interpreted as an integer"));
  }
  return v.as_int();
}

// ---- case mapping and stripping ----

std::string PythonUpper(absl::string_view s) {
  std::string out;
  for (uint32_t cp : DecodeUtf8(s)) AppendUpper(cp, &out);
  return out;
}

std::string PythonLower(absl::string_view s) {
  const std::vector<uint32_t> cps = DecodeUtf8(s);
  std::string out;
  for (size_t i = 0; i < cps.size(); ++i) AppendLower(cps, i, &out);
  return out;
}

std::string PythonCapitalize(absl::string_view s) {
  const std::vector<uint32_t> cps = DecodeUtf8(s);
  std::string out;
  for (size_t i = 0; i < cps.size(); ++i) {
    if (i == 0) {
      AppendTitle(cps[i], &out);
    } else {
      AppendLower(cps, i, &out);
    }
  }
  return out;
}

std::string PythonTitle(absl::string_view s) {
  const std::vector<uint32_t> cps = DecodeUtf8(s);
  std::string out;
  bool previous_cased = false;
  for (size_t i = 0; i < cps.size(); ++i) {
    if (previous_cased) {
      AppendLower(cps, i, &out);
    } else {
      AppendTitle(cps[i], &out);
    }
    previous_cased = IsCased(cps[i]);
  }
  return out;
}

std::string JinjaTitle(absl::string_view s) {
  const std::vector<uint32_t> cps = DecodeUtf8(s);
  auto separator = [](uint32_t cp) {
    return cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<' || IsPythonSpace(cp);
  };
  std::string out;
  size_t i = 0;
  while (i < cps.size()) {
    size_t j = i;
    const bool sep = separator(cps[i]);
    while (j < cps.size() && separator(cps[j]) == sep) ++j;
    // Each piece: its first character upper-cased, the rest lower-cased.
    std::vector<uint32_t> piece(cps.begin() + i, cps.begin() + j);
    AppendUpper(piece[0], &out);
    for (size_t k = 1; k < piece.size(); ++k) AppendLower(piece, k, &out);
    i = j;
  }
  return out;
}

std::string PythonStrip(absl::string_view s, const std::string* chars, bool left, bool right) {
  std::vector<uint32_t> set;
  if (chars != nullptr) set = DecodeUtf8(*chars);
  auto strip = [&](uint32_t cp) {
    return chars == nullptr ? IsPythonSpace(cp)
                            : std::find(set.begin(), set.end(), cp) != set.end();
  };
  // Only the ends are decoded: contents can be long.
  auto decode_at = [&](size_t pos) {
    const std::vector<uint32_t> cps =
        DecodeUtf8(s.substr(pos, std::min<size_t>(4, s.size() - pos)));
    std::string first;
    AppendUtf8(cps[0], &first);
    return std::make_pair(cps[0], first.size());
  };
  size_t b = 0, e = s.size();
  if (left) {
    while (b < e) {
      const auto [cp, len] = decode_at(b);
      if (!strip(cp)) break;
      b += len;
    }
  }
  if (right) {
    while (e > b) {
      size_t start = e - 1;
      while (start > b && e - start < 4 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) {
        --start;
      }
      const auto [cp, len] = decode_at(start);
      if (start + len != e || !strip(cp)) break;
      e = start;
    }
  }
  return std::string(s.substr(b, e - b));
}

// ---- attribute and item access ----

Value GetAttribute(const Value& object, const std::string& name) {
  if (!name.empty() && name[0] == '_') {
    // The sandbox hides Python internals; a dict may still have such a key.
    if (object.is_dict()) {
      if (const Value* v = object.dict().Find(Value::String(name))) return *v;
    }
    return Value::Undefined(absl::StrCat("access to attribute '", name, "' of '", object.TypeName(),
                                         "' object is unsafe."));
  }
  switch (object.kind()) {
    case Value::Kind::kString:
      if (StrMethods().contains(name)) return Bound(object, name, &CallStrMethod);
      if (UnsupportedPythonMethods().contains(name)) {
        // Defined, as in Python; calls to it are refused when the template is parsed.
        return Value::Callable(name, [name](Interpreter&, CallArgs&) -> absl::StatusOr<Value> {
          return absl::InvalidArgumentError(
              absl::StrCat("the method '", name, "()' is not supported"));
        });
      }
      return NoAttribute(object, name);
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      if (name == "index" || name == "count" ||
          (name == "copy" && object.kind() == Value::Kind::kList)) {
        return Bound(object, name, &CallSequenceMethod);
      }
      if (MutatingMethods(object).contains(name)) return Unsafe(object, name);
      return NoAttribute(object, name);
    case Value::Kind::kDict:
      if (name == "items" || name == "keys" || name == "values" || name == "get" ||
          name == "copy") {
        return Bound(object, name, &CallDictMethod);
      }
      if (MutatingMethods(object).contains(name)) return Unsafe(object, name);
      if (const Value* v = object.dict().Find(Value::String(name))) return *v;
      return NoAttribute(object, name);
    case Value::Kind::kNamespace:
      if (const Value* v = object.dict().Find(Value::String(name))) return *v;
      return NoAttribute(object, name);
    case Value::Kind::kLoop:
      return LoopAttribute(object, name);
    default:
      return NoAttribute(object, name);
  }
}

absl::StatusOr<Value> GetItem(const Value& object, const Value& key) {
  auto no_element = [&]() {
    if (key.is_string()) return NoAttribute(object, key.str());
    return Value::Undefined(absl::StrCat("'", TypeObject(object), "' has no element ", key.Repr()));
  };
  switch (object.kind()) {
    case Value::Kind::kDict:
      if (const Value* v = object.dict().Find(key)) return *v;
      break;
    case Value::Kind::kList:
    case Value::Kind::kTuple:
    case Value::Kind::kString: {
      if (key.is_integral()) {
        int64_t i = key.as_int();
        if (object.is_string()) {
          const std::vector<uint32_t> cps = DecodeUtf8(object.str());
          const int64_t n = static_cast<int64_t>(cps.size());
          if (i < 0) i += n;
          if (i < 0 || i >= n) return no_element();
          std::string c;
          AppendUtf8(cps[i], &c);
          return Value::String(std::move(c));
        }
        const int64_t n = static_cast<int64_t>(object.items().size());
        if (i < 0) i += n;
        if (i < 0 || i >= n) return no_element();
        return object.items()[i];
      }
      break;
    }
    default:
      break;
  }
  if (key.is_string()) {
    const Value attr = GetAttribute(object, key.str());
    if (!attr.is_undefined() || object.kind() != Value::Kind::kDict) return attr;
  }
  return no_element();
}

// ---- globals ----

Value MakeRange() {
  return Value::Callable("range", [](Interpreter&, CallArgs& args) -> absl::StatusOr<Value> {
    if (!args.keyword.empty()) return TypeError("range() takes no keyword arguments");
    if (args.positional.empty() || args.positional.size() > 3) {
      return TypeError(
          absl::StrCat("range expected 1 to 3 arguments, got ", args.positional.size()));
    }
    int64_t v[3] = {0, 0, 1};
    for (size_t i = 0; i < args.positional.size(); ++i) {
      absl::StatusOr<int64_t> n = IntArg(args.positional[i], "range()");
      if (!n.ok()) return n.status();
      v[args.positional.size() == 1 ? 1 : i] = *n;
    }
    if (v[2] == 0) return absl::InvalidArgumentError("range() arg 3 must not be zero");
    std::vector<Value> items;
    for (int64_t i = v[0]; v[2] > 0 ? i < v[1] : i > v[1]; i += v[2]) {
      // jinja2's sandbox caps ranges at 100000 items.
      if (items.size() >= 100000) {
        return absl::InvalidArgumentError(
            "Range too big. The sandbox blocks ranges larger than "
            "MAX_RANGE (100000).");
      }
      items.push_back(Value::Int(i));
    }
    return Value::List(std::move(items));
  });
}

Value MakeDict() {
  return Value::Callable("dict", [](Interpreter&, CallArgs& args) -> absl::StatusOr<Value> {
    auto dict = std::make_shared<DictData>();
    if (args.positional.size() > 1) return TypeError("dict expected at most 1 argument");
    if (!args.positional.empty()) {
      const Value& src = args.positional[0];
      if (!src.is_dict()) return TypeError("dict() of anything but a dict is not supported");
      dict->items = src.dict().items;
    }
    for (auto& [k, v] : args.keyword) dict->Set(Value::String(k), v);
    return Value::Dict(std::move(dict));
  });
}

Value MakeNamespace() {
  return Value::Callable("namespace", [](Interpreter&, CallArgs& args) -> absl::StatusOr<Value> {
    auto attrs = std::make_shared<DictData>();
    for (const Value& v : args.positional) {
      if (!v.is_dict()) return TypeError("namespace() takes dicts and keyword arguments");
      for (const auto& [k, x] : v.dict().items) attrs->Set(k, x);
    }
    for (auto& [k, v] : args.keyword) attrs->Set(Value::String(k), v);
    return Value::Namespace(std::move(attrs));
  });
}

bool IsUnsupportedGlobal(absl::string_view name) {
  return name == "lipsum" || name == "cycler" || name == "joiner";
}

Support MethodSupport(absl::string_view name) {
  const std::string n(name);
  if (UnsupportedPythonMethods().contains(n)) return Support::kUnsupported;
  if (StrMethods().contains(n) || n == "items" || n == "keys" || n == "values" || n == "get" ||
      n == "copy" || n == "index" || n == "count") {
    return Support::kSupported;
  }
  return Support::kUnknown;
}

// Python's case predicates, shared with the lower/upper tests.
bool PythonIsUpper(absl::string_view s) {
  bool cased = false;
  for (uint32_t cp : DecodeUtf8(s)) {
    if (IsLowerChar(cp)) return false;
    cased |= IsUpperChar(cp);
  }
  return cased;
}

bool PythonIsLower(absl::string_view s) {
  bool cased = false;
  for (uint32_t cp : DecodeUtf8(s)) {
    if (IsUpperChar(cp)) return false;
    cased |= IsLowerChar(cp);
  }
  return cased;
}

bool PythonIsAlpha(absl::string_view s) {
  const std::vector<uint32_t> cps = DecodeUtf8(s);
  return !cps.empty() && std::all_of(cps.begin(), cps.end(), IsAlphaChar);
}

bool PythonIsDigit(absl::string_view s) {
  const std::vector<uint32_t> cps = DecodeUtf8(s);
  return !cps.empty() && std::all_of(cps.begin(), cps.end(), IsDigitChar);
}

bool PythonIsAlnum(absl::string_view s) {
  const std::vector<uint32_t> cps = DecodeUtf8(s);
  return !cps.empty() && std::all_of(cps.begin(), cps.end(), [](uint32_t cp) {
    return IsAlphaChar(cp) || IsDigitChar(cp);
  });
}

std::string PythonSwapcase(absl::string_view s) {
  const std::vector<uint32_t> cps = DecodeUtf8(s);
  std::string out;
  for (size_t i = 0; i < cps.size(); ++i) {
    if (IsUpperChar(cps[i])) {
      AppendLower(cps, i, &out);
    } else {
      AppendUpper(cps[i], &out);
    }
  }
  return out;
}

}  // namespace specd::jinja
