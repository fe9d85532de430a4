// Lossless speculative decoding (docs/architecture.md) end to end on real checkpoint folders and
// the CPU backend, token for token: greedy output identical to target-only greedy for many
// prompts, tree shapes, drafters and batch sizes; seeded sampling identical to target-only
// sampling; stops inside multi-token steps; the logits processors (penalties, logit bias,
// min_tokens, min_p) and logprobs identical with speculation on and off. The distribution of
// speculative sampling is speculative_distribution_test.cc's.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/backend.h"
#include "engine/draft/draft_model_drafter.h"
#include "engine/draft/ngram_drafter.h"
#include "engine/spec/generator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testutil/counting_backend.h"
#include "tests/testutil/speculation_models.h"

namespace specd {
namespace {

using speculation_testing::DrafterKind;
using speculation_testing::DrafterName;
using speculation_testing::GenerateAll;
using speculation_testing::kVocab;
using speculation_testing::M;
using speculation_testing::Total;
using ::testing::HasSubstr;

constexpr int kPrompts = 50;
constexpr int kNewTokens = 12;

// Prompts of random lengths and contents; every other one repeats a short motif so that
// n-gram lookup finds matches.
std::vector<std::vector<int32_t>> MakePrompts(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < n; ++i) {
    const int len = 1 + rng() % 24;
    std::vector<int32_t> p;
    if (i % 2 == 0) {
      for (int j = 0; j < len; ++j) p.push_back(rng() % 256);
    } else {
      std::vector<int32_t> motif(2 + rng() % 4);
      for (int32_t& t : motif) t = 32 + rng() % 64;
      for (int j = 0; j < len; ++j) p.push_back(motif[j % motif.size()]);
    }
    prompts.push_back(p);
  }
  return prompts;
}

std::vector<GenerationRequest> Requests(const DraftParams& shape, const SamplingParams& sampling,
                                        int n = kPrompts, uint32_t prompt_seed = 1234) {
  std::vector<GenerationRequest> requests;
  for (const std::vector<int32_t>& p : MakePrompts(n, prompt_seed)) {
    GenerationRequest r;
    r.prompt = p;
    r.max_new_tokens = kNewTokens;
    r.sampling = sampling;
    r.draft = shape;
    requests.push_back(r);
  }
  return requests;
}

// Target-only greedy outputs, one sequence at a time.
const std::vector<GenerationResult>& GreedyBaseline() {
  static const auto* baseline = new std::vector<GenerationResult>(
      GenerateAll(DrafterKind::kNone, Requests(DraftParams(), SamplingParams()), 1));
  return *baseline;
}

struct GreedyCase {
  DrafterKind kind;
  DraftParams shape;
  size_t batch;
};

std::string CaseString(const GreedyCase& c) {
  return absl::StrCat(DrafterName(c.kind), "_d", c.shape.depth, "_k", c.shape.top_k, "_n",
                      c.shape.max_nodes, "_b", c.batch);
}

void PrintTo(const GreedyCase& c, std::ostream* os) { *os << CaseString(c); }

std::string CaseName(const ::testing::TestParamInfo<GreedyCase>& info) {
  return CaseString(info.param);
}

class GreedyTest : public ::testing::TestWithParam<GreedyCase> {};

// Speculative greedy output is token-identical to target-only greedy over 50 prompts.
TEST_P(GreedyTest, MatchesTargetOnly) {
  const GreedyCase& c = GetParam();
  const std::vector<GenerationResult>& want = GreedyBaseline();
  std::vector<std::vector<int32_t>> streamed;
  const std::vector<GenerationResult> got =
      GenerateAll(c.kind, Requests(c.shape, SamplingParams()), c.batch, &streamed);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].tokens, want[i].tokens) << "prompt " << i;
    EXPECT_EQ(got[i].finish_reason, want[i].finish_reason) << "prompt " << i;
    EXPECT_EQ(streamed[i], got[i].tokens) << "prompt " << i;
  }
  const SpecStats s = Total(got);
  EXPECT_GT(s.draft_steps, 0);
  EXPECT_LE(s.accepted_tokens, s.draft_tokens);
  // Speculation saves steps whenever something was accepted.
  int64_t emitted = 0;
  for (const GenerationResult& r : got) emitted += r.tokens.size();
  EXPECT_LE(s.steps, emitted);
  if (c.kind == DrafterKind::kRelated) {
    // The related draft agrees with the target often enough to exercise accepted paths.
    EXPECT_GT(s.accepted_tokens, s.draft_steps / 4)
        << "accepted " << s.accepted_tokens << " of " << s.draft_tokens << " in " << s.draft_steps
        << " steps";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GreedyTest,
    ::testing::Values(
        // Chains of depth 1..6.
        GreedyCase{DrafterKind::kRelated, {1, 1, 1}, 10},
        GreedyCase{DrafterKind::kRelated, {2, 1, 2}, 10},
        GreedyCase{DrafterKind::kRelated, {3, 1, 3}, 10},
        GreedyCase{DrafterKind::kRelated, {4, 1, 4}, 10},
        GreedyCase{DrafterKind::kRelated, {5, 1, 5}, 10},
        GreedyCase{DrafterKind::kRelated, {6, 1, 6}, 1},
        // Wide and budgeted trees.
        GreedyCase{DrafterKind::kRelated, {3, 4, 64}, 10},
        GreedyCase{DrafterKind::kRelated, {4, 4, 1}, 10},
        GreedyCase{DrafterKind::kRelated, {3, 2, 7}, 25},
        GreedyCase{DrafterKind::kRelated, {5, 4, 64}, 50},
        GreedyCase{DrafterKind::kRelated, {8, 8, 256}, 10},
        // An unrelated draft model: mostly rejected, still exact.
        GreedyCase{DrafterKind::kOther, {4, 1, 4}, 10},
        GreedyCase{DrafterKind::kOther, {3, 4, 64}, 10},
        GreedyCase{DrafterKind::kOther, {5, 4, 48}, 50},
        // N-gram prompt lookup.
        GreedyCase{DrafterKind::kNgram, {1, 1, 1}, 10},
        GreedyCase{DrafterKind::kNgram, {4, 1, 4}, 10},
        GreedyCase{DrafterKind::kNgram, {6, 4, 7}, 10},
        GreedyCase{DrafterKind::kNgram, {8, 4, 64}, 50},
        GreedyCase{DrafterKind::kNgram, {10, 8, 256}, 10},
        // The EAGLE head fed with the target's taps (random: mostly rejected, still exact).
        GreedyCase{DrafterKind::kEagle, {4, 4, 16}, 10},
        GreedyCase{DrafterKind::kEagle, {6, 8, 64}, 50}),
    CaseName);

