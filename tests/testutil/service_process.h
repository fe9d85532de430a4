// Runs a real specd executable as a child process for integration tests: fork/exec with flags,
// wait until its grpc.health.v1 says SERVING, stop it (SIGTERM, then SIGKILL) when done.
// Plus small helpers those tests share: free loopback ports, HTTP GET, Prometheus text parsing.
#ifndef SPECD_TESTS_TESTUTIL_SERVICE_PROCESS_H_
#define SPECD_TESTS_TESTUTIL_SERVICE_PROCESS_H_

#include <sys/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.pb.h"
#include "grpcpp/grpcpp.h"

namespace specd {

// Path of an executable built by this CMake tree, e.g. SpecdBinary("specd-verify").
std::string SpecdBinary(const std::string& name);

// A TCP port on 127.0.0.1 that was free a moment ago (a bind to it succeeded) and that no
// other test process of this machine holds (ClaimPortAmongTestProcesses), so tests running in
// parallel do not collide on fixed ports.
int PickFreePort();

// Claims `port` for this process among the test processes of this machine, until it exits
// (an exclusive flock on $TMPDIR/specd-test-ports/<port>). False when another process holds
// it; true when this process got it, or when the lock directory cannot be used.
bool ClaimPortAmongTestProcesses(int port);

struct ServiceProcessOptions {
  std::string binary;             // absolute path, see SpecdBinary()
  std::vector<std::string> args;  // e.g. {"--model=/tmp/m", "--address=127.0.0.1:5000"}
  // Where the child serves gRPC; health checks and channel() go there.
  std::string grpc_address;
  // How health checks and channel() connect; null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
};

using HealthStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

class ServiceProcess {
 public:
  // Forks and execs the binary without waiting for it. The child's stdout and stderr go to a
  // log file (Log()), and it is killed if the test process dies.
  static absl::StatusOr<std::unique_ptr<ServiceProcess>> Spawn(
      const ServiceProcessOptions& options);

  // Spawn() then WaitUntilServing(); on failure the error carries the child's log.
  static absl::StatusOr<std::unique_ptr<ServiceProcess>> Start(
      const ServiceProcessOptions& options, absl::Duration timeout = absl::Seconds(60));

  // Stops the child if it still runs (SIGTERM, SIGKILL after 10 s). Prints the child's log to
  // stderr when the current test has failed.
  ~ServiceProcess();

  ServiceProcess(const ServiceProcess&) = delete;
  ServiceProcess& operator=(const ServiceProcess&) = delete;

  // grpc.health.v1 Check for `service` ("" = the whole server), with a 1 s deadline.
  absl::StatusOr<HealthStatus> Health(const std::string& service = "");

  // Polls Health() until it answers `want`; fails at `timeout` or as soon as the child exits.
  absl::Status WaitForHealth(HealthStatus want, absl::Duration timeout);

  // WaitForHealth(SERVING, timeout).
  absl::Status WaitUntilServing(absl::Duration timeout = absl::Seconds(60));

  // Sends `sig` and waits up to `timeout` for the child to exit (SIGKILL after that). Returns
  // its exit code, or 128 + the signal that killed it.
  absl::StatusOr<int> Stop(int sig = 15 /* SIGTERM */, absl::Duration timeout = absl::Seconds(10));

  // Waits up to `timeout` for the child to exit on its own; same result as Stop().
  absl::StatusOr<int> WaitForExit(absl::Duration timeout);

  bool Running();
  pid_t pid() const { return pid_; }
  const std::string& address() const { return options_.grpc_address; }
  std::shared_ptr<grpc::Channel> channel();
  std::string Log() const;

 private:
  explicit ServiceProcess(const ServiceProcessOptions& options) : options_(options) {}

  ServiceProcessOptions options_;
  std::string log_path_;
  pid_t pid_ = -1;
  int exit_code_ = -1;  // set once reaped
  std::shared_ptr<grpc::Channel> channel_;
};

// The services a server lists through gRPC server reflection (grpc.reflection.v1alpha), using
// the reflection messages' descriptors that libgrpc++_reflection registers.
absl::StatusOr<std::vector<std::string>> ListServicesByReflection(
    std::shared_ptr<grpc::Channel> channel);

// GET http://host:port/path over loopback. Returns the body; `status` receives the HTTP status.
absl::StatusOr<std::string> HttpGet(const std::string& host, int port, const std::string& path,
                                    int* status = nullptr);

// The value of the sample `name{labels}` in Prometheus text format (labels must match exactly,
// in any order, except that the services' `model` label is ignored unless `labels` names it).
// NOT_FOUND when there is no such sample.
absl::StatusOr<double> MetricValue(const std::string& text, const std::string& name,
                                   const std::map<std::string, std::string>& labels = {});

}  // namespace specd

#endif  // SPECD_TESTS_TESTUTIL_SERVICE_PROCESS_H_
