// The HTTP listeners against clients that hold connections: real sockets on loopback against
// GuardedHttpServer in this process and against a specd-http process, each case over HTTP and
// over HTTPS (certificates openssl makes for the test). Slow clients (one header
// line at a time) are cut at the request read deadline and do not keep /health from answering;
// connections over the cap get a 503; 500 connections opened at once are all answered.
#include <fcntl.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <filesystem>
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
#include "common/service/reloading_ssl_context.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testutil/random_checkpoint.h"
#include "tests/testutil/service_process.h"
#include "tests/testutil/test_pki.h"

namespace specd {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// Client certificates and trust for the HTTPS runs of every case.
const TestPki& Pki() {
  static const TestPki* pki = [] {
    absl::StatusOr<TestPki> p = MakeTestPki("http_guard_test");
    EXPECT_TRUE(p.ok()) << p.status();
    return new TestPki(p.ok() ? *p : TestPki{});
  }();
  return *pki;
}

// A client context that trusts the test CA (and verifies the server's chain); null for
// plaintext.
SSL_CTX* ClientTls(bool https) {
  if (!https) return nullptr;
  static SSL_CTX* ctx = [] {
    // OpenSSL writes with write(): a slow client writing to a connection the server closed
    // must see EPIPE, not die of SIGPIPE.
    ::signal(SIGPIPE, SIG_IGN);
    SSL_CTX* c = SSL_CTX_new(TLS_client_method());
    EXPECT_EQ(SSL_CTX_load_verify_locations(c, Pki().Path("ca.pem").c_str(), nullptr), 1);
    SSL_CTX_set_verify(c, SSL_VERIFY_PEER, nullptr);
    return c;
  }();
  return ctx;
}

// A non-blocking TCP connection to 127.0.0.1:port whose connect may still be in progress; -1
// on failure.
int StartConnect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 && errno != EINPROGRESS) {
    close(fd);
    return -1;
  }
  return fd;
}

// One client connection, plaintext or TLS (non-blocking underneath either way).
class Conn {
 public:
  // A connection whose TCP connect may be in progress; Advance() completes it.
  Conn(int port, SSL_CTX* tls) : fd_(StartConnect(port)), tls_(tls) {}
  ~Conn() {
    if (ssl_ != nullptr) SSL_free(ssl_);
    if (fd_ >= 0) close(fd_);
  }
  Conn(const Conn&) = delete;
  Conn& operator=(const Conn&) = delete;

  // Connected and (for TLS) handshaken within `timeout`; null otherwise.
  static std::unique_ptr<Conn> Open(int port, SSL_CTX* tls,
                                    absl::Duration timeout = absl::Seconds(10)) {
    auto c = std::make_unique<Conn>(port, tls);
    const absl::Time end = absl::Now() + timeout;
    while (absl::Now() < end) {
      const short want = c->Advance();
      if (want == 0) return c;
      if (want < 0) return nullptr;
      c->Poll(want, absl::Milliseconds(50));
    }
    return nullptr;
  }

  // Moves the connect and handshake on: 0 when the connection is ready for the request, the
  // poll() events it waits for, or -1 when it failed.
  short Advance() {
    if (fd_ < 0) return -1;
    if (!connected_) {
      pollfd p{fd_, POLLOUT, 0};
      if (poll(&p, 1, 0) <= 0) return POLLOUT;
      int err = 0;
      socklen_t len = sizeof(err);
      if (getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) return -1;
      connected_ = true;
      if (tls_ != nullptr) {
        ssl_ = SSL_new(tls_);
        SSL_set_fd(ssl_, fd_);
      }
    }
    if (ssl_ == nullptr || handshaken_) return 0;
    ERR_clear_error();
    const int r = SSL_connect(ssl_);
    if (r == 1) {
      handshaken_ = true;
      return 0;
    }
    switch (SSL_get_error(ssl_, r)) {
      case SSL_ERROR_WANT_READ:
        return POLLIN;
      case SSL_ERROR_WANT_WRITE:
        return POLLOUT;
      default:
        return -1;
    }
  }

