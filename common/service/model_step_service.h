// The gRPC face of a model service (specd.v1.Drafter, specd.v1.Verifier): one
// StepStreamReactor per Step stream, feeding the model loop's queue, and GetInfo. Holds no model
// state of its own. Both services have the same two methods and differ only in message types,
// so one template serves both.
#ifndef SPECD_COMMON_SERVICE_MODEL_STEP_SERVICE_H_
#define SPECD_COMMON_SERVICE_MODEL_STEP_SERVICE_H_

#include <functional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/service/step_stream.h"
#include "grpcpp/grpcpp.h"
#include "specd/v1/tree.pb.h"

namespace specd {

// `CallbackService` is the generated v1::<Service>::CallbackService with methods
// Step(stream Request) returns (stream Response) and GetInfo(InfoRequest) returns (Info).
template <typename CallbackService, typename Request, typename Response, typename InfoRequest,
          typename Info>
class ModelStepService final : public CallbackService {
 public:
  // `queue` must outlive the server this service is registered with.
  explicit ModelStepService(StepQueue<Request, Response>* queue) : queue_(queue) {
    // Step (method 0 of both services) reads its requests leniently (lenient_wire.h), so an
    // unparseable step ends the stream with INVALID_ARGUMENT instead of looking like the
    // client's half-close.
    this->MarkMethodCallback(
        0, new grpc::internal::CallbackBidiHandler<LenientWire<Request>, Response>(
               [this](grpc::CallbackServerContext* /*context*/) {
                 return new StepStreamReactor<Request, Response>(queue_);
               }));
  }

  // Until called, GetInfo answers UNAVAILABLE (the model is still loading).
  void SetInfo(const Info& info) {
    absl::MutexLock lock(&mu_);
    info_ = info;
    loaded_ = true;
  }

  // From now on GetInfo's `load` is the info's merged with what `load` returns (called on gRPC
  // threads; whatever it reads must outlive the server).
  void SetLoad(std::function<v1::ServiceLoad()> load) {
    absl::MutexLock lock(&mu_);
    load_ = std::move(load);
  }

  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* context,
                                    const InfoRequest* /*request*/, Info* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    bool loaded;
    {
      absl::MutexLock lock(&mu_);
      loaded = loaded_;
      if (loaded) *response = info_;
      if (loaded && load_) response->mutable_load()->MergeFrom(load_());
    }
    reactor->Finish(loaded ? grpc::Status::OK
                           : grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                          "the model is still loading"));
    return reactor;
  }

 private:
  StepQueue<Request, Response>* const queue_;
  absl::Mutex mu_;
  bool loaded_ ABSL_GUARDED_BY(mu_) = false;
  Info info_ ABSL_GUARDED_BY(mu_);
  std::function<v1::ServiceLoad()> load_ ABSL_GUARDED_BY(mu_);
};

}  // namespace specd

#endif  // SPECD_COMMON_SERVICE_MODEL_STEP_SERVICE_H_
