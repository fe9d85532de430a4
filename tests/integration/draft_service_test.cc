// specd-draft as a real process on loopback: health, reflection and GetInfo; batched Step
// streams whose trees are valid and equal to the drafters run in this process on the same
// checkpoint (draft model and n-gram, switching between them), per-sequence errors, releases
// and stream ends freeing sequences (seen in /metrics), startup errors.
#include <signal.h>

#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/service/grpc_util.h"
#include "engine/backend.h"
#include "engine/draft/draft_model_drafter.h"
#include "engine/draft/ngram_drafter.h"
#include "gmock/gmock.h"
#include "grpcpp/impl/codegen/sync_stream.h"
#include "gtest/gtest.h"
#include "specd/v1/draft.grpc.pb.h"
#include "tests/testutil/model_service_fixture.h"
#include "tests/testutil/random_checkpoint.h"
#include "tests/testutil/service_process.h"

namespace specd {
namespace {

using ::testing::Contains;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr int kVocab = 300;

using DraftStream = StepStreamClient<v1::Drafter, v1::DraftStepRequest, v1::DraftStepResponse>;

v1::DraftSequenceStep* AddStep(v1::DraftStepRequest* request, uint64_t seq,
                               const std::vector<int32_t>& new_tokens, v1::DraftMethod method,
                               const DraftParams& params) {
  v1::DraftSequenceStep* step = request->add_steps();
  step->set_seq_id(seq);
  step->mutable_new_tokens()->Add(new_tokens.begin(), new_tokens.end());
  step->set_method(method);
  step->set_depth(params.depth);
  step->set_top_k(params.top_k);
  step->set_max_nodes(params.max_nodes);
  return step;
}

TokenTree FromProto(const v1::TokenTree& t) {
  TokenTree tree;
  tree.tokens.assign(t.tokens().begin(), t.tokens().end());
  tree.parents.assign(t.parents().begin(), t.parents().end());
  tree.draft_logprobs.assign(t.draft_logprobs().begin(), t.draft_logprobs().end());
  return tree;
}

class DraftServiceTest : public ModelServiceTest {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(MakeTempDir("specd-draft-it"));
    RandomCheckpointSpec spec;
    spec.vocab_size = kVocab;
    spec.hidden_size = 32;
    spec.intermediate_size = 64;
    spec.num_layers = 1;
    spec.init_std = 0.3f;
    spec.seed = 5;
    spec.max_position_embeddings = 128;
    ASSERT_TRUE(WriteRandomCheckpoint(*dir_, spec).ok());
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(*dir_, ec);
    delete dir_;
  }

  // Starts specd-draft on free loopback ports: with the draft model unless `model_args`
  // replaces it (e.g. {"--vocab_size=300"} for n-gram only).
  std::unique_ptr<ServiceProcess> StartDraft(std::vector<std::string> model_args = {},
                                             std::vector<std::string> extra = {}) {
    if (model_args.empty()) model_args = {"--model=" + *dir_};
    model_args.insert(model_args.end(), extra.begin(), extra.end());
    return StartService(SpecdBinary("specd-draft"), model_args);
  }

