// The whole cluster as a user runs it: specd-verify, specd-draft and specd-router started as
// processes on loopback, spoken to over gRPC (and with the real specd-cli), checked through
// their /metrics. Models are small random checkpoints written by specd-make-test-model (a draft
// that is the target's first layer, so drafts are partly accepted).
//
// Each test starts its own cluster, so metric deltas belong to that test alone and ctest can run
// the tests in parallel.
#include <signal.h>
#include <stdio.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/text/tokenizer.h"
#include "engine/backend.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "specd/v1/generation.grpc.pb.h"
#include "tests/integration/router_cluster_fixture.h"
#include "tests/testutil/random_checkpoint.h"
#include "tests/testutil/service_process.h"

namespace specd {
namespace {

using namespace router_cluster;  // NOLINT: the fixture of this test family
using nlohmann::json;

TEST(RouterClusterTest, GreedyOutputIsIdenticalWithAndWithoutSpeculation) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  const std::vector<std::string> prompts = Prompts(22);
  const int kTokens = 24;
  std::vector<Result> off(prompts.size()), on(prompts.size()), ngram(prompts.size());
  // Four client threads, so requests are also batched with each other.
  std::vector<std::thread> threads;
  std::atomic<size_t> next{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (size_t i; (i = next++) < prompts.size();) {
        off[i] = c->Generate(Greedy(prompts[i], kTokens, v1::SPECULATION_OFF));
        on[i] = c->Generate(Greedy(prompts[i], kTokens, v1::SPECULATION_DRAFT_MODEL));
        ngram[i] = c->Generate(Greedy(prompts[i], kTokens, v1::SPECULATION_NGRAM));
      }
    });
  }
  for (auto& t : threads) t.join();
  uint64_t accepted = 0, drafted = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    SCOPED_TRACE(prompts[i]);
    ASSERT_TRUE(off[i].status.ok()) << off[i].status.error_message();
    ASSERT_TRUE(on[i].status.ok()) << on[i].status.error_message();
    ASSERT_TRUE(ngram[i].status.ok()) << ngram[i].status.error_message();
    EXPECT_EQ(off[i].tokens.size(), static_cast<size_t>(kTokens));
    EXPECT_EQ(on[i].tokens, off[i].tokens);
    EXPECT_EQ(on[i].text, off[i].text);
    EXPECT_EQ(ngram[i].tokens, off[i].tokens);
    EXPECT_EQ(off[i].last.finish_reason(), v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(off[i].last.speculation().steps(), 0u);
    EXPECT_EQ(off[i].last.speculation().mode(), v1::SPECULATION_OFF);
    EXPECT_EQ(ngram[i].last.speculation().mode(), v1::SPECULATION_NGRAM);
    // draft_model without a shape is the goodput policy's to shape, down to none for a
    // sequence where drafting does not pay (its mode then says off).
    if (on[i].last.speculation().steps() > 0) {
      EXPECT_EQ(on[i].last.speculation().mode(), v1::SPECULATION_DRAFT_MODEL);
      ++drafted;
    }
    accepted += on[i].last.speculation().accepted_tokens();
  }
  // The draft is the target's first layer: some requests must have been drafted and some
  // drafts accepted, or the test would not exercise multi-token steps at all.
  EXPECT_GT(drafted, 0u);
  EXPECT_GT(accepted, 0u);

  // Both equal the engine's own target-only greedy decoding, in this process.
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
      Tokenizer::FromModelDir(TestModels().target);
  ASSERT_TRUE(tokenizer.ok());
  BackendOptions bo;
  bo.num_threads = 1;
  absl::StatusOr<std::unique_ptr<Backend>> target = CreateBackend(TestModels().target, bo);
  ASSERT_TRUE(target.ok()) << target.status();
  for (size_t i = 0; i < 4; ++i) {
    const std::vector<int32_t> prompt = (*tokenizer)->Encode(prompts[i], true);
    EXPECT_EQ(EngineGreedy(target->get(), prompt, kTokens, static_cast<SeqId>(i + 1)),
              off[i].tokens)
        << prompts[i];
  }
}

TEST(RouterClusterTest, SeededSamplingIsIdenticalWithAndWithoutSpeculation) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  for (const std::string& prompt : Prompts(5)) {
    v1::GenerateRequest r = Greedy(prompt, 20, v1::SPECULATION_OFF);
    r.set_temperature(0.9f);
    r.set_top_p(0.95f);
    r.set_seed(42);
    const Result off = c->Generate(r);
    r.set_speculation(v1::SPECULATION_DRAFT_MODEL);
    const Result on = c->Generate(r);
    ASSERT_TRUE(off.status.ok() && on.status.ok());
    EXPECT_EQ(on.tokens, off.tokens) << prompt;
  }
}

