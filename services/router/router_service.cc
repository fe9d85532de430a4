#include "services/router/router_service.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <filesystem>
#include <fstream>
#include <memory>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/service/grpc_util.h"
#include "common/service/lenient_handler.h"
#include "engine/backend.h"
#include "nlohmann/json.hpp"
#include "services/router/request_validation.h"

namespace specd {
namespace {

using GenerateWriter = grpc::ServerWriteReactor<v1::GenerateResponse>;

// The scheduler's handle on one Generate RPC. It outlives the reactor (the scheduler may still
// hold it after the RPC is done), so the reactor pointer is cleared in OnDone. gRPC allows one
// outstanding write per stream, so chunks queue here and are written one after another.
// Reactor methods are called outside the mutex: gRPC may run reactions inline.
class ReactorSink : public ResponseSink {
 public:
  explicit ReactorSink(GenerateWriter* reactor) : reactor_(reactor) {}

  void Write(v1::GenerateResponse chunk) override {
    const v1::GenerateResponse* next = nullptr;
    GenerateWriter* reactor = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (finish_requested_ || reactor_ == nullptr) return;
      queue_.push_back(std::move(chunk));  // deque: references to queued chunks stay valid
      if (!writing_) {
        writing_ = true;
        next = &queue_.front();
        reactor = reactor_;
      }
    }
    if (next != nullptr) reactor->StartWrite(next);
  }

  void Finish(const grpc::Status& status) override {
    GenerateWriter* reactor = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (finish_requested_) return;
      finish_requested_ = true;
      final_status_ = status;
      if (writing_ || reactor_ == nullptr) return;  // OnWriteDone finishes
      reactor = reactor_;
    }
    reactor->Finish(status);
  }

  bool Cancelled() const override { return cancelled_.load(std::memory_order_relaxed); }

  void OnWriteDone(bool ok) {
    const v1::GenerateResponse* next = nullptr;
    bool finish = false;
    grpc::Status status;
    GenerateWriter* reactor = nullptr;
    {
      absl::MutexLock lock(&mu_);
      queue_.pop_front();
      if (!ok) {
        // The stream is broken (client gone); nothing more can be written.
        cancelled_.store(true, std::memory_order_relaxed);
        queue_.clear();
      }
      reactor = reactor_;
      if (!queue_.empty()) {
        next = &queue_.front();
      } else {
        writing_ = false;
        if (finish_requested_) {
          finish = true;
          status = final_status_;
        }
      }
    }
    if (next != nullptr) {
      reactor->StartWrite(next);
    } else if (finish) {
      reactor->Finish(status);
    }
  }

  void OnCancel() { cancelled_.store(true, std::memory_order_relaxed); }

  void OnDone() {
    absl::MutexLock lock(&mu_);
    reactor_ = nullptr;
  }

 private:
  absl::Mutex mu_;
  GenerateWriter* reactor_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::GenerateResponse> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_requested_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status final_status_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> cancelled_{false};
};

// One of a request's n samples (GenerateRequest.n > 1): tags its chunks with the sample's index
// and ends the RPC when the last sample ends, or at once with the first error (the others then
// read as cancelled, so the scheduler frees them).
class SampleSink : public ResponseSink {
 public:
  struct Shared {
    explicit Shared(std::shared_ptr<ResponseSink> parent, int samples)
        : parent(std::move(parent)), remaining(samples) {}
    const std::shared_ptr<ResponseSink> parent;
    std::atomic<int> remaining;
    std::atomic<bool> failed{false};
  };

  SampleSink(std::shared_ptr<Shared> shared, uint32_t index)
      : shared_(std::move(shared)), index_(index) {}

  void Write(v1::GenerateResponse chunk) override {
    chunk.set_index(index_);
    shared_->parent->Write(std::move(chunk));
  }

