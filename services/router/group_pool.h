// Several verify groups and draft services behind one router: one RouterLoop per verify service
// (each with its own Step stream, scheduler thread, and a Step stream to every draft service)
// and a placement layer above them.
//
// Placement. Each new request goes to the group with the least load among those whose verify
// service is up. A group's load is the fraction of its sequence slots in use plus the fraction
// of its KV cache in use. Sequences are this router's own (counted from Submit to the end of
// the RPC, so a burst of arrivals spreads at once) plus the other routers' (what the service
// reports in GetInfo's ServiceLoad, polled every `load_poll`, minus this router's share at that
// moment); KV usage is the service's report. Ties go to the group after the last one chosen.
// Greedy output does not depend on the group: every group serves the same model and
// verification is lossless.
//
// Draft services. Each new sequence drafts through the least-loaded draft service that answers,
// chosen apart from its group (load as for groups: this router's sequences on it plus the
// others' from DraftInfo.load, and its KV usage), so the draft and verify tiers scale
// independently. Every group's loop holds a Step stream to every draft service. A sequence
// whose draft service goes down goes on target-only (same output), as in one RouterLoop; new
// sequences go to the draft services that answer.
//
// Addresses. Each entry of verify_addresses and draft_addresses is "host:port" (one service)
// or "dns:///host:port": every address the name resolves to (A and AAAA records; in Kubernetes
// a headless Service has one per pod) is one service. With TLS, each such address is checked
// against the name, not the address (the certificate names the Service). Names are
// resolved again every `resolve_interval`: a new address becomes a new group (or draft service)
// that takes new sequences at once; an address that is gone takes no new sequences and is
// closed once the sequences it holds have ended (they finish normally if the service still
// answers, or fail with UNAVAILABLE if it is gone with its address). A name that fails to
// resolve keeps the addresses it last had.
//
// Failures. A group whose verify service goes away fails only its own running and queued
// sequences, with UNAVAILABLE (RouterLoop's behaviour; they are not re-prefilled elsewhere:
// the client has seen their tokens stream, and retrying is its call). The other groups go on;
// new requests go to groups that are up. When the service comes back its group is up again
// and, being the least loaded, takes new sequences first. The router is SERVING while at least
// one group is up.
//
// Several routers over the same groups (M:N) need nothing more: a router keeps no state across
// groups, each service holds sequences per Step stream, and the reported load makes each router
// see the others' sequences.
#ifndef SPECD_SERVICES_ROUTER_GROUP_POOL_H_
#define SPECD_SERVICES_ROUTER_GROUP_POOL_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/text/tokenizer.h"
#include "prometheus/registry.h"
#include "services/router/router_loop.h"
#include "services/router/router_metrics.h"
#include "specd/v1/verify.grpc.pb.h"

namespace specd {

// The addresses ("ip:port", an IPv6 address in brackets) that `host_port` ("name:port")
// resolves to. Fails when the name does not resolve.
using Resolver =
    std::function<absl::StatusOr<std::vector<std::string>>(const std::string& host_port)>;

// The system's resolver (getaddrinfo): every A and AAAA record, sorted, without repeats.
absl::StatusOr<std::vector<std::string>> ResolveAll(const std::string& host_port);

// An address entry that names every address a DNS name resolves to: "dns:///host:port".
inline constexpr char kDnsScheme[] = "dns:///";

struct GroupPoolOptions {
  // Everything but verify_address and draft_addresses, which come from the entries below.
  RouterLoopOptions loop;
  // Entries ("host:port" or "dns:///host:port"). Verify: one group per address; at least one
  // entry. Draft: none means no draft service.
  std::vector<std::string> verify_addresses;
  std::vector<std::string> draft_addresses;
  absl::Duration load_poll = absl::Milliseconds(250);
  absl::Duration resolve_interval = absl::Seconds(10);
  Resolver resolver;  // null: ResolveAll
};

class GroupPool {
 public:
  // `tokenizer`, `registry` and `metrics` must outlive the pool; `metrics` holds the router's
  // totals, each group gets its own gauges in `registry`. `on_serving` is told whether at least
  // one group's verify service is up; called from internal threads.
  GroupPool(GroupPoolOptions options, const Tokenizer* tokenizer, prometheus::Registry* registry,
            RouterMetrics* metrics, std::function<void(bool serving)> on_serving);
  ~GroupPool();

