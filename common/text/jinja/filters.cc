// jinja2's builtin filters and tests for specd's Jinja engine, with transformers' tojson.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/text/jinja/builtins.h"
#include "common/text/jinja/interpreter.h"
#include "common/text/jinja/methods_internal.h"

namespace specd::jinja {
namespace {

using Args = std::vector<std::optional<Value>>;

const absl::flat_hash_set<std::string>& SupportedFilters() {
  static const auto* s = new absl::flat_hash_set<std::string>{
      "abs",      "attr",     "batch", "capitalize", "center", "count",      "d",
      "default",  "dictsort", "e",     "escape",     "first",  "float",      "forceescape",
      "format",   "indent",   "int",   "items",      "join",   "last",       "length",
      "list",     "lower",    "map",   "max",        "min",    "reject",     "rejectattr",
      "replace",  "reverse",  "round", "safe",       "select", "selectattr", "sort",
      "string",   "sum",      "title", "tojson",     "trim",   "unique",     "upper",
      "wordcount"};
  return *s;
}

const absl::flat_hash_set<std::string>& UnsupportedFilters() {
  static const auto* s = new absl::flat_hash_set<std::string>{
      "filesizeformat", "groupby",   "pprint", "random",   "slice",  "striptags",
      "truncate",       "urlencode", "urlize", "wordwrap", "xmlattr"};
  return *s;
}

const absl::flat_hash_set<std::string>& SupportedTests() {
  static const auto* s = new absl::flat_hash_set<std::string>{
      "odd",    "even",     "divisibleby", "defined",     "undefined", "filter",   "test",
      "none",   "boolean",  "false",       "true",        "integer",   "float",    "lower",
      "upper",  "string",   "mapping",     "number",      "sequence",  "iterable", "callable",
      "sameas", "escaped",  "in",          "==",          "eq",        "equalto",  "!=",
      "ne",     ">",        "gt",          "greaterthan", "ge",        ">=",       "<",
      "lt",     "lessthan", "<=",          "le"};
  return *s;
}

std::string HtmlEscape(absl::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

// jinja2's make_attrgetter: "a.b.0" looks up a, then b, then item 0.
absl::StatusOr<Value> LookupPath(const Value& item, const Value& attribute,
                                 const std::optional<Value>& dflt) {
  std::vector<Value> parts;
  if (attribute.is_string()) {
    for (absl::string_view p : absl::StrSplit(attribute.str(), '.')) {
      if (!p.empty() && std::all_of(p.begin(), p.end(), absl::ascii_isdigit)) {
        parts.push_back(Value::Int(std::strtoll(std::string(p).c_str(), nullptr, 10)));
      } else {
        parts.push_back(Value::String(std::string(p)));
      }
    }
  } else {
    parts.push_back(attribute);
  }
  Value v = item;
  for (const Value& part : parts) {
    if (v.is_undefined()) return UndefinedError(v);
    absl::StatusOr<Value> next = GetItem(v, part);
    if (!next.ok()) return next;
    v = *std::move(next);
    if (dflt.has_value() && !dflt->is_none() && v.is_undefined()) v = *dflt;
  }
  return v;
}

Value IgnoreCase(const Value& v, bool case_sensitive) {
  if (case_sensitive || !v.is_string()) return v;
  return Value::String(PythonLower(v.str()));
}

// The sort key of `item`: attribute lookups ("a,b" gives a tuple), case folded unless asked.
absl::StatusOr<Value> SortKey(const Value& item, const std::optional<Value>& attribute,
                              bool case_sensitive, bool multi) {
  if (!attribute.has_value() || attribute->is_none()) return IgnoreCase(item, case_sensitive);
  if (multi && attribute->is_string() && attribute->str().find(',') != std::string::npos) {
    std::vector<Value> keys;
    for (absl::string_view a : absl::StrSplit(attribute->str(), ',')) {
      absl::StatusOr<Value> k = LookupPath(item, Value::String(std::string(a)), std::nullopt);
      if (!k.ok()) return k;
      keys.push_back(IgnoreCase(*k, case_sensitive));
    }
    return Value::List(std::move(keys));
  }
  absl::StatusOr<Value> k = LookupPath(item, *attribute, std::nullopt);
  if (!k.ok()) return k;
  return IgnoreCase(*k, case_sensitive);
}

absl::Status StableSortBy(std::vector<Value>* items, const std::vector<Value>& keys, bool reverse) {
  std::vector<size_t> order(items->size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  absl::Status error;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (!error.ok()) return false;
    absl::StatusOr<bool> lt = reverse ? LessThan(keys[b], keys[a]) : LessThan(keys[a], keys[b]);
    if (!lt.ok()) {
      error = lt.status();
      return false;
    }
    return *lt;
  });
  if (!error.ok()) return error;
  std::vector<Value> sorted;
  for (size_t i : order) sorted.push_back((*items)[i]);
  *items = std::move(sorted);
  return absl::OkStatus();
}

bool Flag(const std::optional<Value>& v, bool dflt = false) {
  return v.has_value() ? v->Truthy() : dflt;
}

absl::StatusOr<int64_t> Length(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return 0;
    case Value::Kind::kString:
      return static_cast<int64_t>(CodePointCount(v.str()));
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      return static_cast<int64_t>(v.items().size());
    case Value::Kind::kDict:
      return static_cast<int64_t>(v.dict().items.size());
    case Value::Kind::kLoop:
      return static_cast<int64_t>(v.loop().items->size());
    default:
      return TypeError(absl::StrCat("object of type '", v.TypeName(), "' has no len()"));
  }
}

// Python's int(str) after jinja2's fallback through float(); nullopt when neither parses.
std::optional<double> ParseFloat(std::string s) {
  s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
  const std::string t(absl::StripAsciiWhitespace(s));
  if (t.empty()) return std::nullopt;
  char* end = nullptr;
  const double d = std::strtod(t.c_str(), &end);
  if (end != t.c_str() + t.size()) return std::nullopt;
  // strtod also reads hex floats, which Python's float() does not.
  if (t.find_first_of("xX") != std::string::npos) return std::nullopt;
  return d;
}

absl::StatusOr<Value> IntFilter(const Value& v, const Args& a) {
  const Value dflt = a[0].has_value() ? *a[0] : Value::Int(0);
  int64_t base = 10;
  if (a[1].has_value()) {
    absl::StatusOr<int64_t> b = IntArg(*a[1], "base");
    if (!b.ok()) return b.status();
    base = *b;
  }
  if (v.is_undefined()) return UndefinedError(v);
  if (v.is_integral()) return Value::Int(v.as_int());
  if (v.kind() == Value::Kind::kFloat) {
    if (!std::isfinite(v.as_double())) {
      return absl::InvalidArgumentError("cannot convert float infinity or NaN to integer");
    }
    return Value::Int(static_cast<int64_t>(v.as_double()));
  }
  if (v.is_string()) {
    std::string s(absl::StripAsciiWhitespace(v.str()));
    s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
    if (!s.empty()) {
      char* end = nullptr;
      errno = 0;
      const long long i = std::strtoll(s.c_str(), &end, static_cast<int>(base));
      if (end == s.c_str() + s.size() && errno == 0) return Value::Int(i);
    }
    if (std::optional<double> d = ParseFloat(v.str()); d.has_value() && std::isfinite(*d)) {
      return Value::Int(static_cast<int64_t>(*d));
    }
  }
  return dflt;
}

absl::StatusOr<Value> RoundFilter(const Value& v, const Args& a) {
  int64_t precision = 0;
  if (a[0].has_value()) {
    absl::StatusOr<int64_t> p = IntArg(*a[0], "precision");
    if (!p.ok()) return p.status();
    precision = *p;
  }
  std::string method = "common";
  if (a[1].has_value()) method = a[1]->ToStr();
  if (method != "common" && method != "ceil" && method != "floor") {
    return absl::InvalidArgumentError("method must be common, ceil or floor");
  }
  if (v.is_undefined()) return UndefinedError(v);
  if (!v.is_number()) {
    return TypeError(absl::StrCat("type ", v.TypeName(), " doesn't define __round__ method"));
  }
  if (method != "common") {
    const double scale = std::pow(10.0, static_cast<double>(precision));
    const double x = v.as_double() * scale;
    return Value::Float((method == "ceil" ? std::ceil(x) : std::floor(x)) / scale);
  }
  if (v.is_integral() && precision >= 0) return Value::Int(v.as_int());
  if (precision >= 0 && precision < 300) {
    // printf rounds the exact binary value half-to-even, as Python's round() does.
    char buf[512];
    std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(precision), v.as_double());
    return Value::Float(std::strtod(buf, nullptr));
  }
  const double scale = std::pow(10.0, static_cast<double>(-precision));
  const double r = std::nearbyint(v.as_double() / scale) * scale;
  return v.is_integral() ? Value::Int(static_cast<int64_t>(r)) : Value::Float(r);
}

