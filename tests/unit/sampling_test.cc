#include "engine/sampling.h"

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "common/token_tree.h"
#include "engine/backend.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specd {
namespace {

TEST(SamplingTest, ValidationNamesTheField) {
  SamplingParams p;
  p.temperature = -1;
  EXPECT_THAT(ValidateSamplingParams(p).message(), ::testing::HasSubstr("temperature"));
  p = {};
  p.top_p = 0;
  EXPECT_THAT(ValidateSamplingParams(p).message(), ::testing::HasSubstr("top_p"));
  p = {};
  p.top_k = -3;
  EXPECT_THAT(ValidateSamplingParams(p).message(), ::testing::HasSubstr("top_k"));
  EXPECT_TRUE(ValidateSamplingParams(SamplingParams{}).ok());
}

TEST(SamplingTest, ValidationNamesTheNewFields) {
  auto message = [](const SamplingParams& p, int vocab = 0) {
    return std::string(ValidateSamplingParams(p, vocab).message());
  };
  SamplingParams p;
  p.min_p = 1.5f;
  EXPECT_THAT(message(p), ::testing::HasSubstr("min_p: 1.5 must be in [0, 1]"));
  p = {};
  p.repetition_penalty = 0.0f;
  EXPECT_THAT(message(p), ::testing::HasSubstr("repetition_penalty"));
  p.repetition_penalty = std::nanf("");
  EXPECT_THAT(message(p), ::testing::HasSubstr("repetition_penalty"));
  p = {};
  p.presence_penalty = 2.5f;
  EXPECT_THAT(message(p), ::testing::HasSubstr("presence_penalty"));
  p = {};
  p.frequency_penalty = -3.0f;
  EXPECT_THAT(message(p), ::testing::HasSubstr("frequency_penalty"));
  p = {};
  p.min_tokens = -1;
  EXPECT_THAT(message(p), ::testing::HasSubstr("min_tokens"));
  p = {};
  p.logit_bias = {{3, 101.0f}};
  EXPECT_THAT(message(p), ::testing::HasSubstr("logit_bias[3]: bias 101"));
  p.logit_bias = {{3, 1.0f}, {3, 2.0f}};
  EXPECT_THAT(message(p), ::testing::HasSubstr("logit_bias[3]: token id listed twice"));
  p.logit_bias = {{10, 1.0f}};
  EXPECT_TRUE(ValidateSamplingParams(p).ok()) << "no vocabulary given: ids are not checked";
  EXPECT_THAT(message(p, 10), ::testing::HasSubstr("logit_bias[10]: token id 10 is outside"));
  p = {};
  p.min_tokens_stop_ids = {1, -2};
  EXPECT_THAT(message(p), ::testing::HasSubstr("min_tokens_stop_ids[1]"));
  p = {};
  p.min_p = 1.0f;
  p.repetition_penalty = 3.0f;
  p.presence_penalty = -2.0f;
  p.frequency_penalty = 2.0f;
  p.logit_bias = {{9, -100.0f}};
  p.min_tokens = 4;
  EXPECT_TRUE(ValidateSamplingParams(p, 10).ok());
}

TEST(SamplingTest, HistoryCountsPromptAndOutputApart) {
  TokenHistory h;
  h.AddPrompt(std::vector<int32_t>{4, 4, 7});
  h.AddOutput(std::vector<int32_t>{7, 9, 9});
  EXPECT_EQ(h.output_length(), 3);
  EXPECT_TRUE(h.tokens().at(4).in_prompt);
  EXPECT_EQ(h.tokens().at(4).output, 0);
  EXPECT_EQ(h.tokens().at(7).output, 1);
  EXPECT_EQ(h.tokens().at(9).output, 2);
  h.RemoveOutput(std::vector<int32_t>{9, 7});
  EXPECT_EQ(h.output_length(), 1);
  EXPECT_EQ(h.tokens().at(9).output, 1);
  EXPECT_TRUE(h.tokens().at(7).in_prompt);
  EXPECT_EQ(h.tokens().at(7).output, 0);
}

// Hand-computed: repetition over prompt and output, frequency and presence over the output
// only, bias before the penalties, min_tokens masking counted over history and path.
TEST(SamplingTest, ProcessorsFollowVllmSemantics) {
  const std::vector<float> raw = {2.0f, -2.0f, 1.0f, 0.5f, -1.0f, 3.0f};
  TokenHistory h;
  h.AddPrompt(std::vector<int32_t>{0, 1});
  h.AddOutput(std::vector<int32_t>{2, 2});
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  p.logit_bias = {{4, 3.0f}};
  std::vector<float> out;
  ProcessLogits(raw, p, &h, std::vector<int32_t>{3}, &out);
  EXPECT_FLOAT_EQ(out[0], 1.0f);   // prompt: 2 / 2, no frequency or presence
  EXPECT_FLOAT_EQ(out[1], -4.0f);  // prompt: -2 * 2
  EXPECT_FLOAT_EQ(out[2], 0.5f - 1.0f - 0.25f);  // output twice: 1 / 2 - 0.5 * 2 - 0.25
  EXPECT_FLOAT_EQ(out[3], 0.25f - 0.5f - 0.25f);  // on the path once
  EXPECT_FLOAT_EQ(out[4], 2.0f);   // bias only: -1 + 3, unseen
  EXPECT_FLOAT_EQ(out[5], 3.0f);   // untouched

  SamplingParams m;
  m.min_tokens = 4;
  m.min_tokens_stop_ids = {5, 0};
  ProcessLogits(raw, m, &h, std::vector<int32_t>{3}, &out);  // 3 output tokens < 4
  EXPECT_TRUE(std::isinf(out[5]) && out[5] < 0);
  EXPECT_TRUE(std::isinf(out[0]) && out[0] < 0);
  EXPECT_EQ(SampleToken(out, SamplingParams{}, 0), 2) << "greedy skips the masked ids";
  ProcessLogits(raw, m, &h, std::vector<int32_t>{3, 1}, &out);  // 4 tokens: unmasked
  EXPECT_EQ(out, raw);
}

// A tree node's processing with its path equals the processing after committing that path:
// the property that keeps speculative verification lossless.
TEST(SamplingTest, PathCountsAsCommittedOutput) {
  std::vector<float> raw(40);
  for (int i = 0; i < 40; ++i) raw[i] = std::sin(i * 0.7f) * 3.0f;
  SamplingParams p;
  p.repetition_penalty = 1.3f;
  p.frequency_penalty = 0.7f;
  p.presence_penalty = -0.4f;
  p.min_tokens = 6;
  p.min_tokens_stop_ids = {11};
  p.logit_bias = {{3, 1.5f}, {17, -4.0f}};
  TokenHistory base;
  base.AddPrompt(std::vector<int32_t>{1, 2, 3, 20});
  base.AddOutput(std::vector<int32_t>{3, 5});
  const std::vector<int32_t> path = {5, 33, 3};
  std::vector<float> with_path, committed, reversed;
  ProcessLogits(raw, p, &base, path, &with_path);
  TokenHistory after = base;
  after.AddOutput(path);
  ProcessLogits(raw, p, &after, {}, &committed);
  ProcessLogits(raw, p, &base, std::vector<int32_t>{3, 33, 5}, &reversed);
  EXPECT_EQ(with_path, committed);
  EXPECT_EQ(with_path, reversed);
  EXPECT_TRUE(std::isinf(with_path[11]));  // 5 output tokens < 6
}

TEST(SamplingTest, MinPKeepsTokensNearTheTop) {
  // Probabilities at temperature 1: exp(0), exp(-1), exp(-2), exp(-5) over their sum.
  const std::vector<float> l = {0.0f, -1.0f, -2.0f, -5.0f};
  SamplingParams p;
  p.temperature = 1.0f;
  p.min_p = 0.2f;  // keeps p_i >= 0.2 p_max: exp(-1) = 0.37 yes, exp(-2) = 0.14 no
  std::vector<double> d = TargetDistribution(l, p);
  const double z = 1 + std::exp(-1.0);
  EXPECT_NEAR(d[0], 1 / z, 1e-12);
  EXPECT_NEAR(d[1], std::exp(-1.0) / z, 1e-12);
  EXPECT_EQ(d[2], 0.0);
  EXPECT_EQ(d[3], 0.0);
  p.temperature = 2.0f;  // after temperature: exp(-1) = 0.37 for token 2 passes now
  d = TargetDistribution(l, p);
  EXPECT_GT(d[2], 0.0);
  EXPECT_EQ(d[3], 0.0);
  for (int pos = 0; pos < 200; ++pos) {
    p.seed = pos;
    EXPECT_NE(SampleToken(l, p, pos), 3);
  }
}

TEST(SamplingTest, LogprobsOfARowAndItsTopTokens) {
  const std::vector<float> l = {1.0f, 3.0f, 3.0f, -1.0f, 0.0f};
  double z = 0;
  for (float v : l) z += std::exp(v);
  SamplingParams greedy;
  const TokenLogprobs lp = ComputeLogprobs(l, l, greedy, LogprobsMode::kRaw, 4, 3);
  EXPECT_NEAR(lp.logprob, 0.0 - std::log(z), 1e-6);
  EXPECT_EQ(lp.rank, 4);
  ASSERT_EQ(lp.top.size(), 3u);
  EXPECT_EQ(lp.top[0].token, 1);  // ties: lowest id first
  EXPECT_EQ(lp.top[1].token, 2);
  EXPECT_EQ(lp.top[2].token, 0);
  EXPECT_NEAR(lp.top[2].logprob, 1.0 - std::log(z), 1e-6);
  EXPECT_TRUE(ComputeLogprobs(l, l, greedy, LogprobsMode::kRaw, 1, 0).top.empty());
  // Processed, sampling with top-k 2: only tokens 1 and 2 have mass, each 1/2.
  SamplingParams k2;
  k2.temperature = 0.5f;
  k2.top_k = 2;
  const TokenLogprobs pk = ComputeLogprobs(l, l, k2, LogprobsMode::kProcessed, 2, 5);
  EXPECT_NEAR(pk.logprob, std::log(0.5), 1e-6);
  EXPECT_EQ(pk.rank, 1);
  ASSERT_EQ(pk.top.size(), 2u) << "tokens with probability 0 are not listed";
  // Raw mode ignores the sampling parameters.
  EXPECT_EQ(ComputeLogprobs(l, l, k2, LogprobsMode::kRaw, 2, 5).logprob,
            ComputeLogprobs(l, l, greedy, LogprobsMode::kRaw, 2, 5).logprob);
}

TEST(SamplingTest, UnsupportedFeaturesAreUnimplementedNamingTheField) {
  SamplingParams p;
  EXPECT_TRUE(CheckVerifySupport(VerifyFeatures(), p, -1, "the cuda:0 backend").ok());
  p.frequency_penalty = 0.5f;
  absl::Status s = CheckVerifySupport(VerifyFeatures(), p, -1, "the cuda:0 backend");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), ::testing::HasSubstr("sampling.frequency_penalty: not supported by "
                                                "the cuda:0 backend"));
  EXPECT_TRUE(CheckVerifySupport({true, false}, p, -1, "x").ok());
  EXPECT_THAT(CheckVerifySupport({true, false}, p, 0, "x").message(),
              ::testing::HasSubstr("logprobs"));
  p = {};
  p.min_p = 0.1f;
  EXPECT_THAT(CheckVerifySupport({false, true}, p, 3, "x").message(),
              ::testing::HasSubstr("sampling.min_p"));
  EXPECT_TRUE(CheckVerifySupport({true, true}, p, 3, "x").ok());
}