// With the draft model equal to the target, every drafted chain token is the target's greedy
// choice, so (almost) everything is accepted: the tree plumbing works, not just rejection.
TEST(SpeculativeTest, DraftEqualToTargetIsAccepted) {
  const std::vector<GenerationResult>& want = GreedyBaseline();
  for (const DraftParams& shape : {DraftParams{4, 1, 4}, DraftParams{5, 3, 24}}) {
    SCOPED_TRACE(absl::StrCat("depth ", shape.depth, " top_k ", shape.top_k));
    const std::vector<GenerationResult> got =
        GenerateAll(DrafterKind::kSame, Requests(shape, SamplingParams()), 10);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].tokens, want[i].tokens) << i;
    const SpecStats s = Total(got);
    int64_t max_possible = 0;  // each step can accept at most its (clamped) depth
    for (const GenerationResult& r : got) {
      max_possible += static_cast<int64_t>(r.tokens.size()) - r.stats.steps;
    }
    EXPECT_GE(s.accepted_tokens, max_possible * 95 / 100);
    ASSERT_EQ(s.accepted_per_position.size(), static_cast<size_t>(shape.depth));
    EXPECT_GE(s.accepted_per_position[0], s.draft_steps * 95 / 100);
  }
}

// The Generator reports each verified tree's accepted node with the sequence's next draft step
// (as the router does), so a drafter that keeps its KV commits the accepted path instead of
// feeding it again: outputs equal target-only with and without the reuse, and the draft model
// is fed fewer tokens with it. Every other request lets the goodput policy pick its shape
// (steps without a tree in between: the drafter's resync fallback).
TEST(SpeculativeTest, ReportedOutcomesLetTheDrafterKeepAcceptedKv) {
  const std::vector<GenerationResult>& want = GreedyBaseline();
  std::vector<GenerationRequest> requests = Requests({4, 2, 8}, SamplingParams(), 20);
  for (size_t i = 1; i < requests.size(); i += 2) requests[i].auto_shape = true;
  for (const std::string& dir : {M().target_dir, M().draft_dir}) {
    SCOPED_TRACE(dir);
    std::unique_ptr<Backend> draft = speculation_testing::Load(dir);
    ASSERT_NE(draft, nullptr);
    int64_t fed[2] = {0, 0}, accepted[2] = {0, 0};
    for (int reuse : {0, 1}) {
      CountingBackend counting(draft.get());
      DraftModelDrafter drafter(&counting, {/*backend_topk=*/true, /*reuse_kv=*/reuse != 0});
      absl::StatusOr<std::unique_ptr<Generator>> gen =
          Generator::Create(M().target.get(), &drafter);
      ASSERT_TRUE(gen.ok()) << gen.status();
      absl::StatusOr<std::vector<GenerationResult>> got = (*gen)->Generate(requests);
      ASSERT_TRUE(got.ok()) << got.status();
      for (size_t i = 0; i < got->size(); ++i) {
        EXPECT_EQ((*got)[i].tokens, want[i].tokens) << "reuse " << reuse << " request " << i;
      }
      fed[reuse] = counting.tokens();
      accepted[reuse] = Total(*got).accepted_tokens;
      EXPECT_EQ(draft->Usage().used_tokens, 0) << "every sequence released";
    }
    ASSERT_GT(accepted[1], 0);
    // Kept KV saves at least the accepted tokens that were expanded; leaves never expanded and
    // bonus tokens are fed either way.
    EXPECT_LT(fed[1], fed[0]) << "accepted " << accepted[1];
  }
}

