// Every bad GenerateRequest field is refused with INVALID_ARGUMENT naming the field.
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "services/router/request_validation.h"

namespace specd {
namespace {

RequestLimits Limits() {
  RequestLimits l;
  l.vocab_size = 320;
  l.max_context = 64;
  l.eos_token_ids = {256};
  l.max_new_tokens_limit = 100;
  l.default_max_new_tokens = 10;
  return l;
}

v1::GenerateRequest Valid() {
  v1::GenerateRequest r;
  r.set_prompt("hello");
  r.set_max_new_tokens(20);
  return r;
}

struct BadCase {
  std::string field;
  std::function<void(v1::GenerateRequest*)> mutate;
};

TEST(RouterValidationTest, ValidRequestPasses) {
  EXPECT_TRUE(ValidateGenerateRequest(Valid(), Limits()).ok());
  v1::GenerateRequest r = Valid();
  r.mutable_prompt_ids()->add_ids(5);
  r.set_temperature(0.7f);
  r.set_top_p(1.0f);
  r.set_top_k(0);
  r.add_stop("\n\n");
  r.add_stop_token_ids(319);
  r.set_draft_max_nodes(256);
  r.set_max_new_tokens(100);
  EXPECT_TRUE(ValidateGenerateRequest(r, Limits()).ok());
}

TEST(RouterValidationTest, EachBadFieldIsNamed) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<BadCase> cases = {
      {"prompt", [](v1::GenerateRequest* r) { r->set_prompt(""); }},
      {"request_id", [](v1::GenerateRequest* r) { r->set_request_id(std::string(129, 'x')); }},
      {"prompt", [](v1::GenerateRequest* r) { r->clear_input(); }},
      {"prompt_ids.ids", [](v1::GenerateRequest* r) { r->mutable_prompt_ids(); }},
      {"prompt_ids.ids[1]",
       [](v1::GenerateRequest* r) {
         r->mutable_prompt_ids()->add_ids(3);
         r->mutable_prompt_ids()->add_ids(320);
       }},
      {"prompt_ids.ids[0]", [](v1::GenerateRequest* r) { r->mutable_prompt_ids()->add_ids(-1); }},
      {"prompt_ids.ids",
       [](v1::GenerateRequest* r) {
         for (int i = 0; i < 64; ++i) r->mutable_prompt_ids()->add_ids(7);
       }},
      {"max_new_tokens", [](v1::GenerateRequest* r) { r->set_max_new_tokens(101); }},
      {"temperature", [](v1::GenerateRequest* r) { r->set_temperature(-0.1f); }},
      {"temperature", [nan](v1::GenerateRequest* r) { r->set_temperature(nan); }},
      {"temperature",
       [](v1::GenerateRequest* r) { r->set_temperature(std::numeric_limits<float>::infinity()); }},
      {"top_p", [](v1::GenerateRequest* r) { r->set_top_p(0.0f); }},
      {"top_p", [](v1::GenerateRequest* r) { r->set_top_p(1.5f); }},
      {"top_p", [nan](v1::GenerateRequest* r) { r->set_top_p(nan); }},
      {"top_k", [](v1::GenerateRequest* r) { r->set_top_k(-1); }},
      {"stop_token_ids[1]",
       [](v1::GenerateRequest* r) {
         r->add_stop_token_ids(1);
         r->add_stop_token_ids(1000);
       }},
      {"stop[0]", [](v1::GenerateRequest* r) { r->add_stop(""); }},
      {"stop[0]", [](v1::GenerateRequest* r) { r->add_stop(std::string(300, 'x')); }},
      {"stop",
       [](v1::GenerateRequest* r) {
         for (int i = 0; i < 17; ++i) r->add_stop("x");
       }},
      {"speculation",
       [](v1::GenerateRequest* r) { r->set_speculation(static_cast<v1::Speculation>(9)); }},
      {"draft_max_nodes", [](v1::GenerateRequest* r) { r->set_draft_max_nodes(257); }},
      {"draft_depth", [](v1::GenerateRequest* r) { r->set_draft_depth(1000); }},
      {"draft_top_k", [](v1::GenerateRequest* r) { r->set_draft_top_k(1000); }},
  };
  for (const BadCase& c : cases) {
    v1::GenerateRequest r = Valid();
    c.mutate(&r);
    const absl::Status s = ValidateGenerateRequest(r, Limits());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field << ": " << s;
    EXPECT_EQ(std::string(s.message()).rfind(c.field + ":", 0), 0u)
        << "message should start with '" << c.field << ":', got: " << s.message();
  }
}

// request_id is bounded and reaches the logs escaped, so a newline cannot forge a log line.
TEST(RouterValidationTest, RequestIdIsBoundedAndEscaped) {
  v1::GenerateRequest r = Valid();
  r.set_request_id(std::string(kMaxRequestIdBytes, 'a'));
  EXPECT_TRUE(ValidateGenerateRequest(r, Limits()).ok());
  r.set_request_id("id\nI0101 forged line\x01");
  ASSERT_TRUE(ValidateGenerateRequest(r, Limits()).ok());
  const RouterRequest resolved = ResolveRequest(r, Limits(), 7);
  EXPECT_EQ(resolved.request_id, "id\\nI0101 forged line\\x01");
  EXPECT_EQ(resolved.request_id.find('\n'), std::string::npos);
}

TEST(RouterValidationTest, TokenizedPromptMustLeaveRoom) {
  const RequestLimits l = Limits();
  std::vector<int32_t> prompt(63, 5);
  EXPECT_TRUE(ValidatePrompt(prompt, "prompt", l).ok());
  prompt.push_back(5);
  const absl::Status s = ValidatePrompt(prompt, "prompt", l);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(s.message()).rfind("prompt:", 0), 0u) << s;
}

