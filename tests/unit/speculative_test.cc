// Lossless speculative decoding (docs/architecture.md) end to end on real checkpoint folders and
// the CPU backend: greedy output token-identical to target-only greedy for many prompts, tree
// shapes, drafters and batch sizes; seeded sampling token-identical to target-only sampling; stops
// inside multi-token steps; the logits processors (penalties, logit bias, min_tokens, min_p) and
// logprobs identical with speculation on and off; and chi-square tests that speculative sampling
// draws the first two tokens from the target's exact distribution, penalties included.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/io/safetensors.h"
#include "engine/backend.h"
#include "engine/draft/draft_model_drafter.h"
#include "engine/draft/eagle_drafter.h"
#include "engine/draft/eagle_head.h"
#include "engine/draft/ngram_drafter.h"
#include "engine/sampling.h"
#include "engine/spec/generator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testutil/chi_square.h"
#include "tests/testutil/extended_checkpoint.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

using ::testing::HasSubstr;

constexpr int kVocab = 300;
constexpr int kPrompts = 50;
constexpr int kNewTokens = 12;

std::unique_ptr<Backend> Load(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(dir, BackendOptions());
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? *std::move(b) : nullptr;
}

// A random EAGLE-3 head in the published layout for the two-layer, 32-wide target below: taps 0,
// 1 and 2 (the three distinct layer inputs a two-layer target has), a draft vocabulary of the
// first 100 target ids shifted by 7 (d2t), so the map is exercised.
absl::Status WriteRandomEagleHead(const std::string& dir) {
  std::filesystem::create_directories(dir);
  nlohmann::json config = {{"architectures", {"LlamaForCausalLMEagle3"}},
                           {"model_type", "llama"},
                           {"hidden_act", "silu"},
                           {"vocab_size", kVocab},
                           {"hidden_size", 32},
                           {"intermediate_size", 64},
                           {"num_attention_heads", 4},
                           {"num_key_value_heads", 2},
                           {"head_dim", 8},
                           {"num_hidden_layers", 1},
                           {"rms_norm_eps", 1e-5},
                           {"rope_theta", 10000.0},
                           {"max_position_embeddings", 4096},
                           {"tie_word_embeddings", false},
                           {"torch_dtype", "float32"},
                           {"draft_vocab_size", 100},
                           {"specd_tap_layer_inputs", {0, 1, 2}}};
  {
    std::ofstream out(std::filesystem::path(dir) / "config.json");
    out << config.dump(2);
    if (!out) return absl::InternalError("writing the EAGLE head's config.json");
  }
  std::mt19937 rng(31);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  std::vector<TensorToWrite> tensors;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool ones = false) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> v(n);
    for (float& x : v) x = ones ? 1.0f : normal(rng);
    TensorToWrite t;
    t.name = name;
    t.shape = std::move(shape);
    t.data.resize(v.size() * sizeof(float));
    std::memcpy(t.data.data(), v.data(), t.data.size());
    tensors.push_back(std::move(t));
  };
  add("fc.weight", {32, 96});
  add("midlayer.self_attn.q_proj.weight", {32, 64});
  add("midlayer.self_attn.k_proj.weight", {16, 64});
  add("midlayer.self_attn.v_proj.weight", {16, 64});
  add("midlayer.self_attn.o_proj.weight", {32, 32});
  add("midlayer.mlp.gate_proj.weight", {64, 32});
  add("midlayer.mlp.up_proj.weight", {64, 32});
  add("midlayer.mlp.down_proj.weight", {32, 64});
  for (const char* norm : {"midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                           "midlayer.post_attention_layernorm.weight", "norm.weight"}) {
    add(norm, {32}, /*ones=*/true);
  }
  add("lm_head.weight", {100, 32});
  TensorToWrite d2t;
  d2t.name = "d2t";
  d2t.dtype = DType::kI64;
  d2t.shape = {100};
  std::vector<int64_t> offsets(100, 7);
  d2t.data.resize(offsets.size() * sizeof(int64_t));
  std::memcpy(d2t.data.data(), offsets.data(), d2t.data.size());
  tensors.push_back(std::move(d2t));
  return WriteSafetensors((std::filesystem::path(dir) / "model.safetensors").string(), tensors);
}

