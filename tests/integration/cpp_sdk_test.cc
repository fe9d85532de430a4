// The C++ SDK (specd::Client) against a real CPU cluster: specd-verify, specd-draft and
// specd-router as processes on loopback (CpuCluster). Blocking, callback and iterator
// streaming agree with each other and with the raw gRPC stream; cancellation and deadlines
// free the sequence in every service; INVALID_ARGUMENT names the field; RESOURCE_EXHAUSTED
// from a full queue is retried until the request gets in; a stream that fails after a chunk is
// not retried. Each test starts its own cluster, so metric deltas belong to it alone.
#include <signal.h>
#include <stdio.h>
#include <sys/wait.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "specd/client.h"
#include "specd/v1/generation.grpc.pb.h"
#include "tests/testutil/cpu_cluster.h"
#include "tests/testutil/service_process.h"

namespace specd {
namespace {

using absl::StatusCode;

#define ASSERT_OK(expr)                          \
  do {                                           \
    const absl::Status _s = (expr);              \
    ASSERT_TRUE(_s.ok()) << #expr << ": " << _s; \
  } while (0)

std::unique_ptr<CpuCluster> StartCluster(const CpuClusterOptions& options = {}) {
  absl::StatusOr<std::unique_ptr<CpuCluster>> c = CpuCluster::Start(options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

std::unique_ptr<Client> Connect(const CpuCluster& cluster, RetryPolicy retry = {}) {
  ClientOptions options;
  options.target = cluster.router_address;
  options.default_timeout = absl::Seconds(120);
  options.retry = retry;
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Create(options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

GenerateRequest Greedy(const std::string& prompt, uint32_t max_new_tokens,
                       Speculation speculation) {
  GenerateRequest r;
  r.prompt = prompt;
  r.max_new_tokens = max_new_tokens;
  r.ignore_eos = true;
  r.speculation = speculation;
  return r;
}

double RouterMetric(const CpuCluster& c, const std::string& name,
                    const std::map<std::string, std::string>& labels = {}) {
  return CpuCluster::Metric(c.router_metrics, name, labels);
}

// The sequence is gone from the draft and verify services and the router counts the outcome.
void ExpectFreed(const CpuCluster& c, const std::string& outcome, double count) {
  EXPECT_TRUE(CpuCluster::WaitForMetric(c.verify_metrics, "specd_sequences", {}, 0).ok());
  if (c.draft != nullptr) {
    EXPECT_TRUE(CpuCluster::WaitForMetric(c.draft_metrics, "specd_sequences", {}, 0).ok());
  }
  const absl::Status s = CpuCluster::WaitForMetric(c.router_metrics, "specd_requests_total",
                                                   {{"outcome", outcome}}, count);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(RouterMetric(c, "specd_requests_running"), 0);
}

TEST(CppSdkTest, GenerateMatchesTheRawStreamAndTargetOnlyDecoding) {
  std::unique_ptr<CpuCluster> c = StartCluster();
  ASSERT_NE(c, nullptr);
  std::unique_ptr<Client> client = Connect(*c);
  const std::string prompt = "def fibonacci(n):";
  constexpr int kTokens = 24;
  std::map<Speculation, Completion> by_mode;
  for (Speculation s : {Speculation::kOff, Speculation::kDraftModel, Speculation::kNgram}) {
    absl::StatusOr<Completion> r = client->Generate(Greedy(prompt, kTokens, s));
    ASSERT_TRUE(r.ok()) << SpeculationName(s) << ": " << r.status();
    EXPECT_EQ(r->token_ids.size(), static_cast<size_t>(kTokens));
    EXPECT_EQ(r->finish_reason, FinishReason::kLength);
    EXPECT_EQ(r->usage.completion_tokens, static_cast<uint32_t>(kTokens));
    EXPECT_GT(r->usage.prompt_tokens, 0u);
    EXPECT_EQ(r->speculation.mode, s);
    by_mode[s] = *std::move(r);
  }
  // Lossless: the same tokens and text whatever drafted them.
  const Completion& off = by_mode[Speculation::kOff];
  EXPECT_EQ(by_mode[Speculation::kDraftModel].token_ids, off.token_ids);
  EXPECT_EQ(by_mode[Speculation::kDraftModel].text, off.text);
  EXPECT_EQ(by_mode[Speculation::kNgram].token_ids, off.token_ids);
  EXPECT_EQ(off.speculation.steps, 0u);
  EXPECT_EQ(off.speculation.target_only_steps, static_cast<uint64_t>(kTokens));
  EXPECT_FALSE(off.speculation.acceptance_rate().has_value());
  const SpeculationStats& draft = by_mode[Speculation::kDraftModel].speculation;
  EXPECT_GT(draft.steps, 0u);
  ASSERT_TRUE(draft.acceptance_rate().has_value());
  EXPECT_DOUBLE_EQ(*draft.acceptance_rate(),
                   static_cast<double>(draft.accepted_tokens) / draft.draft_tokens);
  EXPECT_DOUBLE_EQ(*draft.mean_accepted_length(),
                   1.0 + static_cast<double>(draft.accepted_tokens) / draft.steps);

  // The SDK's Completion is what the raw gRPC stream carries, joined.
  auto stub = v1::Generation::NewStub(c->router->channel());
  grpc::ClientContext ctx;
  v1::GenerateRequest raw;
  raw.set_prompt(prompt);
  raw.set_max_new_tokens(kTokens);
  raw.set_ignore_eos(true);
  raw.set_speculation(v1::SPECULATION_OFF);
  auto reader = stub->Generate(&ctx, raw);
  v1::GenerateResponse chunk, last;
  std::vector<int32_t> tokens;
  std::string text;
  while (reader->Read(&chunk)) {
    tokens.insert(tokens.end(), chunk.token_ids().begin(), chunk.token_ids().end());
    text += chunk.text();
    if (chunk.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) last = chunk;
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(off.token_ids, tokens);
  EXPECT_EQ(off.text, text);
  EXPECT_EQ(off.usage.prompt_tokens, last.usage().prompt_tokens());
  EXPECT_EQ(off.speculation.target_only_steps, last.speculation().target_only_steps());
}

TEST(CppSdkTest, CallbackAndIteratorStreamWhatGenerateReturns) {
  std::unique_ptr<CpuCluster> c = StartCluster();
  ASSERT_NE(c, nullptr);
  std::unique_ptr<Client> client = Connect(*c);
  const GenerateRequest request = Greedy("class Stack:\n    def", 40, Speculation::kDraftModel);
  const absl::StatusOr<Completion> whole = client->Generate(request);
  ASSERT_TRUE(whole.ok()) << whole.status();

  std::vector<Chunk> by_callback;
  const absl::StatusOr<Completion> joined = client->Generate(request, [&](const Chunk& chunk) {
    by_callback.push_back(chunk);
    return true;
  });
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(joined->token_ids, whole->token_ids);
  EXPECT_EQ(joined->text, whole->text);

  std::vector<Chunk> by_iterator;
  std::unique_ptr<GenerateStream> stream = client->Stream(request);
  Chunk chunk;
  while (stream->Next(&chunk)) by_iterator.push_back(chunk);
  ASSERT_OK(stream->status());
  EXPECT_FALSE(stream->Next(&chunk));

  for (const std::vector<Chunk>* chunks : {&by_callback, &by_iterator}) {
    ASSERT_GT(chunks->size(), 1u) << "speculative steps stream several chunks";
    CompletionBuilder builder;
    for (size_t i = 0; i < chunks->size(); ++i) {
      EXPECT_EQ((*chunks)[i].last(), i + 1 == chunks->size()) << i;
      builder.Add((*chunks)[i]);
    }
    absl::StatusOr<Completion> built = std::move(builder).Finish();
    ASSERT_TRUE(built.ok());
    EXPECT_EQ(built->token_ids, whole->token_ids);
    EXPECT_EQ(built->text, whole->text);
    EXPECT_EQ(built->finish_reason, FinishReason::kLength);
    EXPECT_EQ(built->usage.completion_tokens, 40u);
  }
}

TEST(CppSdkTest, CancellingMidStreamFreesTheSequence) {
  std::unique_ptr<CpuCluster> c = StartCluster();
  ASSERT_NE(c, nullptr);
  std::unique_ptr<Client> client = Connect(*c);
  // Iterator: Cancel() from another thread while Next() waits.
  std::unique_ptr<GenerateStream> stream =
      client->Stream(Greedy("def main():", 3000, Speculation::kDraftModel));
  Chunk chunk;
  ASSERT_TRUE(stream->Next(&chunk));
  EXPECT_EQ(CpuCluster::Metric(c->verify_metrics, "specd_sequences"), 1);
  EXPECT_EQ(CpuCluster::Metric(c->draft_metrics, "specd_sequences"), 1);
  std::thread canceller([&] { stream->Cancel(); });
  size_t tokens = chunk.token_ids.size();
  while (stream->Next(&chunk)) tokens += chunk.token_ids.size();
  canceller.join();
  EXPECT_EQ(stream->status().code(), StatusCode::kCancelled);
  EXPECT_LT(tokens, 3000u);
  ExpectFreed(*c, "cancelled", 1);
  EXPECT_TRUE(CpuCluster::WaitForMetric(c->verify_metrics, "specd_sequences_freed_total",
                                        {{"reason", "cancelled"}}, 1)
                  .ok());

  // Callback: returning false cancels.
  int chunks = 0;
  const absl::StatusOr<Completion> r =
      client->Generate(Greedy("import os", 3000, Speculation::kDraftModel),
                       [&](const Chunk&) { return ++chunks < 3; });
  EXPECT_EQ(r.status().code(), StatusCode::kCancelled);
  EXPECT_EQ(chunks, 3);
  ExpectFreed(*c, "cancelled", 2);

  // Dropping a stream mid-way cancels it too.
  stream = client->Stream(Greedy("while True:\n", 3000, Speculation::kDraftModel));
  ASSERT_TRUE(stream->Next(&chunk));
  stream.reset();
  ExpectFreed(*c, "cancelled", 3);
}

TEST(CppSdkTest, DeadlineMidStreamIsDeadlineExceededAndFrees) {
  std::unique_ptr<CpuCluster> c = StartCluster();
  ASSERT_NE(c, nullptr);
  std::unique_ptr<Client> client = Connect(*c);
  CallOptions call;
  call.timeout = absl::Milliseconds(400);
  size_t tokens = 0;
  const absl::StatusOr<Completion> r = client->Generate(
      Greedy("import os", 3000, Speculation::kDraftModel),
      [&](const Chunk& chunk) {
        tokens += chunk.token_ids.size();
        return true;
      },
      call);
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_GT(tokens, 0u) << "the deadline should pass mid-stream";
  EXPECT_LT(tokens, 3000u);
  ExpectFreed(*c, "deadline_exceeded", 1);
}

TEST(CppSdkTest, InvalidArgumentNamesTheFieldAndIsNotRetried) {
  std::unique_ptr<CpuCluster> c = StartCluster({/*draft=*/false, {}});
  ASSERT_NE(c, nullptr);
  std::unique_ptr<Client> client = Connect(*c);
  struct Case {
    std::string field;
    std::function<void(GenerateRequest*)> mutate;
  };
  const std::vector<Case> cases = {
      {"temperature", [](GenerateRequest* r) { r->temperature = -1; }},
      {"top_p", [](GenerateRequest* r) { r->top_p = 0; }},
      {"top_k", [](GenerateRequest* r) { r->top_k = -3; }},
      {"max_new_tokens", [](GenerateRequest* r) { r->max_new_tokens = 4001; }},
      {"prompt_ids.ids[1]",
       [](GenerateRequest* r) {
         r->prompt.clear();
         r->prompt_ids = {5, kCpuClusterVocabSize};
       }},
      {"stop[0]", [](GenerateRequest* r) { r->stop = {""}; }},
      {"draft_max_nodes", [](GenerateRequest* r) { r->draft_max_nodes = 257; }},
  };
  for (const Case& k : cases) {
    GenerateRequest r = Greedy("def f(x):", 8, Speculation::kAuto);
    k.mutate(&r);
    const absl::StatusOr<Completion> res = client->Generate(r);
    EXPECT_EQ(res.status().code(), StatusCode::kInvalidArgument) << k.field << ": " << res.status();
    EXPECT_TRUE(absl::StartsWith(res.status().message(), k.field + ":"))
        << "want the message to start with '" << k.field << ":', got: " << res.status();
  }
  const absl::StatusOr<std::string> text = client->Detokenize(std::vector<int32_t>{1, 100000});
  EXPECT_EQ(text.status().code(), StatusCode::kInvalidArgument) << text.status();
  // One router request per case: none was retried.
  EXPECT_EQ(RouterMetric(*c, "specd_requests_total", {{"outcome", "invalid_argument"}}),
            cases.size());
}

TEST(CppSdkTest, ResourceExhaustedIsRetriedUntilTheRequestGetsIn) {
  std::unique_ptr<CpuCluster> c =
      StartCluster({/*draft=*/false, {"--max_batch=1", "--max_queue=1"}});
  ASSERT_NE(c, nullptr);
  std::unique_ptr<Client> client = Connect(*c);
  // One long request runs, a second waits: the queue is full.
  std::unique_ptr<GenerateStream> running = client->Stream(Greedy("a", 3000, Speculation::kOff));
  Chunk chunk;
  ASSERT_TRUE(running->Next(&chunk));
  absl::StatusOr<Completion> waiting;
  std::thread waiter([&] { waiting = client->Generate(Greedy("b", 5, Speculation::kOff)); });
  ASSERT_OK(CpuCluster::WaitForMetric(c->router_metrics, "specd_requests_waiting", {}, 1));

  // Without retries the refusal comes straight back.
  RetryPolicy none;
  none.max_attempts = 1;
  const absl::StatusOr<Completion> refused =
      Connect(*c, none)->Generate(Greedy("c", 8, Speculation::kOff));
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "queue is full"));

  // With retries the request comes back until a place is free.
  RetryPolicy patient;
  patient.max_attempts = 1000;
  patient.initial_backoff = absl::Milliseconds(20);
  patient.max_backoff = absl::Milliseconds(100);
  std::unique_ptr<Client> retrying = Connect(*c, patient);
  absl::StatusOr<Completion> retried;
  std::thread retrier([&] { retried = retrying->Generate(Greedy("c", 8, Speculation::kOff)); });
  // Refused twice more at least: it did come back.
  const absl::Time end = absl::Now() + absl::Seconds(20);
  while (RouterMetric(*c, "specd_requests_total", {{"outcome", "resource_exhausted"}}) < 3 &&
         absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_GE(RouterMetric(*c, "specd_requests_total", {{"outcome", "resource_exhausted"}}), 3);
  running->Cancel();
  waiter.join();
  retrier.join();
  ASSERT_TRUE(waiting.ok()) << waiting.status();
  ASSERT_TRUE(retried.ok()) << retried.status();
  EXPECT_EQ(retried->token_ids.size(), 8u);
  const absl::StatusOr<Completion> again = client->Generate(Greedy("c", 8, Speculation::kOff));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(retried->token_ids, again->token_ids);
}

TEST(CppSdkTest, AStreamThatFailsAfterAChunkIsNotRetried) {
  std::unique_ptr<CpuCluster> c = StartCluster({/*draft=*/false, {}});
  ASSERT_NE(c, nullptr);
  RetryPolicy retry;
  retry.max_attempts = 3;
  retry.initial_backoff = absl::Milliseconds(20);
  retry.max_backoff = absl::Milliseconds(40);
  std::unique_ptr<Client> client = Connect(*c, retry);
  bool killed = false;
  const absl::StatusOr<Completion> r =
      client->Generate(Greedy("y", 3000, Speculation::kOff), [&](const Chunk&) {
        if (!killed) {
          killed = true;
          ::kill(c->verify->pid(), SIGKILL);
        }
        return true;
      });
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "verify")) << r.status();
  // The router ended that request once ("error" counts UNAVAILABLE): no second attempt.
  ASSERT_OK(CpuCluster::WaitForMetric(c->router_metrics, "specd_requests_total",
                                      {{"outcome", "error"}}, 1));
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(RouterMetric(*c, "specd_requests_total", {{"outcome", "error"}}), 1);

  // Refused before any chunk, a new request is tried max_attempts times.
  const absl::StatusOr<Completion> refused = client->Generate(Greedy("x", 8, Speculation::kOff));
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(RouterMetric(*c, "specd_requests_total", {{"outcome", "error"}}), 1 + 3);
}

TEST(CppSdkTest, TokenizeDetokenizeAndModelInfo) {
  std::unique_ptr<CpuCluster> c = StartCluster();
  ASSERT_NE(c, nullptr);
  std::unique_ptr<Client> client = Connect(*c);
  const absl::StatusOr<std::vector<int32_t>> ids = client->Tokenize("héllo");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(ids->size(), 6u);  // byte-level: é is two bytes
  const absl::StatusOr<std::string> text = client->Detokenize(*ids);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, "héllo");
  const absl::StatusOr<ModelInfo> info = client->GetModelInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->target_model, "target");
  EXPECT_EQ(info->vocab_size, static_cast<uint32_t>(kCpuClusterVocabSize));
  EXPECT_EQ(info->max_context, static_cast<uint32_t>(kCpuClusterMaxContext));
  // The CPU verify backend serves logprobs and the logits processors (VerifyInfo, passed on).
  EXPECT_TRUE(info->supports_logprobs);
  EXPECT_TRUE(info->supports_logits_processors);
  EXPECT_EQ(info->max_new_tokens_limit, static_cast<uint32_t>(kCpuClusterMaxNewTokensLimit));
  EXPECT_EQ(info->eos_token_ids, std::vector<int32_t>{kCpuClusterEosId});
  EXPECT_TRUE(info->draft_available);
  // The random model's folder has no chat template; the draft service has a draft model.
  EXPECT_FALSE(info->has_chat_template);
  EXPECT_EQ(info->chat_template_source, "");
  EXPECT_EQ(info->speculation_modes,
            (std::vector<Speculation>{Speculation::kAuto, Speculation::kOff,
                                      Speculation::kDraftModel, Speculation::kNgram}));

  // specd-cli info prints the same, as JSON.
  const std::string cmd =
      absl::StrCat(SpecdBinary("specd-cli"), " info --server ", c->router_address);
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  ASSERT_EQ(pclose(p), 0) << out;
  const nlohmann::json j = nlohmann::json::parse(out, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(j.is_object()) << out;
  EXPECT_EQ(j["max_context"], kCpuClusterMaxContext);
  EXPECT_EQ(j["has_chat_template"], false);
  EXPECT_EQ(j["chat_template_source"], "");
  EXPECT_EQ(j["speculation_modes"], nlohmann::json({"auto", "off", "draft_model", "ngram"}));
}

// The sampling fields and logprobs round-trip through the SDK as through the raw stream; n > 1
// comes back through Stream() tagged by index; specd-cli --json prints the logprobs.
TEST(CppSdkTest, SamplingFieldsLogprobsAndSamplesRoundTrip) {
  std::unique_ptr<CpuCluster> c = StartCluster();
  ASSERT_NE(c, nullptr);
  std::unique_ptr<Client> client = Connect(*c);
  GenerateRequest request = Greedy("def parse(line):", 24, Speculation::kDraftModel);
  request.logprobs = 2;
  request.repetition_penalty = 1.25f;
  request.frequency_penalty = 0.5f;
  request.logit_bias = {{101, 4.0f}};
  request.min_tokens = 4;
  const absl::StatusOr<Completion> sdk = client->Generate(request);
  ASSERT_TRUE(sdk.ok()) << sdk.status();

  // The same request on the raw stream, target-only.
  auto stub = v1::Generation::NewStub(
      grpc::CreateChannel(c->router_address, grpc::InsecureChannelCredentials()));
  v1::GenerateRequest raw;
  raw.set_prompt(request.prompt);
  raw.set_max_new_tokens(24);
  raw.set_ignore_eos(true);
  raw.set_speculation(v1::SPECULATION_OFF);
  raw.set_logprobs(2);
  raw.set_repetition_penalty(1.25f);
  raw.set_frequency_penalty(0.5f);
  (*raw.mutable_logit_bias())[101] = 4.0f;
  raw.set_min_tokens(4);
  grpc::ClientContext ctx;
  auto reader = stub->Generate(&ctx, raw);
  std::vector<int32_t> ids;
  std::vector<v1::TokenLogprob> lps;
  v1::GenerateResponse chunk;
  while (reader->Read(&chunk)) {
    ids.insert(ids.end(), chunk.token_ids().begin(), chunk.token_ids().end());
    lps.insert(lps.end(), chunk.logprobs().begin(), chunk.logprobs().end());
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(sdk->token_ids, ids);
  ASSERT_EQ(sdk->logprobs.size(), lps.size());
  ASSERT_EQ(sdk->logprobs.size(), sdk->token_ids.size());
  for (size_t i = 0; i < lps.size(); ++i) {
    EXPECT_EQ(sdk->logprobs[i].token_id, lps[i].token_id());
    EXPECT_EQ(sdk->logprobs[i].token, lps[i].token());
    EXPECT_NEAR(sdk->logprobs[i].logprob, lps[i].logprob(), 1e-4);
    ASSERT_EQ(sdk->logprobs[i].top.size(), 2u);
    EXPECT_EQ(sdk->logprobs[i].top[0].token_id, lps[i].top_logprobs(0).token_id());
  }

  GenerateRequest samples = Greedy("import sys", 8, Speculation::kAuto);
  samples.temperature = 1.0f;
  samples.seed = 5;
  samples.n = 2;
  EXPECT_EQ(client->Generate(samples).status().code(), StatusCode::kInvalidArgument);
  std::unique_ptr<GenerateStream> stream = client->Stream(samples);
  Chunk piece;
  std::map<uint32_t, CompletionBuilder> by_index;
  while (stream->Next(&piece)) by_index[piece.index].Add(piece);
  ASSERT_OK(stream->status());
  ASSERT_EQ(by_index.size(), 2u);
  for (uint32_t i = 0; i < 2; ++i) {
    absl::StatusOr<Completion> got = std::move(by_index[i]).Finish();
    ASSERT_TRUE(got.ok()) << got.status();
    GenerateRequest one = samples;
    one.n = 1;
    one.seed = 5 + i;
    const absl::StatusOr<Completion> want = client->Generate(one);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(got->token_ids, want->token_ids) << "sample " << i;
  }

  const std::string cmd =
      absl::StrCat(SpecdBinary("specd-cli"), " generate --server ", c->router_address,
                   " --prompt 'def parse(line):' --max-new-tokens 24"
                   " --ignore-eos --speculation off --logprobs 2"
                   " --repetition-penalty 1.25 --frequency-penalty 0.5"
                   " --logit-bias 101=4 --min-tokens 4 --json");
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  ASSERT_EQ(pclose(p), 0) << out;
  std::vector<int32_t> cli_ids;
  std::vector<float> cli_logprobs;
  for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("logprobs")) continue;
    for (const auto& id : j["token_ids"]) cli_ids.push_back(id.get<int32_t>());
    for (const auto& lp : j["logprobs"]) {
      cli_logprobs.push_back(lp["logprob"].get<float>());
      EXPECT_EQ(lp["top"].size(), 2u);
    }
  }
  EXPECT_EQ(cli_ids, ids);
  ASSERT_EQ(cli_logprobs.size(), lps.size());
  for (size_t i = 0; i < lps.size(); ++i) EXPECT_NEAR(cli_logprobs[i], lps[i].logprob(), 1e-4);
}

}  // namespace
}  // namespace specd
