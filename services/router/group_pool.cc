#include "services/router/group_pool.h"

#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/service/grpc_util.h"
#include "specd/v1/draft.grpc.pb.h"

namespace specd {
namespace {

// What one GetInfo poll said about a service, and how many of this router's sequences it held
// then; Load() adds the sequences placed since.
struct Reported {
  int running = 0;        // the service's live sequences, all routers
  int inflight_at = 0;    // this router's when that was reported
  int max_sequences = 0;  // 0: not reported
  double kv_usage = 0.0;
};

double LoadOf(int inflight, const Reported& r, int default_slots) {
  const int slots = r.max_sequences > 0 ? r.max_sequences : default_slots;
  const int others = std::max(0, r.running - r.inflight_at);
  return static_cast<double>(inflight + others) / slots + r.kv_usage;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ResolveAll(const std::string& host_port) {
  absl::StatusOr<HostPort> hp = ParseHostPort(host_port, "address");
  if (!hp.ok()) return hp.status();
  if (hp->host.empty()) return absl::InvalidArgumentError(absl::StrCat(host_port, ": no host"));
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* list = nullptr;
  const std::string port = absl::StrCat(hp->port);
  if (const int rc = getaddrinfo(hp->host.c_str(), port.c_str(), &hints, &list); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve ", hp->host, ": ", gai_strerror(rc)));
  }
  std::set<std::string> addresses;
  for (const addrinfo* a = list; a != nullptr; a = a->ai_next) {
    char host[NI_MAXHOST];
    if (getnameinfo(a->ai_addr, a->ai_addrlen, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) !=
        0) {
      continue;
    }
    addresses.insert(a->ai_family == AF_INET6 ? absl::StrCat("[", host, "]:", hp->port)
                                              : absl::StrCat(host, ":", hp->port));
  }
  freeaddrinfo(list);
  if (addresses.empty()) {
    return absl::UnavailableError(absl::StrCat(hp->host, " has no addresses"));
  }
  return std::vector<std::string>(addresses.begin(), addresses.end());
}

struct GroupPool::Group {
  int index = 0;
  std::string verify_address;
  std::unique_ptr<RouterMetrics> metrics;  // the group's labelled gauges; null when unlabelled
  std::unique_ptr<RouterLoop> loop;
  std::unique_ptr<v1::Verifier::Stub> stub;  // GetInfo for the load, on its own channel
  // This router's requests on the group, from Submit until their RPC is finished.
  std::shared_ptr<std::atomic<int>> inflight = std::make_shared<std::atomic<int>>(0);
  bool gone = false;  // guarded by the pool's mu_: its address no longer resolves

  mutable absl::Mutex mu;
  Reported reported ABSL_GUARDED_BY(mu);
};

struct GroupPool::DraftService {
  std::string address;
  std::string tls_name;
  std::unique_ptr<v1::Drafter::Stub> stub;  // GetInfo for the load and whether it answers
  std::shared_ptr<std::atomic<int>> inflight = std::make_shared<std::atomic<int>>(0);
  bool gone = false;  // guarded by the pool's mu_

  mutable absl::Mutex mu;
  Reported reported ABSL_GUARDED_BY(mu);
  // No GetInfo answered yet, or the last two failed. Its slots are known from the answer, so
  // until then its load cannot be compared with the others'. One late answer (a loaded host)
  // does not count it out: every new sequence would go to the others until the next poll.
  bool down ABSL_GUARDED_BY(mu) = true;
  int failed_polls ABSL_GUARDED_BY(mu) = 0;  // in a row
};

// Counts a request against its group and its draft service until the loop finishes it.
class GroupPool::CountingSink : public ResponseSink {
 public:
  CountingSink(std::shared_ptr<ResponseSink> inner, std::shared_ptr<std::atomic<int>> group,
               std::shared_ptr<std::atomic<int>> draft)
      : inner_(std::move(inner)), group_(std::move(group)), draft_(std::move(draft)) {
    group_->fetch_add(1);
    if (draft_ != nullptr) draft_->fetch_add(1);
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
    if (counted_.exchange(false)) {
      group_->fetch_sub(1);
      if (draft_ != nullptr) draft_->fetch_sub(1);
    }
  }

 private:
  const std::shared_ptr<ResponseSink> inner_;
  const std::shared_ptr<std::atomic<int>> group_;
  const std::shared_ptr<std::atomic<int>> draft_;  // null: no draft service
  std::atomic<bool> counted_{true};
};

namespace {

bool AnyDns(const std::vector<std::string>& entries) {
  return std::any_of(entries.begin(), entries.end(),
                     [](const std::string& e) { return absl::StartsWith(e, kDnsScheme); });
}

}  // namespace

GroupPool::GroupPool(GroupPoolOptions options, const Tokenizer* tokenizer,
                     prometheus::Registry* registry, RouterMetrics* metrics,
                     std::function<void(bool serving)> on_serving)
    : options_(std::move(options)),
      tokenizer_(tokenizer),
      registry_(registry),
      metrics_(metrics),
      on_serving_(std::move(on_serving)),
      labelled_(options_.verify_addresses.size() > 1 || AnyDns(options_.verify_addresses)),
      dynamic_(AnyDns(options_.verify_addresses) || AnyDns(options_.draft_addresses)) {
  Apply(Resolve(options_.verify_addresses), Resolve(options_.draft_addresses));
}

GroupPool::~GroupPool() { Stop(); }

std::vector<GroupPool::Target> GroupPool::Resolve(const std::vector<std::string>& entries) {
  std::vector<Target> targets;
  auto add = [&](const std::string& a, const std::string& tls_name) {
    if (std::none_of(targets.begin(), targets.end(),
                     [&](const Target& t) { return t.address == a; })) {
      targets.push_back({a, tls_name});
    }
  };
  for (const std::string& entry : entries) {
    if (!absl::StartsWith(entry, kDnsScheme)) {
      add(entry, "");
      continue;
    }
    const std::string name = entry.substr(sizeof(kDnsScheme) - 1);
    absl::StatusOr<HostPort> hp = ParseHostPort(name);
    const std::string host = hp.ok() ? hp->host : name;
    absl::StatusOr<std::vector<std::string>> found =
        options_.resolver ? options_.resolver(name) : ResolveAll(name);
    absl::MutexLock lock(&resolve_mu_);
    std::vector<std::string>& last = resolved_[name];
    if (found.ok()) {
      if (*found != last) {
        SPECD_LOG(INFO) << name << " resolves to " << absl::StrJoin(*found, ",");
      }
      last = *std::move(found);
    } else {
      SPECD_LOG(WARNING) << found.status().message() << "; keeping its last addresses ("
                         << (last.empty() ? "none" : absl::StrJoin(last, ",")) << ")";
    }
    for (const std::string& a : last) add(a, host);
  }
  return targets;
}

std::shared_ptr<grpc::Channel> GroupPool::Channel(const Target& target) const {
  const auto& credentials = options_.loop.upstream_credentials;
  grpc::ChannelArguments args = ServiceChannelArguments();
  if (credentials && !target.tls_name.empty()) args.SetSslTargetNameOverride(target.tls_name);
  return grpc::CreateCustomChannel(
      target.address, credentials ? credentials : grpc::InsecureChannelCredentials(), args);
}

std::shared_ptr<GroupPool::Group> GroupPool::MakeGroup(const Target& verify,
                                                       const std::vector<Target>& drafts,
                                                       int index) {
  auto group = std::make_shared<Group>();
  group->index = index;
  group->verify_address = verify.address;
  RouterLoopOptions loop_options = options_.loop;
  loop_options.verify_address = verify.address;
  loop_options.verify_tls_name = verify.tls_name;
  loop_options.draft_addresses.clear();
  loop_options.draft_tls_names.clear();
  for (const Target& d : drafts) {
    loop_options.draft_addresses.push_back(d.address);
    loop_options.draft_tls_names.push_back(d.tls_name);
  }
  RouterMetrics* loop_metrics = metrics_;
  if (labelled_) {
    group->metrics = std::make_unique<RouterMetrics>(
        *registry_, MetricLabels{{"verify_group", absl::StrCat(index)}});
    loop_metrics = group->metrics.get();
  }
  auto on_change = [this, loop_metrics](bool up) {
    loop_metrics->verify_available.Set(up ? 1 : 0);
    const bool any = verify_up();
    if (loop_metrics != metrics_) metrics_->verify_available.Set(any ? 1 : 0);
    if (on_serving_) on_serving_(any);
  };
  group->loop =
      std::make_unique<RouterLoop>(loop_options, tokenizer_, loop_metrics, std::move(on_change));
  group->stub = v1::Verifier::NewStub(Channel(verify));
  return group;
}

void GroupPool::Apply(const std::vector<Target>& verify, const std::vector<Target>& draft) {
  auto listed = [](const std::vector<Target>& list, const std::string& a) {
    return std::any_of(list.begin(), list.end(), [&](const Target& t) { return t.address == a; });
  };
  std::vector<std::shared_ptr<Group>> groups;
  std::vector<Target> new_drafts;
  std::vector<Target> drafts;  // every draft service that takes new sequences
  int index;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    for (auto& d : drafts_) {
      if (d->gone != !listed(draft, d->address)) {
        d->gone = !d->gone;
        SPECD_LOG(INFO) << "draft service at " << d->address
                        << (d->gone ? " is gone from the resolved addresses: it takes no new "
                                      "sequences and closes once they end"
                                    : " is back");
      }
    }
    for (const Target& t : draft) {
      const bool known = std::any_of(drafts_.begin(), drafts_.end(),
                                     [&](const auto& d) { return d->address == t.address; });
      if (!known) {
        auto d = std::make_shared<DraftService>();
        d->address = t.address;
        d->tls_name = t.tls_name;
        d->stub = v1::Drafter::NewStub(Channel(t));
        drafts_.push_back(std::move(d));
        new_drafts.push_back(t);
      }
    }
    for (const auto& d : drafts_) {
      if (!d->gone) drafts.push_back({d->address, d->tls_name});
    }
    for (auto& g : groups_) {
      if (g->gone != !listed(verify, g->verify_address)) {
        g->gone = !g->gone;
        SPECD_LOG(INFO) << "verify group " << g->index << " at " << g->verify_address
                        << (g->gone ? " is gone from the resolved addresses: it takes no new "
                                      "sequences and closes once they end"
                                    : " is back");
      }
    }
    groups = groups_;
    index = next_index_;
  }
  for (const auto& g : groups) {
    for (const Target& t : new_drafts) g->loop->AddDraft(t.address, t.tls_name);
  }
  // New groups are built outside the lock (their callbacks take it).
  std::vector<std::shared_ptr<Group>> fresh;
  for (const Target& t : verify) {
    const bool known = std::any_of(groups.begin(), groups.end(),
                                   [&](const auto& g) { return g->verify_address == t.address; });
    if (!known) {
      SPECD_LOG(INFO) << "verify group " << index << " at " << t.address;
      fresh.push_back(MakeGroup(t, drafts, index++));
    }
  }
  if (fresh.empty()) return;
  bool started;
  {
    absl::MutexLock lock(&mu_);
    groups_.insert(groups_.end(), fresh.begin(), fresh.end());
    next_index_ = index;
    started = started_;
  }
  if (started) {
    for (const auto& g : fresh) g->loop->Start();
  }
}

void GroupPool::Reap() {
  std::vector<std::shared_ptr<Group>> closing;
  std::vector<std::string> closing_drafts;
  std::vector<std::shared_ptr<Group>> groups;
  {
    absl::MutexLock lock(&mu_);
    // Submit places under mu_, so nothing is placed on what is taken out here.
    for (auto it = groups_.begin(); it != groups_.end();) {
      if ((*it)->gone && (*it)->inflight->load() == 0) {
        closing.push_back(std::move(*it));
        it = groups_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = drafts_.begin(); it != drafts_.end();) {
      if ((*it)->gone && (*it)->inflight->load() == 0) {
        closing_drafts.push_back((*it)->address);
        it = drafts_.erase(it);
      } else {
        ++it;
      }
    }
    groups = groups_;
  }
  for (const auto& g : closing) {
    SPECD_LOG(INFO) << "closing verify group " << g->index << " at " << g->verify_address;
    g->loop->Stop();
    if (g->metrics != nullptr) {
      g->metrics->verify_available.Set(0);
      g->metrics->draft_available.Set(0);
      g->metrics->requests_running.Set(0);
      g->metrics->requests_waiting.Set(0);
    }
  }
  for (const std::string& a : closing_drafts) {
    SPECD_LOG(INFO) << "closing draft service at " << a;
    for (const auto& g : groups) g->loop->RemoveDraft(a);
  }
  for (const auto& g : groups) g->loop->ReapDrafts();
  if (!closing.empty() && on_serving_) on_serving_(verify_up());
}

void GroupPool::Refresh() {
  Apply(Resolve(options_.verify_addresses), Resolve(options_.draft_addresses));
  Reap();
}

void GroupPool::Start() {
  std::vector<std::shared_ptr<Group>> groups;
  {
    absl::MutexLock lock(&mu_);
    started_ = true;
    groups = groups_;
  }
  for (auto& g : groups) g->loop->Start();
  poller_ = std::thread([this] { PollLoads(); });
  resolver_ = std::thread([this] { ResolveLoop(); });
}

void GroupPool::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (poller_.joinable()) poller_.join();
  if (resolver_.joinable()) resolver_.join();
  for (auto& g : Groups()) g->loop->Stop();
}

std::vector<std::shared_ptr<GroupPool::Group>> GroupPool::Groups() const {
  absl::MutexLock lock(&mu_);
  return groups_;
}

std::vector<std::shared_ptr<GroupPool::DraftService>> GroupPool::Drafts() const {
  absl::MutexLock lock(&mu_);
  return drafts_;
}

int GroupPool::num_groups() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(groups_.size());
}

int GroupPool::num_drafts() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(drafts_.size());
}