// A stop token generated in the middle of a multi-token step ends the output right after it;
// later tokens of the step are neither returned nor streamed. Same for max_new_tokens.
TEST(SpeculativeTest, StopsInsideMultiTokenSteps) {
  const std::vector<GenerationResult>& base = GreedyBaseline();
  std::vector<GenerationRequest> stop_requests = Requests({6, 1, 6}, SamplingParams());
  std::vector<std::vector<int32_t>> want(stop_requests.size());
  for (size_t i = 0; i < stop_requests.size(); ++i) {
    const std::vector<int32_t>& b = base[i].tokens;
    ASSERT_GT(b.size(), 4u);
    const int32_t stop = b[3 + i % (b.size() - 4)];
    stop_requests[i].stop_token_ids = {stop};
    want[i].assign(b.begin(), std::find(b.begin(), b.end(), stop) + 1);
  }
  for (DrafterKind kind : {DrafterKind::kNone, DrafterKind::kSame, DrafterKind::kRelated}) {
    SCOPED_TRACE(DrafterName(kind));
    std::vector<std::vector<int32_t>> streamed;
    const std::vector<GenerationResult> got = GenerateAll(kind, stop_requests, 10, &streamed);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].tokens, want[i]) << i;
      EXPECT_EQ(streamed[i], want[i]) << i;
      EXPECT_EQ(got[i].finish_reason, FinishReason::kStop) << i;
    }
  }
  std::vector<GenerationRequest> short_requests = Requests({6, 1, 6}, SamplingParams());
  for (size_t i = 0; i < short_requests.size(); ++i) {
    short_requests[i].max_new_tokens = 1 + i % 9;
  }
  std::vector<std::vector<int32_t>> streamed;
  const std::vector<GenerationResult> got =
      GenerateAll(DrafterKind::kSame, short_requests, 10, &streamed);
  for (size_t i = 0; i < got.size(); ++i) {
    const std::vector<int32_t>& b = base[i].tokens;
    const size_t n = std::min<size_t>(short_requests[i].max_new_tokens, b.size());
    EXPECT_EQ(got[i].tokens, std::vector<int32_t>(b.begin(), b.begin() + n)) << i;
    EXPECT_EQ(streamed[i], got[i].tokens) << i;
  }
}

