#include "common/text/unicode.h"

#include <algorithm>
#include <array>
#include <vector>

#include "common/text/unicode_tables.h"

namespace specd::unicode {
namespace {

using unicode_internal::ClassRange;

uint8_t LookupRange(const ClassRange* table, size_t size, uint32_t cp) {
  const ClassRange* end = table + size;
  const ClassRange* it = std::upper_bound(
      table, end, cp, [](uint32_t v, const ClassRange& r) { return v < r.lo; });
  if (it == table) return 0;
  --it;
  return cp <= it->hi ? it->value : 0;
}

std::array<uint8_t, 128> MakeAsciiFlags() {
  std::array<uint8_t, 128> a{};
  for (uint32_t c = 0; c < 128; ++c) {
    a[c] = LookupRange(unicode_internal::kClassRanges, unicode_internal::kClassRangesSize, c);
  }
  return a;
}

// Length of the maximal prefix of a well-formed sequence starting at s[pos] (Unicode 3.9,
// table 3-7), 0 if s[pos] cannot start one; *complete says whether the sequence is whole.
int MaximalSubpart(std::string_view s, size_t pos, bool* complete) {
  const auto b = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  const uint8_t c = b(pos);
  *complete = false;
  if (c < 0x80) {
    *complete = true;
    return 1;
  }
  int need;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    need = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  int len = 1;
  while (len < need && pos + len < s.size()) {
    const uint8_t x = b(pos + len);
    const bool ok = len == 1 ? (x >= lo && x <= hi) : (x >= 0x80 && x <= 0xBF);
    if (!ok) break;
    ++len;
  }
  *complete = len == need;
  return len;
}

uint32_t DecodeComplete(std::string_view s, size_t pos, int len) {
  const auto b = [&](size_t i) { return static_cast<uint32_t>(static_cast<uint8_t>(s[i])); };
  switch (len) {
    case 1:
      return b(pos);
    case 2:
      return ((b(pos) & 0x1F) << 6) | (b(pos + 1) & 0x3F);
    case 3:
      return ((b(pos) & 0x0F) << 12) | ((b(pos + 1) & 0x3F) << 6) | (b(pos + 2) & 0x3F);
    default:
      return ((b(pos) & 0x07) << 18) | ((b(pos + 1) & 0x3F) << 12) |
             ((b(pos + 2) & 0x3F) << 6) | (b(pos + 3) & 0x3F);
  }
}

// Bytes that are not valid UTF-8 pass through NFC and NFD unchanged, carried as these
// pseudo code points (combining class 0, never composed).
constexpr uint32_t kRawByteBase = 0x110000;

void AppendCodePoint(uint32_t cp, std::string* out) {
  if (cp >= kRawByteBase) {
    out->push_back(static_cast<char>(cp - kRawByteBase));
  } else {
    AppendUtf8(cp, out);
  }
}

// Hangul syllables are composed and decomposed algorithmically (Unicode 3.12).
constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28;
constexpr uint32_t kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

void DecomposeInto(uint32_t cp, std::vector<uint32_t>* out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const uint32_t s = cp - kSBase;
    out->push_back(kLBase + s / kNCount);
    out->push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out->push_back(kTBase + s % kTCount);
    return;
  }
  if (cp < 0xC0) {
    out->push_back(cp);
    return;
  }
  using unicode_internal::Decomposition;
  const Decomposition* begin = unicode_internal::kDecompositions;
  const Decomposition* end = begin + unicode_internal::kDecompositionsSize;
  const Decomposition* it = std::lower_bound(
      begin, end, cp, [](const Decomposition& d, uint32_t v) { return d.cp < v; });
  if (it != end && it->cp == cp) {
    out->insert(out->end(), it->parts, it->parts + it->len);
  } else {
    out->push_back(cp);
  }
}

// Returns 0 when (a, b) has no primary composite.
uint32_t Compose(uint32_t a, uint32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount) {
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  }
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase &&
      b < kTBase + kTCount) {
    return a + (b - kTBase);
  }
  using unicode_internal::Composition;
  const Composition* begin = unicode_internal::kCompositions;
  const Composition* end = begin + unicode_internal::kCompositionsSize;
  const Composition* it = std::lower_bound(begin, end, std::make_pair(a, b),
                                           [](const Composition& c, std::pair<uint32_t, uint32_t> v) {
                                             return std::make_pair(c.first, c.second) < v;
                                           });
  if (it != end && it->first == a && it->second == b) return it->composite;
  return 0;
}

