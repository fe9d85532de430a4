// Speculative sampling draws from the target's exact distribution (docs/architecture.md):
// chi-square tests on the first two generated tokens against the distribution computed from the
// target's logits, for several drafters, with penalties, logit bias, min_p and min_tokens on; and
// tests that the statistic has the power to catch a biased sampler or a node processed without its
// path.
#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/sampling.h"
#include "engine/spec/generator.h"
#include "gtest/gtest.h"
#include "tests/testutil/chi_square.h"
#include "tests/testutil/speculation_models.h"

namespace specd {
namespace {

using speculation_testing::DrafterKind;
using speculation_testing::DrafterName;
using speculation_testing::GenerateAll;
using speculation_testing::kVocab;
using speculation_testing::Load;
using speculation_testing::M;
using speculation_testing::Total;

// ---------------------------------------------------------------------------------------------
// Distribution tests.

// Exact probability of each (first, second) generated token pair after `prompt`, from the
// target's logits (on a fresh backend) and TargetDistribution.
std::map<std::pair<int32_t, int32_t>, double> ExactJoint(const std::vector<int32_t>& prompt,
                                                         const SamplingParams& sampling) {
  std::unique_ptr<Backend> target = Load(M().target_dir);
  auto forward = [&](const std::vector<std::vector<int32_t>>& contexts) {
    std::vector<ForwardItem> items(contexts.size());
    for (size_t i = 0; i < contexts.size(); ++i) {
      EXPECT_TRUE(target->AddSequence(i).ok());
      items[i].seq = i;
      items[i].tokens = contexts[i];
      items[i].parents.resize(contexts[i].size());
      std::iota(items[i].parents.begin(), items[i].parents.end(), -1);
      items[i].logit_rows = {static_cast<int32_t>(contexts[i].size()) - 1};
    }
    std::vector<float> logits;
    EXPECT_TRUE(target->Forward(items, &logits).ok());
    for (size_t i = 0; i < contexts.size(); ++i) EXPECT_TRUE(target->RemoveSequence(i).ok());
    return logits;
  };
  // The processors see the prompt, then the first token on the way to the second.
  TokenHistory history;
  history.AddPrompt(prompt);
  std::vector<float> processed;
  auto distribution = [&](absl::Span<const float> row, std::vector<int32_t> path) {
    ProcessLogits(row, sampling, &history, path, &processed);
    return TargetDistribution(processed, sampling);
  };
  const std::vector<float> first = forward({prompt});
  const std::vector<double> p1 = distribution(first, {});
  std::vector<int32_t> support;
  std::vector<std::vector<int32_t>> contexts;
  for (int32_t t = 0; t < kVocab; ++t) {
    if (p1[t] <= 0) continue;
    support.push_back(t);
    contexts.push_back(prompt);
    contexts.back().push_back(t);
  }
  const std::vector<float> second = forward(contexts);
  std::map<std::pair<int32_t, int32_t>, double> joint;
  for (size_t i = 0; i < support.size(); ++i) {
    const std::vector<double> p2 =
        distribution(absl::MakeConstSpan(second).subspan(i * kVocab, kVocab), {support[i]});
    for (int32_t t = 0; t < kVocab; ++t) {
      if (p2[t] > 0) joint[{support[i], t}] = p1[support[i]] * p2[t];
    }
  }
  return joint;
}

// The first two tokens of `n` generations after `prompt`, seeds seed0, seed0 + 7, ... Three
// tokens are generated so that the draft tree is two deep (the generator drafts no deeper
// than the budget allows) and both counted tokens can come from accepted draft nodes.
std::map<std::pair<int32_t, int32_t>, int> Sample(DrafterKind kind,
                                                  const std::vector<int32_t>& prompt,
                                                  SamplingParams sampling, int n, uint64_t seed0,
                                                  SpecStats* stats) {
  std::vector<GenerationRequest> requests(n);
  for (int i = 0; i < n; ++i) {
    requests[i].prompt = prompt;
    requests[i].max_new_tokens = 3;
    requests[i].ignore_eos = true;
    requests[i].sampling = sampling;
    requests[i].sampling.seed = seed0 + 7 * static_cast<uint64_t>(i);
    requests[i].draft = {2, 3, 8};
  }
  const std::vector<GenerationResult> results = GenerateAll(kind, requests, 500);
  std::map<std::pair<int32_t, int32_t>, int> counts;
  for (const GenerationResult& r : results) {
    EXPECT_EQ(r.tokens.size(), 3u);
    if (r.tokens.size() >= 2) ++counts[{r.tokens[0], r.tokens[1]}];
  }
  *stats = Total(results);
  return counts;
}

// Bins: every outcome expected at least 5 times on its own, the rest pooled into one bin
// (merged into the smallest bin if the pool is itself expected fewer than 5 times).
struct Bins {
  std::map<std::pair<int32_t, int32_t>, int> of;  // outcome -> bin; absent -> pool
  std::vector<double> expected;                   // per bin, for n samples
  int pool = -1;