// Requests that opt out of speculation share steps with speculating ones and decode
// target-only.
TEST(SpeculativeTest, MixedBatchWithSpeculationOptOut) {
  const std::vector<GenerationResult>& want = GreedyBaseline();
  std::vector<GenerationRequest> requests = Requests({4, 2, 8}, SamplingParams());
  for (size_t i = 0; i < requests.size(); i += 3) requests[i].speculate = false;
  const std::vector<GenerationResult> got = GenerateAll(DrafterKind::kRelated, requests, 25);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].tokens, want[i].tokens) << i;
    if (requests[i].speculate) {
      EXPECT_GT(got[i].stats.draft_steps, 0) << i;
    } else {
      EXPECT_EQ(got[i].stats.draft_steps, 0) << i;
      EXPECT_EQ(got[i].stats.target_only_steps, static_cast<int64_t>(got[i].tokens.size()));
    }
  }
}

TEST(SpeculativeTest, RejectsBadRequests) {
  absl::StatusOr<std::unique_ptr<Generator>> gen =
      Generator::Create(M().target.get(), M().related_drafter.get());
  ASSERT_TRUE(gen.ok());
  GenerationRequest r;
  r.prompt = {1, 2, 3};
  r.sampling.top_p = 0;
  EXPECT_THAT((*gen)->Generate({r}).status().message(), HasSubstr("requests[0].sampling.top_p"));
  r.sampling = {};
  r.draft.max_nodes = 300;
  EXPECT_THAT((*gen)->Generate({r}).status().message(), HasSubstr("requests[0].draft.max_nodes"));
  r.draft = {};
  r.prompt = {1, kVocab};
  EXPECT_THAT((*gen)->Generate({r}).status().message(), HasSubstr("prompt[1]"));
  r.prompt = {};
  EXPECT_THAT((*gen)->Generate({r}).status().message(), HasSubstr("prompt"));
  r.prompt = {1};
  r.max_new_tokens = 0;
  EXPECT_THAT((*gen)->Generate({r}).status().message(), HasSubstr("max_new_tokens"));
  EXPECT_EQ(M().target->Usage().sequences, 0);

  absl::StatusOr<std::unique_ptr<NgramDrafter>> small = NgramDrafter::Create(100, {});
  ASSERT_TRUE(small.ok());
  EXPECT_THAT(Generator::Create(M().target.get(), small->get()).status().message(),
              HasSubstr("vocab_size"));
}

// Seeded sampling: speculation on or off gives exactly the same tokens, for every drafter,
// temperature, top-k and top-p (position-keyed Philox noise).
TEST(SpeculativeTest, SeededSamplingMatchesTargetOnlyTokenForToken) {
  struct Config {
    float temperature;
    int top_k;
    float top_p;
  };
  const std::vector<Config> configs = {{0.6f, 0, 1.0f}, {1.0f, 0, 1.0f}, {1.4f, 0, 1.0f},
                                       {1.0f, 8, 1.0f}, {1.0f, 0, 0.7f}, {0.8f, 20, 0.9f}};
  int64_t accepted = 0;
  for (size_t c = 0; c < configs.size(); ++c) {
    std::vector<GenerationRequest> requests = Requests({4, 3, 16}, {}, 20, 99 + c);
    for (size_t i = 0; i < requests.size(); ++i) {
      requests[i].sampling.temperature = configs[c].temperature;
      requests[i].sampling.top_k = configs[c].top_k;
      requests[i].sampling.top_p = configs[c].top_p;
      requests[i].sampling.seed = 1000 * c + i;
    }
    const std::vector<GenerationResult> want = GenerateAll(DrafterKind::kNone, requests, 20);
    for (DrafterKind kind : {DrafterKind::kSame, DrafterKind::kRelated, DrafterKind::kNgram}) {
      SCOPED_TRACE(absl::StrCat(DrafterName(kind), " config ", c));
      const std::vector<GenerationResult> got = GenerateAll(kind, requests, 7);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].tokens, want[i].tokens) << i;
      accepted += Total(got).accepted_tokens;
    }
    // Different seeds give different samples (the seed is really used).
    for (GenerationRequest& r : requests) r.sampling.seed += 12345;
    const std::vector<GenerationResult> reseeded = GenerateAll(DrafterKind::kNone, requests, 20);
    int differ = 0;
    for (size_t i = 0; i < want.size(); ++i) differ += reseeded[i].tokens != want[i].tokens;
    EXPECT_GT(differ, 10);
  }
  EXPECT_GT(accepted, 500);
}

