// Python's str, list and dict methods for specd's Jinja engine, %-formatting and str.format.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/text/jinja/builtins.h"
#include "common/text/jinja/interpreter.h"
#include "common/text/jinja/methods_internal.h"

namespace specd::jinja {
namespace {

using CodePoints = std::vector<uint32_t>;

// Python's index normalisation for str.find(sub, start, end) and friends.
absl::Status Range(const std::vector<std::optional<Value>>& a, size_t first, int64_t n,
                   int64_t* begin, int64_t* end) {
  *begin = 0;
  *end = n;
  for (size_t k = 0; k < 2; ++k) {
    const std::optional<Value>& v = a[first + k];
    if (!v.has_value() || v->is_none()) continue;
    absl::StatusOr<int64_t> i = IntArg(*v, "slice index");
    if (!i.ok()) return i.status();
    int64_t x = *i < 0 ? *i + n : *i;
    x = std::clamp<int64_t>(x, 0, n);
    (k == 0 ? *begin : *end) = x;
  }
  return absl::OkStatus();
}

int64_t Find(const CodePoints& s, const CodePoints& sub, int64_t begin, int64_t end, bool reverse) {
  if (end - begin < static_cast<int64_t>(sub.size())) return -1;
  const int64_t last = end - static_cast<int64_t>(sub.size());
  for (int64_t k = 0; k <= last - begin; ++k) {
    const int64_t i = reverse ? last - k : begin + k;
    if (std::equal(sub.begin(), sub.end(), s.begin() + i)) return i;
  }
  return -1;
}

std::vector<std::string> SplitWhitespace(const CodePoints& cps, int64_t maxsplit, bool reverse) {
  std::vector<std::string> out;
  const int64_t n = static_cast<int64_t>(cps.size());
  if (!reverse) {
    int64_t i = 0;
    while (true) {
      while (i < n && IsPythonSpace(cps[i])) ++i;
      if (i >= n) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        int64_t e = n;
        while (e > i && IsPythonSpace(cps[e - 1])) --e;
        out.push_back(EncodeUtf8(CodePoints(cps.begin() + i, cps.begin() + e)));
        break;
      }
      int64_t j = i;
      while (j < n && !IsPythonSpace(cps[j])) ++j;
      out.push_back(EncodeUtf8(CodePoints(cps.begin() + i, cps.begin() + j)));
      i = j;
    }
    return out;
  }
  int64_t e = n;
  while (true) {
    while (e > 0 && IsPythonSpace(cps[e - 1])) --e;
    if (e <= 0) break;
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
      int64_t b = 0;
      while (b < e && IsPythonSpace(cps[b])) ++b;
      out.push_back(EncodeUtf8(CodePoints(cps.begin() + b, cps.begin() + e)));
      break;
    }
    int64_t b = e;
    while (b > 0 && !IsPythonSpace(cps[b - 1])) --b;
    out.push_back(EncodeUtf8(CodePoints(cps.begin() + b, cps.begin() + e)));
    e = b;
  }
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<std::string> SplitOn(const std::string& s, const std::string& sep, int64_t maxsplit,
                                 bool reverse) {
  std::vector<std::string> out;
  if (!reverse) {
    size_t pos = 0;
    while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
      const size_t at = s.find(sep, pos);
      if (at == std::string::npos) break;
      out.push_back(s.substr(pos, at - pos));
      pos = at + sep.size();
    }
    out.push_back(s.substr(pos));
    return out;
  }
  size_t end = s.size();
  int64_t splits = 0;
  while (maxsplit < 0 || splits < maxsplit) {
    if (end < sep.size()) break;
    const size_t at = s.rfind(sep, end - sep.size());
    if (at == std::string::npos) break;
    out.push_back(s.substr(at + sep.size(), end - at - sep.size()));
    end = at;
    ++splits;
  }
  out.push_back(s.substr(0, end));
  std::reverse(out.begin(), out.end());
  return out;
}

