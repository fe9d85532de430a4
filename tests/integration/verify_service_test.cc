// specd-verify as a real process on loopback: health and reflection, batched Step streams whose
// results (tokens and logprobs, with penalties, logit bias and min_tokens over several steps)
// equal Backend::Verify run in this process on the same checkpoint, per-sequence errors naming
// the field, capacity limits, deadlines, releases and stream ends freeing sequences (seen in
// /metrics), the metrics contract, startup errors and SIGTERM.
#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/service/grpc_util.h"
#include "engine/backend.h"
#include "gmock/gmock.h"
#include "grpcpp/impl/codegen/sync_stream.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "services/verify/sampling_proto.h"
#include "specd/v1/verify.grpc.pb.h"
#include "tests/testutil/model_service_fixture.h"
#include "tests/testutil/random_checkpoint.h"
#include "tests/testutil/service_process.h"

namespace specd {
namespace {

using ::testing::Contains;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::Not;
using HealthResponse = grpc::health::v1::HealthCheckResponse;

constexpr int kVocab = 320;

using VerifyStream = StepStreamClient<v1::Verifier, v1::VerifyStepRequest, v1::VerifyStepResponse>;

// `stop_token_ids` go with min_tokens (the service adds its model's EOS ids itself).
v1::VerifySequenceStep* AddStep(v1::VerifyStepRequest* request, uint64_t seq,
                                const std::vector<int32_t>& pending, const TokenTree& tree = {},
                                const SamplingParams& sampling = {},
                                const std::vector<int32_t>& stop_token_ids = {}) {
  v1::VerifySequenceStep* step = request->add_steps();
  step->set_seq_id(seq);
  step->mutable_pending()->Add(pending.begin(), pending.end());
  step->mutable_tree()->mutable_tokens()->Add(tree.tokens.begin(), tree.tokens.end());
  step->mutable_tree()->mutable_parents()->Add(tree.parents.begin(), tree.parents.end());
  SamplingToProto(sampling, stop_token_ids, step->mutable_sampling());
  return step;
}

std::vector<int32_t> Tokens(const v1::VerifySequenceResult& r) {
  return {r.tokens().begin(), r.tokens().end()};
}

// Step 1 of a stream: sequence 1 starts with pending tokens {1, 2, 3}; its result. The shutdown
// tests' running sequence.
v1::VerifySequenceResult StartSequenceOne(VerifyStream& stream) {
  v1::VerifyStepRequest request;
  request.set_step_id(1);
  AddStep(&request, 1, {1, 2, 3});
  const v1::VerifyStepResponse response = stream.Step(request);
  EXPECT_EQ(response.results_size(), 1);
  return response.results_size() > 0 ? response.results(0) : v1::VerifySequenceResult();
}

class VerifyServiceTest : public ModelServiceTest {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(MakeTempDir("specd-verify-it"));
    RandomCheckpointSpec spec;
    spec.vocab_size = kVocab;
    spec.init_std = 0.3f;  // peaky enough that greedy continuations are not all one token
    spec.seed = 7;
    spec.max_position_embeddings = 256;
    ASSERT_TRUE(WriteRandomCheckpoint(*dir_, spec).ok());
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(*dir_, ec);
    delete dir_;
  }

  // Starts specd-verify on free loopback ports with `extra` flags after the defaults.
  std::unique_ptr<ServiceProcess> StartVerify(std::vector<std::string> extra = {},
                                              bool wait_serving = true) {
    extra.insert(extra.begin(), "--model=" + *dir_);
    return StartService(SpecdBinary("specd-verify"), extra, wait_serving);
  }

  std::unique_ptr<Backend> InProcessBackend() {
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(*dir_, BackendOptions());
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? std::move(*b) : nullptr;
  }

  static std::string* dir_;
};

std::string* VerifyServiceTest::dir_ = nullptr;

TEST_F(VerifyServiceTest, HealthIsNotServingUntilTheModelIsLoaded) {
  std::unique_ptr<ServiceProcess> p = StartVerify({"--startup_delay_ms=3000"}, false);
  ASSERT_NE(p, nullptr);
  // The gRPC server is up before the model loads; wait for its first answer.
  absl::StatusOr<HealthStatus> health;
  for (int i = 0; i < 20 && !(health = p->Health()).ok(); ++i) {
  }
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, HealthResponse::NOT_SERVING);
  EXPECT_EQ(*p->Health("specd.v1.Verifier"), HealthResponse::NOT_SERVING);
  int http = 0;
  HttpGet("127.0.0.1", metrics_port_, "/health", &http).IgnoreError();
  EXPECT_EQ(http, 503);
  {
    auto stub = v1::Verifier::NewStub(p->channel());
    grpc::ClientContext context;
    v1::VerifyInfo info;
    EXPECT_EQ(stub->GetInfo(&context, v1::VerifyInfoRequest(), &info).error_code(),
              grpc::StatusCode::UNAVAILABLE);
  }

  ASSERT_TRUE(p->WaitUntilServing().ok());
  EXPECT_EQ(*p->Health("specd.v1.Verifier"), HealthResponse::SERVING);
  HttpGet("127.0.0.1", metrics_port_, "/health", &http).IgnoreError();
  EXPECT_EQ(http, 200);
}

TEST_F(VerifyServiceTest, ReflectionIsOffUnlessAskedFor) {
  std::unique_ptr<ServiceProcess> off = StartVerify();
  ASSERT_NE(off, nullptr);
  EXPECT_EQ(ListServicesByReflection(off->channel()).status().code(),
            absl::StatusCode::kUnimplemented);
  off.reset();
  std::unique_ptr<ServiceProcess> p = StartVerify({"--reflection"});
  ASSERT_NE(p, nullptr);
  absl::StatusOr<std::vector<std::string>> services = ListServicesByReflection(p->channel());
  ASSERT_TRUE(services.ok()) << services.status();
  EXPECT_THAT(*services, Contains("specd.v1.Verifier"));
  EXPECT_THAT(*services, Contains("grpc.health.v1.Health"));
}