TEST(RouterClusterTest, BadInputsAreInvalidArgumentNamingTheField) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  struct Case {
    std::string field;
    std::function<void(v1::GenerateRequest*)> mutate;
  };
  const std::vector<Case> cases = {
      {"prompt", [](v1::GenerateRequest* r) { r->set_prompt(""); }},
      {"temperature", [](v1::GenerateRequest* r) { r->set_temperature(-1); }},
      {"temperature", [](v1::GenerateRequest* r) { r->set_temperature(NAN); }},
      {"top_p", [](v1::GenerateRequest* r) { r->set_top_p(0); }},
      {"top_p", [](v1::GenerateRequest* r) { r->set_top_p(1.01f); }},
      {"top_k", [](v1::GenerateRequest* r) { r->set_top_k(-3); }},
      {"max_new_tokens", [](v1::GenerateRequest* r) { r->set_max_new_tokens(4001); }},
      {"prompt_ids.ids[1]",
       [](v1::GenerateRequest* r) {
         r->mutable_prompt_ids()->add_ids(5);
         r->mutable_prompt_ids()->add_ids(320);
       }},
      {"stop_token_ids[0]", [](v1::GenerateRequest* r) { r->add_stop_token_ids(-1); }},
      {"stop[0]", [](v1::GenerateRequest* r) { r->add_stop(""); }},
      {"prompt", [](v1::GenerateRequest* r) { r->set_prompt(std::string(kMaxContext, 'x')); }},
      {"draft_max_nodes", [](v1::GenerateRequest* r) { r->set_draft_max_nodes(257); }},
      {"speculation",
       [](v1::GenerateRequest* r) { r->set_speculation(static_cast<v1::Speculation>(42)); }},
      // Strings that are not UTF-8 fail protobuf parsing in the server; they used to get
      // UNIMPLEMENTED with no message.
      {"prompt", [](v1::GenerateRequest* r) { r->set_prompt("def \xff\xfe f"); }},
      {"stop[1]",
       [](v1::GenerateRequest* r) {
         r->add_stop("ok");
         r->add_stop("\xc3\x28");
       }},
      {"request_id", [](v1::GenerateRequest* r) { r->set_request_id(std::string(129, 'a')); }},
      {"request_id", [](v1::GenerateRequest* r) { r->set_request_id(std::string(1 << 20, '\n')); }},
  };
  for (const Case& k : cases) {
    v1::GenerateRequest r = Greedy("def f(x):", 8, v1::SPECULATION_AUTO);
    k.mutate(&r);
    const Result res = c->Generate(r);
    EXPECT_EQ(res.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << k.field << ": " << res.status.error_message();
    EXPECT_EQ(res.status.error_message().rfind(k.field + ":", 0), 0u)
        << "want the message to start with '" << k.field
        << ":', got: " << res.status.error_message();
  }
  EXPECT_EQ(
      Cluster::Metric(c->router_metrics, "specd_requests_total", {{"outcome", "invalid_argument"}}),
      cases.size());
  // Still serving.
  const Result ok = c->Generate(Greedy("def f(x):", 8, v1::SPECULATION_AUTO));
  EXPECT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_EQ(ok.tokens.size(), 8u);
  EXPECT_TRUE(c->verify->Running() && c->draft->Running() && c->router->Running());
}

TEST(RouterClusterTest, QueueBoundGivesResourceExhausted) {
  ClusterOptions o;
  o.router_args = {"--max_batch=1", "--max_queue=1"};
  std::unique_ptr<Cluster> c = Cluster::Start(o);
  ASSERT_NE(c, nullptr);
  // A long request runs, a second waits, a third finds the queue full.
  grpc::ClientContext first_ctx, second_ctx;
  Result first, second;
  std::thread t1([&] { first = c->Read(&first_ctx, Greedy("a", 3000, v1::SPECULATION_OFF)); });
  ASSERT_TRUE(c->WaitForMetric(c->router_metrics, "specd_requests_running", {}, 1));
  std::thread t2([&] { second = c->Read(&second_ctx, Greedy("b", 5, v1::SPECULATION_OFF)); });
  ASSERT_TRUE(c->WaitForMetric(c->router_metrics, "specd_requests_waiting", {}, 1));
  const Result third = c->Generate(Greedy("c", 5, v1::SPECULATION_OFF));
  EXPECT_EQ(third.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << third.status.error_message();
  first_ctx.TryCancel();
  t1.join();
  t2.join();
  EXPECT_EQ(first.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ(Cluster::Metric(c->router_metrics, "specd_requests_total",
                            {{"outcome", "resource_exhausted"}}),
            1);
}

TEST(RouterClusterTest, CancellationFreesTheSequenceInDraftAndVerify) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  grpc::ClientContext ctx;
  std::atomic<bool> streaming{false};
  Result r;
  std::thread t([&] {
    r = c->Read(&ctx, Greedy("def main():", 3000, v1::SPECULATION_DRAFT_MODEL),
                [&](int) { streaming = true; });
  });
  while (!streaming) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(Cluster::Metric(c->verify_metrics, "specd_sequences"), 1);
  EXPECT_EQ(Cluster::Metric(c->draft_metrics, "specd_sequences"), 1);
  ctx.TryCancel();
  t.join();
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_GT(r.tokens.size(), 0u);
  EXPECT_TRUE(c->WaitForMetric(c->verify_metrics, "specd_sequences", {}, 0));
  EXPECT_TRUE(c->WaitForMetric(c->draft_metrics, "specd_sequences", {}, 0));
  EXPECT_TRUE(c->WaitForMetric(c->verify_metrics, "specd_sequences_freed_total",
                               {{"reason", "cancelled"}}, 1));
  EXPECT_TRUE(c->WaitForMetric(c->draft_metrics, "specd_sequences_freed_total",
                               {{"reason", "cancelled"}}, 1));
  EXPECT_TRUE(
      c->WaitForMetric(c->router_metrics, "specd_requests_total", {{"outcome", "cancelled"}}, 1));
  EXPECT_EQ(Cluster::Metric(c->router_metrics, "specd_requests_running"), 0);
}

TEST(RouterClusterTest, DeadlineMidStreamIsDeadlineExceededAndFrees) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(400));
  const Result r = c->Read(&ctx, Greedy("import os", 3000, v1::SPECULATION_DRAFT_MODEL));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_GT(r.tokens.size(), 0u) << "the deadline should pass mid-stream";
  EXPECT_LT(r.tokens.size(), 3000u);
  EXPECT_TRUE(c->WaitForMetric(c->verify_metrics, "specd_sequences", {}, 0));
  EXPECT_TRUE(c->WaitForMetric(c->draft_metrics, "specd_sequences", {}, 0));
  EXPECT_TRUE(c->WaitForMetric(c->router_metrics, "specd_requests_total",
                               {{"outcome", "deadline_exceeded"}}, 1));
}