  static std::string* dir_;
};

std::string* DraftServiceTest::dir_ = nullptr;

TEST_F(DraftServiceTest, HealthReflectionAndInfo) {
  // Reflection is off by default (internal service); --reflection turns it on.
  std::unique_ptr<ServiceProcess> p = StartDraft({}, {"--reflection"});
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(*p->Health("specd.v1.Drafter"), grpc::health::v1::HealthCheckResponse::SERVING);
  absl::StatusOr<std::vector<std::string>> services = ListServicesByReflection(p->channel());
  ASSERT_TRUE(services.ok()) << services.status();
  EXPECT_THAT(*services, Contains("specd.v1.Drafter"));
  auto stub = v1::Drafter::NewStub(p->channel());
  grpc::ClientContext context;
  v1::DraftInfo info;
  ASSERT_TRUE(stub->GetInfo(&context, v1::DraftInfoRequest(), &info).ok());
  EXPECT_EQ(info.model(), std::filesystem::path(*dir_).filename().string());
  EXPECT_EQ(info.vocab_size(), static_cast<uint32_t>(kVocab));
}

// Model and n-gram sequences in the same steps, some switching method midway: every tree is
// valid, within its shape limits, and equal to what the drafters give in this process when fed
// the same history.
TEST_F(DraftServiceTest, TreesAreValidAndEqualInProcessDrafters) {
  std::unique_ptr<ServiceProcess> p = StartDraft();
  ASSERT_NE(p, nullptr);
  absl::StatusOr<std::unique_ptr<Backend>> model = CreateBackend(*dir_, BackendOptions());
  ASSERT_TRUE(model.ok()) << model.status();
  DraftModelDrafter model_drafter(model->get());
  // Told each step's outcome as the service is: counts the tokens the service should feed.
  absl::StatusOr<std::unique_ptr<Backend>> told_model = CreateBackend(*dir_, BackendOptions());
  ASSERT_TRUE(told_model.ok()) << told_model.status();
  DraftModelDrafter told(told_model->get());
  absl::StatusOr<std::unique_ptr<NgramDrafter>> ngram = NgramDrafter::Create(kVocab, {});
  ASSERT_TRUE(ngram.ok());

  struct Seq {
    uint64_t id;
    std::vector<int32_t> history;
    size_t model_fed = 0;  // history prefix the in-process model drafter has seen
    bool model_added = false;
  };
  std::vector<Seq> seqs = {
      {1, {10, 20, 30, 40, 50}}, {2, {7, 8, 9, 7, 8, 9, 7, 8}}, {3, {100, 101, 102, 100, 101}}};
  const DraftParams params{3, 2, 6};
  const std::vector<std::vector<v1::DraftMethod>> methods = {
      {v1::DRAFT_METHOD_MODEL, v1::DRAFT_METHOD_NGRAM, v1::DRAFT_METHOD_NGRAM},
      {v1::DRAFT_METHOD_MODEL, v1::DRAFT_METHOD_NGRAM, v1::DRAFT_METHOD_MODEL},
      {v1::DRAFT_METHOD_MODEL, v1::DRAFT_METHOD_MODEL, v1::DRAFT_METHOD_MODEL}};
  DraftStream stream(p->channel());
  std::vector<std::vector<int32_t>> pending(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) pending[i] = seqs[i].history;
  std::vector<int32_t> accepted(seqs.size(), -1);
  int nonempty_ngram = 0;
  for (int step = 0; step < 3; ++step) {
    v1::DraftStepRequest request;
    request.set_step_id(step);
    for (size_t i = 0; i < seqs.size(); ++i) {
      v1::DraftSequenceStep* st =
          AddStep(&request, seqs[i].id, pending[i], methods[step][i], params);
      // The outcome of the previous step (node 0 or nothing accepted): the service commits the
      // kept KV of that node instead of feeding it again; the in-process drafter below is not
      // told, so equal trees mean reuse changes nothing.
      if (step > 0) st->set_accepted_node(accepted[i]);
    }
    const v1::DraftStepResponse response = stream.Step(request);
    for (size_t i = 0; i < seqs.size(); ++i) {
      const v1::DraftSequenceResult& r = response.results(i);
      ASSERT_EQ(r.seq_id(), seqs[i].id);
      ASSERT_FALSE(r.has_error()) << r.error().message();
      const TokenTree tree = FromProto(r.tree());
      EXPECT_TRUE(ValidateTree(tree, kVocab).ok());
      EXPECT_LE(tree.size(), params.max_nodes);
      for (int d : TreeDepths(tree)) EXPECT_LT(d, params.depth);

      TokenTree want;
      Seq& s = seqs[i];
      if (methods[step][i] == v1::DRAFT_METHOD_MODEL) {
        if (!s.model_added) ASSERT_TRUE(model_drafter.AddSequence(s.id).ok());
        s.model_added = true;
        std::vector<int32_t> feed(s.history.begin() + s.model_fed, s.history.end());
        absl::StatusOr<std::vector<TokenTree>> trees =
            model_drafter.Draft({DraftRequest{static_cast<SeqId>(s.id), feed, params}});
        ASSERT_TRUE(trees.ok()) << trees.status();
        if (!told.HasSequence(s.id)) ASSERT_TRUE(told.AddSequence(s.id).ok());
        const int32_t outcome = step > 0 ? accepted[i] : DraftRequest::kNoOutcome;
        ASSERT_TRUE(
            told.Draft({DraftRequest{static_cast<SeqId>(s.id), feed, params, outcome}}).ok());
        want = (*trees)[0];
        s.model_fed = s.history.size();
        EXPECT_FALSE(tree.empty());
      } else {
        want = (*ngram)->Propose(s.history, params);
        nonempty_ngram += tree.empty() ? 0 : 1;
      }
      EXPECT_EQ(tree.tokens, want.tokens) << "step " << step << " seq " << i;
      EXPECT_EQ(tree.parents, want.parents) << "step " << step << " seq " << i;
      EXPECT_EQ(tree.draft_logprobs, want.draft_logprobs) << "step " << step << " seq " << i;
      // The "verifier" accepts the first root-to-leaf chain's first token and adds a bonus.
      std::vector<int32_t> emitted;
      if (!tree.empty()) emitted.push_back(tree.tokens[0]);
      accepted[i] = tree.empty() ? -1 : 0;
      emitted.push_back(static_cast<int32_t>((step * 31 + i * 7) % 256));
      s.history.insert(s.history.end(), emitted.begin(), emitted.end());
      pending[i] = emitted;
    }
  }
  EXPECT_GT(nonempty_ngram, 0) << "the repeating prompts must give n-gram proposals";
  EXPECT_EQ(Metric("specd_sequences"), 3);
  EXPECT_GT(Metric("specd_kv_cache_usage_ratio"), 0);
  EXPECT_EQ(Metric("specd_step_batch_size_count"), 3);
  // The service fed what a drafter told the outcomes feeds, less than refeeding the accepted.
  EXPECT_EQ(Metric("specd_step_tokens_total"), static_cast<double>(told.fed_tokens()));
  EXPECT_LT(told.fed_tokens(), model_drafter.fed_tokens());
  EXPECT_TRUE(stream.Close().ok());
}

TEST_F(DraftServiceTest, PerSequenceErrorsLeaveTheOthersServed) {
  std::unique_ptr<ServiceProcess> p = StartDraft();
  ASSERT_NE(p, nullptr);
  DraftStream stream(p->channel());
  const DraftParams params{2, 2, 4};
  v1::DraftStepRequest request;
  request.set_step_id(1);
  AddStep(&request, 1, {1, 2, 3}, v1::DRAFT_METHOD_MODEL, params);
  AddStep(&request, 2, {1, kVocab, 3}, v1::DRAFT_METHOD_MODEL, params);
  AddStep(&request, 3, {}, v1::DRAFT_METHOD_NGRAM, params);
  AddStep(&request, 4, {1}, v1::DRAFT_METHOD_MODEL, {2, 2, 300});  // max_nodes > 256
  AddStep(&request, 5, {1}, static_cast<v1::DraftMethod>(9), params);
  AddStep(&request, 6, {1}, v1::DRAFT_METHOD_NGRAM, params)
      ->set_deadline_unix_ms(absl::ToUnixMillis(absl::Now()) - 10);
  AddStep(&request, 7, {1}, v1::DRAFT_METHOD_MODEL, params)->set_accepted_node(-3);
  const v1::DraftStepResponse response = stream.Step(request);
  EXPECT_FALSE(response.results(0).has_error()) << response.results(0).error().message();
  EXPECT_FALSE(response.results(0).tree().tokens().empty());
  auto expect_error = [&](int i, grpc::StatusCode code, const std::string& text) {
    const v1::DraftSequenceResult& r = response.results(i);
    EXPECT_EQ(r.error().code(), code) << i << ": " << r.error().message();
    EXPECT_THAT(r.error().message(), HasSubstr(text)) << i;
    EXPECT_EQ(r.tree().tokens_size(), 0) << i;
  };
  expect_error(1, grpc::StatusCode::INVALID_ARGUMENT, "steps[1].new_tokens[1]: token id 300");
  expect_error(2, grpc::StatusCode::INVALID_ARGUMENT, "steps[2].new_tokens: empty");
  expect_error(3, grpc::StatusCode::INVALID_ARGUMENT, "steps[3].max_nodes");
  expect_error(4, grpc::StatusCode::INVALID_ARGUMENT, "steps[4].method");
  expect_error(5, grpc::StatusCode::DEADLINE_EXCEEDED, "deadline");
  expect_error(6, grpc::StatusCode::INVALID_ARGUMENT, "steps[6].accepted_node: -3");
  EXPECT_EQ(Metric("specd_sequences"), 1);

  // Still serving: seq 1 continues, seq 2 starts with valid tokens.
  v1::DraftStepRequest next;
  next.set_step_id(2);
  AddStep(&next, 1, {response.results(0).tree().tokens(0), 9}, v1::DRAFT_METHOD_MODEL, params);
  AddStep(&next, 2, {1, 2, 3}, v1::DRAFT_METHOD_MODEL, params);
  const v1::DraftStepResponse second = stream.Step(next);
  EXPECT_FALSE(second.results(0).has_error()) << second.results(0).error().message();
  EXPECT_FALSE(second.results(1).has_error()) << second.results(1).error().message();
  // Same prompt, same deterministic drafter: seq 2's tree equals seq 1's first tree.
  EXPECT_THAT(second.results(1).tree().tokens(),
              ElementsAreArray(response.results(0).tree().tokens()));
  EXPECT_TRUE(stream.Close().ok());
}

// Overlap: a pre_draft step guesses the outcome of the tree the sequence got last (its tokens
// are a path of that tree, then a bonus token that is none of the last node's children) and
// returns the tree below the guess, the tree a fresh sequence with that history gets; a hit's
// tokens are taken in; bad pre-draft steps are refused per sequence, naming the field.
TEST_F(DraftServiceTest, PreDraftsGuessTheOutcomeAndRefuseBadStepsByField) {
  std::unique_ptr<ServiceProcess> p = StartDraft();
  ASSERT_NE(p, nullptr);
  DraftStream stream(p->channel());
  const DraftParams params{3, 2, 6};
  const std::vector<int32_t> prompt = {1, 2, 3};
  v1::DraftStepRequest first;
  first.set_step_id(1);
  AddStep(&first, 1, prompt, v1::DRAFT_METHOD_MODEL, params);
  AddStep(&first, 2, {5, 6, 7, 5, 6}, v1::DRAFT_METHOD_NGRAM, params);
  const v1::DraftStepResponse drafted = stream.Step(first);
  ASSERT_FALSE(drafted.results(0).has_error()) << drafted.results(0).error().message();
  const TokenTree tree = FromProto(drafted.results(0).tree());
  ASSERT_FALSE(tree.empty());

  v1::DraftStepRequest pre;
  pre.set_step_id(2);
  AddStep(&pre, 1, {}, v1::DRAFT_METHOD_MODEL, params)->set_pre_draft(true);
  AddStep(&pre, 2, {}, v1::DRAFT_METHOD_NGRAM, params)->set_pre_draft(true);
  AddStep(&pre, 3, {}, v1::DRAFT_METHOD_MODEL, params)->set_pre_draft(true);
  AddStep(&pre, 4, {}, v1::DRAFT_METHOD_MODEL, {2, 2, 300})->set_pre_draft(true);
  const v1::DraftStepResponse guessed = stream.Step(pre);
  const v1::DraftSequenceResult& g = guessed.results(0);
  ASSERT_FALSE(g.has_error()) << g.error().message();
  ASSERT_FALSE(g.tree().tokens().empty());
  const std::vector<int32_t> guess(g.guess_tokens().begin(), g.guess_tokens().end());
  std::vector<int32_t> path;
  for (int n = g.guess_node(); n >= 0; n = tree.parents[n]) path.insert(path.begin(), n);
  ASSERT_EQ(guess.size(), path.size() + 1);
  for (size_t i = 0; i < path.size(); ++i) EXPECT_EQ(guess[i], tree.tokens[path[i]]);
  for (int i = 0; i < tree.size(); ++i) {
    if (tree.parents[i] == g.guess_node()) EXPECT_NE(tree.tokens[i], guess.back());
  }
  EXPECT_EQ(guessed.results(1).error().code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(guessed.results(1).error().message(), HasSubstr("steps[1].pre_draft"));
  EXPECT_EQ(guessed.results(2).error().code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(guessed.results(2).error().message(), HasSubstr("steps[2].pre_draft"));
  EXPECT_EQ(guessed.results(3).error().code(), grpc::StatusCode::FAILED_PRECONDITION);

  // A fresh sequence with the guessed history gets the pre-drafted tree.
  std::vector<int32_t> history = prompt;
  history.insert(history.end(), guess.begin(), guess.end());
  v1::DraftStepRequest fresh;
  fresh.set_step_id(3);
  AddStep(&fresh, 5, history, v1::DRAFT_METHOD_MODEL, params);
  // The hit: seq 1's guess confirmed, and the next guess below the pre-drafted tree.
  AddStep(&fresh, 1, guess, v1::DRAFT_METHOD_MODEL, params)->set_pre_draft(true);
  const v1::DraftStepResponse third = stream.Step(fresh);
  ASSERT_FALSE(third.results(0).has_error()) << third.results(0).error().message();
  EXPECT_THAT(third.results(0).tree().tokens(), ElementsAreArray(g.tree().tokens()));
  EXPECT_THAT(third.results(0).tree().parents(), ElementsAreArray(g.tree().parents()));
  ASSERT_FALSE(third.results(1).has_error()) << third.results(1).error().message();
  EXPECT_FALSE(third.results(1).guess_tokens().empty());

  // A miss: the next draft step sends what verify really emitted; the sequence goes on.
  v1::DraftStepRequest after;
  after.set_step_id(4);
  AddStep(&after, 1, {7, 8}, v1::DRAFT_METHOD_MODEL, params)->set_accepted_node(-1);
  const v1::DraftStepResponse fourth = stream.Step(after);
  ASSERT_FALSE(fourth.results(0).has_error()) << fourth.results(0).error().message();
  EXPECT_FALSE(fourth.results(0).tree().tokens().empty());
  EXPECT_EQ(Metric("specd_sequences"), 3);
  EXPECT_TRUE(stream.Close().ok());
}

// A pre_draft step with fan_out 3 (and measured chain_rates to rank them) returns up to two
// further guesses, each a different outcome with the tree a fresh sequence with that history
// gets; a hit on a further guess is taken in like one on the first; a fan_out above 8 and a rate
// outside [0, 1] are refused naming the field.
TEST_F(DraftServiceTest, PreDraftsSeveralGuessesWithAFanOut) {
  std::unique_ptr<ServiceProcess> p = StartDraft();
  ASSERT_NE(p, nullptr);
  DraftStream stream(p->channel());
  const DraftParams params{3, 2, 6};
  const std::vector<int32_t> prompt = {1, 2, 3};
  v1::DraftStepRequest first;
  first.set_step_id(1);
  AddStep(&first, 1, prompt, v1::DRAFT_METHOD_MODEL, params);
  AddStep(&first, 2, prompt, v1::DRAFT_METHOD_MODEL, params);
  AddStep(&first, 6, prompt, v1::DRAFT_METHOD_MODEL, params);
  const v1::DraftStepResponse drafted = stream.Step(first);
  ASSERT_FALSE(drafted.results(0).has_error()) << drafted.results(0).error().message();

  v1::DraftStepRequest pre;
  pre.set_step_id(2);
  AddStep(&pre, 1, {}, v1::DRAFT_METHOD_MODEL, params)->set_pre_draft(true);
  pre.mutable_steps(0)->set_fan_out(3);
  for (float rate : {0.6f, 0.7f, 0.8f}) pre.mutable_steps(0)->add_chain_rates(rate);
  AddStep(&pre, 2, {}, v1::DRAFT_METHOD_MODEL, params)->set_pre_draft(true);
  pre.mutable_steps(1)->set_fan_out(9);
  AddStep(&pre, 6, {}, v1::DRAFT_METHOD_MODEL, params)->set_pre_draft(true);
  for (float rate : {0.5f, 1.5f}) pre.mutable_steps(2)->add_chain_rates(rate);
  const v1::DraftStepResponse guessed = stream.Step(pre);
  const v1::DraftSequenceResult& g = guessed.results(0);
  ASSERT_FALSE(g.has_error()) << g.error().message();
  ASSERT_GE(g.more_guesses_size(), 1);
  ASSERT_LE(g.more_guesses_size(), 2);
  EXPECT_EQ(guessed.results(1).error().code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(guessed.results(1).error().message(), HasSubstr("steps[1].fan_out"));
  EXPECT_EQ(guessed.results(2).error().code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(guessed.results(2).error().message(), HasSubstr("steps[2].chain_rates[1]"));
  const v1::PreDraftGuess& second = g.more_guesses(0);
  const std::vector<int32_t> guess(second.tokens().begin(), second.tokens().end());
  EXPECT_NE(guess, std::vector<int32_t>(g.guess_tokens().begin(), g.guess_tokens().end()));
  ASSERT_FALSE(second.tree().tokens().empty());

  // The hit on the second guess, and a fresh sequence with its history: the same tree.
  std::vector<int32_t> history = prompt;
  history.insert(history.end(), guess.begin(), guess.end());
  v1::DraftStepRequest hit;
  hit.set_step_id(3);
  AddStep(&hit, 5, history, v1::DRAFT_METHOD_MODEL, params);
  AddStep(&hit, 1, guess, v1::DRAFT_METHOD_MODEL, params)->set_pre_draft(true);
  const v1::DraftStepResponse third = stream.Step(hit);
  ASSERT_FALSE(third.results(0).has_error()) << third.results(0).error().message();
  EXPECT_THAT(third.results(0).tree().tokens(), ElementsAreArray(second.tree().tokens()));
  EXPECT_THAT(third.results(0).tree().parents(), ElementsAreArray(second.tree().parents()));
  ASSERT_FALSE(third.results(1).has_error()) << third.results(1).error().message();
  EXPECT_FALSE(third.results(1).guess_tokens().empty());  // the hit was taken in
  EXPECT_TRUE(stream.Close().ok());
}

// Ingest-only steps feed a sequence without drafting it: a present, empty tree, and the next
// draft of the sequence equals that of a fresh one sent its whole history, whether the ingest
// created the sequence or followed a drafted step (with its outcome). Misuse is named.
TEST_F(DraftServiceTest, IngestOnlyStepsFeedWithoutDrafting) {
  std::unique_ptr<ServiceProcess> p = StartDraft();
  ASSERT_NE(p, nullptr);
  DraftStream stream(p->channel());
  const DraftParams params{3, 2, 6};
  const std::vector<int32_t> prompt = {1, 2, 3, 4};
  v1::DraftStepRequest first;
  first.set_step_id(1);
  AddStep(&first, 1, prompt, v1::DRAFT_METHOD_MODEL, params);
  AddStep(&first, 2, prompt, v1::DRAFT_METHOD_MODEL, params)->set_ingest_only(true);
  AddStep(&first, 3, prompt, v1::DRAFT_METHOD_NGRAM, params)->set_ingest_only(true);
  v1::DraftSequenceStep* both = AddStep(&first, 4, prompt, v1::DRAFT_METHOD_MODEL, params);
  both->set_ingest_only(true);
  both->set_pre_draft(true);
  const v1::DraftStepResponse r1 = stream.Step(first);
  ASSERT_FALSE(r1.results(0).has_error()) << r1.results(0).error().message();
  const TokenTree tree = FromProto(r1.results(0).tree());
  ASSERT_FALSE(tree.empty());
  ASSERT_FALSE(r1.results(1).has_error()) << r1.results(1).error().message();
  EXPECT_TRUE(r1.results(1).has_tree());
  EXPECT_EQ(r1.results(1).tree().tokens_size(), 0);
  for (int i : {2, 3}) {
    EXPECT_EQ(r1.results(i).error().code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(r1.results(i).error().message(), HasSubstr("].ingest_only"));
  }

  // Sequence 1 accepted node 0 plus a bonus token; both sequences are then ingested once more
  // and drafted with one new token.
  const std::vector<int32_t> outcome = {tree.tokens[0], 9};
  v1::DraftStepRequest second;
  second.set_step_id(2);
  AddStep(&second, 1, outcome, v1::DRAFT_METHOD_MODEL, params)->set_ingest_only(true);
  second.mutable_steps(0)->set_accepted_node(0);
  AddStep(&second, 2, outcome, v1::DRAFT_METHOD_MODEL, params)->set_ingest_only(true);
  const v1::DraftStepResponse r2 = stream.Step(second);
  for (int i : {0, 1}) ASSERT_FALSE(r2.results(i).has_error()) << r2.results(i).error().message();
  v1::DraftStepRequest third;
  third.set_step_id(3);
  AddStep(&third, 1, {11}, v1::DRAFT_METHOD_MODEL, params);
  AddStep(&third, 2, {11}, v1::DRAFT_METHOD_MODEL, params);
  std::vector<int32_t> history = prompt;
  history.insert(history.end(), outcome.begin(), outcome.end());
  history.push_back(11);
  AddStep(&third, 5, history, v1::DRAFT_METHOD_MODEL, params);
  const v1::DraftStepResponse r3 = stream.Step(third);
  for (int i : {0, 1, 2})
    ASSERT_FALSE(r3.results(i).has_error()) << r3.results(i).error().message();
  for (int i : {0, 1}) {
    EXPECT_THAT(r3.results(i).tree().tokens(), ElementsAreArray(r3.results(2).tree().tokens()));
    EXPECT_THAT(r3.results(i).tree().parents(), ElementsAreArray(r3.results(2).tree().parents()));
  }
  EXPECT_TRUE(stream.Close().ok());
}

// Tree shapes no tree can have (depth 100000 used to answer an empty tree) and a history
// beyond any served context are refused per sequence, naming the field.
TEST_F(DraftServiceTest, OversizedShapesAndHistoriesAreNamed) {
  std::unique_ptr<ServiceProcess> p = StartDraft({absl::StrCat("--vocab_size=", kVocab)});
  ASSERT_NE(p, nullptr);
  DraftStream stream(p->channel());
  v1::DraftStepRequest request;
  request.set_step_id(1);
  AddStep(&request, 1, {1, 2, 3}, v1::DRAFT_METHOD_NGRAM, {100000, 2, 4});
  AddStep(&request, 2, {1, 2, 3}, v1::DRAFT_METHOD_NGRAM, {2, 100000, 4});
  AddStep(&request, 3, {1, 2, 3}, v1::DRAFT_METHOD_NGRAM, {2, 2, 4})->set_depth(4000000000u);
  AddStep(&request, 4, std::vector<int32_t>((1 << 20) + 1, 5), v1::DRAFT_METHOD_NGRAM, {2, 2, 4});
  AddStep(&request, 5, {1, 2, 3}, v1::DRAFT_METHOD_NGRAM, {256, 2, 4});
  const v1::DraftStepResponse response = stream.Step(request);
  ASSERT_EQ(response.results_size(), 5);
  for (const auto& [i, text] : std::vector<std::pair<int, std::string>>{
           {0, "steps[0].depth: 100000 must be in [1, 256]"},
           {1, "steps[1].top_k: 100000 must be in [1, 256]"},
           {2, "steps[2].depth"},
           {3, "steps[3].new_tokens: the sequence would hold 1048577 tokens"}}) {
    EXPECT_EQ(response.results(i).error().code(), grpc::StatusCode::INVALID_ARGUMENT) << i;
    EXPECT_THAT(response.results(i).error().message(), HasSubstr(text)) << i;
  }
  EXPECT_FALSE(response.results(4).has_error()) << response.results(4).error().message();
  EXPECT_TRUE(stream.Close().ok());
}

// A Step message that does not parse used to end the stream's reads as a half-close: status OK,
// later steps silently dropped. It ends the stream with INVALID_ARGUMENT; the service serves on.
TEST_F(DraftServiceTest, UnparseableStepEndsTheStreamWithInvalidArgument) {
  std::unique_ptr<ServiceProcess> p = StartDraft({absl::StrCat("--vocab_size=", kVocab)});
  ASSERT_NE(p, nullptr);
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, v1::DraftStepResponse>> raw(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, v1::DraftStepResponse>::Create(
          p->channel().get(),
          grpc::internal::RpcMethod("/specd.v1.Drafter/Step",
                                    grpc::internal::RpcMethod::BIDI_STREAMING),
          &context));
  const std::string garbage = "\x0a\xff\xff\xff\xff\x0f garbage";  // field 1 with a huge length
  grpc::Slice slice(garbage);
  grpc::ByteBuffer bad(&slice, 1);
  ASSERT_TRUE(raw->Write(bad));
  v1::DraftStepRequest later;
  later.set_step_id(2);
  AddStep(&later, 1, {1, 2, 3}, v1::DRAFT_METHOD_NGRAM, {2, 2, 4});
  grpc::ByteBuffer later_bytes;
  bool own = false;
  ASSERT_TRUE(
      grpc::SerializationTraits<v1::DraftStepRequest>::Serialize(later, &later_bytes, &own).ok());
  raw->Write(later_bytes);  // may fail once the server has ended the stream
  raw->WritesDone();
  v1::DraftStepResponse response;
  EXPECT_FALSE(raw->Read(&response));
  const grpc::Status status = raw->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("could not be parsed"));

  DraftStream stream(p->channel());
  const v1::DraftStepResponse ok = stream.Step(later);
  EXPECT_FALSE(ok.results(0).has_error()) << ok.results(0).error().message();
  EXPECT_TRUE(stream.Close().ok());
}

TEST_F(DraftServiceTest, NgramOnlyServiceRefusesModelDrafting) {
  std::unique_ptr<ServiceProcess> p = StartDraft({absl::StrCat("--vocab_size=", kVocab)});
  ASSERT_NE(p, nullptr);
  DraftStream stream(p->channel());
  v1::DraftStepRequest request;
  request.set_step_id(1);
  AddStep(&request, 1, {5, 6, 7, 5, 6}, v1::DRAFT_METHOD_NGRAM, {3, 2, 8});
  AddStep(&request, 2, {5, 6, 7}, v1::DRAFT_METHOD_MODEL, {3, 2, 8});
  const v1::DraftStepResponse response = stream.Step(request);
  EXPECT_FALSE(response.results(0).has_error());
  // "5 6" occurred before, followed by "7 5 6".
  EXPECT_THAT(response.results(0).tree().tokens(), ElementsAreArray({7, 5, 6}));
  EXPECT_EQ(response.results(1).error().code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(response.results(1).error().message(), HasSubstr("no draft model"));
  EXPECT_EQ(Metric("specd_kv_cache_usage_ratio"), 0);
  EXPECT_TRUE(stream.Close().ok());
}

TEST_F(DraftServiceTest, ReleasesAndStreamEndsFreeSequences) {
  std::unique_ptr<ServiceProcess> p = StartDraft({}, {"--max_sequences=3"});
  ASSERT_NE(p, nullptr);
  DraftStream a(p->channel());
  DraftStream b(p->channel());
  const DraftParams params{2, 2, 4};
  v1::DraftStepRequest ra;
  ra.set_step_id(1);
  for (uint64_t s = 1; s <= 3; ++s) {
    AddStep(&ra, s, {static_cast<int32_t>(s), 2, 3}, v1::DRAFT_METHOD_MODEL, params);
  }
  const v1::DraftStepResponse first = a.Step(ra);
  for (const auto& r : first.results()) EXPECT_FALSE(r.has_error()) << r.error().message();
  EXPECT_EQ(Metric("specd_sequences"), 3);
  const double usage = Metric("specd_kv_cache_usage_ratio");

  // The service is full: another stream's sequence is refused.
  v1::DraftStepRequest rb;
  rb.set_step_id(1);
  AddStep(&rb, 1, {4, 5}, v1::DRAFT_METHOD_NGRAM, params);
  EXPECT_EQ(b.Step(rb).results(0).error().code(), grpc::StatusCode::RESOURCE_EXHAUSTED);

  v1::DraftStepRequest release;
  release.set_step_id(2);
  release.add_release_seq_ids(2);
  EXPECT_EQ(a.Step(release).results_size(), 0);
  EXPECT_EQ(Metric("specd_sequences"), 2);
  EXPECT_EQ(Metric("specd_sequences_freed_total", {{"reason", "finished"}}), 1);
  EXPECT_LT(Metric("specd_kv_cache_usage_ratio"), usage);
  EXPECT_FALSE(b.Step(rb).results(0).has_error());
  EXPECT_EQ(Metric("specd_sequences"), 3);

  v1::DraftStepRequest cancel;  // a client that cancels
  cancel.set_step_id(3);
  cancel.add_cancel_seq_ids(3);
  EXPECT_EQ(a.Step(cancel).results_size(), 0);
  EXPECT_EQ(Metric("specd_sequences"), 2);
  EXPECT_EQ(Metric("specd_sequences_freed_total", {{"reason", "cancelled"}}), 1);

  a.context().TryCancel();  // a router that dies
  ExpectMetricSoon("specd_sequences", 1);
  EXPECT_EQ(Metric("specd_sequences_freed_total", {{"reason", "cancelled"}}), 2);
  EXPECT_TRUE(b.Close().ok());
  ExpectMetricSoon("specd_sequences", 0);
  EXPECT_EQ(Metric("specd_sequences_freed_total", {{"reason", "cancelled"}}), 3);
  EXPECT_EQ(Metric("specd_kv_cache_usage_ratio"), 0);
}

TEST_F(DraftServiceTest, StartupErrorsAndSigterm) {
  const std::string empty = MakeTempDir("specd-no-draft-model");
  const int port = PickFreePort();
  const std::vector<std::string> base = {absl::StrCat("--address=127.0.0.1:", port),
                                         absl::StrCat("--metrics_port=", PickFreePort())};
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  for (const Case& c :
       std::vector<Case>{{{"--model=" + empty}, "config.json"},
                         {{}, "--vocab_size"},
                         {{"--model=" + *dir_, "--vocab_size=7"}, "vocab_size"},
                         {{"--vocab_size=300", "--tree_max_nodes=999"}, "max_nodes"}}) {
    std::vector<std::string> args = base;
    args.insert(args.end(), c.args.begin(), c.args.end());
    absl::StatusOr<std::unique_ptr<ServiceProcess>> p =
        ServiceProcess::Spawn({SpecdBinary("specd-draft"), args, absl::StrCat("127.0.0.1:", port)});
    ASSERT_TRUE(p.ok());
    absl::StatusOr<int> code = (*p)->WaitForExit(absl::Seconds(30));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 1) << c.message;
    EXPECT_THAT((*p)->Log(), HasSubstr(c.message));
  }

  std::unique_ptr<ServiceProcess> p = StartDraft();
  ASSERT_NE(p, nullptr);
  absl::StatusOr<int> code = p->Stop(SIGINT, absl::Seconds(10));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  EXPECT_THAT(p->Log(), HasSubstr("specd-draft: stopped"));
}

}  // namespace
}  // namespace specd