TEST_F(VerifyServiceTest, GetInfoDescribesTheModel) {
  std::unique_ptr<ServiceProcess> p = StartVerify();
  ASSERT_NE(p, nullptr);
  auto stub = v1::Verifier::NewStub(p->channel());
  grpc::ClientContext context;
  v1::VerifyInfo info;
  ASSERT_TRUE(stub->GetInfo(&context, v1::VerifyInfoRequest(), &info).ok());
  EXPECT_EQ(info.model(), std::filesystem::path(*dir_).filename().string());
  EXPECT_EQ(info.vocab_size(), static_cast<uint32_t>(kVocab));
  EXPECT_EQ(info.max_context(), 256u);
  EXPECT_THAT(info.eos_token_ids(), ElementsAreArray({256}));
  EXPECT_EQ(info.tensor_parallel(), 1u);
  EXPECT_TRUE(info.supports_logprobs());
  EXPECT_TRUE(info.supports_logits_processors());
}

// Several sequences per step, over several steps, with trees that partly match the target's
// own continuation: every result equals Backend::Verify in this process on the same items.
// The same steps against a verify service whose target is split over GetParam() CPU ranks
// (uneven head split at 3): results equal the single-device in-process backend.
class VerifyServiceTpTest : public VerifyServiceTest, public ::testing::WithParamInterface<int> {};

TEST_P(VerifyServiceTpTest, BatchedStepsMatchInProcessVerify) {
  std::unique_ptr<ServiceProcess> p = StartVerify({absl::StrCat("--tensor_parallel=", GetParam())});
  ASSERT_NE(p, nullptr);
  {
    auto stub = v1::Verifier::NewStub(p->channel());
    grpc::ClientContext context;
    v1::VerifyInfo info;
    ASSERT_TRUE(stub->GetInfo(&context, v1::VerifyInfoRequest(), &info).ok());
    EXPECT_EQ(info.tensor_parallel(), static_cast<uint32_t>(GetParam()));
  }
  std::unique_ptr<Backend> reference = InProcessBackend();
  std::unique_ptr<Backend> oracle = InProcessBackend();  // greedy continuations for the trees
  ASSERT_NE(reference, nullptr);
  ASSERT_NE(oracle, nullptr);

  struct Seq {
    uint64_t id;
    std::vector<int32_t> pending;
    SamplingParams sampling;
    std::vector<int32_t> history;
    int logprobs = -1;
    LogprobsMode mode = LogprobsMode::kRaw;
    std::vector<int32_t> stop_token_ids;
    TokenHistory processed;  // the reference's history for the processors
  };
  SamplingParams sampled;
  sampled.temperature = 0.8f;
  sampled.top_k = 20;
  sampled.top_p = 0.9f;
  sampled.seed = 1234;
  // Greedy with every processor; its first greedy token (found below) is held back by
  // min_tokens, so the service must count the output right for the results to agree.
  SamplingParams processors;
  processors.repetition_penalty = 1.3f;
  processors.frequency_penalty = 0.4f;
  processors.presence_penalty = -0.3f;
  processors.logit_bias = {{40, 1.5f}, {41, -2.0f}};
  processors.min_tokens = 6;
  std::vector<Seq> seqs(4);
  seqs[0] = {11, {72, 101, 108, 108, 111}, {}, {}};
  seqs[1] = {12, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, {}, {}, 0};
  seqs[2] = {13, {200, 13, 200, 13}, sampled, {}, 5};
  seqs[3] = {14, {40, 41, 42, 40, 41, 42, 7}, processors, {}, 3, LogprobsMode::kProcessed};
  for (Seq& s : seqs) s.history = s.pending;

  // Greedy next tokens after `history`, decoded one by one on the oracle backend.
  SeqId oracle_id = 1;
  auto greedy = [&](const std::vector<int32_t>& history, int n) {
    const SeqId id = oracle_id++;
    EXPECT_TRUE(oracle->AddSequence(id).ok());
    std::vector<int32_t> out;
    VerifyItem item{id, history, {}, {}};
    for (int i = 0; i < n; ++i) {
      absl::StatusOr<std::vector<VerifyOutcome>> o = oracle->Verify({item});
      EXPECT_TRUE(o.ok()) << o.status();
      out.push_back((*o)[0].tokens[0]);
      item.pending = {out.back()};
    }
    EXPECT_TRUE(oracle->RemoveSequence(id).ok());
    return out;
  };

  seqs[3].stop_token_ids = {greedy(seqs[3].history, 1)[0]};
  seqs[3].sampling.min_tokens_stop_ids = {256, seqs[3].stop_token_ids[0]};  // as the service does

  VerifyStream stream(p->channel());
  int accepted_total = 0;
  for (int step = 0; step < 4; ++step) {
    v1::VerifyStepRequest request;
    request.set_step_id(100 + step);
    std::vector<VerifyItem> items;
    for (size_t i = 0; i < seqs.size(); ++i) {
      Seq& s = seqs[i];
      TokenTree tree;
      if (step > 0) {
        // A chain of the true greedy continuation (3 deep) plus a wrong sibling at each level;
        // for the sampled sequence the same shape, accepted only where the samples agree.
        const std::vector<int32_t> next = greedy(s.history, 3);
        int parent = -1;
        for (int d = 0; d < 3; ++d) {
          tree.tokens.push_back((next[d] + 1) % kVocab);
          tree.parents.push_back(parent);
          tree.tokens.push_back(next[d]);
          tree.parents.push_back(parent);
          parent = tree.size() - 1;
        }
      }
      v1::VerifySequenceStep* wire =
          AddStep(&request, s.id, s.pending, tree, s.sampling, s.stop_token_ids);
      if (s.logprobs >= 0) wire->set_logprobs(s.logprobs);
      if (s.mode == LogprobsMode::kProcessed) {
        wire->set_logprobs_mode(v1::LOGPROBS_MODE_PROCESSED);
      }
      VerifyItem item{static_cast<SeqId>(1000 + i), s.pending, tree, s.sampling};
      item.logprobs = s.logprobs;
      item.logprobs_mode = s.mode;
      if (s.sampling.needs_history()) {
        if (step == 0) {
          s.processed.AddPrompt(s.pending);
        } else {
          s.processed.AddOutput(s.pending);
        }
        item.history = &s.processed;
      }
      items.push_back(std::move(item));
      if (step == 0) ASSERT_TRUE(reference->AddSequence(1000 + i).ok());
    }
    const v1::VerifyStepResponse response = stream.Step(request);
    absl::StatusOr<std::vector<VerifyOutcome>> want = reference->Verify(items);
    ASSERT_TRUE(want.ok()) << want.status();
    for (size_t i = 0; i < seqs.size(); ++i) {
      SCOPED_TRACE(absl::StrCat("step ", step, " seq ", i));
      const v1::VerifySequenceResult& r = response.results(i);
      const VerifyOutcome& w = (*want)[i];
      ASSERT_EQ(r.seq_id(), seqs[i].id);
      ASSERT_FALSE(r.has_error()) << r.error().message();
      EXPECT_EQ(Tokens(r), w.tokens);
      EXPECT_EQ(r.accepted_draft(), static_cast<uint32_t>(w.accepted_draft));
      EXPECT_THAT(r.accepted_nodes(), ElementsAreArray(w.accepted_nodes));
      if (step > 0 && seqs[i].sampling.greedy() && !seqs[i].sampling.has_processors()) {
        EXPECT_EQ(r.accepted_draft(), 3u) << "the greedy chain must be accepted whole";
      }
      accepted_total += r.accepted_draft();
      // Logprobs only when asked, one per token; the sharded target's sums differ in the last
      // bits from the reference's.
      ASSERT_EQ(r.logprobs_size(), seqs[i].logprobs < 0 ? 0 : r.tokens_size());
      ASSERT_EQ(w.logprobs.size(), static_cast<size_t>(r.logprobs_size()));
      for (int t = 0; t < r.logprobs_size(); ++t) {
        const TokenLogprobs got = LogprobsFromProto(r.logprobs(t));
        EXPECT_NEAR(got.logprob, w.logprobs[t].logprob, 1e-5) << "token " << t;
        EXPECT_EQ(got.rank, w.logprobs[t].rank) << "token " << t;
        ASSERT_EQ(got.top.size(), w.logprobs[t].top.size()) << "token " << t;
        EXPECT_EQ(got.top.size(), static_cast<size_t>(std::max(seqs[i].logprobs, 0)));
        for (size_t k = 0; k < got.top.size(); ++k) {
          EXPECT_EQ(got.top[k].token, w.logprobs[t].top[k].token) << "token " << t;
          EXPECT_NEAR(got.top[k].logprob, w.logprobs[t].top[k].logprob, 1e-5);
        }
      }
      std::vector<int32_t> emitted = Tokens(r);
      seqs[i].history.insert(seqs[i].history.end(), emitted.begin(), emitted.end());
      seqs[i].pending = {emitted.back()};
      if (seqs[i].sampling.needs_history()) {
        seqs[i].processed.AddOutput(absl::MakeConstSpan(emitted).first(w.accepted_draft));
      }
    }
  }
  // min_tokens held the first greedy token back for the first 6 output tokens.
  const std::vector<int32_t> out4(seqs[3].history.begin() + 7, seqs[3].history.end());
  ASSERT_GE(out4.size(), 6u);
  EXPECT_EQ(std::count(out4.begin(), out4.begin() + 6, seqs[3].stop_token_ids[0]), 0);
  EXPECT_GE(accepted_total, 18);
  EXPECT_EQ(Metric("specd_sequences"), 4);
  EXPECT_EQ(Metric("specd_step_batch_size_count"), 4);
  EXPECT_GT(Metric("specd_kv_cache_usage_ratio"), 0);
  // Prefill 5 + 12 + 4 + 7 tokens, then 1 pending + 6 tree nodes per sequence and step.
  EXPECT_EQ(Metric("specd_step_tokens_total"), 28 + 3 * 4 * 7);
  EXPECT_TRUE(stream.Close().ok());
}

