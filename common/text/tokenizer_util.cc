#include "common/text/tokenizer_util.h"

#include <string>

#include "common/text/unicode.h"

namespace specd::tokenizer_internal {

// Replaces every non-overlapping occurrence of `from`, left to right.
std::string ReplaceAll(std::string_view s, std::string_view from, std::string_view to) {
  if (from.empty()) return std::string(s);
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (true) {
    const size_t hit = s.find(from, pos);
    if (hit == std::string_view::npos) break;
    out.append(s.data() + pos, hit - pos);
    out.append(to);
    pos = hit + from.size();
  }
  out.append(s.data() + pos, s.size() - pos);
  return out;
}

std::string CodePointUtf8(uint32_t cp) {
  std::string s;
  unicode::AppendUtf8(cp, &s);
  return s;
}

// The single code point of `s`, or nullopt if `s` is not exactly one character.
std::optional<uint32_t> SingleChar(std::string_view s) {
  if (s.empty()) return std::nullopt;
  const unicode::DecodedChar c = unicode::DecodeAt(s, 0);
  if (c.cp == unicode::kInvalid || static_cast<size_t>(c.len) != s.size()) return std::nullopt;
  return c.cp;
}

// Code point of the last character of `s` (kInvalid for a stray byte).
uint32_t LastChar(std::string_view s) {
  size_t start = s.size() - 1;
  while (start > 0 && s.size() - start < 4 && (static_cast<uint8_t>(s[start]) & 0xC0) == 0x80) {
    --start;
  }
  const unicode::DecodedChar c = unicode::DecodeAt(s, start);
  return start + c.len == s.size() ? c.cp : unicode::kInvalid;
}

// Byte length of the leading / trailing White_Space run.
size_t LeadingSpaceBytes(std::string_view s) {
  size_t pos = 0;
  while (pos < s.size()) {
    const unicode::DecodedChar c = unicode::DecodeAt(s, pos);
    if (!unicode::IsSpace(c.cp)) break;
    pos += c.len;
  }
  return pos;
}

size_t TrailingSpaceStart(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    const uint32_t cp = LastChar(s.substr(0, end));
    if (!unicode::IsSpace(cp)) break;
    end -= cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
  }
  return end;
}

const ByteMap& Bytes() {
  static const ByteMap* map = new ByteMap();
  return *map;
}

}  // namespace specd::tokenizer_internal