Value StringList(const std::vector<std::string>& parts) {
  std::vector<Value> items;
  for (const std::string& p : parts) items.push_back(Value::String(p));
  return Value::List(std::move(items));
}

std::string Pad(const std::string& s, int64_t width, const std::string& fill, char align) {
  const int64_t n = static_cast<int64_t>(CodePointCount(s));
  if (width <= n) return s;
  const int64_t total = width - n;
  int64_t left = align == '<' ? 0 : align == '>' ? total : total / 2;
  // str.center puts the odd extra space on the right when the width is even, like CPython.
  if (align == '^' && (total % 2 == 1) && (width % 2 == 1)) left += 1;
  std::string out;
  for (int64_t i = 0; i < left; ++i) out += fill;
  out += s;
  for (int64_t i = 0; i < total - left; ++i) out += fill;
  return out;
}

// One %-conversion of Python's printf-style formatting.
absl::StatusOr<std::string> Convert(const std::string& flags, int64_t width, int precision,
                                    char type, const Value& v) {
  if (v.is_undefined() && type != 's') return UndefinedError(v);
  std::string body;
  switch (type) {
    case 's':
    case 'r':
    case 'a': {
      body = type == 's' ? v.ToStr() : v.Repr();
      if (precision >= 0)
        body = EncodeUtf8([&] {
          CodePoints cps = DecodeUtf8(body);
          cps.resize(std::min<size_t>(cps.size(), precision));
          return cps;
        }());
      const bool left = flags.find('-') != std::string::npos;
      return Pad(body, width, " ", left ? '<' : '>');
    }
    case 'd':
    case 'i':
    case 'u':
    case 'x':
    case 'X':
    case 'o':
    case 'c':
    case 'e':
    case 'E':
    case 'f':
    case 'F':
    case 'g':
    case 'G': {
      if (!v.is_number()) {
        return TypeError(absl::StrCat("%", std::string(1, type),
                                      " format: a real number is "
                                      "required, not ",
                                      v.TypeName()));
      }
      std::string spec = "%" + flags;
      if (width > 0) absl::StrAppend(&spec, width);
      if (precision >= 0) absl::StrAppend(&spec, ".", precision);
      char buf[512];
      if (type == 'c') {
        std::string c;
        AppendUtf8(static_cast<uint32_t>(v.as_int()), &c);
        return Pad(c, width, " ", flags.find('-') != std::string::npos ? '<' : '>');
      }
      if (std::string("diuxXo").find(type) != std::string::npos) {
        const long long i = v.is_integral() ? v.as_int() : static_cast<long long>(v.as_double());
        spec += "ll";
        spec.push_back(type == 'u' || type == 'i' ? 'd' : type);
        std::snprintf(buf, sizeof(buf), spec.c_str(), i);
      } else {
        spec.push_back(type);
        std::snprintf(buf, sizeof(buf), spec.c_str(), v.as_double());
      }
      return std::string(buf);
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unsupported format character '", std::string(1, type), "'"));
  }
}

// str.format's replacement fields: {}, {0}, {name}, with !r / !s and a format spec of
// [[fill]align][width][.precision][type] for types s, d, f, e, g, x, X, %.
absl::StatusOr<std::string> FormatField(const Value& v, const std::string& spec) {
  if (spec.empty()) return v.ToStr();
  const CodePoints cps = DecodeUtf8(spec);
  size_t i = 0;
  std::string fill = " ";
  char align = 0;
  auto is_align = [](uint32_t c) { return c == '<' || c == '>' || c == '^'; };
  if (cps.size() >= 2 && is_align(cps[1])) {
    AppendUtf8(cps[0], &(fill = std::string()));
    align = static_cast<char>(cps[1]);
    i = 2;
  } else if (!cps.empty() && is_align(cps[0])) {
    align = static_cast<char>(cps[0]);
    i = 1;
  }
  int64_t width = 0;
  while (i < cps.size() && cps[i] >= '0' && cps[i] <= '9') width = width * 10 + (cps[i++] - '0');
  int precision = -1;
  if (i < cps.size() && cps[i] == '.') {
    precision = 0;
    ++i;
    while (i < cps.size() && cps[i] >= '0' && cps[i] <= '9')
      precision = precision * 10 + (cps[i++] - '0');
  }
  char type = 0;
  if (i < cps.size()) type = static_cast<char>(cps[i++]);
  if (i != cps.size() || (type != 0 && std::string("sdfegxX%").find(type) == std::string::npos)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the format specification '", spec, "' is not supported"));
  }
  std::string body;
  if (type == 0 || type == 's') {
    if (type == 's' && !v.is_string()) {
      return absl::InvalidArgumentError("Unknown format code 's' for a non-string value");
    }
    body = v.ToStr();
    if (precision >= 0) {
      CodePoints b = DecodeUtf8(body);
      b.resize(std::min<size_t>(b.size(), precision));
      body = EncodeUtf8(b);
    }
    if (align == 0) align = v.is_number() ? '>' : '<';
  } else {
    if (!v.is_number()) {
      return absl::InvalidArgumentError(
          absl::StrCat("Unknown format code '", std::string(1, type), "' for ", v.TypeName()));
    }
    char buf[512];
    if (type == 'd' || type == 'x' || type == 'X') {
      if (!v.is_integral()) {
        return absl::InvalidArgumentError(
            absl::StrCat("Unknown format code '", std::string(1, type), "' for float"));
      }
      std::snprintf(buf, sizeof(buf),
                    type == 'd'   ? "%lld"
                    : type == 'x' ? "%llx"
                                  : "%llX",
                    static_cast<long long>(v.as_int()));
    } else if (type == '%') {
      std::snprintf(buf, sizeof(buf), "%.*f%%", precision < 0 ? 6 : precision, v.as_double() * 100);
    } else {
      const std::string f = absl::StrCat("%.*", std::string(1, type));
      std::snprintf(buf, sizeof(buf), f.c_str(), precision < 0 ? 6 : precision, v.as_double());
    }
    body = buf;
    if (align == 0) align = '>';
  }
  return Pad(body, width, fill, align);
}

absl::StatusOr<std::string> StrFormat(const std::string& format, const CallArgs& args) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < format.size(); ++i) {
    const char c = format[i];
    if (c == '}') {
      if (i + 1 < format.size() && format[i + 1] == '}') {
        out.push_back('}');
        ++i;
        continue;
      }
      return absl::InvalidArgumentError("Single '}' encountered in format string");
    }
    if (c != '{') {
      out.push_back(c);
      continue;
    }
    if (i + 1 < format.size() && format[i + 1] == '{') {
      out.push_back('{');
      ++i;
      continue;
    }
    const size_t close = format.find('}', i);
    if (close == std::string::npos) {
      return absl::InvalidArgumentError("Single '{' encountered in format string");
    }
    std::string field = format.substr(i + 1, close - i - 1);
    i = close;
    std::string spec;
    if (const size_t colon = field.find(':'); colon != std::string::npos) {
      spec = field.substr(colon + 1);
      field.resize(colon);
    }
    char conversion = 0;
    if (const size_t bang = field.find('!'); bang != std::string::npos) {
      conversion = bang + 1 < field.size() ? field[bang + 1] : 0;
      field.resize(bang);
    }
    if (field.find_first_of(".[") != std::string::npos) {
      return absl::InvalidArgumentError(
          "attribute and index lookups in format fields are not "
          "supported");
    }
    const Value* value = nullptr;
    if (field.empty() || absl::ascii_isdigit(field[0])) {
      const size_t index = field.empty() ? auto_index++ : std::stoul(field);
      if (index >= args.positional.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("Replacement index ", index, " out of range for positional args tuple"));
      }
      value = &args.positional[index];
    } else {
      for (const auto& [k, v] : args.keyword) {
        if (k == field) value = &v;
      }
      if (value == nullptr)
        return absl::InvalidArgumentError(absl::StrCat("KeyError: '", field, "'"));
    }
    Value shown = *value;
    if (conversion == 'r') shown = Value::String(value->Repr());
    if (conversion == 's') shown = Value::String(value->ToStr());
    absl::StatusOr<std::string> f = FormatField(shown, spec);
    if (!f.ok()) return f.status();
    out += *f;
  }
  return out;
}

}  // namespace

