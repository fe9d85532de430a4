// When to try a failed call again (RetryPolicy in specd/client.h).
#ifndef SPECD_CLIENTS_CPP_SRC_RETRY_H_
#define SPECD_CLIENTS_CPP_SRC_RETRY_H_

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "specd/client.h"

namespace specd {
namespace client_internal {

// The wait before retry `retry` (1 for the first): min(max_backoff, initial_backoff *
// multiplier^(retry-1)) scaled by 1 + jitter * (2 * unit - 1), `unit` uniform in [0, 1).
absl::Duration RetryDelay(const RetryPolicy& policy, int retry, double unit);

// RetryDelay with a random `unit`.
absl::Duration RandomRetryDelay(const RetryPolicy& policy, int retry);

// Whether a call that failed with `code` after `attempts` attempts, before any response
// arrived, is tried again after `delay`, given the call's `deadline`: a retryable code,
// attempts left, and time left after the wait.
bool ShouldRetry(const RetryPolicy& policy, absl::StatusCode code, int attempts,
                 absl::Duration delay, absl::Time deadline);

}  // namespace client_internal
}  // namespace specd

#endif  // SPECD_CLIENTS_CPP_SRC_RETRY_H_
