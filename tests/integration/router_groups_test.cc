// Several verify groups behind the router (services/router/group_pool.h), as processes on
// loopback: two specd-verify and two specd-draft services, one or two specd-router in front.
// Which group served a request is read from the verify services' own /metrics
// (specd_sequences_freed_total), not from the router.
#include <signal.h>
#include <stdio.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/text/tokenizer.h"
#include "engine/backend.h"
#include "gtest/gtest.h"
#include "specd/v1/generation.grpc.pb.h"
#include "tests/testutil/random_checkpoint.h"
#include "tests/testutil/service_process.h"

namespace specd {
namespace {

namespace fs = std::filesystem;

struct Models {
  std::string dir, target, draft;
};

const Models& TestModels() {
  static const Models* models = [] {
    auto* m = new Models();
    m->dir = MakeTempDir("router_groups_test");
    m->target = m->dir + "/target";
    m->draft = m->dir + "/draft";
    const std::string cmd =
        absl::StrCat(SpecdBinary("specd-make-test-model"), " --target_dir=", m->target,
                     " --draft_dir=", m->draft,
                     " --hidden_size=64 --intermediate_size=128 --num_layers=4 --draft_layers=1"
                     " --max_position_embeddings=2048 > /dev/null");
    if (std::system(cmd.c_str()) != 0) ADD_FAILURE() << "failed: " << cmd;
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(TestModels().dir, ec);
    });
    return m;
  }();
  return *models;
}

struct Result {
  grpc::Status status;
  std::vector<int32_t> tokens;
  int chunks = 0;
};

double Metric(int port, const std::string& name,
              const std::map<std::string, std::string>& labels = {}) {
  absl::StatusOr<std::string> text = HttpGet("127.0.0.1", port, "/metrics");
  if (!text.ok()) return NAN;
  absl::StatusOr<double> v = MetricValue(*text, name, labels);
  return v.ok() ? *v : NAN;
}

// A model service (verify or draft) that can be killed and started again on the same ports.
struct Model {
  ServiceProcessOptions options;
  int metrics_port = 0;
  std::unique_ptr<ServiceProcess> process;

  static Model Make(const std::string& binary, const std::string& model) {
    Model m;
    m.metrics_port = PickFreePort();
    const std::string address = absl::StrCat("127.0.0.1:", PickFreePort());
    m.options = {SpecdBinary(binary),
                 {"--address=" + address, absl::StrCat("--metrics_port=", m.metrics_port),
                  "--model=" + model, "--num_threads=1"},
                 address};
    return m;
  }
  absl::Status Spawn() {
    absl::StatusOr<std::unique_ptr<ServiceProcess>> p = ServiceProcess::Spawn(options);
    if (!p.ok()) return p.status();
    process = *std::move(p);
    return absl::OkStatus();
  }
  // Sequences this service finished normally, and those cut short, since it started.
  double Finished() const {
    return Metric(metrics_port, "specd_sequences_freed_total", {{"reason", "finished"}});
  }
  double Cancelled() const {
    return Metric(metrics_port, "specd_sequences_freed_total", {{"reason", "cancelled"}});
  }
};