  void Finish(const grpc::Status& status) override {
    if (finished_.exchange(true)) return;
    if (!status.ok()) {
      shared_->failed.store(true);
      shared_->parent->Finish(status);
    } else if (shared_->remaining.fetch_sub(1) == 1) {
      shared_->parent->Finish(status);
    }
  }

  bool Cancelled() const override { return shared_->failed.load() || shared_->parent->Cancelled(); }

 private:
  const std::shared_ptr<Shared> shared_;
  const uint32_t index_;
  std::atomic<bool> finished_{false};
};

class GenerateReactor : public GenerateWriter {
 public:
  GenerateReactor(RouterService* service, grpc::CallbackServerContext* context,
                  const v1::GenerateRequest* request)
      : service_(service), sink_(std::make_shared<ReactorSink>(this)) {
    service->StreamOpened();
    RouterRequest prepared;
    absl::Status status = service->Admit(*context, /*generate=*/true);
    if (status.ok()) status = service->Prepare(*request, &prepared);
    if (status.ok()) {
      prepared.arrival = absl::Now();
      const auto deadline = context->deadline();
      // gRPC reports "no deadline" as a far-future time point.
      if (deadline < std::chrono::system_clock::now() + std::chrono::hours(24 * 365 * 10)) {
        prepared.deadline = absl::FromChrono(deadline);
      }
      const int samples = std::max<int>(1, static_cast<int>(request->n()));
      if (samples == 1) {
        status = service->loop()->Submit(std::move(prepared), sink_);
      } else {
        auto shared = std::make_shared<SampleSink::Shared>(sink_, samples);
        for (int i = 0; i < samples && status.ok(); ++i) {
          RouterRequest sample = prepared;
          // vLLM's rule for n > 1: sample i of a seeded request uses seed + i, so each sample
          // is reproducible on its own and the samples differ.
          sample.sampling.seed = request->has_seed() ? request->seed() + static_cast<uint64_t>(i)
                                 : i == 0            ? prepared.sampling.seed
                                                     : service->RandomSeed();
          if (!sample.request_id.empty()) absl::StrAppend(&sample.request_id, "/", i);
          status = service->loop()->Submit(
              std::move(sample), std::make_shared<SampleSink>(shared, static_cast<uint32_t>(i)));
        }
        // Samples queued before a refusal end as cancelled; the RPC ends with the refusal.
        if (!status.ok()) shared->failed.store(true);
      }
    }
    if (!status.ok()) {
      if (status.code() != absl::StatusCode::kInvalidArgument &&
          status.code() != absl::StatusCode::kUnauthenticated) {
        SPECD_LOG(INFO) << "request '" << absl::CHexEscape(request->request_id())
                        << "' refused: " << status;
      }
      service->metrics()->CountOutcome(static_cast<grpc::StatusCode>(status.code()));
      sink_->Finish(ToGrpcStatus(status));
    }
  }

  void OnWriteDone(bool ok) override { sink_->OnWriteDone(ok); }

  void OnCancel() override {
    sink_->OnCancel();
    service_->loop()->Wake();
  }

  void OnDone() override {
    sink_->OnDone();
    service_->StreamDone();
    delete this;
  }

 private:
  RouterService* const service_;
  const std::shared_ptr<ReactorSink> sink_;
};

}  // namespace

