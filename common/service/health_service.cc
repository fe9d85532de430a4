#include "common/service/health_service.h"

#include <utility>

namespace specd {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// One Watch stream. Its state is guarded by the service's mutex, since status changes arrive
// from whichever thread calls SetServing(). The gRPC calls themselves (StartWrite, Finish) are
// made outside the lock, by whoever the state machine picked, so exactly one of them is in
// flight at a time and Finish comes only after the last write completed.
class HealthService::Watcher final : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  enum class Action { kNone, kWrite, kFinish };

  Watcher(HealthService* service, std::string name) : service_(service), name_(std::move(name)) {
    Action action;
    {
      absl::MutexLock lock(&service_->mu_);
      service_->watchers_.insert(this);
      wanted_ = service_->WatchStatusLocked(name_);
      finishing_ = service_->shut_down_;
      action = NextActionLocked();
    }
    Run(action);
  }

  const std::string& name() const { return name_; }

  // A new status (or the end of the service) for this stream; returns what the caller must Run
  // once it has released the service's mutex.
  Action UpdateLocked(ServingStatus status, bool finishing) {
    wanted_ = status;
    finishing_ = finishing_ || finishing;
    return NextActionLocked();
  }

  void Run(Action action) {
    if (action == Action::kWrite) {
      StartWrite(&response_);
    } else if (action == Action::kFinish) {
      Finish(cancelled_ ? grpc::Status::CANCELLED : grpc::Status::OK);
    }
  }

  void OnWriteDone(bool ok) override {
    Action action;
    {
      absl::MutexLock lock(&service_->mu_);
      writing_ = false;
      if (!ok) cancelled_ = finishing_ = true;  // the client is gone
      action = NextActionLocked();
    }
    Run(action);
  }

  void OnCancel() override {
    Action action;
    {
      absl::MutexLock lock(&service_->mu_);
      cancelled_ = finishing_ = true;
      action = NextActionLocked();
    }
    Run(action);
  }

  void OnDone() override {
    {
      absl::MutexLock lock(&service_->mu_);
      service_->watchers_.erase(this);
      if (service_->watchers_.empty()) service_->no_watchers_.SignalAll();
    }
    delete this;
  }

 private:
  Action NextActionLocked() {
    if (writing_ || finished_) return Action::kNone;
    if (!cancelled_ && (!has_sent_ || sent_ != wanted_)) {
      response_.set_status(wanted_);
      sent_ = wanted_;
      has_sent_ = writing_ = true;
      return Action::kWrite;
    }
    if (finishing_) {
      finished_ = true;
      return Action::kFinish;
    }
    return Action::kNone;
  }

  HealthService* const service_;
  const std::string name_;
  // All below guarded by service_->mu_; response_ is only touched by the one write in flight.
  HealthCheckResponse response_;
  ServingStatus wanted_ = HealthCheckResponse::UNKNOWN;
  ServingStatus sent_ = HealthCheckResponse::UNKNOWN;
  bool has_sent_ = false;
  bool writing_ = false;
  bool finishing_ = false;
  bool cancelled_ = false;
  bool finished_ = false;
};

HealthService::HealthService(const std::vector<std::string>& names) {
  statuses_[""] = HealthCheckResponse::NOT_SERVING;
  for (const std::string& name : names) statuses_[name] = HealthCheckResponse::NOT_SERVING;
  statuses_[kLivenessName] = HealthCheckResponse::SERVING;
}

HealthService::~HealthService() {
  absl::MutexLock lock(&mu_);
  while (!watchers_.empty()) no_watchers_.Wait(&mu_);
}

HealthService::ServingStatus HealthService::WatchStatusLocked(const std::string& name) const {
  auto it = statuses_.find(name);
  return it == statuses_.end() ? HealthCheckResponse::SERVICE_UNKNOWN : it->second;
}

void HealthService::SetServing(bool serving) {
  std::vector<std::pair<Watcher*, Watcher::Action>> actions;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    for (auto& [name, status] : statuses_) {
      if (name == kLivenessName) continue;  // alive whatever the model or upstreams say
      status = serving ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
    }
    for (Watcher* w : watchers_) {
      actions.emplace_back(w, w->UpdateLocked(WatchStatusLocked(w->name()), false));
    }
  }
  for (auto& [w, action] : actions) w->Run(action);
}

void HealthService::Shutdown() {
  std::vector<std::pair<Watcher*, Watcher::Action>> actions;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    for (auto& [name, status] : statuses_) status = HealthCheckResponse::NOT_SERVING;
    for (Watcher* w : watchers_) {
      actions.emplace_back(w, w->UpdateLocked(WatchStatusLocked(w->name()), true));
    }
  }
  for (auto& [w, action] : actions) w->Run(action);
}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* context,
                                               const HealthCheckRequest* request,
                                               HealthCheckResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  grpc::Status status;
  {
    absl::MutexLock lock(&mu_);
    auto it = statuses_.find(request->service());
    if (it == statuses_.end()) {
      status = grpc::Status(grpc::StatusCode::NOT_FOUND,
                            "service: \"" + request->service() + "\" is not served here");
    } else {
      response->set_status(it->second);
    }
  }
  reactor->Finish(status);
  return reactor;
}

grpc::ServerWriteReactor<HealthCheckResponse>* HealthService::Watch(
    grpc::CallbackServerContext* /*context*/, const HealthCheckRequest* request) {
  return new Watcher(this, request->service());
}

}  // namespace specd
