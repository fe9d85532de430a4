#include "services/router/group_pool.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/service/grpc_util.h"

namespace specd {

struct GroupPool::Group {
  int index = 0;
  std::string verify_address;
  std::unique_ptr<RouterMetrics> metrics;  // the group's labelled gauges; null with one group
  std::unique_ptr<RouterLoop> loop;
  std::unique_ptr<v1::Verifier::Stub> stub;  // GetInfo for the load, on its own channel
  // This router's requests on the group, from Submit until their RPC is finished.
  std::shared_ptr<std::atomic<int>> inflight = std::make_shared<std::atomic<int>>(0);

  mutable absl::Mutex mu;
  int reported_running ABSL_GUARDED_BY(mu) = 0;  // the service's live sequences, all routers
  int inflight_at_poll ABSL_GUARDED_BY(mu) = 0;  // `inflight` when that was reported
  double kv_usage ABSL_GUARDED_BY(mu) = 0.0;
};

// Counts a request against its group until the loop finishes it.
class GroupPool::CountingSink : public ResponseSink {
 public:
  CountingSink(std::shared_ptr<ResponseSink> inner, std::shared_ptr<std::atomic<int>> inflight)
      : inner_(std::move(inner)), inflight_(std::move(inflight)) {
    inflight_->fetch_add(1);
  }
  ~CountingSink() override { Uncount(); }

  void Write(v1::GenerateResponse chunk) override { inner_->Write(std::move(chunk)); }
  void Finish(const grpc::Status& status) override {
    Uncount();
    inner_->Finish(status);
  }
  bool Cancelled() const override { return inner_->Cancelled(); }

  // The group refused the request: it no longer counts there (the caller still owns `inner`).
  void Uncount() {
    if (counted_.exchange(false)) inflight_->fetch_sub(1);
  }

 private:
  const std::shared_ptr<ResponseSink> inner_;
  const std::shared_ptr<std::atomic<int>> inflight_;
  std::atomic<bool> counted_{true};
};

GroupPool::GroupPool(GroupPoolOptions options, const Tokenizer* tokenizer,
                     prometheus::Registry* registry, RouterMetrics* metrics,
                     std::function<void(bool serving)> on_serving)
    : options_(std::move(options)), metrics_(metrics), on_serving_(std::move(on_serving)) {
  const size_t n = options_.verify_addresses.size();
  for (size_t i = 0; i < n; ++i) {
    auto group = std::make_unique<Group>();
    group->index = static_cast<int>(i);
    group->verify_address = options_.verify_addresses[i];
    RouterLoopOptions loop_options = options_.loop;
    loop_options.verify_address = group->verify_address;
    loop_options.draft_address =
        options_.draft_addresses.empty()
            ? std::string()
            : options_.draft_addresses[i % options_.draft_addresses.size()];
    RouterMetrics* loop_metrics = metrics_;
    if (n > 1) {
      group->metrics = std::make_unique<RouterMetrics>(
          *registry, MetricLabels{{"verify_group", absl::StrCat(i)}});
      loop_metrics = group->metrics.get();
    }
    auto on_change = [this, loop_metrics](bool up) {
      loop_metrics->verify_available.Set(up ? 1 : 0);
      const bool any = verify_up();
      if (loop_metrics != metrics_) metrics_->verify_available.Set(any ? 1 : 0);
      if (on_serving_) on_serving_(any);
    };
    group->loop =
        std::make_unique<RouterLoop>(loop_options, tokenizer, loop_metrics, std::move(on_change));
    group->stub = v1::Verifier::NewStub(
        CreateServiceChannel(group->verify_address, options_.loop.upstream_credentials));
    groups_.push_back(std::move(group));
  }
}

GroupPool::~GroupPool() { Stop(); }

void GroupPool::Start() {
  for (auto& g : groups_) g->loop->Start();
  poller_ = std::thread([this] { PollLoads(); });
}

void GroupPool::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (poller_.joinable()) poller_.join();
  for (auto& g : groups_) g->loop->Stop();
}

double GroupPool::Load(const Group& group) const {
  const int inflight = group.inflight->load();
  // Known from the GetInfo that brought the group up, so it is there before the first poll.
  int slots = static_cast<int>(group.loop->verify_info().load().max_sequences());
  if (slots <= 0) slots = options_.loop.max_batch;  // a service that does not report it
  absl::MutexLock lock(&group.mu);
  const int others = std::max(0, group.reported_running - group.inflight_at_poll);
  return static_cast<double>(inflight + others) / slots + group.kv_usage;
}