RouterService::RouterService(RouterServiceOptions options, const Tokenizer* tokenizer,
                             GroupPool* loop, RouterMetrics* metrics)
    : options_(std::move(options)),
      tokenizer_(tokenizer),
      loop_(loop),
      metrics_(metrics),
      rng_(std::random_device{}()) {
  // Requests that fail to parse (e.g. a prompt that is not UTF-8) reach the methods marked, so
  // they are answered INVALID_ARGUMENT naming the field rather than UNIMPLEMENTED (see
  // common/service/lenient_parse.h). Indexes follow the rpc order in generation.proto.
  MarkMethodCallback(
      0, new LenientMethodHandler<v1::GenerateRequest, v1::GenerateResponse, false>(
             new grpc::internal::CallbackServerStreamingHandler<v1::GenerateRequest,
                                                                v1::GenerateResponse>(
                 [this](grpc::CallbackServerContext* context, const v1::GenerateRequest* request) {
                   return Generate(context, request);
                 })));
  MarkMethodCallback(
      1, new LenientMethodHandler<v1::TokenizeRequest, v1::TokenizeResponse, true>(
             new grpc::internal::CallbackUnaryHandler<v1::TokenizeRequest, v1::TokenizeResponse>(
                 [this](grpc::CallbackServerContext* context, const v1::TokenizeRequest* request,
                        v1::TokenizeResponse* response) {
                   return Tokenize(context, request, response);
                 })));
}

RequestLimits RouterService::CurrentLimits() const {
  RequestLimits limits = options_.limits;
  limits.max_context = loop_->max_context();
  return limits;
}

uint64_t RouterService::RandomSeed() {
  absl::MutexLock lock(&rng_mu_);
  return rng_();
}

absl::Status RouterService::Admit(const grpc::CallbackServerContext& context, bool generate) {
  if (options_.tokens != nullptr) {
    if (grpc::Status s = options_.tokens->CheckCall(context); !s.ok()) return FromGrpcStatus(s);
  }
  if (generate && draining_.load()) {
    return absl::UnavailableError("the router is shutting down; retry on another replica");
  }
  return absl::OkStatus();
}

absl::Status RouterService::CheckVerifySupport(const RouterRequest& request) const {
  // Refused up front, naming the fields, rather than failing at the request's first verify
  // step. While the verify service is down its info is empty; Submit refuses the request then.
  if (!loop_->verify_up()) return absl::OkStatus();
  const v1::VerifyInfo verify = loop_->verify_info();
  VerifyFeatures features;
  features.logprobs = verify.supports_logprobs();
  features.logits_processors = verify.supports_logits_processors();
  absl::Status s = specd::CheckVerifySupport(features, request.sampling, request.logprobs,
                                             "the verify service's backend");
  if (s.ok()) return s;
  // The engine names the field as in its SamplingParams ("sampling.min_p"); this API's field is
  // top-level.
  return absl::Status(s.code(), absl::StripPrefix(s.message(), "sampling."));
}

absl::Status RouterService::Prepare(const v1::GenerateRequest& request, RouterRequest* out) {
  if (absl::Status s = WireError(request); !s.ok()) return s;
  const RequestLimits limits = CurrentLimits();
  if (absl::Status s = ValidateGenerateRequest(request, limits); !s.ok()) return s;
  *out = ResolveRequest(request, limits, RandomSeed());
  if (absl::Status s = CheckVerifySupport(*out); !s.ok()) return s;
  if (request.input_case() == v1::GenerateRequest::kPromptIds) {
    out->prompt.assign(request.prompt_ids().ids().begin(), request.prompt_ids().ids().end());
    return absl::OkStatus();
  }
  // No tokenizer makes tokens of more than a few dozen bytes, so a text this long cannot fit
  // the context; refusing it up front keeps a huge prompt from tying up a reactor thread.
  if (request.prompt().size() > static_cast<size_t>(limits.max_context) * 1024) {
    return absl::InvalidArgumentError(absl::StrCat("prompt: ", request.prompt().size(),
                                                   " bytes cannot fit the context of ",
                                                   limits.max_context, " tokens"));
  }
  out->prompt = tokenizer_->Encode(request.prompt(), /*add_special_tokens=*/true);
  return ValidatePrompt(out->prompt, "prompt", limits);
}

grpc::ServerWriteReactor<v1::GenerateResponse>* RouterService::Generate(
    grpc::CallbackServerContext* context, const v1::GenerateRequest* request) {
  return new GenerateReactor(this, context, request);
}