absl::StatusOr<Value> ToJsonFilter(const Value& v, const Args& a) {
  JsonOptions o;
  o.ensure_ascii = Flag(a[0], false);
  if (a[1].has_value() && !a[1]->is_none()) {
    if (a[1]->is_integral()) {
      o.indent = std::string(std::max<int64_t>(0, a[1]->as_int()), ' ');
    } else if (a[1]->is_string()) {
      o.indent = a[1]->str();
    } else {
      return TypeError("tojson: indent must be an integer or a string");
    }
    o.item_separator = ",";
  }
  if (a[2].has_value() && !a[2]->is_none()) {
    const Value& sep = *a[2];
    if (!sep.is_sequence() || sep.items().size() != 2 || !sep.items()[0].is_string() ||
        !sep.items()[1].is_string()) {
      return TypeError("tojson: separators must be a pair of strings");
    }
    o.item_separator = sep.items()[0].str();
    o.key_separator = sep.items()[1].str();
  }
  o.sort_keys = Flag(a[3], false);
  absl::StatusOr<std::string> s = ToJson(v, o);
  if (!s.ok()) return s.status();
  return Value::String(*std::move(s));
}

absl::StatusOr<Value> IndentFilter(const Value& v, const Args& a) {
  std::string indention = "    ";
  if (a[0].has_value()) {
    if (a[0]->is_string()) {
      indention = a[0]->str();
    } else {
      absl::StatusOr<int64_t> w = IntArg(*a[0], "width");
      if (!w.ok()) return w.status();
      indention = std::string(std::max<int64_t>(0, *w), ' ');
    }
  }
  const std::string s = v.ToStr() + "\n";
  std::vector<std::string> lines = PythonSplitLines(s);
  std::string rv;
  if (Flag(a[2])) {
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i > 0) absl::StrAppend(&rv, "\n", indention);
      rv += lines[i];
    }
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t i = 1; i < lines.size(); ++i) {
      absl::StrAppend(&rv, "\n", lines[i].empty() ? "" : indention, lines[i]);
    }
  }
  if (Flag(a[1])) rv = indention + rv;
  return Value::String(std::move(rv));
}