// A draft service told to stop (SIGTERM, as Kubernetes does) drains: the request it is
// drafting for keeps speculating to the end, a request that arrives meanwhile is refused by the
// draft and runs target-only, both outputs equal target-only decoding, and the draft process
// exits as soon as its last sequence is released.
TEST(RouterClusterTest, StoppedDraftServiceDrainsWhileTheClusterKeepsServing) {
  ClusterOptions options;
  options.draft_args = {"--shutdown_grace_ms=60000"};
  // Every step drafts (no policy), so that the running request shows it kept its drafts.
  options.router_args = {"--speculation_policy=fixed"};
  std::unique_ptr<Cluster> c = Cluster::Start(options);
  ASSERT_NE(c, nullptr);
  const int kTokens = 600;
  const Result reference = c->Generate(Greedy("class Node:", kTokens, v1::SPECULATION_OFF));
  ASSERT_TRUE(reference.status.ok());

  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  Result during;
  bool stopped = false;
  const Result r =
      c->Read(&ctx, Greedy("class Node:", kTokens, v1::SPECULATION_DRAFT_MODEL), [&](int) {
        if (stopped) return;
        stopped = true;
        ASSERT_EQ(::kill(c->draft->pid(), SIGTERM), 0);
        // Draining once its health says so; then a new request reaches it.
        const absl::Status draining = c->draft->WaitForHealth(
            grpc::health::v1::HealthCheckResponse::NOT_SERVING, absl::Seconds(10));
        ASSERT_TRUE(draining.ok()) << draining;
        during = c->Generate(Greedy("class Node:", 32, v1::SPECULATION_DRAFT_MODEL));
      });
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens, reference.tokens);
  // The running request kept its drafts: the draft service served it to the end. A step
  // without a tree is allowed only where a late pre-draft held the draft stream (overlap), and
  // as the last step, whose budget may leave nothing to draft once such plain steps have shifted
  // where the request ends.
  EXPECT_EQ(r.last.speculation().mode(), v1::SPECULATION_DRAFT_MODEL);
  EXPECT_LE(std::max(0, static_cast<int>(r.last.speculation().target_only_steps()) - 1),
            DraftBusySteps(c->router_metrics))
      << "target-only steps by reason: draft_unavailable "
      << Cluster::Metric(c->router_metrics, "specd_target_only_steps_total",
                         {{"reason", "draft_unavailable"}})
      << ", no_draft "
      << Cluster::Metric(c->router_metrics, "specd_target_only_steps_total",
                         {{"reason", "no_draft"}})
      << "; steps " << r.last.speculation().steps();
  EXPECT_GT(r.last.speculation().steps(), 0u);
  // The new one was refused by the draining draft service and ran target-only, unharmed.
  ASSERT_TRUE(during.status.ok()) << during.status.error_message();
  EXPECT_EQ(during.tokens,
            std::vector<int32_t>(reference.tokens.begin(), reference.tokens.begin() + 32));
  EXPECT_GT(during.last.speculation().target_only_steps(), 0u);
  // Its last sequence released, the draft service exits without waiting out its 60 s grace.
  absl::StatusOr<int> code = c->draft->WaitForExit(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  EXPECT_EQ(c->draft->Log().find("still running after"), std::string::npos) << c->draft->Log();
  // The cluster goes on target-only.
  const Result after = c->Generate(Greedy("class Node:", 16, v1::SPECULATION_AUTO));
  ASSERT_TRUE(after.status.ok());
  EXPECT_EQ(after.tokens,
            std::vector<int32_t>(reference.tokens.begin(), reference.tokens.begin() + 16));
}

TEST(RouterClusterTest, KilledDraftServiceFallsBackToTargetOnly) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  const int kTokens = 1500;
  const Result reference = c->Generate(Greedy("class Node:", kTokens, v1::SPECULATION_OFF));
  ASSERT_TRUE(reference.status.ok());
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  bool killed = false;
  const Result r =
      c->Read(&ctx, Greedy("class Node:", kTokens, v1::SPECULATION_DRAFT_MODEL), [&](int) {
        if (!killed) {
          killed = true;
          ::kill(c->draft->pid(), SIGKILL);
        }
      });
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens, reference.tokens);
  EXPECT_EQ(r.text, reference.text);
  // It really ran target-only after the kill (had it finished first, this would be 0).
  EXPECT_GT(Cluster::Metric(c->router_metrics, "specd_target_only_steps_total",
                            {{"reason", "draft_unavailable"}}),
            0);
  EXPECT_GT(r.last.speculation().target_only_steps(), 0u);
  EXPECT_EQ(Cluster::Metric(c->router_metrics, "specd_draft_available"), 0);
  // And keeps serving new requests.
  const Result after = c->Generate(Greedy("class Node:", 16, v1::SPECULATION_AUTO));
  ASSERT_TRUE(after.status.ok());
  EXPECT_EQ(after.tokens,
            std::vector<int32_t>(reference.tokens.begin(), reference.tokens.begin() + 16));
  // Without its draft service auto still has the router's n-gram drafter, where it pays.
  EXPECT_NE(after.last.speculation().mode(), v1::SPECULATION_DRAFT_MODEL);

  // A new draft process on the same address: the router reconnects and speculates again.
  c->draft.reset();
  absl::StatusOr<std::unique_ptr<ServiceProcess>> draft = ServiceProcess::Start(c->draft_options);
  ASSERT_TRUE(draft.ok()) << draft.status();
  c->draft = *std::move(draft);
  ASSERT_TRUE(c->WaitForMetric(c->router_metrics, "specd_draft_available", {}, 1));
  const Result again = c->Generate(Greedy("class Node:", 64, v1::SPECULATION_AUTO));
  ASSERT_TRUE(again.status.ok());
  EXPECT_EQ(again.tokens,
            std::vector<int32_t>(reference.tokens.begin(), reference.tokens.begin() + 64));
  EXPECT_EQ(again.last.speculation().mode(), v1::SPECULATION_DRAFT_MODEL);
  EXPECT_GT(again.last.speculation().steps(), 0u);
}

