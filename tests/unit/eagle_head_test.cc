// specd's CPU EAGLE head forward against the PyTorch reference (tools/oracle/eagle3_reference.py).
// tests/fixtures/eagle3 (tools/oracle/make_eagle_fixtures.py) holds a tiny target, a random
// EAGLE-3 head (draft vocabulary 64 of 256; also read with norm_before_residual) and a random
// two-layer EAGLE-1/2 head in their published layouts, and for each head a script of Forward/Commit
// calls with the reference's outputs: a prefill chain from the target's features, three tree levels
// fed with the head's own outputs, a commit, a second chain and one more level; and a 2100-pair
// chain with two levels beyond the head's 2048-position RoPE table. The replay feeds each level the
// outputs specd computed itself, as the drafter will, and compares every output (logits and hidden
// states) with the reference's, which computed in float64.
#include "engine/draft/eagle_head.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/io/safetensors.h"
#include "engine/draft/eagle_head_cpu.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testutil/eagle_replay.h"
#include "tests/testutil/hf_fixtures.h"

namespace specd {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using ::testing::HasSubstr;
using testutil::ReadJson;
using testutil::RelError;
using testutil::Replay;
using testutil::RepoRoot;

constexpr double kMaxRelError = 1e-4;

fs::path FixtureDir() { return RepoRoot() / "tests" / "fixtures" / "eagle3"; }

std::unique_ptr<EagleHead> LoadHead(const std::string& name, EagleHeadOptions options = {}) {
  options.num_threads = 1;
  absl::StatusOr<std::unique_ptr<EagleHead>> head =
      CreateEagleHead((FixtureDir() / name).string(), (FixtureDir() / "target").string(), options);
  EXPECT_TRUE(head.ok()) << head.status();
  return head.ok() ? *std::move(head) : nullptr;
}

class EagleOracleTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ASSERT_FALSE(RepoRoot().empty()) << "tests/fixtures not found above " << fs::current_path();
    oracle_json_ = ReadJson(FixtureDir() / "oracle.json");
    absl::StatusOr<std::unique_ptr<TensorStore>> store =
        TensorStore::OpenFolder(FixtureDir().string());
    ASSERT_TRUE(store.ok()) << store.status();
    oracle_ = *std::move(store);
    scenario_ = oracle_json_["scenarios"][GetParam()];
    head_ = LoadHead(scenario_["head"].get<std::string>());
    ASSERT_NE(head_, nullptr);
  }

  json oracle_json_, scenario_;
  std::unique_ptr<TensorStore> oracle_;
  std::unique_ptr<EagleHead> head_;
};

TEST_P(EagleOracleTest, EveryStepMatchesTheReference) {
  Replay replay(head_.get(), oracle_.get(), scenario_, /*twin=*/false, kMaxRelError);
  replay.Run();
  std::printf("%s: worst relative error %.3g\n", GetParam().c_str(), replay.worst());
}

// Two sequences in every call give each the bits it gets alone (and the reference's values).
TEST_P(EagleOracleTest, BatchedSequencesMatchTheReference) {
  Replay replay(head_.get(), oracle_.get(), scenario_, /*twin=*/true, kMaxRelError);
  replay.Run();
}

INSTANTIATE_TEST_SUITE_P(Scenarios, EagleOracleTest,
                         ::testing::Values("eagle3", "eagle3_nbr", "eagle1", "long"));

TEST(EagleHeadTest, ServesTheTargetsContextNotTheHeadsTable) {
  std::unique_ptr<EagleHead> head = LoadHead("eagle3_head");
  ASSERT_NE(head, nullptr);
  EXPECT_EQ(head->config().head.max_position_embeddings, 2048);  // as its config.json states
  EXPECT_EQ(head->context_length(), 4096);                       // the target's
}

