#include "specd/client.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "channel.h"
#include "convert.h"
#include "grpcpp/client_context.h"
#include "retry.h"
#include "specd/v1/generation.grpc.pb.h"

namespace specd {
namespace client_internal {
namespace {

using Stub = v1::Generation::StubInterface;

absl::Time DeadlineOf(const ClientOptions& options, const CallOptions& call) {
  const absl::Duration timeout = call.timeout.value_or(options.default_timeout);
  if (timeout == absl::InfiniteDuration()) return absl::InfiniteFuture();
  return absl::Now() + timeout;
}

void PrepareContext(absl::Time deadline, const Metadata& metadata, grpc::ClientContext* ctx) {
  if (deadline != absl::InfiniteFuture()) ctx->set_deadline(absl::ToChronoTime(deadline));
  for (const auto& [key, value] : metadata) ctx->AddMetadata(key, value);
}

// One Generate call, tried again (a new gRPC call with the same request and deadline) while it
// fails with a retryable code before its first chunk.
class GenerateStreamImpl final : public GenerateStream {
 public:
  // `request` and `metadata` carry an error found before the call starts; Next() reports it.
  GenerateStreamImpl(std::shared_ptr<Stub> stub, const RetryPolicy& retry,
                     absl::StatusOr<v1::GenerateRequest> request, absl::StatusOr<Metadata> metadata,
                     absl::Time deadline)
      : stub_(std::move(stub)), retry_(retry), deadline_(deadline) {
    if (!request.ok()) {
      End(request.status());
    } else if (!metadata.ok()) {
      End(metadata.status());
    } else {
      request_ = *std::move(request);
      metadata_ = *std::move(metadata);
      StartAttempt();
    }
  }

  ~GenerateStreamImpl() override {
    if (done_) return;
    Cancel();
    // The call ends promptly once cancelled; Finish() releases it.
    v1::GenerateResponse ignored;
    while (reader_->Read(&ignored)) {
    }
    reader_->Finish().IgnoreError();
  }

  bool Next(Chunk* chunk) override {
    if (done_) return false;
    while (true) {
      v1::GenerateResponse response;
      if (reader_->Read(&response)) {
        received_ = true;
        *chunk = FromProto(response);
        saw_last_ = saw_last_ || chunk->last();
        return true;
      }
      absl::Status status = FromGrpcStatus(reader_->Finish());
      if (status.ok() && !saw_last_) {
        status = absl::InternalError("the stream ended without a finish reason");
      }
      if (!status.ok() && !received_ && !cancelled()) {
        const absl::Duration delay = RandomRetryDelay(retry_, attempts_);
        if (ShouldRetry(retry_, status.code(), attempts_, delay, deadline_)) {
          if (WaitUnlessCancelled(delay)) {
            StartAttempt();
            continue;
          }
          status = absl::CancelledError("the call was cancelled by the client");
        }
      }
      if (cancelled() && (status.ok() || absl::IsCancelled(status))) {
        status = absl::CancelledError("the call was cancelled by the client");
      }
      End(status);
      return false;
    }
  }

  void Cancel() override {
    absl::MutexLock lock(&mu_);
    if (cancelled_) return;
    cancelled_ = true;
    if (ctx_ != nullptr) ctx_->TryCancel();
  }

  absl::Status status() const override {
    absl::MutexLock lock(&mu_);
    return status_;
  }

 private:
  void StartAttempt() {
    ++attempts_;
    reader_.reset();  // before the context it refers to
    auto ctx = std::make_unique<grpc::ClientContext>();
    PrepareContext(deadline_, metadata_, ctx.get());
    grpc::ClientContext* raw = ctx.get();
    {
      absl::MutexLock lock(&mu_);
      ctx_ = std::move(ctx);
      // A call cancelled before it starts ends as soon as it starts.
      if (cancelled_) ctx_->TryCancel();
    }
    reader_ = stub_->Generate(raw, request_);
  }

  // Sleeps `delay`; false, at once, if the call is cancelled meanwhile.
  bool WaitUnlessCancelled(absl::Duration delay) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&cancelled_), delay);
    return !cancelled_;
  }

  bool cancelled() const {
    absl::MutexLock lock(&mu_);
    return cancelled_;
  }

  void End(absl::Status status) {
    done_ = true;
    absl::MutexLock lock(&mu_);
    status_ = std::move(status);
  }

  const std::shared_ptr<Stub> stub_;
  const RetryPolicy retry_;
  const absl::Time deadline_;
  v1::GenerateRequest request_;
  Metadata metadata_;

  // Touched by the thread in Next() only.
  std::unique_ptr<grpc::ClientReaderInterface<v1::GenerateResponse>> reader_;
  int attempts_ = 0;
  bool received_ = false;  // a chunk arrived: no more retries
  bool saw_last_ = false;
  bool done_ = false;