  Bins(const std::map<std::pair<int32_t, int32_t>, double>& joint, int n) {
    double pooled = 0;
    for (const auto& [outcome, p] : joint) {
      if (p * n >= 5) {
        of[outcome] = static_cast<int>(expected.size());
        expected.push_back(p * n);
      } else {
        pooled += p * n;
      }
    }
    if (pooled >= 5 || expected.empty()) {
      pool = static_cast<int>(expected.size());
      expected.push_back(pooled);
    } else {
      pool =
          static_cast<int>(std::min_element(expected.begin(), expected.end()) - expected.begin());
      expected[pool] += pooled;
    }
  }

  std::vector<int> Observed(const std::map<std::pair<int32_t, int32_t>, int>& counts) const {
    std::vector<int> o(expected.size(), 0);
    for (const auto& [outcome, c] : counts) {
      const auto it = of.find(outcome);
      o[it == of.end() ? pool : it->second] += c;
    }
    return o;
  }

  // Goodness of fit against the exact distribution.
  double Statistic(const std::vector<int>& o) const {
    double chi2 = 0;
    for (size_t b = 0; b < o.size(); ++b) {
      if (expected[b] <= 0) {
        if (o[b] > 0) return INFINITY;  // an outcome the target cannot produce
        continue;
      }
      chi2 += (o[b] - expected[b]) * (o[b] - expected[b]) / expected[b];
    }
    return chi2;
  }
  int df() const { return static_cast<int>(expected.size()) - 1; }
};

struct DistributionCase {
  std::string name;
  std::function<SamplingParams()> sampling;  // called in the test: it may load the models
};

void PrintTo(const DistributionCase& c, std::ostream* os) { *os << c.name; }

// Temperature with penalties, bias, min_p and min_tokens (the EOS and the 4th to 6th likeliest
// first tokens of the plain distribution are masked for the first two tokens; the likeliest
// stay, so drafts of the first token are often accepted). The prompt's
// tokens are penalised and the output's rewarded (negative frequency and presence penalties),
// so a second token that repeats the first is likely only when the first token's row counts
// it: a tree node processed without its path shows in the statistic.
SamplingParams Penalized() {
  SamplingParams s;
  s.temperature = 1.0f;
  s.min_p = 0.02f;
  s.repetition_penalty = 1.5f;
  s.frequency_penalty = -1.5f;
  s.presence_penalty = -1.0f;
  s.logit_bias = {{72, 1.5f}, {33, -2.0f}};
  s.min_tokens = 2;
  s.min_tokens_stop_ids = {256};
  std::unique_ptr<Backend> target = Load(M().target_dir);
  const std::vector<int32_t> prompt = {72, 105, 33, 32};
  EXPECT_TRUE(target->AddSequence(1).ok());
  ForwardItem item;
  item.seq = 1;
  item.tokens = prompt;
  item.parents = {-1, 0, 1, 2};
  item.logit_rows = {3};
  std::vector<float> logits;
  EXPECT_TRUE(target->Forward({item}, &logits).ok());
  std::vector<int32_t> order(kVocab);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + 6, order.end(),
                    [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  s.min_tokens_stop_ids.insert(s.min_tokens_stop_ids.end(), order.begin() + 3, order.begin() + 6);
  return s;
}

class DistributionTest : public ::testing::TestWithParam<DistributionCase> {};

// Speculative sampling with a drafter that proposes the target's most likely tokens (the
// draft model equals the target) and with a related draft, each run with seeds unrelated to
// the target-only run's, matches the exact distribution of the first two tokens, as does
// target-only sampling; and the samples match each other.
TEST_P(DistributionTest, FirstTwoTokensFollowTheTarget) {
  const SamplingParams sampling = GetParam().sampling();
  const std::vector<int32_t> prompt = {72, 105, 33, 32};
  const int n = 4000;
  const auto joint = ExactJoint(prompt, sampling);
  const Bins bins(joint, n);
  ASSERT_GE(bins.df(), 20) << "too few bins for a meaningful test";
  const double critical = ChiSquareCritical001(bins.df());

  SpecStats stats;
  const std::vector<int> plain =
      bins.Observed(Sample(DrafterKind::kNone, prompt, sampling, n, 1, &stats));
  EXPECT_EQ(stats.draft_steps, 0);
  EXPECT_LT(bins.Statistic(plain), critical) << "target-only sampling, df " << bins.df();

  uint64_t seed0 = 1;
  for (DrafterKind kind : {DrafterKind::kSame, DrafterKind::kRelated, DrafterKind::kEagle}) {
    SCOPED_TRACE(DrafterName(kind));
    seed0 += 1000003;  // seeds unrelated to the other runs'
    const std::vector<int> spec = bins.Observed(Sample(kind, prompt, sampling, n, seed0, &stats));
    // The drafts were really used: most first tokens came from an accepted draft node (fewer
    // with processors, which the draft model does not apply to its proposals). The EAGLE head
    // is random and drafts from the second token on (its first step has no taps yet): only a
    // few second tokens (13-40 of 4000 with these seeds) come from its trees, enough to show the
    // walk takes its nodes, not enough to give the statistic much power over them.
    const bool exact_draft = kind == DrafterKind::kSame && !sampling.has_processors();
    const int64_t least = kind == DrafterKind::kEagle ? 10 : n / (exact_draft ? 2 : 8);
    EXPECT_GT(stats.accepted_tokens, least) << "accepted " << stats.accepted_tokens;
    EXPECT_LT(bins.Statistic(spec), critical) << "speculative sampling, df " << bins.df();
    const auto [chi2, df] = TwoSampleChiSquare(plain, spec);
    EXPECT_LT(chi2, ChiSquareCritical001(df)) << "speculative vs target-only, df " << df;
  }
}

SamplingParams Filters(float temperature, int top_k, float top_p) {
  SamplingParams s;
  s.temperature = temperature;
  s.top_k = top_k;
  s.top_p = top_p;
  return s;
}

INSTANTIATE_TEST_SUITE_P(
    Sampling, DistributionTest,
    ::testing::Values(DistributionCase{"t100_k0_p100", [] { return Filters(1.0f, 0, 1.0f); }},
                      DistributionCase{"t80_k12_p90", [] { return Filters(0.8f, 12, 0.9f); }},
                      DistributionCase{"penalized", Penalized}),
    [](const auto& info) { return info.param.name; });

// The statistic has power: sampling at a moderately wrong temperature is rejected.
TEST(DistributionPowerTest, DetectsABiasedSampler) {
  SamplingParams sampling;
  sampling.temperature = 1.0f;
  const std::vector<int32_t> prompt = {72, 105, 33, 32};
  const int n = 4000;
  const Bins bins(ExactJoint(prompt, sampling), n);
  SamplingParams hotter = sampling;
  hotter.temperature = 1.25f;
  SpecStats stats;
  const std::vector<int> wrong =
      bins.Observed(Sample(DrafterKind::kNone, prompt, hotter, n, 1, &stats));
  EXPECT_GT(bins.Statistic(wrong), ChiSquareCritical001(bins.df()));
}

// And the penalties matter to it: plain sampling fails the penalized distribution.
TEST(DistributionPowerTest, DetectsMissingPenalties) {
  const SamplingParams penalized = Penalized();
  const std::vector<int32_t> prompt = {72, 105, 33, 32};
  const int n = 4000;
  const Bins bins(ExactJoint(prompt, penalized), n);
  SpecStats stats;
  const std::vector<int> wrong =
      bins.Observed(Sample(DrafterKind::kNone, prompt, Filters(1.0f, 0, 1.0f), n, 1, &stats));
  EXPECT_GT(bins.Statistic(wrong), ChiSquareCritical001(bins.df()));
}

}  // namespace
}  // namespace specd