// Runs specd-cli and returns its stdout lines.
std::vector<std::string> RunCli(const std::string& args, int* exit_code) {
  const std::string cmd = SpecdBinary("specd-cli") + " " + args + " 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  *exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return absl::StrSplit(out, '\n', absl::SkipEmpty());
}

TEST(RouterClusterTest, RouterMetricsAgreeWithCliStats) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  const int port = c->router_metrics;
  const double steps0 = Cluster::Metric(port, "specd_spec_decode_steps_total");
  const double draft0 = Cluster::Metric(port, "specd_spec_decode_draft_tokens_total");
  const double acc0 = Cluster::Metric(port, "specd_spec_decode_accepted_tokens_total");
  const double gen0 = Cluster::Metric(port, "specd_generation_tokens_total");
  auto value_or_zero = [&](const std::string& name) {
    const double v = Cluster::Metric(port, name);
    return std::isnan(v) ? 0.0 : v;
  };
  const double prompt_n0 = value_or_zero("specd_request_prompt_tokens_count");
  const double prompt_sum0 = value_or_zero("specd_request_prompt_tokens_sum");
  const double gen_n0 = value_or_zero("specd_request_generation_tokens_count");
  const double gen_sum0 = value_or_zero("specd_request_generation_tokens_sum");
  int code = 0;
  const std::vector<std::string> lines =
      RunCli(absl::StrCat("generate --server ", c->router_address,
                          " --prompt 'def add(a, b):' --max-new-tokens 40 --ignore-eos"
                          " --speculation draft_model --json"),
             &code);
  ASSERT_EQ(code, 0);
  ASSERT_GE(lines.size(), 2u);
  std::vector<int32_t> streamed;
  for (size_t i = 0; i + 1 < lines.size(); ++i) {
    const json chunk = json::parse(lines[i]);
    for (int32_t id : chunk["token_ids"]) streamed.push_back(id);
  }
  const json last = json::parse(lines.back());
  EXPECT_EQ(last["finish_reason"], "length");
  EXPECT_EQ(last["usage"]["completion_tokens"], 40);
  EXPECT_EQ(streamed.size(), 40u);
  const json& spec = last["speculation"];
  EXPECT_GT(spec["steps"].get<double>(), 0);
  EXPECT_EQ(Cluster::Metric(port, "specd_spec_decode_steps_total") - steps0,
            spec["steps"].get<double>());
  EXPECT_EQ(Cluster::Metric(port, "specd_spec_decode_draft_tokens_total") - draft0,
            spec["draft_tokens"].get<double>());
  EXPECT_EQ(Cluster::Metric(port, "specd_spec_decode_accepted_tokens_total") - acc0,
            spec["accepted_tokens"].get<double>());
  EXPECT_EQ(Cluster::Metric(port, "specd_generation_tokens_total") - gen0, 40);
  // The length histograms saw the request once: its prompt, and its 40 generated tokens
  // (observed as the sequence finishes, which may trail its last chunk).
  EXPECT_TRUE(c->WaitForMetric(port, "specd_request_generation_tokens_count", {}, gen_n0 + 1));
  EXPECT_EQ(Cluster::Metric(port, "specd_request_generation_tokens_sum") - gen_sum0, 40);
  EXPECT_EQ(Cluster::Metric(port, "specd_request_prompt_tokens_count") - prompt_n0, 1);
  EXPECT_EQ(Cluster::Metric(port, "specd_request_prompt_tokens_sum") - prompt_sum0,
            last["usage"]["prompt_tokens"].get<double>());
  const double steps = spec["steps"], accepted = spec["accepted_tokens"],
               drafted = spec["draft_tokens"];
  EXPECT_DOUBLE_EQ(spec["acceptance_rate"].get<double>(), accepted / drafted);
  EXPECT_DOUBLE_EQ(spec["mean_accepted_length"].get<double>(), 1 + accepted / steps);

  // Errors: the gRPC code name on stderr and a non-zero exit.
  const std::string err = c->router_address;
  std::string cmd = SpecdBinary("specd-cli") + " generate --server " + err +
                    " --prompt x --temperature -1 2>&1 >/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  char buf[512] = {0};
  fread(buf, 1, sizeof(buf) - 1, p);
  const int status = pclose(p);
  EXPECT_NE(WEXITSTATUS(status), 0);
  EXPECT_NE(std::string(buf).find("INVALID_ARGUMENT: temperature"), std::string::npos) << buf;
}