TEST(EagleHeadTest, RefusesPositionsBeyondTheContext) {
  EagleHeadOptions options;
  options.context_length = 8;
  std::unique_ptr<EagleHead> head = LoadHead("eagle3_head", options);
  ASSERT_NE(head, nullptr);
  ASSERT_TRUE(head->AddSequence(1).ok());
  const int64_t fw = head->config().feature_size();
  std::vector<float> feats(9 * fw, 0.5f);
  EagleHeadItem item;
  item.seq = 1;
  for (int i = 0; i < 9; ++i) {
    item.tokens.push_back(3 + i);
    item.parents.push_back(i - 1);
  }
  item.inputs = feats;
  EagleHeadOutputs out;
  const absl::Status s = head->Forward({item}, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("position 8 is beyond the context"));
  EXPECT_EQ(*head->CommittedLength(1), 0);
  // Eight pairs fit.
  item.tokens.pop_back();
  item.parents.pop_back();
  item.inputs = absl::Span<const float>(feats).subspan(0, 8 * fw);
  item.output_rows = {7};
  ASSERT_TRUE(head->Forward({item}, &out).ok());
  EXPECT_EQ(out.logits.size(), static_cast<size_t>(head->config().draft_vocab_size));
}

TEST(EagleHeadTest, BadItemsAreRefusedWithoutChangingAnySequence) {
  std::unique_ptr<EagleHead> head = LoadHead("eagle3_head");
  ASSERT_NE(head, nullptr);
  ASSERT_TRUE(head->AddSequence(1).ok());
  ASSERT_TRUE(head->AddSequence(2).ok());
  const int64_t fw = head->config().feature_size(), H = head->config().head.hidden_size;
  std::vector<float> feats(2 * fw, 0.25f);
  EagleHeadItem good;
  good.seq = 1;
  good.tokens = {5, 6};
  good.parents = {-1, 0};
  good.inputs = feats;
  good.output_rows = {1};
  EagleHeadOutputs out;

  EagleHeadItem wrong_width = good;
  wrong_width.seq = 2;
  wrong_width.input = EagleInput::kHidden;  // 2 x 96 floats are not 2 x 32
  absl::Status s = head->Forward({good, wrong_width}, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("items[1].inputs"));
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("expected ", 2 * H)));

  EagleHeadItem bad_token = good;
  bad_token.seq = 2;
  bad_token.tokens = {5, 256};
  s = head->Forward({good, bad_token}, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("items[1].tokens[1] = 256"));

  EagleHeadItem unknown = good;
  unknown.seq = 9;
  EXPECT_EQ(head->Forward({good, unknown}, &out).code(), absl::StatusCode::kNotFound);

  EagleHeadItem bad_row = good;
  bad_row.seq = 2;
  bad_row.output_rows = {2};
  EXPECT_EQ(head->Forward({good, bad_row}, &out).code(), absl::StatusCode::kInvalidArgument);

  // Nothing was appended: committing the two good pairs fails until they are fed.
  EXPECT_FALSE(head->Commit(1, {0, 1}).ok());
  ASSERT_TRUE(head->Forward({good}, &out).ok());
  ASSERT_TRUE(head->Commit(1, {0, 1}).ok());
  EXPECT_EQ(*head->CommittedLength(1), 2);
  EXPECT_EQ(*head->CommittedLength(2), 0);
}

// The trained head committed for the reference target loads against it as published.
TEST(EagleHeadTest, TheReferenceHeadLoads) {
  EagleHeadOptions options;
  options.num_threads = 1;
  absl::StatusOr<std::unique_ptr<EagleHead>> head =
      CreateEagleHead((RepoRoot() / "models" / "pycoder-eagle3").string(),
                      (RepoRoot() / "models" / "pycoder-target").string(), options);
  ASSERT_TRUE(head.ok()) << head.status();
  const EagleHeadConfig& c = (*head)->config();
  EXPECT_EQ(c.kind, EagleKind::kEagle3);
  EXPECT_EQ(c.taps, (std::vector<int>{1, 2, 4}));
  EXPECT_EQ(c.draft_vocab_size, 8192);
  EXPECT_EQ((*head)->context_length(), 1024);
  const absl::Span<const int32_t> d2t = (*head)->draft_to_target();
  ASSERT_EQ(d2t.size(), 8192u);
  for (size_t i = 1; i < d2t.size(); ++i) ASSERT_LT(d2t[i - 1], d2t[i]);
  ASSERT_TRUE((*head)->AddSequence(1).ok());
  std::vector<float> feats(4 * c.feature_size(), 0.1f);
  EagleHeadItem item;
  item.seq = 1;
  item.tokens = {10, 11, 12, 13};
  item.parents = {-1, 0, 1, 2};
  item.inputs = feats;
  item.output_rows = {3};
  EagleHeadOutputs out;
  ASSERT_TRUE((*head)->Forward({item}, &out).ok());
  EXPECT_EQ(out.logits.size(), 8192u);
  EXPECT_EQ(out.hidden.size(), 320u);
}

