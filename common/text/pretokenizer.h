// Hand-written matchers for the pre-tokenizer split regexes of GPT-2, Llama-3 and Qwen2.
//
// These regexes use \p{L}, \p{N}, case-insensitive contractions and the look-ahead
// `\s+(?!\S)`, which RE2 lacks; Hugging Face tokenizers runs them with Oniguruma. The
// matchers below reproduce Oniguruma's leftmost-first alternation with backtracking for
// exactly these patterns, character class by character class.
#ifndef SPECD_COMMON_TEXT_PRETOKENIZER_H_
#define SPECD_COMMON_TEXT_PRETOKENIZER_H_

#include <cstddef>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

namespace specd {

enum class SplitRegex {
  // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  kGpt2,
  // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
  //  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
  kLlama3,
  // As kLlama3 with \p{N} instead of \p{N}{1,3}.
  kQwen2,
};

// The known pattern whose regex source text is `regex`, if any.
std::optional<SplitRegex> RecognizeSplitRegex(std::string_view regex);

// The source text of a known pattern (as it appears in tokenizer.json).
std::string_view SplitRegexSource(SplitRegex pattern);

// All non-overlapping matches of `pattern` in `text`, left to right, as byte ranges
// [begin, end). Bytes that are not valid UTF-8 count as one character each, of no class
// (like punctuation), so any byte string can be split.
std::vector<std::pair<size_t, size_t>> FindSplitMatches(SplitRegex pattern, std::string_view text);

}  // namespace specd

#endif  // SPECD_COMMON_TEXT_PRETOKENIZER_H_
