// The public API's sampling fields, logprobs and n through a real CPU cluster (specd-verify,
// specd-draft and specd-router as processes on loopback, spoken to over gRPC):
//   - logprobs are the same with speculation off, the draft model, n-gram and auto (greedy, and
//     seeded sampling in processed mode), and equal log_softmax of the transformers fixture's
//     logits within 1e-4;
//   - the logits processors (penalties, logit_bias, min_p, min_tokens) give the same tokens with
//     speculation on and off, greedy and seeded, and do change the output;
//   - n > 1 streams n samples tagged by index, sample i being the request with seed + i;
//   - bad values are INVALID_ARGUMENT naming the field, and the router keeps serving.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "specd/v1/generation.grpc.pb.h"
#include "tests/testutil/cpu_cluster.h"
#include "tests/testutil/hf_fixtures.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

namespace fs = std::filesystem;

// One sample's stream.
struct Sample {
  std::vector<int32_t> tokens;
  std::vector<v1::TokenLogprob> logprobs;
  v1::GenerateResponse last;  // the chunk with the finish reason
  int finished_chunks = 0;
};

struct Result {
  grpc::Status status;
  std::map<uint32_t, Sample> samples;  // by GenerateResponse.index
};

Result Generate(const std::string& address, const v1::GenerateRequest& request) {
  auto stub =
      v1::Generation::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  Result r;
  auto reader = stub->Generate(&ctx, request);
  v1::GenerateResponse chunk;
  while (reader->Read(&chunk)) {
    Sample& s = r.samples[chunk.index()];
    s.tokens.insert(s.tokens.end(), chunk.token_ids().begin(), chunk.token_ids().end());
    s.logprobs.insert(s.logprobs.end(), chunk.logprobs().begin(), chunk.logprobs().end());
    if (chunk.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      ++s.finished_chunks;
      s.last = chunk;
    }
  }
  r.status = reader->Finish();
  return r;
}

v1::GenerateRequest Request(const std::string& prompt, int max_new_tokens,
                            v1::Speculation speculation) {
  v1::GenerateRequest r;
  r.set_prompt(prompt);
  r.set_max_new_tokens(max_new_tokens);
  r.set_speculation(speculation);
  r.set_ignore_eos(true);
  return r;
}

constexpr v1::Speculation kModes[] = {v1::SPECULATION_OFF, v1::SPECULATION_DRAFT_MODEL,
                                      v1::SPECULATION_NGRAM, v1::SPECULATION_AUTO};

// Same tokens, and logprobs equal within `tol` (top alternatives: same ids in the same order).
void ExpectSameSample(const Sample& want, const Sample& got, double tol, const std::string& what) {
  ASSERT_EQ(got.tokens, want.tokens) << what;
  ASSERT_EQ(got.logprobs.size(), want.logprobs.size()) << what;
  for (size_t i = 0; i < want.logprobs.size(); ++i) {
    const v1::TokenLogprob& w = want.logprobs[i];
    const v1::TokenLogprob& g = got.logprobs[i];
    EXPECT_EQ(g.token_id(), w.token_id()) << what << " token " << i;
    EXPECT_NEAR(g.logprob(), w.logprob(), tol) << what << " token " << i;
    EXPECT_EQ(g.rank(), w.rank()) << what << " token " << i;
    ASSERT_EQ(g.top_logprobs_size(), w.top_logprobs_size()) << what << " token " << i;
    for (int k = 0; k < w.top_logprobs_size(); ++k) {
      EXPECT_EQ(g.top_logprobs(k).token_id(), w.top_logprobs(k).token_id())
          << what << " token " << i << " top " << k;
      EXPECT_NEAR(g.top_logprobs(k).logprob(), w.top_logprobs(k).logprob(), tol)
          << what << " token " << i << " top " << k;
    }
  }
}

class GenerationApiTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<CpuCluster>> c = CpuCluster::Start();
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = c->release();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  const std::string& address() { return cluster_->router_address; }

  static CpuCluster* cluster_;
};

CpuCluster* GenerationApiTest::cluster_ = nullptr;

