#include "channel.h"

#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace specd {

// Public: declared in specd/client.h.
absl::StatusOr<TlsOptions> TlsOptions::FromFiles(const std::string& root_ca_path,
                                                 const std::string& cert_chain_path,
                                                 const std::string& private_key_path) {
  TlsOptions tls;
  const std::pair<const std::string*, std::string*> files[] = {
      {&root_ca_path, &tls.root_ca_pem},
      {&cert_chain_path, &tls.cert_chain_pem},
      {&private_key_path, &tls.private_key_pem}};
  const char* names[] = {"root_ca", "cert_chain", "private_key"};
  for (int i = 0; i < 3; ++i) {
    if (files[i].first->empty()) continue;
    absl::StatusOr<std::string> pem = client_internal::ReadFile(*files[i].first, names[i]);
    if (!pem.ok()) return pem.status();
    *files[i].second = *std::move(pem);
  }
  return tls;
}

namespace client_internal {

absl::StatusOr<std::string> ReadFile(const std::string& path, const std::string& field) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": cannot read ", path, ": ", std::strerror(errno)));
  }
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": cannot read ", path));
  }
  return contents.str();
}

namespace {

// A bearer token goes into an HTTP/2 header: visible ASCII only, no line breaks.
absl::Status ValidateToken(const std::string& token, const std::string& field) {
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": the token is empty"));
  for (unsigned char c : token) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": the token may hold visible ASCII characters only"));
    }
  }
  return absl::OkStatus();
}

bool ValidDuration(absl::Duration d) { return d > absl::ZeroDuration(); }

int ClampedMillis(absl::Duration d) {
  const int64_t ms = absl::ToInt64Milliseconds(d);
  return ms > std::numeric_limits<int>::max() ? std::numeric_limits<int>::max()
                                              : static_cast<int>(ms);
}

}  // namespace

absl::Status ValidateOptions(const ClientOptions& options) {
  if (options.target.empty()) {
    return absl::InvalidArgumentError("target: give the router's address, e.g. localhost:50050");
  }
  if (options.tls.has_value() &&
      options.tls->cert_chain_pem.empty() != options.tls->private_key_pem.empty()) {
    return absl::InvalidArgumentError(
        "tls.private_key_pem: mutual TLS needs both a certificate chain and its private key");
  }
  if (!options.bearer_token.empty() && !options.token_file.empty()) {
    return absl::InvalidArgumentError("token_file: give either bearer_token or token_file");
  }
  if (!options.bearer_token.empty()) {
    if (absl::Status s = ValidateToken(options.bearer_token, "bearer_token"); !s.ok()) return s;
  }
  if (absl::Status s = ValidateMetadata(options.metadata, "metadata"); !s.ok()) return s;
  if (!ValidDuration(options.default_timeout)) {
    return absl::InvalidArgumentError(
        absl::StrCat("default_timeout: must be positive (InfiniteDuration() for none), got ",
                     absl::FormatDuration(options.default_timeout)));
  }
  const RetryPolicy& r = options.retry;
  if (r.max_attempts < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("retry.max_attempts: must be >= 1 (1 = no retries), got ", r.max_attempts));
  }
  if (!ValidDuration(r.initial_backoff) || r.initial_backoff == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError("retry.initial_backoff: must be positive and finite");
  }
  if (r.max_backoff < r.initial_backoff || r.max_backoff == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        "retry.max_backoff: must be finite and at least retry.initial_backoff");
  }
  if (!(r.multiplier >= 1.0) || !std::isfinite(r.multiplier)) {
    return absl::InvalidArgumentError(
        absl::StrCat("retry.multiplier: must be a finite number >= 1, got ", r.multiplier));
  }
  if (!(r.jitter >= 0.0 && r.jitter < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("retry.jitter: must be in [0, 1), got ", r.jitter));
  }
  for (absl::StatusCode code : r.retryable_codes) {
    if (code == absl::StatusCode::kOk) {
      return absl::InvalidArgumentError("retry.retryable_codes: OK is not an error");
    }
  }
  if (!ValidDuration(options.keepalive_time) || !ValidDuration(options.keepalive_timeout)) {
    return absl::InvalidArgumentError(
        "keepalive_time, keepalive_timeout: must be positive (InfiniteDuration() for no pings)");
  }
  if (options.max_receive_message_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_receive_message_bytes: must be positive, got ", options.max_receive_message_bytes));
  }
  return absl::OkStatus();
}