std::vector<std::string> PythonSplitLines(absl::string_view s) {
  const CodePoints cps = DecodeUtf8(s);
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t i = 0; i < cps.size(); ++i) {
    const uint32_t c = cps[i];
    const bool brk = c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D ||
                     c == 0x1E || c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!brk) continue;
    out.push_back(EncodeUtf8(CodePoints(cps.begin() + start, cps.begin() + i)));
    if (c == '\r' && i + 1 < cps.size() && cps[i + 1] == '\n') ++i;
    start = i + 1;
  }
  if (start < cps.size()) out.push_back(EncodeUtf8(CodePoints(cps.begin() + start, cps.end())));
  return out;
}

absl::StatusOr<std::string> PercentFormat(absl::string_view format, const Value& args) {
  std::vector<Value> positional;
  const Value* mapping = nullptr;
  if (args.kind() == Value::Kind::kTuple) {
    positional = args.items();
  } else if (args.is_dict()) {
    mapping = &args;
  } else {
    positional.push_back(args);
  }
  std::string out;
  size_t next = 0;
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] != '%') {
      out.push_back(format[i]);
      continue;
    }
    if (++i >= format.size()) return absl::InvalidArgumentError("incomplete format");
    if (format[i] == '%') {
      out.push_back('%');
      continue;
    }
    const Value* value = nullptr;
    Value keyed;
    if (format[i] == '(') {
      const size_t close = format.find(')', i);
      if (mapping == nullptr || close == absl::string_view::npos) {
        return TypeError("format requires a mapping");
      }
      const Value* v =
          mapping->dict().Find(Value::String(std::string(format.substr(i + 1, close - i - 1))));
      if (v == nullptr) return absl::InvalidArgumentError("KeyError in %-format");
      keyed = *v;
      value = &keyed;
      i = close + 1;
    }
    std::string flags;
    while (i < format.size() && absl::string_view("-+ #0").find(format[i]) != std::string::npos) {
      flags.push_back(format[i++]);
    }
    int64_t width = 0;
    while (i < format.size() && absl::ascii_isdigit(format[i]))
      width = width * 10 + (format[i++] - '0');
    int precision = -1;
    if (i < format.size() && format[i] == '.') {
      precision = 0;
      ++i;
      while (i < format.size() && absl::ascii_isdigit(format[i]))
        precision = precision * 10 + (format[i++] - '0');
    }
    if (i >= format.size()) return absl::InvalidArgumentError("incomplete format");
    if (value == nullptr) {
      if (mapping != nullptr) return TypeError("format requires a mapping");
      if (next >= positional.size()) return TypeError("not enough arguments for format string");
      value = &positional[next++];
    }
    absl::StatusOr<std::string> piece = Convert(flags, width, precision, format[i], *value);
    if (!piece.ok()) return piece.status();
    out += *piece;
  }
  if (mapping == nullptr && next < positional.size()) {
    return TypeError("not all arguments converted during string formatting");
  }
  return out;
}

