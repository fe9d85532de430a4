#include "common/signals.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <thread>

namespace specd {
namespace {

int g_pipe[2] = {-1, -1};
std::atomic<int> g_signal{0};

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

int TerminationSignal() { return g_signal.load(); }

}  // namespace specd
