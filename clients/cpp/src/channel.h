// The client's connection and the metadata it sends: channel credentials and arguments from
// ClientOptions, and the per-call metadata (bearer token, the caller's headers).
#ifndef SPECD_CLIENTS_CPP_SRC_CHANNEL_H_
#define SPECD_CLIENTS_CPP_SRC_CHANNEL_H_

#include <sys/types.h>

#include <ctime>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/channel.h"
#include "specd/client.h"

namespace specd {
namespace client_internal {

using Metadata = std::vector<std::pair<std::string, std::string>>;

// The whole file; INVALID_ARGUMENT "<field>: cannot read <path>: <why>" when it cannot.
absl::StatusOr<std::string> ReadFile(const std::string& path, const std::string& field);

// Checks every option, naming the bad one ("retry.max_attempts: must be >= 1, got 0").
absl::Status ValidateOptions(const ClientOptions& options);

// The channel to options.target (lazy: nothing connects until the first call).
std::shared_ptr<grpc::Channel> CreateChannel(const ClientOptions& options);

// gRPC metadata keys are lower case [0-9a-z-_.]; values of keys not ending in "-bin" are
// printable ASCII. gRPC fails a call with a bad pair without saying which; this names it.
absl::Status ValidateMetadata(const Metadata& metadata, const std::string& field);

// The metadata of every call: the client's headers and "authorization: Bearer <token>", the
// token taken from the options or read from the token file when that file has changed.
class CallMetadata {
 public:
  // Reads the token file once, so that a missing file is an error at Client::Create.
  static absl::StatusOr<std::unique_ptr<CallMetadata>> Create(const ClientOptions& options);

  // The client's metadata then `extra` (the call's own, validated here).
  absl::StatusOr<Metadata> ForCall(const Metadata& extra);

 private:
  CallMetadata() = default;

  // Reads the token file again (whitespace trimmed) when it is another file than last time or
  // was modified since: Kubernetes swaps a projected token's file by renaming a symlink.
  absl::Status RefreshToken() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Metadata base_;
  std::string token_file_;
  absl::Mutex mu_;
  std::string token_ ABSL_GUARDED_BY(mu_);
  // What identified the file read last.
  ino_t token_inode_ ABSL_GUARDED_BY(mu_) = 0;
  struct timespec token_mtime_ ABSL_GUARDED_BY(mu_) = {0, 0};
  off_t token_size_ ABSL_GUARDED_BY(mu_) = -1;
};

}  // namespace client_internal
}  // namespace specd

#endif  // SPECD_CLIENTS_CPP_SRC_CHANNEL_H_