// Step times keep a request's prefill step apart from its decode steps (kind="prefill" and
// "decode"), in the services and in the router's round trips, and the two sides agree on which
// steps were which.
TEST(RouterClusterTest, StepTimesKeepPrefillApartFromDecode) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  auto count = [](int port, const std::string& name, const std::string& kind) {
    return Cluster::Metric(port, name + "_count", {{"kind", kind}});
  };
  EXPECT_EQ(count(c->verify_metrics, "specd_step_seconds", "prefill"), 0);
  EXPECT_EQ(count(c->verify_metrics, "specd_step_seconds", "decode"), 0);
  int code = 0;
  const std::vector<std::string> lines =
      RunCli(absl::StrCat("generate --server ", c->router_address,
                          " --prompt 'def add(a, b):' --max-new-tokens 40 --ignore-eos"
                          " --speculation draft_model --json"),
             &code);
  ASSERT_EQ(code, 0);
  const json last = json::parse(lines.back());
  ASSERT_EQ(last["usage"]["completion_tokens"], 40);
  const double spec_steps = last["speculation"]["steps"].get<double>();
  ASSERT_GT(spec_steps, 0);
  // One request: its first verify step and its first draft step take in the prompt; every
  // other step is a decode step.
  const double verify_prefill = count(c->verify_metrics, "specd_step_seconds", "prefill");
  const double verify_decode = count(c->verify_metrics, "specd_step_seconds", "decode");
  EXPECT_EQ(verify_prefill, 1);
  EXPECT_GE(verify_decode, spec_steps - 1);
  EXPECT_EQ(count(c->draft_metrics, "specd_step_seconds", "prefill"), 1);
  EXPECT_GT(count(c->draft_metrics, "specd_step_seconds", "decode"), 0);
  EXPECT_EQ(count(c->router_metrics, "specd_verify_latency_seconds", "prefill"), verify_prefill);
  EXPECT_EQ(count(c->router_metrics, "specd_verify_latency_seconds", "decode"), verify_decode);
  EXPECT_EQ(count(c->router_metrics, "specd_draft_latency_seconds", "prefill"), 1);
  EXPECT_GT(count(c->router_metrics, "specd_draft_latency_seconds", "decode"), 0);
  // The prefill step's time is in its own sum, not the decode one.
  EXPECT_GT(Cluster::Metric(c->verify_metrics, "specd_step_seconds_sum", {{"kind", "prefill"}}), 0);
}

TEST(RouterClusterTest, StopsAtSplitStopStringsAndAtTheContextEnd) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  const Result plain = c->Generate(Greedy("for i in range(", 48, v1::SPECULATION_OFF));
  ASSERT_TRUE(plain.status.ok());
  // Characters 4..6 of the output as the stop string: each character comes from at least one
  // byte token (no merges in this tokenizer), so the stop string spans several tokens.
  std::vector<size_t> starts;  // byte offset of each UTF-8 character
  for (size_t i = 0; i < plain.text.size(); ++i) {
    if ((static_cast<unsigned char>(plain.text[i]) & 0xC0) != 0x80) starts.push_back(i);
  }
  ASSERT_GE(starts.size(), 8u) << plain.text;
  const std::string stop = plain.text.substr(starts[4], starts[7] - starts[4]);
  const size_t at = plain.text.find(stop);
  for (v1::Speculation s : {v1::SPECULATION_OFF, v1::SPECULATION_DRAFT_MODEL}) {
    v1::GenerateRequest r = Greedy("for i in range(", 48, s);
    r.add_stop(stop);
    const Result got = c->Generate(r);
    ASSERT_TRUE(got.status.ok());
    EXPECT_EQ(got.text, plain.text.substr(0, at));
    EXPECT_EQ(got.text.find(stop), std::string::npos);
    EXPECT_EQ(got.last.finish_reason(), v1::FINISH_REASON_STOP_STRING);
    EXPECT_EQ(got.last.matched_stop(), stop);
  }

  // A prompt 10 tokens short of the context: generation ends there, drafts are cut to fit, and
  // the output is still the target-only one.
  std::vector<Result> near_end;
  for (v1::Speculation s : {v1::SPECULATION_OFF, v1::SPECULATION_DRAFT_MODEL}) {
    v1::GenerateRequest r = Greedy("", 50, s);
    for (int i = 0; i < kMaxContext - 10; ++i) r.mutable_prompt_ids()->add_ids(97 + i % 26);
    near_end.push_back(c->Generate(r));
    ASSERT_TRUE(near_end.back().status.ok()) << near_end.back().status.error_message();
    EXPECT_EQ(near_end.back().last.finish_reason(), v1::FINISH_REASON_CONTEXT);
    EXPECT_EQ(near_end.back().tokens.size(), 10u);
  }
  EXPECT_EQ(near_end[0].tokens, near_end[1].tokens);
}

TEST(RouterClusterTest, ConcurrentRequestsShareSteps) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  std::vector<std::thread> threads;
  std::vector<Result> results(4);
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      // An explicit shape is drafted every step (the policy would draft these only where it
      // pays), so the draft service's steps carry whichever sequences are running.
      v1::GenerateRequest r = Greedy(Prompts(4)[i], 200, v1::SPECULATION_DRAFT_MODEL);
      r.set_draft_depth(3);
      r.set_draft_top_k(2);
      r.set_draft_max_nodes(6);
      results[i] = c->Generate(r);
    });
  }
  for (auto& t : threads) t.join();
  for (const Result& r : results) ASSERT_TRUE(r.status.ok());
  // Steps that carried more than one sequence: all steps minus those in the le="1" bucket.
  for (int port : {c->verify_metrics, c->draft_metrics}) {
    const double all = Cluster::Metric(port, "specd_step_batch_size_count");
    const double single = Cluster::Metric(port, "specd_step_batch_size_bucket", {{"le", "1"}});
    EXPECT_GT(all - single, 0) << "no batched step seen on port " << port;
  }
}

