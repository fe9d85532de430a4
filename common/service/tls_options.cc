#include "common/service/tls_options.h"

#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/logging.h"
#include "common/signals.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "grpcpp/support/client_interceptor.h"

namespace specd {
namespace {

// Reads the whole file; errors name `flag`.
absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read '", path, "'"));
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

// A PEM file gRPC can use: readable, and holding a PEM block of the right kind. gRPC's file
// watcher would otherwise start with nothing and fail every handshake instead of the start.
absl::Status CheckPemFile(const std::string& path, absl::string_view flag, bool key) {
  absl::StatusOr<std::string> text = ReadFile(path, flag);
  if (!text.ok()) return text.status();
  const bool ok = key ? absl::StrContains(*text, "PRIVATE KEY-----")
                      : absl::StrContains(*text, "-----BEGIN CERTIFICATE-----");
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", path, "' holds no PEM ", key ? "private key" : "certificate"));
  }
  return absl::OkStatus();
}

absl::Status CheckPair(const std::string& cert, const std::string& key, absl::string_view prefix) {
  if (cert.empty() != key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "cert and ", prefix, "key: give both (a certificate and its key)"));
  }
  if (cert.empty()) return absl::OkStatus();
  if (absl::Status s = CheckPemFile(cert, absl::StrCat(prefix, "cert"), false); !s.ok()) return s;
  return CheckPemFile(key, absl::StrCat(prefix, "key"), true);
}

}  // namespace

absl::Status CheckServerTlsFiles(const ServerTlsFiles& files, absl::string_view flag_prefix) {
  if (!files.enabled()) return absl::OkStatus();
  if (files.cert.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(flag_prefix, "cert: required with ", flag_prefix,
                                                   "key or ", flag_prefix, "client_ca"));
  }
  if (absl::Status s = CheckPair(files.cert, files.key, flag_prefix); !s.ok()) return s;
  if (!files.client_ca.empty()) {
    return CheckPemFile(files.client_ca, absl::StrCat(flag_prefix, "client_ca"), false);
  }
  return absl::OkStatus();
}

absl::Status CheckChannelTlsFiles(const ChannelTlsFiles& files, absl::string_view flag_prefix) {
  if (!files.enabled()) return absl::OkStatus();
  if (absl::Status s = CheckPair(files.cert, files.key, flag_prefix); !s.ok()) return s;
  if (!files.ca.empty()) return CheckPemFile(files.ca, absl::StrCat(flag_prefix, "ca"), false);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerTlsFiles& files, absl::string_view flag_prefix) {
  if (absl::Status s = CheckServerTlsFiles(files, flag_prefix); !s.ok()) return s;
  if (!files.enabled()) return grpc::InsecureServerCredentials();
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      files.key, files.cert, files.client_ca, kTlsRefreshSeconds);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (!files.client_ca.empty()) {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ChannelTlsFiles& files, absl::string_view flag_prefix) {
  if (absl::Status s = CheckChannelTlsFiles(files, flag_prefix); !s.ok()) return s;
  if (!files.enabled()) return grpc::InsecureChannelCredentials();
  grpc::experimental::TlsChannelCredentialsOptions options;
  if (!files.ca.empty() || !files.cert.empty()) {
    options.set_certificate_provider(
        std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
            files.key, files.cert, files.ca, kTlsRefreshSeconds));
    // Without watched roots gRPC verifies against the system's.
    if (!files.ca.empty()) options.watch_root_certs();
    if (!files.cert.empty()) options.watch_identity_key_cert_pairs();
  }
  return grpc::experimental::TlsCredentials(options);
}

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