absl::StatusOr<Value> CallStrMethod(const Value& self, const std::string& name, CallArgs& args) {
  const std::string& s = self.str();
  auto bind = [&](std::vector<absl::string_view> params, size_t required) {
    return BindArgs(args, name, std::move(params), required);
  };
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    auto a = bind({"chars"}, 0);
    if (!a.ok()) return a.status();
    std::string chars;
    const bool have = (*a)[0].has_value() && !(*a)[0]->is_none();
    if (have) {
      absl::StatusOr<std::string> c = StringArg(*(*a)[0], "strip arg");
      if (!c.ok()) return c.status();
      chars = *c;
    }
    return Value::String(
        PythonStrip(s, have ? &chars : nullptr, name != "rstrip", name != "lstrip"));
  }
  if (name == "upper") return Value::String(PythonUpper(s));
  if (name == "lower" || name == "casefold") return Value::String(PythonLower(s));
  if (name == "title") return Value::String(PythonTitle(s));
  if (name == "capitalize") return Value::String(PythonCapitalize(s));
  if (name == "swapcase") return Value::String(PythonSwapcase(s));
  if (name == "isupper") return Value::Bool(PythonIsUpper(s));
  if (name == "islower") return Value::Bool(PythonIsLower(s));
  if (name == "isalpha") return Value::Bool(PythonIsAlpha(s));
  if (name == "isdigit" || name == "isdecimal" || name == "isnumeric") {
    return Value::Bool(PythonIsDigit(s));
  }
  if (name == "isalnum") return Value::Bool(PythonIsAlnum(s));
  if (name == "isascii") {
    return Value::Bool(std::all_of(s.begin(), s.end(),
                                   [](char c) { return static_cast<unsigned char>(c) < 0x80; }));
  }
  if (name == "isspace") {
    const CodePoints cps = DecodeUtf8(s);
    return Value::Bool(!cps.empty() && std::all_of(cps.begin(), cps.end(), IsPythonSpace));
  }
  if (name == "istitle") {
    const bool cased = PythonLower(s) != s || PythonUpper(s) != s;
    return Value::Bool(cased && PythonTitle(s) == s);
  }
  if (name == "startswith" || name == "endswith") {
    auto a = bind({"prefix", "start", "end"}, 1);
    if (!a.ok()) return a.status();
    if (!(*a)[1].has_value() && !(*a)[2].has_value() && (*a)[0]->is_string()) {
      // Whole-string checks need no code-point view: UTF-8 prefixes are byte prefixes.
      const std::string& x = (*a)[0]->str();
      const bool r = name == "startswith"
                         ? s.compare(0, x.size(), x) == 0
                         : s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
      return Value::Bool(r);
    }
    const CodePoints cps = DecodeUtf8(s);
    int64_t b, e;
    if (absl::Status st = Range(*a, 1, static_cast<int64_t>(cps.size()), &b, &e); !st.ok()) {
      return st;
    }
    std::vector<Value> candidates;
    const Value& p = *(*a)[0];
    if (p.kind() == Value::Kind::kTuple) {
      candidates = p.items();
    } else {
      candidates.push_back(p);
    }
    for (const Value& c : candidates) {
      if (!c.is_string()) {
        return TypeError(
            absl::StrCat(name, " first arg must be str or a tuple of str, not ", c.TypeName()));
      }
      const CodePoints sub = DecodeUtf8(c.str());
      if (static_cast<int64_t>(sub.size()) > e - b) continue;
      const auto at = name == "startswith" ? cps.begin() + b : cps.begin() + e - sub.size();
      if (std::equal(sub.begin(), sub.end(), at)) return Value::Bool(true);
    }
    return Value::Bool(false);
  }
  if (name == "split" || name == "rsplit") {
    auto a = bind({"sep", "maxsplit"}, 0);
    if (!a.ok()) return a.status();
    int64_t maxsplit = -1;
    if ((*a)[1].has_value()) {
      absl::StatusOr<int64_t> m = IntArg(*(*a)[1], "maxsplit");
      if (!m.ok()) return m.status();
      maxsplit = *m;
    }
    if (!(*a)[0].has_value() || (*a)[0]->is_none()) {
      return StringList(SplitWhitespace(DecodeUtf8(s), maxsplit, name == "rsplit"));
    }
    absl::StatusOr<std::string> sep = StringArg(*(*a)[0], "sep");
    if (!sep.ok()) return sep.status();
    if (sep->empty()) return absl::InvalidArgumentError("empty separator");
    return StringList(SplitOn(s, *sep, maxsplit, name == "rsplit"));
  }
  if (name == "splitlines") return StringList(PythonSplitLines(s));
  if (name == "replace") {
    auto a = bind({"old", "new", "count"}, 2);
    if (!a.ok()) return a.status();
    absl::StatusOr<std::string> old = StringArg(*(*a)[0], "replace() argument 1");
    absl::StatusOr<std::string> repl = StringArg(*(*a)[1], "replace() argument 2");
    if (!old.ok()) return old.status();
    if (!repl.ok()) return repl.status();
    int64_t count = -1;
    if ((*a)[2].has_value()) {
      absl::StatusOr<int64_t> c = IntArg(*(*a)[2], "count");
      if (!c.ok()) return c.status();
      count = *c;
    }
    std::string out;
    if (old->empty()) {
      const CodePoints cps = DecodeUtf8(s);
      int64_t done = 0;
      for (size_t i = 0; i <= cps.size(); ++i) {
        if (count < 0 || done < count) {
          out += *repl;
          ++done;
        }
        if (i < cps.size()) AppendUtf8(cps[i], &out);
      }
      return Value::String(std::move(out));
    }
    size_t pos = 0;
    for (int64_t done = 0; count < 0 || done < count; ++done) {
      const size_t at = s.find(*old, pos);
      if (at == std::string::npos) break;
      out.append(s, pos, at - pos);
      out += *repl;
      pos = at + old->size();
    }
    out.append(s, pos, std::string::npos);
    return Value::String(std::move(out));
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
    auto a = bind({"sub", "start", "end"}, 1);
    if (!a.ok()) return a.status();
    absl::StatusOr<std::string> sub = StringArg(*(*a)[0], "must be str");
    if (!sub.ok()) return sub.status();
    const CodePoints cps = DecodeUtf8(s);
    const CodePoints needle = DecodeUtf8(*sub);
    int64_t b, e;
    if (absl::Status st = Range(*a, 1, static_cast<int64_t>(cps.size()), &b, &e); !st.ok()) {
      return st;
    }
    if (name == "count") {
      if (needle.empty()) return Value::Int(std::max<int64_t>(0, e - b + 1));
      int64_t n = 0;
      for (int64_t i = b; (i = Find(cps, needle, i, e, false)) >= 0; i += needle.size()) ++n;
      return Value::Int(n);
    }
    const int64_t at = Find(cps, needle, b, e, name[0] == 'r');
    if (at < 0 && (name == "index" || name == "rindex")) {
      return absl::InvalidArgumentError("substring not found");
    }
    return Value::Int(at);
  }
  if (name == "join") {
    auto a = bind({"iterable"}, 1);
    if (!a.ok()) return a.status();
    absl::StatusOr<std::vector<Value>> items = Interpreter::Iterate(*(*a)[0]);
    if (!items.ok()) return items.status();
    std::string out;
    for (size_t i = 0; i < items->size(); ++i) {
      if (!(*items)[i].is_string()) {
        return TypeError(absl::StrCat("sequence item ", i, ": expected str instance, ",
                                      (*items)[i].TypeName(), " found"));
      }
      if (i > 0) out += s;
      out += (*items)[i].str();
    }
    return Value::String(std::move(out));
  }
  if (name == "removeprefix" || name == "removesuffix") {
    auto a = bind({"affix"}, 1);
    if (!a.ok()) return a.status();
    absl::StatusOr<std::string> x = StringArg(*(*a)[0], name);
    if (!x.ok()) return x.status();
    if (name == "removeprefix" && s.compare(0, x->size(), *x) == 0) {
      return Value::String(s.substr(x->size()));
    }
    if (name == "removesuffix" && !x->empty() && s.size() >= x->size() &&
        s.compare(s.size() - x->size(), x->size(), *x) == 0) {
      return Value::String(s.substr(0, s.size() - x->size()));
    }
    return Value::String(s);
  }
  if (name == "center" || name == "ljust" || name == "rjust" || name == "zfill") {
    auto a = bind({"width", "fillchar"}, 1);
    if (!a.ok()) return a.status();
    absl::StatusOr<int64_t> width = IntArg(*(*a)[0], "width");
    if (!width.ok()) return width.status();
    if (name == "zfill") {
      const int64_t n = static_cast<int64_t>(CodePointCount(s));
      if (*width <= n) return Value::String(s);
      const bool sign = !s.empty() && (s[0] == '-' || s[0] == '+');
      return Value::String(absl::StrCat(sign ? s.substr(0, 1) : "", std::string(*width - n, '0'),
                                        sign ? s.substr(1) : s));
    }
    std::string fill = " ";
    if ((*a)[1].has_value()) {
      absl::StatusOr<std::string> f = StringArg(*(*a)[1], "fillchar");
      if (!f.ok()) return f.status();
      if (CodePointCount(*f) != 1) {
        return TypeError("The fill character must be exactly one character long");
      }
      fill = *f;
    }
    return Value::String(Pad(s, *width, fill,
                             name == "center"  ? '^'
                             : name == "ljust" ? '<'
                                               : '>'));
  }
  if (name == "partition" || name == "rpartition") {
    auto a = bind({"sep"}, 1);
    if (!a.ok()) return a.status();
    absl::StatusOr<std::string> sep = StringArg(*(*a)[0], "sep");
    if (!sep.ok()) return sep.status();
    if (sep->empty()) return absl::InvalidArgumentError("empty separator");
    const size_t at = name == "partition" ? s.find(*sep) : s.rfind(*sep);
    if (at == std::string::npos) {
      return name == "partition"
                 ? Value::Tuple({Value::String(s), Value::String(""), Value::String("")})
                 : Value::Tuple({Value::String(""), Value::String(""), Value::String(s)});
    }
    return Value::Tuple({Value::String(s.substr(0, at)), Value::String(*sep),
                         Value::String(s.substr(at + sep->size()))});
  }
  if (name == "format") {
    absl::StatusOr<std::string> out = StrFormat(s, args);
    if (!out.ok()) return out.status();
    return Value::String(*std::move(out));
  }
  return TypeError(absl::StrCat("'str' object has no method '", name, "'"));
}