// Cost priors (not measured, so every run decides the same) under which a batch of many
// sequences does not speculate and a lone one does; probes every few steps without drafts.
// With requests of different lengths the batch shrinks as they finish, so the policy switches
// shapes per sequence while they run.
GeneratorOptions SwitchingPolicy(bool measure) {
  GeneratorOptions o;
  o.policy.measure_costs = measure;
  o.policy.verify_fixed_s = 2e-3;
  o.policy.verify_per_row_s = 0.0;
  o.policy.verify_per_token_s = 0.3e-3;
  o.policy.draft_fixed_s = 0.2e-3;
  o.policy.draft_level_fixed_s = 0.5e-3;
  o.policy.draft_level_per_token_s = 0.02e-3;
  o.policy.probe_interval = 4;
  o.policy.hysteresis = 0.02;
  return o;
}

std::vector<GenerationRequest> AutoRequests(const SamplingParams& sampling, int n, uint32_t seed) {
  std::vector<GenerationRequest> requests = Requests(DraftParams(), sampling, n, seed);
  for (size_t i = 0; i < requests.size(); ++i) {
    requests[i].auto_shape = true;
    requests[i].max_new_tokens = 2 + static_cast<int>((i * 7) % 23);
  }
  return requests;
}

// Greedy output under the goodput policy equals target-only greedy for every drafter and batch
// size while the policy switches shapes (none, chains, trees) from step to step.
TEST(SpeculativeTest, GreedyUnderTheGoodputPolicyMatchesTargetOnly) {
  const std::vector<GenerationRequest> requests = AutoRequests(SamplingParams(), kPrompts, 4321);
  const std::vector<GenerationResult> want = GenerateAll(DrafterKind::kNone, requests, 1);
  SpecStats all;
  for (bool measure : {false, true}) {
    for (DrafterKind kind :
         {DrafterKind::kRelated, DrafterKind::kSame, DrafterKind::kOther, DrafterKind::kNgram}) {
      for (size_t batch : {1u, 7u, 50u}) {
        SCOPED_TRACE(absl::StrCat(DrafterName(kind), " batch ", batch, " measured ", measure));
        std::vector<std::vector<int32_t>> streamed;
        const std::vector<GenerationResult> got =
            GenerateAll(kind, requests, batch, &streamed, SwitchingPolicy(measure));
        ASSERT_EQ(got.size(), want.size());
        for (size_t i = 0; i < got.size(); ++i) {
          EXPECT_EQ(got[i].tokens, want[i].tokens) << "prompt " << i;
          EXPECT_EQ(got[i].finish_reason, want[i].finish_reason) << "prompt " << i;
          EXPECT_EQ(streamed[i], got[i].tokens) << "prompt " << i;
        }
        if (!measure) all.Add(Total(got));
      }
    }
  }
  // The policy really switched: steps with and without drafts, and shape changes.
  EXPECT_GT(all.draft_steps, 0);
  EXPECT_GT(all.target_only_steps, 0);
  EXPECT_GT(all.shape_changes, 0);
  EXPECT_GT(all.accepted_tokens, 0);
}