  int fd() const { return fd_; }
  void Poll(short events, absl::Duration timeout) const {
    pollfd p{fd_, events, 0};
    poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout)));
  }

  // Sends all of `data` within 5 s.
  bool Send(const std::string& data) {
    size_t sent = 0;
    const absl::Time end = absl::Now() + absl::Seconds(5);
    while (sent < data.size() && absl::Now() < end) {
      ssize_t n;
      if (ssl_ != nullptr) {
        ERR_clear_error();
        n = SSL_write(ssl_, data.data() + sent, static_cast<int>(data.size() - sent));
        if (n <= 0) {
          const int e = SSL_get_error(ssl_, static_cast<int>(n));
          if (e != SSL_ERROR_WANT_WRITE && e != SSL_ERROR_WANT_READ) return false;
          Poll(e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, absl::Milliseconds(50));
          continue;
        }
      } else {
        n = send(fd_, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
        if (n < 0) {
          if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return false;
          Poll(POLLOUT, absl::Milliseconds(50));
          continue;
        }
      }
      sent += static_cast<size_t>(n);
    }
    return sent == data.size();
  }

  // Appends what has arrived to `out`: >0 bytes read, 0 the peer closed, -1 nothing yet, -2
  // the connection failed (a reset).
  int ReadSome(std::string* out) {
    char buf[4096];
    if (ssl_ != nullptr) {
      ERR_clear_error();
      const int n = SSL_read(ssl_, buf, sizeof(buf));
      if (n > 0) {
        out->append(buf, static_cast<size_t>(n));
        return n;
      }
      const int e = SSL_get_error(ssl_, n);
      if (e == SSL_ERROR_WANT_READ) return -1;
      if (e == SSL_ERROR_ZERO_RETURN || (e == SSL_ERROR_SYSCALL && errno == 0)) return 0;
      return -2;
    }
    const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
    if (n > 0) {
      out->append(buf, static_cast<size_t>(n));
      return static_cast<int>(n);
    }
    if (n == 0) return 0;
    return errno == EAGAIN || errno == EWOULDBLOCK ? -1 : -2;
  }

  // Reads until the peer closes or `timeout` passes.
  std::string ReadAll(absl::Duration timeout) {
    std::string out;
    const absl::Time end = absl::Now() + timeout;
    while (absl::Now() < end) {
      const int r = ReadSome(&out);
      if (r == 0 || r == -2) break;
      if (r < 0) Poll(POLLIN, absl::Milliseconds(50));
    }
    return out;
  }

  // Whether the peer has closed the connection (what it sent before is read and dropped).
  bool PeerClosed() {
    std::string sink;
    for (;;) {
      const int r = ReadSome(&sink);
      if (r > 0) continue;
      return r != -1;
    }
  }

 private:
  const int fd_;
  SSL_CTX* const tls_;
  SSL* ssl_ = nullptr;
  bool connected_ = false;
  bool handshaken_ = false;
};

