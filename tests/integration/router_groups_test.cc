// Several verify groups and draft services behind the router (services/router/group_pool.h),
// as processes on loopback: specd-verify and specd-draft services, one or two specd-router in
// front, or the router's group pool in this process where the test plays the DNS resolver.
// Which service served a request is read from the services' own /metrics
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
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/service/grpc_util.h"
#include "common/text/tokenizer.h"
#include "engine/backend.h"
#include "engine/model_config.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "services/router/group_pool.h"
#include "services/router/router_metrics.h"
#include "specd/v1/generation.grpc.pb.h"
#include "tests/integration/router_cluster_fixture.h"
#include "tests/testutil/random_checkpoint.h"
#include "tests/testutil/service_process.h"
#include "tests/testutil/test_pki.h"

namespace specd {
namespace {

namespace fs = std::filesystem;
using router_cluster::EngineGreedy;

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
  // Sequences this service holds now.
  double Live() const { return Metric(metrics_port, "specd_sequences"); }
  // Sequences this service finished normally, and those cut short, since it started.
  double Finished() const {
    return Metric(metrics_port, "specd_sequences_freed_total", {{"reason", "finished"}});
  }
  double Cancelled() const {
    return Metric(metrics_port, "specd_sequences_freed_total", {{"reason", "cancelled"}});
  }
};

struct ClusterShape {
  int routers = 1;
  int verifies = 2;
  int drafts = 2;
  // The router reaches the services by dns:///localhost:PORT (the system's resolver) rather
  // than by their addresses (one verify and one draft service).
  bool by_localhost = false;
  std::vector<std::string> router_args;  // more router flags
};

class Groups {
 public:
  // `shape.verifies` verify and `shape.drafts` draft services, then `shape.routers` routers over
  // all of them; nullptr on failure.
  static std::unique_ptr<Groups> Start(ClusterShape shape = {}) {
    const Models& models = TestModels();
    auto g = std::make_unique<Groups>();
    for (int i = 0; i < shape.verifies; ++i) {
      g->verify.push_back(Model::Make("specd-verify", models.target));
    }
    for (int i = 0; i < shape.drafts; ++i) {
      g->draft.push_back(Model::Make("specd-draft", models.draft));
    }
    std::vector<std::string> verify_list, draft_list;
    for (std::vector<Model>* list : {&g->verify, &g->draft}) {
      for (Model& m : *list) {
        const absl::Status s = m.Spawn();
        EXPECT_TRUE(s.ok()) << s;
        if (!s.ok()) return nullptr;
        std::string address = m.options.grpc_address;
        if (shape.by_localhost) {
          address = absl::StrCat(kDnsScheme, "localhost", address.substr(address.rfind(':')));
        }
        (list == &g->verify ? verify_list : draft_list).push_back(address);
      }
    }
    const int routers = shape.routers;
    for (int r = 0; r < routers; ++r) {
      const int metrics_port = PickFreePort();
      const std::string address = absl::StrCat("127.0.0.1:", PickFreePort());
      std::vector<std::string> args = {"--address=" + address,
                                       absl::StrCat("--metrics_port=", metrics_port),
                                       "--model=" + models.target,
                                       "--verify_address=" + absl::StrJoin(verify_list, ","),
                                       "--draft_address=" + absl::StrJoin(draft_list, ","),
                                       "--max_batch=64",
                                       "--max_new_tokens_limit=4000"};
      args.insert(args.end(), shape.router_args.begin(), shape.router_args.end());
      absl::StatusOr<std::unique_ptr<ServiceProcess>> router =
          ServiceProcess::Spawn({SpecdBinary("specd-router"), args, address});
      EXPECT_TRUE(router.ok()) << router.status();
      if (!router.ok()) return nullptr;
      g->router_metrics.push_back(metrics_port);
      g->routers.push_back(*std::move(router));
    }
    std::vector<ServiceProcess*> all;
    for (std::vector<Model>* list : {&g->verify, &g->draft}) {
      for (Model& m : *list) all.push_back(m.process.get());
    }
    for (auto& r : g->routers) all.push_back(r.get());
    for (ServiceProcess* p : all) {
      const absl::Status s = p->WaitUntilServing(absl::Seconds(60));
      EXPECT_TRUE(s.ok()) << s << "\n" << p->Log();
      if (!s.ok()) return nullptr;
    }
    for (auto& r : g->routers) g->stubs.push_back(v1::Generation::NewStub(r->channel()));
    // The router serves once one group is up; wait until every group is, and drafting. One
    // group by address has the router's gauges; otherwise each group has its own.
    const bool labelled = shape.verifies > 1 || shape.by_localhost;
    for (int r = 0; r < routers; ++r) {
      for (int i = 0; i < shape.verifies; ++i) {
        const std::string group = labelled ? absl::StrCat(i) : "";
        // Every draft service's stream, not only one: a sequence placed on a draft service
        // whose stream is not up yet runs target-only.
        if (!g->WaitForGroup(r, group, "specd_verify_available") ||
            (shape.drafts > 0 &&
             !g->WaitForGroup(r, group, "specd_draft_services_up", shape.drafts))) {
          return nullptr;
        }
      }
    }
    // Placement reads each draft service's load from its GetInfo (polled every 250 ms by
    // default) and counts a service only once that has answered: its stream can be up first,
    // when the first poll came before the service listened. Two polls later every one has.
    if (shape.drafts > 1) absl::SleepFor(absl::Milliseconds(600));
    return g;
  }

