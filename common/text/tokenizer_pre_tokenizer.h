// The pre-tokenizer stage of tokenizer.json: Sequence, ByteLevel, Split, Metaspace, Digits,
// WhitespaceSplit, cutting normalized text into the words the model merges. The split regexes
// themselves are matched by common/text/pretokenizer.h. Private to common/text/tokenizer*.cc.
#ifndef SPECD_COMMON_TEXT_TOKENIZER_PRE_TOKENIZER_H_
#define SPECD_COMMON_TEXT_TOKENIZER_PRE_TOKENIZER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/text/pretokenizer.h"
#include "common/text/tokenizer_util.h"

namespace specd::tokenizer_internal {

// NormalizedString::split's behaviors: what happens to the matched ranges.
enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct Piece {
  std::string text;
  bool at_origin;  // starts at offset 0 of the original input (Metaspace prepend "first")
};

enum class Prepend { kAlways, kFirst, kNever };

struct PreStep {
  enum Kind { kByteLevel, kSplit, kMetaspace, kDigits, kWhitespaceSplit } kind;
  // ByteLevel
  bool add_prefix_space = false;
  bool use_regex = true;
  // Split
  std::optional<SplitRegex> regex;
  std::string literal;
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;
  // Metaspace
  uint32_t replacement = 0x2581;
  Prepend prepend = Prepend::kAlways;
  bool split = true;
  // Digits
  bool individual_digits = false;
};

// Replaces `pieces` by what step `st` makes of each.
void RunPreStep(const PreStep& st, std::vector<Piece>* pieces);

// Appends the steps of the pre-tokenizer `j` (at JSON path `path`) to `out`.
absl::Status ParsePreTokenizer(const Ctx& ctx, const json& j, const std::string& path,
                               std::vector<PreStep>* out);

// Metaspace's replacement character and prepend_scheme (with the legacy add_prefix_space
// flag), which the Metaspace decoder reads too.
absl::Status ParseMetaspaceChar(const Ctx& ctx, const json& j, const std::string& path,
                                uint32_t* out);
absl::Status ParsePrependScheme(const Ctx& ctx, const json& j, const std::string& path,
                                Prepend* out);

}  // namespace specd::tokenizer_internal

#endif  // SPECD_COMMON_TEXT_TOKENIZER_PRE_TOKENIZER_H_
