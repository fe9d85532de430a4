// Transport security of the specd services: gRPC server and channel credentials built from PEM
// files, and the bearer tokens of the public API.
//
// Certificates are read through gRPC's FileWatcherCertificateProvider, which polls the files
// every kTlsRefreshSeconds: replacing them (atomically, e.g. by renaming a directory or
// swapping a symlink, as Kubernetes does for mounted Secrets) takes effect for new connections
// without a restart; connections already open keep the certificate they were made with.
#ifndef SPECD_COMMON_SERVICE_TLS_OPTIONS_H_
#define SPECD_COMMON_SERVICE_TLS_OPTIONS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace specd {

// How often certificate, key and CA files are read again to pick up a rotation.
inline constexpr unsigned int kTlsRefreshSeconds = 2;

// A listener's TLS files. All empty: plaintext.
struct ServerTlsFiles {
  std::string cert;       // PEM certificate chain of the server
  std::string key;        // PEM private key of `cert`
  std::string client_ca;  // PEM CA bundle; set: clients must present a certificate it signed
  bool enabled() const { return !cert.empty() || !key.empty() || !client_ca.empty(); }
};

// A client's TLS files. All empty: plaintext.
struct ChannelTlsFiles {
  std::string ca;    // PEM CA bundle that signs the server's certificate; empty: system roots
  std::string cert;  // PEM client certificate chain for mutual TLS (with `key`)
  std::string key;
  bool enabled() const { return !ca.empty() || !cert.empty() || !key.empty(); }
};

// Checks that the files belong together and can be read: cert and key both or neither, a
// client CA only with a certificate. Errors name the flags: `flag_prefix` + "cert", "key",
// "client_ca" (e.g. "--tls_").
absl::Status CheckServerTlsFiles(const ServerTlsFiles& files, absl::string_view flag_prefix);
absl::Status CheckChannelTlsFiles(const ChannelTlsFiles& files, absl::string_view flag_prefix);

// Insecure credentials when `files` is empty, else TLS (mutual when client_ca is set), with
// the files watched for rotation. Runs the Check* function first.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const ServerTlsFiles& files, absl::string_view flag_prefix);
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const ChannelTlsFiles& files, absl::string_view flag_prefix);

// Whether `a` equals `b`, in a time that depends only on their lengths.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

// The bearer tokens a server accepts, from a file with one token per line (blank lines and
// lines starting with '#' skipped). The file is read again when its modification time or size
// changes (checked at most once a second) and at once after a SIGHUP, so tokens rotate without
// a restart; a file that becomes unreadable or empty keeps the previous tokens (and logs why).
class BearerTokens {
 public:
  // Errors name `flag` (e.g. "--token_file"): unreadable file, no token in it.
  static absl::StatusOr<std::unique_ptr<BearerTokens>> Load(const std::string& path,
                                                            absl::string_view flag);

  // Whether `token` is one of the tokens. Every token is compared, each in constant time.
  bool Accepts(absl::string_view token);

  // Whether an HTTP Authorization / gRPC authorization value, "Bearer <token>" (scheme in any
  // case), carries an accepted token.
  bool AcceptsAuthorization(absl::string_view header_value);

  // The file's first token: what a client sends.
  std::string First();

  // OK when the call's "authorization" metadata carries an accepted token, else
  // UNAUTHENTICATED with a message that says nothing about the tokens.
  grpc::Status CheckCall(const grpc::ServerContextBase& context);

 private:
  explicit BearerTokens(std::string path) : path_(std::move(path)) {}
  absl::Status ReadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeReload();

  const std::string path_;
  absl::Mutex mu_;
  std::vector<std::string> tokens_ ABSL_GUARDED_BY(mu_);
  int64_t mtime_ns_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t size_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t reload_signals_seen_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time next_check_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

// A channel whose every call carries "authorization: Bearer <tokens->First()>", so a client
// follows the rotation of its token file. Works over plaintext channels too (loopback).
std::shared_ptr<grpc::Channel> CreateChannelWithToken(
    const std::string& target, std::shared_ptr<grpc::ChannelCredentials> credentials,
    const grpc::ChannelArguments& args, std::shared_ptr<BearerTokens> tokens);

// The message of UNAUTHENTICATED answers and HTTP 401 bodies.
inline constexpr char kUnauthenticatedMessage[] = "missing or invalid bearer token";

}  // namespace specd

#endif  // SPECD_COMMON_SERVICE_TLS_OPTIONS_H_