std::vector<std::string> GroupPool::verify_addresses() const {
  std::vector<std::string> out;
  absl::MutexLock lock(&mu_);
  for (const auto& g : groups_) {
    if (!g->gone) out.push_back(g->verify_address);
  }
  return out;
}

std::vector<std::string> GroupPool::draft_addresses() const {
  std::vector<std::string> out;
  absl::MutexLock lock(&mu_);
  for (const auto& d : drafts_) {
    if (!d->gone) out.push_back(d->address);
  }
  return out;
}

double GroupPool::Load(const Group& group) const {
  const int inflight = group.inflight->load();
  Reported r;
  {
    absl::MutexLock lock(&group.mu);
    r = group.reported;
  }
  // Known from the GetInfo that brought the group up, so it is there before the first poll.
  r.max_sequences = static_cast<int>(group.loop->verify_info().load().max_sequences());
  return LoadOf(inflight, r, options_.loop.max_batch);
}

double GroupPool::Load(const DraftService& draft) const {
  const int inflight = draft.inflight->load();
  absl::MutexLock lock(&draft.mu);
  return LoadOf(inflight, draft.reported, options_.loop.max_batch);
}

std::shared_ptr<GroupPool::DraftService> GroupPool::ChooseDraft() {
  const size_t n = drafts_.size();
  // Those that answered their last GetInfo first; while none does, any (it may come back).
  std::shared_ptr<DraftService> best;
  bool best_answers = false;
  double best_load = 0;
  size_t best_at = 0;
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (next_draft_ + k) % n;
    const std::shared_ptr<DraftService>& d = drafts_[i];
    if (d->gone) continue;
    bool answers;
    {
      absl::MutexLock lock(&d->mu);
      answers = !d->down;
    }
    const double load = Load(*d);
    if (best == nullptr || (answers && !best_answers) ||
        (answers == best_answers && load < best_load)) {
      best = d;
      best_answers = answers;
      best_load = load;
      best_at = i;
    }
  }
  if (best != nullptr) next_draft_ = (best_at + 1) % n;
  return best;
}

