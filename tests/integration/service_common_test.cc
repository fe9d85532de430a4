// The shared service plumbing on its own: the /metrics listener over real HTTP on loopback,
// the Prometheus text it serves (checked by promtool when installed), status mapping, address
// parsing, the health service (Check and Watch), and the metric-text parser the integration
// tests rely on.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/service/grpc_util.h"
#include "common/service/metrics.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/testutil/random_checkpoint.h"
#include "tests/testutil/service_process.h"

namespace specd {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Runs `promtool check metrics` on `text`; returns promtool's output, or nullopt without
// promtool.
std::optional<std::pair<int, std::string>> PromtoolCheck(const std::string& text) {
  if (std::system("command -v promtool >/dev/null 2>&1") != 0) return std::nullopt;
  const std::string dir = MakeTempDir("specd-promtool");
  const std::string in = dir + "/metrics.txt";
  const std::string out = dir + "/out.txt";
  FILE* f = std::fopen(in.c_str(), "w");
  std::fwrite(text.data(), 1, text.size(), f);
  std::fclose(f);
  const int rc = std::system(("promtool check metrics < " + in + " > " + out + " 2>&1").c_str());
  FILE* g = std::fopen(out.c_str(), "r");
  std::string output;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), g)) > 0;) output.append(buf, n);
  std::fclose(g);
  return std::make_pair(rc, output);
}

TEST(MetricsServer, ServesRegistryAndHealthOverHttp) {
  auto registry = std::make_shared<prometheus::Registry>();
  ModelServiceMetrics metrics(*registry);
  metrics.sequences.Set(3);
  metrics.decode_step_seconds.Observe(0.004);
  metrics.step_batch_size.Observe(5);
  metrics.step_tokens.Increment(17);
  metrics.freed_finished.Increment(2);
  std::atomic<bool> healthy{false};
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start({"127.0.0.1", 0}, registry, [&] { return healthy.load(); });
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  ASSERT_GT(port, 0);

  int status = 0;
  absl::StatusOr<std::string> text = HttpGet("127.0.0.1", port, "/metrics", &status);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(status, 200);
  EXPECT_EQ(*MetricValue(*text, "specd_sequences"), 3);
  EXPECT_EQ(*MetricValue(*text, "specd_step_tokens_total"), 17);
  EXPECT_EQ(*MetricValue(*text, "specd_sequences_freed_total", {{"reason", "finished"}}), 2);
  EXPECT_EQ(*MetricValue(*text, "specd_sequences_freed_total", {{"reason", "cancelled"}}), 0);
  EXPECT_EQ(*MetricValue(*text, "specd_step_seconds_count", {{"kind", "decode"}}), 1);
  EXPECT_EQ(*MetricValue(*text, "specd_step_seconds_count", {{"kind", "prefill"}}), 0);
  EXPECT_EQ(*MetricValue(*text, "specd_step_seconds_bucket", {{"kind", "decode"}, {"le", "0.005"}}),
            1);
  EXPECT_EQ(
      *MetricValue(*text, "specd_step_seconds_bucket", {{"kind", "decode"}, {"le", "0.0025"}}), 0);
  EXPECT_EQ(*MetricValue(*text, "specd_step_batch_size_bucket", {{"le", "4"}}), 0);
  EXPECT_EQ(*MetricValue(*text, "specd_step_batch_size_bucket", {{"le", "8"}}), 1);
  EXPECT_THAT(*text, HasSubstr("# TYPE specd_kv_cache_usage_ratio gauge"));
  if (auto check = PromtoolCheck(*text)) {
    EXPECT_EQ(check->first, 0) << check->second;
  }

  HttpGet("127.0.0.1", port, "/health", &status).IgnoreError();
  EXPECT_EQ(status, 503);
  healthy = true;
  HttpGet("127.0.0.1", port, "/health", &status).IgnoreError();
  EXPECT_EQ(status, 200);
  HttpGet("127.0.0.1", port, "/nope", &status).IgnoreError();
  EXPECT_EQ(status, 404);

  (*server)->Stop();
  EXPECT_FALSE(HttpGet("127.0.0.1", port, "/metrics").ok());
}

TEST(MetricsServer, BusyPortIsAnError) {
  auto registry = std::make_shared<prometheus::Registry>();
  absl::StatusOr<std::unique_ptr<MetricsServer>> first =
      MetricsServer::Start({"127.0.0.1", 0}, registry);
  ASSERT_TRUE(first.ok());
  absl::StatusOr<std::unique_ptr<MetricsServer>> second =
      MetricsServer::Start({"127.0.0.1", (*first)->port()}, registry);
  ASSERT_FALSE(second.ok());
  EXPECT_THAT(second.status().message(), HasSubstr("cannot listen"));
}