class Groups {
 public:
  // Two verify and two draft services, then `routers` routers over all of them.
  static std::unique_ptr<Groups> Start(int routers = 1) {
    const Models& models = TestModels();
    auto g = std::make_unique<Groups>();
    for (int i = 0; i < 2; ++i) {
      g->verify.push_back(Model::Make("specd-verify", models.target));
      g->draft.push_back(Model::Make("specd-draft", models.draft));
    }
    for (Model* m : {&g->verify[0], &g->verify[1], &g->draft[0], &g->draft[1]}) {
      const absl::Status s = m->Spawn();
      EXPECT_TRUE(s.ok()) << s;
      if (!s.ok()) return nullptr;
    }
    const std::string verify_list =
        absl::StrCat(g->verify[0].options.grpc_address, ",", g->verify[1].options.grpc_address);
    const std::string draft_list =
        absl::StrCat(g->draft[0].options.grpc_address, ",", g->draft[1].options.grpc_address);
    for (int r = 0; r < routers; ++r) {
      const int metrics_port = PickFreePort();
      const std::string address = absl::StrCat("127.0.0.1:", PickFreePort());
      absl::StatusOr<std::unique_ptr<ServiceProcess>> router = ServiceProcess::Spawn(
          {SpecdBinary("specd-router"),
           {"--address=" + address, absl::StrCat("--metrics_port=", metrics_port),
            "--model=" + models.target, "--verify_address=" + verify_list,
            "--draft_address=" + draft_list, "--max_batch=64", "--max_new_tokens_limit=4000"},
           address});
      EXPECT_TRUE(router.ok()) << router.status();
      if (!router.ok()) return nullptr;
      g->router_metrics.push_back(metrics_port);
      g->routers.push_back(*std::move(router));
    }
    std::vector<ServiceProcess*> all;
    for (Model* m : {&g->verify[0], &g->verify[1], &g->draft[0], &g->draft[1]}) {
      all.push_back(m->process.get());
    }
    for (auto& r : g->routers) all.push_back(r.get());
    for (ServiceProcess* p : all) {
      const absl::Status s = p->WaitUntilServing(absl::Seconds(60));
      EXPECT_TRUE(s.ok()) << s << "\n" << p->Log();
      if (!s.ok()) return nullptr;
    }
    for (auto& r : g->routers) g->stubs.push_back(v1::Generation::NewStub(r->channel()));
    // The router serves once one group is up; wait until both are, and drafting.
    for (int r = 0; r < routers; ++r) {
      for (const char* group : {"0", "1"}) {
        if (!g->WaitForGroup(r, group, "specd_verify_available") ||
            !g->WaitForGroup(r, group, "specd_draft_available")) {
          return nullptr;
        }
      }
    }
    return g;
  }

  // Polls router `r`'s per-group gauge `name` until it reads 1 (20 s).
  bool WaitForGroup(int r, const std::string& group, const std::string& name) {
    const absl::Time end = absl::Now() + absl::Seconds(20);
    double v = NAN;
    while ((v = Metric(router_metrics[r], name, {{"verify_group", group}})) != 1 &&
           absl::Now() < end) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_EQ(v, 1) << name << "{verify_group=\"" << group << "\"} of router " << r;
    return v == 1;
  }

  Result Generate(const v1::GenerateRequest& request, int router = 0,
                  const std::function<void()>& on_first_chunk = nullptr) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
    Result r;
    auto reader = stubs[router]->Generate(&ctx, request);
    v1::GenerateResponse chunk;
    while (reader->Read(&chunk)) {
      r.tokens.insert(r.tokens.end(), chunk.token_ids().begin(), chunk.token_ids().end());
      if (r.chunks++ == 0 && on_first_chunk) on_first_chunk();
    }
    r.status = reader->Finish();
    return r;
  }

  // Runs `n` requests at once (one client thread each), request i through router i % routers.
  std::vector<Result> GenerateAll(const std::vector<v1::GenerateRequest>& requests,
                                  const std::function<void()>& on_first_chunk = nullptr) {
    std::vector<Result> results(requests.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < requests.size(); ++i) {
      threads.emplace_back([&, i] {
        results[i] = Generate(requests[i], static_cast<int>(i % stubs.size()), on_first_chunk);
      });
    }
    for (std::thread& t : threads) t.join();
    return results;
  }

  std::vector<Model> verify, draft;
  std::vector<std::unique_ptr<ServiceProcess>> routers;
  std::vector<int> router_metrics;
  std::vector<std::unique_ptr<v1::Generation::Stub>> stubs;
};

v1::GenerateRequest Greedy(const std::string& prompt, int max_new_tokens) {
  v1::GenerateRequest r;
  r.set_prompt(prompt);
  r.set_max_new_tokens(max_new_tokens);
  r.set_ignore_eos(true);
  r.set_speculation(v1::SPECULATION_DRAFT_MODEL);
  return r;
}

