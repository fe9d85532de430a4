#include "common/service/guarded_http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
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

// What an HTTP 503 for a connection over the cap says (plaintext or inside TLS).
const std::string& BusyResponse() {
  static const std::string* const kBusy = [] {
    const std::string body =
        R"({"error":{"message":"too many connections, retry later","type":"server_error",)"
        R"("code":"too_many_connections"}})";
    return new std::string(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        "Retry-After: 1\r\nConnection: close\r\nContent-Length: " +
        std::to_string(body.size()) + "\r\n\r\n" + body);
  }();
  return *kBusy;
}

// The TLS connection of one socket (non-blocking: every wait is a poll() with a bound).
struct SslDeleter {
  void operator()(SSL* ssl) const { SSL_free(ssl); }
};
using SslPtr = std::unique_ptr<SSL, SslDeleter>;

// Waits for what OpenSSL asked for after a call returned `ret`: >0 ready, 0 timed out, <0 the
// connection failed or closed.
int WaitForSsl(SSL* ssl, int sock, int ret, absl::Duration timeout) {
  switch (SSL_get_error(ssl, ret)) {
    case SSL_ERROR_WANT_READ:
      return Wait(sock, POLLIN, timeout);
    case SSL_ERROR_WANT_WRITE:
      return Wait(sock, POLLOUT, timeout);
    default:
      return -1;
  }
}

// OpenSSL writes to the socket with write(), which raises SIGPIPE when the client has gone;
// blocked on the connection's own thread (which ends with the connection), the signal stays
// pending there and is dropped, and the write fails with EPIPE as send(MSG_NOSIGNAL) would.
void BlockSigpipeOnThisThread() {
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
}

// A server-side TLS session on `sock` from `ctx`, handshaken by `deadline`; null when the
// client did not complete it in time or failed it (no certificate under mutual TLS, plaintext
// on the HTTPS port).
SslPtr Handshake(SSL_CTX* ctx, int sock, absl::Time deadline) {
  const int flags = fcntl(sock, F_GETFL, 0);
  if (flags < 0 || fcntl(sock, F_SETFL, flags | O_NONBLOCK) < 0) return nullptr;
  SslPtr ssl(SSL_new(ctx));
  if (ssl == nullptr || SSL_set_fd(ssl.get(), sock) != 1) return nullptr;
  for (;;) {
    ERR_clear_error();
    const int r = SSL_accept(ssl.get());
    if (r == 1) return ssl;
    if (WaitForSsl(ssl.get(), sock, r, deadline - absl::Now()) <= 0) {
      ERR_clear_error();
      return nullptr;
    }
  }
}

// httplib's socket stream, except that every read also stops at the current request's
// deadline, so a request trickled in a byte at a time cannot hold its thread for longer. With
// `ssl` set it reads and writes through TLS (the socket non-blocking), else the socket itself.
class DeadlineStream : public httplib::Stream {
 public:
  DeadlineStream(int sock, SSL* ssl, absl::Duration read_timeout, absl::Duration write_timeout)
      : sock_(sock), ssl_(ssl), read_timeout_(read_timeout), write_timeout_(write_timeout) {}

  void StartRequest(absl::Duration budget) { deadline_ = absl::Now() + budget; }

  // Bytes of a request OpenSSL already decrypted, which poll() on the socket cannot see.
  bool Buffered() const { return ssl_ != nullptr && SSL_pending(ssl_) > 0; }

  bool is_readable() const override { return Buffered() || Wait(sock_, POLLIN, ReadWait()) > 0; }
  bool is_writable() const override { return Wait(sock_, POLLOUT, write_timeout_) > 0; }

