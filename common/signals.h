// Clean shutdown on SIGINT/SIGTERM for the service executables: block both signals in every
// thread (call BlockTerminationSignals() first thing in main, before any thread exists, so the
// gRPC and HTTP threads inherit the mask), then wait for one on the main thread and shut down in
// order. Nothing runs inside a signal handler.
#ifndef SPECD_COMMON_SIGNALS_H_
#define SPECD_COMMON_SIGNALS_H_

namespace specd {

void BlockTerminationSignals();

// Blocks until SIGINT or SIGTERM arrives; returns the signal number.
int WaitForTerminationSignal();

}  // namespace specd

#endif  // SPECD_COMMON_SIGNALS_H_