  // Polls router `r`'s gauge `name` of verify group `group` ("": the router's own) until it
  // reads `want` (20 s).
  bool WaitForGroup(int r, const std::string& group, const std::string& name, double want = 1) {
    std::map<std::string, std::string> labels;
    if (!group.empty()) labels["verify_group"] = group;
    const absl::Time end = absl::Now() + absl::Seconds(20);
    double v = NAN;
    while ((v = Metric(router_metrics[r], name, labels)) != want && absl::Now() < end) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_EQ(v, want) << name << "{verify_group=\"" << group << "\"} of router " << r;
    return v == want;
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

// Greedy with a fixed tree shape: every step drafts, so every sequence is held (and freed) by
// the draft service it was placed on.
v1::GenerateRequest Drafted(const std::string& prompt, int max_new_tokens) {
  v1::GenerateRequest r = Greedy(prompt, max_new_tokens);
  r.set_draft_depth(3);
  r.set_draft_top_k(2);
  r.set_draft_max_nodes(6);
  return r;
}

std::string PromptOf(int i) {
  static const char* const kSeeds[] = {
      "def fibonacci(n):",   "import numpy as np\n", "class Stack:\n    def", "for i in range(",
      "The quick brown fox", "SELECT * FROM",        "#include <stdio.h>",    "while True:\n"};
  return absl::StrCat(kSeeds[i % 8], " ", i);
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

// Engine greedy output of PromptOf(i) for i in [0, n), `tokens` long.
std::vector<std::vector<int32_t>> References(int n, int tokens) {
  std::vector<std::vector<int32_t>> out;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
      Tokenizer::FromModelDir(TestModels().target);
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  BackendOptions bo;
  bo.num_threads = 1;
  absl::StatusOr<std::unique_ptr<Backend>> target = CreateBackend(TestModels().target, bo);
  EXPECT_TRUE(target.ok()) << target.status();
  if (!tokenizer.ok() || !target.ok()) return out;
  for (int i = 0; i < n; ++i) {
    const std::vector<int32_t> prompt = (*tokenizer)->Encode(PromptOf(i), true);
    out.push_back(EngineGreedy(target->get(), prompt, tokens, i + 1));
  }
  return out;
}

// |a - b| within `fraction` of their mean.
void ExpectBalanced(double a, double b, double fraction, const char* what = "verify group") {
  std::printf("sequences per %s: %g and %g\n", what, a, b);
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
  for (int i = 0; i < kStreams; ++i) requests.push_back(Drafted(PromptOf(i), kTokens));
  const std::vector<Result> results = g->GenerateAll(requests);
  for (const Result& r : results) ASSERT_TRUE(r.status.ok()) << r.status.error_message();

  auto total = [&] { return g->verify[0].Finished() + g->verify[1].Finished(); };
  EXPECT_EQ(WaitFor(total, kStreams), kStreams);
  ExpectBalanced(g->verify[0].Finished(), g->verify[1].Finished(), 0.2);
  // The draft services are chosen by their own load, apart from the groups: balanced too.
  auto drafted = [&] { return g->draft[0].Finished() + g->draft[1].Finished(); };
  EXPECT_EQ(WaitFor(drafted, kStreams), kStreams);
  ExpectBalanced(g->draft[0].Finished(), g->draft[1].Finished(), 0.2, "draft service");

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
  std::unique_ptr<Groups> g = Groups::Start({.routers = 2});
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

// Two routers on one draft service and one verify service: the draft service drafts both
// routers' sequences in shared batches (one forward a level for both: its gather window waits
// for the other router's step, and the verify service's keeps the routers in step), and every
// output equals the target's greedy decoding (speculation off).
TEST(RouterGroupsTest, TwoRoutersOnOneDraftServiceDraftInSharedBatches) {
  std::unique_ptr<Groups> g = Groups::Start({.routers = 2, .verifies = 1, .drafts = 1});
  ASSERT_NE(g, nullptr);
  constexpr int kStreams = 16, kTokens = 96;
  const std::vector<std::vector<int32_t>> want = References(kStreams, kTokens);
  ASSERT_EQ(want.size(), static_cast<size_t>(kStreams));
  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < kStreams; ++i) requests.push_back(Drafted(PromptOf(i), kTokens));
  const int port = g->draft[0].metrics_port;
  const double merged_before = Metric(port, "specd_step_merged_streams_total");
  ASSERT_EQ(merged_before, 0);
  const std::vector<Result> results = g->GenerateAll(requests);
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(results[i].status.ok()) << results[i].status.error_message();
    EXPECT_EQ(results[i].tokens, want[i]) << "request " << i;
  }
  // Both services' gather windows keep the routers in step once they meet: most draft steps
  // serve both (without the windows, a few percent met by chance).
  const double merged = Metric(port, "specd_step_merged_streams_total");
  const double steps = Metric(port, "specd_step_seconds_count", {{"kind", "decode"}}) +
                       Metric(port, "specd_step_seconds_count", {{"kind", "prefill"}});
  std::printf("draft steps serving both routers: %g of %g\n", merged, steps);
  EXPECT_GE(merged * 5, steps);
}

}  // namespace
}  // namespace specd

namespace specd {
namespace {

// One verify group and two draft services: each sequence's draft service is chosen by load, not
// by its group, and a draft service killed mid-run costs speculation, never a request. The
// router pre-drafts while verify runs (--overlap=on), one pre-draft message to each draft
// service a step.
TEST(RouterGroupsTest, DraftServicesChosenByLoadAndAKilledOneLosesNothing) {
  std::unique_ptr<Groups> g =
      Groups::Start({.verifies = 1, .drafts = 2, .router_args = {"--overlap=on"}});
  ASSERT_NE(g, nullptr);
  constexpr int kStreams = 64, kTokens = 48, kLong = 32, kLongTokens = 160;
  const std::vector<std::vector<int32_t>> want = References(kStreams, kLongTokens);
  ASSERT_EQ(want.size(), static_cast<size_t>(kStreams));
  auto expect_output = [&](int i, const Result& r, int tokens) {
    EXPECT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.tokens, std::vector<int32_t>(want[i].begin(), want[i].begin() + tokens))
        << PromptOf(i);
  };

  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < kStreams; ++i) requests.push_back(Drafted(PromptOf(i), kTokens));
  std::vector<Result> results = g->GenerateAll(requests);
  for (int i = 0; i < kStreams; ++i) expect_output(i, results[i], kTokens);
  auto drafted = [&] { return g->draft[0].Finished() + g->draft[1].Finished(); };
  EXPECT_EQ(WaitFor(drafted, kStreams), kStreams);
  ExpectBalanced(g->draft[0].Finished(), g->draft[1].Finished(), 0.2, "draft service");
  // Pre-drafts went out (those whose step accepted nothing are counted at position 0).
  double predrafts = 0;
  for (const char* result : {"hit", "miss"}) {
    predrafts += Metric(g->router_metrics[0], "specd_predraft_outcomes_total",
                        {{"position", "0"}, {"result", result}});
  }
  EXPECT_GT(predrafts, 0);

