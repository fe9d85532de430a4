// The router cluster of the integration tests: specd-verify, specd-draft and specd-router started
// as processes on loopback on small random models written once per test process, with the
// helpers the cluster tests share (router_cluster_test, router_overlap_test).
#ifndef SPECD_TESTS_INTEGRATION_ROUTER_CLUSTER_FIXTURE_H_
#define SPECD_TESTS_INTEGRATION_ROUTER_CLUSTER_FIXTURE_H_

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
#include "tests/testutil/random_checkpoint.h"
#include "tests/testutil/service_process.h"

namespace specd {
namespace router_cluster {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int kMaxContext = 2048;

// The models, written once per test process.
struct Models {
  std::string dir;
  std::string target;
  std::string draft;
};

inline const Models& TestModels() {
  static const Models* models = [] {
    auto* m = new Models();
    m->dir = MakeTempDir("router_cluster_test");
    m->target = m->dir + "/target";
    m->draft = m->dir + "/draft";
    const std::string cmd =
        absl::StrCat(SpecdBinary("specd-make-test-model"), " --target_dir=", m->target,
                     " --draft_dir=", m->draft,
                     " --hidden_size=64 --intermediate_size=128 --num_layers=4 --draft_layers=1"
                     " --max_position_embeddings=",
                     kMaxContext, " > /dev/null");
    if (std::system(cmd.c_str()) != 0) {
      ADD_FAILURE() << "failed: " << cmd;
    }
    // The services are stopped by then (each test's Cluster is gone before exit).
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
  std::string text;
  int chunks = 0;
  v1::GenerateResponse last;  // the chunk with the finish reason
};

struct ClusterOptions {
  bool draft = true;
  std::vector<std::string> router_args;
  std::vector<std::string> draft_args;
};

class Cluster {
 public:
  static std::unique_ptr<Cluster> Start(const ClusterOptions& options = {}) {
    const Models& models = TestModels();
    auto c = std::make_unique<Cluster>();
    c->verify_metrics = PickFreePort();
    const std::string verify_address = absl::StrCat("127.0.0.1:", PickFreePort());
    c->verify_options = {
        SpecdBinary("specd-verify"),
        {"--address=" + verify_address, absl::StrCat("--metrics_port=", c->verify_metrics),
         "--model=" + models.target, "--num_threads=1"},
        verify_address};
    absl::StatusOr<std::unique_ptr<ServiceProcess>> verify =
        ServiceProcess::Spawn(c->verify_options);
    EXPECT_TRUE(verify.ok()) << verify.status();
    if (!verify.ok()) return nullptr;
    c->verify = *std::move(verify);
    std::string draft_address;
    if (options.draft) {
      c->draft_metrics = PickFreePort();
      draft_address = absl::StrCat("127.0.0.1:", PickFreePort());
      c->draft_options = {
          SpecdBinary("specd-draft"),
          {"--address=" + draft_address, absl::StrCat("--metrics_port=", c->draft_metrics),
           "--model=" + models.draft, "--num_threads=1"},
          draft_address};
      c->draft_options.args.insert(c->draft_options.args.end(), options.draft_args.begin(),
                                   options.draft_args.end());
      absl::StatusOr<std::unique_ptr<ServiceProcess>> draft =
          ServiceProcess::Spawn(c->draft_options);
      EXPECT_TRUE(draft.ok()) << draft.status();
      if (!draft.ok()) return nullptr;
      c->draft = *std::move(draft);
    }
    c->router_metrics = PickFreePort();
    c->router_address = absl::StrCat("127.0.0.1:", PickFreePort());
    std::vector<std::string> args = {
        "--address=" + c->router_address,   absl::StrCat("--metrics_port=", c->router_metrics),
        "--model=" + models.target,         "--verify_address=" + verify_address,
        "--draft_address=" + draft_address, "--max_new_tokens_limit=4000"};
    args.insert(args.end(), options.router_args.begin(), options.router_args.end());
    // The router_cluster_overlap ctest entry reruns the lossless and fault tests with overlap.
    if (const char* extra = std::getenv("SPECD_TEST_ROUTER_ARGS"); extra != nullptr) {
      for (absl::string_view a : absl::StrSplit(extra, ' ', absl::SkipEmpty())) {
        args.emplace_back(a);
      }
    }
    absl::StatusOr<std::unique_ptr<ServiceProcess>> router =
        ServiceProcess::Spawn({SpecdBinary("specd-router"), args, c->router_address});
    EXPECT_TRUE(router.ok()) << router.status();
    if (!router.ok()) return nullptr;
    c->router = *std::move(router);
    for (ServiceProcess* p : {c->verify.get(), c->draft.get(), c->router.get()}) {
      if (p == nullptr) continue;
      const absl::Status s = p->WaitUntilServing(absl::Seconds(60));
      EXPECT_TRUE(s.ok()) << s << "\n" << p->Log();
      if (!s.ok()) return nullptr;
    }
    c->stub = v1::Generation::NewStub(c->router->channel());
    if (options.draft) {
      // The router probes the draft service in the background; wait until it is in use.
      EXPECT_TRUE(c->WaitForMetric(c->router_metrics, "specd_draft_available", {}, 1));
    }
    return c;
  }

  Result Generate(const v1::GenerateRequest& request, absl::Duration timeout = absl::Seconds(120)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    return Read(&ctx, request);
  }

  Result Read(grpc::ClientContext* ctx, const v1::GenerateRequest& request,
              const std::function<void(int chunk)>& on_chunk = nullptr) {
    Result r;
    std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = stub->Generate(ctx, request);
    v1::GenerateResponse chunk;
    while (reader->Read(&chunk)) {
      r.tokens.insert(r.tokens.end(), chunk.token_ids().begin(), chunk.token_ids().end());
      r.text += chunk.text();
      ++r.chunks;
      if (chunk.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) r.last = chunk;
      if (on_chunk) on_chunk(r.chunks);
    }
    r.status = reader->Finish();
    return r;
  }

  static double Metric(int port, const std::string& name,
                       const std::map<std::string, std::string>& labels = {}) {
    absl::StatusOr<std::string> text = HttpGet("127.0.0.1", port, "/metrics");
    if (!text.ok()) return NAN;
    absl::StatusOr<double> v = MetricValue(*text, name, labels);
    return v.ok() ? *v : NAN;
  }

  // Polls until the metric equals `want` (10 s).
  bool WaitForMetric(int port, const std::string& name,
                     const std::map<std::string, std::string>& labels, double want) {
    const absl::Time end = absl::Now() + absl::Seconds(10);
    double v = NAN;
    while (absl::Now() < end) {
      v = Metric(port, name, labels);
      if (v == want) return true;
      absl::SleepFor(absl::Milliseconds(20));
    }
    ADD_FAILURE() << name << " is " << v << ", want " << want;
    return false;
  }

  ServiceProcessOptions verify_options, draft_options;
  std::unique_ptr<ServiceProcess> verify, draft, router;
  int verify_metrics = 0, draft_metrics = 0, router_metrics = 0;
  std::string router_address;
  std::unique_ptr<v1::Generation::Stub> stub;
};

// Sequence steps the router served without a tree because a late pre-draft held the draft
// stream (overlap); 0 without overlap.
inline double DraftBusySteps(int router_metrics) {
  const double v =
      Cluster::Metric(router_metrics, "specd_target_only_steps_total", {{"reason", "draft_busy"}});
  return std::isnan(v) ? 0 : v;
}

inline v1::GenerateRequest Greedy(const std::string& prompt, int max_new_tokens,
                                  v1::Speculation speculation) {
  v1::GenerateRequest r;
  r.set_prompt(prompt);
  r.set_max_new_tokens(max_new_tokens);
  r.set_ignore_eos(true);
  r.set_speculation(speculation);
  return r;
}

inline std::vector<std::string> Prompts(int n) {
  const std::vector<std::string> seeds = {"def fibonacci(n):",     "import numpy as np\n",
                                          "class Stack:\n    def", "for i in range(",
                                          "Hello, world",          "The quick brown fox",
                                          "return x * y + z",      "SELECT * FROM",
                                          "#include <stdio.h>",    "while True:\n",
                                          "if __name__ ==",        "x = [1, 2, 3]",
                                          "async def fetch(url)",  "lambda a, b: a",
                                          "print('hi')",           "try:\n    pass",
                                          "{\"key\": \"value\"",   "a",
                                          "<html><body>",          "0123456789",
                                          "    yield from",        "Zebra"};
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.push_back(seeds[i % seeds.size()]);
  return out;
}

// Each of `prompts` from `clients` threads at once, greedy and sampled (`temperature`, `top_k`
// unless 0, `seed`),
// with speculation off and with `mode`: every request succeeds and `mode`'s greedy tokens and
// text equal off's, its seeded tokens seeded off's.
inline void ExpectGreedyAndSeededMatchOff(Cluster& c, const std::vector<std::string>& prompts,
                                          int tokens, int clients, v1::Speculation mode,
                                          float temperature, int top_k, uint64_t seed) {
  std::vector<Result> off(prompts.size()), greedy(prompts.size()), seeded_off(prompts.size()),
      seeded(prompts.size());
  auto sampled = [&](const std::string& prompt, v1::Speculation speculation) {
    v1::GenerateRequest r = Greedy(prompt, tokens, speculation);
    r.set_temperature(temperature);
    if (top_k > 0) r.set_top_k(top_k);
    r.set_seed(seed);
    return r;
  };
  std::vector<std::thread> threads;
  std::atomic<size_t> next{0};
  for (int t = 0; t < clients; ++t) {
    threads.emplace_back([&] {
      for (size_t i; (i = next++) < prompts.size();) {
        off[i] = c.Generate(Greedy(prompts[i], tokens, v1::SPECULATION_OFF));
        greedy[i] = c.Generate(Greedy(prompts[i], tokens, mode));
        seeded_off[i] = c.Generate(sampled(prompts[i], v1::SPECULATION_OFF));
        seeded[i] = c.Generate(sampled(prompts[i], mode));
      }
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) {
    SCOPED_TRACE(absl::StrCat(prompts[i], " with ", clients, " clients"));
    for (const Result* r : {&off[i], &greedy[i], &seeded_off[i], &seeded[i]}) {
      ASSERT_TRUE(r->status.ok()) << r->status.error_message();
    }
    EXPECT_EQ(greedy[i].tokens, off[i].tokens);
    EXPECT_EQ(greedy[i].text, off[i].text);
    EXPECT_EQ(seeded[i].tokens, seeded_off[i].tokens);
  }
}

// Target-only greedy decoding in this process, straight on the engine.
inline std::vector<int32_t> EngineGreedy(Backend* target, const std::vector<int32_t>& prompt, int n,
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

}  // namespace router_cluster
}  // namespace specd

#endif  // SPECD_TESTS_INTEGRATION_ROUTER_CLUSTER_FIXTURE_H_