absl::Status GroupPool::Submit(RouterRequest request, std::shared_ptr<ResponseSink> sink) {
  // Candidates: groups that are up, least loaded first; ties from the round-robin position on.
  std::vector<std::pair<double, size_t>> order;
  size_t start;
  {
    absl::MutexLock lock(&mu_);
    start = next_;
  }
  const size_t n = groups_.size();
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (start + k) % n;
    if (groups_[i]->loop->verify_up()) order.emplace_back(Load(*groups_[i]), k);
  }
  if (order.empty()) {
    return absl::UnavailableError(
        n == 1 ? absl::StrCat("the verify service at ", groups_[0]->verify_address,
                              " is not available; retry later")
               : absl::StrCat("none of the ", n, " verify services is available; retry later"));
  }
  std::stable_sort(order.begin(), order.end());
  absl::Status last;
  for (const auto& [load, k] : order) {
    Group& g = *groups_[(start + k) % n];
    auto counted = std::make_shared<CountingSink>(sink, g.inflight);
    last = g.loop->Submit(request, counted);
    if (last.ok()) {
      absl::MutexLock lock(&mu_);
      next_ = (g.index + 1) % n;
      return last;
    }
    counted->Uncount();
    // UNAVAILABLE: it went down since verify_up(); RESOURCE_EXHAUSTED: its queue is full.
  }
  return last;
}

void GroupPool::Wake() {
  for (auto& g : groups_) g->loop->Wake();
}

bool GroupPool::verify_up() const {
  for (const auto& g : groups_) {
    if (g->loop->verify_up()) return true;
  }
  return false;
}

bool GroupPool::draft_up() const {
  for (const auto& g : groups_) {
    if (g->loop->draft_up()) return true;
  }
  return false;
}

v1::VerifyInfo GroupPool::verify_info() const {
  for (const auto& g : groups_) {
    if (g->loop->verify_up()) return g->loop->verify_info();
  }
  return groups_[0]->loop->verify_info();
}

v1::DraftInfo GroupPool::draft_info() const {
  for (const auto& g : groups_) {
    if (g->loop->draft_up()) return g->loop->draft_info();
  }
  return groups_[0]->loop->draft_info();
}

int GroupPool::max_context() const {
  int context = groups_[0]->loop->max_context();
  for (const auto& g : groups_) context = std::min(context, g->loop->max_context());
  return context;
}

void GroupPool::PollLoads() {
  while (true) {
    for (auto& g : groups_) {
      if (!g->loop->verify_up()) continue;
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() +
                           absl::ToChronoMilliseconds(options_.loop.probe_timeout));
      const int before = g->inflight->load();
      v1::VerifyInfo info;
      const grpc::Status status = g->stub->GetInfo(&context, v1::VerifyInfoRequest(), &info);
      if (!status.ok()) continue;  // the group's own upstream notices a service that is gone
      // Sequences placed while the call was on its way may already be in the service's count:
      // taking the larger count as ours keeps a burst of our own arrivals from looking like
      // another router's load (which would steer the next arrivals away until the next poll).
      const int after = g->inflight->load();
      absl::MutexLock lock(&g->mu);
      g->reported_running = static_cast<int>(info.load().running_sequences());
      g->inflight_at_poll = std::max(before, after);
      g->kv_usage = info.load().kv_cache_usage_ratio();
    }
    UpdateTotals();
    absl::MutexLock lock(&mu_);
    auto stopping = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
    if (mu_.AwaitWithTimeout(absl::Condition(&stopping), options_.load_poll)) return;
  }
}

void GroupPool::UpdateTotals() {
  if (groups_.size() < 2) return;  // the one loop keeps the router's own gauges
  double running = 0, waiting = 0;
  bool draft = false;
  for (const auto& g : groups_) {
    running += g->metrics->requests_running.Value();
    waiting += g->metrics->requests_waiting.Value();
    draft = draft || g->loop->draft_up();
  }
  metrics_->requests_running.Set(running);
  metrics_->requests_waiting.Set(waiting);
  metrics_->draft_available.Set(draft ? 1 : 0);
  metrics_->verify_available.Set(verify_up() ? 1 : 0);  // in case two groups' changes raced
}

}  // namespace specd
