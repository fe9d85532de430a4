// The C++ SDK's call semantics that need faults on cue: retries (UNAVAILABLE and
// RESOURCE_EXHAUSTED, only before the first chunk, with growing backoff, within the deadline),
// cancellation, metadata and tokens, option checks. The SDK talks over a real socket to an
// in-process server whose answers each test scripts (ScriptedGenerationServer); what the
// real router does with the SDK is in cpp_sdk_test.cc.
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "specd/client.h"
#include "tests/testutil/random_checkpoint.h"
#include "tests/testutil/scripted_generation_server.h"
#include "tests/testutil/service_process.h"

namespace specd {
namespace {

using absl::StatusCode;

std::unique_ptr<ScriptedGenerationServer> StartServer() {
  absl::StatusOr<std::unique_ptr<ScriptedGenerationServer>> s = ScriptedGenerationServer::Start();
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

// Short, deterministic backoff so that the tests run quickly.
RetryPolicy QuickRetry(int max_attempts = 3) {
  RetryPolicy r;
  r.max_attempts = max_attempts;
  r.initial_backoff = absl::Milliseconds(20);
  r.max_backoff = absl::Milliseconds(100);
  r.jitter = 0;
  return r;
}

std::unique_ptr<Client> Connect(const std::string& address, RetryPolicy retry = QuickRetry()) {
  ClientOptions options;
  options.target = address;
  options.retry = retry;
  absl::StatusOr<std::unique_ptr<Client>> c = Client::Create(options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

GenerateRequest Request(const std::string& prompt) {
  GenerateRequest r;
  r.prompt = prompt;
  r.max_new_tokens = 3;
  return r;
}

ScriptedAnswer Fail(StatusCode code, const std::string& message, int chunks = 0) {
  ScriptedAnswer a;
  a.code = code;
  a.message = message;
  a.chunks = chunks;
  return a;
}

ScriptedAnswer Slow(int chunks, absl::Duration interval) {
  ScriptedAnswer a;
  a.chunks = chunks;
  a.chunk_interval = interval;
  return a;
}

TEST(CppSdkRetryTest, GenerateRetriesUnavailableBeforeTheFirstChunk) {
  auto server = StartServer();
  auto client = Connect(server->address());
  server->Script({Fail(StatusCode::kUnavailable, "down"), Fail(StatusCode::kUnavailable, "down")});
  const absl::StatusOr<Completion> c = client->Generate(Request("hi"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(server->received().size(), 3u);
  // What the third call streamed, joined, with the last chunk's stats.
  EXPECT_EQ(c->text, "1 2 3 ");
  EXPECT_EQ(c->token_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(c->finish_reason, FinishReason::kLength);
  EXPECT_EQ(c->usage.prompt_tokens, 2u);
  EXPECT_EQ(c->usage.completion_tokens, 3u);
  EXPECT_EQ(c->speculation.steps, 2u);
  EXPECT_EQ(c->speculation.accepted_per_position, (std::vector<uint64_t>{2, 4}));
  EXPECT_EQ(c->speculation.acceptance_rate(), 0.75);
  EXPECT_EQ(c->speculation.mean_accepted_length(), 4.0);
  EXPECT_EQ(c->speculation.mode, Speculation::kDraftModel);
  // Every attempt carried the same request.
  for (const ReceivedCall& r : server->received()) EXPECT_EQ(r.request.prompt(), "hi");
}

TEST(CppSdkRetryTest, GivesUpAfterMaxAttempts) {
  auto server = StartServer();
  auto client = Connect(server->address(), QuickRetry(3));
  server->Script(std::vector<ScriptedAnswer>(5, Fail(StatusCode::kUnavailable, "still down")));
  const absl::StatusOr<Completion> c = client->Generate(Request("hi"));
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(c.status().message(), "still down");
  EXPECT_EQ(server->received().size(), 3u);

  // max_attempts = 1: no retries at all.
  auto once = Connect(server->address(), QuickRetry(1));
  EXPECT_EQ(once->Generate(Request("hi")).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(server->received().size(), 4u);
}

TEST(CppSdkRetryTest, ResourceExhaustedIsRetriedAfterAGrowingBackoff) {
  auto server = StartServer();
  RetryPolicy retry = QuickRetry(5);
  retry.initial_backoff = absl::Milliseconds(100);
  retry.max_backoff = absl::Milliseconds(250);
  retry.multiplier = 2;
  retry.jitter = 0.2;
  auto client = Connect(server->address(), retry);
  server->Script({Fail(StatusCode::kResourceExhausted, "queue full"),
                  Fail(StatusCode::kResourceExhausted, "queue full"),
                  Fail(StatusCode::kResourceExhausted, "queue full")});
  const absl::StatusOr<Completion> c = client->Generate(Request("hi"));
  ASSERT_TRUE(c.ok()) << c.status();
  const std::vector<ReceivedCall> calls = server->received();
  ASSERT_EQ(calls.size(), 4u);
  // Waits of 100, 200 and 250 (capped) ms, each at least 80% of that with the jitter.
  EXPECT_GE(calls[1].at - calls[0].at, absl::Milliseconds(80));
  EXPECT_GE(calls[2].at - calls[1].at, absl::Milliseconds(160));
  EXPECT_GE(calls[3].at - calls[2].at, absl::Milliseconds(200));

  // Left out of the retryable codes, it is not retried.
  retry.retryable_codes = {StatusCode::kUnavailable};
  auto strict = Connect(server->address(), retry);
  server->Script({Fail(StatusCode::kResourceExhausted, "queue full")});
  EXPECT_EQ(strict->Generate(Request("hi")).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(server->received().size(), 5u);
}

TEST(CppSdkRetryTest, NeverRetriedOnceAChunkArrived) {
  auto server = StartServer();
  auto client = Connect(server->address(), QuickRetry(5));
  // Callback style.
  server->Script({Fail(StatusCode::kUnavailable, "lost the verify service", 1)});
  std::vector<Chunk> seen;
  const absl::StatusOr<Completion> c = client->Generate(Request("hi"), [&](const Chunk& chunk) {
    seen.push_back(chunk);
    return true;
  });
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(c.status().message(), "lost the verify service");
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].text, "1 ");
  EXPECT_FALSE(seen[0].last());
  EXPECT_EQ(server->received().size(), 1u);

  // Iterator style.
  server->Script({Fail(StatusCode::kResourceExhausted, "late", 2)});
  std::unique_ptr<GenerateStream> stream = client->Stream(Request("hi"));
  Chunk chunk;
  int chunks = 0;
  while (stream->Next(&chunk)) ++chunks;
  EXPECT_EQ(chunks, 2);
  EXPECT_EQ(stream->status().code(), StatusCode::kResourceExhausted);
  EXPECT_FALSE(stream->Next(&chunk));  // stays ended
  EXPECT_EQ(server->received().size(), 2u);
}

TEST(CppSdkRetryTest, OtherErrorsAreReturnedAsTheyCameWithoutRetry) {
  auto server = StartServer();
  auto client = Connect(server->address(), QuickRetry(5));
  size_t calls = 0;
  for (StatusCode code :
       {StatusCode::kInvalidArgument, StatusCode::kInternal, StatusCode::kPermissionDenied,
        StatusCode::kUnauthenticated, StatusCode::kFailedPrecondition}) {
    server->Script({Fail(code, "temperature: must be a finite number >= 0, got -1")});
    const absl::StatusOr<Completion> c = client->Generate(Request("hi"));
    EXPECT_EQ(c.status().code(), code);
    EXPECT_EQ(c.status().message(), "temperature: must be a finite number >= 0, got -1");
    EXPECT_EQ(server->received().size(), ++calls) << absl::StatusCodeToString(code);
  }
}

TEST(CppSdkRetryTest, UnaryCallsRetryToo) {
  auto server = StartServer();
  auto client = Connect(server->address());
  server->Script({Fail(StatusCode::kUnavailable, "x"), Fail(StatusCode::kResourceExhausted, "y")});
  const absl::StatusOr<std::vector<int32_t>> ids = client->Tokenize("AB");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, (std::vector<int32_t>{65, 66}));
  EXPECT_EQ(server->received().size(), 3u);
  server->Script({Fail(StatusCode::kUnavailable, "x")});
  const absl::StatusOr<std::string> text = client->Detokenize(std::vector<int32_t>{104, 105});
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, "hi");
  server->Script({Fail(StatusCode::kUnavailable, "x")});
  const absl::StatusOr<ModelInfo> info = client->GetModelInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->target_model, "scripted-target");
  EXPECT_EQ(info->draft_model, "scripted-draft");
  EXPECT_EQ(info->vocab_size, 256u);
  EXPECT_EQ(info->max_context, 1024u);
  EXPECT_EQ(info->eos_token_ids, std::vector<int32_t>{0});
  EXPECT_EQ(info->max_new_tokens_limit, 512u);
  EXPECT_TRUE(info->draft_available);
  EXPECT_EQ(server->received().size(), 7u);
  server->Script({Fail(StatusCode::kInvalidArgument, "ids[0]: out of range")});
  EXPECT_EQ(client->Detokenize(std::vector<int32_t>{-1}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(server->received().size(), 8u);
}

TEST(CppSdkRetryTest, TheDeadlineCoversTheRetries) {
  auto server = StartServer();
  RetryPolicy retry = QuickRetry(100);
  retry.initial_backoff = retry.max_backoff = absl::Milliseconds(50);
  auto client = Connect(server->address(), retry);
  server->Script(std::vector<ScriptedAnswer>(100, Fail(StatusCode::kUnavailable, "down")));
  CallOptions call;
  call.timeout = absl::Milliseconds(300);
  const absl::Time start = absl::Now();
  const absl::StatusOr<Completion> c = client->Generate(Request("hi"), call);
  // The last error, once the next wait would pass the deadline.
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(1500));
  EXPECT_GE(server->received().size(), 3u);
  EXPECT_LE(server->received().size(), 7u);
}

TEST(CppSdkRetryTest, TheDeadlineTravelsWithTheCall) {
  auto server = StartServer();
  auto client = Connect(server->address());
  server->Script({Slow(20, absl::Milliseconds(100))});
  CallOptions call;
  call.timeout = absl::Milliseconds(350);
  int chunks = 0;
  const absl::StatusOr<Completion> c = client->Generate(
      Request("hi"), [&](const Chunk&) { return ++chunks > 0; }, call);
  EXPECT_EQ(c.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_GE(chunks, 1);
  EXPECT_LT(chunks, 20);
  // The server got the deadline (gRPC sends it as grpc-timeout) and not a retry.
  EXPECT_EQ(server->received().size(), 1u);

  // The client's default timeout, when the call sets none.
  ClientOptions options;
  options.target = server->address();
  options.default_timeout = absl::Milliseconds(350);
  absl::StatusOr<std::unique_ptr<Client>> bounded = Client::Create(options);
  ASSERT_TRUE(bounded.ok());
  server->Script({Slow(20, absl::Milliseconds(100))});
  EXPECT_EQ((*bounded)->Generate(Request("hi")).status().code(), StatusCode::kDeadlineExceeded);
}

TEST(CppSdkRetryTest, CancelFromAnotherThreadEndsTheStream) {
  auto server = StartServer();
  auto client = Connect(server->address());
  server->Script({Slow(1000, absl::Milliseconds(20))});
  std::unique_ptr<GenerateStream> stream = client->Stream(Request("hi"));
  Chunk chunk;
  ASSERT_TRUE(stream->Next(&chunk));
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(100));
    stream->Cancel();
  });
  int more = 0;
  while (stream->Next(&chunk)) ++more;
  canceller.join();
  EXPECT_LT(more, 100);
  EXPECT_EQ(stream->status().code(), StatusCode::kCancelled);
  // The server saw the cancellation.
  const absl::Time end = absl::Now() + absl::Seconds(5);
  while (server->cancelled() < 1 && absl::Now() < end) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(server->cancelled(), 1);
}

TEST(CppSdkRetryTest, CallbackReturningFalseAndDroppingAStreamCancel) {
  auto server = StartServer();
  auto client = Connect(server->address());
  server->Script({Slow(1000, absl::Milliseconds(10))});
  int chunks = 0;
  const absl::StatusOr<Completion> c =
      client->Generate(Request("hi"), [&](const Chunk&) { return ++chunks < 2; });
  EXPECT_EQ(c.status().code(), StatusCode::kCancelled);
  EXPECT_EQ(chunks, 2);

  server->Script({Slow(1000, absl::Milliseconds(10))});
  std::unique_ptr<GenerateStream> stream = client->Stream(Request("hi"));
  Chunk chunk;
  ASSERT_TRUE(stream->Next(&chunk));
  stream.reset();
  const absl::Time end = absl::Now() + absl::Seconds(5);
  while (server->cancelled() < 2 && absl::Now() < end) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(server->cancelled(), 2);
  EXPECT_EQ(server->received().size(), 2u);
}

TEST(CppSdkRetryTest, CancelDuringABackoffWaitEndsAtOnce) {
  auto server = StartServer();
  RetryPolicy retry = QuickRetry(5);
  retry.initial_backoff = retry.max_backoff = absl::Seconds(30);
  auto client = Connect(server->address(), retry);
  server->Script({Fail(StatusCode::kUnavailable, "down")});
  const absl::Time start = absl::Now();
  std::unique_ptr<GenerateStream> stream = client->Stream(Request("hi"));
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(200));
    stream->Cancel();
  });
  Chunk chunk;
  EXPECT_FALSE(stream->Next(&chunk));
  canceller.join();
  EXPECT_EQ(stream->status().code(), StatusCode::kCancelled);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(server->received().size(), 1u);
}

TEST(CppSdkRetryTest, ARouterThatComesUpIsReachedByARetry) {
  const int port = PickFreePort();
  RetryPolicy retry = QuickRetry(40);
  retry.initial_backoff = absl::Milliseconds(50);
  retry.max_backoff = absl::Milliseconds(200);
  auto client = Connect(absl::StrCat("127.0.0.1:", port), retry);
  // Nobody listens yet: retried, then UNAVAILABLE.
  auto quick = Connect(absl::StrCat("127.0.0.1:", port), QuickRetry(2));
  EXPECT_EQ(quick->GetModelInfo().status().code(), StatusCode::kUnavailable);

  std::unique_ptr<ScriptedGenerationServer> server;
  std::thread starter([&] {
    absl::SleepFor(absl::Milliseconds(700));
    absl::StatusOr<std::unique_ptr<ScriptedGenerationServer>> s =
        ScriptedGenerationServer::Start(nullptr, port);
    ASSERT_TRUE(s.ok()) << s.status();
    server = *std::move(s);
  });
  const absl::StatusOr<Completion> c = client->Generate(Request("hi"));
  starter.join();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->text, "1 2 3 ");
}