// The reference head is a bf16 checkpoint: its GEMM matrices are kept as bf16 (half the bytes a
// forward streams) and give the fp32 matrices' outputs bit for bit, over a chain and a tree level.
TEST(EagleHeadTest, TheReferenceHeadsBf16MatricesGiveTheFp32Bits) {
  std::unique_ptr<EagleHead> heads[2];
  for (int packed = 0; packed < 2; ++packed) {
    EagleHeadOptions options;
    options.num_threads = 1;
    options.cpu_bf16_weights = packed == 1;
    absl::StatusOr<std::unique_ptr<EagleHead>> head =
        CreateEagleHead((RepoRoot() / "models" / "pycoder-eagle3").string(),
                        (RepoRoot() / "models" / "pycoder-target").string(), options);
    ASSERT_TRUE(head.ok()) << head.status();
    heads[packed] = *std::move(head);
  }
  const auto* fp32 = dynamic_cast<const EagleHeadCpu*>(heads[0].get());
  const auto* bf16 = dynamic_cast<const EagleHeadCpu*>(heads[1].get());
  ASSERT_TRUE(fp32 != nullptr && bf16 != nullptr);
  EXPECT_EQ(bf16->GemmWeightBytes() * 2, fp32->GemmWeightBytes());

  const EagleHeadConfig& c = heads[0]->config();
  const int64_t fw = c.feature_size(), h = c.head.hidden_size;
  std::vector<float> feats(6 * fw);
  for (size_t i = 0; i < feats.size(); ++i) feats[i] = std::sin(0.37f * static_cast<float>(i));
  EagleHeadItem chain;
  chain.seq = 1;
  chain.tokens = {10, 11, 12, 13, 14, 15};
  chain.parents = {-1, 0, 1, 2, 3, 4};
  chain.inputs = feats;
  chain.output_rows = {5, 2};
  EagleHeadOutputs outs[2];
  for (int packed = 0; packed < 2; ++packed) {
    ASSERT_TRUE(heads[packed]->AddSequence(1).ok());
    ASSERT_TRUE(heads[packed]->Forward({chain}, &outs[packed]).ok());
    ASSERT_TRUE(heads[packed]->Commit(1, {0, 1, 2, 3, 4, 5}).ok());
  }
  ASSERT_EQ(outs[0].logits.size(), 2u * c.draft_vocab_size);
  EXPECT_EQ(outs[0].logits, outs[1].logits);
  EXPECT_EQ(outs[0].hidden, outs[1].hidden);

  // A level of four nodes fed the chain's last output.
  std::vector<float> hidden;
  for (int i = 0; i < 4; ++i)
    hidden.insert(hidden.end(), outs[0].hidden.begin(), outs[0].hidden.begin() + h);
  EagleHeadItem level;
  level.seq = 1;
  level.input = EagleInput::kHidden;
  level.tokens = {20, 21, 22, 23};
  level.parents = {-1, -1, 0, 1};
  level.inputs = hidden;
  level.output_rows = {3, 0, 1, 2};
  for (int packed = 0; packed < 2; ++packed) {
    ASSERT_TRUE(heads[packed]->Forward({level}, &outs[packed]).ok());
  }
  ASSERT_EQ(outs[0].logits.size(), 4u * c.draft_vocab_size);
  EXPECT_EQ(outs[0].logits, outs[1].logits);
  EXPECT_EQ(outs[0].hidden, outs[1].hidden);
}