TEST(RouterClusterTest, TokenizeDetokenizeAndModelInfo) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  grpc::ClientContext c1, c2, c3, c4;
  v1::TokenizeRequest tr;
  tr.set_text("héllo");
  v1::TokenizeResponse tokens;
  ASSERT_TRUE(c->stub->Tokenize(&c1, tr, &tokens).ok());
  EXPECT_EQ(tokens.ids_size(), 6);  // byte-level: é is two bytes
  {
    grpc::ClientContext bad_context;
    v1::TokenizeRequest bad;
    bad.set_text("h\xe9llo");  // Latin-1, not UTF-8
    v1::TokenizeResponse none;
    const grpc::Status status = c->stub->Tokenize(&bad_context, bad, &none);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(status.error_message().rfind("text: not valid UTF-8", 0), 0u)
        << status.error_message();
  }
  v1::DetokenizeRequest dr;
  *dr.mutable_ids() = tokens.ids();
  v1::DetokenizeResponse text;
  ASSERT_TRUE(c->stub->Detokenize(&c2, dr, &text).ok());
  EXPECT_EQ(text.text(), "héllo");
  dr.add_ids(100000);
  EXPECT_EQ(c->stub->Detokenize(&c3, dr, &text).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::ModelInfo info;
  ASSERT_TRUE(c->stub->GetModelInfo(&c4, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.vocab_size(), 320u);
  EXPECT_EQ(info.max_context(), static_cast<uint32_t>(kMaxContext));
  EXPECT_EQ(info.max_new_tokens_limit(), 4000u);
  EXPECT_TRUE(info.draft_available());
  ASSERT_EQ(info.eos_token_ids_size(), 1);
  EXPECT_EQ(info.eos_token_ids(0), 256);
}

TEST(RouterClusterTest, VerifyFailureIsUnavailableAndRecovers) {
  std::unique_ptr<Cluster> c = Cluster::Start({/*draft=*/false, {}});
  ASSERT_NE(c, nullptr);
  // Without a draft service the draft model's requests are target-only, and say why (auto's
  // may still draft n-grams in the router).
  const Result plain = c->Generate(Greedy("x", 8, v1::SPECULATION_DRAFT_MODEL));
  ASSERT_TRUE(plain.status.ok());
  EXPECT_EQ(plain.last.speculation().mode(), v1::SPECULATION_OFF);
  EXPECT_EQ(plain.last.speculation().target_only_steps(), 8u);

  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  bool killed = false;
  const Result r = c->Read(&ctx, Greedy("y", 3000, v1::SPECULATION_OFF), [&](int) {
    if (!killed) {
      killed = true;
      ::kill(c->verify->pid(), SIGKILL);
    }
  });
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE) << r.status.error_message();
  EXPECT_NE(r.status.error_message().find("verify"), std::string::npos);
  // NOT_SERVING until the verify service is back.
  const absl::Status down = c->router->WaitForHealth(
      grpc::health::v1::HealthCheckResponse::NOT_SERVING, absl::Seconds(10));
  ASSERT_TRUE(down.ok()) << down;
  // Not ready, but alive: Kubernetes must not restart the router (the chart's liveness probe).
  const absl::StatusOr<HealthStatus> live = c->router->Health("liveness");
  ASSERT_TRUE(live.ok()) << live.status();
  EXPECT_EQ(*live, grpc::health::v1::HealthCheckResponse::SERVING);
  const Result refused = c->Generate(Greedy("x", 8, v1::SPECULATION_AUTO));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE);

  // A new verify process on the same address: the router reconnects and serves again.
  c->verify.reset();
  absl::StatusOr<std::unique_ptr<ServiceProcess>> verify = ServiceProcess::Start(c->verify_options);
  ASSERT_TRUE(verify.ok()) << verify.status();
  c->verify = *std::move(verify);
  ASSERT_TRUE(c->router->WaitUntilServing(absl::Seconds(20)).ok());
  const Result again = c->Generate(Greedy("x", 8, v1::SPECULATION_AUTO));
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_EQ(again.tokens, plain.tokens);
}