// The models every test shares (written once per process): a draft; a target made of the
// draft plus one layer with small output projections, so drafts are often right as with a
// real small/large pair; and an unrelated random draft of another shape and family.
struct Models {
  std::string root, draft_dir, target_dir, other_dir;
  std::unique_ptr<Backend> target, draft, same, other;
  std::unique_ptr<DraftModelDrafter> related_drafter, same_drafter, other_drafter;
  std::unique_ptr<NgramDrafter> ngram;
  std::unique_ptr<EagleHead> eagle_head;
  std::unique_ptr<EagleDrafter> eagle_drafter;

  Models() {
    root = MakeTempDir("specd_spec_");
    draft_dir = root + "/draft";
    target_dir = root + "/target";
    other_dir = root + "/other";
    RandomCheckpointSpec spec;
    spec.vocab_size = kVocab;
    spec.hidden_size = 32;
    spec.intermediate_size = 64;
    spec.num_layers = 1;
    spec.num_heads = 4;
    spec.num_kv_heads = 2;
    spec.init_std = 0.3f;
    spec.seed = 21;
    EXPECT_TRUE(WriteRandomCheckpoint(draft_dir, spec).ok());
    ExtendSpec extend;
    extend.extra_layers = 1;
    extend.output_scale = 0.15f;
    extend.init_std = 0.3f;
    extend.seed = 22;
    EXPECT_TRUE(WriteExtendedCheckpoint(draft_dir, target_dir, extend).ok());
    RandomCheckpointSpec other_spec = spec;
    other_spec.seed = 77;
    other_spec.hidden_size = 48;
    other_spec.num_heads = 6;
    other_spec.num_kv_heads = 3;
    other_spec.model_type = "qwen2";
    EXPECT_TRUE(WriteRandomCheckpoint(other_dir, other_spec).ok());
    target = Load(target_dir);
    draft = Load(draft_dir);
    same = Load(target_dir);  // draft == target: its proposals are the target's favourites
    other = Load(other_dir);
    related_drafter = std::make_unique<DraftModelDrafter>(draft.get());
    same_drafter = std::make_unique<DraftModelDrafter>(same.get());
    other_drafter = std::make_unique<DraftModelDrafter>(other.get());
    ngram = *NgramDrafter::Create(kVocab, NgramOptions());
    EXPECT_TRUE(WriteRandomEagleHead(root + "/eagle").ok());
    absl::StatusOr<std::unique_ptr<EagleHead>> head =
        CreateEagleHead(root + "/eagle", target_dir, EagleHeadOptions());
    EXPECT_TRUE(head.ok()) << head.status();
    if (head.ok()) {
      eagle_head = *std::move(head);
      eagle_drafter = std::make_unique<EagleDrafter>(eagle_head.get());
    }
  }
  ~Models() {
    std::error_code ec;
    std::filesystem::remove_all(root, ec);
  }
};

Models& M() {
  static Models* models = new Models();
  return *models;
}

enum class DrafterKind { kNone, kRelated, kSame, kOther, kNgram, kEagle };

Drafter* GetDrafter(DrafterKind kind) {
  switch (kind) {
    case DrafterKind::kNone:
      return nullptr;
    case DrafterKind::kRelated:
      return M().related_drafter.get();
    case DrafterKind::kSame:
      return M().same_drafter.get();
    case DrafterKind::kOther:
      return M().other_drafter.get();
    case DrafterKind::kNgram:
      return M().ngram.get();
    case DrafterKind::kEagle:
      return M().eagle_drafter.get();
  }
  return nullptr;
}