// The head's last layer runs queries, attention, o_proj and the MLP for the requested rows only;
// the other rows of a chain are there for their keys and values. A row's outputs are the same bits
// whichever other rows are asked for, and the keys left behind serve the next forward alike.
TEST(EagleHeadTest, OutputsDoNotDependOnWhichOtherRowsAreRequested) {
  for (const char* name : {"eagle3_head", "eagle3_nbr_head", "eagle1_head"}) {
    SCOPED_TRACE(name);
    std::unique_ptr<EagleHead> all = LoadHead(name);
    std::unique_ptr<EagleHead> last = LoadHead(name);
    ASSERT_TRUE(all && last);
    const int64_t fw = all->config().feature_size(), h = all->config().head.hidden_size;
    std::vector<float> feats(7 * fw);
    for (size_t i = 0; i < feats.size(); ++i) feats[i] = std::cos(0.29f * static_cast<float>(i));
    EagleHeadItem chain;
    chain.seq = 1;
    chain.tokens = {5, 6, 7, 8, 9, 10, 11};
    chain.parents = {-1, 0, 1, 2, 3, 4, 5};
    chain.inputs = feats;
    EagleHeadOutputs full, one;
    ASSERT_TRUE(all->AddSequence(1).ok());
    ASSERT_TRUE(last->AddSequence(1).ok());
    chain.output_rows = {0, 1, 2, 3, 4, 5, 6};
    ASSERT_TRUE(all->Forward({chain}, &full).ok());
    chain.output_rows = {6};
    ASSERT_TRUE(last->Forward({chain}, &one).ok());
    const int64_t dv = all->config().draft_vocab_size;
    EXPECT_EQ(std::vector<float>(full.hidden.begin() + 6 * h, full.hidden.end()), one.hidden);
    EXPECT_EQ(std::vector<float>(full.logits.begin() + 6 * dv, full.logits.end()), one.logits);
    chain.output_rows = {};
    ASSERT_TRUE(all->Commit(1, {0, 1, 2, 3, 4, 5, 6}).ok());
    ASSERT_TRUE(last->Commit(1, {0, 1, 2, 3, 4, 5, 6}).ok());

    // A tree level over the committed chain, every output asked for: the keys the chain left
    // behind are the same in both heads.
    std::vector<float> hidden(one.hidden);
    hidden.insert(hidden.end(), one.hidden.begin(), one.hidden.end());
    EagleHeadItem level;
    level.seq = 1;
    level.input = EagleInput::kHidden;
    level.tokens = {30, 31};
    level.parents = {-1, 0};
    level.inputs = hidden;
    level.output_rows = {1, 0};
    ASSERT_TRUE(all->Forward({level}, &full).ok());
    ASSERT_TRUE(last->Forward({level}, &one).ok());
    EXPECT_EQ(full.hidden, one.hidden);
    EXPECT_EQ(full.logits, one.logits);
  }
}

TEST(EagleHeadTest, ForwardTopKIsTheTopKOfForwardsLogits) {
  std::unique_ptr<EagleHead> head = LoadHead("eagle3_head");
  std::unique_ptr<EagleHead> twin = LoadHead("eagle3_head");
  ASSERT_TRUE(head && twin);
  const int64_t fw = head->config().feature_size(), dv = head->config().draft_vocab_size;
  std::vector<float> feats(5 * fw);
  for (size_t i = 0; i < feats.size(); ++i) feats[i] = std::sin(0.37f * static_cast<float>(i));
  EagleHeadItem item;
  item.seq = 1;
  item.tokens = {3, 9, 27, 81, 243};
  item.parents = {-1, 0, 1, 2, 3};
  item.inputs = feats;
  item.output_rows = {4, 1};
  ASSERT_TRUE(head->AddSequence(1).ok());
  ASSERT_TRUE(twin->AddSequence(1).ok());
  EagleHeadOutputs full, topped;
  ASSERT_TRUE(head->Forward({item}, &full).ok());
  TopKRows top;
  ASSERT_TRUE(twin->ForwardTopK({item}, 5, &topped, &top).ok());
  EXPECT_TRUE(topped.logits.empty());
  EXPECT_EQ(topped.hidden, full.hidden);
  ASSERT_EQ(top.k, 5);
  ASSERT_EQ(top.rows(), 2);
  for (int64_t r = 0; r < 2; ++r) {
    std::vector<int32_t> ids(5);
    std::vector<float> lp(5);
    RowTopKLogprobs(absl::MakeConstSpan(full.logits).subspan(r * dv, dv), 5, ids.data(), lp.data());
    EXPECT_EQ(std::vector<int32_t>(top.ids.begin() + r * 5, top.ids.begin() + (r + 1) * 5), ids);
    EXPECT_EQ(std::vector<float>(top.logprobs.begin() + r * 5, top.logprobs.begin() + (r + 1) * 5),
              lp);
  }
  for (int k : {0, kMaxForwardTopK + 1}) {
    const absl::Status s = twin->ForwardTopK({}, k, &topped, &top);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k;
    EXPECT_THAT(s.message(), HasSubstr("k: ")) << k;
  }
}