// GET /health on a fresh connection; the raw response, or "" when none came within `timeout`.
std::string GetHealth(int port, SSL_CTX* tls, absl::Duration timeout) {
  std::unique_ptr<Conn> c = Conn::Open(port, tls, timeout);
  if (c == nullptr) return "";
  c->Send("GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  return c->ReadAll(timeout);
}

// Clients that each send a request line and then one header line every `interval`, forever
// (slowloris). Stop() ends them; closed_by_server() counts those the server hung up on.
class SlowClients {
 public:
  SlowClients(int port, SSL_CTX* tls, int n, absl::Duration interval) {
    for (int i = 0; i < n; ++i) {
      std::unique_ptr<Conn> c = Conn::Open(port, tls);
      if (c != nullptr && c->Send("GET /health HTTP/1.1\r\n")) conns_.push_back(std::move(c));
    }
    closed_.assign(conns_.size(), false);
    thread_ = std::thread([this, interval] {
      while (!stop_.HasBeenNotified()) {
        for (size_t i = 0; i < conns_.size(); ++i) {
          if (closed_[i]) continue;
          if (conns_[i]->PeerClosed() || !conns_[i]->Send("X-Slow: 1\r\n")) {
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
  }
  int opened() const { return static_cast<int>(conns_.size()); }
  int closed_by_server() const { return closed_count_.load(); }

 private:
  std::vector<std::unique_ptr<Conn>> conns_;
  std::vector<bool> closed_;
  std::atomic<int> closed_count_{0};
  absl::Notification stop_;
  std::thread thread_;
};

// A GuardedHttpServer serving /health in this process, over HTTPS with the test's server
// certificate when `https`.
class GuardedServer {
 public:
  GuardedServer(GuardedHttpOptions options, bool https) {
    if (https && options.tls == nullptr) {
      absl::StatusOr<std::unique_ptr<ReloadingSslContext>> tls = ReloadingSslContext::Create(
          {Pki().Path("server.pem"), Pki().Path("server.key"), ""}, "--tls_");
      EXPECT_TRUE(tls.ok()) << tls.status();
      if (tls.ok()) options.tls = *std::move(tls);
    }
    server_ = std::make_unique<GuardedHttpServer>(options);
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

// Every case runs over plaintext HTTP and over HTTPS (the same guard serves both).
class GuardedHttpServerTest : public ::testing::TestWithParam<bool> {
 protected:
  bool https() const { return GetParam(); }
  SSL_CTX* tls() const { return ClientTls(GetParam()); }
};

std::string TransportName(const ::testing::TestParamInfo<bool>& info) {
  return info.param ? "Https" : "Http";
}

TEST_P(GuardedHttpServerTest, SlowClientsDoNotBlockHealthAndAreCutAtTheReadDeadline) {
  GuardedHttpOptions options;
  options.max_connections = 128;
  options.request_read_deadline = absl::Seconds(2);
  GuardedServer s(options, https());
  SlowClients slow(s.port(), tls(), 70, absl::Milliseconds(300));
  ASSERT_EQ(slow.opened(), 70);
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_GE(s.server().active_connections(), 70);
  const absl::Time start = absl::Now();
  const std::string health = GetHealth(s.port(), tls(), absl::Seconds(5));
  EXPECT_THAT(health, StartsWith("HTTP/1.1 200"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  // Still sending a line every 300 ms, each slow client is cut once its request has taken the
  // 2 s deadline (httplib's per-read timeout alone never fired).
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (slow.closed_by_server() < 70 && absl::Now() < end) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(slow.closed_by_server(), 70);
}

// A client that connects and sends nothing holds its thread for a bounded time: over HTTPS the
// handshake must finish within the read deadline, over HTTP the first byte must come within
// the keep-alive timeout.
TEST_P(GuardedHttpServerTest, SilentConnectionsAreClosed) {
  GuardedHttpOptions options;
  options.request_read_deadline = absl::Seconds(1);
  GuardedServer s(options, https());
  std::vector<int> silent;
  for (int i = 0; i < 8; ++i) silent.push_back(StartConnect(s.port()));
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(s.server().active_connections(), 8);
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (s.server().active_connections() > 0 && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(s.server().active_connections(), 0);
  for (int fd : silent) close(fd);
}

TEST_P(GuardedHttpServerTest, ConnectionsOverTheCapGet503) {
  GuardedHttpOptions options;
  options.max_connections = 4;
  GuardedServer s(options, https());
  std::vector<std::unique_ptr<Conn>> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(Conn::Open(s.port(), tls()));
    ASSERT_NE(held.back(), nullptr);
  }
  const absl::Time end = absl::Now() + absl::Seconds(5);
  while (s.server().active_connections() < 4 && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(s.server().active_connections(), 4);
  for (int i = 0; i < 3; ++i) {
    const std::string refused = GetHealth(s.port(), tls(), absl::Seconds(5));
    EXPECT_THAT(refused, StartsWith("HTTP/1.1 503"));
    EXPECT_THAT(refused, HasSubstr("too many connections"));
  }
  held.clear();
  const absl::Time end2 = absl::Now() + absl::Seconds(10);
  std::string ok;
  while (absl::Now() < end2) {
    ok = GetHealth(s.port(), tls(), absl::Seconds(5));
    if (absl::StartsWith(ok, "HTTP/1.1 200")) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_THAT(ok, StartsWith("HTTP/1.1 200"));
}

// Opens `n` connections at once (non-blocking connects and handshakes from one thread), sends
// GET `path` on each and counts complete HTTP responses; resets and missing answers are
// failures.
int AnsweredOfConcurrent(int port, SSL_CTX* tls, int n, const std::string& path) {
  std::vector<std::unique_ptr<Conn>> conns;
  for (int i = 0; i < n; ++i) conns.push_back(std::make_unique<Conn>(port, tls));
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  std::vector<std::string> got(conns.size());
  enum State { kConnecting, kReading, kDone };
  std::vector<State> state(conns.size(), kConnecting);
  std::vector<short> want(conns.size(), POLLOUT);
  int done = 0;
  const absl::Time end = absl::Now() + absl::Seconds(60);
  while (done < n && absl::Now() < end) {
    std::vector<pollfd> p;
    std::vector<size_t> index;
    for (size_t i = 0; i < conns.size(); ++i) {
      if (state[i] == kDone) continue;
      p.push_back({conns[i]->fd(), want[i], 0});
      index.push_back(i);
    }
    if (poll(p.data(), p.size(), 100) <= 0) continue;
    for (size_t j = 0; j < p.size(); ++j) {
      if (p[j].revents == 0) continue;
      const size_t i = index[j];
      if (state[i] == kConnecting) {
        const short w = conns[i]->Advance();
        if (w > 0) {
          want[i] = w;
          continue;
        }
        if (w == 0 && conns[i]->Send(request)) {
          state[i] = kReading;
          want[i] = POLLIN;
        } else {
          state[i] = kDone;
          ++done;
        }
        continue;
      }
      int r;
      while ((r = conns[i]->ReadSome(&got[i])) > 0) {
      }
      if (r != -1) {
        state[i] = kDone;
        ++done;
      }
    }
  }
  int answered = 0;
  for (size_t i = 0; i < conns.size(); ++i) {
    if (absl::StartsWith(got[i], "HTTP/1.1 ")) ++answered;
  }
  return answered;
}

TEST_P(GuardedHttpServerTest, FiveHundredConcurrentConnectionsAreAllAnswered) {
  GuardedServer s(GuardedHttpOptions{}, https());
  EXPECT_EQ(AnsweredOfConcurrent(s.port(), tls(), 500, "/health"), 500);
}

INSTANTIATE_TEST_SUITE_P(Transports, GuardedHttpServerTest, ::testing::Bool(), TransportName);

// A trust store holding only `ca` (a file of the test PKI).
SSL_CTX* Trusting(const std::string& ca) {
  ClientTls(true);  // ignores SIGPIPE
  SSL_CTX* c = SSL_CTX_new(TLS_client_method());
  EXPECT_EQ(SSL_CTX_load_verify_locations(c, Pki().Path(ca).c_str(), nullptr), 1);
  SSL_CTX_set_verify(c, SSL_VERIFY_PEER, nullptr);
  return c;
}

// Reads one response of a keep-alive connection (until its body, "ok\n", has arrived).
std::string ReadHealthResponse(Conn* c) {
  std::string out;
  const absl::Time end = absl::Now() + absl::Seconds(5);
  while (!absl::StrContains(out, "\r\n\r\nok\n") && absl::Now() < end) {
    if (c->ReadSome(&out) < 0) c->Poll(POLLIN, absl::Milliseconds(50));
  }
  return out;
}

// Certificate files replaced on disk (no signal): new connections get the new certificate
// within the polling period, and a keep-alive connection opened before goes on serving.
TEST(GuardedHttpsTest, RotatedFilesServeNewConnectionsAndOpenOnesGoOn) {
  const std::string dir = MakeTempDir("http_guard_rotation");
  std::filesystem::copy_file(Pki().Path("server.pem"), dir + "/tls.crt");
  std::filesystem::copy_file(Pki().Path("server.key"), dir + "/tls.key");
  absl::StatusOr<std::unique_ptr<ReloadingSslContext>> tls =
      ReloadingSslContext::Create({dir + "/tls.crt", dir + "/tls.key", ""}, "--tls_");
  ASSERT_TRUE(tls.ok()) << tls.status();
  GuardedHttpOptions options;
  options.tls = *std::move(tls);
  ReloadingSslContext* context = options.tls.get();
  GuardedServer s(options, /*https=*/true);
  SSL_CTX* old_ca = Trusting("ca.pem");
  SSL_CTX* new_ca = Trusting("other-ca.pem");

  std::unique_ptr<Conn> open = Conn::Open(s.port(), old_ca);
  ASSERT_NE(open, nullptr);
  const std::string request = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_TRUE(open->Send(request));
  EXPECT_THAT(ReadHealthResponse(open.get()), StartsWith("HTTP/1.1 200"));
  EXPECT_EQ(Conn::Open(s.port(), new_ca, absl::Seconds(2)), nullptr);

  for (const auto& [from, to] : {std::pair<std::string, std::string>{"other-server.key", "tls.key"},
                                 {"other-server.pem", "tls.crt"}}) {
    std::filesystem::copy_file(Pki().Path(from), dir + "/" + to + ".new");
    std::filesystem::rename(dir + "/" + to + ".new", dir + "/" + to);
  }
  std::unique_ptr<Conn> fresh;
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (fresh == nullptr && absl::Now() < end) {
    fresh = Conn::Open(s.port(), new_ca, absl::Seconds(2));
    if (fresh == nullptr) absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_NE(fresh, nullptr) << "no connection saw the new certificate";
  EXPECT_EQ(context->reloads(), 1);
  ASSERT_TRUE(fresh->Send(request));
  EXPECT_THAT(ReadHealthResponse(fresh.get()), StartsWith("HTTP/1.1 200"));
  EXPECT_EQ(Conn::Open(s.port(), old_ca, absl::Seconds(2)), nullptr);
  // The connection made under the old certificate still serves requests.
  ASSERT_TRUE(open->Send(request));
  EXPECT_THAT(ReadHealthResponse(open.get()), StartsWith("HTTP/1.1 200"));
  SSL_CTX_free(old_ca);
  SSL_CTX_free(new_ca);
}

// The same against a specd-http process (no router behind it, so /health answers 503: the
// point is that it answers), over HTTP and over HTTPS.
class HttpEdgeGuardTest : public GuardedHttpServerTest {};

TEST_P(HttpEdgeGuardTest, SpecdHttpHealthAnswersUnderSlowClientsAndConnectionBursts) {
  const int port = PickFreePort();
  const int router_port = PickFreePort();  // nothing listens there
  std::vector<std::string> args = {absl::StrCat("--address=127.0.0.1:", port),
                                   absl::StrCat("--router=127.0.0.1:", router_port),
                                   "--request_read_timeout_ms=4000"};
  if (https()) {
    args.push_back("--tls_cert=" + Pki().Path("server.pem"));
    args.push_back("--tls_key=" + Pki().Path("server.key"));
  }
  absl::StatusOr<std::unique_ptr<ServiceProcess>> p =
      ServiceProcess::Spawn({SpecdBinary("specd-http"), args, absl::StrCat("127.0.0.1:", port)});
  ASSERT_TRUE(p.ok()) << p.status();
  std::string first;
  const absl::Time end = absl::Now() + absl::Seconds(30);
  while (first.empty() && absl::Now() < end) {
    first = GetHealth(port, tls(), absl::Seconds(3));
    if (first.empty()) absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_THAT(first, StartsWith("HTTP/1.1 ")) << (*p)->Log();
  {
    SlowClients slow(port, tls(), 70, absl::Milliseconds(300));
    ASSERT_EQ(slow.opened(), 70);
    absl::SleepFor(absl::Milliseconds(500));
    const absl::Time start = absl::Now();
    EXPECT_THAT(GetHealth(port, tls(), absl::Seconds(5)), StartsWith("HTTP/1.1 "));
    // /health asks the router's health with a 1 s deadline; the bound leaves room for it.
    EXPECT_LT(absl::Now() - start, absl::Seconds(3));
    const absl::Time cut = absl::Now() + absl::Seconds(12);
    while (slow.closed_by_server() < 70 && absl::Now() < cut) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    EXPECT_EQ(slow.closed_by_server(), 70);
  }
  // The read deadline also bounds each TLS handshake: 4 s leaves this one client thread room
  // to complete 500 of them on a loaded machine.
  EXPECT_EQ(AnsweredOfConcurrent(port, tls(), 500, "/version"), 500);
  EXPECT_TRUE((*p)->Running());
}

INSTANTIATE_TEST_SUITE_P(Transports, HttpEdgeGuardTest, ::testing::Bool(), TransportName);

}  // namespace
}  // namespace specd
