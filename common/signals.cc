#include "common/signals.h"

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <thread>

namespace specd {
namespace {

sigset_t TerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

std::atomic<int> g_signal{0};

}  // namespace

void BlockTerminationSignals() {
  const sigset_t set = TerminationSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

absl::Notification& WatchTerminationSignals() {
  static absl::Notification* const notification = new absl::Notification();
  std::thread([] {
    const sigset_t set = TerminationSignals();
    int sig = 0;
    while (sigwait(&set, &sig) != 0) {
    }
    g_signal = sig;
    notification->Notify();
  }).detach();
  return *notification;
}

int TerminationSignal() { return g_signal.load(); }

}  // namespace specd