// Seeded sampling under the goodput policy equals target-only sampling token for token.
TEST(SpeculativeTest, SeededSamplingUnderTheGoodputPolicyMatchesTargetOnly) {
  SamplingParams sampling;
  sampling.temperature = 0.9f;
  sampling.top_k = 20;
  sampling.top_p = 0.95f;
  std::vector<GenerationRequest> requests = AutoRequests(sampling, 30, 777);
  for (size_t i = 0; i < requests.size(); ++i) requests[i].sampling.seed = 5000 + i;
  const std::vector<GenerationResult> want = GenerateAll(DrafterKind::kNone, requests, 30);
  SpecStats all;
  for (DrafterKind kind : {DrafterKind::kSame, DrafterKind::kRelated, DrafterKind::kNgram}) {
    for (size_t batch : {1u, 30u}) {
      SCOPED_TRACE(absl::StrCat(DrafterName(kind), " batch ", batch));
      const std::vector<GenerationResult> got =
          GenerateAll(kind, requests, batch, nullptr, SwitchingPolicy(false));
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].tokens, want[i].tokens) << i;
      all.Add(Total(got));
    }
  }
  EXPECT_GT(all.draft_steps, 0);
  EXPECT_GT(all.target_only_steps, 0);
  EXPECT_GT(all.shape_changes, 0);
}

// With auto_ngram the policy also has each sequence's n-gram proposal beside the drafter (as
// the router's auto has): greedy and seeded outputs still equal target-only, and sequences are
// drafted by both, the proposal where it pays (the motif prompts) and the drafter elsewhere.
TEST(SpeculativeTest, AutoWithNgramBesideTheDrafterMatchesTargetOnly) {
  SamplingParams seeded;
  seeded.temperature = 0.8f;
  seeded.top_k = 30;
  int64_t ngram_steps = 0, model_steps = 0, both = 0;
  for (const SamplingParams& sampling : {SamplingParams(), seeded}) {
    std::vector<GenerationRequest> requests = AutoRequests(sampling, 30, 99);
    for (size_t i = 0; i < requests.size(); ++i) {
      requests[i].sampling.seed = 300 + i;
      requests[i].max_new_tokens += 16;
    }
    const std::vector<GenerationResult> want = GenerateAll(DrafterKind::kNone, requests, 30);
    GeneratorOptions options = SwitchingPolicy(false);
    options.auto_ngram = true;
    for (DrafterKind kind : {DrafterKind::kSame, DrafterKind::kRelated}) {
      for (size_t batch : {1u, 30u}) {
        SCOPED_TRACE(absl::StrCat(DrafterName(kind), " batch ", batch, " temperature ",
                                  sampling.temperature));
        const std::vector<GenerationResult> got =
            GenerateAll(kind, requests, batch, nullptr, options);
        ASSERT_EQ(got.size(), want.size());
        for (size_t i = 0; i < got.size(); ++i) {
          EXPECT_EQ(got[i].tokens, want[i].tokens) << i;
          const int64_t ngram = got[i].stats.ngram_steps;
          ngram_steps += ngram;
          model_steps += got[i].stats.draft_steps - ngram;
          both += ngram > 0 && got[i].stats.draft_steps > ngram ? 1 : 0;
        }
      }
    }
  }
  EXPECT_GT(ngram_steps, 0);
  EXPECT_GT(model_steps, 0);
  EXPECT_GT(both, 0);  // a sequence drafted by each drafter in turn
  std::printf("%lld n-gram steps, %lld drafter steps, %lld sequences used both\n",
              static_cast<long long>(ngram_steps), static_cast<long long>(model_steps),
              static_cast<long long>(both));
}