absl::StatusOr<Value> CallSequenceMethod(const Value& self, const std::string& name,
                                         CallArgs& args) {
  if (name == "copy") {
    if (!args.positional.empty() || !args.keyword.empty()) {
      return TypeError("copy() takes no arguments");
    }
    return Value::List(self.items());
  }
  absl::StatusOr<std::vector<std::optional<Value>>> a = BindArgs(args, name, {"value"}, 1);
  if (!a.ok()) return a.status();
  int64_t n = 0;
  for (size_t i = 0; i < self.items().size(); ++i) {
    if (!Equals(self.items()[i], *(*a)[0])) continue;
    if (name == "index") return Value::Int(static_cast<int64_t>(i));
    ++n;
  }
  if (name == "index") {
    return absl::InvalidArgumentError(
        absl::StrCat((*a)[0]->Repr(), " is not in ", self.TypeName()));
  }
  return Value::Int(n);
}

absl::StatusOr<Value> CallDictMethod(const Value& self, const std::string& name, CallArgs& args) {
  if (name == "get") {
    absl::StatusOr<std::vector<std::optional<Value>>> a =
        BindArgs(args, "get", {"key", "default"}, 1);
    if (!a.ok()) return a.status();
    if (const Value* v = self.dict().Find(*(*a)[0])) return *v;
    return (*a)[1].has_value() ? *(*a)[1] : Value::None();
  }
  if (!args.positional.empty() || !args.keyword.empty()) {
    return TypeError(absl::StrCat(name, "() takes no arguments"));
  }
  if (name == "copy") {
    auto copy = std::make_shared<DictData>(self.dict());
    return Value::Dict(std::move(copy));
  }
  std::vector<Value> out;
  for (const auto& [k, v] : self.dict().items) {
    if (name == "items") {
      out.push_back(Value::Tuple({k, v}));
    } else {
      out.push_back(name == "keys" ? k : v);
    }
  }
  return Value::List(std::move(out));
}

}  // namespace specd::jinja
