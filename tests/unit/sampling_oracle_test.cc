// The logits processors, sampling filters and log-probabilities of engine/sampling.h against
// PyTorch: tests/fixtures/sampling_oracle.json (tools/oracle/make_sampling_fixture.py) holds
// random rows with a prompt, an output and a tree path, and what torch computes for them with
// vLLM v1's semantics and order (tensor masks, fp32 processing, fp64 distributions).
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/sampling.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testutil/hf_fixtures.h"

namespace specd {
namespace {

using nlohmann::json;

constexpr double kInf = std::numeric_limits<double>::infinity();

// null in the fixture is -inf.
std::vector<double> Row(const json& j) {
  std::vector<double> out;
  for (const json& v : j) out.push_back(v.is_null() ? -kInf : v.get<double>());
  return out;
}

std::vector<int32_t> Ids(const json& j) { return j.get<std::vector<int32_t>>(); }

SamplingParams Params(const json& c) {
  SamplingParams p;
  p.temperature = c["temperature"].get<float>();
  p.top_k = c["top_k"].get<int>();
  p.top_p = c["top_p"].get<float>();
  p.min_p = c["min_p"].get<float>();
  for (const json& b : c["logit_bias"]) {
    p.logit_bias.emplace_back(b[0].get<int32_t>(), b[1].get<float>());
  }
  p.repetition_penalty = c["repetition_penalty"].get<float>();
  p.presence_penalty = c["presence_penalty"].get<float>();
  p.frequency_penalty = c["frequency_penalty"].get<float>();
  p.min_tokens = c["min_tokens"].get<int>();
  p.min_tokens_stop_ids = Ids(c["stop_ids"]);
  p.seed = 5;
  return p;
}

class SamplingOracleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto root = testutil::RepoRoot();
    ASSERT_FALSE(root.empty());
    fixture_ = testutil::ReadJson(root / "tests" / "fixtures" / "sampling_oracle.json");
    ASSERT_GE(fixture_["cases"].size(), 60u);
  }
  json fixture_;
};

TEST_F(SamplingOracleTest, ProcessedLogitsDistributionAndLogprobsMatchTorch) {
  const int vocab = fixture_["vocab"].get<int>();
  int greedy = 0, sampled = 0;
  for (size_t i = 0; i < fixture_["cases"].size(); ++i) {
    const json& c = fixture_["cases"][i];
    SCOPED_TRACE(absl::StrCat("case ", i, " (", c["kind"].get<std::string>(), ")"));
    const SamplingParams p = Params(c);
    ASSERT_TRUE(ValidateSamplingParams(p, vocab).ok()) << ValidateSamplingParams(p, vocab);
    std::vector<float> raw;
    for (double v : Row(c["raw"])) raw.push_back(static_cast<float>(v));
    TokenHistory history;
    history.AddPrompt(Ids(c["prompt"]));
    history.AddOutput(Ids(c["output"]));
    std::vector<float> processed;
    ProcessLogits(raw, p, &history, Ids(c["path"]), &processed);

    const std::vector<double> want = Row(c["processed"]);
    ASSERT_EQ(processed.size(), want.size());
    for (int t = 0; t < vocab; ++t) {
      if (std::isinf(want[t])) {
        EXPECT_TRUE(std::isinf(processed[t]) && processed[t] < 0) << "token " << t;
      } else {
        // The same fp32 operations in the same order as torch: equal to the last bit or so.
        EXPECT_NEAR(processed[t], want[t], 1e-6 * std::max(1.0, std::fabs(want[t])))
            << "token " << t;
      }
    }

    const std::vector<double> want_raw_lp = Row(c["raw_logprobs"]);
    const std::vector<double> want_lp = Row(c["processed_logprobs"]);
    // The emitted token: the argmax for greedy rows, else the most likely kept token (any
    // token would do; this one has a finite log-probability in both modes).
    int32_t token = 0;
    if (p.greedy()) {
      ++greedy;
      token = SampleToken(processed, p, 0);
      EXPECT_EQ(token, c["argmax"].get<int32_t>());
    } else {
      ++sampled;
      const std::vector<double> probs = TargetDistribution(processed, p);
      const std::vector<double> want_probs = Row(c["probs"]);
      for (int t = 0; t < vocab; ++t) {
        const double w = std::isinf(want_probs[t]) ? 0.0 : want_probs[t];
        if (w == 0.0) {
          EXPECT_EQ(probs[t], 0.0) << "token " << t << " is filtered out in torch";
        } else {
          EXPECT_NEAR(probs[t], w, 1e-6 * std::max(1e-3, w)) << "token " << t;
        }
        if (probs[t] > probs[token]) token = t;
      }
    }
    for (LogprobsMode mode : {LogprobsMode::kRaw, LogprobsMode::kProcessed}) {
      const std::vector<double>& lp = mode == LogprobsMode::kRaw ? want_raw_lp : want_lp;
      const TokenLogprobs got = ComputeLogprobs(raw, processed, p, mode, token, kMaxLogprobs);
      EXPECT_NEAR(got.logprob, lp[token], 2e-6 * std::max(1.0, std::fabs(lp[token])));
      int rank = 1, finite = 0;
      for (int t = 0; t < vocab; ++t) {
        rank += lp[t] > lp[token];
        finite += !std::isinf(lp[t]);
      }
      EXPECT_EQ(got.rank, rank);
      ASSERT_EQ(got.top.size(), static_cast<size_t>(std::min(kMaxLogprobs, finite)));
      for (size_t k = 0; k < got.top.size(); ++k) {
        const int32_t t = got.top[k].token;
        EXPECT_NEAR(got.top[k].logprob, lp[t], 2e-6 * std::max(1.0, std::fabs(lp[t])));
        if (k > 0) EXPECT_GE(got.top[k - 1].logprob, got.top[k].logprob);
        // Everything listed is at least as likely as everything not listed.
        int above = 0;
        for (int u = 0; u < vocab; ++u) above += lp[u] > lp[t];
        EXPECT_LE(above, static_cast<int>(k)) << "top[" << k << "]";
      }
    }
  }
  EXPECT_GE(greedy, 15);
  EXPECT_GE(sampled, 40);
}

}  // namespace
}  // namespace specd
