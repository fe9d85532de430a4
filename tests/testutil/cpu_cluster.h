// A whole specd cluster on the CPU for client tests: specd-verify, specd-draft (optional) and
// specd-router started as real processes on free loopback ports, serving small random models
// that specd-make-test-model writes once per test process (the draft is the target's first
// layer, so drafts are partly accepted). Metrics are read from the services' /metrics.
#ifndef SPECD_TESTS_TESTUTIL_CPU_CLUSTER_H_
#define SPECD_TESTS_TESTUTIL_CPU_CLUSTER_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "tests/testutil/service_process.h"

namespace specd {

// The models' shape as tests see it through the router.
inline constexpr int kCpuClusterMaxContext = 2048;
inline constexpr int kCpuClusterVocabSize = 320;
inline constexpr int kCpuClusterEosId = 256;
inline constexpr int kCpuClusterMaxNewTokensLimit = 4000;

struct CpuClusterOptions {
  bool draft = true;
  std::vector<std::string> router_args;  // appended to the router's flags
  std::vector<std::string> verify_args, draft_args;  // appended to those services' flags
  // The target model verify and router serve; empty: the random test model. It must have the
  // random model's vocabulary (TestTargetDir() has a tokenizer to copy beside it).
  std::string target_dir;
  // How the test's health checks reach the services (TLS clusters); null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> router_credentials, upstream_credentials;
};

class CpuCluster {
 public:
  // Starts the services and waits until they serve (and, with a draft service, until the
  // router uses it).
  static absl::StatusOr<std::unique_ptr<CpuCluster>> Start(const CpuClusterOptions& options = {});

  // The folder of the random target model (config, weights, tokenizer.json).
  static absl::StatusOr<std::string> TestTargetDir();

  // The value of a metric sample on the /metrics of `port`; NaN when it cannot be read.
  static double Metric(int port, const std::string& name,
                       const std::map<std::string, std::string>& labels = {});

  // Polls until the metric equals `want`; the error says what it was instead.
  static absl::Status WaitForMetric(int port, const std::string& name,
                                    const std::map<std::string, std::string>& labels, double want,
                                    absl::Duration timeout = absl::Seconds(10));

  std::string router_address;
  int router_metrics = 0, verify_metrics = 0, draft_metrics = 0;
  ServiceProcessOptions verify_options, draft_options, router_options;
  std::unique_ptr<ServiceProcess> verify, draft, router;
};

}  // namespace specd

#endif  // SPECD_TESTS_TESTUTIL_CPU_CLUSTER_H_
