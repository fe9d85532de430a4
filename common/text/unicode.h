// Unicode helpers for the tokenizer: character classes, lenient UTF-8 decoding, Rust-style
// lossy UTF-8 repair and NFC. Tables come from tools/codegen/gen_unicode_tables.py.
#ifndef SPECD_COMMON_TEXT_UNICODE_H_
#define SPECD_COMMON_TEXT_UNICODE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace specd::unicode {

// Class bits of CharFlags().
inline constexpr uint8_t kLetter = 1;     // \p{L}
inline constexpr uint8_t kNumber = 2;     // \p{N}
inline constexpr uint8_t kSpace = 4;      // \s of Oniguruma and Rust: White_Space
inline constexpr uint8_t kMark = 8;       // \p{M}
inline constexpr uint8_t kConnector = 16; // \p{Pc}
inline constexpr uint8_t kWord = 32;      // Rust regex's Unicode \w

// Code point returned for a byte that does not start a valid UTF-8 sequence.
inline constexpr uint32_t kInvalid = 0xFFFFFFFFu;
inline constexpr uint32_t kReplacementChar = 0xFFFD;

// Class bits of a code point; 0 for kInvalid and unassigned code points.
uint8_t CharFlags(uint32_t cp);
inline bool IsLetter(uint32_t cp) { return CharFlags(cp) & kLetter; }
inline bool IsNumber(uint32_t cp) { return CharFlags(cp) & kNumber; }
inline bool IsSpace(uint32_t cp) { return CharFlags(cp) & kSpace; }
// Rust regex's Unicode \w (Alphabetic, marks, decimal digits, connector punctuation,
// Join_Control): what tokenizers tests for single_word added tokens.
inline bool IsWordChar(uint32_t cp) { return CharFlags(cp) & kWord; }

struct DecodedChar {
  uint32_t cp;  // kInvalid for a byte that is not part of a valid sequence
  int len;      // bytes consumed, >= 1 when pos < s.size()
};

// Decodes the character at byte `pos`. An invalid sequence consumes exactly one byte and
// yields kInvalid, so every byte string can be walked without losing bytes.
DecodedChar DecodeAt(std::string_view s, size_t pos);

void AppendUtf8(uint32_t cp, std::string* out);
bool IsValidUtf8(std::string_view s);

// Replaces ill-formed sequences by U+FFFD exactly as Rust's String::from_utf8_lossy does
// (one replacement per maximal subpart, the Unicode recommendation).
std::string Utf8Lossy(std::string_view s);

// Bytes at the end of `s` that form an incomplete (but so far valid) UTF-8 sequence: the
// part a streaming decoder must hold back until more bytes arrive. 0 to 3.
size_t IncompleteUtf8Suffix(std::string_view s);

// Canonical combining class (0 for starters).
uint8_t CombiningClass(uint32_t cp);

// Unicode Normalization Forms C and D. Bytes that are not valid UTF-8 pass through
// unchanged (they act as starters that compose with nothing).
std::string Nfc(std::string_view s);
std::string Nfd(std::string_view s);

const char* Version();

}  // namespace specd::unicode

#endif  // SPECD_COMMON_TEXT_UNICODE_H_
