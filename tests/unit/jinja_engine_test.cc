// specd's Jinja engine against Python's jinja2: every small template of
// tests/fixtures/jinja/engine_cases.json (written by tools/oracle/make_chat_goldens.py) renders
// byte for byte as jinja2 rendered it, or fails where jinja2 failed. Then the constructs the
// engine refuses: each fails at Parse() with the construct and its position named.
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/time/civil_time.h"
#include "absl/time/time.h"
#include "common/text/jinja/template.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace specd::jinja {
namespace {

using nlohmann::json;
using ordered = nlohmann::ordered_json;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The instant the oracle freezes strftime_now at (a naive 2024-11-05 12:34:56.789012).
Globals FrozenGlobals() {
  const absl::Time now =
      absl::FromCivil(absl::CivilSecond(2024, 11, 5, 12, 34, 56), absl::UTCTimeZone()) +
      absl::Microseconds(789012);
  return Globals::Transformers([now] { return now; }, absl::UTCTimeZone());
}

TEST(JinjaEngineTest, MatchesJinja2OnEveryConstruct) {
  const ordered golden = ordered::parse(ReadFile("tests/fixtures/jinja/engine_cases.json"));
  const Globals globals = FrozenGlobals();
  ASSERT_GE(golden["cases"].size(), 100u);
  for (const ordered& c : golden["cases"]) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    absl::StatusOr<Template> t = Template::Parse(c["template"].get<std::string>());
    if (c.value("syntax_error", false)) {
      EXPECT_FALSE(t.ok()) << "jinja2: " << c["error"];
      continue;
    }
    ASSERT_TRUE(t.ok()) << t.status();
    absl::StatusOr<std::string> out = t->Render(c["context"], globals);
    if (c.contains("output")) {
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_EQ(*out, c["output"].get<std::string>());
      continue;
    }
    ASSERT_FALSE(out.ok()) << "rendered " << *out << "; jinja2: " << c["error"];
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    // jinja2's message, after our "line N: " prefix (type names such as "TypeError: " are
    // Python's exception classes, which our messages do not carry).
    std::string want = c["error"];
    if (const size_t colon = want.find("Error: "); colon != std::string::npos) {
      want = want.substr(colon + 7);
    }
    EXPECT_TRUE(absl::EndsWith(out.status().message(), want))
        << out.status() << "\n want: " << want;
  }
}

TEST(JinjaEngineTest, RenderErrorsNameTheLine) {
  absl::StatusOr<Template> t =
      Template::Parse("a\n{% if true %}\n{{ raise_exception('no') }}\n{% endif %}");
  ASSERT_TRUE(t.ok()) << t.status();
  absl::StatusOr<std::string> out = t->Render(ordered::object());
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().message(), "line 3: no");
  EXPECT_FALSE(t->Render(ordered::array()).ok());
}

TEST(JinjaEngineTest, UnsupportedConstructsFailAtParseWithTheirName) {
  struct Case {
    std::string source;
    std::string message;  // a part of the error message
  };
  const Case cases[] = {
      {"{% call m() %}x{% endcall %}", "line 1, column 4: '{% call %}' is not supported"},
      {"{% include 'x.jinja' %}", "'{% include %}' is not supported"},
      {"{% extends 'base' %}", "'{% extends %}' is not supported"},
      {"{% import 'm' as m %}", "'{% import %}' is not supported"},
      {"{% do x.append(1) %}", "unknown tag 'do'"},
      {"a\n  {{ x | groupby('k') }}", "line 2, column 10: the filter 'groupby' is not supported"},
      {"{{ x | truncate(5) }}", "the filter 'truncate' is not supported"},
      {"{{ x | nosuchfilter }}", "no filter named 'nosuchfilter'"},
      {"{% if x is nosuchtest %}{% endif %}", "no test named 'nosuchtest'"},
      {"{{ s.encode('utf-8') }}", "the method 'encode()' is not supported"},
      {"{{ s.translate(t) }}", "the method 'translate()' is not supported"},
      {"{{ lipsum(2) }}", "the global 'lipsum()' is not supported"},
      {"{{ cycler('a', 'b') }}", "the global 'cycler()' is not supported"},
      {"{% for x in y recursive %}{{ loop(x) }}{% endfor %}", "recursive loops are not supported"},
      {"{{ f(*args) }}", "'*args' and '**kwargs' in calls are not supported"},
      {"{% set x | upper %}a{% endset %}", "filtered '{% set %}' blocks are not supported"},
      {"{% macro m() %}{{ caller() }}{% endmacro %}", "macros using 'caller' are not supported"},
      {"{{ '\\N{BULLET}' }}", "\\N{...} escapes are not supported"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.source);
    absl::StatusOr<Template> t = Template::Parse(c.source);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(t.status().message(), c.message)) << t.status();
  }
}

TEST(JinjaEngineTest, SyntaxErrorsNameLineAndColumn) {
  struct Case {
    std::string source;
    std::string message;
  };
  const Case cases[] = {
      {"{{ x ", "line 1, column 1: unexpected end of template: '{{' is never closed"},
      {"ok\n{% if x %}never closed", "looking for '{% elif %}' or '{% else %}' or '{% endif %}'"},
      {"{% for x in y %}{% endif %}", "unknown tag 'endif'"},
      {"{{ (1, 2 }}", "line 1, column 10: unexpected '}', expected ')'"},
      {"{{ a b }}", "line 1, column 6: expected end of print statement, got 'b'"},
      {"{% break %}", "'break' outside of a loop"},
      {"{# never closed", "missing end of comment tag"},
      {"{{ 'abc }}", "unterminated string literal"},
      {"{{ x is odd is even }}", "tests cannot be chained with 'is'"},
      {"{{ 1 + }}", "unexpected end of print statement"},
      {"{% set %}", "expected a name"},
      {"{{ x @ y }}", "unexpected character '@'"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.source);
    absl::StatusOr<Template> t = Template::Parse(c.source);
    ASSERT_FALSE(t.ok());
    EXPECT_TRUE(absl::StrContains(t.status().message(), c.message)) << t.status();
  }
}

TEST(JinjaEngineTest, RegisteredGlobalsAndInputTypes) {
  Globals g;
  g.Register("add", [](const std::vector<json>& args) -> absl::StatusOr<json> {
    if (args.size() != 2) return absl::InvalidArgumentError("add() takes two numbers");
    return args[0].get<double>() + args[1].get<double>();
  });
  absl::StatusOr<Template> t = Template::Parse("{{ add(1, 2.5) }} {{ big }} {{ add(1) }}");
  ASSERT_TRUE(t.ok());
  absl::StatusOr<std::string> out = t->Render({{"big", 18446744073709551615ull}}, g);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().message(), "line 1: add() takes two numbers");

  t = Template::Parse("{{ add(1, 2.5) }} {{ big }} {{ strftime_now is defined }}");
  ASSERT_TRUE(t.ok());
  out = t->Render({{"big", 18446744073709551615ull}}, g);
  ASSERT_TRUE(out.ok()) << out.status();
  // Python would print the exact integer; beyond int64 the engine keeps it as a float.
  EXPECT_EQ(*out, "3.5 1.8446744073709552e+19 False");
}

}  // namespace
}  // namespace specd::jinja