const char* Name(DrafterKind kind) {
  switch (kind) {
    case DrafterKind::kNone:
      return "none";
    case DrafterKind::kRelated:
      return "related";
    case DrafterKind::kSame:
      return "same";
    case DrafterKind::kOther:
      return "other";
    case DrafterKind::kNgram:
      return "ngram";
    case DrafterKind::kEagle:
      return "eagle";
  }
  return "?";
}

// Runs `requests` over the shared target, `batch` requests per Generator::Generate() call (so `batch`
// sequences share every Draft and Verify call).
std::vector<GenerationResult> GenerateAll(DrafterKind kind,
                                          const std::vector<GenerationRequest>& requests,
                                          size_t batch,
                                          std::vector<std::vector<int32_t>>* streamed = nullptr,
                                          const GeneratorOptions& options = GeneratorOptions()) {
  absl::StatusOr<std::unique_ptr<Generator>> gen =
      Generator::Create(M().target.get(), GetDrafter(kind), options);
  EXPECT_TRUE(gen.ok()) << gen.status();
  if (!gen.ok()) return {};
  std::vector<GenerationResult> out;
  if (streamed != nullptr) streamed->assign(requests.size(), {});
  for (size_t i = 0; i < requests.size(); i += batch) {
    const size_t n = std::min(batch, requests.size() - i);
    TokenCallback cb = nullptr;
    if (streamed != nullptr) {
      cb = [&, i](size_t index, absl::Span<const int32_t> tokens) {
        (*streamed)[i + index].insert((*streamed)[i + index].end(), tokens.begin(),
                                      tokens.end());
      };
    }
    absl::StatusOr<std::vector<GenerationResult>> r =
        (*gen)->Generate(absl::MakeConstSpan(requests).subspan(i, n), cb);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return {};
    out.insert(out.end(), r->begin(), r->end());
  }
  EXPECT_EQ(M().target->Usage().sequences, 0) << "sequences leaked in the target";
  return out;
}

SpecStats Total(const std::vector<GenerationResult>& results) {
  SpecStats s;
  for (const GenerationResult& r : results) s.Add(r.stats);
  return s;
}

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
  return absl::StrCat(Name(c.kind), "_d", c.shape.depth, "_k", c.shape.top_k, "_n",
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
        << "accepted " << s.accepted_tokens << " of " << s.draft_tokens << " in "
        << s.draft_steps << " steps";
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
    SCOPED_TRACE(Name(kind));
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
  const std::vector<GenerationResult> got = GenerateAll(DrafterKind::kSame, short_requests, 10, &streamed);
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
      SCOPED_TRACE(absl::StrCat(Name(kind), " config ", c));
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
        SCOPED_TRACE(absl::StrCat(Name(kind), " batch ", batch, " measured ", measure));
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
      SCOPED_TRACE(absl::StrCat(Name(kind), " batch ", batch));
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
      SCOPED_TRACE(absl::StrCat(Name(kind), " config ", c));
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
    SCOPED_TRACE(Name(kind));
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
      SCOPED_TRACE(absl::StrCat(Name(kind), " config ", c));
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
      pool = static_cast<int>(std::min_element(expected.begin(), expected.end()) -
                              expected.begin());
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
  s.min_tokens_stop_ids.insert(s.min_tokens_stop_ids.end(), order.begin() + 3,
                               order.begin() + 6);
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
  const std::vector<int> plain = bins.Observed(Sample(DrafterKind::kNone, prompt, sampling, n,
                                                      1, &stats));
  EXPECT_EQ(stats.draft_steps, 0);
  EXPECT_LT(bins.Statistic(plain), critical) << "target-only sampling, df " << bins.df();

  uint64_t seed0 = 1;
  for (DrafterKind kind : {DrafterKind::kSame, DrafterKind::kRelated, DrafterKind::kEagle}) {
    SCOPED_TRACE(Name(kind));
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

INSTANTIATE_TEST_SUITE_P(Sampling, DistributionTest,
                         ::testing::Values(
                             DistributionCase{"t100_k0_p100", [] { return Filters(1.0f, 0, 1.0f); }},
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
