// The decoder stage of tokenizer.json: ByteLevel, Metaspace, Replace (literal), ByteFallback,
// Fuse, Strip, Sequence, turning token strings back into text. Private to
// common/text/tokenizer*.cc.
#ifndef SPECD_COMMON_TEXT_TOKENIZER_DECODER_H_
#define SPECD_COMMON_TEXT_TOKENIZER_DECODER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "common/text/tokenizer_util.h"

namespace specd::tokenizer_internal {

struct DecStep {
  enum Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind;
  std::string a, b;  // Replace: a -> b
  uint32_t ch = 0;   // Strip content / Metaspace replacement
  int64_t start = 0, stop = 0;
  bool prepend_never = false;
};

// Value of a "<0xNN>" byte-fallback token, as ByteFallback's decoder recognises it
// (Rust's u8::from_str_radix, which also takes a leading '+').
std::optional<uint8_t> ByteFallbackValue(std::string_view t);

// The text of `tokens` (token strings) after every step of `decoder`. at_start=false decodes a
// continuation: the text that follows a clean prefix (no start-of-text rules). *clean says
// whether the result may be split here (DecodeStream emits only clean text).
std::string RunDecoder(const std::vector<DecStep>& decoder, std::vector<std::string> tokens,
                       bool at_start, bool* clean);

// Appends the steps of the decoder `j` (at JSON path `path`) to `out`.
absl::Status ParseDecoder(const Ctx& ctx, const json& j, const std::string& path,
                          std::vector<DecStep>* out);

}  // namespace specd::tokenizer_internal

#endif  // SPECD_COMMON_TEXT_TOKENIZER_DECODER_H_
