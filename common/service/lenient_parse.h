// Turning request bytes that do not parse into an INVALID_ARGUMENT that names the field.
//
// Why: proto3 `string` fields must hold UTF-8, and libprotobuf refuses the whole message
// otherwise. gRPC's callback API then answers UNIMPLEMENTED with an empty message (unary and
// server-streaming calls) or ends a bidi stream's reads as if the client had half-closed, so the
// stream finished OK and later messages vanished. Declaring the fields `bytes` would change the
// public API of every client (Python would take bytes for a prompt), and protobuf 3.21 has no
// per-field UTF-8 option. So the server parses as usual and only on failure, off the hot path,
// walks the wire bytes against the descriptor to find the first string field holding invalid
// UTF-8; the request reaches the handler empty, carrying the problem in a reserved unknown field
// (MarkUnparsed), and the handler answers WireError()'s INVALID_ARGUMENT.
//
// Header-only: it is used from gRPC serialization traits and method handlers
// (lenient_wire.h, lenient_handler.h) and by the fuzz harnesses.
#ifndef SPECD_COMMON_SERVICE_LENIENT_PARSE_H_
#define SPECD_COMMON_SERVICE_LENIENT_PARSE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/message.h"
#include "google/protobuf/unknown_field_set.h"
#include "google/protobuf/wire_format_lite.h"

namespace specd {

// The largest field number protobuf allows; no specd message uses it, so a request that
// carries it as an unknown field was marked by MarkUnparsed (or forged by its own client, who
// then gets its own text back as INVALID_ARGUMENT).
inline constexpr int kWireErrorField = (1 << 29) - 1;

// Whether `s` is well-formed UTF-8 (no overlongs, no surrogates, at most U+10FFFF), the rule
// libprotobuf applies to proto3 strings.
inline bool IsValidUtf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  while (p < end) {
    const unsigned char c = *p;
    if (c < 0x80) {
      ++p;
      continue;
    }
    int n;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) {
      n = 1, cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      n = 2, cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      n = 3, cp = c & 0x07;
    } else {
      return false;
    }
    if (end - p <= n) return false;
    for (int i = 1; i <= n; ++i) {
      if ((p[i] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i] & 0x3F);
    }
    if ((n == 2 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) ||
        (n == 3 && (cp < 0x10000 || cp > 0x10FFFF))) {
      return false;
    }
    p += n + 1;
  }
  return true;
}

namespace lenient_internal {

// Appends to `path` the first string field of `wire` (a `type` message) that holds invalid
// UTF-8, as "stop[2]" or "steps[0].name"; false when there is none (or the bytes are malformed
// before one is found). `depth` bounds recursion on hostile nesting.
inline bool FindInvalidUtf8(std::string_view wire, const google::protobuf::Descriptor* type,
                            const std::string& prefix, int depth, std::string* path) {
  using google::protobuf::FieldDescriptor;
  using google::protobuf::internal::WireFormatLite;
  if (depth > 32) return false;
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(wire.data()),
                                            static_cast<int>(wire.size()));
  in.SetRecursionLimit(64);
  std::vector<std::pair<int, int>> counts;  // field number -> occurrences seen
  for (;;) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) return false;
    const int number = static_cast<int>(WireFormatLite::GetTagFieldNumber(tag));
    const FieldDescriptor* field = type->FindFieldByNumber(number);
    if (WireFormatLite::GetTagWireType(tag) != WireFormatLite::WIRETYPE_LENGTH_DELIMITED ||
        field == nullptr) {
      if (!WireFormatLite::SkipField(&in, tag)) return false;
      continue;
    }
    uint32_t length = 0;
    std::string bytes;
    if (!in.ReadVarint32(&length) || !in.ReadString(&bytes, static_cast<int>(length))) {
      return false;
    }
    int index = 0;
    if (field->is_repeated()) {
      bool found = false;
      for (auto& [n, c] : counts) {
        if (n == number) index = c++, found = true;
      }
      if (!found) counts.emplace_back(number, 1);
    }
    std::string name = prefix + field->name();
    if (field->is_repeated()) absl::StrAppend(&name, "[", index, "]");
    if (field->type() == FieldDescriptor::TYPE_STRING && !IsValidUtf8(bytes)) {
      *path = name;
      return true;
    }
    if (field->type() == FieldDescriptor::TYPE_MESSAGE &&
        FindInvalidUtf8(bytes, field->message_type(), name + ".", depth + 1, path)) {
      return true;
    }
  }
}

}  // namespace lenient_internal

// Call after `message` failed to parse `wire`: clears it and records in it why, naming the
// string field with invalid UTF-8 when that is the cause.
inline void MarkUnparsed(std::string_view wire, google::protobuf::Message* message) {
  std::string field;
  std::string problem =
      lenient_internal::FindInvalidUtf8(wire, message->GetDescriptor(), "", 0, &field)
          ? absl::StrCat(field,
                         ": not valid UTF-8 (proto3 strings must be UTF-8; send token ids "
                         "for arbitrary bytes)")
          : absl::StrCat("the ", message->GetDescriptor()->name(),
                         " message could not be parsed (malformed protobuf)");
  message->Clear();
  message->GetReflection()->MutableUnknownFields(message)->AddLengthDelimited(kWireErrorField,
                                                                              problem);
}

// INVALID_ARGUMENT with MarkUnparsed's text when `message` carries it, else OK. Costs a look at
// the unknown fields, which well-formed requests from current clients do not have.
inline absl::Status WireError(const google::protobuf::Message& message) {
  const google::protobuf::UnknownFieldSet& unknown =
      message.GetReflection()->GetUnknownFields(message);
  for (int i = 0; i < unknown.field_count(); ++i) {
    const google::protobuf::UnknownField& f = unknown.field(i);
    if (f.number() == kWireErrorField &&
        f.type() == google::protobuf::UnknownField::TYPE_LENGTH_DELIMITED) {
      return absl::InvalidArgumentError(f.length_delimited());
    }
  }
  return absl::OkStatus();
}

}  // namespace specd

#endif  // SPECD_COMMON_SERVICE_LENIENT_PARSE_H_