  void Start();
  // Stops every group (their sequences fail with UNAVAILABLE) and the load poller.
  void Stop();

  // Places the request on the least-loaded group that is up, drafting through the least-loaded
  // draft service. UNAVAILABLE when no group is up, RESOURCE_EXHAUSTED when every group that
  // is up has a full queue. On success the pool owns finishing `sink`.
  absl::Status Submit(RouterRequest request, std::shared_ptr<ResponseSink> sink);
  // Makes every group's scheduler look at its queue (a queued request was cancelled).
  void Wake();

  // Groups and draft services in use (those whose address is gone included until closed).
  int num_groups() const;
  int num_drafts() const;
  // The verify and draft addresses that take new sequences, as last resolved.
  std::vector<std::string> verify_addresses() const;
  std::vector<std::string> draft_addresses() const;
  bool verify_up() const;  // any group
  int groups_up() const;   // groups whose verify service is up
  int drafts_up() const;   // draft services that answered the last poll
  bool draft_up() const;   // any group's stream to any draft service
  bool has_draft() const { return !options_.draft_addresses.empty(); }
  // Of the first group that is up (the first group while none is).
  v1::VerifyInfo verify_info() const;
  v1::DraftInfo draft_info() const;
  // The smallest of the groups' contexts: a request valid on one group is valid on every one.
  int max_context() const;

  // Resolves the entries now and applies the result (what the resolver thread does every
  // resolve_interval); closes what is gone and drained.
  void Refresh();

 private:
  struct Group;
  struct DraftService;
  class CountingSink;
  // A service's address, and with TLS the name its certificate is checked against: the DNS
  // name it was resolved from (empty for an address given as such).
  struct Target {
    std::string address;
    std::string tls_name;
  };

  // Load in [0, 2]: sequence slots in use plus KV in use, as a fraction each.
  double Load(const Group& group) const;
  double Load(const DraftService& draft) const;
  // The draft service for a new sequence; null when there is none.
  std::shared_ptr<DraftService> ChooseDraft() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<Target> Resolve(const std::vector<std::string>& entries);
  // Makes the groups and draft services those of the addresses given.
  void Apply(const std::vector<Target>& verify, const std::vector<Target>& draft);
  std::shared_ptr<grpc::Channel> Channel(const Target& target) const;
  // Closes groups and draft services whose address is gone and that hold no sequence.
  void Reap();
  std::shared_ptr<Group> MakeGroup(const Target& verify, const std::vector<Target>& drafts,
                                   int index);
  std::vector<std::shared_ptr<Group>> Groups() const;
  std::vector<std::shared_ptr<DraftService>> Drafts() const;
  void PollLoads();
  void ResolveLoop();
  void UpdateTotals();

  const GroupPoolOptions options_;
  const Tokenizer* const tokenizer_;
  prometheus::Registry* const registry_;
  RouterMetrics* const metrics_;
  const std::function<void(bool)> on_serving_;
  // Groups get labelled gauges: more than one entry, or a name that may resolve to several.
  const bool labelled_;
  const bool dynamic_;  // some entry is a DNS name

  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<Group>> groups_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<DraftService>> drafts_ ABSL_GUARDED_BY(mu_);
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;        // round-robin start for ties
  size_t next_draft_ ABSL_GUARDED_BY(mu_) = 0;  // the same for draft services
  int next_index_ ABSL_GUARDED_BY(mu_) = 0;     // the next group's verify_group label
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // The last addresses each DNS name resolved to (resolver thread, or the constructor).
  absl::Mutex resolve_mu_;
  std::map<std::string, std::vector<std::string>> resolved_ ABSL_GUARDED_BY(resolve_mu_);
  std::thread poller_;
  std::thread resolver_;
};

}  // namespace specd

#endif  // SPECD_SERVICES_ROUTER_GROUP_POOL_H_