absl::StatusOr<std::unique_ptr<BearerTokens>> BearerTokens::Load(const std::string& path,
                                                                 absl::string_view flag) {
  std::unique_ptr<BearerTokens> tokens(new BearerTokens(path));
  absl::MutexLock lock(&tokens->mu_);
  tokens->reload_signals_seen_ = ReloadSignalCount();
  if (absl::Status s = tokens->ReadLocked(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", s.message()));
  }
  tokens->next_check_ = absl::Now() + absl::Seconds(1);
  return tokens;
}

absl::Status BearerTokens::ReadLocked() {
  struct stat st = {};
  if (stat(path_.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("cannot read '", path_, "'"));
  }
  absl::StatusOr<std::string> text = ReadFile(path_, "token file");
  if (!text.ok()) return text.status();
  std::vector<std::string> tokens;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    tokens.emplace_back(line);
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("'", path_, "' holds no token"));
  }
  tokens_ = std::move(tokens);
  mtime_ns_ = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  size_ = st.st_size;
  return absl::OkStatus();
}

void BearerTokens::MaybeReload() {
  absl::MutexLock lock(&mu_);
  const int64_t signals = ReloadSignalCount();
  const absl::Time now = absl::Now();
  if (signals == reload_signals_seen_ && now < next_check_) return;
  next_check_ = now + absl::Seconds(1);
  bool changed = signals != reload_signals_seen_;
  reload_signals_seen_ = signals;
  if (!changed) {
    struct stat st = {};
    if (stat(path_.c_str(), &st) != 0) return;
    const int64_t mtime = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
    changed = mtime != mtime_ns_ || st.st_size != size_;
  }
  if (!changed) return;
  const size_t before = tokens_.size();
  if (absl::Status s = ReadLocked(); !s.ok()) {
    SPECD_LOG(WARNING) << "token file: " << s.message() << "; keeping the " << before
                       << " token(s) read before";
    return;
  }
  SPECD_LOG(INFO) << "token file '" << path_ << "' read again: " << tokens_.size() << " token(s)";
}

bool BearerTokens::Accepts(absl::string_view token) {
  MaybeReload();
  if (token.empty()) return false;
  absl::MutexLock lock(&mu_);
  bool accepted = false;
  // No early exit: the time taken does not say which token matched.
  for (const std::string& t : tokens_) accepted |= ConstantTimeEquals(t, token);
  return accepted;
}

bool BearerTokens::AcceptsAuthorization(absl::string_view header_value) {
  header_value = absl::StripAsciiWhitespace(header_value);
  constexpr absl::string_view kScheme = "bearer ";
  if (header_value.size() <= kScheme.size() ||
      !absl::EqualsIgnoreCase(header_value.substr(0, kScheme.size()), kScheme)) {
    return false;
  }
  return Accepts(absl::StripLeadingAsciiWhitespace(header_value.substr(kScheme.size())));
}

std::string BearerTokens::First() {
  MaybeReload();
  absl::MutexLock lock(&mu_);
  return tokens_.empty() ? std::string() : tokens_.front();
}

grpc::Status BearerTokens::CheckCall(const grpc::ServerContextBase& context) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it != metadata.end() &&
      AcceptsAuthorization(absl::string_view(it->second.data(), it->second.size()))) {
    return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, kUnauthenticatedMessage);
}

namespace {

class TokenInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit TokenInterceptor(BearerTokens* tokens) : tokens_(tokens) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace("authorization",
                                                 absl::StrCat("Bearer ", tokens_->First()));
    }
    methods->Proceed();
  }

 private:
  BearerTokens* const tokens_;
};

class TokenInterceptorFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit TokenInterceptorFactory(std::shared_ptr<BearerTokens> tokens)
      : tokens_(std::move(tokens)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* /*info*/) override {
    return new TokenInterceptor(tokens_.get());
  }

 private:
  const std::shared_ptr<BearerTokens> tokens_;
};

}  // namespace

std::shared_ptr<grpc::Channel> CreateChannelWithToken(
    const std::string& target, std::shared_ptr<grpc::ChannelCredentials> credentials,
    const grpc::ChannelArguments& args, std::shared_ptr<BearerTokens> tokens) {
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> factories;
  factories.push_back(std::make_unique<TokenInterceptorFactory>(std::move(tokens)));
  return grpc::experimental::CreateCustomChannelWithInterceptors(
      target, credentials ? credentials : grpc::InsecureChannelCredentials(), args,
      std::move(factories));
}

}  // namespace specd
