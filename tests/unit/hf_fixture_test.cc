// specd's CPU backend against Hugging Face transformers, the outside oracle.
// The fixtures under tests/fixtures were written by
// tools/oracle/make_fixtures.py with transformers 5.17 in fp32 on the CPU
// (tests/fixtures/README.md): tiny random checkpoints of every supported family
// with their logits and greedy continuations, and greedy continuations of the
// committed reference models. Each greedy step of those fixtures has a
// top-1/top-2 logit gap of at least 1e-3, so an exact token match is a fair
// demand of an fp32 engine that sums in another order.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "engine/backend.h"
#include "nlohmann/json.hpp"
#include "tests/testutil/hf_fixtures.h"
#include "gtest/gtest.h"

namespace specd {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr double kMaxRelError = 1e-4;

using testutil::Argmax;
using testutil::Chain;
using testutil::Greedy;
using testutil::ReadJson;
using testutil::RelError;
using testutil::RepoRoot;

std::unique_ptr<Backend> Load(const fs::path &dir) {
  BackendOptions options;
  options.device = "cpu";
  absl::StatusOr<std::unique_ptr<Backend>> b =
      CreateBackend(dir.string(), options);
  EXPECT_TRUE(b.ok()) << dir << ": " << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

std::vector<int32_t> Ids(const json &j) {
  return j.get<std::vector<int32_t>>();
}

class FamilyFixtureTest : public ::testing::TestWithParam<std::string> {
protected:
  void SetUp() override {
    root_ = RepoRoot();
    ASSERT_FALSE(root_.empty())
        << "tests/fixtures not found above " << fs::current_path();
    dir_ = root_ / "tests" / "fixtures" / "models" / GetParam();
    oracle_ = ReadJson(dir_ / "oracle.json");
    backend_ = Load(dir_);
    ASSERT_NE(backend_, nullptr);
  }

  fs::path root_, dir_;
  json oracle_;
  std::unique_ptr<Backend> backend_;
};

TEST_P(FamilyFixtureTest, ConfigIsTheFamily) {
  const ModelConfig &c = backend_->config();
  EXPECT_EQ(c.model_type, oracle_["model_type"].get<std::string>());
  EXPECT_EQ(c.ParameterCount(), oracle_["parameters"].get<int64_t>());
  EXPECT_EQ(c.num_kv_heads, 1);
  EXPECT_EQ(c.num_heads % 2, 1) << "the fixtures use odd query-head counts";
}

// All prompts in one batched Forward(), each as its own sequence.
TEST_P(FamilyFixtureTest, LogitsMatchTransformers) {
  const int vocab = backend_->config().vocab_size;
  std::vector<ForwardItem> items;
  SeqId seq = 1;
  for (const json &p : oracle_["prompts"]) {
    ASSERT_TRUE(backend_->AddSequence(seq).ok());
    items.push_back(Chain(seq++, Ids(p["ids"]), Ids(p["logit_positions"])));
  }
  std::vector<float> logits;
  absl::Status s = backend_->Forward(items, &logits);
  ASSERT_TRUE(s.ok()) << s;
  size_t row = 0, rows = 0;
  for (const json &p : oracle_["prompts"])
    rows += p["logit_positions"].size();
  ASSERT_EQ(logits.size(), rows * vocab);
  for (size_t i = 0; i < oracle_["prompts"].size(); ++i) {
    const json &p = oracle_["prompts"][i];
    for (size_t r = 0; r < p["logits"].size(); ++r, ++row) {
      const std::vector<double> want =
          p["logits"][r].get<std::vector<double>>();
      ASSERT_EQ(want.size(), static_cast<size_t>(vocab));
      EXPECT_LE(
          RelError(absl::MakeConstSpan(logits).subspan(row * vocab, vocab),
                   want),
          kMaxRelError)
          << GetParam() << " prompt " << i << " position "
          << p["logit_positions"][r];
    }
  }
}

TEST_P(FamilyFixtureTest, GreedyMatchesTransformers) {
  SeqId seq = 100;
  for (const json &p : oracle_["prompts"]) {
    const std::vector<int32_t> want = Ids(p["greedy"]);
    EXPECT_EQ(
        Greedy(*backend_, seq++, Ids(p["ids"]), static_cast<int>(want.size())),
        want)
        << GetParam() << " prompt of " << p["ids"].size() << " tokens";
  }
}

// Logprobs through Backend::Verify (the path the verify service runs): every prefix of every
// prompt as a sequence of its own, the top 20 and the emitted token's log-probability, against
// log_softmax of transformers' logits after that prefix, within 1e-4.
TEST_P(FamilyFixtureTest, LogprobsMatchLogSoftmaxOfTransformers) {
  const int vocab = backend_->config().vocab_size;
  SeqId seq = 1000;
  int rows = 0;
  for (const json &p : oracle_["prompts"]) {
    const std::vector<int32_t> ids = Ids(p["ids"]);
    const std::vector<int32_t> positions = Ids(p["logit_positions"]);
    std::vector<VerifyItem> items;
    for (int32_t pos : positions) {
      VerifyItem item;
      item.seq = seq++;
      item.pending.assign(ids.begin(), ids.begin() + pos + 1);
      item.logprobs = kMaxLogprobs;
      // Even numbered rows in processed mode: greedy without processors, the same numbers.
      item.logprobs_mode =
          items.size() % 2 == 0 ? LogprobsMode::kRaw : LogprobsMode::kProcessed;
      ASSERT_TRUE(backend_->AddSequence(item.seq).ok());
      items.push_back(std::move(item));
    }
    absl::StatusOr<std::vector<VerifyOutcome>> out = backend_->Verify(items);
    ASSERT_TRUE(out.ok()) << out.status();
    for (size_t r = 0; r < items.size(); ++r, ++rows) {
      SCOPED_TRACE(absl::StrCat(GetParam(), " prompt of ", ids.size(), " position ",
                                positions[r]));
      ASSERT_TRUE(backend_->RemoveSequence(items[r].seq).ok());
      const std::vector<double> logits = p["logits"][r].get<std::vector<double>>();
      double max_l = logits[0], total = 0;
      for (double l : logits) max_l = std::max(max_l, l);
      for (double l : logits) total += std::exp(l - max_l);
      auto log_softmax = [&](int32_t t) { return logits[t] - max_l - std::log(total); };
      const VerifyOutcome &o = (*out)[r];
      ASSERT_EQ(o.tokens.size(), 1u);
      ASSERT_EQ(o.logprobs.size(), 1u);
      const TokenLogprobs &lp = o.logprobs[0];
      EXPECT_NEAR(lp.logprob, log_softmax(o.tokens[0]), 1e-4);
      EXPECT_EQ(lp.rank, 1);
      ASSERT_EQ(lp.top.size(), static_cast<size_t>(kMaxLogprobs));
      std::vector<int32_t> order(vocab);
      for (int32_t t = 0; t < vocab; ++t) order[t] = t;
      std::partial_sort(order.begin(), order.begin() + kMaxLogprobs, order.end(),
                        [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
      for (int k = 0; k < kMaxLogprobs; ++k) {
        EXPECT_NEAR(lp.top[k].logprob, log_softmax(order[k]), 1e-4) << "top " << k;
        // Same token unless two of transformers' logits are too close to order.
        if (lp.top[k].token != order[k]) {
          EXPECT_NEAR(logits[lp.top[k].token], logits[order[k]], 1e-4) << "top " << k;
        }
      }
    }
  }
  EXPECT_GE(rows, 10);
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyFixtureTest,
                         ::testing::Values("llama31", "mistral", "qwen2",
                                           "qwen3"));

class ReferenceModelTest : public ::testing::TestWithParam<std::string> {};

// The committed reference models (bf16 weights, run in fp32) reproduce
// transformers' greedy continuations of code prompts token for token, and its
// logits after the first prompts.
TEST_P(ReferenceModelTest, GreedyMatchesTransformers) {
  const fs::path root = RepoRoot();
  ASSERT_FALSE(root.empty());
  const json fixture =
      ReadJson(root / "tests" / "fixtures" / "reference_greedy.json");
  const json &cases = fixture["models"][GetParam()]["cases"];
  ASSERT_GE(cases.size(), 6u);
  std::unique_ptr<Backend> b = Load(root / "models" / GetParam());
  ASSERT_NE(b, nullptr);
  const int vocab = b->config().vocab_size;
  SeqId seq = 1;
  for (const json &c : cases) {
    const std::vector<int32_t> prompt = Ids(c["prompt_ids"]);
    if (c.contains("last_logits")) {
      ASSERT_TRUE(b->AddSequence(seq).ok());
      std::vector<float> logits;
      ASSERT_TRUE(b->Forward({Chain(seq, prompt,
                                    {static_cast<int32_t>(prompt.size()) - 1})},
                             &logits)
                      .ok());
      ASSERT_TRUE(b->RemoveSequence(seq++).ok());
      EXPECT_LE(RelError(absl::MakeConstSpan(logits).first(vocab),
                         c["last_logits"].get<std::vector<double>>()),
                kMaxRelError)
          << GetParam() << ": " << c["text"];
    }
    const std::vector<int32_t> want = Ids(c["continuation_ids"]);
    EXPECT_EQ(Greedy(*b, seq++, prompt, static_cast<int>(want.size())), want)
        << GetParam() << ": " << c["text"];
  }
}

INSTANTIATE_TEST_SUITE_P(Reference, ReferenceModelTest,
                         ::testing::Values("pycoder-target", "pycoder-draft"),
                         [](const ::testing::TestParamInfo<std::string> &info) {
                           return info.param == "pycoder-target" ? "Target"
                                                                 : "Draft";
                         });

} // namespace
} // namespace specd