TEST(SamplingTest, GreedyTakesLowestArgmax) {
  std::vector<float> l = {0.1f, 3.0f, 3.0f, -1.0f};
  EXPECT_EQ(SampleToken(l, SamplingParams{}, 0), 1);
}

TEST(SamplingTest, SameSeedAndPositionGiveSameToken) {
  std::vector<float> l(50);
  for (int i = 0; i < 50; ++i) l[i] = std::sin(i * 1.3f);
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 1234;
  int differs = 0;
  for (int pos = 0; pos < 100; ++pos) {
    EXPECT_EQ(SampleToken(l, p, pos), SampleToken(l, p, pos));
    SamplingParams q = p;
    q.seed = 99;
    differs += SampleToken(l, p, pos) != SampleToken(l, q, pos);
  }
  EXPECT_GT(differs, 50);
}

// Chi-square goodness of fit of Gumbel-max draws against the filtered softmax.
TEST(SamplingTest, FrequenciesMatchTargetDistribution) {
  std::vector<float> l = {1.0f, 0.5f, 2.0f, -1.0f, 0.0f, 1.5f};
  for (auto [k, top_p] : std::vector<std::pair<int, float>>{{0, 1.0f}, {4, 1.0f}, {0, 0.8f}}) {
    SamplingParams p;
    p.temperature = 0.7f;
    p.top_k = k;
    p.top_p = top_p;
    const std::vector<double> dist = TargetDistribution(l, p);
    std::vector<int> counts(l.size());
    const int n = 20000;
    for (int i = 0; i < n; ++i) {
      p.seed = 1000003ull * i + 7;
      ++counts[SampleToken(l, p, 17)];
    }
    double chi2 = 0;
    int dof = -1;
    for (size_t t = 0; t < l.size(); ++t) {
      if (dist[t] == 0) {
        EXPECT_EQ(counts[t], 0) << "token " << t << " was filtered out";
        continue;
      }
      const double e = dist[t] * n;
      chi2 += (counts[t] - e) * (counts[t] - e) / e;
      ++dof;
    }
    // 99.9th percentile of chi-square with <= 5 degrees of freedom is 20.5.
    EXPECT_LT(chi2, 20.5) << "k=" << k << " p=" << top_p;
  }
}

