// An in-process specd.v1.Generation server whose answers a test scripts, for what the real
// router cannot be made to do on cue: fail the n-th call with a chosen code, fail after the
// first chunk, stream slowly, serve over TLS (the router does not serve TLS yet). It records
// what each call carried (method, metadata, arrival time) for the test to check. The client
// side under test is the real SDK or specd-cli over a real socket.
#ifndef SPECD_TESTS_TESTUTIL_SCRIPTED_GENERATION_SERVER_H_
#define SPECD_TESTS_TESTUTIL_SCRIPTED_GENERATION_SERVER_H_

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "specd/v1/generation.grpc.pb.h"

namespace specd {

// How one call is answered.
struct ScriptedAnswer {
  absl::StatusCode code = absl::StatusCode::kOk;  // how the call ends
  std::string message;                            // its error message
  // Generate: chunks streamed before the call ends. Chunk i holds token i + 1 and text
  // "<i + 1> "; ending OK, the last of them carries finish reason LENGTH, usage and stats.
  int chunks = 3;
  absl::Duration chunk_interval = absl::ZeroDuration();  // pause before each chunk
};

struct ReceivedCall {
  std::string method;  // "Generate", "Tokenize", "Detokenize", "GetModelInfo"
  absl::Time at;
  std::multimap<std::string, std::string> metadata;
  v1::GenerateRequest request;  // Generate only
};

class ScriptedGenerationServer {
 public:
  // Serves on 127.0.0.1:`port` (0: a free one) with `credentials` (insecure when null).
  static absl::StatusOr<std::unique_ptr<ScriptedGenerationServer>> Start(
      std::shared_ptr<grpc::ServerCredentials> credentials = nullptr, int port = 0);

  ~ScriptedGenerationServer();

  std::string address() const;  // "127.0.0.1:<port>"
  int port() const { return port_; }

  // The answers to the next calls, whatever their method, in order; once they are used up,
  // calls succeed with ScriptedAnswer{}.
  void Script(std::vector<ScriptedAnswer> answers);

  std::vector<ReceivedCall> received() const;

  // Generate calls that ended because the client cancelled them (or went away).
  int cancelled() const;

  // The ModelInfo GetModelInfo answers with.
  static v1::ModelInfo Info();

 private:
  class Service;

  ScriptedGenerationServer() = default;
  ScriptedAnswer Next(ReceivedCall call);
  void CountCancelled();

  mutable absl::Mutex mu_;
  std::deque<ScriptedAnswer> script_ ABSL_GUARDED_BY(mu_);
  std::vector<ReceivedCall> received_ ABSL_GUARDED_BY(mu_);
  int cancelled_ ABSL_GUARDED_BY(mu_) = 0;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace specd

#endif  // SPECD_TESTS_TESTUTIL_SCRIPTED_GENERATION_SERVER_H_