std::string PromptOf(int i) {
  static const char* const kSeeds[] = {
      "def fibonacci(n):",   "import numpy as np\n", "class Stack:\n    def", "for i in range(",
      "The quick brown fox", "SELECT * FROM",        "#include <stdio.h>",    "while True:\n"};
  return absl::StrCat(kSeeds[i % 8], " ", i);
}

// Target-only greedy decoding in this process, straight on the engine.
std::vector<int32_t> EngineGreedy(Backend* target, const std::vector<int32_t>& prompt, int n,
                                  SeqId seq) {
  std::vector<int32_t> out;
  EXPECT_TRUE(target->AddSequence(seq).ok());
  VerifyItem item;
  item.seq = seq;
  item.pending = prompt;
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<std::vector<VerifyOutcome>> o = target->Verify({item});
    EXPECT_TRUE(o.ok()) << o.status();
    if (!o.ok()) break;
    out.push_back((*o)[0].tokens[0]);
    item.pending = {(*o)[0].tokens[0]};
  }
  EXPECT_TRUE(target->RemoveSequence(seq).ok());
  return out;
}

// Polls `value` until it equals `want` (10 s; the router names finished sequences to the
// services in its next step message, a moment after their last chunk). Returns the last value.
double WaitFor(const std::function<double()>& value, double want) {
  const absl::Time end = absl::Now() + absl::Seconds(10);
  double v = value();
  while (v != want && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(20));
    v = value();
  }
  return v;
}

// |a - b| within `fraction` of their mean.
void ExpectBalanced(double a, double b, double fraction) {
  std::printf("sequences per verify group: %g and %g\n", a, b);
  const double mean = (a + b) / 2;
  EXPECT_LE(std::fabs(a - mean), fraction * mean) << a << " vs " << b;
}

TEST(RouterGroupsTest, SpreadsSixtyFourStreamsEvenlyWithEngineGreedyOutput) {
  std::unique_ptr<Groups> g = Groups::Start();
  ASSERT_NE(g, nullptr);
  // Long enough that every stream is still running when the last one arrives, so the groups'
  // shares measure placement, not which process the machine happened to run faster.
  constexpr int kStreams = 64, kTokens = 64;
  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < kStreams; ++i) requests.push_back(Greedy(PromptOf(i), kTokens));
  const std::vector<Result> results = g->GenerateAll(requests);
  for (const Result& r : results) ASSERT_TRUE(r.status.ok()) << r.status.error_message();

  auto total = [&] { return g->verify[0].Finished() + g->verify[1].Finished(); };
  EXPECT_EQ(WaitFor(total, kStreams), kStreams);
  ExpectBalanced(g->verify[0].Finished(), g->verify[1].Finished(), 0.2);
  // Both draft services drafted (each group drafts through its own).
  for (const Model& d : g->draft) EXPECT_GT(d.Finished(), 0) << d.options.grpc_address;

  // Each service logged its load as it went and the KV capacity it settled on (the verify
  // services run with the default --kv_capacity_tokens and --max_sequences).
  const std::string log = g->verify[0].process->Log();
  EXPECT_NE(log.find("tensors, "), std::string::npos) << log;     // the file it mapped
  EXPECT_NE(log.find("cpu: placed "), std::string::npos) << log;  // what it placed
  EXPECT_NE(log.find("KV cache 1048576 tokens = 512 sequences of the full 2048-token context; "
                     "at most 256 sequences"),
            std::string::npos)
      << log;

  // Whichever group served it, each output is the engine's own target-only greedy decoding.
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
      Tokenizer::FromModelDir(TestModels().target);
  ASSERT_TRUE(tokenizer.ok());
  BackendOptions bo;
  bo.num_threads = 1;
  absl::StatusOr<std::unique_ptr<Backend>> target = CreateBackend(TestModels().target, bo);
  ASSERT_TRUE(target.ok()) << target.status();
  for (int i = 0; i < kStreams; ++i) {
    const std::vector<int32_t> prompt = (*tokenizer)->Encode(PromptOf(i), true);
    EXPECT_EQ(EngineGreedy(target->get(), prompt, kTokens, i + 1), results[i].tokens)
        << PromptOf(i);
  }
}