// The logits processors under speculation: each tree node is processed with its own path, so
// greedy and seeded outputs equal target-only ones token for token, for every drafter.
TEST(SpeculativeTest, ProcessorsMatchTargetOnlyTokenForToken) {
  SamplingParams penalties;
  penalties.repetition_penalty = 1.4f;
  penalties.frequency_penalty = 0.6f;
  penalties.presence_penalty = 0.4f;
  penalties.logit_bias = {{32, 2.5f}, {101, -1.5f}, {200, 4.0f}};
  SamplingParams sampled = penalties;
  sampled.temperature = 0.9f;
  sampled.top_k = 40;
  sampled.min_p = 0.05f;
  SamplingParams min_p_only;
  min_p_only.temperature = 1.1f;
  min_p_only.min_p = 0.1f;
  SamplingParams negative;  // penalties below 1 / 0 reward repeats instead
  negative.repetition_penalty = 0.8f;
  negative.presence_penalty = -0.5f;
  const std::vector<SamplingParams> configs = {penalties, sampled, min_p_only, negative};
  int64_t accepted = 0;
  for (size_t c = 0; c < configs.size(); ++c) {
    std::vector<GenerationRequest> requests = Requests({4, 3, 16}, configs[c], 20, 500 + c);
    for (size_t i = 0; i < requests.size(); ++i) requests[i].sampling.seed = 77 * c + i;
    const std::vector<GenerationResult> want = GenerateAll(DrafterKind::kNone, requests, 20);
    for (DrafterKind kind : {DrafterKind::kSame, DrafterKind::kRelated, DrafterKind::kNgram}) {
      SCOPED_TRACE(absl::StrCat(DrafterName(kind), " config ", c));
      const std::vector<GenerationResult> got = GenerateAll(kind, requests, 7);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].tokens, want[i].tokens) << i;
      accepted += Total(got).accepted_tokens;
    }
    // The processors really act: without them the outputs differ.
    std::vector<GenerationRequest> plain = requests;
    for (GenerationRequest& r : plain) {
      r.sampling.repetition_penalty = 1.0f;
      r.sampling.presence_penalty = r.sampling.frequency_penalty = 0.0f;
      r.sampling.logit_bias.clear();
      r.sampling.min_p = 0.0f;
    }
    const std::vector<GenerationResult> unprocessed = GenerateAll(DrafterKind::kNone, plain, 20);
    int differ = 0;
    for (size_t i = 0; i < want.size(); ++i) differ += unprocessed[i].tokens != want[i].tokens;
    EXPECT_GT(differ, 5) << "config " << c;
  }
  EXPECT_GT(accepted, 300);
}

// min_tokens masks EOS and the stop ids until the output is long enough, with or without
// speculation: the stop that ends a plain run at its second token cannot come before the 6th.
TEST(SpeculativeTest, MinTokensHoldsStopsBackUnderSpeculation) {
  const std::vector<GenerationResult>& base = GreedyBaseline();
  std::vector<GenerationRequest> requests = Requests({5, 2, 12}, SamplingParams());
  for (size_t i = 0; i < requests.size(); ++i) {
    requests[i].stop_token_ids = {base[i].tokens[1]};
    requests[i].sampling.min_tokens = 6;
  }
  const std::vector<GenerationResult> want = GenerateAll(DrafterKind::kNone, requests, 10);
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_GE(want[i].tokens.size(), 6u) << i;
    const int32_t stop = requests[i].stop_token_ids[0];
    EXPECT_EQ(std::count(want[i].tokens.begin(), want[i].tokens.begin() + 6, stop), 0) << i;
  }
  for (DrafterKind kind : {DrafterKind::kSame, DrafterKind::kRelated, DrafterKind::kNgram}) {
    SCOPED_TRACE(DrafterName(kind));
    const std::vector<GenerationResult> got = GenerateAll(kind, requests, 10);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].tokens, want[i].tokens) << i;
      EXPECT_EQ(got[i].finish_reason, want[i].finish_reason) << i;
    }
  }
}