// The goodput policy decides every step's shape (speculation = auto and draft_model without
// tree flags); with 1 to 8 concurrent clients the batch changes all the time, so its decisions
// change too. Greedy output stays identical to speculation off, seeded sampling likewise, next
// to requests with explicit shapes, and the router counts every step by size and reason.
TEST(RouterClusterTest, GoodputPolicyKeepsGreedyAndSeededOutputIdentical) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  const std::vector<std::string> prompts = Prompts(22);
  const int kTokens = 20;
  std::vector<Result> off(prompts.size()), greedy(prompts.size()), seeded_off(prompts.size()),
      seeded(prompts.size()), fixed(prompts.size());
  auto sampled = [](const std::string& prompt, v1::Speculation speculation) {
    v1::GenerateRequest r = Greedy(prompt, kTokens, speculation);
    r.set_temperature(0.8f);
    r.set_top_k(30);
    r.set_seed(7);
    return r;
  };
  int fixed_plain_steps = 0;
  for (int clients : {1, 3, 8}) {
    const double busy_before = DraftBusySteps(c->router_metrics);
    std::vector<std::thread> threads;
    std::atomic<size_t> next{0};
    for (int t = 0; t < clients; ++t) {
      threads.emplace_back([&] {
        for (size_t i; (i = next++) < prompts.size();) {
          off[i] = c->Generate(Greedy(prompts[i], kTokens, v1::SPECULATION_OFF));
          greedy[i] = c->Generate(Greedy(
              prompts[i], kTokens, i % 2 ? v1::SPECULATION_AUTO : v1::SPECULATION_DRAFT_MODEL));
          seeded_off[i] = c->Generate(sampled(prompts[i], v1::SPECULATION_OFF));
          seeded[i] = c->Generate(sampled(prompts[i], v1::SPECULATION_AUTO));
          v1::GenerateRequest explicit_shape = Greedy(prompts[i], kTokens, v1::SPECULATION_AUTO);
          explicit_shape.set_draft_depth(3);
          explicit_shape.set_draft_top_k(2);
          explicit_shape.set_draft_max_nodes(6);
          fixed[i] = c->Generate(explicit_shape);
        }
      });
    }
    for (auto& t : threads) t.join();
    // Where a late pre-draft held the draft stream (overlap on a loaded host), a short request
    // may have had every step without a tree: then only the pass as a whole must have drafted.
    const bool busy = DraftBusySteps(c->router_metrics) > busy_before;
    uint64_t pass_steps = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      SCOPED_TRACE(absl::StrCat(prompts[i], " with ", clients, " clients"));
      for (const Result* r : {&off[i], &greedy[i], &seeded_off[i], &seeded[i], &fixed[i]}) {
        ASSERT_TRUE(r->status.ok()) << r->status.error_message();
      }
      EXPECT_EQ(greedy[i].tokens, off[i].tokens);
      EXPECT_EQ(fixed[i].tokens, off[i].tokens);
      EXPECT_EQ(seeded[i].tokens, seeded_off[i].tokens);
      // An explicit shape is drafted every step: never a step without a tree but the first
      // (where its prompt fits beside verify's prefill, the drafter is fed it there and it
      // drafts from the second step), the last one, whose budget leaves nothing to draft, and
      // (with overlap) those where a late pre-draft held the draft stream, counted below.
      fixed_plain_steps +=
          std::max(0, static_cast<int>(fixed[i].last.speculation().target_only_steps()) - 2);
      pass_steps += fixed[i].last.speculation().steps();
      if (!busy) EXPECT_GT(fixed[i].last.speculation().steps(), 0u);
    }
    EXPECT_GT(pass_steps, 0u) << clients << " clients";
  }
  const int port = c->router_metrics;
  EXPECT_LE(fixed_plain_steps, DraftBusySteps(port));
  EXPECT_GT(
      Cluster::Metric(port, "specd_spec_steps_total", {{"tree_size", "0"}, {"reason", "off"}}), 0);
  double explicit_steps = 0, policy_steps = 0;
  for (const char* size : {"1", "2", "3-4", "5-8", "9-16", "17+"}) {
    const double e = Cluster::Metric(port, "specd_spec_steps_total",
                                     {{"tree_size", size}, {"reason", "explicit"}});
    const double p = Cluster::Metric(port, "specd_spec_steps_total",
                                     {{"tree_size", size}, {"reason", "policy"}});
    explicit_steps += std::isnan(e) ? 0 : e;
    policy_steps += std::isnan(p) ? 0 : p;
  }
  EXPECT_GT(explicit_steps, 0);
  const double policy_off = Cluster::Metric(port, "specd_spec_steps_total",
                                            {{"tree_size", "0"}, {"reason", "policy_off"}});
  EXPECT_GT(policy_steps + (std::isnan(policy_off) ? 0 : policy_off), 0);
  EXPECT_GT(Cluster::Metric(port, "specd_policy_verify_one_token_seconds"), 0);
  // A catch-up the policy moved off the draft call was fed beside verify, not dropped.
  const double catch_up =
      Cluster::Metric(port, "specd_spec_steps_total", {{"tree_size", "0"}, {"reason", "catch_up"}});
  const double ingested = Cluster::Metric(port, "specd_draft_ingest_tokens_total");
  if (!std::isnan(catch_up) && catch_up > 0) EXPECT_GT(ingested, 0);
  std::printf("catch_up steps %.0f, ingested tokens %.0f\n", catch_up, ingested);
}

// Under auto the goodput policy drafts each sequence, step by step, with the draft model, with
// the router's n-gram proposal (prompts that repeat themselves, and the random target's loops,
// give matches) or not at all. With 1 and 4 clients greedy output equals off's and seeded
// sampling seeded off's, both drafters are used, and sequences move between them (printed).
// Back is rare on this pair (once the random target loops, n-gram keeps matching and the
// policy keeps it); on the trained pair eagle_cluster_test's AutoSwitching test prints both ways.
TEST(RouterClusterTest, AutoSwitchingBetweenNgramAndTheDraftModelIsIdenticalToOff) {
  std::unique_ptr<Cluster> c = Cluster::Start();
  ASSERT_NE(c, nullptr);
  std::vector<std::string> prompts = Prompts(12);
  for (const char* repeated :
       {"def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a",
        "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(",
        "x = x + 1\nx = x + 1\nx = x + 1\nx = x", "abc abc abc abc abc abc ab"}) {
    prompts.push_back(repeated);
  }
  const int port = c->router_metrics;
  auto switches = [&](const char* to) {
    const double v = Cluster::Metric(port, "specd_auto_drafter_switches_total", {{"to", to}});
    return std::isnan(v) ? 0 : v;
  };
  for (int clients : {1, 4}) {
    ExpectGreedyAndSeededMatchOff(*c, prompts, /*tokens=*/48, clients, v1::SPECULATION_AUTO,
                                  /*temperature=*/0.7f, /*top_k=*/0, /*seed=*/5);
  }
  auto steps = [&](const char* reason) {
    double sum = 0;
    for (const char* size : {"1", "2", "3-4", "5-8", "9-16", "17+"}) {
      const double v = Cluster::Metric(port, "specd_spec_steps_total",
                                       {{"tree_size", size}, {"reason", reason}});
      sum += std::isnan(v) ? 0 : v;
    }
    return sum;
  };
  const double ngram = steps("policy_ngram"), model = steps("policy");
  const double to_ngram = switches("ngram"), to_model = switches("model");
  std::printf(
      "auto steps: %.0f n-gram, %.0f draft model (%.0f probes); switches %.0f to n-gram, %.0f to "
      "the model\n",
      ngram, model, steps("probe"), to_ngram, to_model);
  EXPECT_GT(ngram, 0);
  // The draft model drafts at least its probes (how often more, and whether a sequence moves
  // from it to n-gram, is the measured costs' call: a loaded host saw no move).
  EXPECT_GT(model + steps("probe"), 0);
}

