// The real chat templates of tests/fixtures/chat_templates (Llama-3.1/3.2-Instruct,
// Mistral-7B-Instruct-v0.3, Qwen2.5-Instruct, Qwen3 with and without thinking, Llama-2-chat)
// rendered by specd's Jinja engine over the message lists of goldens.json, byte for byte equal to
// what Python's jinja2 rendered in the environment transformers uses (see
// tools/oracle/make_chat_goldens.py), including the cases where the template raises.
#include <fstream>
#include <map>
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

TEST(JinjaChatTemplateTest, RealTemplatesMatchJinja2ByteForByte) {
  const ordered golden = ordered::parse(ReadFile("tests/fixtures/chat_templates/goldens.json"));
  const absl::Time now =
      absl::FromCivil(absl::CivilSecond(2024, 11, 5, 12, 34, 56), absl::UTCTimeZone()) +
      absl::Microseconds(789012);
  const Globals globals = Globals::Transformers([now] { return now; }, absl::UTCTimeZone());
  std::map<std::string, int> rendered;
  for (const ordered& entry : golden["templates"]) {
    const std::string file = entry["template"];
    SCOPED_TRACE(file);
    absl::StatusOr<Template> t = Template::Parse(ReadFile("tests/fixtures/chat_templates/" + file));
    ASSERT_TRUE(t.ok()) << t.status();
    for (const ordered& c : entry["cases"]) {
      SCOPED_TRACE(c["name"].get<std::string>() + " " + c["context"].dump().substr(0, 200));
      absl::StatusOr<std::string> out = t->Render(c["context"], globals);
      if (c.contains("output")) {
        ASSERT_TRUE(out.ok()) << out.status();
        EXPECT_EQ(*out, c["output"].get<std::string>());
        ++rendered[file];
      } else {
        ASSERT_FALSE(out.ok()) << *out;
        // Only raise_exception fails these templates; its message passes through unchanged.
        ASSERT_TRUE(c.value("raised", false)) << c["error"];
        EXPECT_TRUE(absl::EndsWith(out.status().message(), ": " + c["error"].get<std::string>()))
            << out.status();
      }
    }
  }
  EXPECT_EQ(rendered.size(), 6u);
  for (const auto& [file, n] : rendered) EXPECT_GE(n, 20) << file;
}

}  // namespace
}  // namespace specd::jinja