// select / reject / selectattr / rejectattr.
absl::StatusOr<Value> SelectFilter(Interpreter& interp, absl::string_view name, const Value& v,
                                   CallArgs& args) {
  const bool by_attr = name == "selectattr" || name == "rejectattr";
  const bool keep_if = name == "select" || name == "selectattr";
  if (!v.Truthy()) return Value::Iterator({});
  size_t off = 0;
  Value attr;
  if (by_attr) {
    if (args.positional.empty()) {
      return absl::InvalidArgumentError("Missing parameter for attribute name");
    }
    attr = args.positional[0];
    off = 1;
  }
  std::optional<std::string> test;
  CallArgs test_args;
  if (args.positional.size() > off) {
    test = args.positional[off].ToStr();
    if (TestSupport(*test) != Support::kSupported) {
      return absl::InvalidArgumentError(absl::StrCat("no test named '", *test, "'"));
    }
    test_args.positional.assign(args.positional.begin() + off + 1, args.positional.end());
    test_args.keyword = args.keyword;
  }
  absl::StatusOr<std::vector<Value>> items = Interpreter::Iterate(v);
  if (!items.ok()) return items.status();
  std::vector<Value> out;
  for (Value& item : *items) {
    Value subject = item;
    if (by_attr) {
      absl::StatusOr<Value> s = LookupPath(item, attr, std::nullopt);
      if (!s.ok()) return s;
      subject = *std::move(s);
    }
    bool pass = subject.Truthy();
    if (test.has_value()) {
      CallArgs copy = test_args;
      absl::StatusOr<bool> r = ApplyTest(interp, *test, subject, copy);
      if (!r.ok()) return r.status();
      pass = *r;
    }
    if (pass == keep_if) out.push_back(std::move(item));
  }
  return Value::Iterator(std::move(out));
}