TEST(RouterGroupsTest, KilledGroupFailsOnlyItsOwnSequencesAndComesBack) {
  std::unique_ptr<Groups> g = Groups::Start();
  ASSERT_NE(g, nullptr);
  constexpr int kStreams = 32;
  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < kStreams; ++i) requests.push_back(Greedy(PromptOf(i), 200));
  // Kill group 1's verify service once every stream has its first chunk (all are placed).
  std::atomic<int> started{0};
  const std::vector<Result> results = g->GenerateAll(requests, [&] {
    if (++started == kStreams) ::kill(g->verify[1].process->pid(), SIGKILL);
  });
  ASSERT_EQ(started.load(), kStreams);
  int ok = 0, unavailable = 0;
  for (const Result& r : results) {
    if (r.status.ok()) {
      ++ok;
      EXPECT_EQ(r.tokens.size(), 200u);
    } else {
      EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE) << r.status.error_message();
      ++unavailable;
    }
  }
  // Group 0 lost nothing: every sequence it held finished, and those are exactly the OK ones;
  // the killed group's sequences (its half) ended UNAVAILABLE.
  EXPECT_EQ(WaitFor([&] { return g->verify[0].Finished(); }, ok), ok);
  EXPECT_EQ(g->verify[0].Cancelled(), 0);
  EXPECT_EQ(ok + unavailable, kStreams);
  ExpectBalanced(ok, unavailable, 0.2);

  // While group 1 is down, new requests all go to group 0 and succeed.
  EXPECT_EQ(Metric(g->router_metrics[0], "specd_verify_available", {{"verify_group", "1"}}), 0);
  EXPECT_EQ(Metric(g->router_metrics[0], "specd_verify_available"), 1);
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(g->Generate(Greedy(PromptOf(i), 8)).status.ok());
  }
  EXPECT_EQ(WaitFor([&] { return g->verify[0].Finished(); }, ok + 4), ok + 4);

  // Restarted (same address), group 1 takes new sequences again.
  ASSERT_TRUE(g->verify[1].Spawn().ok());
  ASSERT_TRUE(g->verify[1].process->WaitUntilServing(absl::Seconds(60)).ok());
  ASSERT_TRUE(g->WaitForGroup(0, "1", "specd_verify_available"));
  const double before0 = g->verify[0].Finished(), before1 = g->verify[1].Finished();
  std::vector<v1::GenerateRequest> more;
  for (int i = 0; i < 16; ++i) more.push_back(Greedy(PromptOf(i), 48));
  for (const Result& r : g->GenerateAll(more)) EXPECT_TRUE(r.status.ok());
  auto total = [&] { return g->verify[0].Finished() + g->verify[1].Finished(); };
  EXPECT_EQ(WaitFor(total, before0 + before1 + 16), before0 + before1 + 16);
  ExpectBalanced(g->verify[0].Finished() - before0, g->verify[1].Finished() - before1, 0.25);
}

TEST(RouterGroupsTest, TwoRoutersOverTwoGroupsShareTheLoad) {
  std::unique_ptr<Groups> g = Groups::Start(/*routers=*/2);
  ASSERT_NE(g, nullptr);
  constexpr int kStreams = 64, kTokens = 48;
  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < kStreams; ++i) requests.push_back(Greedy(PromptOf(i), kTokens));
  const std::vector<Result> results = g->GenerateAll(requests);
  for (const Result& r : results) ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  // Same prompt through either router: same tokens.
  const Result via0 = g->Generate(Greedy(PromptOf(1), kTokens), 0);
  const Result via1 = g->Generate(Greedy(PromptOf(1), kTokens), 1);
  EXPECT_EQ(via0.tokens, results[1].tokens);
  EXPECT_EQ(via1.tokens, results[1].tokens);
  auto total = [&] { return g->verify[0].Finished() + g->verify[1].Finished(); };
  EXPECT_EQ(WaitFor(total, kStreams + 2), kStreams + 2);
  ExpectBalanced(g->verify[0].Finished(), g->verify[1].Finished(), 0.2);
}

}  // namespace
}  // namespace specd
