#include "retry.h"

#include <algorithm>
#include <cmath>

#include "absl/random/random.h"

namespace specd {
namespace client_internal {

absl::Duration RetryDelay(const RetryPolicy& policy, int retry, double unit) {
  const double exponent = std::max(0, retry - 1);
  const double base_s = std::min(
      absl::ToDoubleSeconds(policy.max_backoff),
      absl::ToDoubleSeconds(policy.initial_backoff) * std::pow(policy.multiplier, exponent));
  return absl::Seconds(base_s * (1.0 + policy.jitter * (2.0 * unit - 1.0)));
}

absl::Duration RandomRetryDelay(const RetryPolicy& policy, int retry) {
  // One generator a thread: absl::BitGen is not thread-safe and is costly to seed.
  thread_local absl::BitGen gen;
  return RetryDelay(policy, retry, absl::Uniform(gen, 0.0, 1.0));
}

bool ShouldRetry(const RetryPolicy& policy, absl::StatusCode code, int attempts,
                 absl::Duration delay, absl::Time deadline) {
  if (attempts >= policy.max_attempts) return false;
  if (std::find(policy.retryable_codes.begin(), policy.retryable_codes.end(), code) ==
      policy.retryable_codes.end()) {
    return false;
  }
  return absl::Now() + delay < deadline;
}

}  // namespace client_internal
}  // namespace specd
