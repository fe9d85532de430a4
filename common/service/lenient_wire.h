// The request type of the draft and verify Step streams as the server reads them: the message,
// parsed leniently (lenient_parse.h). gRPC's callback API ends a bidi stream's reads on a
// message that fails to parse exactly as on the client's half-close, so the stream used to
// finish OK and later steps vanished; with this wrapper the reactor sees the message, empty and
// marked, and ends the stream with INVALID_ARGUMENT. A distinct type (not the message itself)
// so its SerializationTraits cannot collide with gRPC's protobuf traits in other translation
// units; only Deserialize's failure path differs from them.
#ifndef SPECD_COMMON_SERVICE_LENIENT_WIRE_H_
#define SPECD_COMMON_SERVICE_LENIENT_WIRE_H_

#include <string>
#include <vector>

#include "common/service/lenient_parse.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/byte_buffer.h"

namespace specd {

template <typename Message>
struct LenientWire {
  Message message;
};

}  // namespace specd

namespace grpc {

template <typename Message>
class SerializationTraits<specd::LenientWire<Message>, void> {
 public:
  static Status Serialize(const specd::LenientWire<Message>& wire, ByteBuffer* bb,
                          bool* own_buffer) {
    return GenericSerialize<ProtoBufferWriter, Message>(wire.message, bb, own_buffer);
  }

  static Status Deserialize(ByteBuffer* buffer, specd::LenientWire<Message>* wire) {
    // Slices are reference-counted: keeping them costs no copy of the bytes.
    std::vector<Slice> slices;
    const bool kept = buffer->Valid() && buffer->Dump(&slices).ok();
    Status status = GenericDeserialize<ProtoBufferReader, Message>(buffer, &wire->message);
    if (status.ok() || !kept) return status;
    std::string bytes;
    for (const Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    specd::MarkUnparsed(bytes, &wire->message);
    return Status::OK;
  }
};

}  // namespace grpc

#endif  // SPECD_COMMON_SERVICE_LENIENT_WIRE_H_