  // Draft service 1 is killed once every stream has its first chunk (all are placed): its
  // sequences go on target-only, and every output is still the engine's.
  requests.clear();
  for (int i = 0; i < kLong; ++i) requests.push_back(Drafted(PromptOf(i), kLongTokens));
  std::atomic<int> started{0};
  results = g->GenerateAll(requests, [&] {
    if (++started == kLong) ::kill(g->draft[1].process->pid(), SIGKILL);
  });
  ASSERT_EQ(started.load(), kLong);
  for (int i = 0; i < kLong; ++i) expect_output(i, results[i], kLongTokens);

  // New sequences draft through the one that is left.
  EXPECT_EQ(WaitFor([&] { return g->draft[0].Live(); }, 0), 0);
  const double before = g->draft[0].Finished();
  requests.clear();
  for (int i = 0; i < 8; ++i) requests.push_back(Drafted(PromptOf(i), 16));
  results = g->GenerateAll(requests);
  for (int i = 0; i < 8; ++i) expect_output(i, results[i], 16);
  EXPECT_EQ(WaitFor([&] { return g->draft[0].Finished(); }, before + 8), before + 8);
}

// Where a request's chunks go in the in-process pool: collects them until Finish.
class CollectingSink : public ResponseSink {
 public:
  explicit CollectingSink(std::function<void()> on_first_chunk)
      : on_first_chunk_(std::move(on_first_chunk)) {}
  void Write(v1::GenerateResponse chunk) override {
    bool first;
    {
      absl::MutexLock lock(&mu_);
      result_.tokens.insert(result_.tokens.end(), chunk.token_ids().begin(),
                            chunk.token_ids().end());
      first = result_.chunks++ == 0;
    }
    if (first && on_first_chunk_) on_first_chunk_();
  }
  void Finish(const grpc::Status& status) override {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    result_.status = status;
    finished_ = true;
  }
  bool Cancelled() const override { return false; }
  Result Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&finished_));
    return result_;
  }

 private:
  const std::function<void()> on_first_chunk_;
  absl::Mutex mu_;
  Result result_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