TEST_F(GenerationApiTest, GreedyLogprobsAreIdenticalUnderEverySpeculationMode) {
  ASSERT_NE(cluster_, nullptr);
  for (const char* prompt : {"def fibonacci(n):", "class Stack:\n    def"}) {
    Sample reference;
    for (v1::Speculation mode : kModes) {
      v1::GenerateRequest req = Request(prompt, 40, mode);
      req.set_logprobs(5);
      if (mode == v1::SPECULATION_DRAFT_MODEL) {
        // An explicit shape is drafted every step; the policy would draft only where it
        // measures a gain, possibly nowhere on a loaded host.
        req.set_draft_depth(3);
        req.set_draft_top_k(2);
        req.set_draft_max_nodes(6);
      }
      const Result r = Generate(address(), req);
      ASSERT_TRUE(r.status.ok()) << r.status.error_message();
      ASSERT_EQ(r.samples.size(), 1u);
      const Sample& s = r.samples.at(0);
      ASSERT_EQ(s.tokens.size(), 40u);
      ASSERT_EQ(s.logprobs.size(), s.tokens.size());
      for (size_t i = 0; i < s.tokens.size(); ++i) {
        const v1::TokenLogprob& lp = s.logprobs[i];
        EXPECT_EQ(lp.token_id(), s.tokens[i]);
        ASSERT_EQ(lp.top_logprobs_size(), 5);
        // Greedy over raw logprobs: the emitted token is the most likely one.
        EXPECT_EQ(lp.rank(), 1u) << "token " << i;
        EXPECT_EQ(lp.top_logprobs(0).token_id(), s.tokens[i]);
        EXPECT_FLOAT_EQ(lp.top_logprobs(0).logprob(), lp.logprob());
        EXPECT_LE(lp.logprob(), 0.0f);
        for (int k = 1; k < 5; ++k) {
          EXPECT_LE(lp.top_logprobs(k).logprob(), lp.top_logprobs(k - 1).logprob());
        }
      }
      if (mode == v1::SPECULATION_OFF) {
        reference = s;
      } else {
        ExpectSameSample(reference, s, 1e-4, absl::StrCat(prompt, " mode ", mode));
        if (mode == v1::SPECULATION_DRAFT_MODEL) {
          EXPECT_GT(s.last.speculation().accepted_tokens(), 0u) << "nothing was speculated";
        }
      }
    }
  }
}

TEST_F(GenerationApiTest, SeededProcessedLogprobsAreIdenticalWithAndWithoutSpeculation) {
  ASSERT_NE(cluster_, nullptr);
  Sample reference;
  for (v1::Speculation mode : kModes) {
    v1::GenerateRequest req = Request("import numpy as np\n", 32, mode);
    req.set_temperature(0.8f);
    req.set_top_k(40);
    req.set_seed(1234);
    req.set_logprobs(3);
    req.set_logprobs_source(v1::LOGPROBS_SOURCE_PROCESSED);
    const Result r = Generate(address(), req);
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    const Sample& s = r.samples.at(0);
    ASSERT_EQ(s.logprobs.size(), s.tokens.size());
    if (mode == v1::SPECULATION_OFF) {
      reference = s;
    } else {
      ExpectSameSample(reference, s, 1e-4, absl::StrCat("mode ", mode));
    }
  }
  // Processed logprobs describe the sampled distribution: a top-40 filter leaves at most 40
  // tokens, and each token drawn is one of them.
  for (const v1::TokenLogprob& lp : reference.logprobs) {
    EXPECT_LE(lp.rank(), 40u);
    EXPECT_TRUE(std::isfinite(lp.logprob()));
  }
}

TEST_F(GenerationApiTest, LogitsProcessorsAreLosslessUnderSpeculation) {
  ASSERT_NE(cluster_, nullptr);
  auto with_processors = [](v1::GenerateRequest req) {
    req.set_repetition_penalty(1.3f);
    req.set_presence_penalty(0.5f);
    req.set_frequency_penalty(0.4f);
    (*req.mutable_logit_bias())[int32_t{'e'}] = 3.0f;
    req.set_min_tokens(8);
    return req;
  };
  for (const bool sampled : {false, true}) {
    Sample plain, reference;
    {
      v1::GenerateRequest req = Request("for i in range(", 48, v1::SPECULATION_OFF);
      if (sampled) {
        req.set_temperature(0.7f);
        req.set_seed(99);
      }
      const Result r = Generate(address(), req);
      ASSERT_TRUE(r.status.ok()) << r.status.error_message();
      plain = r.samples.at(0);
    }
    for (v1::Speculation mode : kModes) {
      v1::GenerateRequest req = with_processors(Request("for i in range(", 48, mode));
      if (sampled) {
        req.set_temperature(0.7f);
        req.set_seed(99);
        req.set_min_p(0.05f);
      }
      const Result r = Generate(address(), req);
      ASSERT_TRUE(r.status.ok()) << r.status.error_message();
      const Sample& s = r.samples.at(0);
      if (mode == v1::SPECULATION_OFF) {
        reference = s;
        // The processors were applied: the output is not the plain one.
        EXPECT_NE(s.tokens, plain.tokens) << "sampled=" << sampled;
      } else {
        EXPECT_EQ(s.tokens, reference.tokens) << "mode " << mode << " sampled=" << sampled;
      }
    }
  }
}