TEST(CppSdkRetryTest, MetadataAndTheBearerTokenGoWithEveryCall) {
  auto server = StartServer();
  ClientOptions options;
  options.target = server->address();
  options.bearer_token = "s3cret-token";
  options.metadata = {{"x-team", "search"}};
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
  ASSERT_TRUE(client.ok()) << client.status();
  CallOptions call;
  call.metadata = {{"x-request", "42"}};
  ASSERT_TRUE((*client)->Generate(Request("hi"), call).ok());
  ASSERT_TRUE((*client)->GetModelInfo().ok());
  const std::vector<ReceivedCall> calls = server->received();
  ASSERT_EQ(calls.size(), 2u);
  for (const ReceivedCall& r : calls) {
    ASSERT_EQ(r.metadata.count("authorization"), 1u);
    EXPECT_EQ(r.metadata.find("authorization")->second, "Bearer s3cret-token");
    EXPECT_EQ(r.metadata.find("x-team")->second, "search");
    EXPECT_TRUE(absl::StrContains(r.metadata.find("user-agent")->second, "specd-cpp"));
  }
  EXPECT_EQ(calls[0].metadata.find("x-request")->second, "42");
  EXPECT_EQ(calls[1].metadata.count("x-request"), 0u);
}

TEST(CppSdkRetryTest, TheTokenFileIsReadAgainWhenItChanges) {
  auto server = StartServer();
  const std::string dir = MakeTempDir("cpp_sdk_token");
  const std::string path = dir + "/token";
  auto write = [&](const std::string& token) {
    // As Kubernetes does: a new file renamed over the old one.
    std::ofstream(dir + "/next") << token << "\n";
    std::filesystem::rename(dir + "/next", path);
  };
  write("first");
  ClientOptions options;
  options.target = server->address();
  options.token_file = path;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->GetModelInfo().ok());
  write("second");
  ASSERT_TRUE((*client)->GetModelInfo().ok());
  const std::vector<ReceivedCall> calls = server->received();
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0].metadata.find("authorization")->second, "Bearer first");
  EXPECT_EQ(calls[1].metadata.find("authorization")->second, "Bearer second");

  std::filesystem::remove(path);
  const absl::StatusOr<ModelInfo> gone = (*client)->GetModelInfo();
  EXPECT_EQ(gone.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StartsWith(gone.status().message(), "token_file: cannot read"))
      << gone.status();
  EXPECT_EQ(server->received().size(), 2u);
  std::filesystem::remove_all(dir);
}

