// Clean shutdown on SIGINT/SIGTERM for the service executables: block both signals in every
// thread (call BlockTerminationSignals() first thing in main, before any thread exists, so the
// gRPC and HTTP threads inherit the mask), then let one thread sigwait() for them and shut down
// in order from ordinary code. Nothing runs inside a signal handler.
#ifndef SPECD_COMMON_SIGNALS_H_
#define SPECD_COMMON_SIGNALS_H_

#include "absl/synchronization/notification.h"

namespace specd {

void BlockTerminationSignals();

// Starts a detached thread that waits for SIGINT or SIGTERM and then notifies the returned
// notification (process-lifetime). Call once, after BlockTerminationSignals(). A signal that
// arrives while the model loads is seen once loading returns.
absl::Notification& WatchTerminationSignals();

// The signal that notified WatchTerminationSignals()' notification (0 before).
int TerminationSignal();

}  // namespace specd

#endif  // SPECD_COMMON_SIGNALS_H_
