// The real chat templates of tests/fixtures/chat_templates (Llama-3.1/3.2-Instruct,
// Mistral-7B-Instruct-v0.3, Qwen2.5-Instruct, Qwen3 with and without thinking, Llama-2-chat,
// and Hermes-3, Functionary v3.2, gpt-oss and Granite 3.3 for more constructs)
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
        // raise_exception's message passes through unchanged; other errors carry jinja2's
        // message without Python's exception class ("TypeError: ").
        std::string want = c["error"];
        if (!c.value("raised", false)) {
          if (const size_t colon = want.find("Error: "); colon != std::string::npos) {
            want = want.substr(colon + 7);
          }
        }
        EXPECT_TRUE(absl::EndsWith(out.status().message(), ": " + want)) << out.status();
      }
    }
  }
  // Hermes-3's tool-use template needs tools (it iterates them): only its tool case renders.
  EXPECT_EQ(rendered.size(), 10u);
  int total = 0;
  for (const auto& [file, n] : rendered) {
    EXPECT_GE(n, 2) << file;
    total += n;
  }
  EXPECT_EQ(total, 358);
}

}  // namespace
}  // namespace specd::jinja
