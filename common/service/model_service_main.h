// The process life of a model service executable (specd-draft, specd-verify), shared so both
// start, report readiness and shut down the same way:
//   start the gRPC server (health NOT_SERVING) and the /metrics + /health listener, so probes
//   answer while the model loads; load the model and start its loop; mark health SERVING;
//   on SIGTERM/SIGINT mark NOT_SERVING and drain: sequences already running go on (up to the
//   grace period), new ones are refused; once none is left the server shuts down at once (open
//   Step streams end, so a router sees the service go), then the loop and the metrics listener
//   stop.
// Flags stay in each main.cc; this takes their values as an option struct.
#ifndef SPECD_COMMON_SERVICE_MODEL_SERVICE_MAIN_H_
#define SPECD_COMMON_SERVICE_MODEL_SERVICE_MAIN_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/service/metrics.h"
#include "grpcpp/grpcpp.h"

namespace specd {

// What RunModelService needs of a loaded model's loop.
class ModelLoop {
 public:
  virtual ~ModelLoop() = default;
  // The model's name as GetInfo reports it.
  virtual const std::string& model_name() const = 0;
  // From now on steps that would start a new sequence get UNAVAILABLE; steps of sequences
  // already running go on. Called when the service is told to stop.
  virtual void BeginDrain() = 0;
  // Sequences the loop holds, as of its last batch (any thread).
  virtual int64_t LiveSequences() const = 0;
  // Cached tokens / KV capacity as of its last batch (any thread); 0 without a KV cache.
  virtual double KvCacheUsage() const = 0;
  // What the model settled on when it loaded (KV tokens, sequences), for the "serving" line.
  virtual std::string CapacitySummary() const { return ""; }
  // Answers what is queued, frees every sequence and joins the loop thread. Called after the
  // gRPC server has shut down.
  virtual void Stop() = 0;
};

// The vLLM-style line a service prints when it starts serving: the KV capacity it settled on
// and how many sequences that holds. `capacity_tokens` 0: no KV cache.
std::string KvCapacityLine(int64_t capacity_tokens, int64_t max_context, int max_sequences);

struct ModelServiceOptions {
  std::string name;       // executable name, prefixes the log lines: "specd-draft"
  std::string address;    // gRPC listen address, "host:port" (--address)
  int metrics_port = 0;   // /metrics and /health, on the host of `address`
  grpc::Service* service = nullptr;  // not owned; must outlive RunModelService
  std::string service_full_name;     // health status name, e.g. v1::Drafter::service_full_name()
  std::string loading;    // what the startup log line says is being loaded
  std::string device;     // where the model runs, for the "serving" log line
  // The model folder (--model); its name is the `model` label of every specd_ metric.
  std::string model;
  int startup_delay_ms = 0;     // wait before loading (readiness probes in tests)
  int shutdown_grace_ms = 5000;  // how long running sequences may go on after a signal
  // TLS of the gRPC listener (see common/service/tls_options.h); null: plaintext. The
  // /metrics + /health listener stays plaintext (probes and Prometheus scrape it).
  std::shared_ptr<grpc::ServerCredentials> credentials;
  bool reflection = false;  // serve grpc.reflection
};

// Logs `status`'s message as an error and returns EXIT_FAILURE: how a service reports a bad
// flag or a failed start.
int FailStartup(const absl::Status& status);

// Checks `options.address` (errors name --address). RunModelService checks it too; calling
// this first lets main.cc report a bad address before its own flag errors.
absl::Status CheckModelServiceOptions(const ModelServiceOptions& options);

// Loads the model with `create_loop` and serves until SIGTERM/SIGINT. `create_loop` runs once
// both listeners are up; it must also fill the service's GetInfo answer on success, and on
// failure answer anything already queued (the server is shut down right after). Returns the
// process exit code.
int RunModelService(
    const ModelServiceOptions& options,
    const std::function<absl::StatusOr<std::unique_ptr<ModelLoop>>(ModelServiceMetrics*)>&
        create_loop);

}  // namespace specd

#endif  // SPECD_COMMON_SERVICE_MODEL_SERVICE_MAIN_H_
