// specd's grpc.health.v1.Health service (gRPC's doc/health-checking.md): Check and Watch over a
// status table that starts NOT_SERVING.
//
// gRPC's built-in service (grpc::EnableDefaultHealthCheckService) reports "" as SERVING from the
// moment the server listens, until the caller can reach the server to say otherwise. A client
// that polls during that window (a test's wait-until-serving loop, a Kubernetes probe, a router
// waiting for its verify service) sees SERVING while the model is still loading, sends work, and
// gets UNAVAILABLE. This table is filled before the server starts, so the first answer is
// already the truth.
#ifndef SPECD_COMMON_SERVICE_HEALTH_SERVICE_H_
#define SPECD_COMMON_SERVICE_HEALTH_SERVICE_H_

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace specd {

class HealthService final : public grpc::health::v1::Health::CallbackService {
 public:
  using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

  // The name a liveness probe asks for: SERVING whenever the process answers at all, whatever
  // SetServing() says. "" and the service names say whether the process can do its work (the
  // model is loaded; for the router, the verify service is up), which is what readiness wants;
  // a liveness probe on those would restart every router while its verify service is down.
  static constexpr char kLivenessName[] = "liveness";

  // `names` are the services whose status follows SetServing(), besides "" (the whole
  // server); they start NOT_SERVING. kLivenessName is SERVING from the first call until
  // Shutdown(). Any other name answers NOT_FOUND on Check and SERVICE_UNKNOWN on Watch.
  explicit HealthService(const std::vector<std::string>& names);
  ~HealthService() override;

  // Sets "" and the names given at construction to SERVING or NOT_SERVING and tells their
  // watchers. Ignored after Shutdown().
  void SetServing(bool serving);

  // Every name becomes NOT_SERVING for good; open Watch streams get that status and then end
  // with OK, so that they do not hold the server's shutdown until its deadline.
  void Shutdown();

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* context,
                                  const grpc::health::v1::HealthCheckRequest* request,
                                  grpc::health::v1::HealthCheckResponse* response) override;
  grpc::ServerWriteReactor<grpc::health::v1::HealthCheckResponse>* Watch(
      grpc::CallbackServerContext* context,
      const grpc::health::v1::HealthCheckRequest* request) override;

 private:
  class Watcher;

  // The status Watch reports for `name`. Requires mu_.
  ServingStatus WatchStatusLocked(const std::string& name) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  std::map<std::string, ServingStatus> statuses_ ABSL_GUARDED_BY(mu_);
  std::set<Watcher*> watchers_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  // Signalled when the last watcher is gone; the destructor waits for it because watchers
  // call back into mu_ until their OnDone.
  absl::CondVar no_watchers_;
};

}  // namespace specd

#endif  // SPECD_COMMON_SERVICE_HEALTH_SERVICE_H_
