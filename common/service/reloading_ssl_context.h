// The OpenSSL server context of an HTTPS listener, built from PEM files and built again when
// they change, so certificates rotate without a restart: the files are looked at again at most
// every kTlsRefreshSeconds (the period of the gRPC listeners' file watcher) and at once after a
// SIGHUP, by the next connection to arrive. Each connection keeps the context it was accepted
// with (OpenSSL counts references), so those in flight are not disturbed by a rotation.
#ifndef SPECD_COMMON_SERVICE_RELOADING_SSL_CONTEXT_H_
#define SPECD_COMMON_SERVICE_RELOADING_SSL_CONTEXT_H_

#include <openssl/ssl.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/service/tls_options.h"

namespace specd {

class ReloadingSslContext {
 public:
  // Reads the files (cert and key required; client_ca set: clients must present a certificate
  // it signed). Errors name the flags `flag_prefix` + "cert", "key", "client_ca".
  static absl::StatusOr<std::unique_ptr<ReloadingSslContext>> Create(const ServerTlsFiles& files,
                                                                     absl::string_view flag_prefix);

  // The context for a new connection (an SSL made from it holds its own reference). Builds it
  // again first when a SIGHUP came since the last look or the files' stamps changed; files
  // that do not make a valid context (a key not matching the certificate while a rotation is
  // half done) keep the previous one and are logged.
  std::shared_ptr<SSL_CTX> Current();

  // Contexts built since Create (for tests and logs).
  int64_t reloads();

 private:
  // What tells a file changed: a rotation by rename or symlink swap changes the inode, an
  // in-place rewrite the modification time or size.
  struct Stamp {
    uint64_t dev = 0, ino = 0;
    int64_t mtime_ns = 0, size = -1;
    bool operator==(const Stamp& o) const {
      return dev == o.dev && ino == o.ino && mtime_ns == o.mtime_ns && size == o.size;
    }
  };
  using Stamps = std::array<Stamp, 3>;  // cert, key, client_ca

  ReloadingSslContext(const ServerTlsFiles& files, absl::string_view flag_prefix)
      : files_(files), flag_prefix_(flag_prefix) {}
  Stamps StampsNow() const;

  const ServerTlsFiles files_;
  const std::string flag_prefix_;
  absl::Mutex mu_;
  std::shared_ptr<SSL_CTX> current_ ABSL_GUARDED_BY(mu_);
  Stamps stamps_ ABSL_GUARDED_BY(mu_);
  int64_t signals_seen_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t reloads_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time next_check_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace specd

#endif  // SPECD_COMMON_SERVICE_RELOADING_SSL_CONTEXT_H_