absl::Status GroupPool::Submit(RouterRequest request, std::shared_ptr<ResponseSink> sink) {
  // Under mu_: Reap() closes only what holds no sequence, and a sequence counts from here.
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the router is shutting down");
  // Candidates: groups that are up, least loaded first; ties from the round-robin position on.
  std::vector<std::pair<double, size_t>> order;
  const size_t n = groups_.size();
  for (size_t k = 0; k < n; ++k) {
    const Group& g = *groups_[(next_ + k) % n];
    if (!g.gone && g.loop->verify_up()) order.emplace_back(Load(g), k);
  }
  if (order.empty()) {
    if (n == 0) {
      return absl::UnavailableError(absl::StrCat("no verify service address is known yet (",
                                                 absl::StrJoin(options_.verify_addresses, ","),
                                                 "); retry later"));
    }
    return absl::UnavailableError(
        n == 1 ? absl::StrCat("the verify service at ", groups_[0]->verify_address,
                              " is not available; retry later")
               : absl::StrCat("none of the ", n, " verify services is available; retry later"));
  }
  std::stable_sort(order.begin(), order.end());
  const std::shared_ptr<DraftService> draft = ChooseDraft();
  absl::Status last;
  for (const auto& [load, k] : order) {
    Group& g = *groups_[(next_ + k) % n];
    auto counted =
        std::make_shared<CountingSink>(sink, g.inflight, draft ? draft->inflight : nullptr);
    last = g.loop->Submit(request, counted, draft ? draft->address : std::string());
    if (last.ok()) {
      next_ = (next_ + k + 1) % n;
      return last;
    }
    counted->Uncount();
    // UNAVAILABLE: it went down since verify_up(); RESOURCE_EXHAUSTED: its queue is full.
  }
  return last;
}