  ssize_t read(char* ptr, size_t size) override {
    if (ssl_ != nullptr) {
      for (;;) {
        ERR_clear_error();
        const int n = SSL_read(ssl_, ptr, static_cast<int>(std::min<size_t>(size, INT_MAX)));
        if (n > 0) return n;
        if (SSL_get_error(ssl_, n) == SSL_ERROR_ZERO_RETURN) return 0;
        if (WaitForSsl(ssl_, sock_, n, ReadWait()) <= 0) return -1;
      }
    }
    if (Wait(sock_, POLLIN, ReadWait()) <= 0) return -1;
    ssize_t n;
    do {
      n = recv(sock_, ptr, size, 0);
    } while (n < 0 && errno == EINTR);
    return n;
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (ssl_ != nullptr) {
      for (;;) {
        ERR_clear_error();
        const int n = SSL_write(ssl_, ptr, static_cast<int>(std::min<size_t>(size, INT_MAX)));
        if (n > 0) return n;
        if (WaitForSsl(ssl_, sock_, n, write_timeout_) <= 0) return -1;
      }
    }
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
  SSL* const ssl_;  // not owned; null: plaintext
  const absl::Duration read_timeout_;
  const absl::Duration write_timeout_;
  absl::Time deadline_ = absl::InfiniteFuture();
};

// Ends a TLS session with a close_notify (not waiting for the client's), so the client sees a
// clean end of the response rather than a truncation.
void CloseTls(SSL* ssl) {
  ERR_clear_error();
  SSL_shutdown(ssl);
  ERR_clear_error();
}

// The 503 of an HTTPS connection over the cap: handshake and answer within a short bound.
void RefuseTls(SSL_CTX* ctx, int sock) {
  BlockSigpipeOnThisThread();
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  if (SslPtr ssl = Handshake(ctx, sock, deadline)) {
    const std::string& busy = BusyResponse();
    size_t sent = 0;
    while (sent < busy.size()) {
      ERR_clear_error();
      const int n = SSL_write(ssl.get(), busy.data() + sent, static_cast<int>(busy.size() - sent));
      if (n > 0) {
        sent += static_cast<size_t>(n);
      } else if (WaitForSsl(ssl.get(), sock, n, deadline - absl::Now()) <= 0) {
        break;
      }
    }
    CloseTls(ssl.get());
    // Closing with the client's request unread would reset the connection, which can discard
    // the 503 before the client reads it: wait (briefly) for the client to close first.
    ::shutdown(sock, SHUT_WR);
    char sink[4096];
    for (;;) {
      const ssize_t n = recv(sock, sink, sizeof(sink), 0);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) break;
      if (n < 0 && Wait(sock, POLLIN, deadline - absl::Now()) <= 0) break;
    }
  }
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
}

// HTTPS refusals handshaking at once; connections beyond are closed without an answer.
constexpr int kMaxTlsRefusals = 32;

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
  if (options_.tls != nullptr) {
    if (tls_refusals_->fetch_add(1) < kMaxTlsRefusals) {
      std::thread([ctx = options_.tls->Current(), sock, count = tls_refusals_] {
        RefuseTls(ctx.get(), sock);
        --*count;
      }).detach();
      return;
    }
    --*tls_refusals_;
    ::close(sock);
    return;
  }
  const std::string& busy = BusyResponse();
  send(sock, busy.data(), busy.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  // Reading what already arrived keeps close() from resetting the connection (which could
  // discard the 503 before the client reads it).
  char sink[4096];
  while (recv(sock, sink, sizeof(sink), MSG_DONTWAIT) > 0) {
  }
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
}

bool GuardedHttpServer::WaitForRequest(socket_t sock, absl::Duration timeout, bool buffered) const {
  if (buffered) return true;
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
  SslPtr ssl;
  if (options_.tls != nullptr) {
    // The handshake is bounded like a request: a client cannot hold the thread without one.
    BlockSigpipeOnThisThread();
    const std::shared_ptr<SSL_CTX> ctx = options_.tls->Current();
    ssl = Handshake(ctx.get(), sock, absl::Now() + options_.request_read_deadline);
    if (ssl == nullptr) {
      ::shutdown(sock, SHUT_RDWR);
      ::close(sock);
      return false;
    }
  }
  DeadlineStream stream(sock, ssl.get(), read_timeout, write_timeout);
  SSL* const request_ssl = ssl.get();
  const std::function<void(httplib::Request&)> setup = [request_ssl](httplib::Request& req) {
    req.ssl = request_ssl;
  };
  bool ok = false;
  // httplib's keep-alive loop: up to keep_alive_max_count_ requests, each waiting at most the
  // keep-alive timeout for its first byte, then given the read deadline to arrive whole.
  for (size_t left = keep_alive_max_count_; left > 0 && svr_sock_ != INVALID_SOCKET; --left) {
    if (!WaitForRequest(sock, keep_alive, stream.Buffered())) break;
    stream.StartRequest(options_.request_read_deadline);
    bool closed = false;
    ok = process_request(stream, /*close_connection=*/left == 1, closed,
                         ssl != nullptr ? setup : nullptr);
    if (!ok || closed) break;
  }
  if (ssl != nullptr) CloseTls(ssl.get());
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
  return ok;
}

}  // namespace specd
