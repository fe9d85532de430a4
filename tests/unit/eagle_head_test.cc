// specd's CPU EAGLE head forward against the PyTorch reference (tools/oracle/eagle3_reference.py).
// tests/fixtures/eagle3 (tools/oracle/make_eagle_fixtures.py) holds a tiny target, a random
// EAGLE-3 head (draft vocabulary 64 of 256; also read with norm_before_residual) and a random
// two-layer EAGLE-1/2 head in their published layouts, and for each head a script of Forward/Commit calls with the reference's
// outputs: a prefill chain from the target's features, three tree levels fed with the head's own
// outputs, a commit, a second chain and one more level; and a 2100-pair chain with two levels
// beyond the head's 2048-position RoPE table. The replay feeds each level the outputs specd
// computed itself, as the drafter will, and compares every output (logits and hidden states)
// with the reference's, which computed in float64.
#include "engine/draft/eagle_head.h"

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/io/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testutil/hf_fixtures.h"

namespace specd {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using ::testing::HasSubstr;
using testutil::ReadJson;
using testutil::RelError;
using testutil::RepoRoot;

constexpr double kMaxRelError = 1e-4;

fs::path FixtureDir() { return RepoRoot() / "tests" / "fixtures" / "eagle3"; }

std::unique_ptr<EagleHead> LoadHead(const std::string& name, EagleHeadOptions options = {}) {
  options.num_threads = 1;
  absl::StatusOr<std::unique_ptr<EagleHead>> head = CreateEagleHead(
      (FixtureDir() / name).string(), (FixtureDir() / "target").string(), options);
  EXPECT_TRUE(head.ok()) << head.status();
  return head.ok() ? *std::move(head) : nullptr;
}

// A float tensor of the oracle file, with its shape.
std::vector<float> Tensor(const TensorStore& store, const std::string& name,
                          std::vector<int64_t>* shape = nullptr) {
  absl::StatusOr<const TensorView*> v = store.Get(name);
  EXPECT_TRUE(v.ok()) << v.status();
  if (!v.ok()) return {};
  std::vector<float> out((*v)->numel());
  EXPECT_TRUE(store.ReadF32(name, (*v)->shape, out.data()).ok());
  if (shape != nullptr) *shape = (*v)->shape;
  return out;
}

std::vector<double> Row(const std::vector<float>& t, int64_t width, int64_t row) {
  return std::vector<double>(t.begin() + row * width, t.begin() + (row + 1) * width);
}

// Replays one scenario of oracle.json on `head`. With `twin`, every feed and commit also runs for
// a second sequence (id + 100) in the same call, with the same nodes listed first; its outputs
// must equal the first sequence's bit for bit.
class Replay {
 public:
  Replay(EagleHead* head, const TensorStore* oracle, const json& scenario, bool twin)
      : head_(head), oracle_(oracle), scenario_(scenario), twin_(twin) {
    features_ = Tensor(*oracle, scenario["features"].get<std::string>(), &feature_shape_);
  }

  void Run() {
    const json& calls = scenario_["calls"];
    outputs_.resize(calls.size());
    for (size_t c = 0; c < calls.size(); ++c) {
      SCOPED_TRACE(absl::StrCat("call ", c));
      const json& call = calls[c];
      const SeqId seq = call["seq"].get<SeqId>();
      for (SeqId s : Seqs(seq)) {
        if (!head_->HasSequence(s)) ASSERT_TRUE(head_->AddSequence(s).ok());
      }
      if (call["op"] == "commit") {
        const auto path = call["path"].get<std::vector<int32_t>>();
        for (SeqId s : Seqs(seq)) ASSERT_TRUE(head_->Commit(s, path).ok());
        continue;
      }
      Feed(c, call);
      if (HasFailure()) return;
    }
  }

 private:
  std::vector<SeqId> Seqs(SeqId seq) const {
    return twin_ ? std::vector<SeqId>{seq + 100, seq} : std::vector<SeqId>{seq};
  }
  static bool HasFailure() { return ::testing::Test::HasFailure(); }