grpc::ServerUnaryReactor* RouterService::Tokenize(grpc::CallbackServerContext* context,
                                                  const v1::TokenizeRequest* request,
                                                  v1::TokenizeResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::Status s = Admit(*context, /*generate=*/false);
  if (s.ok()) s = WireError(*request);
  if (!s.ok()) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  const std::vector<int32_t> ids =
      tokenizer_->Encode(request->text(), request->add_special_tokens());
  response->mutable_ids()->Assign(ids.begin(), ids.end());
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* RouterService::Detokenize(grpc::CallbackServerContext* context,
                                                    const v1::DetokenizeRequest* request,
                                                    v1::DetokenizeResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status s = Admit(*context, /*generate=*/false); !s.ok()) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  if (absl::Status s = CheckTokenIds(request->ids(), options_.limits.vocab_size, "ids"); !s.ok()) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  response->set_text(
      tokenizer_->Decode(std::vector<int32_t>(request->ids().begin(), request->ids().end()),
                         request->skip_special_tokens()));
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

std::string ChatTemplateSourceOf(const std::string& model_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(fs::path(model_dir) / "chat_template.jinja", ec)) return "chat_template.jinja";
  std::ifstream in(fs::path(model_dir) / "tokenizer_config.json", std::ios::binary);
  if (!in) return "";
  const nlohmann::json config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) return "";
  const auto it = config.find("chat_template");
  if (it == config.end()) return "";
  if (it->is_string()) return "tokenizer_config.json";
  if (it->is_array()) {
    for (const nlohmann::json& entry : *it) {
      if (entry.is_object() && entry.value("name", nlohmann::json()) == "default" &&
          entry.contains("template") && entry["template"].is_string()) {
        return "tokenizer_config.json";
      }
    }
  }
  return "";
}

std::vector<v1::Speculation> AvailableSpeculationModes(bool draft_up, const v1::DraftInfo& draft,
                                                       const v1::VerifyInfo& verify) {
  std::vector<v1::Speculation> modes = {v1::SPECULATION_AUTO, v1::SPECULATION_OFF};
  // A draft service without a model (n-gram only) has no KV cache.
  if (draft_up && draft.load().kv_capacity_tokens() > 0) {
    modes.push_back(v1::SPECULATION_DRAFT_MODEL);
  }
  modes.push_back(v1::SPECULATION_NGRAM);
  if (draft_up && EagleTapsServed(draft, verify)) {
    modes.push_back(v1::SPECULATION_EAGLE3);
  }
  return modes;
}

grpc::ServerUnaryReactor* RouterService::GetModelInfo(grpc::CallbackServerContext* context,
                                                      const v1::GetModelInfoRequest* /*request*/,
                                                      v1::ModelInfo* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status s = Admit(*context, /*generate=*/false); !s.ok()) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  const v1::VerifyInfo verify = loop_->verify_info();
  response->set_target_model(verify.model().empty() ? options_.target_model : verify.model());
  if (loop_->has_draft()) response->set_draft_model(loop_->draft_info().model());
  response->set_vocab_size(options_.limits.vocab_size);
  response->set_max_context(loop_->max_context());
  response->mutable_eos_token_ids()->Assign(options_.limits.eos_token_ids.begin(),
                                            options_.limits.eos_token_ids.end());
  response->set_max_new_tokens_limit(options_.limits.max_new_tokens_limit);
  // One look at the draft services for draft_available and the modes, so they agree.
  const bool draft_up = loop_->draft_up();
  response->set_draft_available(draft_up);
  response->set_supports_logprobs(verify.supports_logprobs());
  response->set_supports_logits_processors(verify.supports_logits_processors());
  response->set_has_chat_template(!options_.chat_template_source.empty());
  response->set_chat_template_source(options_.chat_template_source);
  for (v1::Speculation mode : AvailableSpeculationModes(
           draft_up, draft_up ? loop_->draft_info() : v1::DraftInfo(), verify)) {
    response->add_speculation_modes(mode);
  }
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace specd