absl::StatusOr<Value> MapFilter(Interpreter& interp, const Value& v, CallArgs& args) {
  if (!v.Truthy()) return Value::Iterator({});
  absl::StatusOr<std::vector<Value>> items = Interpreter::Iterate(v);
  if (!items.ok()) return items.status();
  std::vector<Value> out;
  if (args.positional.empty()) {
    std::optional<Value> attribute, dflt;
    for (auto& [k, x] : args.keyword) {
      if (k == "attribute") {
        attribute = x;
      } else if (k == "default") {
        dflt = x;
      } else {
        return absl::InvalidArgumentError(absl::StrCat("Unexpected keyword argument '", k, "'"));
      }
    }
    if (!attribute.has_value()) return absl::InvalidArgumentError("map requires a filter argument");
    for (const Value& item : *items) {
      absl::StatusOr<Value> r = LookupPath(item, *attribute, dflt);
      if (!r.ok()) return r;
      out.push_back(*std::move(r));
    }
    return Value::Iterator(std::move(out));
  }
  const std::string filter = args.positional[0].ToStr();
  if (FilterSupport(filter) != Support::kSupported) {
    return absl::InvalidArgumentError(absl::StrCat("no filter named '", filter, "'"));
  }
  for (const Value& item : *items) {
    CallArgs rest;
    rest.positional.assign(args.positional.begin() + 1, args.positional.end());
    rest.keyword = args.keyword;
    absl::StatusOr<Value> r = ApplyFilter(interp, filter, item, rest);
    if (!r.ok()) return r;
    out.push_back(*std::move(r));
  }
  return Value::Iterator(std::move(out));
}

absl::StatusOr<Value> MinMax(const Value& v, const Args& a, bool max) {
  absl::StatusOr<std::vector<Value>> items = Interpreter::Iterate(v);
  if (!items.ok()) return items.status();
  if (items->empty()) return Value::Undefined("No aggregated item, sequence was empty.");
  const bool case_sensitive = Flag(a[0]);
  size_t best = 0;
  absl::StatusOr<Value> best_key = SortKey((*items)[0], a[1], case_sensitive, false);
  if (!best_key.ok()) return best_key;
  for (size_t i = 1; i < items->size(); ++i) {
    absl::StatusOr<Value> key = SortKey((*items)[i], a[1], case_sensitive, false);
    if (!key.ok()) return key;
    absl::StatusOr<bool> better = max ? LessThan(*best_key, *key) : LessThan(*key, *best_key);
    if (!better.ok()) return better.status();
    if (*better) {
      best = i;
      best_key = *std::move(key);
    }
  }
  return (*items)[best];
}

}  // namespace

Support FilterSupport(absl::string_view name) {
  const std::string n(name);
  if (SupportedFilters().contains(n)) return Support::kSupported;
  if (UnsupportedFilters().contains(n)) return Support::kUnsupported;
  return Support::kUnknown;
}

Support TestSupport(absl::string_view name) {
  return SupportedTests().contains(std::string(name)) ? Support::kSupported : Support::kUnknown;
}

