// An httplib::Server that a few slow or numerous clients cannot take over: it serves every
// connection on its own thread up to a cap and answers 503 beyond it, bounds the time a client
// may take to send one whole request (not only each read), and listens with a backlog of
// SOMAXCONN. Plain httplib queued connections behind a fixed pool of workers, each of which a
// client sending one header line a second could hold indefinitely (the per-read timeout never
// fired), and listened with a backlog of 5, so bursts of connections were reset.
//
// HTTPS takes the same path when the options hold a TLS context: the handshake runs on the
// connection's thread within the read deadline, and the context is asked for at each
// connection, so a rotated certificate serves new connections while open ones keep theirs.
#ifndef SPECD_COMMON_SERVICE_GUARDED_HTTP_SERVER_H_
#define SPECD_COMMON_SERVICE_GUARDED_HTTP_SERVER_H_

#include <atomic>
#include <memory>

#include "absl/time/time.h"
#include "common/service/reloading_ssl_context.h"
#include "httplib.h"

namespace specd {

struct GuardedHttpOptions {
  // Connections served at once (one thread each); a connection beyond it is answered 503 and
  // closed.
  int max_connections = 512;
  // From the first byte of a request to the last byte of its body; a slower client's
  // connection is closed.
  absl::Duration request_read_deadline = absl::Seconds(10);
  // Set: HTTPS with this context (shared with whoever else reloads it); null: plaintext.
  std::shared_ptr<ReloadingSslContext> tls;
};

class GuardedHttpServer : public httplib::Server {
 public:
  explicit GuardedHttpServer(const GuardedHttpOptions& options);

  // Call after bind_to_port / bind_to_any_port (httplib listens with a backlog of 5): raises
  // the listen backlog to SOMAXCONN.
  void RaiseListenBacklog();

  // Connections being served now (not counting those answered 503).
  int active_connections() const { return active_.load(); }

 private:
  // Called by httplib on a task-queue thread for each accepted connection.
  bool process_and_close_socket(socket_t sock) override;
  // Waits for the first byte of a request (keep-alive) while the server runs; `buffered`: a
  // request already read from the socket (TLS records hold more than one).
  bool WaitForRequest(socket_t sock, absl::Duration timeout, bool buffered) const;
  // Answers 503 on a connection over the cap, without reading the request, and closes it.
  void Refuse(socket_t sock);

  const GuardedHttpOptions options_;
  std::atomic<int> active_{0};
  // HTTPS refusals in progress: each needs a handshake, so it runs on a thread of its own
  // (the accept thread must not wait for a client), and these threads are capped too.
  std::shared_ptr<std::atomic<int>> tls_refusals_ = std::make_shared<std::atomic<int>>(0);
};

}  // namespace specd

#endif  // SPECD_COMMON_SERVICE_GUARDED_HTTP_SERVER_H_