void ExpectSameLogprobs(const GenerationResult& got, const GenerationResult& want, size_t i) {
  ASSERT_EQ(got.logprobs.size(), got.tokens.size()) << i;
  ASSERT_EQ(want.logprobs.size(), want.tokens.size()) << i;
  for (size_t t = 0; t < got.logprobs.size() && t < want.logprobs.size(); ++t) {
    const TokenLogprobs& a = got.logprobs[t];
    const TokenLogprobs& b = want.logprobs[t];
    EXPECT_EQ(a.logprob, b.logprob) << i << " token " << t;
    EXPECT_EQ(a.rank, b.rank) << i << " token " << t;
    ASSERT_EQ(a.top.size(), b.top.size()) << i << " token " << t;
    for (size_t k = 0; k < a.top.size(); ++k) {
      EXPECT_EQ(a.top[k].token, b.top[k].token) << i << " token " << t;
      EXPECT_EQ(a.top[k].logprob, b.top[k].logprob) << i << " token " << t;
    }
  }
}

// Logprobs come from the row each token was drawn from, so accepted draft tokens report what
// target-only decoding reports, bit for bit: greedy raw, greedy with penalties (processed),
// seeded sampling with filters (processed).
TEST(SpeculativeTest, LogprobsMatchTargetOnly) {
  struct Config {
    SamplingParams sampling;
    int logprobs;
    LogprobsMode mode;
  };
  SamplingParams penalized;
  penalized.repetition_penalty = 1.3f;
  penalized.frequency_penalty = 0.5f;
  SamplingParams filtered;
  filtered.temperature = 0.8f;
  filtered.top_k = 20;
  filtered.top_p = 0.9f;
  filtered.presence_penalty = 0.7f;
  const std::vector<Config> configs = {{SamplingParams(), 5, LogprobsMode::kRaw},
                                       {penalized, 20, LogprobsMode::kProcessed},
                                       {filtered, 3, LogprobsMode::kProcessed},
                                       {filtered, 0, LogprobsMode::kRaw}};
  for (size_t c = 0; c < configs.size(); ++c) {
    std::vector<GenerationRequest> requests = Requests({4, 3, 16}, configs[c].sampling, 16);
    for (size_t i = 0; i < requests.size(); ++i) {
      requests[i].sampling.seed = 31 * i + c;
      requests[i].logprobs = configs[c].logprobs;
      requests[i].logprobs_mode = configs[c].mode;
    }
    const std::vector<GenerationResult> want = GenerateAll(DrafterKind::kNone, requests, 16);
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(want[i].logprobs.size(), want[i].tokens.size());
      for (size_t t = 0; t < want[i].tokens.size(); ++t) {
        const TokenLogprobs& lp = want[i].logprobs[t];
        EXPECT_LE(lp.logprob, 0.0f);
        if (configs[c].mode == LogprobsMode::kRaw || configs[c].sampling.greedy()) {
          EXPECT_EQ(lp.top.size(), static_cast<size_t>(configs[c].logprobs));
        } else {  // only tokens top-k and top-p kept have a probability
          EXPECT_LE(lp.top.size(), static_cast<size_t>(configs[c].logprobs));
        }
        if (configs[c].sampling.greedy()) {
          // Greedy picks the most likely token of the (processed) row.
          EXPECT_EQ(lp.rank, 1);
          EXPECT_EQ(lp.top[0].token, want[i].tokens[t]);
          EXPECT_EQ(lp.top[0].logprob, lp.logprob);
        }
      }
    }
    for (DrafterKind kind : {DrafterKind::kSame, DrafterKind::kRelated, DrafterKind::kNgram}) {
      SCOPED_TRACE(absl::StrCat(DrafterName(kind), " config ", c));
      const std::vector<GenerationResult> got = GenerateAll(kind, requests, 8);
      ASSERT_EQ(got.size(), want.size());
      int64_t accepted = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].tokens, want[i].tokens) << i;
        ExpectSameLogprobs(got[i], want[i], i);
        accepted += got[i].stats.accepted_tokens;
      }
      if (kind != DrafterKind::kNgram) EXPECT_GT(accepted, 20);
    }
  }
  // Not asked: none computed.
  const std::vector<GenerationResult> none =
      GenerateAll(DrafterKind::kRelated, Requests({4, 3, 16}, SamplingParams(), 4), 4);
  for (const GenerationResult& r : none) EXPECT_TRUE(r.logprobs.empty());
}

}  // namespace
}  // namespace specd