// Without any draft service auto still speculates: the router's n-gram drafter, where it pays,
// with greedy and seeded output identical to off.
TEST(RouterClusterTest, AutoWithoutADraftServiceDraftsNgramsInTheRouter) {
  std::unique_ptr<Cluster> c = Cluster::Start({/*draft=*/false, {}});
  ASSERT_NE(c, nullptr);
  const int kTokens = 64;
  int ngram_requests = 0;
  for (const std::string& prompt : Prompts(6)) {
    SCOPED_TRACE(prompt);
    v1::GenerateRequest r = Greedy(prompt, kTokens, v1::SPECULATION_OFF);
    const Result off = c->Generate(r);
    r.set_speculation(v1::SPECULATION_AUTO);
    const Result on = c->Generate(r);
    r.set_temperature(0.8f);
    r.set_seed(3);
    const Result seeded = c->Generate(r);
    r.set_speculation(v1::SPECULATION_OFF);
    const Result seeded_off = c->Generate(r);
    for (const Result* x : {&off, &on, &seeded, &seeded_off}) {
      ASSERT_TRUE(x->status.ok()) << x->status.error_message();
    }
    EXPECT_EQ(on.tokens, off.tokens);
    EXPECT_EQ(seeded.tokens, seeded_off.tokens);
    for (const Result* x : {&on, &seeded}) {
      const v1::SpeculationStats& st = x->last.speculation();
      EXPECT_EQ(st.mode(), st.steps() > 0 ? v1::SPECULATION_NGRAM : v1::SPECULATION_OFF);
      ngram_requests += st.steps() > 0 ? 1 : 0;
    }
  }
  EXPECT_GT(ngram_requests, 0);
  const double ngram_steps = Cluster::Metric(c->router_metrics, "specd_spec_steps_total",
                                             {{"tree_size", "5-8"}, {"reason", "policy_ngram"}});
  std::printf("%d requests drafted n-grams; %.0f steps of 5-8 tokens\n", ngram_requests,
              ngram_steps);
  // --auto_ngram=false: the draft service's drafter alone, so none here.
  c.reset();
  c = Cluster::Start({/*draft=*/false, {"--auto_ngram=false"}});
  ASSERT_NE(c, nullptr);
  const Result plain = c->Generate(Greedy(Prompts(6)[0], kTokens, v1::SPECULATION_AUTO));
  ASSERT_TRUE(plain.status.ok()) << plain.status.error_message();
  EXPECT_EQ(plain.last.speculation().mode(), v1::SPECULATION_OFF);
  EXPECT_EQ(plain.last.speculation().steps(), 0u);
}

// A sequence the policy does not draft is still fed to the draft service (ingest-only steps
// beside verify, here after a single token of backlog): outputs stay those of target-only
// decoding, greedy and seeded, and every step the policy left a drafted sequence without a tree
// fed the drafter instead.
TEST(RouterClusterTest, IngestOnlyStepsKeepOutputsIdentical) {
  ClusterOptions options;
  options.router_args = {"--draft_ingest_tokens=1"};
  std::unique_ptr<Cluster> c = Cluster::Start(options);
  ASSERT_NE(c, nullptr);
  ExpectGreedyAndSeededMatchOff(*c, Prompts(16), /*tokens=*/24, /*clients=*/8, v1::SPECULATION_AUTO,
                                /*temperature=*/0.8f, /*top_k=*/0, /*seed=*/11);
  const int port = c->router_metrics;
  const double policy_off = Cluster::Metric(port, "specd_spec_steps_total",
                                            {{"tree_size", "0"}, {"reason", "policy_off"}});
  const double ingested = Cluster::Metric(port, "specd_draft_ingest_tokens_total");
  if (!std::isnan(policy_off) && policy_off > 0) EXPECT_GT(ingested, 0);
  std::printf("policy_off steps %.0f, ingested tokens %.0f\n", policy_off, ingested);
}

// A verify service stopped gracefully (SIGTERM) is seen at once even by an idle router: its
// health turns NOT_SERVING, and once a new verify process is up the next request succeeds
// (it must not die on the stream the old process closed).
TEST(RouterClusterTest, GracefullyStoppedVerifyIsSeenAtOnceAndTheNextRequestSucceeds) {
  std::unique_ptr<Cluster> c = Cluster::Start({/*draft=*/false, {}});
  ASSERT_NE(c, nullptr);
  const Result before = c->Generate(Greedy("x", 8, v1::SPECULATION_AUTO));
  ASSERT_TRUE(before.status.ok()) << before.status.error_message();

  ASSERT_EQ(::kill(c->verify->pid(), SIGTERM), 0);
  const absl::Time stopped = absl::Now();
  const absl::Status down = c->router->WaitForHealth(
      grpc::health::v1::HealthCheckResponse::NOT_SERVING, absl::Seconds(3));
  ASSERT_TRUE(down.ok()) << down << "\n" << c->router->Log();
  EXPECT_LT(absl::Now() - stopped, absl::Seconds(2));
  absl::StatusOr<int> code = c->verify->WaitForExit(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  const Result refused = c->Generate(Greedy("x", 8, v1::SPECULATION_AUTO));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE);

  c->verify.reset();
  absl::StatusOr<std::unique_ptr<ServiceProcess>> verify = ServiceProcess::Start(c->verify_options);
  ASSERT_TRUE(verify.ok()) << verify.status();
  c->verify = *std::move(verify);
  ASSERT_TRUE(c->router->WaitUntilServing(absl::Seconds(20)).ok());
  for (int i = 0; i < 3; ++i) {
    const Result again = c->Generate(Greedy("x", 8, v1::SPECULATION_AUTO));
    ASSERT_TRUE(again.status.ok()) << again.status.error_message();
    EXPECT_EQ(again.tokens, before.tokens);
  }
}

}  // namespace
}  // namespace specd
