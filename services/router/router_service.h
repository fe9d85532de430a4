// specd.v1.Generation, the public API, on the gRPC callback API. Generate validates and
// tokenizes in its reactor (bounded CPU work, no waiting) and hands the request to the
// RouterLoop, which streams the chunks back through the reactor; nothing here blocks.
#ifndef SPECD_SERVICES_ROUTER_ROUTER_SERVICE_H_
#define SPECD_SERVICES_ROUTER_ROUTER_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/service/tls_options.h"
#include "common/text/tokenizer.h"
#include "grpcpp/grpcpp.h"
#include "services/router/group_pool.h"
#include "services/router/request.h"
#include "services/router/router_metrics.h"
#include "specd/v1/generation.grpc.pb.h"

namespace specd {

struct RouterServiceOptions {
  RequestLimits limits;
  std::string target_model;  // reported by GetModelInfo when the verify service names none
  // Set: every call must carry "authorization: Bearer <token>" with one of these tokens
  // (UNAUTHENTICATED otherwise). Not owned; must outlive the service.
  BearerTokens* tokens = nullptr;
  // Where the model folder's chat template is, for ModelInfo (ChatTemplateSourceOf); empty:
  // the folder has none.
  std::string chat_template_source;
};

// Where `model_dir`'s chat template is, in the order specd-http's ChatTemplate::Load looks:
// "chat_template.jinja", then "tokenizer_config.json" (its chat_template, a string or a list
// with a "default" entry); empty when there is none, or the config cannot be read as JSON.
// Only the presence is checked: the router does not render templates.
std::string ChatTemplateSourceOf(const std::string& model_dir);

// The speculation modes a new request can get (ModelInfo.speculation_modes), in enum order:
// AUTO, OFF and NGRAM always (the router drafts n-grams itself when no draft service does);
// DRAFT_MODEL while a draft service with a model is up (`draft` is its info); EAGLE3 while one
// with an EAGLE head is up and the verify service exports taps.
std::vector<v1::Speculation> AvailableSpeculationModes(bool draft_up, const v1::DraftInfo& draft,
                                                       const v1::VerifyInfo& verify);

class RouterService final : public v1::Generation::CallbackService {
 public:
  // All pointers must outlive the service.
  RouterService(RouterServiceOptions options, const Tokenizer* tokenizer, GroupPool* loop,
                RouterMetrics* metrics);

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* context,
                                     const v1::TokenizeRequest* request,
                                     v1::TokenizeResponse* response) override;
  grpc::ServerUnaryReactor* Detokenize(grpc::CallbackServerContext* context,
                                       const v1::DetokenizeRequest* request,
                                       v1::DetokenizeResponse* response) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request,
                                         v1::ModelInfo* response) override;

  // Whether a call may go on: its bearer token (when tokens are required), then, for Generate,
  // whether the router still admits new requests.
  absl::Status Admit(const grpc::CallbackServerContext& context, bool generate);

  // From now on Generate answers UNAVAILABLE (the client retries another replica); streams
  // already running go on. Called when the router is told to stop.
  void BeginDrain() { draining_ = true; }

  // Validates and tokenizes a request; on success fills `out` except arrival and deadline.
  absl::Status Prepare(const v1::GenerateRequest& request, RouterRequest* out);

  // A fresh seed for a sampling request that names none (or for its further samples).
  uint64_t RandomSeed();

  GroupPool* loop() { return loop_; }
  RouterMetrics* metrics() { return metrics_; }

  // Generate RPCs whose reactor gRPC has not released yet (any thread). Shutdown waits for
  // these to reach 0 before it stops the server, so final chunks are still delivered.
  int OpenGenerateStreams() const { return open_streams_.load(); }
  void StreamOpened() { open_streams_.fetch_add(1); }
  void StreamDone() { open_streams_.fetch_sub(1); }

 private:
  RequestLimits CurrentLimits() const;
  // UNIMPLEMENTED naming the fields when the verify service cannot do what `request` asks.
  absl::Status CheckVerifySupport(const RouterRequest& request) const;

  const RouterServiceOptions options_;
  const Tokenizer* const tokenizer_;
  GroupPool* const loop_;
  RouterMetrics* const metrics_;
  std::atomic<int> open_streams_{0};
  std::atomic<bool> draining_{false};
  absl::Mutex rng_mu_;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(rng_mu_);
};

}  // namespace specd

#endif  // SPECD_SERVICES_ROUTER_ROUTER_SERVICE_H_
