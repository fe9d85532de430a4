#include "engine/sampling.h"

#include <cmath>
#include <map>

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
