#include "common/service/guarded_http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/synchronization/mutex.h"

namespace specd {
namespace {

// Set while the accept thread runs a connection's task only to refuse it.
thread_local bool refusing = false;

// One thread per connection up to `max`; beyond it the task runs at once on the accept thread
// with `refusing` set, which answers 503 without reading (non-blocking, so a client that does
// not read cannot stall the accept loop). shutdown() waits for the connection threads.
class ConnectionThreads : public httplib::TaskQueue {
 public:
  ConnectionThreads(int max, std::atomic<int>* active)
      : max_(max), active_(active), state_(std::make_shared<State>()) {}

  void enqueue(std::function<void()> fn) override {
    {
      absl::MutexLock lock(&state_->mu);
      if (state_->running < max_) {
        active_->store(++state_->running);
        // The thread holds the state, so it may finish unlocking after shutdown() returned.
        std::thread([state = state_, active = active_, fn = std::move(fn)] {
          fn();
          absl::MutexLock lock(&state->mu);
          active->store(--state->running);
        }).detach();
        return;
      }
    }
    refusing = true;
    fn();
    refusing = false;
  }

  void shutdown() override {
    absl::MutexLock lock(&state_->mu);
    state_->mu.Await(absl::Condition(
        +[](int* running) { return *running == 0; }, &state_->running));
  }

 private:
  struct State {
    absl::Mutex mu;
    int running ABSL_GUARDED_BY(mu) = 0;
  };
  const int max_;
  std::atomic<int>* const active_;  // the server's, which outlives its task queue
  const std::shared_ptr<State> state_;
};

// poll() for `events` on `sock` for at most `timeout` (clamped at 0): >0 ready, 0 timed out.
int Wait(int sock, short events, absl::Duration timeout) {
  pollfd p{sock, events, 0};
  const int ms = static_cast<int>(
      std::clamp<int64_t>(absl::ToInt64Milliseconds(timeout), 0, int64_t{1} << 30));
  int r;
  do {
    r = poll(&p, 1, ms);
  } while (r < 0 && errno == EINTR);
  return r;
}

std::pair<std::string, int> Address(const sockaddr_storage& a) {
  char host[INET6_ADDRSTRLEN] = {};
  int port = 0;
  if (a.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&a);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
  } else if (a.ss_family == AF_INET6) {
    const auto* in = reinterpret_cast<const sockaddr_in6*>(&a);
    inet_ntop(AF_INET6, &in->sin6_addr, host, sizeof(host));
    port = ntohs(in->sin6_port);
  }
  return {host, port};
}

// httplib's socket stream, except that every read also stops at the current request's
// deadline, so a request trickled in a byte at a time cannot hold its thread for longer.
class DeadlineStream : public httplib::Stream {
 public:
  DeadlineStream(int sock, absl::Duration read_timeout, absl::Duration write_timeout)
      : sock_(sock), read_timeout_(read_timeout), write_timeout_(write_timeout) {}

  void StartRequest(absl::Duration budget) { deadline_ = absl::Now() + budget; }

  bool is_readable() const override { return Wait(sock_, POLLIN, ReadWait()) > 0; }
  bool is_writable() const override { return Wait(sock_, POLLOUT, write_timeout_) > 0; }

  ssize_t read(char* ptr, size_t size) override {
    if (Wait(sock_, POLLIN, ReadWait()) <= 0) return -1;
    ssize_t n;
    do {
      n = recv(sock_, ptr, size, 0);
    } while (n < 0 && errno == EINTR);
    return n;
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (!is_writable()) return -1;
    ssize_t n;
    do {
      n = send(sock_, ptr, size, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    return n;
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage a{};
    socklen_t len = sizeof(a);
    if (getpeername(sock_, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
      std::tie(ip, port) = Address(a);
    }
  }

  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage a{};
    socklen_t len = sizeof(a);
    if (getsockname(sock_, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
      std::tie(ip, port) = Address(a);
    }
  }

  socket_t socket() const override { return sock_; }

 private:
  absl::Duration ReadWait() const { return std::min(read_timeout_, deadline_ - absl::Now()); }

  const int sock_;
  const absl::Duration read_timeout_;
  const absl::Duration write_timeout_;
  absl::Time deadline_ = absl::InfiniteFuture();
};

}  // namespace

GuardedHttpServer::GuardedHttpServer(const GuardedHttpOptions& options) : options_(options) {
  new_task_queue = [this] {
    return new ConnectionThreads(std::max(1, options_.max_connections), &active_);
  };
}

void GuardedHttpServer::RaiseListenBacklog() {
  // listen() on a listening socket updates its backlog (Linux).
  const socket_t sock = svr_sock_;
  if (sock != INVALID_SOCKET) ::listen(sock, SOMAXCONN);
}

void GuardedHttpServer::Refuse(socket_t sock) {
  static const std::string* const kBusy = [] {
    const std::string body =
        R"({"error":{"message":"too many connections, retry later","type":"server_error",)"
        R"("code":"too_many_connections"}})";
    return new std::string(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        "Retry-After: 1\r\nConnection: close\r\nContent-Length: " +
        std::to_string(body.size()) + "\r\n\r\n" + body);
  }();
  send(sock, kBusy->data(), kBusy->size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  // Reading what already arrived keeps close() from resetting the connection (which could
  // discard the 503 before the client reads it).
  char sink[4096];
  while (recv(sock, sink, sizeof(sink), MSG_DONTWAIT) > 0) {
  }
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
}

bool GuardedHttpServer::WaitForRequest(socket_t sock, absl::Duration timeout) const {
  // In slices, so that stop() does not wait a whole keep-alive timeout for idle connections.
  const absl::Time end = absl::Now() + timeout;
  while (svr_sock_ != INVALID_SOCKET) {
    const absl::Duration left = end - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    const int r = Wait(sock, POLLIN, std::min(left, absl::Milliseconds(100)));
    if (r < 0) return false;
    if (r > 0) return true;
  }
  return false;
}

bool GuardedHttpServer::process_and_close_socket(socket_t sock) {
  if (refusing) {
    Refuse(sock);
    return true;
  }
  const absl::Duration read_timeout =
      absl::Seconds(read_timeout_sec_) + absl::Microseconds(read_timeout_usec_);
  const absl::Duration write_timeout =
      absl::Seconds(write_timeout_sec_) + absl::Microseconds(write_timeout_usec_);
  const absl::Duration keep_alive = absl::Seconds(keep_alive_timeout_sec_);
  DeadlineStream stream(sock, read_timeout, write_timeout);
  bool ok = false;
  // httplib's keep-alive loop: up to keep_alive_max_count_ requests, each waiting at most the
  // keep-alive timeout for its first byte, then given the read deadline to arrive whole.
  for (size_t left = keep_alive_max_count_; left > 0 && svr_sock_ != INVALID_SOCKET; --left) {
    if (!WaitForRequest(sock, keep_alive)) break;
    stream.StartRequest(options_.request_read_deadline);
    bool closed = false;
    ok = process_request(stream, /*close_connection=*/left == 1, closed, nullptr);
    if (!ok || closed) break;
  }
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
  return ok;
}

}  // namespace specd
