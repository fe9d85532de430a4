#include "tests/testutil/scripted_generation_server.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace specd {
namespace {

grpc::Status ToGrpc(const ScriptedAnswer& a) {
  return grpc::Status(static_cast<grpc::StatusCode>(a.code), a.message);
}

ReceivedCall Received(const std::string& method, const grpc::ServerContext& ctx) {
  ReceivedCall call;
  call.method = method;
  call.at = absl::Now();
  for (const auto& [key, value] : ctx.client_metadata()) {
    call.metadata.emplace(std::string(key.data(), key.size()),
                          std::string(value.data(), value.size()));
  }
  return call;
}

// Sleeps `d` in small steps; false as soon as the client has cancelled.
bool SleepUnlessCancelled(grpc::ServerContext* ctx, absl::Duration d) {
  const absl::Time end = absl::Now() + d;
  while (absl::Now() < end) {
    if (ctx->IsCancelled()) return false;
    absl::SleepFor(std::min(absl::Milliseconds(5), end - absl::Now()));
  }
  return !ctx->IsCancelled();
}

}  // namespace

class ScriptedGenerationServer::Service final : public v1::Generation::Service {
 public:
  explicit Service(ScriptedGenerationServer* server) : server_(server) {}

  grpc::Status Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* request,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    ReceivedCall call = Received("Generate", *ctx);
    call.request = *request;
    const ScriptedAnswer a = server_->Next(std::move(call));
    for (int i = 0; i < a.chunks; ++i) {
      if (!SleepUnlessCancelled(ctx, a.chunk_interval)) {
        server_->CountCancelled();
        return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client");
      }
      v1::GenerateResponse chunk;
      chunk.add_token_ids(i + 1);
      chunk.set_text(absl::StrCat(i + 1, " "));
      if (a.code == absl::StatusCode::kOk && i + 1 == a.chunks) {
        chunk.set_finish_reason(v1::FINISH_REASON_LENGTH);
        chunk.mutable_usage()->set_prompt_tokens(request->prompt().size());
        chunk.mutable_usage()->set_completion_tokens(a.chunks);
        v1::SpeculationStats* s = chunk.mutable_speculation();
        s->set_steps(2);
        s->set_draft_tokens(8);
        s->set_accepted_tokens(6);
        s->add_accepted_per_position(2);
        s->add_accepted_per_position(4);
        s->set_mode(v1::SPECULATION_DRAFT_MODEL);
      }
      if (!writer->Write(chunk)) {
        server_->CountCancelled();
        return grpc::Status(grpc::StatusCode::CANCELLED, "gone");
      }
    }
    return ToGrpc(a);
  }

  grpc::Status Tokenize(grpc::ServerContext* ctx, const v1::TokenizeRequest* request,
                        v1::TokenizeResponse* response) override {
    const ScriptedAnswer a = server_->Next(Received("Tokenize", *ctx));
    if (a.code != absl::StatusCode::kOk) return ToGrpc(a);
    for (unsigned char c : request->text()) response->add_ids(c);
    return grpc::Status::OK;
  }

  grpc::Status Detokenize(grpc::ServerContext* ctx, const v1::DetokenizeRequest* request,
                          v1::DetokenizeResponse* response) override {
    const ScriptedAnswer a = server_->Next(Received("Detokenize", *ctx));
    if (a.code != absl::StatusCode::kOk) return ToGrpc(a);
    for (int32_t id : request->ids()) response->mutable_text()->push_back(static_cast<char>(id));
    return grpc::Status::OK;
  }

  grpc::Status GetModelInfo(grpc::ServerContext* ctx, const v1::GetModelInfoRequest*,
                            v1::ModelInfo* response) override {
    const ScriptedAnswer a = server_->Next(Received("GetModelInfo", *ctx));
    if (a.code != absl::StatusCode::kOk) return ToGrpc(a);
    *response = Info();
    return grpc::Status::OK;
  }

 private:
  ScriptedGenerationServer* const server_;
};

absl::StatusOr<std::unique_ptr<ScriptedGenerationServer>> ScriptedGenerationServer::Start(
    std::shared_ptr<grpc::ServerCredentials> credentials, int port) {
  std::unique_ptr<ScriptedGenerationServer> s(new ScriptedGenerationServer());
  s->service_ = std::make_unique<Service>(s.get());
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat("127.0.0.1:", port),
                           credentials ? credentials : grpc::InsecureServerCredentials(),
                           &s->port_);
  builder.RegisterService(s->service_.get());
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::InternalError("the scripted server did not start");
  }
  return s;
}

ScriptedGenerationServer::~ScriptedGenerationServer() {
  if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now()));
}

std::string ScriptedGenerationServer::address() const { return absl::StrCat("127.0.0.1:", port_); }

void ScriptedGenerationServer::Script(std::vector<ScriptedAnswer> answers) {
  absl::MutexLock lock(&mu_);
  script_.assign(answers.begin(), answers.end());
}

std::vector<ReceivedCall> ScriptedGenerationServer::received() const {
  absl::MutexLock lock(&mu_);
  return received_;
}

int ScriptedGenerationServer::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

void ScriptedGenerationServer::CountCancelled() {
  absl::MutexLock lock(&mu_);
  ++cancelled_;
}

v1::ModelInfo ScriptedGenerationServer::Info() {
  v1::ModelInfo info;
  info.set_target_model("scripted-target");
  info.set_draft_model("scripted-draft");
  info.set_vocab_size(256);
  info.set_max_context(1024);
  info.add_eos_token_ids(0);
  info.set_max_new_tokens_limit(512);
  info.set_draft_available(true);
  return info;
}

ScriptedAnswer ScriptedGenerationServer::Next(ReceivedCall call) {
  absl::MutexLock lock(&mu_);
  received_.push_back(std::move(call));
  if (script_.empty()) return ScriptedAnswer();
  ScriptedAnswer a = script_.front();
  script_.pop_front();
  return a;
}

}  // namespace specd
