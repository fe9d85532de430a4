// The HTTP listeners against clients that hold connections: real sockets on loopback against
// GuardedHttpServer in this process and against a specd-http process. Slow clients (one header
// line at a time) are cut at the request read deadline and do not keep /health from answering;
// connections over the cap get a 503; 500 connections opened at once are all answered.
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/service/guarded_http_server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testutil/service_process.h"

namespace specd {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// A blocking TCP connection to 127.0.0.1:port; -1 on failure.
int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

bool SendAll(int fd, const std::string& data) {
  return send(fd, data.data(), data.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(data.size());
}

// Reads until the peer closes or `timeout` passes.
std::string ReadAll(int fd, absl::Duration timeout) {
  std::string out;
  const absl::Time end = absl::Now() + timeout;
  char buf[4096];
  while (absl::Now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// GET /health on a fresh connection; the raw response, or "" when none came within `timeout`.
std::string GetHealth(int port, absl::Duration timeout) {
  const int fd = Connect(port);
  if (fd < 0) return "";
  SendAll(fd, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  std::string response = ReadAll(fd, timeout);
  close(fd);
  return response;
}

// Whether the peer has closed `fd` (what it sent before is read and dropped).
bool PeerClosed(int fd) {
  char buf[1024];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n > 0) continue;
    return n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK);
  }
}

// Clients that each send a request line and then one header line every `interval`, forever
// (slowloris). Stop() ends them; closed_by_server() counts those the server hung up on.
class SlowClients {
 public:
  SlowClients(int port, int n, absl::Duration interval) {
    for (int i = 0; i < n; ++i) {
      const int fd = Connect(port);
      if (fd >= 0 && SendAll(fd, "GET /health HTTP/1.1\r\n")) fds_.push_back(fd);
    }
    closed_.assign(fds_.size(), false);
    thread_ = std::thread([this, interval] {
      while (!stop_.HasBeenNotified()) {
        for (size_t i = 0; i < fds_.size(); ++i) {
          if (closed_[i]) continue;
          if (PeerClosed(fds_[i]) || !SendAll(fds_[i], "X-Slow: 1\r\n")) {
            closed_[i] = true;
            ++closed_count_;
          }
        }
        stop_.WaitForNotificationWithTimeout(interval);
      }
    });
  }
  ~SlowClients() {
    stop_.Notify();
    thread_.join();
    for (int fd : fds_) close(fd);
  }
  int opened() const { return static_cast<int>(fds_.size()); }
  int closed_by_server() const { return closed_count_.load(); }

 private:
  std::vector<int> fds_;
  std::vector<bool> closed_;
  std::atomic<int> closed_count_{0};
  absl::Notification stop_;
  std::thread thread_;
};

class GuardedServer {
 public:
  explicit GuardedServer(const GuardedHttpOptions& options)
      : server_(std::make_unique<GuardedHttpServer>(options)) {
    server_->Get("/health", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("ok\n", "text/plain");
    });
    port_ = server_->bind_to_any_port("127.0.0.1");
    server_->RaiseListenBacklog();
    thread_ = std::thread([this] { server_->listen_after_bind(); });
    while (!server_->is_running()) absl::SleepFor(absl::Milliseconds(5));
  }
  ~GuardedServer() {
    server_->stop();
    thread_.join();
  }
  int port() const { return port_; }
  GuardedHttpServer& server() { return *server_; }

 private:
  std::unique_ptr<GuardedHttpServer> server_;
  int port_ = 0;
  std::thread thread_;
};

TEST(GuardedHttpServerTest, SlowClientsDoNotBlockHealthAndAreCutAtTheReadDeadline) {
  GuardedHttpOptions options;
  options.max_connections = 128;
  options.request_read_deadline = absl::Seconds(2);
  GuardedServer s(options);
  SlowClients slow(s.port(), 70, absl::Milliseconds(300));
  ASSERT_EQ(slow.opened(), 70);
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_GE(s.server().active_connections(), 70);
  const absl::Time start = absl::Now();
  const std::string health = GetHealth(s.port(), absl::Seconds(5));
  EXPECT_THAT(health, StartsWith("HTTP/1.1 200"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  // Still sending a line every 300 ms, each slow client is cut once its request has taken the
  // 2 s deadline (httplib's per-read timeout alone never fired).
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (slow.closed_by_server() < 70 && absl::Now() < end) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(slow.closed_by_server(), 70);
}

TEST(GuardedHttpServerTest, ConnectionsOverTheCapGet503) {
  GuardedHttpOptions options;
  options.max_connections = 4;
  GuardedServer s(options);
  std::vector<int> held;
  for (int i = 0; i < 4; ++i) held.push_back(Connect(s.port()));
  const absl::Time end = absl::Now() + absl::Seconds(5);
  while (s.server().active_connections() < 4 && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(s.server().active_connections(), 4);
  const std::string refused = GetHealth(s.port(), absl::Seconds(5));
  EXPECT_THAT(refused, StartsWith("HTTP/1.1 503"));
  EXPECT_THAT(refused, HasSubstr("too many connections"));
  for (int fd : held) close(fd);
  const absl::Time end2 = absl::Now() + absl::Seconds(10);
  std::string ok;
  while (absl::Now() < end2) {
    ok = GetHealth(s.port(), absl::Seconds(5));
    if (absl::StartsWith(ok, "HTTP/1.1 200")) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_THAT(ok, StartsWith("HTTP/1.1 200"));
}

// Opens `n` connections at once (non-blocking connects from one thread), sends GET /health on
// each and counts complete HTTP responses; resets and missing answers are failures.
int AnsweredOfConcurrent(int port, int n, const std::string& path) {
  std::vector<int> fds;
  for (int i = 0; i < n; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    fds.push_back(fd);
  }
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  std::vector<std::string> got(fds.size());
  std::vector<int> state(fds.size(), 0);  // 0 connecting, 1 sent, 2 done
  int done = 0;
  const absl::Time end = absl::Now() + absl::Seconds(30);
  while (done < n && absl::Now() < end) {
    std::vector<pollfd> p;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (state[i] < 2)
        p.push_back({fds[i], static_cast<short>(state[i] == 0 ? POLLOUT : POLLIN), 0});
    }
    if (poll(p.data(), p.size(), 100) <= 0) continue;
    for (size_t i = 0, j = 0; i < fds.size(); ++i) {
      if (state[i] >= 2) continue;
      const pollfd& q = p[j++];
      if (q.revents == 0) continue;
      if (state[i] == 0) {
        state[i] = SendAll(fds[i], request) ? 1 : 2;
        if (state[i] == 2) ++done;
        continue;
      }
      char buf[4096];
      const ssize_t r = recv(fds[i], buf, sizeof(buf), 0);
      if (r > 0) {
        got[i].append(buf, static_cast<size_t>(r));
      } else if (r == 0 || errno != EAGAIN) {
        state[i] = 2;
        ++done;
      }
    }
  }
  int answered = 0;
  for (size_t i = 0; i < fds.size(); ++i) {
    if (absl::StartsWith(got[i], "HTTP/1.1 ")) ++answered;
    close(fds[i]);
  }
  return answered;
}

TEST(GuardedHttpServerTest, FiveHundredConcurrentConnectionsAreAllAnswered) {
  GuardedServer s(GuardedHttpOptions{});
  EXPECT_EQ(AnsweredOfConcurrent(s.port(), 500, "/health"), 500);
}

// The same against a specd-http process (no router behind it, so /health answers 503: the
// point is that it answers).
TEST(HttpEdgeGuardTest, SpecdHttpHealthAnswersUnderSlowClientsAndConnectionBursts) {
  const int port = PickFreePort();
  const int router_port = PickFreePort();  // nothing listens there
  absl::StatusOr<std::unique_ptr<ServiceProcess>> p = ServiceProcess::Spawn(
      {SpecdBinary("specd-http"),
       {absl::StrCat("--address=127.0.0.1:", port),
        absl::StrCat("--router=127.0.0.1:", router_port), "--request_read_timeout_ms=2000"},
       absl::StrCat("127.0.0.1:", port)});
  ASSERT_TRUE(p.ok()) << p.status();
  std::string first;
  const absl::Time end = absl::Now() + absl::Seconds(30);
  while (first.empty() && absl::Now() < end) {
    first = GetHealth(port, absl::Seconds(3));
    if (first.empty()) absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_THAT(first, StartsWith("HTTP/1.1 ")) << (*p)->Log();
  {
    SlowClients slow(port, 70, absl::Milliseconds(300));
    ASSERT_EQ(slow.opened(), 70);
    absl::SleepFor(absl::Milliseconds(500));
    const absl::Time start = absl::Now();
    EXPECT_THAT(GetHealth(port, absl::Seconds(5)), StartsWith("HTTP/1.1 "));
    // /health asks the router's health with a 1 s deadline; the bound leaves room for it.
    EXPECT_LT(absl::Now() - start, absl::Seconds(3));
    const absl::Time cut = absl::Now() + absl::Seconds(10);
    while (slow.closed_by_server() < 70 && absl::Now() < cut) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    EXPECT_EQ(slow.closed_by_server(), 70);
  }
  EXPECT_EQ(AnsweredOfConcurrent(port, 500, "/version"), 500);
  EXPECT_TRUE((*p)->Running());
}

}  // namespace
}  // namespace specd