absl::StatusOr<Value> ApplyFilter(Interpreter& interp, absl::string_view name, const Value& v,
                                  CallArgs& args) {
  auto bind = [&](std::vector<absl::string_view> params, size_t required) {
    return BindArgs(args, name, std::move(params), required);
  };
  if (name == "map") return MapFilter(interp, v, args);
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    return SelectFilter(interp, name, v, args);
  }
  if (name == "format") {
    if (!args.positional.empty() && !args.keyword.empty()) {
      return absl::InvalidArgumentError(
          "can't handle positional and keyword arguments at the same time");
    }
    Value fmt_args = Value::Tuple(args.positional);
    if (!args.keyword.empty()) {
      auto d = std::make_shared<DictData>();
      for (auto& [k, x] : args.keyword) d->Set(Value::String(k), x);
      fmt_args = Value::Dict(std::move(d));
    }
    absl::StatusOr<std::string> s = PercentFormat(v.ToStr(), fmt_args);
    if (!s.ok()) return s.status();
    return Value::String(*std::move(s));
  }

  // Filters with fixed parameters.
  if (name == "default" || name == "d") {
    absl::StatusOr<Args> a = bind({"default_value", "boolean"}, 0);
    if (!a.ok()) return a.status();
    if (v.is_undefined() || (Flag((*a)[1]) && !v.Truthy())) {
      return (*a)[0].has_value() ? *(*a)[0] : Value::String("");
    }
    return v;
  }
  if (name == "tojson") {
    absl::StatusOr<Args> a = bind({"ensure_ascii", "indent", "separators", "sort_keys"}, 0);
    if (!a.ok()) return a.status();
    return ToJsonFilter(v, *a);
  }
  if (name == "indent") {
    absl::StatusOr<Args> a = bind({"width", "first", "blank"}, 0);
    if (!a.ok()) return a.status();
    return IndentFilter(v, *a);
  }
  if (name == "int") {
    absl::StatusOr<Args> a = bind({"default", "base"}, 0);
    if (!a.ok()) return a.status();
    return IntFilter(v, *a);
  }
  if (name == "round") {
    absl::StatusOr<Args> a = bind({"precision", "method"}, 0);
    if (!a.ok()) return a.status();
    return RoundFilter(v, *a);
  }
  if (name == "max" || name == "min") {
    absl::StatusOr<Args> a = bind({"case_sensitive", "attribute"}, 0);
    if (!a.ok()) return a.status();
    return MinMax(v, *a, name == "max");
  }
  if (name == "join") {
    absl::StatusOr<Args> a = bind({"d", "attribute"}, 0);
    if (!a.ok()) return a.status();
    absl::StatusOr<std::vector<Value>> items = Interpreter::Iterate(v);
    if (!items.ok()) return items.status();
    const std::string sep = (*a)[0].has_value() ? (*a)[0]->ToStr() : "";
    std::string out;
    for (size_t i = 0; i < items->size(); ++i) {
      Value item = (*items)[i];
      if ((*a)[1].has_value() && !(*a)[1]->is_none()) {
        absl::StatusOr<Value> x = LookupPath(item, *(*a)[1], std::nullopt);
        if (!x.ok()) return x;
        item = *std::move(x);
      }
      if (i > 0) out += sep;
      out += item.ToStr();
    }
    return Value::String(std::move(out));
  }
  if (name == "sort" || name == "unique") {
    absl::StatusOr<Args> a = name == "sort" ? bind({"reverse", "case_sensitive", "attribute"}, 0)
                                            : bind({"case_sensitive", "attribute"}, 0);
    if (!a.ok()) return a.status();
    absl::StatusOr<std::vector<Value>> items = Interpreter::Iterate(v);
    if (!items.ok()) return items.status();
    const size_t off = name == "sort" ? 1 : 0;
    std::vector<Value> keys;
    for (const Value& item : *items) {
      absl::StatusOr<Value> k = SortKey(item, (*a)[off + 1], Flag((*a)[off]), name == "sort");
      if (!k.ok()) return k;
      keys.push_back(*std::move(k));
    }
    if (name == "sort") {
      if (absl::Status s = StableSortBy(&*items, keys, Flag((*a)[0])); !s.ok()) return s;
      return Value::List(*std::move(items));
    }
    std::vector<Value> out, seen;
    for (size_t i = 0; i < items->size(); ++i) {
      if (std::any_of(seen.begin(), seen.end(),
                      [&](const Value& s) { return Equals(s, keys[i]); })) {
        continue;
      }
      seen.push_back(keys[i]);
      out.push_back((*items)[i]);
    }
    return Value::Iterator(std::move(out));
  }
  if (name == "dictsort") {
    absl::StatusOr<Args> a = bind({"case_sensitive", "by", "reverse"}, 0);
    if (!a.ok()) return a.status();
    if (!v.is_dict()) return TypeError("dictsort: a mapping is required");
    const std::string by = (*a)[1].has_value() ? (*a)[1]->ToStr() : "key";
    if (by != "key" && by != "value") {
      return absl::InvalidArgumentError("You can only sort by either \"key\" or \"value\"");
    }
    std::vector<Value> items, keys;
    for (const auto& [k, x] : v.dict().items) {
      items.push_back(Value::Tuple({k, x}));
      keys.push_back(IgnoreCase(by == "key" ? k : x, Flag((*a)[0])));
    }
    if (absl::Status s = StableSortBy(&items, keys, Flag((*a)[2])); !s.ok()) return s;
    return Value::List(std::move(items));
  }
  if (name == "sum") {
    absl::StatusOr<Args> a = bind({"attribute", "start"}, 0);
    if (!a.ok()) return a.status();
    absl::StatusOr<std::vector<Value>> items = Interpreter::Iterate(v);
    if (!items.ok()) return items.status();
    Value total = (*a)[1].has_value() ? *(*a)[1] : Value::Int(0);
    for (const Value& item : *items) {
      Value x = item;
      if ((*a)[0].has_value() && !(*a)[0]->is_none()) {
        absl::StatusOr<Value> y = LookupPath(item, *(*a)[0], std::nullopt);
        if (!y.ok()) return y;
        x = *std::move(y);
      }
      absl::StatusOr<Value> t = Interpreter::Arithmetic("+", total, x);
      if (!t.ok()) return t;
      total = *std::move(t);
    }
    return total;
  }
  if (name == "batch") {
    absl::StatusOr<Args> a = bind({"linecount", "fill_with"}, 1);
    if (!a.ok()) return a.status();
    absl::StatusOr<int64_t> n = IntArg(*(*a)[0], "linecount");
    if (!n.ok()) return n.status();
    if (*n <= 0) return absl::InvalidArgumentError("batch: linecount must be positive");
    absl::StatusOr<std::vector<Value>> items = Interpreter::Iterate(v);
    if (!items.ok()) return items.status();
    std::vector<Value> out, row;
    for (Value& item : *items) {
      row.push_back(std::move(item));
      if (static_cast<int64_t>(row.size()) == *n)
        out.push_back(Value::List(std::exchange(row, {})));
    }
    if (!row.empty()) {
      if ((*a)[1].has_value() && !(*a)[1]->is_none()) {
        while (static_cast<int64_t>(row.size()) < *n) row.push_back(*(*a)[1]);
      }
      out.push_back(Value::List(std::move(row)));
    }
    return Value::Iterator(std::move(out));
  }
  if (name == "replace") {
    absl::StatusOr<Args> a = bind({"old", "new", "count"}, 2);
    if (!a.ok()) return a.status();
    CallArgs method_args;
    method_args.positional = {Value::String((*a)[0]->ToStr()), Value::String((*a)[1]->ToStr())};
    if ((*a)[2].has_value() && !(*a)[2]->is_none()) method_args.positional.push_back(*(*a)[2]);
    return CallStrMethod(Value::String(v.ToStr()), "replace", method_args);
  }
  if (name == "trim") {
    absl::StatusOr<Args> a = bind({"chars"}, 0);
    if (!a.ok()) return a.status();
    std::string chars;
    const bool have = (*a)[0].has_value() && !(*a)[0]->is_none();
    if (have) chars = (*a)[0]->ToStr();
    return Value::String(PythonStrip(v.ToStr(), have ? &chars : nullptr, true, true));
  }
  if (name == "center") {
    absl::StatusOr<Args> a = bind({"width"}, 0);
    if (!a.ok()) return a.status();
    CallArgs method_args;
    method_args.positional = {(*a)[0].has_value() ? *(*a)[0] : Value::Int(80)};
    return CallStrMethod(Value::String(v.ToStr()), "center", method_args);
  }
  if (name == "float") {
    absl::StatusOr<Args> a = bind({"default"}, 0);
    if (!a.ok()) return a.status();
    if (v.is_undefined()) return UndefinedError(v);
    if (v.is_number()) return Value::Float(v.as_double());
    if (v.is_string()) {
      if (std::optional<double> d = ParseFloat(v.str())) return Value::Float(*d);
    }
    return (*a)[0].has_value() ? *(*a)[0] : Value::Float(0);
  }
  if (name == "attr") {
    absl::StatusOr<Args> a = bind({"name"}, 1);
    if (!a.ok()) return a.status();
    const std::string attr = (*a)[0]->ToStr();
    // Only real attributes: a dict's keys are not attributes.
    if (v.is_dict() && v.dict().Find(Value::String(attr)) != nullptr &&
        MethodSupport(attr) != Support::kSupported) {
      return Value::Undefined(absl::StrCat("'dict object' has no attribute '", attr, "'"));
    }
    return GetAttribute(v, attr);
  }

  // One-argument filters.
  if (!args.positional.empty() || !args.keyword.empty()) {
    return TypeError(absl::StrCat("the filter '", name, "' takes no arguments"));
  }
  if (name == "length" || name == "count") {
    absl::StatusOr<int64_t> n = Length(v);
    if (!n.ok()) return n.status();
    return Value::Int(*n);
  }
  if (name == "list") {
    absl::StatusOr<std::vector<Value>> items = Interpreter::Iterate(v);
    if (!items.ok()) return items.status();
    return Value::List(*std::move(items));
  }
  if (name == "first") {
    if (v.kind() == Value::Kind::kIterator) {
      IteratorData& it = v.iterator();
      if (it.next < it.items.size()) return it.items[it.next++];
      return Value::Undefined("No first item, sequence was empty.");
    }
    absl::StatusOr<std::vector<Value>> items = Interpreter::Iterate(v);
    if (!items.ok()) return items.status();
    if (items->empty()) return Value::Undefined("No first item, sequence was empty.");
    return items->front();
  }
  if (name == "last") {
    if (v.kind() == Value::Kind::kIterator)
      return TypeError("'generator' object is not reversible");
    absl::StatusOr<std::vector<Value>> items = Interpreter::Iterate(v);
    if (!items.ok()) return items.status();
    if (items->empty()) return Value::Undefined("No last item, sequence was empty.");
    return items->back();
  }
  if (name == "reverse") {
    if (v.is_string()) {
      std::vector<uint32_t> cps = DecodeUtf8(v.str());
      std::reverse(cps.begin(), cps.end());
      return Value::String(EncodeUtf8(cps));
    }
    const bool iterator = v.kind() == Value::Kind::kIterator;
    absl::StatusOr<std::vector<Value>> items = Interpreter::Iterate(v);
    if (!items.ok()) return absl::InvalidArgumentError("argument must be iterable");
    std::reverse(items->begin(), items->end());
    return iterator ? Value::List(*std::move(items)) : Value::Iterator(*std::move(items));
  }
  if (name == "items") {
    if (v.is_undefined()) return Value::Iterator({});
    if (!v.is_dict()) return TypeError("Can only get item pairs from a mapping.");
    std::vector<Value> out;
    for (const auto& [k, x] : v.dict().items) out.push_back(Value::Tuple({k, x}));
    return Value::Iterator(std::move(out));
  }
  if (name == "string") return Value::String(v.ToStr(), v.markup());
  if (name == "safe") return Value::String(v.ToStr(), true);
  if (name == "escape" || name == "e" || name == "forceescape") {
    if (v.markup() && name != "forceescape") return v;
    return Value::String(HtmlEscape(v.ToStr()), true);
  }
  if (name == "upper") return Value::String(PythonUpper(v.ToStr()));
  if (name == "lower") return Value::String(PythonLower(v.ToStr()));
  if (name == "title") return Value::String(JinjaTitle(v.ToStr()));
  if (name == "capitalize") return Value::String(PythonCapitalize(v.ToStr()));
  if (name == "abs") {
    if (v.is_undefined()) return UndefinedError(v);
    if (v.is_integral()) return Value::Int(std::llabs(v.as_int()));
    if (v.is_number()) return Value::Float(std::fabs(v.as_double()));
    return TypeError(absl::StrCat("bad operand type for abs(): '", v.TypeName(), "'"));
  }
  if (name == "wordcount") {
    int64_t words = 0;
    bool in_word = false;
    for (uint32_t cp : DecodeUtf8(v.ToStr())) {
      std::string c;
      AppendUtf8(cp, &c);
      const bool word = cp == '_' || PythonIsAlnum(c);
      if (word && !in_word) ++words;
      in_word = word;
    }
    return Value::Int(words);
  }
  return absl::InternalError(absl::StrCat("filter '", name, "' has no implementation"));
}

