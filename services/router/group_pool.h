// Several verify groups behind one router: one RouterLoop per verify service (each with its own
// Step stream, scheduler thread and paired draft service) and a placement layer above them.
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
// Draft services. Group i drafts through draft address i mod D (D draft addresses): the draft
// service of a sequence is chosen with its group. A group whose draft service is down goes on
// target-only (same output), as one RouterLoop does.
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
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/text/tokenizer.h"
#include "prometheus/registry.h"
#include "services/router/router_loop.h"
#include "services/router/router_metrics.h"
#include "specd/v1/verify.grpc.pb.h"

namespace specd {

struct GroupPoolOptions {
  // Everything but verify_address and draft_address, which come from the lists below.
  RouterLoopOptions loop;
  std::vector<std::string> verify_addresses;  // one group each; at least one
  std::vector<std::string> draft_addresses;   // empty: no draft service
  absl::Duration load_poll = absl::Milliseconds(250);
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

  // Places the request on the least-loaded group that is up. UNAVAILABLE when none is up,
  // RESOURCE_EXHAUSTED when every group that is up has a full queue. On success the pool owns
  // finishing `sink`.
  absl::Status Submit(RouterRequest request, std::shared_ptr<ResponseSink> sink);
  // Makes every group's scheduler look at its queue (a queued request was cancelled).
  void Wake();

  int num_groups() const { return static_cast<int>(groups_.size()); }
  bool verify_up() const;  // any group
  bool draft_up() const;   // any group's draft service
  bool has_draft() const { return !options_.draft_addresses.empty(); }
  // Of the first group that is up (group 0 while none is).
  v1::VerifyInfo verify_info() const;
  v1::DraftInfo draft_info() const;
  // The smallest of the groups' contexts: a request valid on one group is valid on every one.
  int max_context() const;

 private:
  struct Group;
  class CountingSink;

  // Load in [0, 2]: sequence slots in use plus KV in use, as a fraction each.
  double Load(const Group& group) const;
  void PollLoads();
  void UpdateTotals();

  const GroupPoolOptions options_;
  RouterMetrics* const metrics_;
  const std::function<void(bool)> on_serving_;
  std::vector<std::unique_ptr<Group>> groups_;

  absl::Mutex mu_;
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;  // round-robin start for ties
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread poller_;
};

}  // namespace specd

#endif  // SPECD_SERVICES_ROUTER_GROUP_POOL_H_