TEST(RouterValidationTest, DefaultsAndSeedsAreResolved) {
  RequestLimits l = Limits();
  l.default_shape = {3, 2, 7};
  l.default_speculation = v1::SPECULATION_NGRAM;
  v1::GenerateRequest r = Valid();
  r.set_max_new_tokens(0);
  r.set_temperature(0.8f);
  RouterRequest g = ResolveRequest(r, l, /*random_seed=*/1234);
  EXPECT_EQ(g.max_new_tokens, 10);
  EXPECT_EQ(g.sampling.seed, 1234u);
  EXPECT_EQ(g.sampling.top_p, 1.0f);
  EXPECT_EQ(g.speculation, v1::SPECULATION_NGRAM);
  EXPECT_EQ(g.shape.depth, 3);
  EXPECT_EQ(g.shape.top_k, 2);
  EXPECT_EQ(g.shape.max_nodes, 7);
  r.set_seed(5);
  r.set_speculation(v1::SPECULATION_OFF);
  r.set_draft_depth(6);
  g = ResolveRequest(r, l, 1234);
  EXPECT_EQ(g.sampling.seed, 5u);
  EXPECT_EQ(g.speculation, v1::SPECULATION_OFF);
  EXPECT_EQ(g.shape.depth, 6);
}

TEST(RouterValidationTest, SamplingFieldsLogprobsAndNResolve) {
  v1::GenerateRequest r = Valid();
  r.set_min_p(0.2f);
  (*r.mutable_logit_bias())[9] = -3.0f;
  (*r.mutable_logit_bias())[4] = 1.5f;
  r.set_repetition_penalty(1.1f);
  r.set_presence_penalty(-0.5f);
  r.set_frequency_penalty(2.0f);
  r.set_min_tokens(3);
  r.set_logprobs(20);
  r.set_logprobs_source(v1::LOGPROBS_SOURCE_PROCESSED);
  r.set_n(16);
  ASSERT_TRUE(ValidateGenerateRequest(r, Limits()).ok());
  const RouterRequest out = ResolveRequest(r, Limits(), 7);
  EXPECT_FLOAT_EQ(out.sampling.min_p, 0.2f);
  // Sorted by id, whatever the map's order.
  ASSERT_EQ(out.sampling.logit_bias.size(), 2u);
  EXPECT_EQ(out.sampling.logit_bias[0], std::make_pair(4, 1.5f));
  EXPECT_EQ(out.sampling.logit_bias[1], std::make_pair(9, -3.0f));
  EXPECT_FLOAT_EQ(out.sampling.repetition_penalty, 1.1f);
  EXPECT_FLOAT_EQ(out.sampling.presence_penalty, -0.5f);
  EXPECT_FLOAT_EQ(out.sampling.frequency_penalty, 2.0f);
  EXPECT_EQ(out.sampling.min_tokens, 3);
  EXPECT_EQ(out.logprobs, 20);
  EXPECT_EQ(out.logprobs_mode, LogprobsMode::kProcessed);

  // Unset: no logprobs, repetition penalty off.
  const RouterRequest plain = ResolveRequest(Valid(), Limits(), 7);
  EXPECT_EQ(plain.logprobs, -1);
  EXPECT_FLOAT_EQ(plain.sampling.repetition_penalty, 1.0f);
  EXPECT_FALSE(plain.sampling.has_processors());

  for (auto [field, set] : std::vector<std::pair<std::string, void (*)(v1::GenerateRequest*)>>{
           {"logprobs", [](v1::GenerateRequest* q) { q->set_logprobs(21); }},
           {"n", [](v1::GenerateRequest* q) { q->set_n(17); }},
           {"min_p", [](v1::GenerateRequest* q) { q->set_min_p(-0.1f); }},
           {"repetition_penalty", [](v1::GenerateRequest* q) { q->set_repetition_penalty(-1); }},
           {"logit_bias[-1]", [](v1::GenerateRequest* q) { (*q->mutable_logit_bias())[-1] = 1; }},
       }) {
    v1::GenerateRequest bad = Valid();
    set(&bad);
    const absl::Status s = ValidateGenerateRequest(bad, Limits());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_TRUE(absl::StartsWith(s.message(), field + ":")) << s.message();
  }
}

}  // namespace
}  // namespace specd