absl::StatusOr<bool> ApplyTest(Interpreter& interp, absl::string_view name, const Value& v,
                               CallArgs& args) {
  (void)interp;
  const std::string n(name);
  auto one_arg = [&]() -> absl::StatusOr<Value> {
    if (args.positional.size() != 1 || !args.keyword.empty()) {
      return TypeError(absl::StrCat("the test '", n, "' takes one argument"));
    }
    return args.positional[0];
  };
  if (n == "==" || n == "eq" || n == "equalto" || n == "!=" || n == "ne") {
    absl::StatusOr<Value> other = one_arg();
    if (!other.ok()) return other.status();
    return Equals(v, *other) == (n[0] == '=' || n == "eq" || n == "equalto");
  }
  if (n == "<" || n == "lt" || n == "lessthan" || n == ">" || n == "gt" || n == "greaterthan" ||
      n == "<=" || n == "le" || n == ">=" || n == "ge") {
    absl::StatusOr<Value> other = one_arg();
    if (!other.ok()) return other.status();
    const bool less = n == "<" || n == "lt" || n == "lessthan" || n == "<=" || n == "le";
    const bool or_equal = n == "<=" || n == "le" || n == ">=" || n == "ge";
    absl::StatusOr<bool> r = less ? LessThan(v, *other) : LessThan(*other, v);
    if (!r.ok() || *r || !or_equal) return r;
    return Equals(v, *other);
  }
  if (n == "in") {
    absl::StatusOr<Value> seq = one_arg();
    if (!seq.ok()) return seq.status();
    return Interpreter::Contains(*seq, v);
  }
  if (n == "sameas") {
    absl::StatusOr<Value> other = one_arg();
    if (!other.ok()) return other.status();
    return v.SameAs(*other);
  }
  if (n == "divisibleby" || n == "odd" || n == "even") {
    Value divisor = Value::Int(2);
    if (n == "divisibleby") {
      absl::StatusOr<Value> d = one_arg();
      if (!d.ok()) return d.status();
      divisor = *d;
    }
    absl::StatusOr<Value> r = Interpreter::Arithmetic("%", v, divisor);
    if (!r.ok()) return r.status();
    return Equals(*r, Value::Int(n == "odd" ? 1 : 0));
  }
  if (!args.positional.empty() || !args.keyword.empty()) {
    return TypeError(absl::StrCat("the test '", n, "' takes no arguments"));
  }
  if (n == "filter" || n == "test") {
    if (!v.is_string()) return false;
    return (n == "filter" ? FilterSupport(v.str()) : TestSupport(v.str())) == Support::kSupported;
  }
  const Value::Kind k = v.kind();
  if (n == "defined") return !v.is_undefined();
  if (n == "undefined") return v.is_undefined();
  if (n == "none") return v.is_none();
  if (n == "boolean") return v.is_bool();
  if (n == "true") return v.is_bool() && v.as_bool();
  if (n == "false") return v.is_bool() && !v.as_bool();
  if (n == "integer") return k == Value::Kind::kInt;
  if (n == "float") return k == Value::Kind::kFloat;
  if (n == "number") return v.is_number();
  if (n == "string") return v.is_string();
  if (n == "mapping") return v.is_dict();
  if (n == "escaped") return v.markup();
  if (n == "callable") return v.is_callable() || v.is_undefined();
  if (n == "sequence") return v.is_undefined() || v.is_string() || v.is_sequence() || v.is_dict();
  if (n == "iterable") {
    return v.is_undefined() || v.is_string() || v.is_sequence() || v.is_dict() ||
           k == Value::Kind::kIterator || k == Value::Kind::kLoop;
  }
  if (n == "lower") return PythonIsLower(v.ToStr());
  if (n == "upper") return PythonIsUpper(v.ToStr());
  return absl::InternalError(absl::StrCat("test '", n, "' has no implementation"));
}

}  // namespace specd::jinja