void GroupPool::Wake() {
  for (auto& g : Groups()) g->loop->Wake();
}

bool GroupPool::verify_up() const {
  for (const auto& g : Groups()) {
    if (g->loop->verify_up()) return true;
  }
  return false;
}

int GroupPool::drafts_up() const {
  int up = 0;
  for (const auto& d : Drafts()) {
    absl::MutexLock lock(&d->mu);
    up += d->down ? 0 : 1;
  }
  return up;
}

int GroupPool::groups_up() const {
  int up = 0;
  for (const auto& g : Groups()) up += g->loop->verify_up() ? 1 : 0;
  return up;
}

bool GroupPool::draft_up() const {
  for (const auto& g : Groups()) {
    if (g->loop->draft_up()) return true;
  }
  return false;
}

v1::VerifyInfo GroupPool::verify_info() const {
  const auto groups = Groups();
  for (const auto& g : groups) {
    if (g->loop->verify_up()) return g->loop->verify_info();
  }
  return groups.empty() ? v1::VerifyInfo() : groups[0]->loop->verify_info();
}

v1::DraftInfo GroupPool::draft_info() const {
  const auto groups = Groups();
  for (const auto& g : groups) {
    if (g->loop->draft_up()) return g->loop->draft_info();
  }
  return groups.empty() ? v1::DraftInfo() : groups[0]->loop->draft_info();
}