  void Feed(size_t c, const json& call) {
    const int64_t H = head_->config().head.hidden_size;
    const int64_t dv = head_->config().draft_vocab_size;
    const int vocab = head_->config().vocab_size;
    const json& in = call["input"];
    EagleHeadItem item;
    item.seq = call["seq"].get<SeqId>();
    std::vector<float> inputs;
    if (call.contains("tokens")) {
      item.tokens = call["tokens"].get<std::vector<int32_t>>();
      item.parents = call["parents"].get<std::vector<int32_t>>();
    } else {  // the long chain: tokens (p * 37 + 11) % vocab
      const int n = call["length"].get<int>();
      for (int p = 0; p < n; ++p) {
        item.tokens.push_back((p * 37 + 11) % vocab);
        item.parents.push_back(p - 1);
      }
    }
    const int64_t n = static_cast<int64_t>(item.tokens.size());
    const std::string kind = in["kind"].get<std::string>();
    const int64_t fw = feature_shape_[1];
    if (kind == "target" || kind == "periodic") {
      item.input = EagleInput::kTargetFeatures;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t r = kind == "target" ? in["rows"][j].get<int64_t>()
                                           : j % in["period"].get<int64_t>();
        inputs.insert(inputs.end(), features_.begin() + r * fw, features_.begin() + (r + 1) * fw);
      }
    } else {
      ASSERT_EQ(kind, "hidden");
      item.input = EagleInput::kHidden;
      for (const json& from : in["from"]) {
        const std::vector<float>& h = outputs_[from[0].get<size_t>()].hidden;
        const int64_t r = from[1].get<int64_t>();
        inputs.insert(inputs.end(), h.begin() + r * H, h.begin() + (r + 1) * H);
      }
    }
    item.inputs = inputs;
    for (int64_t j = 0; j < n; ++j) item.output_rows.push_back(static_cast<int32_t>(j));
    std::vector<EagleHeadItem> batch;
    if (twin_) {
      batch.push_back(item);
      batch.back().seq += 100;
    }
    batch.push_back(item);
    EagleHeadOutputs out;
    ASSERT_TRUE(head_->Forward(batch, &out).ok());
    ASSERT_EQ(out.hidden.size(), batch.size() * n * H);
    ASSERT_EQ(out.logits.size(), batch.size() * n * dv);
    EagleHeadOutputs& mine = outputs_[c];
    const size_t skip = twin_ ? 1 : 0;
    mine.hidden.assign(out.hidden.begin() + skip * n * H, out.hidden.end());
    mine.logits.assign(out.logits.begin() + skip * n * dv, out.logits.end());
    if (twin_) {
      EXPECT_TRUE(std::equal(mine.hidden.begin(), mine.hidden.end(), out.hidden.begin()));
      EXPECT_TRUE(std::equal(mine.logits.begin(), mine.logits.end(), out.logits.begin()));
    }
    if (call.contains("draft_ids")) {
      const auto drafts = call["draft_ids"].get<std::vector<int32_t>>();
      for (int64_t j = 0; j < n; ++j) {
        EXPECT_EQ(head_->draft_to_target()[drafts[j]], item.tokens[j]) << "node " << j;
      }
    }

    const std::string key = call["out"].get<std::string>();
    const std::vector<float> want_h = Tensor(*oracle_, key + "/hidden");
    const std::vector<float> want_l = Tensor(*oracle_, key + "/logits");
    std::vector<int64_t> rows;
    if (call.contains("checked_rows")) {
      rows = call["checked_rows"].get<std::vector<int64_t>>();
    } else {
      for (int64_t j = 0; j < n; ++j) rows.push_back(j);
    }
    for (size_t i = 0; i < rows.size(); ++i) {
      const int64_t r = rows[i];
      const absl::Span<const float> got_h(&mine.hidden[r * H], H);
      const absl::Span<const float> got_l(&mine.logits[r * dv], dv);
      EXPECT_LE(RelError(got_h, Row(want_h, H, i)), kMaxRelError) << key << " hidden row " << r;
      EXPECT_LE(RelError(got_l, Row(want_l, dv, i)), kMaxRelError) << key << " logits row " << r;
      worst_ = std::max({worst_, RelError(got_l, Row(want_l, dv, i)),
                         RelError(got_h, Row(want_h, H, i))});
    }
  }

 public:
  double worst() const { return worst_; }

 private:
  EagleHead* head_;
  const TensorStore* oracle_;
  const json& scenario_;
  const bool twin_;
  std::vector<float> features_;
  std::vector<int64_t> feature_shape_;
  std::vector<EagleHeadOutputs> outputs_;
  double worst_ = 0;
};

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
  Replay replay(head_.get(), oracle_.get(), scenario_, /*twin=*/false);
  replay.Run();
  std::printf("%s: worst relative error %.3g\n", GetParam().c_str(), replay.worst());
}

// Two sequences in every call give each the bits it gets alone (and the reference's values).
TEST_P(EagleOracleTest, BatchedSequencesMatchTheReference) {
  Replay replay(head_.get(), oracle_.get(), scenario_, /*twin=*/true);
  replay.Run();
}

INSTANTIATE_TEST_SUITE_P(Scenarios, EagleOracleTest,
                         ::testing::Values("eagle3", "eagle3_nbr", "eagle1", "long"));

TEST(EagleHeadTest, ServesTheTargetsContextNotTheHeadsTable) {
  std::unique_ptr<EagleHead> head = LoadHead("eagle3_head");
  ASSERT_NE(head, nullptr);
  EXPECT_EQ(head->config().head.max_position_embeddings, 2048);  // as its config.json states
  EXPECT_EQ(head->context_length(), 4096);                        // the target's
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
  EXPECT_EQ(c.draft_vocab_size, 2048);
  EXPECT_EQ((*head)->context_length(), 1024);
  const absl::Span<const int32_t> d2t = (*head)->draft_to_target();
  ASSERT_EQ(d2t.size(), 2048u);
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
  EXPECT_EQ(out.logits.size(), 2048u);
  EXPECT_EQ(out.hidden.size(), 320u);
}

TEST(EagleHeadTest, OptionsAreChecked) {
  const std::string head = (FixtureDir() / "eagle3_head").string();
  const std::string target = (FixtureDir() / "target").string();
  EagleHeadOptions options;
  options.device = "cuda:0";
  EXPECT_EQ(CreateEagleHead(head, target, options).status().code(),
            absl::StatusCode::kUnimplemented);
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
