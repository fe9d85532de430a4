#include "tests/testutil/cpu_cluster.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

struct Models {
  std::string dir;
  std::string target;
  std::string draft;
  absl::Status status;
};

// Written once per process, removed at exit (every cluster is stopped by then).
const Models& TestModels() {
  static const Models* models = [] {
    auto* m = new Models();
    m->dir = MakeTempDir("cpu_cluster");
    m->target = m->dir + "/target";
    m->draft = m->dir + "/draft";
    const std::string cmd =
        absl::StrCat(SpecdBinary("specd-make-test-model"), " --target_dir=", m->target,
                     " --draft_dir=", m->draft,
                     " --hidden_size=64 --intermediate_size=128 --num_layers=4 --draft_layers=1"
                     " --max_position_embeddings=",
                     kCpuClusterMaxContext, " > /dev/null");
    if (std::system(cmd.c_str()) != 0) m->status = absl::InternalError("failed: " + cmd);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(TestModels().dir, ec);
    });
    return m;
  }();
  return *models;
}

std::string Address() { return absl::StrCat("127.0.0.1:", PickFreePort()); }

}  // namespace

absl::StatusOr<std::string> CpuCluster::TestTargetDir() {
  const Models& models = TestModels();
  if (!models.status.ok()) return models.status;
  return models.target;
}

absl::StatusOr<std::unique_ptr<CpuCluster>> CpuCluster::Start(const CpuClusterOptions& options) {
  const Models& models = TestModels();
  if (!models.status.ok()) return models.status;
  const std::string target = options.target_dir.empty() ? models.target : options.target_dir;
  auto c = std::make_unique<CpuCluster>();
  c->verify_metrics = PickFreePort();
  const std::string verify_address = Address();
  c->verify_options = {
      SpecdBinary("specd-verify"),
      {"--address=" + verify_address, absl::StrCat("--metrics_port=", c->verify_metrics),
       "--model=" + target, "--num_threads=1"},
      verify_address,
      options.upstream_credentials};
  c->verify_options.args.insert(c->verify_options.args.end(), options.verify_args.begin(),
                                options.verify_args.end());
  absl::StatusOr<std::unique_ptr<ServiceProcess>> verify = ServiceProcess::Spawn(c->verify_options);
  if (!verify.ok()) return verify.status();
  c->verify = *std::move(verify);
  std::string draft_address;
  if (options.draft) {
    c->draft_metrics = PickFreePort();
    draft_address = Address();
    c->draft_options = {
        SpecdBinary("specd-draft"),
        {"--address=" + draft_address, absl::StrCat("--metrics_port=", c->draft_metrics),
         "--model=" + models.draft, "--num_threads=1"},
        draft_address,
        options.upstream_credentials};
    c->draft_options.args.insert(c->draft_options.args.end(), options.draft_args.begin(),
                                 options.draft_args.end());
    absl::StatusOr<std::unique_ptr<ServiceProcess>> draft = ServiceProcess::Spawn(c->draft_options);
    if (!draft.ok()) return draft.status();
    c->draft = *std::move(draft);
  }
  c->router_metrics = PickFreePort();
  c->router_address = Address();
  std::vector<std::string> args = {
      "--address=" + c->router_address,
      absl::StrCat("--metrics_port=", c->router_metrics),
      "--model=" + target,
      "--verify_address=" + verify_address,
      "--draft_address=" + draft_address,
      absl::StrCat("--max_new_tokens_limit=", kCpuClusterMaxNewTokensLimit)};
  args.insert(args.end(), options.router_args.begin(), options.router_args.end());
  c->router_options = {SpecdBinary("specd-router"), args, c->router_address,
                       options.router_credentials};
  absl::StatusOr<std::unique_ptr<ServiceProcess>> router = ServiceProcess::Spawn(c->router_options);
  if (!router.ok()) return router.status();
  c->router = *std::move(router);
  for (ServiceProcess* p : {c->verify.get(), c->draft.get(), c->router.get()}) {
    if (p == nullptr) continue;
    if (absl::Status s = p->WaitUntilServing(absl::Seconds(60)); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(s.message(), "\n", p->Log()));
    }
  }
  if (options.draft) {
    // The router probes the draft service in the background; wait until it is in use.
    if (absl::Status s = WaitForMetric(c->router_metrics, "specd_draft_available", {}, 1);
        !s.ok()) {
      return s;
    }
  }
  return c;
}

double CpuCluster::Metric(int port, const std::string& name,
                          const std::map<std::string, std::string>& labels) {
  absl::StatusOr<std::string> text = HttpGet("127.0.0.1", port, "/metrics");
  if (!text.ok()) return NAN;
  absl::StatusOr<double> v = MetricValue(*text, name, labels);
  return v.ok() ? *v : NAN;
}

absl::Status CpuCluster::WaitForMetric(int port, const std::string& name,
                                       const std::map<std::string, std::string>& labels,
                                       double want, absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  double v = NAN;
  while (absl::Now() < end) {
    v = Metric(port, name, labels);
    if (v == want) return absl::OkStatus();
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat(name, " is ", v, ", want ", want));
}

}  // namespace specd