// The router's group pool in this process, over two names the test resolves:
// dns:///verify.test:1 and dns:///draft.test:1 stand for the addresses last Set().
class ResolvedPool {
 public:
  ResolvedPool(std::vector<std::string> verify, std::vector<std::string> draft)
      : verify_(std::move(verify)), draft_(std::move(draft)), metrics_(registry_) {
    absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
        Tokenizer::FromModelDir(TestModels().target);
    EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = *std::move(tokenizer);
    absl::StatusOr<ModelConfig> config = LoadModelConfig(TestModels().target);
    EXPECT_TRUE(config.ok()) << config.status();
    GroupPoolOptions o;
    o.loop.max_batch = 64;
    o.loop.limits.vocab_size = config->vocab_size;
    o.loop.limits.max_context = config->max_position_embeddings;
    o.loop.limits.eos_token_ids = config->eos_token_ids;
    o.verify_addresses = {absl::StrCat(kDnsScheme, "verify.test:1")};
    o.draft_addresses = {absl::StrCat(kDnsScheme, "draft.test:1")};
    o.resolve_interval = absl::Milliseconds(200);
    o.resolver = [this](const std::string& name) -> absl::StatusOr<std::vector<std::string>> {
      absl::MutexLock lock(&mu_);
      if (name == "verify.test:1") return verify_;
      if (name == "draft.test:1") return draft_;
      return absl::NotFoundError(absl::StrCat(name, " does not resolve"));
    };
    pool_ = std::make_unique<GroupPool>(o, tokenizer_.get(), &registry_, &metrics_, nullptr);
    pool_->Start();
  }
  ~ResolvedPool() { pool_->Stop(); }

  void Set(std::vector<std::string> verify, std::vector<std::string> draft) {
    absl::MutexLock lock(&mu_);
    verify_ = std::move(verify);
    draft_ = std::move(draft);
  }
  GroupPool& pool() { return *pool_; }

