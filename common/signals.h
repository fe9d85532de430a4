// Clean shutdown on SIGINT/SIGTERM for the service executables. The handler only writes the
// signal number to a pipe (async-signal-safe); a watcher thread reads it and notifies ordinary
// code, which then shuts down in order. A handler rather than a blocked mask plus sigwait(),
// because libraries start threads before main (OpenBLAS's pool) that would not inherit the mask
// and would let the default action kill the process.
#ifndef SPECD_COMMON_SIGNALS_H_
#define SPECD_COMMON_SIGNALS_H_

#include <cstdint>

#include "absl/synchronization/notification.h"

namespace specd {

// Installs the SIGINT/SIGTERM handlers (and the SIGHUP one, see ReloadSignalCount; SIGPIPE is
// ignored) and starts the detached watcher thread on the first call;
// returns the process-lifetime notification it fires on the first signal.
absl::Notification& WatchTerminationSignals();

// SIGHUPs received since WatchTerminationSignals() was first called. SIGHUP asks a service to
// read its credentials (token files) again instead of ending it; readers compare the count
// with the one they last saw.
int64_t ReloadSignalCount();

// The signal that fired WatchTerminationSignals()' notification (0 before).
int TerminationSignal();

}  // namespace specd

#endif  // SPECD_COMMON_SIGNALS_H_