std::shared_ptr<grpc::Channel> CreateChannel(const ClientOptions& options) {
  grpc::ChannelArguments args;
  if (options.keepalive_time != absl::InfiniteDuration()) {
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, ClampedMillis(options.keepalive_time));
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ClampedMillis(options.keepalive_timeout));
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  }
  args.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  // A channel that failed to connect waits before trying again (1 s at first, growing to
  // 120 s by default) and fails calls at once meanwhile; tied to the retry backoff, a router
  // that comes back is reached by the next retry rather than minutes later.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, ClampedMillis(options.retry.initial_backoff));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, ClampedMillis(options.retry.max_backoff));
  args.SetUserAgentPrefix("specd-cpp");
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (options.tls.has_value()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls->root_ca_pem;
    ssl.pem_cert_chain = options.tls->cert_chain_pem;
    ssl.pem_private_key = options.tls->private_key_pem;
    credentials = grpc::SslCredentials(ssl);
    if (!options.tls->server_name_override.empty()) {
      args.SetSslTargetNameOverride(options.tls->server_name_override);
    }
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  return grpc::CreateCustomChannel(options.target, credentials, args);
}

absl::Status ValidateMetadata(const Metadata& metadata, const std::string& field) {
  for (const auto& [key, value] : metadata) {
    bool ok = !key.empty() && key[0] != ':';
    for (char c : key) {
      ok = ok &&
           (absl::ascii_isdigit(c) || absl::ascii_islower(c) || c == '-' || c == '_' || c == '.');
    }
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": bad key '", key, "' (lower case letters, digits, '-', '_' and '.' only)"));
    }
    if (absl::EndsWith(key, "-bin")) continue;  // binary values: anything goes
    for (unsigned char c : value) {
      if (c < 0x20 || c > 0x7e) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ": the value of '", key,
            "' may hold printable ASCII only (keys ending in -bin take binary values)"));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CallMetadata>> CallMetadata::Create(const ClientOptions& options) {
  std::unique_ptr<CallMetadata> m(new CallMetadata());
  m->base_ = options.metadata;
  if (!options.bearer_token.empty()) {
    m->base_.emplace_back("authorization", absl::StrCat("Bearer ", options.bearer_token));
  }
  m->token_file_ = options.token_file;
  if (!m->token_file_.empty()) {
    absl::MutexLock lock(&m->mu_);
    if (absl::Status s = m->RefreshToken(); !s.ok()) return s;
  }
  return m;
}

absl::Status CallMetadata::RefreshToken() {
  struct stat st;
  if (::stat(token_file_.c_str(), &st) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("token_file: cannot read ", token_file_, ": ", std::strerror(errno)));
  }
  if (token_size_ >= 0 && st.st_ino == token_inode_ && st.st_size == token_size_ &&
      st.st_mtim.tv_sec == token_mtime_.tv_sec && st.st_mtim.tv_nsec == token_mtime_.tv_nsec) {
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> contents = ReadFile(token_file_, "token_file");
  if (!contents.ok()) return absl::FailedPreconditionError(contents.status().message());
  std::string token(absl::StripAsciiWhitespace(*contents));
  if (absl::Status s = ValidateToken(token, absl::StrCat("token_file ", token_file_)); !s.ok()) {
    return absl::FailedPreconditionError(s.message());
  }
  token_ = std::move(token);
  token_inode_ = st.st_ino;
  token_size_ = st.st_size;
  token_mtime_ = st.st_mtim;
  return absl::OkStatus();
}

absl::StatusOr<Metadata> CallMetadata::ForCall(const Metadata& extra) {
  if (absl::Status s = ValidateMetadata(extra, "CallOptions.metadata"); !s.ok()) return s;
  Metadata out = base_;
  if (!token_file_.empty()) {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = RefreshToken(); !s.ok()) return s;
    out.emplace_back("authorization", absl::StrCat("Bearer ", token_));
  }
  out.insert(out.end(), extra.begin(), extra.end());
  return out;
}

}  // namespace client_internal
}  // namespace specd