  // Generates PromptOf(i) for i in `which` at once, `tokens` each.
  std::vector<Result> Run(const std::vector<int>& which, int tokens,
                          const std::function<void()>& on_first_chunk = nullptr) {
    std::vector<Result> results(which.size());
    std::vector<std::thread> threads;
    for (size_t k = 0; k < which.size(); ++k) {
      threads.emplace_back([&, k] {
        RouterRequest r;
        r.prompt = tokenizer_->Encode(PromptOf(which[k]), true);
        r.max_new_tokens = tokens;
        r.ignore_eos = true;
        r.speculation = v1::SPECULATION_DRAFT_MODEL;
        r.shape = {3, 2, 6};
        r.shape_explicit = true;
        r.arrival = absl::Now();
        auto sink = std::make_shared<CollectingSink>(on_first_chunk);
        const absl::Status s = pool_->Submit(std::move(r), sink);
        results[k] = s.ok() ? sink->Wait() : Result{ToGrpcStatus(s)};
      });
    }
    for (std::thread& t : threads) t.join();
    return results;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> verify_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> draft_ ABSL_GUARDED_BY(mu_);
  prometheus::Registry registry_;
  RouterMetrics metrics_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<GroupPool> pool_;
};

bool WaitUntil(const std::function<bool()>& done, absl::Duration timeout = absl::Seconds(20)) {
  const absl::Time end = absl::Now() + timeout;
  while (!done()) {
    if (absl::Now() > end) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

std::vector<int> Range(int from, int to) {
  std::vector<int> out;
  for (int i = from; i < to; ++i) out.push_back(i);
  return out;
}

// Groups and draft services follow what a DNS name resolves to: an address that appears takes
// new sequences, one that disappears takes none, finishes what it holds and is closed, and one
// that disappears because its service died fails only its own sequences.
TEST(RouterGroupsTest, GroupsFollowTheAddressesANameResolvesTo) {
  std::unique_ptr<Groups> g = Groups::Start({.routers = 0});
  ASSERT_NE(g, nullptr);
  const std::string v0 = g->verify[0].options.grpc_address;
  const std::string v1 = g->verify[1].options.grpc_address;
  const std::string d0 = g->draft[0].options.grpc_address;
  const std::string d1 = g->draft[1].options.grpc_address;
  constexpr int kTokens = 40, kLongTokens = 160;
  const std::vector<std::vector<int32_t>> want = References(32, kLongTokens);
  ASSERT_EQ(want.size(), 32u);
  auto expect_output = [&](int i, const Result& r, int tokens) {
    EXPECT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.tokens, std::vector<int32_t>(want[i].begin(), want[i].begin() + tokens))
        << PromptOf(i);
  };

  // One address each: everything goes there.
  ResolvedPool p({v0}, {d0});
  ASSERT_TRUE(WaitUntil([&] { return p.pool().groups_up() == 1 && p.pool().drafts_up() == 1; }));
  std::vector<Result> results = p.Run(Range(0, 8), kTokens);
  for (int i = 0; i < 8; ++i) expect_output(i, results[i], kTokens);
  EXPECT_EQ(WaitFor([&] { return g->verify[0].Finished(); }, 8), 8);
  EXPECT_EQ(WaitFor([&] { return g->draft[0].Finished(); }, 8), 8);
  EXPECT_EQ(g->verify[1].Finished(), 0);

  // Two addresses each, picked up by the periodic resolution: new sequences spread over both.
  p.Set({v0, v1}, {d0, d1});
  ASSERT_TRUE(WaitUntil([&] { return p.pool().groups_up() == 2 && p.pool().drafts_up() == 2; }));
  EXPECT_EQ(p.pool().draft_addresses(), (std::vector<std::string>{d0, d1}));
  results = p.Run(Range(0, 32), kTokens);
  for (int i = 0; i < 32; ++i) expect_output(i, results[i], kTokens);
  auto verified = [&] { return g->verify[0].Finished() + g->verify[1].Finished(); };
  auto drafted = [&] { return g->draft[0].Finished() + g->draft[1].Finished(); };
  EXPECT_EQ(WaitFor(verified, 40), 40);
  EXPECT_EQ(WaitFor(drafted, 40), 40);
  ExpectBalanced(g->verify[0].Finished() - 8, g->verify[1].Finished(), 0.25);
  ExpectBalanced(g->draft[0].Finished() - 8, g->draft[1].Finished(), 0.25, "draft service");

  // v1 and d1 leave the name while 16 long streams run on both (from a thread of the test, once
  // every stream has its first chunk): theirs finish normally, new ones go to v0 and d0 only,
  // and v1 and d1 are closed once drained.
  std::atomic<int> started{0};
  absl::Notification all_started;
  std::thread mover([&] {
    all_started.WaitForNotification();
    p.Set({v0}, {d0});
    p.pool().Refresh();
  });
  results = p.Run(Range(0, 16), kLongTokens, [&] {
    if (++started == 16) all_started.Notify();
  });
  mover.join();
  for (int i = 0; i < 16; ++i) expect_output(i, results[i], kLongTokens);
  EXPECT_EQ(p.pool().verify_addresses(), std::vector<std::string>{v0});
  ASSERT_TRUE(WaitUntil([&] { return p.pool().num_groups() == 1 && p.pool().num_drafts() == 1; }));
  EXPECT_EQ(WaitFor(verified, 56), 56);
  EXPECT_EQ(g->verify[1].Cancelled(), 0);
  const double v1_done = g->verify[1].Finished(), d1_done = g->draft[1].Finished();
  EXPECT_GT(v1_done, 8);  // it served its share of the long streams
  results = p.Run(Range(0, 8), kTokens);
  for (int i = 0; i < 8; ++i) expect_output(i, results[i], kTokens);
  EXPECT_EQ(WaitFor(verified, 64), 64);
  EXPECT_EQ(g->verify[1].Finished(), v1_done);
  EXPECT_EQ(g->draft[1].Finished(), d1_done);

  // v1 comes back, then leaves the name because its service died: its sequences fail with
  // UNAVAILABLE, v0's finish, and the group is closed.
  p.Set({v0, v1}, {d0});
  p.pool().Refresh();
  ASSERT_TRUE(WaitUntil([&] { return p.pool().groups_up() == 2; }));
  const double v0_before = g->verify[0].Finished();
  started = 0;
  absl::Notification all_started_again;
  std::thread killer([&] {
    all_started_again.WaitForNotification();
    p.Set({v0}, {d0});
    p.pool().Refresh();
    ::kill(g->verify[1].process->pid(), SIGKILL);
  });
  results = p.Run(Range(0, 16), kLongTokens, [&] {
    if (++started == 16) all_started_again.Notify();
  });
  killer.join();
  int ok = 0, unavailable = 0;
  for (int i = 0; i < 16; ++i) {
    if (results[i].status.ok()) {
      ++ok;
      expect_output(i, results[i], kLongTokens);
    } else {
      EXPECT_EQ(results[i].status.error_code(), grpc::StatusCode::UNAVAILABLE)
          << results[i].status.error_message();
      ++unavailable;
    }
  }
  EXPECT_EQ(ok + unavailable, 16);
  EXPECT_GT(ok, 0);
  EXPECT_GT(unavailable, 0);
  // v0 lost nothing: every sequence it held finished, and those are exactly the OK ones.
  EXPECT_EQ(WaitFor([&] { return g->verify[0].Finished(); }, v0_before + ok), v0_before + ok);
  ASSERT_TRUE(WaitUntil([&] { return p.pool().num_groups() == 1; }));
  EXPECT_TRUE(p.pool().verify_up());
}

// With TLS, an address resolved from a name is checked against that name: a verify service whose
// certificate names only localhost (no address) serves a router given dns:///localhost:PORT
// (resolved to 127.0.0.1:PORT), and is refused by a router given 127.0.0.1:PORT.
TEST(RouterGroupsTest, ResolvedAddressesAreCheckedAgainstTheNameWithTls) {
  absl::StatusOr<TestPki> pki = MakeTestPki("router_groups_pki");
  ASSERT_TRUE(pki.ok()) << pki.status();
  Model verify = Model::Make("specd-verify", TestModels().target);
  verify.options.args.push_back("--tls_cert=" + pki->Path("named-server.pem"));
  verify.options.args.push_back("--tls_key=" + pki->Path("named-server.key"));
  ASSERT_TRUE(verify.Spawn().ok());
  const std::string port =
      verify.options.grpc_address.substr(verify.options.grpc_address.rfind(':') + 1);
  struct Router {
    int metrics_port = PickFreePort();
    std::unique_ptr<ServiceProcess> process;
  };
  auto start = [&](const std::string& verify_address) {
    Router r;
    const std::string address = absl::StrCat("127.0.0.1:", PickFreePort());
    absl::StatusOr<std::unique_ptr<ServiceProcess>> p = ServiceProcess::Spawn(
        {SpecdBinary("specd-router"),
         {"--address=" + address, absl::StrCat("--metrics_port=", r.metrics_port),
          "--model=" + TestModels().target, "--verify_address=" + verify_address,
          "--upstream_tls_ca=" + pki->Path("ca.pem")},
         address});
    EXPECT_TRUE(p.ok()) << p.status();
    if (p.ok()) r.process = *std::move(p);
    return r;
  };
  Router named = start(absl::StrCat(kDnsScheme, "localhost:", port));
  Router by_address = start("127.0.0.1:" + port);
  ASSERT_NE(named.process, nullptr);
  ASSERT_NE(by_address.process, nullptr);
  const absl::Status serving = named.process->WaitUntilServing(absl::Seconds(60));
  ASSERT_TRUE(serving.ok()) << serving << "\n" << named.process->Log() << verify.process->Log();

  const std::vector<std::vector<int32_t>> want = References(2, 16);
  ASSERT_EQ(want.size(), 2u);
  auto generate = [&](Router& r, int i, int tokens) {
    auto stub = v1::Generation::NewStub(r.process->channel());
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    Result out;
    auto reader = stub->Generate(&ctx, Greedy(PromptOf(i), tokens));
    v1::GenerateResponse chunk;
    while (reader->Read(&chunk)) {
      out.tokens.insert(out.tokens.end(), chunk.token_ids().begin(), chunk.token_ids().end());
    }
    out.status = reader->Finish();
    return out;
  };
  for (int i = 0; i < 2; ++i) {
    const Result r = generate(named, i, 16);
    EXPECT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.tokens, want[i]) << PromptOf(i);
  }
  // By its address the handshake fails (the certificate does not name 127.0.0.1): the router
  // never sees the service up, which the named router did in the same time.
  EXPECT_EQ(Metric(by_address.metrics_port, "specd_verify_available"), 0);
  EXPECT_EQ(generate(by_address, 0, 4).status.error_code(), grpc::StatusCode::UNAVAILABLE);
}

// The real resolver: localhost resolves (to 127.0.0.1 at least), and a router given
// dns:///localhost:PORT entries serves through it.
TEST(RouterGroupsTest, LocalhostThroughTheSystemResolver) {
  absl::StatusOr<std::vector<std::string>> found = ResolveAll("localhost:50052");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_NE(std::find(found->begin(), found->end(), "127.0.0.1:50052"), found->end())
      << absl::StrJoin(*found, ",");
  EXPECT_FALSE(ResolveAll("no-such-host.invalid:1").ok());
  EXPECT_FALSE(ResolveAll("localhost").ok());  // no port

  std::unique_ptr<Groups> g = Groups::Start({.verifies = 1, .drafts = 1, .by_localhost = true});
  ASSERT_NE(g, nullptr);
  constexpr int kTokens = 24;
  const std::vector<std::vector<int32_t>> want = References(4, kTokens);
  ASSERT_EQ(want.size(), 4u);
  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < 4; ++i) requests.push_back(Drafted(PromptOf(i), kTokens));
  const std::vector<Result> results = g->GenerateAll(requests);
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(results[i].status.ok()) << results[i].status.error_message();
    EXPECT_EQ(results[i].tokens, want[i]) << PromptOf(i);
  }
  EXPECT_EQ(WaitFor([&] { return g->verify[0].Finished(); }, 4), 4);
  EXPECT_EQ(WaitFor([&] { return g->draft[0].Finished(); }, 4), 4);
}

}  // namespace
}  // namespace specd