  mutable absl::Mutex mu_;
  std::unique_ptr<grpc::ClientContext> ctx_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

class ClientImpl final : public Client {
 public:
  ClientImpl(const ClientOptions& options, std::shared_ptr<Stub> stub,
             std::unique_ptr<CallMetadata> metadata)
      : options_(options), stub_(std::move(stub)), metadata_(std::move(metadata)) {}

  absl::StatusOr<Completion> Generate(const GenerateRequest& request,
                                      const CallOptions& call) override {
    return Generate(request, nullptr, call);
  }

  absl::StatusOr<Completion> Generate(const GenerateRequest& request, const ChunkCallback& on_chunk,
                                      const CallOptions& call) override {
    if (request.n > 1) {
      return absl::InvalidArgumentError(
          "n: Generate() returns one completion; use Stream() and Chunk::index for n > 1");
    }
    std::unique_ptr<GenerateStream> stream = Stream(request, call);
    CompletionBuilder builder;
    Chunk chunk;
    while (stream->Next(&chunk)) {
      builder.Add(chunk);
      if (on_chunk && !on_chunk(chunk)) {
        stream.reset();  // cancels the call
        return absl::CancelledError("the call was cancelled by the chunk callback");
      }
    }
    if (absl::Status s = stream->status(); !s.ok()) return s;
    return std::move(builder).Finish();
  }

  std::unique_ptr<GenerateStream> Stream(const GenerateRequest& request,
                                         const CallOptions& call) override {
    return std::make_unique<GenerateStreamImpl>(stub_, options_.retry, ToProto(request),
                                                metadata_->ForCall(call.metadata),
                                                DeadlineOf(options_, call));
  }

  absl::StatusOr<std::vector<int32_t>> Tokenize(std::string_view text, bool add_special_tokens,
                                                const CallOptions& call) override {
    v1::TokenizeRequest request;
    request.set_text(std::string(text));
    request.set_add_special_tokens(add_special_tokens);
    v1::TokenizeResponse response;
    const absl::Status s = Unary(
        call, [&](grpc::ClientContext* ctx) { return stub_->Tokenize(ctx, request, &response); });
    if (!s.ok()) return s;
    return std::vector<int32_t>(response.ids().begin(), response.ids().end());
  }

  absl::StatusOr<std::string> Detokenize(absl::Span<const int32_t> ids, bool skip_special_tokens,
                                         const CallOptions& call) override {
    v1::DetokenizeRequest request;
    request.mutable_ids()->Assign(ids.begin(), ids.end());
    request.set_skip_special_tokens(skip_special_tokens);
    v1::DetokenizeResponse response;
    const absl::Status s = Unary(
        call, [&](grpc::ClientContext* ctx) { return stub_->Detokenize(ctx, request, &response); });
    if (!s.ok()) return s;
    return std::move(*response.mutable_text());
  }

  absl::StatusOr<ModelInfo> GetModelInfo(const CallOptions& call) override {
    v1::ModelInfo response;
    const absl::Status s = Unary(call, [&](grpc::ClientContext* ctx) {
      return stub_->GetModelInfo(ctx, v1::GetModelInfoRequest(), &response);
    });
    if (!s.ok()) return s;
    return FromProto(response);
  }

 private:
  // A unary call with the retry policy; the calls are idempotent, so any retryable failure
  // is retried (within the deadline).
  template <typename Invoke>
  absl::Status Unary(const CallOptions& call, Invoke invoke) {
    absl::StatusOr<Metadata> metadata = metadata_->ForCall(call.metadata);
    if (!metadata.ok()) return metadata.status();
    const absl::Time deadline = DeadlineOf(options_, call);
    for (int attempts = 1;; ++attempts) {
      grpc::ClientContext ctx;
      PrepareContext(deadline, *metadata, &ctx);
      const absl::Status status = FromGrpcStatus(invoke(&ctx));
      if (status.ok()) return status;
      const absl::Duration delay = RandomRetryDelay(options_.retry, attempts);
      if (!ShouldRetry(options_.retry, status.code(), attempts, delay, deadline)) return status;
      absl::SleepFor(delay);
    }
  }

  const ClientOptions options_;
  const std::shared_ptr<Stub> stub_;
  const std::unique_ptr<CallMetadata> metadata_;
};

}  // namespace
}  // namespace client_internal

absl::StatusOr<std::unique_ptr<Client>> Client::Create(const ClientOptions& options) {
  if (absl::Status s = client_internal::ValidateOptions(options); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<client_internal::CallMetadata>> metadata =
      client_internal::CallMetadata::Create(options);
  if (!metadata.ok()) return metadata.status();
  std::shared_ptr<v1::Generation::StubInterface> stub =
      v1::Generation::NewStub(client_internal::CreateChannel(options));
  return std::make_unique<client_internal::ClientImpl>(options, std::move(stub),
                                                       *std::move(metadata));
}

}  // namespace specd
