// specd's Jinja engine: the subset of Jinja that Hugging Face chat templates use, rendered as
// transformers renders them (jinja2 3.1's ImmutableSandboxedEnvironment with trim_blocks,
// lstrip_blocks and the loopcontrols extension; transformers' tojson, raise_exception and
// strftime_now; the {% generation %} tag). Python's jinja2 is the oracle: tests compare the
// output byte for byte on real templates (tests/fixtures/chat_templates).
//
// A template using a construct the engine lacks (a tag, filter, test, Python method or global)
// fails in Parse() with the construct named, never renders differently.
//
//   absl::StatusOr<jinja::Template> t = jinja::Template::Parse(source);
//   absl::StatusOr<std::string> text = t->Render({{"messages", ...}, {"add_generation_prompt",
//                                                 true}, {"bos_token", "<s>"}});
#ifndef SPECD_COMMON_TEXT_JINJA_TEMPLATE_H_
#define SPECD_COMMON_TEXT_JINJA_TEMPLATE_H_

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace specd::jinja {

struct Node;

// A global function templates can call, with its arguments and result as JSON (Undefined
// arguments arrive as null; keyword arguments are not passed). An error status makes the render
// fail with its message.
using Function =
    std::function<absl::StatusOr<nlohmann::json>(const std::vector<nlohmann::json>& args)>;

// Functions a render can call besides jinja2's range, dict and namespace.
class Globals {
 public:
  Globals() = default;

  // transformers' globals: raise_exception(message) fails the render with `message`;
  // strftime_now(format) formats clock() in `time_zone` as Python's datetime.now().strftime
  // does (a naive local time: %z and %Z print nothing).
  static Globals Transformers(std::function<absl::Time()> clock = absl::Now,
                              absl::TimeZone time_zone = absl::LocalTimeZone());

  void Register(std::string name, Function function);

 private:
  friend class Template;
  std::vector<std::pair<std::string, Function>> functions_;
};

class Template {
 public:
  // Errors are INVALID_ARGUMENT naming line, column and the construct: "line 3, column 12: the
  // filter 'groupby' is not supported by specd's chat-template engine".
  static absl::StatusOr<Template> Parse(absl::string_view source);

  // Renders with the top-level variables of `context` (a JSON object; ordered_json keeps the
  // key order of the text, which dict iteration and tojson show) and Globals::Transformers().
  absl::StatusOr<std::string> Render(const nlohmann::ordered_json& context) const;
  // Errors are INVALID_ARGUMENT: "line 12: <jinja2's message>", and for raise_exception
  // "line 12: <the template's message>".
  absl::StatusOr<std::string> Render(const nlohmann::ordered_json& context,
                                     const Globals& globals) const;

 private:
  explicit Template(std::shared_ptr<const std::vector<std::unique_ptr<Node>>> nodes)
      : nodes_(std::move(nodes)) {}

  std::shared_ptr<const std::vector<std::unique_ptr<Node>>> nodes_;
};

}  // namespace specd::jinja

#endif  // SPECD_COMMON_TEXT_JINJA_TEMPLATE_H_