int GroupPool::max_context() const {
  int context = options_.loop.limits.max_context;
  for (const auto& g : Groups()) context = std::min(context, g->loop->max_context());
  return context;
}

void GroupPool::PollLoads() {
  while (true) {
    for (auto& g : Groups()) {
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
      g->reported.running = static_cast<int>(info.load().running_sequences());
      g->reported.inflight_at = std::max(before, after);
      g->reported.kv_usage = info.load().kv_cache_usage_ratio();
    }
    for (auto& d : Drafts()) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() +
                           absl::ToChronoMilliseconds(options_.loop.probe_timeout));
      const int before = d->inflight->load();
      v1::DraftInfo info;
      const grpc::Status status = d->stub->GetInfo(&context, v1::DraftInfoRequest(), &info);
      const int after = d->inflight->load();
      absl::MutexLock lock(&d->mu);
      d->failed_polls = status.ok() ? 0 : d->failed_polls + 1;
      if (!status.ok()) {
        if (d->failed_polls >= 2) d->down = true;
        continue;
      }
      d->down = false;
      d->reported.running = static_cast<int>(info.load().running_sequences());
      d->reported.inflight_at = std::max(before, after);
      d->reported.max_sequences = static_cast<int>(info.load().max_sequences());
      d->reported.kv_usage = info.load().kv_cache_usage_ratio();
    }
    UpdateTotals();
    absl::MutexLock lock(&mu_);
    auto stopping = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
    if (mu_.AwaitWithTimeout(absl::Condition(&stopping), options_.load_poll)) return;
  }
}

void GroupPool::ResolveLoop() {
  // Groups whose address is gone close once drained, so they are looked at more often than
  // names are resolved.
  absl::Time next_resolve = absl::Now() + options_.resolve_interval;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto stopping = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping), options_.load_poll)) return;
    }
    if (dynamic_ && absl::Now() >= next_resolve) {
      next_resolve = absl::Now() + options_.resolve_interval;
      Apply(Resolve(options_.verify_addresses), Resolve(options_.draft_addresses));
    }
    Reap();
  }
}

void GroupPool::UpdateTotals() {
  if (!labelled_) return;  // the one loop keeps the router's own gauges
  double running = 0, waiting = 0;
  bool draft = false;
  for (const auto& g : Groups()) {
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
