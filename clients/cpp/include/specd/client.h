// specd::Client: the C++ client of specd-router's public gRPC API (specd.v1.Generation).
//
//   specd::ClientOptions options;
//   options.target = "localhost:50050";
//   absl::StatusOr<std::unique_ptr<specd::Client>> client = specd::Client::Create(options);
//   specd::GenerateRequest request;
//   request.prompt = "def fib(n):";
//   request.max_new_tokens = 64;
//   absl::StatusOr<specd::Completion> completion = (*client)->Generate(request);
//
// Every call returns an absl::Status(Or): on failure its code is the gRPC status code (Abseil
// and gRPC share the numbering) and its message the server's, e.g. INVALID_ARGUMENT
// "temperature: must be a finite number >= 0, got -1". Errors the client finds itself (a
// request with both prompt and prompt_ids, an unreadable token file) are INVALID_ARGUMENT or
// FAILED_PRECONDITION naming the field.
//
// Retries (RetryPolicy): a call that fails with UNAVAILABLE (router unreachable or restarting)
// or RESOURCE_EXHAUSTED (the router's queue is full) is tried again after an exponential
// backoff with jitter, but only before any response arrived: a Generate stream is never
// retried once a chunk was delivered, since the caller has already seen part of the output.
// The deadline covers every attempt and travels to the router, which passes it on to the
// draft and verify services.
//
// A Client is thread-safe; one is meant to be shared by all threads of a process (it holds one
// HTTP/2 connection). docs/sdk-cpp.md has the whole guide.
#ifndef SPECD_CLIENTS_CPP_INCLUDE_SPECD_CLIENT_H_
#define SPECD_CLIENTS_CPP_INCLUDE_SPECD_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "specd/types.h"

namespace specd {

// Transport security. PEM contents, not paths: TlsOptions::FromFiles reads files.
struct TlsOptions {
  // CAs to trust; empty: gRPC's default roots ($GRPC_DEFAULT_SSL_ROOTS_FILE_PATH, else the
  // bundle gRPC was installed with, /usr/share/grpc/roots.pem on Debian).
  std::string root_ca_pem;
  // Client certificate chain and private key, both or neither: mutual TLS.
  std::string cert_chain_pem;
  std::string private_key_pem;
  // Checks the server's certificate against this name instead of the target's host (tests,
  // connecting by IP address).
  std::string server_name_override;

  // Reads the PEM files (an empty path leaves its field empty). Errors name the file's field:
  // "root_ca: cannot read /etc/ca.pem: No such file or directory".
  static absl::StatusOr<TlsOptions> FromFiles(const std::string& root_ca_path,
                                              const std::string& cert_chain_path,
                                              const std::string& private_key_path);
};

struct RetryPolicy {
  int max_attempts = 3;  // attempts in all, the first included; 1 turns retries off
  // The wait before retry n (n = 1, 2, ...) is min(max_backoff, initial_backoff *
  // multiplier^(n-1)), times a random factor in [1 - jitter, 1 + jitter] so that clients
  // refused together do not come back together.
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(2);
  double multiplier = 2.0;
  double jitter = 0.2;
  // The codes retried (before any response only).
  std::vector<absl::StatusCode> retryable_codes = {absl::StatusCode::kUnavailable,
                                                   absl::StatusCode::kResourceExhausted};
};

struct ClientOptions {
  // The router: "host:port", or any gRPC target name ("dns:///router.specd:50050").
  std::string target;
  // Unset: plaintext. Set (even to TlsOptions{}): TLS, mutual when it has a client key.
  std::optional<TlsOptions> tls;
  // Sent as "authorization: Bearer <token>" with every call. At most one of the two; the
  // file (Kubernetes projected tokens rotate) is read again whenever it changes.
  std::string bearer_token;
  std::string token_file;
  // Extra metadata sent with every call (keys lower case).
  std::vector<std::pair<std::string, std::string>> metadata;
  // Deadline of each call, retries included, unless the call sets its own.
  absl::Duration default_timeout = absl::InfiniteDuration();
  RetryPolicy retry;
  // HTTP/2 keepalive pings, so that a dead router (host lost) is noticed on an idle
  // connection. specd's servers accept pings every 10 s or more; shorter times make them
  // close the connection.
  absl::Duration keepalive_time = absl::Seconds(20);
  absl::Duration keepalive_timeout = absl::Seconds(10);
  // Largest response message accepted (token ids of a long prompt in Tokenize).
  int max_receive_message_bytes = 64 << 20;
};

// Per-call settings.
struct CallOptions {
  std::optional<absl::Duration> timeout;  // overrides ClientOptions::default_timeout
  std::vector<std::pair<std::string, std::string>> metadata;  // added to the client's
};

// An iterator over one Generate call's chunks (Client::Stream):
//
//   std::unique_ptr<specd::GenerateStream> stream = client->Stream(request);
//   specd::Chunk chunk;
//   while (stream->Next(&chunk)) std::cout << chunk.text << std::flush;
//   if (!stream->status().ok()) ...
class GenerateStream {
 public:
  virtual ~GenerateStream() = default;  // cancels the call if it has not ended