TEST(AcceptTreeTest, DescendsWhileSampleIsAChild) {
  // Vocab 4; tree: root children {2 (node0), 1 (node1)}; node0 has child 3 (node2).
  TokenTree tree;
  tree.tokens = {2, 1, 3};
  tree.parents = {-1, -1, 0};
  const int v = 4;
  // rows: pending -> argmax 2; node0 -> argmax 3; node1 -> 0; node2 -> argmax 1.
  std::vector<float> rows = {0, 0, 5, 0, /*node0*/ 0, 0, 0, 5, /*node1*/ 5, 0, 0, 0,
                             /*node2*/ 0, 5, 0, 0};
  VerifyOutcome out = AcceptTree(tree, rows, v, SamplingParams{}, 10);
  EXPECT_EQ(out.tokens, (std::vector<int32_t>{2, 3, 1}));
  EXPECT_EQ(out.accepted_nodes, (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(out.accepted_draft, 2);
  // Nothing accepted when the first sample is not a root.
  rows[2] = 0;
  rows[0] = 5;
  out = AcceptTree(tree, rows, v, SamplingParams{}, 10);
  EXPECT_EQ(out.tokens, (std::vector<int32_t>{0}));
  EXPECT_EQ(out.accepted_draft, 0);
}

TEST(TokenTreeTest, ValidateNamesTheField) {
  TokenTree t;
  t.tokens = {1, 2};
  t.parents = {-1, 1};
  EXPECT_THAT(ValidateTree(t, 10).message(), ::testing::HasSubstr("tree.parents[1]"));
  t.parents = {-1, 0};
  EXPECT_TRUE(ValidateTree(t, 10).ok());
  t.tokens[1] = 10;
  EXPECT_THAT(ValidateTree(t, 10).message(), ::testing::HasSubstr("tree.tokens[1]"));
  t = ChainTree(std::vector<int32_t>(300, 1));
  EXPECT_THAT(ValidateTree(t, 10).message(), ::testing::HasSubstr("limit"));
  EXPECT_EQ(TreeDepths(ChainTree({1, 2, 3})), (std::vector<int>{0, 1, 2}));
}

}  // namespace
}  // namespace specd