TEST(EagleHeadTest, WarmUpRunsEachRowCountAndLeavesTheHeadAsItWas) {
  EagleHeadOptions small;
  small.kv_capacity_tokens = 40;
  std::unique_ptr<EagleHead> cold = LoadHead("eagle3_head");
  std::unique_ptr<EagleHead> warm = LoadHead("eagle3_head", small);
  ASSERT_TRUE(cold && warm);
  ASSERT_TRUE(warm->AddSequence(5).ok());
  const KvUsage before = warm->Usage();
  // 64 and 1024 exceed the free capacity (40) and are left out.
  absl::StatusOr<WarmUpReport> report = WarmUpEagleHead(*warm, {1, 2, 17, 33, 64, 1024});
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->rows, (std::vector<int64_t>{1, 2, 17, 33}));
  EXPECT_GE(report->seconds, 0);
  const KvUsage after = warm->Usage();
  EXPECT_EQ(after.sequences, before.sequences);
  EXPECT_EQ(after.used_tokens, before.used_tokens);
  EXPECT_TRUE(warm->HasSequence(5));
  // Outputs unchanged by the warm-up.
  const int64_t fw = cold->config().feature_size();
  std::vector<float> feats(3 * fw);
  for (size_t i = 0; i < feats.size(); ++i) feats[i] = std::cos(0.11f * static_cast<float>(i));
  EagleHeadItem item;
  item.seq = 9;
  item.tokens = {4, 8, 15};
  item.parents = {-1, 0, 1};
  item.inputs = feats;
  item.output_rows = {0, 1, 2};
  EagleHeadOutputs a, b;
  ASSERT_TRUE(cold->AddSequence(9).ok());
  ASSERT_TRUE(warm->AddSequence(9).ok());
  ASSERT_TRUE(cold->Forward({item}, &a).ok());
  ASSERT_TRUE(warm->Forward({item}, &b).ok());
  EXPECT_EQ(a.logits, b.logits);
  EXPECT_EQ(a.hidden, b.hidden);
}

TEST(EagleHeadTest, OptionsAreChecked) {
  const std::string head = (FixtureDir() / "eagle3_head").string();
  const std::string target = (FixtureDir() / "target").string();
  EagleHeadOptions options;
  for (const char* device : {"tpu:0", "cuda:x", "cuda:-1"}) {
    options.device = device;
    const absl::Status s = CreateEagleHead(head, target, options).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << device << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr("device")) << device;
  }
#ifndef SPECD_WITH_CUDA
  // A build without CUDA has no cuda device at all (the CUDA head, EAGLE-3 and EAGLE-1/2 alike,
  // is tests/gpu/cuda_eagle_head_test.cc's).
  options.device = "cuda:0";
  for (const char* name : {"eagle3_head", "eagle1_head"}) {
    EXPECT_EQ(CreateEagleHead((FixtureDir() / name).string(), target, options).status().code(),
              absl::StatusCode::kUnimplemented)
        << name;
  }
#endif
  options = {};
  options.kv_capacity_tokens = 0;
  absl::Status s = CreateEagleHead(head, target, options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("kv_capacity_tokens"));
  options = {};
  options.context_length = -1;
  s = CreateEagleHead(head, target, options).status();
  EXPECT_THAT(s.message(), HasSubstr("context_length"));
}

}  // namespace
}  // namespace specd