  // Blocks until the next chunk and returns true, or returns false once the call has ended:
  // then status() says how (OK after the last chunk, which carries the finish reason).
  virtual bool Next(Chunk* chunk) = 0;

  // Ends the call; the router frees the sequence in the draft and verify services. Callable
  // from any thread, also while another thread blocks in Next(), which then returns false
  // with status() CANCELLED (unless the call had already ended).
  virtual void Cancel() = 0;

  // How the call ended; OK while it runs.
  virtual absl::Status status() const = 0;
};

// Called with each chunk as it arrives, on the calling thread; return false to cancel the call.
using ChunkCallback = std::function<bool(const Chunk& chunk)>;

class Client {
 public:
  // Connects lazily: a router that is not up yet is not an error here (the first call retries
  // UNAVAILABLE). Errors: INVALID_ARGUMENT for bad options, naming the field.
  static absl::StatusOr<std::unique_ptr<Client>> Create(const ClientOptions& options);

  virtual ~Client() = default;

  // The whole completion.
  virtual absl::StatusOr<Completion> Generate(const GenerateRequest& request,
                                              const CallOptions& call = {}) = 0;

  // Streams: `on_chunk` sees every chunk as it arrives (the last one carries the finish
  // reason, usage and stats). Returns the joined completion, or the call's error: CANCELLED
  // when on_chunk returned false.
  virtual absl::StatusOr<Completion> Generate(const GenerateRequest& request,
                                              const ChunkCallback& on_chunk,
                                              const CallOptions& call = {}) = 0;

  // Streams as an iterator. The call starts at once; errors, a bad request included, surface
  // through Next() and status().
  virtual std::unique_ptr<GenerateStream> Stream(const GenerateRequest& request,
                                                 const CallOptions& call = {}) = 0;

  virtual absl::StatusOr<std::vector<int32_t>> Tokenize(std::string_view text,
                                                        bool add_special_tokens = false,
                                                        const CallOptions& call = {}) = 0;

  virtual absl::StatusOr<std::string> Detokenize(absl::Span<const int32_t> ids,
                                                 bool skip_special_tokens = false,
                                                 const CallOptions& call = {}) = 0;

  virtual absl::StatusOr<ModelInfo> GetModelInfo(const CallOptions& call = {}) = 0;
};

// Joins the chunks of a stream into a Completion: what Generate does.
class CompletionBuilder {
 public:
  void Add(const Chunk& chunk);
  // INTERNAL when no chunk carried a finish reason (the stream ended early).
  absl::StatusOr<Completion> Finish() &&;

 private:
  Completion completion_;
};

}  // namespace specd

#endif  // SPECD_CLIENTS_CPP_INCLUDE_SPECD_CLIENT_H_