TEST(Buckets, LatencyBucketsSpan100MicrosecondsTo60Seconds) {
  const auto b = LatencyBuckets();
  ASSERT_FALSE(b.empty());
  EXPECT_DOUBLE_EQ(b.front(), 1e-4);
  EXPECT_DOUBLE_EQ(b.back(), 60.0);
  for (size_t i = 1; i < b.size(); ++i) EXPECT_LT(b[i - 1], b[i]);
  const auto s = BatchSizeBuckets();
  EXPECT_DOUBLE_EQ(s.front(), 1);
  for (size_t i = 1; i < s.size(); ++i) EXPECT_LT(s[i - 1], s[i]);
}

TEST(GrpcUtil, StatusMappingKeepsCodeAndMessage) {
  const absl::Status s = absl::ResourceExhaustedError("kv full");
  const grpc::Status g = ToGrpcStatus(s);
  EXPECT_EQ(g.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(g.error_message(), "kv full");
  EXPECT_EQ(FromGrpcStatus(g), s);
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "x")),
            absl::InvalidArgumentError("x"));
  v1::SequenceError e;
  ToSequenceError(absl::DeadlineExceededError("late"), &e);
  EXPECT_EQ(e.code(), static_cast<int>(grpc::StatusCode::DEADLINE_EXCEEDED));
  EXPECT_EQ(e.message(), "late");
}

TEST(GrpcUtil, ParseHostPort) {
  absl::StatusOr<HostPort> a = ParseHostPort("localhost:50051");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->host, "localhost");
  EXPECT_EQ(a->port, 50051);
  absl::StatusOr<HostPort> b = ParseHostPort("[::1]:7");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->host, "::1");
  EXPECT_EQ(b->port, 7);
  absl::StatusOr<HostPort> c = ParseHostPort(":0");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->host, "");
  EXPECT_EQ(c->port, 0);
  EXPECT_THAT(ParseHostPort("nohost", "--server").status().message(), HasSubstr("--server"));
  EXPECT_FALSE(ParseHostPort("h:70000").ok());
  EXPECT_FALSE(ParseHostPort("h:-1").ok());
  EXPECT_FALSE(ParseHostPort("h:").ok());
  EXPECT_FALSE(ParseHostPort("::1:80").ok());
  EXPECT_FALSE(ParseHostPort("[::1]80").ok());
  EXPECT_EQ(ModelNameFromPath("/models/llama-3/"), "llama-3");
  EXPECT_EQ(ModelNameFromPath("tiny"), "tiny");
}

// A GrpcServer on a free loopback port whose health follows "" and specd.v1.Verifier, and a
// health stub connected to it.
struct HealthTarget {
  std::unique_ptr<GrpcServer> server;
  std::unique_ptr<grpc::health::v1::Health::Stub> stub;
};

HealthTarget StartHealthTarget() {
  absl::StatusOr<std::unique_ptr<GrpcServer>> server =
      GrpcServer::Start({"127.0.0.1:0", {}, {"specd.v1.Verifier"}});
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return {};
  HealthTarget t;
  t.stub = grpc::health::v1::Health::NewStub(
      CreateServiceChannel(absl::StrCat("127.0.0.1:", (*server)->port())));
  t.server = *std::move(server);
  return t;
}

