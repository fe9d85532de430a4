#include "common/signals.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <thread>

namespace specd {
namespace {

int g_pipe[2] = {-1, -1};
std::atomic<int> g_signal{0};
std::atomic<int64_t> g_reloads{0};
static_assert(std::atomic<int64_t>::is_always_lock_free, "used from a signal handler");

void OnReloadSignal(int /*sig*/) { g_reloads.fetch_add(1, std::memory_order_relaxed); }

void OnSignal(int sig) {
  const int saved = errno;
  const char byte = static_cast<char>(sig);
  (void)!write(g_pipe[1], &byte, 1);
  errno = saved;
}

absl::Notification* Install() {
  auto* notification = new absl::Notification();
  if (pipe2(g_pipe, O_CLOEXEC) != 0) return notification;
  struct sigaction action = {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  struct sigaction reload = {};
  reload.sa_handler = OnReloadSignal;
  sigemptyset(&reload.sa_mask);
  reload.sa_flags = SA_RESTART;
  sigaction(SIGHUP, &reload, nullptr);
  // A write to a peer that closed its end must fail with EPIPE, not end the process:
  // OpenSSL (specd-http's HTTPS) writes with plain write().
  signal(SIGPIPE, SIG_IGN);
  std::thread([notification] {
    char byte = 0;
    ssize_t n;
    while ((n = read(g_pipe[0], &byte, 1)) < 0 && errno == EINTR) {
    }
    g_signal = n == 1 ? byte : SIGTERM;
    notification->Notify();
  }).detach();
  return notification;
}

}  // namespace

absl::Notification& WatchTerminationSignals() {
  static absl::Notification* const notification = Install();
  return *notification;
}

int64_t ReloadSignalCount() { return g_reloads.load(std::memory_order_relaxed); }

int TerminationSignal() { return g_signal.load(); }

}  // namespace specd
