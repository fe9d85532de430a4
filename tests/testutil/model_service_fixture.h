// What the integration tests of specd-draft and specd-verify share: a client end of one Step
// stream, and a fixture that starts the service executable on free loopback ports and reads
// its /metrics. Header-only so that it needs no library of its own beyond
// specd_service_testutil, which integration tests link.
#ifndef SPECD_TESTS_TESTUTIL_MODEL_SERVICE_FIXTURE_H_
#define SPECD_TESTS_TESTUTIL_MODEL_SERVICE_FIXTURE_H_

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/testutil/service_process.h"

namespace specd {

// A client end of one Step stream of `Service` (v1::Drafter, v1::Verifier), sync API: the test
// thread blocks, the server may not.
template <typename Service, typename Request, typename Response>
class StepStreamClient {
 public:
  explicit StepStreamClient(std::shared_ptr<grpc::Channel> channel)
      : stub_(Service::NewStub(channel)), stream_(stub_->Step(&context_)) {}

  // Writes `request` and reads its reply, which must answer it step for step.
  Response Step(const Request& request) {
    Response response;
    EXPECT_TRUE(stream_->Write(request));
    EXPECT_TRUE(stream_->Read(&response));
    EXPECT_EQ(response.step_id(), request.step_id());
    EXPECT_EQ(response.results_size(), request.steps_size());
    return response;
  }

  grpc::Status Close() {
    stream_->WritesDone();
    return stream_->Finish();
  }

  // Expects the server to have ended the stream (a stopping service): no further reply, and a
  // status other than OK.
  void ExpectEndedByServer() {
    Response response;
    EXPECT_FALSE(stream_->Read(&response));
    EXPECT_FALSE(stream_->Finish().ok());
  }

  grpc::ClientContext& context() { return context_; }
  grpc::ClientReaderWriter<Request, Response>& stream() { return *stream_; }

 private:
  std::unique_ptr<typename Service::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<Request, Response>> stream_;
};

// Starts a model service executable and reads its metrics. Each test file keeps its own
// checkpoint (the services want different shapes).
class ModelServiceTest : public ::testing::Test {
 protected:
  // Starts `binary` (see SpecdBinary()) on free loopback ports, one CPU thread and a short
  // shutdown grace, with `args` after those defaults. Waits until it is serving unless
  // `wait_serving` is false.
  std::unique_ptr<ServiceProcess> StartService(const std::string& binary,
                                               const std::vector<std::string>& args,
                                               bool wait_serving = true) {
    grpc_port_ = PickFreePort();
    metrics_port_ = PickFreePort();
    std::vector<std::string> all = {absl::StrCat("--address=127.0.0.1:", grpc_port_),
                                    absl::StrCat("--metrics_port=", metrics_port_),
                                    "--num_threads=1", "--shutdown_grace_ms=500"};
    all.insert(all.end(), args.begin(), args.end());
    ServiceProcessOptions options{binary, all, absl::StrCat("127.0.0.1:", grpc_port_)};
    absl::StatusOr<std::unique_ptr<ServiceProcess>> p =
        wait_serving ? ServiceProcess::Start(options) : ServiceProcess::Spawn(options);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  }

  // The last started service's /metrics text.
  std::string Metrics() {
    absl::StatusOr<std::string> text = HttpGet("127.0.0.1", metrics_port_, "/metrics");
    EXPECT_TRUE(text.ok()) << text.status();
    return text.ok() ? *text : "";
  }

  double Metric(const std::string& name, const std::map<std::string, std::string>& labels = {}) {
    absl::StatusOr<double> v = MetricValue(Metrics(), name, labels);
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? *v : -1;
  }

  // Polls until Metric(name) == want (stream ends are handled asynchronously).
  void ExpectMetricSoon(const std::string& name, double want,
                        const std::map<std::string, std::string>& labels = {}) {
    const absl::Time end = absl::Now() + absl::Seconds(10);
    double got = -1;
    while (absl::Now() < end) {
      got = Metric(name, labels);
      if (got == want) return;
      absl::SleepFor(absl::Milliseconds(20));
    }
    ADD_FAILURE() << name << " is " << got << ", want " << want;
  }

  int grpc_port_ = 0;
  int metrics_port_ = 0;
};

}  // namespace specd

#endif  // SPECD_TESTS_TESTUTIL_MODEL_SERVICE_FIXTURE_H_