TEST(CppSdkRetryTest, BadOptionsAndRequestsNameTheField) {
  auto server = StartServer();
  struct Case {
    std::string field;
    std::function<void(ClientOptions*)> mutate;
  };
  const std::vector<Case> cases = {
      {"target", [](ClientOptions* o) { o->target = ""; }},
      {"token_file",
       [](ClientOptions* o) {
         o->bearer_token = "a";
         o->token_file = "/t";
       }},
      {"bearer_token", [](ClientOptions* o) { o->bearer_token = "two words"; }},
      {"retry.max_attempts", [](ClientOptions* o) { o->retry.max_attempts = 0; }},
      {"retry.multiplier", [](ClientOptions* o) { o->retry.multiplier = 0.5; }},
      {"retry.jitter", [](ClientOptions* o) { o->retry.jitter = 1.5; }},
      {"retry.max_backoff", [](ClientOptions* o) { o->retry.max_backoff = absl::Milliseconds(1); }},
      {"default_timeout", [](ClientOptions* o) { o->default_timeout = absl::ZeroDuration(); }},
      {"tls.private_key_pem",
       [](ClientOptions* o) {
         o->tls = TlsOptions{"", "-----BEGIN CERTIFICATE-----", "", ""};
       }},
      {"metadata",
       [](ClientOptions* o) {
         o->metadata = {{"X-Upper", "v"}};
       }},
      {"metadata",
       [](ClientOptions* o) {
         o->metadata = {{"x-newline", "a\nb"}};
       }},
  };
  for (const Case& k : cases) {
    ClientOptions options;
    options.target = server->address();
    k.mutate(&options);
    const absl::StatusOr<std::unique_ptr<Client>> c = Client::Create(options);
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << k.field;
    EXPECT_TRUE(absl::StartsWith(c.status().message(), k.field + ":"))
        << k.field << ": " << c.status();
  }
  ClientOptions missing_token;
  missing_token.target = server->address();
  missing_token.token_file = "/nonexistent/token";
  EXPECT_EQ(Client::Create(missing_token).status().code(), StatusCode::kFailedPrecondition);
  const absl::StatusOr<TlsOptions> tls = TlsOptions::FromFiles("/nonexistent/ca.pem", "", "");
  EXPECT_EQ(tls.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(tls.status().message(), "root_ca: cannot read /nonexistent"));

  // Errors the client finds in a call never reach the server.
  auto client = Connect(server->address());
  GenerateRequest both = Request("hi");
  both.prompt_ids = {1, 2};
  const absl::StatusOr<Completion> c = client->Generate(both);
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(c.status().message(), "prompt_ids:")) << c.status();
  CallOptions bad;
  bad.metadata = {{"Bad Key", "v"}};
  const absl::StatusOr<ModelInfo> info = client->GetModelInfo(bad);
  EXPECT_EQ(info.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(info.status().message(), "CallOptions.metadata:"));
  std::unique_ptr<GenerateStream> stream = client->Stream(Request("hi"), bad);
  Chunk chunk;
  EXPECT_FALSE(stream->Next(&chunk));
  EXPECT_EQ(stream->status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(server->received().size(), 0u);
}

}  // namespace
}  // namespace specd
