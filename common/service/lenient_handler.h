// A gRPC callback method handler that delivers requests which fail to parse to the service
// marked (lenient_parse.h) instead of letting gRPC answer UNIMPLEMENTED with no message. It
// wraps the handler the generated code would use; only Deserialize's failure path differs.
#ifndef SPECD_COMMON_SERVICE_LENIENT_HANDLER_H_
#define SPECD_COMMON_SERVICE_LENIENT_HANDLER_H_

#include <memory>
#include <new>
#include <string>
#include <vector>

#include "common/service/lenient_parse.h"
#include "grpc/byte_buffer.h"
#include "grpc/byte_buffer_reader.h"
#include "grpc/slice.h"
#include "grpcpp/impl/codegen/core_codegen_interface.h"
#include "grpcpp/impl/rpc_service_method.h"
#include "grpcpp/support/message_allocator.h"
#include "grpcpp/support/slice.h"

namespace specd {

// `kUnary`: the wrapped handler is a CallbackUnaryHandler, whose request lives in the message
// holder it leaves in *handler_data; else a CallbackServerStreamingHandler, which frees its
// request when parsing fails, so a fresh one is placed in the call's arena (which it destroys
// when the call ends, as it does its own).
template <typename Request, typename Response, bool kUnary>
class LenientMethodHandler : public grpc::internal::MethodHandler {
 public:
  explicit LenientMethodHandler(grpc::internal::MethodHandler* inner) : inner_(inner) {}

  void RunHandler(const HandlerParameter& param) override { inner_->RunHandler(param); }

  void* Deserialize(grpc_call* call, grpc_byte_buffer* req, grpc::Status* status,
                    void** handler_data) override {
    // The wrapped handler destroys `req` as it parses; its slices are reference-counted, so
    // keeping them costs no copy of the bytes.
    std::vector<grpc::Slice> slices;
    if (grpc_byte_buffer_reader reader;
        req != nullptr && grpc_byte_buffer_reader_init(&reader, req)) {
      for (grpc_slice slice; grpc_byte_buffer_reader_next(&reader, &slice) != 0;) {
        slices.emplace_back(slice, grpc::Slice::STEAL_REF);
      }
      grpc_byte_buffer_reader_destroy(&reader);
    }
    void* parsed = inner_->Deserialize(call, req, status, handler_data);
    if (status->ok() || req == nullptr) return parsed;
    Request* request;
    if constexpr (kUnary) {
      request = static_cast<grpc::MessageHolder<Request, Response>*>(*handler_data)->request();
    } else {
      request = new (grpc::g_core_codegen_interface->grpc_call_arena_alloc(call, sizeof(Request)))
          Request();
    }
    std::string wire;
    for (const grpc::Slice& s : slices) {
      wire.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    MarkUnparsed(wire, request);
    *status = grpc::Status::OK;
    return request;
  }

 private:
  const std::unique_ptr<grpc::internal::MethodHandler> inner_;
};

}  // namespace specd

#endif  // SPECD_COMMON_SERVICE_LENIENT_HANDLER_H_
