#include "common/text/jinja/template.h"

#include <ctime>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/text/jinja/ast.h"
#include "common/text/jinja/builtins.h"
#include "common/text/jinja/interpreter.h"
#include "common/text/jinja/parser.h"
#include "common/text/jinja/value.h"

namespace specd::jinja {
namespace {

// Python's datetime.strftime for a naive datetime: %f is the microseconds, %z and %Z are
// empty, everything else is the C library's strftime (as CPython delegates it).
std::string Strftime(const std::string& format, absl::Time t, absl::TimeZone tz) {
  const std::tm tm = absl::ToTM(t, tz);
  const absl::TimeZone::CivilInfo ci = tz.At(t);
  std::string expanded;
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] == '%' && i + 1 < format.size()) {
      const char c = format[i + 1];
      if (c == 'f') {
        expanded += absl::StrFormat("%06d", static_cast<int>(ci.subsecond / absl::Microseconds(1)));
        ++i;
        continue;
      }
      if (c == 'z' || c == 'Z') {
        ++i;
        continue;
      }
      expanded.push_back('%');
      expanded.push_back(c);
      ++i;
      continue;
    }
    expanded.push_back(format[i]);
  }
  if (expanded.empty()) return "";
  std::string out(expanded.size() * 4 + 256, '\0');
  const size_t n = std::strftime(out.data(), out.size(), expanded.c_str(), &tm);
  out.resize(n);
  return out;
}

std::string ArgString(const std::vector<nlohmann::json>& args, size_t i) {
  if (i >= args.size() || args[i].is_null()) return "";
  return args[i].is_string() ? args[i].get<std::string>() : args[i].dump();
}

}  // namespace

Globals Globals::Transformers(std::function<absl::Time()> clock, absl::TimeZone time_zone) {
  Globals g;
  g.Register("raise_exception",
             [](const std::vector<nlohmann::json>& args) -> absl::StatusOr<nlohmann::json> {
               return absl::InvalidArgumentError(ArgString(args, 0));
             });
  g.Register("strftime_now",
             [clock, time_zone](
                 const std::vector<nlohmann::json>& args) -> absl::StatusOr<nlohmann::json> {
               if (args.size() != 1 || !args[0].is_string()) {
                 return absl::InvalidArgumentError("strftime_now() takes one format string");
               }
               return nlohmann::json(Strftime(args[0].get<std::string>(), clock(), time_zone));
             });
  return g;
}

void Globals::Register(std::string name, Function function) {
  functions_.emplace_back(std::move(name), std::move(function));
}

absl::StatusOr<Template> Template::Parse(absl::string_view source) {
  absl::StatusOr<NodeList> nodes = ParseTemplate(source);
  if (!nodes.ok()) return nodes.status();
  return Template(std::make_shared<const NodeList>(*std::move(nodes)));
}

absl::StatusOr<std::string> Template::Render(const nlohmann::ordered_json& context) const {
  static const Globals* transformers = new Globals(Globals::Transformers());
  return Render(context, *transformers);
}

absl::StatusOr<std::string> Template::Render(const nlohmann::ordered_json& context,
                                             const Globals& globals) const {
  if (!context.is_object()) {
    return absl::InvalidArgumentError("the template context must be a JSON object");
  }
  absl::flat_hash_map<std::string, Value> builtins = {
      {"range", MakeRange()}, {"dict", MakeDict()}, {"namespace", MakeNamespace()}};
  for (const auto& [name, function] : globals.functions_) {
    Function fn = function;
    builtins[name] =
        Value::Callable(name, [fn](Interpreter&, CallArgs& args) -> absl::StatusOr<Value> {
          std::vector<nlohmann::json> json_args;
          for (const Value& v : args.positional) {
            if (v.is_undefined()) {
              json_args.push_back(nullptr);
              continue;
            }
            absl::StatusOr<nlohmann::json> j = ToNlohmann(v);
            if (!j.ok()) return j.status();
            json_args.push_back(*std::move(j));
          }
          absl::StatusOr<nlohmann::json> r = fn(json_args);
          if (!r.ok()) return r.status();
          return Value::FromJson(nlohmann::ordered_json(*r));
        });
  }
  auto root = std::make_shared<Frame>(nullptr);
  for (const auto& [key, value] : context.items()) root->Set(key, Value::FromJson(value));
  Interpreter interp(&builtins);
  std::string out;
  absl::Status s = interp.Render(*nodes_, root, &out);
  if (!s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("line ", interp.error_line(), ": ", s.message()));
  }
  return out;
}

}  // namespace specd::jinja