INSTANTIATE_TEST_SUITE_P(TensorParallel, VerifyServiceTpTest, ::testing::Values(1, 3));

TEST_F(VerifyServiceTest, PerSequenceErrorsLeaveTheOthersServed) {
  std::unique_ptr<ServiceProcess> p = StartVerify();
  ASSERT_NE(p, nullptr);
  VerifyStream stream(p->channel());
  v1::VerifyStepRequest request;
  request.set_step_id(1);
  AddStep(&request, 1, {10, 20, 30});
  AddStep(&request, 2, {10, kVocab + 5, 30});  // token id outside the vocabulary
  TokenTree bad_tree;
  bad_tree.tokens = {5, 6};
  bad_tree.parents = {-1, 1};  // a node cannot be its own parent
  AddStep(&request, 3, {10}, bad_tree);
  SamplingParams negative;
  negative.temperature = -1;
  AddStep(&request, 4, {10}, {}, negative);
  AddStep(&request, 5, {});    // no pending token
  AddStep(&request, 1, {40});  // seq 1 twice in one step
  AddStep(&request, 6, {-3});  // negative token id
  v1::VerifyStepResponse response = stream.Step(request);

  EXPECT_FALSE(response.results(0).has_error());
  EXPECT_EQ(response.results(0).tokens_size(), 1);
  auto expect_error = [&](int i, grpc::StatusCode code, const std::string& text) {
    const v1::VerifySequenceResult& r = response.results(i);
    EXPECT_TRUE(r.has_error()) << i;
    EXPECT_EQ(r.error().code(), code) << i << ": " << r.error().message();
    EXPECT_THAT(r.error().message(), HasSubstr(text)) << i;
    EXPECT_EQ(r.tokens_size(), 0) << i;
  };
  expect_error(1, grpc::StatusCode::INVALID_ARGUMENT, "steps[1].pending[1]: token id 325");
  expect_error(2, grpc::StatusCode::INVALID_ARGUMENT, "steps[2].tree.parents[1]");
  expect_error(3, grpc::StatusCode::INVALID_ARGUMENT, "temperature");
  expect_error(4, grpc::StatusCode::INVALID_ARGUMENT, "steps[4].pending: empty");
  expect_error(5, grpc::StatusCode::INVALID_ARGUMENT, "appears more than once");
  expect_error(6, grpc::StatusCode::INVALID_ARGUMENT, "token id -3");
  // Rejected sequences were never created.
  EXPECT_EQ(Metric("specd_sequences"), 1);

  // The stream and the service go on: seq 1 continues, seq 2 starts over with valid tokens.
  v1::VerifyStepRequest next;
  next.set_step_id(2);
  AddStep(&next, 1, {response.results(0).tokens(0)});
  AddStep(&next, 2, {10, 20, 30});
  v1::VerifyStepResponse second = stream.Step(next);
  EXPECT_FALSE(second.results(0).has_error()) << second.results(0).error().message();
  EXPECT_FALSE(second.results(1).has_error()) << second.results(1).error().message();
  // Same prompt, same greedy model: seq 2's first token equals seq 1's.
  EXPECT_EQ(second.results(1).tokens(0), response.results(0).tokens(0));
  EXPECT_EQ(Metric("specd_sequences"), 2);
  EXPECT_TRUE(stream.Close().ok());
}