TEST_F(GenerationApiTest, MinTokensHoldsBackEos) {
  ASSERT_NE(cluster_, nullptr);
  for (v1::Speculation mode : {v1::SPECULATION_OFF, v1::SPECULATION_DRAFT_MODEL}) {
    v1::GenerateRequest req = Request("x = ", 64, mode);
    req.set_ignore_eos(false);
    // EOS is the most likely token everywhere, so only min_tokens keeps it back.
    (*req.mutable_logit_bias())[kCpuClusterEosId] = 100.0f;
    req.set_min_tokens(10);
    const Result r = Generate(address(), req);
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    const Sample& s = r.samples.at(0);
    EXPECT_EQ(s.last.finish_reason(), v1::FINISH_REASON_EOS) << "mode " << mode;
    EXPECT_EQ(s.last.usage().completion_tokens(), 11u) << "mode " << mode;
    EXPECT_EQ(s.tokens.size(), 10u) << "mode " << mode;
  }
  // The other tests of this suite ignore EOS, so these two are the only ones it ended.
  // Every specd_ sample carries the served model's name (the model folder is ".../target").
  EXPECT_TRUE(CpuCluster::WaitForMetric(cluster_->router_metrics, "specd_requests_finished_total",
                                        {{"finish_reason", "eos"}, {"model", "target"}}, 2)
                  .ok());
  EXPECT_FALSE(
      std::isnan(CpuCluster::Metric(cluster_->verify_metrics, "specd_sequences_freed_total",
                                    {{"reason", "finished"}, {"model", "target"}})));
  EXPECT_FALSE(std::isnan(
      CpuCluster::Metric(cluster_->draft_metrics, "specd_sequences", {{"model", "draft"}})));
}

TEST_F(GenerationApiTest, NSamplesStreamByIndexWithSeedPlusIndex) {
  ASSERT_NE(cluster_, nullptr);
  v1::GenerateRequest req = Request("def main():", 24, v1::SPECULATION_AUTO);
  req.set_temperature(1.0f);
  req.set_seed(7);
  req.set_n(3);
  req.set_logprobs(0);
  const Result r = Generate(address(), req);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_EQ(r.samples.size(), 3u);
  for (uint32_t i = 0; i < 3; ++i) {
    const Sample& s = r.samples.at(i);
    EXPECT_EQ(s.finished_chunks, 1) << "sample " << i;
    EXPECT_EQ(s.tokens.size(), 24u);
    EXPECT_EQ(s.logprobs.size(), s.tokens.size());
    v1::GenerateRequest single = req;
    single.set_n(1);
    single.set_seed(7 + i);
    single.set_speculation(v1::SPECULATION_OFF);
    const Result one = Generate(address(), single);
    ASSERT_TRUE(one.status.ok()) << one.status.error_message();
    EXPECT_EQ(one.samples.at(0).tokens, s.tokens) << "sample " << i;
  }
  EXPECT_NE(r.samples.at(0).tokens, r.samples.at(1).tokens);
}

