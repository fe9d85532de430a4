// The tokenizer's shared helpers: the string and UTF-8 primitives its pipeline stages use,
// GPT-2's byte map, and the JSON reader whose errors name the file and the field. Private to
// common/text/tokenizer*.cc.
#ifndef SPECD_COMMON_TEXT_TOKENIZER_UTIL_H_
#define SPECD_COMMON_TEXT_TOKENIZER_UTIL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

// Returns the status of `expr` from the enclosing function when it is not OK.
#define SPECD_TOK_RETURN_IF_ERROR(expr) \
  do {                                  \
    absl::Status _st = (expr);          \
    if (!_st.ok()) return _st;          \
  } while (0)

namespace specd::tokenizer_internal {

using json = nlohmann::json;

// Debian's Abseil keeps its own string_view type; StrCat and hash lookups need it.
inline absl::string_view A(std::string_view s) { return absl::string_view(s.data(), s.size()); }

inline bool StartsWith(std::string_view s, std::string_view p) {
  return s.substr(0, p.size()) == p;
}

// Replaces every non-overlapping occurrence of `from`, left to right.
std::string ReplaceAll(std::string_view s, std::string_view from, std::string_view to);

std::string CodePointUtf8(uint32_t cp);

// The single code point of `s`, or nullopt if `s` is not exactly one character.
std::optional<uint32_t> SingleChar(std::string_view s);

// Code point of the last character of `s` (kInvalid for a stray byte).
uint32_t LastChar(std::string_view s);

// Byte length of the leading / trailing White_Space run.
size_t LeadingSpaceBytes(std::string_view s);
size_t TrailingSpaceStart(std::string_view s);

// GPT-2's reversible map from bytes to printable code points: printable Latin-1 bytes map
// to themselves, the others to U+0100 and up in byte order.
struct ByteMap {
  std::string byte_to_utf8[256];
  absl::flat_hash_map<uint32_t, uint8_t> char_to_byte;

  ByteMap() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      const uint32_t cp = printable ? b : 256 + n++;
      byte_to_utf8[b] = CodePointUtf8(cp);
      char_to_byte[cp] = static_cast<uint8_t>(b);
    }
  }
};

// The process-wide ByteMap (built once, never freed).
const ByteMap& Bytes();

// JSON access with errors that name the file and the field.
class Ctx {
 public:
  explicit Ctx(std::string source) : source_(std::move(source)) {}

  absl::Status Error(std::string_view field, std::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": field '", A(field), "': ", A(what)));
  }

  // A member that may be absent or null (returns nullptr then).
  const json* Optional(const json& obj, std::string_view key) const {
    auto it = obj.find(std::string(key));
    if (it == obj.end() || it->is_null()) return nullptr;
    return &*it;
  }

  absl::Status String(const json& obj, std::string_view path, std::string_view key,
                      std::string* out, bool required = true) const {
    const json* v = Optional(obj, key);
    if (v == nullptr) {
      if (required) return Error(absl::StrCat(A(path), ".", A(key)), "missing");
      return absl::OkStatus();
    }
    if (!v->is_string()) return Error(absl::StrCat(A(path), ".", A(key)), "must be a string");
    *out = v->get<std::string>();
    return absl::OkStatus();
  }

  absl::Status Bool(const json& obj, std::string_view path, std::string_view key, bool* out,
                    bool dflt) const {
    const json* v = Optional(obj, key);
    if (v == nullptr) {
      *out = dflt;
      return absl::OkStatus();
    }
    if (!v->is_boolean()) return Error(absl::StrCat(A(path), ".", A(key)), "must be a boolean");
    *out = v->get<bool>();
    return absl::OkStatus();
  }

  absl::Status Int(const json& obj, std::string_view path, std::string_view key, int64_t* out,
                   int64_t dflt) const {
    const json* v = Optional(obj, key);
    if (v == nullptr) {
      *out = dflt;
      return absl::OkStatus();
    }
    if (!v->is_number_integer())
      return Error(absl::StrCat(A(path), ".", A(key)), "must be an integer");
    *out = v->get<int64_t>();
    return absl::OkStatus();
  }

  absl::Status Type(const json& obj, std::string_view path, std::string* type) const {
    if (!obj.is_object()) return Error(path, "must be an object");
    return String(obj, path, "type", type);
  }

  // A {"String": s} or {"Regex": r} pattern object.
  absl::Status Pattern(const json& obj, std::string_view path, std::string* text,
                       bool* is_regex) const {
    const json* p = Optional(obj, "pattern");
    const std::string field = absl::StrCat(A(path), ".pattern");
    if (p == nullptr || !p->is_object())
      return Error(field, "must be {\"String\": ...} or {\"Regex\": ...}");
    if (const json* s = Optional(*p, "String"); s != nullptr && s->is_string()) {
      *text = s->get<std::string>();
      *is_regex = false;
      return absl::OkStatus();
    }
    if (const json* r = Optional(*p, "Regex"); r != nullptr && r->is_string()) {
      *text = r->get<std::string>();
      *is_regex = true;
      return absl::OkStatus();
    }
    return Error(field, "must be {\"String\": ...} or {\"Regex\": ...}");
  }

 private:
  std::string source_;
};

// A regex with no metacharacters matches itself literally.
inline bool IsLiteralRegex(std::string_view r) {
  return r.find_first_of("\\^$.|?*+()[]{}") == std::string_view::npos;
}

// Token ids must fit a dense table; real vocabularies are far below this.
inline constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

}  // namespace specd::tokenizer_internal

#endif  // SPECD_COMMON_TEXT_TOKENIZER_UTIL_H_