// Every sampling field is checked against its range (an unset optional field is "off", an
// explicit 0 where 0 is invalid is refused); errors name the field and leave the other
// sequences served. Logprobs come back only when asked.
TEST_F(VerifyServiceTest, SamplingFieldsAreValidatedNamingTheField) {
  std::unique_ptr<ServiceProcess> p = StartVerify();
  ASSERT_NE(p, nullptr);
  VerifyStream stream(p->channel());
  v1::VerifyStepRequest request;
  request.set_step_id(1);
  auto add = [&](uint64_t seq, const std::function<void(v1::VerifySequenceStep*)>& edit) {
    v1::VerifySequenceStep* step = AddStep(&request, seq, {10, 20, 30});
    edit(step);
  };
  add(1, [](v1::VerifySequenceStep* s) {  // valid: top_p unset means no limit
    s->mutable_sampling()->set_temperature(1.0f);
    s->mutable_sampling()->set_seed(3);
    s->mutable_sampling()->clear_top_p();
    s->set_logprobs(0);
  });
  add(2, [](v1::VerifySequenceStep* s) { s->mutable_sampling()->set_top_p(0.0f); });
  add(3, [](v1::VerifySequenceStep* s) { s->mutable_sampling()->set_min_p(2.0f); });
  add(4, [](v1::VerifySequenceStep* s) {
    (*s->mutable_sampling()->mutable_logit_bias())[kVocab + 1] = 1.0f;
  });
  add(5,
      [](v1::VerifySequenceStep* s) { (*s->mutable_sampling()->mutable_logit_bias())[5] = 150; });
  add(6, [](v1::VerifySequenceStep* s) { s->mutable_sampling()->set_repetition_penalty(0.0f); });
  add(7, [](v1::VerifySequenceStep* s) { s->mutable_sampling()->set_presence_penalty(2.5f); });
  add(8, [](v1::VerifySequenceStep* s) { s->mutable_sampling()->set_frequency_penalty(-2.5f); });
  add(9, [](v1::VerifySequenceStep* s) {
    s->mutable_sampling()->set_min_tokens(2);
    s->mutable_sampling()->add_stop_token_ids(-1);
  });
  add(10, [](v1::VerifySequenceStep* s) { s->set_logprobs(21); });
  add(11, [](v1::VerifySequenceStep* s) {
    s->set_logprobs(2);
    s->set_logprobs_mode(static_cast<v1::LogprobsMode>(9));
  });
  add(12, [](v1::VerifySequenceStep*) {});  // valid, no processors, no logprobs
  const v1::VerifyStepResponse response = stream.Step(request);
  ASSERT_EQ(response.results_size(), 12);
  auto expect_error = [&](int i, const std::string& text) {
    const v1::VerifySequenceResult& r = response.results(i);
    EXPECT_EQ(r.error().code(), grpc::StatusCode::INVALID_ARGUMENT)
        << i << ": " << r.error().message();
    EXPECT_THAT(r.error().message(), HasSubstr(text)) << i;
    EXPECT_EQ(r.tokens_size(), 0) << i;
  };
  expect_error(1, "steps[1].sampling.top_p: 0 must be in (0, 1]");
  expect_error(2, "steps[2].sampling.min_p: 2 must be in [0, 1]");
  expect_error(3, absl::StrCat("steps[3].sampling.logit_bias[", kVocab + 1, "]: token id"));
  expect_error(4, "steps[4].sampling.logit_bias[5]: bias 150 must be in [-100, 100]");
  expect_error(5, "steps[5].sampling.repetition_penalty: 0 must be a finite number > 0");
  expect_error(6, "steps[6].sampling.presence_penalty: 2.5 must be in [-2, 2]");
  expect_error(7, "steps[7].sampling.frequency_penalty: -2.5 must be in [-2, 2]");
  expect_error(8, "steps[8].sampling.stop_token_ids[0]: token id -1");
  expect_error(9, "steps[9].logprobs: 21 must be at most 20");
  expect_error(10, "steps[10].logprobs_mode: unknown value 9");

  const v1::VerifySequenceResult& ok = response.results(0);
  ASSERT_FALSE(ok.has_error()) << ok.error().message();
  ASSERT_EQ(ok.logprobs_size(), 1);
  EXPECT_EQ(ok.logprobs(0).top_tokens_size(), 0);
  EXPECT_LT(ok.logprobs(0).logprob(), 0.0f);
  EXPECT_FALSE(response.results(11).has_error()) << response.results(11).error().message();
  EXPECT_EQ(response.results(11).logprobs_size(), 0);
  {
    // Unset top_p samples as top_p 1 does in this process.
    std::unique_ptr<Backend> reference = InProcessBackend();
    ASSERT_NE(reference, nullptr);
    ASSERT_TRUE(reference->AddSequence(1).ok());
    VerifyItem item{1, {10, 20, 30}, {}, {}};
    item.sampling.temperature = 1.0f;
    item.sampling.seed = 3;
    absl::StatusOr<std::vector<VerifyOutcome>> want = reference->Verify({item});
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(Tokens(ok), (*want)[0].tokens);
  }
  EXPECT_EQ(Metric("specd_sequences"), 2);

  // A sequence that started without penalties keeps no history: turning them on later is
  // refused rather than computed from a partial count.
  v1::VerifyStepRequest next;
  next.set_step_id(2);
  AddStep(&next, 12, {response.results(11).tokens(0)})
      ->mutable_sampling()
      ->set_repetition_penalty(1.2f);
  AddStep(&next, 1, {ok.tokens(0)})->mutable_sampling()->set_temperature(1.0f);
  const v1::VerifyStepResponse second = stream.Step(next);
  EXPECT_EQ(second.results(0).error().code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(second.results(0).error().message(),
              HasSubstr("steps[0].sampling: penalties and min_tokens must be set from a "
                        "sequence's first step"));
  EXPECT_FALSE(second.results(1).has_error()) << second.results(1).error().message();
  EXPECT_TRUE(stream.Close().ok());
}

// The service keeps each sequence's history, so a step carries only its new tokens. When a
// router resyncs a sequence onto a replaced verify service it feeds the whole history at once
// with prompt_length: the new sequence then counts the resent output as output (penalties,
// min_tokens) and continues exactly as the original, while the same feed without it (all
// prompt) does not. prompt_length on a live sequence or outside [1, pending] is refused.
TEST_F(VerifyServiceTest, ResyncedHistoryCountsItsOutputAsOutput) {
  std::unique_ptr<ServiceProcess> p = StartVerify();
  ASSERT_NE(p, nullptr);
  SamplingParams penalties;
  penalties.frequency_penalty = 2.0f;
  penalties.presence_penalty = 2.0f;
  penalties.min_tokens = 7;
  const std::vector<int32_t> prompt = {5, 6, 7, 5, 6};
  std::vector<int32_t> history = prompt;
  VerifyStream stream(p->channel());
  auto add = [&](v1::VerifyStepRequest* request, uint64_t id, const std::vector<int32_t>& pending) {
    v1::VerifySequenceStep* step = AddStep(request, id, pending, {}, penalties);
    step->set_logprobs(5);
    step->set_logprobs_mode(v1::LOGPROBS_MODE_PROCESSED);
    return step;
  };
  std::vector<int32_t> pending = prompt;
  for (int step = 0; step < 4; ++step) {  // the original sequence, target-only steps
    v1::VerifyStepRequest request;
    request.set_step_id(step);
    add(&request, 31, pending);
    const v1::VerifyStepResponse response = stream.Step(request);
    ASSERT_FALSE(response.results(0).has_error()) << response.results(0).error().message();
    pending = Tokens(response.results(0));
    history.insert(history.end(), pending.begin(), pending.end());
  }
  v1::VerifyStepRequest request;
  request.set_step_id(10);
  add(&request, 31, pending);
  add(&request, 32, history)->set_prompt_length(prompt.size());  // resynced right
  add(&request, 33, history);                                    // everything as prompt
  add(&request, 34, history)->set_prompt_length(0);
  add(&request, 35, history)->set_prompt_length(history.size() + 1);
  const v1::VerifyStepResponse response = stream.Step(request);
  ASSERT_EQ(response.results_size(), 5);
  for (int i = 0; i < 3; ++i) {
    ASSERT_FALSE(response.results(i).has_error()) << response.results(i).error().message();
    ASSERT_EQ(response.results(i).logprobs_size(), 1);
  }
  const v1::VerifySequenceResult& original = response.results(0);
  const v1::VerifySequenceResult& resynced = response.results(1);
  const v1::VerifySequenceResult& as_prompt = response.results(2);
  EXPECT_EQ(Tokens(resynced), Tokens(original));
  EXPECT_NEAR(resynced.logprobs(0).logprob(), original.logprobs(0).logprob(), 1e-5);
  EXPECT_THAT(resynced.logprobs(0).top_tokens(),
              ElementsAreArray(original.logprobs(0).top_tokens()));
  // Counted as prompt, the four output tokens lose their penalties and eos its min_tokens
  // mask: a different processed distribution.
  EXPECT_GT(std::abs(as_prompt.logprobs(0).logprob() - original.logprobs(0).logprob()) +
                (Tokens(as_prompt) != Tokens(original) ? 1.0 : 0.0),
            1e-3);
  for (int i : {3, 4}) {
    EXPECT_EQ(response.results(i).error().code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(response.results(i).error().message(),
                HasSubstr(absl::StrCat("steps[", i, "].prompt_length: ")));
  }
  EXPECT_EQ(Metric("specd_sequences"), 3);  // the refused first steps created nothing

  v1::VerifyStepRequest later;
  later.set_step_id(11);
  add(&later, 32, Tokens(resynced))->set_prompt_length(1);
  const v1::VerifyStepResponse refused = stream.Step(later);
  EXPECT_EQ(refused.results(0).error().code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(refused.results(0).error().message(),
              HasSubstr("steps[0].prompt_length: only a sequence's first step"));
  EXPECT_TRUE(stream.Close().ok());
}

// A Step message that does not parse ends the stream with INVALID_ARGUMENT (it used to look
// like the client's half-close: status OK, later steps dropped); the service serves on.
TEST_F(VerifyServiceTest, UnparseableStepEndsTheStreamWithInvalidArgument) {
  std::unique_ptr<ServiceProcess> p = StartVerify();
  ASSERT_NE(p, nullptr);
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, v1::VerifyStepResponse>> raw(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, v1::VerifyStepResponse>::Create(
          p->channel().get(),
          grpc::internal::RpcMethod("/specd.v1.Verifier/Step",
                                    grpc::internal::RpcMethod::BIDI_STREAMING),
          &context));
  const std::string garbage = "\x12\x05\x08";  // steps: 5 bytes promised, 1 sent
  grpc::Slice slice(garbage);
  grpc::ByteBuffer bad(&slice, 1);
  ASSERT_TRUE(raw->Write(bad));
  raw->WritesDone();
  v1::VerifyStepResponse response;
  EXPECT_FALSE(raw->Read(&response));
  const grpc::Status status = raw->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("VerifyStepRequest message could not be parsed"));

  VerifyStream stream(p->channel());
  const v1::VerifySequenceResult first = StartSequenceOne(stream);
  EXPECT_FALSE(first.has_error()) << first.error().message();
  EXPECT_TRUE(stream.Close().ok());
}

TEST_F(VerifyServiceTest, CapacityLimitsAreResourceExhaustedPerSequence) {
  std::unique_ptr<ServiceProcess> p = StartVerify({"--max_sequences=2", "--kv_capacity_tokens=64"});
  ASSERT_NE(p, nullptr);
  VerifyStream stream(p->channel());
  v1::VerifyStepRequest request;
  request.set_step_id(1);
  AddStep(&request, 1, {1, 2, 3});
  AddStep(&request, 2, std::vector<int32_t>(100, 7));  // more than the whole KV cache
  AddStep(&request, 3, {4, 5});
  AddStep(&request, 4, {6});  // a third live sequence
  v1::VerifyStepResponse response = stream.Step(request);
  EXPECT_FALSE(response.results(0).has_error()) << response.results(0).error().message();
  EXPECT_EQ(response.results(1).error().code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(response.results(1).error().message(), HasSubstr("KV cache"));
  EXPECT_FALSE(response.results(2).has_error()) << response.results(2).error().message();
  EXPECT_EQ(response.results(3).error().code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(response.results(3).error().message(), HasSubstr("max_sequences"));

  // Releasing one makes room for another.
  v1::VerifyStepRequest next;
  next.set_step_id(2);
  next.add_release_seq_ids(1);
  AddStep(&next, 4, {6});
  response = stream.Step(next);
  EXPECT_FALSE(response.results(0).has_error()) << response.results(0).error().message();
  EXPECT_TRUE(stream.Close().ok());
}

TEST_F(VerifyServiceTest, PassedDeadlinesFreeSequences) {
  std::unique_ptr<ServiceProcess> p = StartVerify();
  ASSERT_NE(p, nullptr);
  VerifyStream stream(p->channel());
  const int64_t now = absl::ToUnixMillis(absl::Now());
  v1::VerifyStepRequest request;
  request.set_step_id(1);
  AddStep(&request, 1, {1, 2, 3});
  AddStep(&request, 2, {1, 2, 3})->set_deadline_unix_ms(now + 600);
  AddStep(&request, 3, {1, 2, 3})->set_deadline_unix_ms(now - 1000);  // already passed
  v1::VerifyStepResponse response = stream.Step(request);
  EXPECT_FALSE(response.results(0).has_error());
  EXPECT_FALSE(response.results(1).has_error());
  EXPECT_EQ(response.results(2).error().code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(Metric("specd_sequences"), 2);

  // Seq 2's deadline passes while the stream is idle: the loop frees it on its own.
  ExpectMetricSoon("specd_sequences", 1);
  EXPECT_EQ(Metric("specd_sequences_freed_total", {{"reason", "cancelled"}}), 1);

  // A later step for it is refused rather than silently restarted from one token...
  v1::VerifyStepRequest next;
  next.set_step_id(2);
  AddStep(&next, 2, {response.results(1).tokens(0)});
  // ...and a live sequence whose new deadline has passed is freed right away.
  AddStep(&next, 1, {response.results(0).tokens(0)})->set_deadline_unix_ms(now - 1);
  response = stream.Step(next);
  EXPECT_EQ(response.results(0).error().code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(response.results(0).error().message(), HasSubstr("deadline"));
  EXPECT_EQ(response.results(1).error().code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(Metric("specd_sequences"), 0);
  EXPECT_EQ(Metric("specd_sequences_freed_total", {{"reason", "cancelled"}}), 2);

  // Once the router releases the id, it may start a new sequence under it.
  v1::VerifyStepRequest restart;
  restart.set_step_id(3);
  restart.add_release_seq_ids(2);
  AddStep(&restart, 2, {1, 2, 3});
  response = stream.Step(restart);
  EXPECT_FALSE(response.results(0).has_error()) << response.results(0).error().message();
  EXPECT_TRUE(stream.Close().ok());
}

TEST_F(VerifyServiceTest, ReleasesFreeSequences) {
  std::unique_ptr<ServiceProcess> p = StartVerify();
  ASSERT_NE(p, nullptr);
  VerifyStream stream(p->channel());
  v1::VerifyStepRequest request;
  request.set_step_id(1);
  for (uint64_t s = 1; s <= 3; ++s) AddStep(&request, s, std::vector<int32_t>(20, 40 + s));
  stream.Step(request);
  EXPECT_EQ(Metric("specd_sequences"), 3);
  const double usage = Metric("specd_kv_cache_usage_ratio");
  EXPECT_GT(usage, 0);

  v1::VerifyStepRequest release;
  release.set_step_id(2);
  release.add_release_seq_ids(1);
  release.add_cancel_seq_ids(3);
  release.add_release_seq_ids(99);  // unknown ids are ignored
  release.add_cancel_seq_ids(98);
  EXPECT_EQ(stream.Step(release).results_size(), 0);
  EXPECT_EQ(Metric("specd_sequences"), 1);
  EXPECT_EQ(Metric("specd_sequences_freed_total", {{"reason", "finished"}}), 1);
  EXPECT_EQ(Metric("specd_sequences_freed_total", {{"reason", "cancelled"}}), 1);
  EXPECT_LT(Metric("specd_kv_cache_usage_ratio"), usage);
  EXPECT_TRUE(stream.Close().ok());
}

TEST_F(VerifyServiceTest, EndingOrCancellingAStreamFreesItsSequences) {
  std::unique_ptr<ServiceProcess> p = StartVerify();
  ASSERT_NE(p, nullptr);
  // Two streams from two "routers" that both number their sequences from 1.
  VerifyStream a(p->channel());
  VerifyStream b(p->channel());
  v1::VerifyStepRequest ra;
  ra.set_step_id(1);
  AddStep(&ra, 1, {5, 6, 7});
  AddStep(&ra, 2, {8, 9});
  v1::VerifyStepRequest rb;
  rb.set_step_id(1);
  AddStep(&rb, 1, {100, 101, 102, 103});
  const v1::VerifyStepResponse resp_a = a.Step(ra);
  const v1::VerifyStepResponse resp_b = b.Step(rb);
  for (const auto* r : {&resp_a, &resp_b}) {
    for (const auto& result : r->results()) EXPECT_FALSE(result.has_error());
  }
  EXPECT_EQ(Metric("specd_sequences"), 3);

  // Stream a closes cleanly: its two sequences go, b's stays.
  EXPECT_TRUE(a.Close().ok());
  ExpectMetricSoon("specd_sequences", 1);
  EXPECT_EQ(Metric("specd_sequences_freed_total", {{"reason", "cancelled"}}), 2);

  // b's sequence 1 is intact: its next step equals a fresh in-process run of its prompt.
  std::unique_ptr<Backend> reference = InProcessBackend();
  ASSERT_TRUE(reference->AddSequence(1).ok());
  absl::StatusOr<std::vector<VerifyOutcome>> first =
      reference->Verify({VerifyItem{1, {100, 101, 102, 103}, {}, {}}});
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(resp_b.results(0).tokens(0), (*first)[0].tokens[0]);
  absl::StatusOr<std::vector<VerifyOutcome>> second =
      reference->Verify({VerifyItem{1, {(*first)[0].tokens[0]}, {}, {}}});
  v1::VerifyStepRequest rb2;
  rb2.set_step_id(2);
  AddStep(&rb2, 1, {resp_b.results(0).tokens(0)});
  EXPECT_EQ(b.Step(rb2).results(0).tokens(0), (*second)[0].tokens[0]);

  // Stream b is cancelled mid-flight (a router that dies): its sequence goes too.
  b.context().TryCancel();
  ExpectMetricSoon("specd_sequences", 0);
  EXPECT_EQ(Metric("specd_sequences_freed_total", {{"reason", "cancelled"}}), 3);
  EXPECT_EQ(Metric("specd_sequences_freed_total", {{"reason", "finished"}}), 0);
}

TEST_F(VerifyServiceTest, PipelinedStepsAreAnsweredInOrder) {
  std::unique_ptr<ServiceProcess> p = StartVerify();
  ASSERT_NE(p, nullptr);
  VerifyStream stream(p->channel());
  // Ten steps written, and the writing side closed, before reading any reply; each step starts
  // a new sequence. Every reply still comes, in order, and then the stream ends OK.
  for (int i = 0; i < 10; ++i) {
    v1::VerifyStepRequest request;
    request.set_step_id(i);
    AddStep(&request, i, {i + 1, i + 2});
    ASSERT_TRUE(stream.stream().Write(request));
  }
  ASSERT_TRUE(stream.stream().WritesDone());
  for (int i = 0; i < 10; ++i) {
    v1::VerifyStepResponse response;
    ASSERT_TRUE(stream.stream().Read(&response));
    EXPECT_EQ(response.step_id(), static_cast<uint64_t>(i));
    ASSERT_EQ(response.results_size(), 1);
    EXPECT_EQ(response.results(0).seq_id(), static_cast<uint64_t>(i));
    EXPECT_FALSE(response.results(0).has_error());
  }
  v1::VerifyStepResponse extra;
  EXPECT_FALSE(stream.stream().Read(&extra));
  EXPECT_TRUE(stream.stream().Finish().ok());
  // The ended stream's ten sequences are freed.
  ExpectMetricSoon("specd_sequences", 0);
  EXPECT_EQ(Metric("specd_sequences_freed_total", {{"reason", "cancelled"}}), 10);
}

// Every draft/verify metric of docs/metrics.md is served with its documented type, and the
// text passes promtool when it is installed.
TEST_F(VerifyServiceTest, MetricsFollowTheContract) {
  std::unique_ptr<ServiceProcess> p = StartVerify();
  ASSERT_NE(p, nullptr);
  std::ifstream doc("docs/metrics.md");
  ASSERT_TRUE(doc.good()) << "run from the source tree";
  std::string line;
  bool in_section = false;
  int rows = 0;
  const std::string text = Metrics();
  while (std::getline(doc, line)) {
    if (line.rfind("## ", 0) == 0) in_section = line.find("verify") != std::string::npos;
    if (!in_section || line.rfind("| specd_", 0) != 0) continue;
    std::vector<std::string> cells = absl::StrSplit(line, '|');
    const std::string name(absl::StripAsciiWhitespace(cells[1]));
    const std::string type(absl::StripAsciiWhitespace(cells[2]));
    // prometheus-cpp names the TYPE line after the family, counters included (…_total).
    EXPECT_THAT(text, HasSubstr(absl::StrCat("# TYPE ", name, " ", type))) << name;
    ++rows;
  }
  EXPECT_EQ(rows, 10);
  EXPECT_EQ(Metric("specd_sequences_freed_total", {{"reason", "finished"}}), 0);
  // The CPU backend has no graphs and launches no kernels.
  EXPECT_EQ(Metric("specd_cuda_graph_captures_total"), 0);
  EXPECT_EQ(Metric("specd_eager_steps_total"), 0);
  EXPECT_EQ(Metric("specd_sequences_freed_total", {{"reason", "cancelled"}}), 0);
  if (std::system("command -v promtool >/dev/null 2>&1") == 0) {
    const std::string path = MakeTempDir("specd-verify-metrics") + "/metrics.txt";
    std::ofstream(path) << text;
    EXPECT_EQ(std::system(("promtool check metrics < " + path).c_str()), 0);
  }
}

// A copy of the test checkpoint whose config.json (or generation_config.json) gets `key` = `value`.
std::string CheckpointWith(const std::string& from, const std::string& file, const std::string& key,
                           const nlohmann::json& value) {
  const std::string dir = MakeTempDir("specd-bad-config");
  std::filesystem::copy(
      from, dir,
      std::filesystem::copy_options::recursive | std::filesystem::copy_options::overwrite_existing);
  nlohmann::json j = nlohmann::json::object();
  if (std::ifstream in(dir + "/" + file); in) j = nlohmann::json::parse(in);
  j[key] = value;
  std::ofstream(dir + "/" + file) << j.dump();
  return dir;
}

TEST_F(VerifyServiceTest, StartupErrorsExitNonZeroWithAClearMessage) {
  const std::string empty = MakeTempDir("specd-no-model");
  // These used to load and report SERVING while refusing every request.
  const std::string no_context = CheckpointWith(*dir_, "config.json", "max_position_embeddings", 0);
  const std::string huge_context =
      CheckpointWith(*dir_, "config.json", "max_position_embeddings", int64_t{1} << 40);
  const std::string bad_eos =
      CheckpointWith(*dir_, "generation_config.json", "eos_token_id", kVocab + 5);
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const int port = PickFreePort();
  const std::string address = absl::StrCat("--address=127.0.0.1:", port);
  const std::string metrics = absl::StrCat("--metrics_port=", PickFreePort());
  for (const Case& c : std::vector<Case>{
           {{address, metrics, "--model=" + empty}, "config.json"},
           {{address, metrics}, "--model: required"},
           {{address, metrics, "--model=" + no_context},
            "max_position_embeddings 0 must be in [1, 16777216]"},
           {{address, metrics, "--model=" + huge_context},
            "max_position_embeddings is out of the 32-bit integer range"},
           {{address, metrics, "--model=" + bad_eos},
            absl::StrCat("eos_token_id ", kVocab + 5, " is outside the vocabulary")},
           {{address, metrics, "--model=" + *dir_, "--tensor_parallel=0"}, "tensor_parallel"},
           // The dashed spelling other servers use reaches the same flag.
           {{address, metrics, "--model=" + *dir_, "--tensor-parallel=0"}, "tensor_parallel"},
           {{address, metrics, "--model=" + *dir_, "--tensor_parallel=2", "--devices=60,61"},
#ifdef SPECD_WITH_CUDA
            "cuda:60 is not available"},
#else
            // A build configured with SPECD_CUDA=OFF says so instead.
            "this build has no CUDA backend"},
#endif
           {{address, metrics, "--model=" + *dir_, "--tensor_parallel=2", "--devices=0,x"},
            "--devices: entry 1"},
           {{"--address=nonsense", metrics, "--model=" + *dir_}, "--address"},
           {{address, metrics, "--model=" + *dir_, "--devices=cpu,cpu"}, "--devices"}}) {
    absl::StatusOr<std::unique_ptr<ServiceProcess>> p = ServiceProcess::Spawn(
        {SpecdBinary("specd-verify"), c.args, absl::StrCat("127.0.0.1:", port)});
    ASSERT_TRUE(p.ok());
    absl::StatusOr<int> code = (*p)->WaitForExit(absl::Seconds(30));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 1) << c.message;
    EXPECT_THAT((*p)->Log(), HasSubstr(c.message));
  }
}

TEST_F(VerifyServiceTest, SigtermShutsDownCleanlyWithAnOpenStream) {
  std::unique_ptr<ServiceProcess> p = StartVerify();
  ASSERT_NE(p, nullptr);
  VerifyStream stream(p->channel());
  EXPECT_FALSE(StartSequenceOne(stream).has_error());
  absl::StatusOr<int> code = p->Stop(SIGTERM, absl::Seconds(10));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  EXPECT_THAT(p->Log(), HasSubstr("specd-verify: stopped"));
  // The open stream was ended by the server, not left hanging.
  stream.ExpectEndedByServer();
}

// On SIGTERM the service drains: a sequence already running keeps stepping, a new one is
// refused (per sequence, UNAVAILABLE), and once the last one is released the process stops at
// once, ending the open stream, instead of waiting out its grace period.
TEST_F(VerifyServiceTest, SigtermDrainsRunningSequencesThenStopsAtOnce) {
  std::unique_ptr<ServiceProcess> p = StartVerify({"--shutdown_grace_ms=60000"});
  ASSERT_NE(p, nullptr);
  VerifyStream stream(p->channel());
  const v1::VerifySequenceResult first = StartSequenceOne(stream);
  ASSERT_FALSE(first.has_error());

  ASSERT_EQ(kill(p->pid(), SIGTERM), 0);
  const absl::Status draining = p->WaitForHealth(HealthResponse::NOT_SERVING, absl::Seconds(10));
  ASSERT_TRUE(draining.ok()) << draining;

  v1::VerifyStepRequest second;
  second.set_step_id(2);
  AddStep(&second, 1, Tokens(first));
  AddStep(&second, 2, {4, 5});
  const v1::VerifyStepResponse r2 = stream.Step(second);
  ASSERT_EQ(r2.results_size(), 2);
  EXPECT_FALSE(r2.results(0).has_error()) << r2.results(0).error().message();
  EXPECT_EQ(r2.results(1).error().code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(r2.results(1).error().message(), HasSubstr("shutting down"));
  EXPECT_TRUE(p->Running()) << "stopped while a sequence was still running";

  v1::VerifyStepRequest last;
  last.set_step_id(3);
  last.add_release_seq_ids(1);
  stream.Step(last);
  // Released: nothing is left, so the process ends now, not after its 60 s grace.
  absl::StatusOr<int> code = p->WaitForExit(absl::Seconds(10));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  EXPECT_THAT(p->Log(), HasSubstr("specd-verify: stopped"));
  EXPECT_THAT(p->Log(), Not(HasSubstr("still running after")));
  stream.ExpectEndedByServer();
}

// A router keeps its Step stream open between requests, and clients keep idle connections:
// neither holds a stopping service for its grace period.
TEST_F(VerifyServiceTest, SigtermWithAnIdleStreamStopsAtOnce) {
  std::unique_ptr<ServiceProcess> p = StartVerify({"--shutdown_grace_ms=60000"});
  ASSERT_NE(p, nullptr);
  VerifyStream stream(p->channel());
  ASSERT_FALSE(StartSequenceOne(stream).has_error());
  v1::VerifyStepRequest release;
  release.set_step_id(2);
  release.add_release_seq_ids(1);
  stream.Step(release);
  const absl::Time before = absl::Now();
  absl::StatusOr<int> code = p->Stop(SIGTERM, absl::Seconds(10));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  EXPECT_LT(absl::Now() - before, absl::Seconds(5));
  stream.ExpectEndedByServer();
}

}  // namespace
}  // namespace specd
