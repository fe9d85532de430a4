#include "common/text/pretokenizer.h"

#include <cstdint>

#include "common/text/unicode.h"

namespace specd {
namespace {

constexpr std::string_view kGpt2Source =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr std::string_view kLlama3Source =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2Source =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

struct Char {
  uint32_t cp;
  uint32_t begin;  // byte offset
  uint8_t flags;
};

class Matcher {
 public:
  Matcher(SplitRegex pattern, std::string_view text) : pattern_(pattern), size_(text.size()) {
    chars_.reserve(text.size());
    for (size_t pos = 0; pos < text.size();) {
      const unicode::DecodedChar c = unicode::DecodeAt(text, pos);
      chars_.push_back({c.cp, static_cast<uint32_t>(pos), unicode::CharFlags(c.cp)});
      pos += c.len;
    }
  }

  std::vector<std::pair<size_t, size_t>> Run() {
    std::vector<std::pair<size_t, size_t>> out;
    const size_t n = chars_.size();
    size_t i = 0;
    while (i < n) {
      size_t end = Match(i);
      if (end == i) {
        // No alternative matches here (cannot happen for these patterns, which cover every
        // character class); the search moves on one character, as a regex search would.
        ++i;
        continue;
      }
      out.emplace_back(Byte(i), Byte(end));
      i = end;
    }
    return out;
  }

 private:
  size_t Byte(size_t i) const { return i < chars_.size() ? chars_[i].begin : size_; }
  bool In(size_t i) const { return i < chars_.size(); }
  bool Letter(size_t i) const { return In(i) && (chars_[i].flags & unicode::kLetter); }
  bool Number(size_t i) const { return In(i) && (chars_[i].flags & unicode::kNumber); }
  bool Space(size_t i) const { return In(i) && (chars_[i].flags & unicode::kSpace); }
  // [^\s\p{L}\p{N}]
  bool Other(size_t i) const {
    return In(i) &&
           !(chars_[i].flags & (unicode::kLetter | unicode::kNumber | unicode::kSpace));
  }
  bool Is(size_t i, uint32_t cp) const { return In(i) && chars_[i].cp == cp; }
  bool IsNewline(size_t i) const { return Is(i, '\r') || Is(i, '\n'); }

  // Case-insensitive match of an ASCII lowercase letter, with Unicode simple case folding
  // (only 's' has a non-ASCII fold among the contraction letters: U+017F LONG S).
  bool IsCi(size_t i, char lower) const {
    if (!In(i)) return false;
    const uint32_t cp = chars_[i].cp;
    if (cp == static_cast<uint32_t>(lower) || cp == static_cast<uint32_t>(lower - 32)) {
      return true;
    }
    return lower == 's' && cp == 0x17F;
  }
  bool IsCs(size_t i, char lower) const { return Is(i, static_cast<uint32_t>(lower)); }

  size_t Run(size_t i, bool (Matcher::*pred)(size_t) const) const {
    while ((this->*pred)(i)) ++i;
    return i;
  }

  // 's|'t|'re|'ve|'m|'ll|'d, case-insensitive or not; returns i when it does not match.
  size_t Contraction(size_t i, bool ci) const {
    if (!Is(i, '\'')) return i;
    auto is = [&](size_t k, char c) { return ci ? IsCi(k, c) : IsCs(k, c); };
    if (is(i + 1, 's') || is(i + 1, 't')) return i + 2;
    if (is(i + 1, 'r') && is(i + 2, 'e')) return i + 3;
    if (is(i + 1, 'v') && is(i + 2, 'e')) return i + 3;
    if (is(i + 1, 'm')) return i + 2;
    if (is(i + 1, 'l') && is(i + 2, 'l')) return i + 3;
    if (is(i + 1, 'd')) return i + 2;
    return i;
  }

  // ` ?X+` for a class X.
  size_t OptSpaceRun(size_t i, bool (Matcher::*cls)(size_t) const) const {
    if (Is(i, ' ') && (this->*cls)(i + 1)) return Run(i + 1, cls);
    if ((this->*cls)(i)) return Run(i, cls);
    return i;
  }

  // \s+(?!\S) then \s+: a whitespace run gives back its last character when a
  // non-space follows, unless that would leave it empty.
  size_t SpaceRuns(size_t i) const {
    if (!Space(i)) return i;
    const size_t k = Run(i, &Matcher::Space);
    if (k == chars_.size() || k - i >= 2) return k == chars_.size() ? k : k - 1;
    return k;
  }

  size_t Match(size_t i) const {
    if (pattern_ == SplitRegex::kGpt2) {
      size_t e;
      if ((e = Contraction(i, /*ci=*/false)) != i) return e;
      if ((e = OptSpaceRun(i, &Matcher::Letter)) != i) return e;
      if ((e = OptSpaceRun(i, &Matcher::Number)) != i) return e;
      if ((e = OptSpaceRun(i, &Matcher::Other)) != i) return e;
      return SpaceRuns(i);
    }
    size_t e;
    if ((e = Contraction(i, /*ci=*/true)) != i) return e;
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (In(i) && !IsNewline(i) && !Letter(i) && !Number(i) && Letter(i + 1)) {
      return Run(i + 1, &Matcher::Letter);
    }
    if (Letter(i)) return Run(i, &Matcher::Letter);
    // \p{N}{1,3} (Llama-3) or \p{N} (Qwen2)
    if (Number(i)) {
      const size_t max = pattern_ == SplitRegex::kLlama3 ? 3 : 1;
      size_t k = i;
      while (k - i < max && Number(k)) ++k;
      return k;
    }
    //  ?[^\s\p{L}\p{N}]+[\r\n]*
    if ((e = OptSpaceRun(i, &Matcher::Other)) != i) return Run(e, &Matcher::IsNewline);
    // \s*[\r\n]+ : the whitespace run up to and including its last line break.
    if (Space(i)) {
      const size_t k = Run(i, &Matcher::Space);
      for (size_t m = k; m > i; --m) {
        if (IsNewline(m - 1)) return m;
      }
    }
    return SpaceRuns(i);
  }

  SplitRegex pattern_;
  size_t size_;
  std::vector<Char> chars_;
};

}  // namespace

std::optional<SplitRegex> RecognizeSplitRegex(std::string_view regex) {
  if (regex == kGpt2Source) return SplitRegex::kGpt2;
  if (regex == kLlama3Source) return SplitRegex::kLlama3;
  if (regex == kQwen2Source) return SplitRegex::kQwen2;
  return std::nullopt;
}

std::string_view SplitRegexSource(SplitRegex pattern) {
  switch (pattern) {
    case SplitRegex::kGpt2:
      return kGpt2Source;
    case SplitRegex::kLlama3:
      return kLlama3Source;
    case SplitRegex::kQwen2:
      return kQwen2Source;
  }
  return {};
}

std::vector<std::pair<size_t, size_t>> FindSplitMatches(SplitRegex pattern,
                                                        std::string_view text) {
  return Matcher(pattern, text).Run();
}

}  // namespace specd