TEST_F(GenerationApiTest, BadFieldsAreInvalidArgumentNamingTheField) {
  ASSERT_NE(cluster_, nullptr);
  struct Case {
    const char* field;
    std::function<void(v1::GenerateRequest*)> set;
  };
  const std::vector<Case> cases = {
      {"min_p", [](v1::GenerateRequest* r) { r->set_min_p(1.5f); }},
      {"logit_bias[9999]", [](v1::GenerateRequest* r) { (*r->mutable_logit_bias())[9999] = 1; }},
      {"logit_bias[3]", [](v1::GenerateRequest* r) { (*r->mutable_logit_bias())[3] = 101; }},
      {"repetition_penalty", [](v1::GenerateRequest* r) { r->set_repetition_penalty(0); }},
      {"repetition_penalty", [](v1::GenerateRequest* r) { r->set_repetition_penalty(NAN); }},
      {"presence_penalty", [](v1::GenerateRequest* r) { r->set_presence_penalty(2.5f); }},
      {"frequency_penalty", [](v1::GenerateRequest* r) { r->set_frequency_penalty(-3); }},
      {"min_tokens", [](v1::GenerateRequest* r) { r->set_min_tokens(17); }},
      {"logprobs", [](v1::GenerateRequest* r) { r->set_logprobs(21); }},
      {"logprobs_source",
       [](v1::GenerateRequest* r) { r->set_logprobs_source(static_cast<v1::LogprobsSource>(7)); }},
      {"n", [](v1::GenerateRequest* r) { r->set_n(17); }},
  };
  for (const Case& c : cases) {
    v1::GenerateRequest req = Request("hello", 16, v1::SPECULATION_AUTO);
    c.set(&req);
    const Result r = Generate(address(), req);
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.field;
    EXPECT_EQ(r.status.error_message().rfind(absl::StrCat(c.field, ":"), 0), 0u)
        << c.field << ": " << r.status.error_message();
  }
  const Result after = Generate(address(), Request("hello", 4, v1::SPECULATION_AUTO));
  EXPECT_TRUE(after.status.ok()) << after.status.error_message();
}

// The transformers fixture model (tests/fixtures/models/llama31) served by the cluster, with the
// random model's tokenizer beside it (same vocabulary; prompts are ids): each first generated
// token's logprobs equal log_softmax of the fixture's logits after the prompt.
TEST(GenerationApiFixtureTest, LogprobsMatchTheTransformersFixture) {
  const fs::path root = testutil::RepoRoot();
  ASSERT_FALSE(root.empty());
  const fs::path fixture = root / "tests" / "fixtures" / "models" / "llama31";
  absl::StatusOr<std::string> random_target = CpuCluster::TestTargetDir();
  ASSERT_TRUE(random_target.ok()) << random_target.status();
  const std::string dir = MakeTempDir("generation_api_fixture");
  for (const char* f : {"config.json", "generation_config.json", "model.safetensors"}) {
    fs::copy_file(fixture / f, fs::path(dir) / f);
  }
  fs::copy_file(fs::path(*random_target) / "tokenizer.json", fs::path(dir) / "tokenizer.json");
  CpuClusterOptions options;
  options.target_dir = dir;
  options.draft = false;
  absl::StatusOr<std::unique_ptr<CpuCluster>> cluster = CpuCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const nlohmann::json oracle = testutil::ReadJson(fixture / "oracle.json");
  for (const nlohmann::json& prompt : oracle["prompts"]) {
    const std::vector<int32_t> ids = prompt["ids"].get<std::vector<int32_t>>();
    const std::vector<double> logits = prompt["logits"].back().get<std::vector<double>>();
    ASSERT_EQ(prompt["logit_positions"].back().get<size_t>(), ids.size() - 1);
    double max = -INFINITY;
    for (double l : logits) max = std::max(max, l);
    double sum = 0;
    for (double l : logits) sum += std::exp(l - max);
    const double lse = max + std::log(sum);
    std::vector<int32_t> order(logits.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });

    for (v1::Speculation mode : {v1::SPECULATION_OFF, v1::SPECULATION_NGRAM}) {
      v1::GenerateRequest req;
      req.mutable_prompt_ids()->mutable_ids()->Assign(ids.begin(), ids.end());
      req.set_max_new_tokens(16);
      req.set_ignore_eos(true);
      req.set_speculation(mode);
      req.set_logprobs(20);
      const Result r = Generate((*cluster)->router_address, req);
      ASSERT_TRUE(r.status.ok()) << r.status.error_message();
      const Sample& s = r.samples.at(0);
      EXPECT_EQ(s.tokens, prompt["greedy"].get<std::vector<int32_t>>()) << "mode " << mode;
      ASSERT_EQ(s.logprobs.size(), 16u);
      const v1::TokenLogprob& first = s.logprobs[0];
      EXPECT_NEAR(first.logprob(), logits[s.tokens[0]] - lse, 1e-4);
      ASSERT_EQ(first.top_logprobs_size(), 20);
      for (int k = 0; k < 20; ++k) {
        EXPECT_EQ(first.top_logprobs(k).token_id(), order[k]) << "top " << k;
        EXPECT_NEAR(first.top_logprobs(k).logprob(), logits[order[k]] - lse, 1e-4) << "top " << k;
      }
    }
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
}  // namespace specd
