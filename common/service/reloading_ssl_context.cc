#include "common/service/reloading_ssl_context.h"

#include <openssl/err.h>
#include <sys/stat.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/signals.h"

namespace specd {
namespace {

// OpenSSL's queued errors as one line (and the queue emptied).
std::string OpenSslErrors() {
  std::string out;
  while (const unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    absl::StrAppend(&out, out.empty() ? "" : "; ", buf);
  }
  return out.empty() ? std::string("unknown OpenSSL error") : out;
}

struct CtxDeleter {
  void operator()(SSL_CTX* ctx) const { SSL_CTX_free(ctx); }
};

// A server context from the files; errors name the flag of the file OpenSSL refused.
absl::StatusOr<std::shared_ptr<SSL_CTX>> Build(const ServerTlsFiles& files,
                                               absl::string_view prefix) {
  ERR_clear_error();
  std::shared_ptr<SSL_CTX> ctx(SSL_CTX_new(TLS_server_method()), CtxDeleter());
  if (ctx == nullptr) return absl::InternalError(OpenSslErrors());
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  SSL_CTX_set_options(ctx.get(), SSL_OP_NO_COMPRESSION | SSL_OP_NO_RENEGOTIATION);
  // httplib writes again from where a short write stopped.
  SSL_CTX_set_mode(ctx.get(), SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  if (SSL_CTX_use_certificate_chain_file(ctx.get(), files.cert.c_str()) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "cert: '", files.cert, "': ", OpenSslErrors()));
  }
  if (SSL_CTX_use_PrivateKey_file(ctx.get(), files.key.c_str(), SSL_FILETYPE_PEM) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "key: '", files.key, "': ", OpenSslErrors()));
  }
  if (SSL_CTX_check_private_key(ctx.get()) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "key: '", files.key, "' is not the key of ", prefix, "cert '", files.cert, "'"));
  }
  if (!files.client_ca.empty()) {
    if (SSL_CTX_load_verify_locations(ctx.get(), files.client_ca.c_str(), nullptr) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, "client_ca: '", files.client_ca, "': ", OpenSslErrors()));
    }
    // The CA names sent in the CertificateRequest, so clients pick a matching certificate.
    if (STACK_OF(X509_NAME)* names = SSL_load_client_CA_file(files.client_ca.c_str())) {
      SSL_CTX_set_client_CA_list(ctx.get(), names);
    }
    SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  ERR_clear_error();
  return ctx;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ReloadingSslContext>> ReloadingSslContext::Create(
    const ServerTlsFiles& files, absl::string_view flag_prefix) {
  if (absl::Status s = CheckServerTlsFiles(files, flag_prefix); !s.ok()) return s;
  if (files.cert.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(flag_prefix, "cert: required for HTTPS"));
  }
  std::unique_ptr<ReloadingSslContext> c(new ReloadingSslContext(files, flag_prefix));
  absl::MutexLock lock(&c->mu_);
  c->signals_seen_ = ReloadSignalCount();
  c->stamps_ = c->StampsNow();
  absl::StatusOr<std::shared_ptr<SSL_CTX>> ctx = Build(files, flag_prefix);
  if (!ctx.ok()) return ctx.status();
  c->current_ = *std::move(ctx);
  c->next_check_ = absl::Now() + absl::Seconds(kTlsRefreshSeconds);
  return c;
}

ReloadingSslContext::Stamps ReloadingSslContext::StampsNow() const {
  Stamps stamps;
  const std::string* paths[3] = {&files_.cert, &files_.key, &files_.client_ca};
  for (int i = 0; i < 3; ++i) {
    struct stat st = {};
    if (paths[i]->empty() || stat(paths[i]->c_str(), &st) != 0) continue;
    stamps[i].dev = st.st_dev;
    stamps[i].ino = st.st_ino;
    stamps[i].mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
    stamps[i].size = st.st_size;
  }
  return stamps;
}

std::shared_ptr<SSL_CTX> ReloadingSslContext::Current() {
  absl::MutexLock lock(&mu_);
  const int64_t signals = ReloadSignalCount();
  const absl::Time now = absl::Now();
  if (signals == signals_seen_ && now < next_check_) return current_;
  next_check_ = now + absl::Seconds(kTlsRefreshSeconds);
  const bool signalled = signals != signals_seen_;
  signals_seen_ = signals;
  Stamps stamps = StampsNow();
  if (!signalled && stamps == stamps_) return current_;
  // Whatever the outcome, these stamps were seen: a half-done rotation is tried again when
  // its next file lands, not every few seconds in between.
  stamps_ = stamps;
  absl::StatusOr<std::shared_ptr<SSL_CTX>> ctx = Build(files_, flag_prefix_);
  if (!ctx.ok()) {
    SPECD_LOG(WARNING) << "HTTPS certificate files changed but cannot be used ("
                       << ctx.status().message() << "); keeping the previous ones";
    return current_;
  }
  current_ = *std::move(ctx);
  ++reloads_;
  SPECD_LOG(INFO) << "HTTPS certificate '" << files_.cert << "' read again"
                  << (signalled ? " (SIGHUP)" : " (files changed)");
  return current_;
}

int64_t ReloadingSslContext::reloads() {
  absl::MutexLock lock(&mu_);
  return reloads_;
}

}  // namespace specd