TEST(GrpcUtil, ServerStartsNotServingThenServesAndStaysLive) {
  HealthTarget t = StartHealthTarget();
  ASSERT_NE(t.server, nullptr);
  auto check = [&](const std::string& service) {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    grpc::health::v1::HealthCheckResponse resp;
    grpc::Status st = t.stub->Check(&ctx, req, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return resp.status();
  };
  EXPECT_EQ(check(""), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(check("specd.v1.Verifier"), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  // Liveness does not wait for the model: the process answers, so it is alive.
  EXPECT_EQ(check("liveness"), grpc::health::v1::HealthCheckResponse::SERVING);
  t.server->SetServing(true);
  EXPECT_EQ(check(""), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(check("specd.v1.Verifier"), grpc::health::v1::HealthCheckResponse::SERVING);
  t.server->SetServing(false);
  EXPECT_EQ(check(""), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(check("liveness"), grpc::health::v1::HealthCheckResponse::SERVING);
  t.server->Shutdown(0);
}

TEST(GrpcUtil, UnknownHealthServiceIsNotFound) {
  HealthTarget t = StartHealthTarget();
  ASSERT_NE(t.server, nullptr);
  grpc::ClientContext ctx;
  grpc::health::v1::HealthCheckRequest req;
  req.set_service("specd.v1.Drafter");
  grpc::health::v1::HealthCheckResponse resp;
  const grpc::Status st = t.stub->Check(&ctx, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(st.error_message(), HasSubstr("specd.v1.Drafter"));
}

// DrainAndShutdown waits for the work it is told about, then shuts down at once: it returns as
// soon as the count reaches 0 (well before the grace), or at the grace with what is left.
TEST(GrpcUtil, DrainAndShutdownWaitsForInFlightWorkUpToTheGrace) {
  {
    HealthTarget t = StartHealthTarget();
    ASSERT_NE(t.server, nullptr);
    std::atomic<int64_t> in_flight{2};
    std::thread finisher([&] {
      absl::SleepFor(absl::Milliseconds(100));
      in_flight = 1;
      absl::SleepFor(absl::Milliseconds(100));
      in_flight = 0;
    });
    const absl::Time start = absl::Now();
    EXPECT_EQ(t.server->DrainAndShutdown([&] { return in_flight.load(); }, absl::Seconds(30)), 0);
    const absl::Duration took = absl::Now() - start;
    finisher.join();
    EXPECT_GE(took, absl::Milliseconds(190));
    EXPECT_LT(took, absl::Seconds(10));
    // Shut down: the server no longer answers.
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    grpc::health::v1::HealthCheckResponse resp;
    EXPECT_FALSE(t.stub->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp).ok());
  }
  {
    HealthTarget t = StartHealthTarget();
    ASSERT_NE(t.server, nullptr);
    const absl::Time start = absl::Now();
    EXPECT_EQ(t.server->DrainAndShutdown([] { return int64_t{3}; }, absl::Milliseconds(200)), 3);
    EXPECT_GE(absl::Now() - start, absl::Milliseconds(200));
  }
}

// Watch streams report the current status at once, then every change; at shutdown they get
// NOT_SERVING and end with OK, so they do not hold the server open until its deadline.
TEST(GrpcUtil, HealthWatchFollowsServingUntilShutdown) {
  HealthTarget t = StartHealthTarget();
  ASSERT_NE(t.server, nullptr);
  using Response = grpc::health::v1::HealthCheckResponse;
  struct Watch {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<Response>> reader;
    Response Next() {
      Response r;
      EXPECT_TRUE(reader->Read(&r));
      return r;
    }
  };
  auto watch = [&](const std::string& service) {
    auto w = std::make_unique<Watch>();
    w->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    w->reader = t.stub->Watch(&w->ctx, req);
    return w;
  };
  std::unique_ptr<Watch> all = watch(""), verifier = watch("specd.v1.Verifier"),
                         unknown = watch("specd.v1.Drafter");
  EXPECT_EQ(all->Next().status(), Response::NOT_SERVING);
  EXPECT_EQ(verifier->Next().status(), Response::NOT_SERVING);
  EXPECT_EQ(unknown->Next().status(), Response::SERVICE_UNKNOWN);
  t.server->SetServing(true);
  EXPECT_EQ(all->Next().status(), Response::SERVING);
  EXPECT_EQ(verifier->Next().status(), Response::SERVING);
  // No change, nothing sent: the next reads are the change after it. (Two changes within one
  // write's flight may be merged into the latest, so each change is read before the next.)
  t.server->SetServing(true);
  t.server->SetServing(false);
  EXPECT_EQ(all->Next().status(), Response::NOT_SERVING);
  EXPECT_EQ(verifier->Next().status(), Response::NOT_SERVING);
  t.server->SetServing(true);
  EXPECT_EQ(all->Next().status(), Response::SERVING);
  EXPECT_EQ(verifier->Next().status(), Response::SERVING);

  const absl::Time before = absl::Now();
  t.server->Shutdown(/*grace_ms=*/10000);
  EXPECT_LT(absl::Now() - before, absl::Seconds(5)) << "open Watch streams held the shutdown";
  EXPECT_EQ(all->Next().status(), Response::NOT_SERVING);
  Response r;
  EXPECT_FALSE(all->reader->Read(&r));
  EXPECT_TRUE(all->reader->Finish().ok());
  EXPECT_EQ(verifier->Next().status(), Response::NOT_SERVING);
  EXPECT_FALSE(verifier->reader->Read(&r));
  EXPECT_TRUE(verifier->reader->Finish().ok());
  EXPECT_FALSE(unknown->reader->Read(&r));
  EXPECT_TRUE(unknown->reader->Finish().ok());
}

// A client polling while the server comes up (a readiness probe, a test waiting for a child
// service) must never see SERVING before SetServing(true). gRPC's built-in health service
// answered SERVING in the moment between listening and being told otherwise; under CI load
// that let a test send work to a verify service that was still loading.
TEST(GrpcUtil, HealthIsNeverServingBeforeSetServing) {
  for (int round = 0; round < 10; ++round) {
    const int port = PickFreePort();
    ASSERT_GT(port, 0);
    const std::string address = absl::StrCat("127.0.0.1:", port);
    std::atomic<bool> stop{false};
    std::atomic<int> answers{0}, serving_answers{0};
    std::thread poller([&] {
      grpc::ChannelArguments args = ServiceChannelArguments();
      args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 1);
      args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 1);
      args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 5);
      auto stub = grpc::health::v1::Health::NewStub(
          grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
      while (!stop.load()) {
        grpc::ClientContext ctx;
        ctx.set_wait_for_ready(true);
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
        grpc::health::v1::HealthCheckResponse resp;
        if (stub->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp).ok()) {
          ++answers;
          if (resp.status() == grpc::health::v1::HealthCheckResponse::SERVING) ++serving_answers;
        }
      }
    });
    absl::StatusOr<std::unique_ptr<GrpcServer>> server = GrpcServer::Start({address, {}, {}});
    ASSERT_TRUE(server.ok()) << server.status();
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (answers.load() < 3 && absl::Now() < end) absl::SleepFor(absl::Milliseconds(1));
    stop = true;
    poller.join();
    EXPECT_GE(answers.load(), 3);
    EXPECT_EQ(serving_answers.load(), 0) << "round " << round;
    (*server)->Shutdown(0);
  }
}

// Two test executables running in parallel (ctest -j) never get the same port: a port one
// process picked stays claimed against the others while it lives.
TEST(PickFreePort, PortsAreClaimedAgainstOtherTestProcesses) {
  const int port = PickFreePort();
  ASSERT_GT(port, 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Another process: the parent's port is taken, a fresh one is not.
    const bool parents = ClaimPortAmongTestProcesses(port);
    const int other = PickFreePort();
    _exit(!parents && other > 0 && other != port ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(GrpcUtil, BusyAddressIsAnError) {
  absl::StatusOr<std::unique_ptr<GrpcServer>> first = GrpcServer::Start({"127.0.0.1:0", {}, {}});
  ASSERT_TRUE(first.ok());
  absl::StatusOr<std::unique_ptr<GrpcServer>> second =
      GrpcServer::Start({absl::StrCat("127.0.0.1:", (*first)->port()), {}, {}});
  EXPECT_FALSE(second.ok());
}

TEST(MetricValue, ParsesLabelsAndEscapes) {
  const std::string text =
      "# HELP a x\n# TYPE a counter\na 1\nb{x=\"q\\\"uote\",y=\"2\"} 3.5\nb{y=\"1\"} 4\n"
      "c_bucket{le=\"+Inf\"} 7\n";
  EXPECT_EQ(*MetricValue(text, "a"), 1);
  EXPECT_EQ(*MetricValue(text, "b", {{"y", "2"}, {"x", "q\"uote"}}), 3.5);
  EXPECT_EQ(*MetricValue(text, "b", {{"y", "1"}}), 4);
  EXPECT_EQ(*MetricValue(text, "c_bucket", {{"le", "+Inf"}}), 7);
  EXPECT_EQ(MetricValue(text, "b").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(MetricValue(text, "nope").status().code(), absl::StatusCode::kNotFound);
}

// --help used to print "No flags matched" (Abseil keeps only flags of a file named after the
// program); it lists each binary's own flags, and not Abseil's.
TEST(Help, EveryServiceBinaryListsItsOwnFlags) {
  const std::vector<std::pair<std::string, std::string>> binaries = {
      {"specd-router", "--verify_address"},
      {"specd-verify", "--kv_capacity_tokens"},
      {"specd-draft", "--tree_max_nodes"},
      {"specd-http", "--router"}};
  for (const auto& [binary, flag] : binaries) {
    const std::string command = SpecdBinary(binary) + " --help 2>&1";
    FILE* pipe = popen(command.c_str(), "r");
    ASSERT_NE(pipe, nullptr) << command;
    std::string out;
    char buffer[4096];
    for (size_t n; (n = fread(buffer, 1, sizeof(buffer), pipe)) > 0;) out.append(buffer, n);
    pclose(pipe);
    EXPECT_THAT(out, Not(HasSubstr("No flags matched"))) << binary;
    EXPECT_THAT(out, HasSubstr(flag)) << binary << ":\n" << out;
    EXPECT_THAT(out, HasSubstr("--address")) << binary;
    EXPECT_THAT(out, Not(HasSubstr("--flagfile")))
        << binary << ": Abseil's flags belong to --helpfull";
  }
}

}  // namespace
}  // namespace specd