std::vector<uint32_t> CanonicalDecomposition(std::string_view s) {
  std::vector<uint32_t> d;
  d.reserve(s.size());
  for (size_t pos = 0; pos < s.size();) {
    const DecodedChar c = DecodeAt(s, pos);
    pos += c.len;
    if (c.cp == kInvalid) {
      d.push_back(kRawByteBase + static_cast<uint8_t>(s[pos - 1]));
    } else {
      DecomposeInto(c.cp, &d);
    }
  }
  // Canonical ordering: stable sort of every run of non-starters by combining class.
  for (size_t i = 1; i < d.size(); ++i) {
    const uint8_t cc = CombiningClass(d[i]);
    if (cc == 0) continue;
    size_t j = i;
    const uint32_t v = d[i];
    while (j > 0) {
      const uint8_t prev = CombiningClass(d[j - 1]);
      if (prev == 0 || prev <= cc) break;
      d[j] = d[j - 1];
      --j;
    }
    d[j] = v;
  }
  return d;
}

// True when every character is below U+0300: such text is already in NFC and NFD is only
// needed for the precomposed Latin-1 letters, so NFC can skip the tables.
bool BelowCombiningRange(std::string_view s) {
  for (unsigned char c : s) {
    if (c >= 0xCC) return false;  // lead bytes of U+0300 and above
  }
  return true;
}

}  // namespace

uint8_t CharFlags(uint32_t cp) {
  static const std::array<uint8_t, 128> ascii = MakeAsciiFlags();
  if (cp < 128) return ascii[cp];
  if (cp == kInvalid) return 0;
  return LookupRange(unicode_internal::kClassRanges, unicode_internal::kClassRangesSize, cp);
}

uint8_t CombiningClass(uint32_t cp) {
  if (cp < 0x300 || cp > 0x10FFFF) return 0;
  return LookupRange(unicode_internal::kCombiningClassRanges,
                     unicode_internal::kCombiningClassRangesSize, cp);
}

DecodedChar DecodeAt(std::string_view s, size_t pos) {
  const uint8_t c = static_cast<uint8_t>(s[pos]);
  if (c < 0x80) return {c, 1};
  bool complete;
  const int len = MaximalSubpart(s, pos, &complete);
  if (!complete) return {kInvalid, 1};
  return {DecodeComplete(s, pos, len), len};
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool IsValidUtf8(std::string_view s) {
  for (size_t pos = 0; pos < s.size();) {
    if (static_cast<uint8_t>(s[pos]) < 0x80) {
      ++pos;
      continue;
    }
    bool complete;
    const int len = MaximalSubpart(s, pos, &complete);
    if (!complete) return false;
    pos += len;
  }
  return true;
}

std::string Utf8Lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t pos = 0; pos < s.size();) {
    bool complete;
    const int len = MaximalSubpart(s, pos, &complete);
    if (complete) {
      out.append(s.data() + pos, len);
      pos += len;
    } else {
      AppendUtf8(kReplacementChar, &out);
      pos += std::max(len, 1);
    }
  }
  return out;
}

size_t IncompleteUtf8Suffix(std::string_view s) {
  const size_t first = s.size() >= 3 ? s.size() - 3 : 0;
  for (size_t p = first; p < s.size(); ++p) {
    const uint8_t c = static_cast<uint8_t>(s[p]);
    if (c < 0xC2 || c > 0xF4) continue;
    bool complete;
    const int len = MaximalSubpart(s, p, &complete);
    if (!complete && p + len == s.size()) return s.size() - p;
  }
  return 0;
}

std::string Nfd(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (uint32_t cp : CanonicalDecomposition(s)) AppendCodePoint(cp, &out);
  return out;
}

std::string Nfc(std::string_view s) {
  if (BelowCombiningRange(s)) return std::string(s);
  const std::vector<uint32_t> d = CanonicalDecomposition(s);
  std::vector<uint32_t> c;
  c.reserve(d.size());
  size_t starter = 0;
  int last_class = 256;  // blocks composition until the first starter
  for (uint32_t cp : d) {
    const int cc = CombiningClass(cp);
    if (!c.empty() && (last_class < cc || last_class == 0) &&
        CombiningClass(c[starter]) == 0) {
      if (const uint32_t composite = Compose(c[starter], cp); composite != 0) {
        c[starter] = composite;
        continue;
      }
    }
    if (cc == 0) starter = c.size();
    last_class = cc;
    c.push_back(cp);
  }
  std::string out;
  out.reserve(s.size());
  for (uint32_t cp : c) AppendCodePoint(cp, &out);
  return out;
}

const char* Version() { return unicode_internal::kUnicodeVersion; }

}  // namespace specd::unicode
