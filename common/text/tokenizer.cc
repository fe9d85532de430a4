#include "common/text/tokenizer.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <queue>
#include <sstream>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/text/pretokenizer.h"
#include "common/text/unicode.h"
#include "nlohmann/json.hpp"

namespace specd {
namespace {

using json = nlohmann::json;

#define SPECD_TOK_RETURN_IF_ERROR(expr) \
  do {                                  \
    absl::Status _st = (expr);          \
    if (!_st.ok()) return _st;          \
  } while (0)

// ---------------------------------------------------------------------------------------
// Small string helpers.

// Debian's Abseil keeps its own string_view type; StrCat and hash lookups need it.
absl::string_view A(std::string_view s) { return absl::string_view(s.data(), s.size()); }

bool StartsWith(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

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

const ByteMap& Bytes() {
  static const ByteMap* map = new ByteMap();
  return *map;
}

// ---------------------------------------------------------------------------------------
// JSON access with errors that name the file and the field.

class Ctx {
 public:
  explicit Ctx(std::string source) : source_(std::move(source)) {}

  absl::Status Error(std::string_view field, std::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(source_, ": field '", A(field), "': ", A(what)));
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
    if (!v->is_number_integer()) return Error(absl::StrCat(A(path), ".", A(key)), "must be an integer");
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
    if (p == nullptr || !p->is_object()) return Error(field, "must be {\"String\": ...} or {\"Regex\": ...}");
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
bool IsLiteralRegex(std::string_view r) {
  return r.find_first_of("\\^$.|?*+()[]{}") == std::string_view::npos;
}

// Token ids must fit a dense table; real vocabularies are far below this.
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

// ---------------------------------------------------------------------------------------
// Pipeline pieces.

struct AddedToken {
  int32_t id = 0;
  std::string content;
  std::string pattern;  // what is matched: content, normalized if `normalized`
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool special = false;
};

// Leftmost-longest matcher over the added tokens of one kind (normalized or not).
class AddedMatcher {
 public:
  void Build(const std::vector<AddedToken>& tokens, bool normalized) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i].normalized != normalized || tokens[i].pattern.empty()) continue;
      by_first_byte_[static_cast<uint8_t>(tokens[i].pattern[0])].push_back(&tokens[i]);
      empty_ = false;
    }
    for (auto& list : by_first_byte_) {
      std::stable_sort(list.begin(), list.end(), [](const AddedToken* a, const AddedToken* b) {
        return a->pattern.size() > b->pattern.size();
      });
    }
  }
  bool empty() const { return empty_; }

  // Longest token whose pattern starts at `pos`, or nullptr.
  const AddedToken* LongestAt(std::string_view s, size_t pos) const {
    for (const AddedToken* t : by_first_byte_[static_cast<uint8_t>(s[pos])]) {
      if (s.compare(pos, t->pattern.size(), t->pattern) == 0) return t;
    }
    return nullptr;
  }

 private:
  std::vector<const AddedToken*> by_first_byte_[256];
  bool empty_ = true;
};

struct Segment {
  size_t begin, end;
  const AddedToken* token;  // nullptr for plain text
};

// Splits `s` around added-token matches like tokenizers' AddedVocabulary::find_matches.
std::vector<Segment> SplitOnAdded(std::string_view s, const AddedMatcher& m) {
  std::vector<Segment> out;
  if (s.empty()) return out;
  if (m.empty()) {
    out.push_back({0, s.size(), nullptr});
    return out;
  }
  size_t start_offset = 0;
  size_t pos = 0;
  while (pos < s.size()) {
    const AddedToken* t = m.LongestAt(s, pos);
    if (t == nullptr) {
      ++pos;
      continue;
    }
    size_t start = pos, stop = pos + t->pattern.size();
    // The search resumes after the raw match, even when the match is discarded below or
    // rstrip extends it: tokenizers then emits overlapping tokens, and so do we.
    pos = stop;
    if (t->single_word) {
      const bool start_ok = start == 0 || !unicode::IsWordChar(LastChar(s.substr(0, start)));
      const bool stop_ok =
          stop == s.size() || !unicode::IsWordChar(unicode::DecodeAt(s, stop).cp);
      if (!start_ok || !stop_ok) continue;
    }
    if (t->lstrip) start = std::max(TrailingSpaceStart(s.substr(0, start)), start_offset);
    if (t->rstrip) stop += LeadingSpaceBytes(s.substr(stop));
    if (start_offset < start) out.push_back({start_offset, start, nullptr});
    out.push_back({start, stop, t});
    start_offset = stop;
  }
  if (start_offset < s.size()) out.push_back({start_offset, s.size(), nullptr});
  return out;
}

struct NormalizerStep {
  enum Kind { kPrepend, kReplace, kStrip, kNfc, kNfd } kind;
  std::string a, b;
  bool left = false, right = false;
};

std::string Normalize(const std::vector<NormalizerStep>& steps, std::string s) {
  for (const NormalizerStep& st : steps) {
    if (s.empty()) break;  // every supported normalizer maps "" to ""
    switch (st.kind) {
      case NormalizerStep::kPrepend:
        s = st.a + s;
        break;
      case NormalizerStep::kReplace:
        s = ReplaceAll(s, st.a, st.b);
        break;
      case NormalizerStep::kStrip: {
        size_t b = st.left ? LeadingSpaceBytes(s) : 0;
        size_t e = st.right ? TrailingSpaceStart(s) : s.size();
        s = e > b ? s.substr(b, e - b) : std::string();
        break;
      }
      case NormalizerStep::kNfc:
        s = unicode::Nfc(s);
        break;
      case NormalizerStep::kNfd:
        s = unicode::Nfd(s);
        break;
    }
  }
  return s;
}

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct Match {
  size_t begin, end;
  bool is_match;
};

// Turns match ranges into a cover of [0, n) with flags, as tokenizers' Pattern does.
std::vector<Match> Cover(const std::vector<std::pair<size_t, size_t>>& ranges, size_t n) {
  std::vector<Match> out;
  size_t prev = 0;
  for (const auto& [b, e] : ranges) {
    if (prev != b) out.push_back({prev, b, false});
    out.push_back({b, e, true});
    prev = e;
  }
  if (prev != n) out.push_back({prev, n, false});
  return out;
}

// Each character for which `pred` holds is its own match.
template <typename Pred>
std::vector<Match> CharMatches(std::string_view s, Pred pred) {
  std::vector<std::pair<size_t, size_t>> ranges;
  for (size_t pos = 0; pos < s.size();) {
    const unicode::DecodedChar c = unicode::DecodeAt(s, pos);
    if (pred(c.cp)) ranges.emplace_back(pos, pos + c.len);
    pos += c.len;
  }
  return Cover(ranges, s.size());
}

// NormalizedString::split: the ranges kept for a split behavior.
std::vector<std::pair<size_t, size_t>> ApplyBehavior(const std::vector<Match>& m, Behavior b) {
  std::vector<std::pair<size_t, size_t>> out;
  switch (b) {
    case Behavior::kIsolated:
      for (const Match& x : m) out.emplace_back(x.begin, x.end);
      break;
    case Behavior::kRemoved:
      for (const Match& x : m) {
        if (!x.is_match) out.emplace_back(x.begin, x.end);
      }
      break;
    case Behavior::kContiguous: {
      bool prev = false;
      for (const Match& x : m) {
        if (x.is_match == prev && !out.empty()) {
          out.back().second = x.end;
        } else {
          out.emplace_back(x.begin, x.end);
        }
        prev = x.is_match;
      }
      break;
    }
    case Behavior::kMergedWithPrevious: {
      bool prev = false;
      for (const Match& x : m) {
        if (x.is_match && !prev && !out.empty()) {
          out.back().second = x.end;
        } else {
          out.emplace_back(x.begin, x.end);
        }
        prev = x.is_match;
      }
      break;
    }
    case Behavior::kMergedWithNext: {
      bool prev = false;
      for (auto it = m.rbegin(); it != m.rend(); ++it) {
        if (it->is_match && !prev && !out.empty()) {
          out.back().first = it->begin;
        } else {
          out.emplace_back(it->begin, it->end);
        }
        prev = it->is_match;
      }
      std::reverse(out.begin(), out.end());
      break;
    }
  }
  return out;
}

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

void Emit(const Piece& parent, std::string_view text,
          const std::vector<std::pair<size_t, size_t>>& ranges, std::vector<Piece>* out) {
  for (const auto& [b, e] : ranges) {
    if (e > b) out->push_back({std::string(text.substr(b, e - b)), parent.at_origin && b == 0});
  }
}

void RunPreStep(const PreStep& st, std::vector<Piece>* pieces) {
  std::vector<Piece> out;
  out.reserve(pieces->size() * 2);
  for (Piece& p : *pieces) {
    switch (st.kind) {
      case PreStep::kByteLevel: {
        std::string text = std::move(p.text);
        if (st.add_prefix_space && !text.empty() && text[0] != ' ') text.insert(0, " ");
        std::vector<std::pair<size_t, size_t>> ranges;
        if (st.use_regex) {
          ranges = ApplyBehavior(Cover(FindSplitMatches(SplitRegex::kGpt2, text), text.size()),
                                 Behavior::kIsolated);
        } else {
          ranges.emplace_back(0, text.size());
        }
        const ByteMap& bm = Bytes();
        for (const auto& [b, e] : ranges) {
          if (e <= b) continue;
          Piece q{std::string(), p.at_origin && b == 0};
          q.text.reserve((e - b) * 2);
          for (size_t i = b; i < e; ++i) q.text += bm.byte_to_utf8[static_cast<uint8_t>(text[i])];
          out.push_back(std::move(q));
        }
        break;
      }
      case PreStep::kSplit: {
        std::vector<Match> m;
        if (st.regex.has_value()) {
          m = Cover(FindSplitMatches(*st.regex, p.text), p.text.size());
        } else if (st.literal.empty()) {
          m.push_back({0, p.text.size(), false});
        } else {
          std::vector<std::pair<size_t, size_t>> ranges;
          for (size_t pos = p.text.find(st.literal); pos != std::string::npos;
               pos = p.text.find(st.literal, pos + st.literal.size())) {
            ranges.emplace_back(pos, pos + st.literal.size());
          }
          m = Cover(ranges, p.text.size());
        }
        if (st.invert) {
          for (Match& x : m) x.is_match = !x.is_match;
        }
        Emit(p, p.text, ApplyBehavior(m, st.behavior), &out);
        break;
      }
      case PreStep::kMetaspace: {
        const std::string rep = CodePointUtf8(st.replacement);
        std::string text = ReplaceAll(p.text, " ", rep);
        if (!text.empty() && !StartsWith(text, rep) &&
            (st.prepend == Prepend::kAlways || (st.prepend == Prepend::kFirst && p.at_origin))) {
          text.insert(0, rep);
        }
        if (st.split) {
          const uint32_t r = st.replacement;
          Emit(p, text,
               ApplyBehavior(CharMatches(text, [r](uint32_t cp) { return cp == r; }),
                             Behavior::kMergedWithNext),
               &out);
        } else if (!text.empty()) {
          out.push_back({std::move(text), p.at_origin});
        }
        break;
      }
      case PreStep::kDigits:
        Emit(p, p.text,
             ApplyBehavior(CharMatches(p.text, [](uint32_t cp) { return unicode::IsNumber(cp); }),
                           st.individual_digits ? Behavior::kIsolated : Behavior::kContiguous),
             &out);
        break;
      case PreStep::kWhitespaceSplit:
        Emit(p, p.text,
             ApplyBehavior(CharMatches(p.text, [](uint32_t cp) { return unicode::IsSpace(cp); }),
                           Behavior::kRemoved),
             &out);
        break;
    }
  }
  *pieces = std::move(out);
}

struct DecStep {
  enum Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind;
  std::string a, b;  // Replace: a -> b
  uint32_t ch = 0;   // Strip content / Metaspace replacement
  int64_t start = 0, stop = 0;
  bool prepend_never = false;
};

// Value of a "<0xNN>" byte-fallback token, as ByteFallback's decoder recognises it
// (Rust's u8::from_str_radix, which also takes a leading '+').
std::optional<uint8_t> ByteFallbackValue(std::string_view t) {
  if (t.size() != 6 || !StartsWith(t, "<0x") || t[5] != '>') return std::nullopt;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  const int h = hex(t[3]), l = hex(t[4]);
  if (t[3] == '+' && l >= 0) return static_cast<uint8_t>(l);
  if (h < 0 || l < 0) return std::nullopt;
  return static_cast<uint8_t>(h * 16 + l);
}

// ---------------------------------------------------------------------------------------
// BPE model.

class Bpe {
 public:
  absl::flat_hash_map<std::string, int32_t> vocab;
  std::vector<std::string> id_to_token;  // "" where no token has the id
  std::vector<bool> has_id;
  absl::flat_hash_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // pair -> (rank, new id)
  std::optional<int32_t> unk_id;
  std::string continuing_subword_prefix;
  std::string end_of_word_suffix;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  int32_t byte_ids[256];

  static uint64_t Key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  void Tokenize(std::string_view word, std::vector<int32_t>* out) const {
    if (word.empty()) return;
    if (ignore_merges) {
      if (auto it = vocab.find(A(word)); it != vocab.end()) {
        out->push_back(it->second);
        return;
      }
    }
    const bool cacheable = word.size() <= kMaxCachedWordBytes;
    if (cacheable) {
      absl::ReaderMutexLock lock(&cache_mu_);
      if (auto it = cache_.find(A(word)); it != cache_.end()) {
        out->insert(out->end(), it->second.begin(), it->second.end());
        return;
      }
    }
    std::vector<int32_t> ids = MergeWord(word);
    out->insert(out->end(), ids.begin(), ids.end());
    if (cacheable) {
      absl::MutexLock lock(&cache_mu_);
      if (cache_.size() < kMaxCacheEntries) cache_.emplace(std::string(word), std::move(ids));
    }
  }

  void ClearCache() const {
    absl::flat_hash_map<std::string, std::vector<int32_t>> empty;
    absl::MutexLock lock(&cache_mu_);
    cache_.swap(empty);  // frees the table too (clear() may keep it)
  }

 private:
  static constexpr size_t kMaxCachedWordBytes = 256;
  static constexpr size_t kMaxCacheEntries = 50000;

  struct Symbol {
    int32_t id;
    int32_t prev, next;
    bool alive;
  };

  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t new_id;
    // std::priority_queue pops the largest: make that the lowest rank, then leftmost.
    bool operator<(const Candidate& o) const {
      if (rank != o.rank) return rank > o.rank;
      return pos > o.pos;
    }
  };

  // tokenizers' BPE::merge_word + Word::merge_all (without dropout).
  std::vector<int32_t> MergeWord(std::string_view w) const {
    std::vector<Symbol> sym;
    sym.reserve(w.size());
    auto add = [&](int32_t id) {
      const int32_t n = static_cast<int32_t>(sym.size());
      sym.push_back({id, n - 1, -1, true});
      if (n > 0) sym[n - 1].next = n;
    };
    std::optional<int32_t> pending_unk;
    std::string buf;
    for (size_t pos = 0; pos < w.size();) {
      const unicode::DecodedChar c = unicode::DecodeAt(w, pos);
      const std::string_view ch = w.substr(pos, c.len);
      const bool first = pos == 0;
      pos += c.len;
      const bool last = pos >= w.size();
      std::string_view key = ch;
      if ((!first && !continuing_subword_prefix.empty()) || (last && !end_of_word_suffix.empty())) {
        buf.clear();
        if (!first) buf += continuing_subword_prefix;
        buf.append(ch);
        if (last) buf += end_of_word_suffix;
        key = buf;
      }
      if (auto it = vocab.find(A(key)); it != vocab.end()) {
        if (pending_unk) add(*pending_unk);
        pending_unk.reset();
        add(it->second);
        continue;
      }
      if (byte_fallback) {
        bool all = true;
        for (unsigned char b : key) all = all && byte_ids[b] >= 0;
        if (all) {
          for (unsigned char b : key) add(byte_ids[b]);
          continue;
        }
      }
      if (unk_id) {
        if (pending_unk && !fuse_unk) add(*pending_unk);
        pending_unk = *unk_id;
      }
    }
    if (pending_unk) add(*pending_unk);

    std::priority_queue<Candidate> queue;
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      if (auto it = merges.find(Key(sym[i].id, sym[i + 1].id)); it != merges.end()) {
        queue.push({it->second.first, static_cast<int32_t>(i), it->second.second});
      }
    }
    while (!queue.empty()) {
      const Candidate top = queue.top();
      queue.pop();
      Symbol& s = sym[top.pos];
      if (!s.alive || s.next < 0) continue;
      Symbol& right = sym[s.next];
      auto it = merges.find(Key(s.id, right.id));
      if (it == merges.end() || it->second.second != top.new_id) continue;  // stale entry
      s.id = top.new_id;
      right.alive = false;
      s.next = right.next;
      if (s.next >= 0) sym[s.next].prev = top.pos;
      if (s.prev >= 0) {
        if (auto m = merges.find(Key(sym[s.prev].id, s.id)); m != merges.end()) {
          queue.push({m->second.first, s.prev, m->second.second});
        }
      }
      if (s.next >= 0) {
        if (auto m = merges.find(Key(s.id, sym[s.next].id)); m != merges.end()) {
          queue.push({m->second.first, top.pos, m->second.second});
        }
      }
    }
    std::vector<int32_t> ids;
    ids.reserve(sym.size());
    for (const Symbol& s : sym) {
      if (s.alive) ids.push_back(s.id);
    }
    return ids;
  }

  mutable absl::Mutex cache_mu_;
  mutable absl::flat_hash_map<std::string, std::vector<int32_t>> cache_ ABSL_GUARDED_BY(cache_mu_);
};

}  // namespace

// ---------------------------------------------------------------------------------------

struct Tokenizer::Impl {
  Bpe bpe;
  std::vector<AddedToken> added;  // sorted by id
  absl::flat_hash_map<int32_t, const AddedToken*> added_by_id;
  absl::flat_hash_map<std::string, int32_t> added_by_content;
  AddedMatcher raw_matcher, normalized_matcher;
  std::vector<NormalizerStep> normalizer;
  bool has_pre_tokenizer = false;
  std::vector<PreStep> pre;
  bool byte_level = false;  // any ByteLevel pre-tokenizer: raw bytes are tokenizable
  std::vector<int32_t> prefix_ids, suffix_ids;  // post-processor, single sequence
  bool has_decoder = false;
  std::vector<DecStep> decoder;
  // False when the decoder chain has position-dependent steps DecodeStream cannot split
  // exactly (Strip at the end of fused text, Metaspace after Fuse); the stream then holds
  // everything until Flush().
  bool stream_splittable = true;
  std::optional<int32_t> bos, eos;
  int vocab_size = 0;

  // Decodes `ids`. at_start=false decodes a continuation: the text that follows a clean
  // prefix (no start-of-text rules). *clean says whether the result may be split here.
  std::string Decode(absl::Span<const int32_t> ids, bool skip_special, bool at_start,
                     bool* clean) const;
  void EncodeText(std::string_view text, bool at_origin, std::vector<int32_t>* ids) const;
};

void Tokenizer::Impl::EncodeText(std::string_view text, bool at_origin,
                                 std::vector<int32_t>* ids) const {
  if (!has_pre_tokenizer) {
    bpe.Tokenize(text, ids);
    return;
  }
  std::vector<Piece> pieces;
  pieces.push_back({std::string(text), at_origin});
  for (const PreStep& st : pre) RunPreStep(st, &pieces);
  for (const Piece& p : pieces) bpe.Tokenize(p.text, ids);
}

std::string Tokenizer::Impl::Decode(absl::Span<const int32_t> ids, bool skip_special,
                                    bool at_start, bool* clean) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (auto it = added_by_id.find(id); it != added_by_id.end()) {
      if (skip_special && it->second->special) continue;
      tokens.push_back(it->second->content);
    } else if (id >= 0 && static_cast<size_t>(id) < bpe.has_id.size() && bpe.has_id[id]) {
      tokens.push_back(bpe.id_to_token[id]);
    }
  }
  *clean = true;
  std::string out;
  if (!has_decoder) {
    if (!at_start && !tokens.empty()) out = " ";
    out += absl::StrJoin(tokens, " ");
    *clean = !at_start || !tokens.empty();
    return out;
  }
  bool fused = false;
  for (const DecStep& st : decoder) {
    switch (st.kind) {
      case DecStep::kByteLevel: {
        const ByteMap& bm = Bytes();
        std::string bytes;
        for (const std::string& t : tokens) {
          const size_t mark = bytes.size();
          bool all = true;
          for (size_t pos = 0; pos < t.size() && all;) {
            const unicode::DecodedChar c = unicode::DecodeAt(t, pos);
            auto it = bm.char_to_byte.find(c.cp);
            if (it == bm.char_to_byte.end()) {
              all = false;
            } else {
              bytes.push_back(static_cast<char>(it->second));
            }
            pos += c.len;
          }
          if (!all) {
            bytes.resize(mark);
            bytes += t;
          }
        }
        if (unicode::IncompleteUtf8Suffix(bytes) != 0) *clean = false;
        tokens.assign(1, unicode::Utf8Lossy(bytes));
        fused = true;
        break;
      }
      case DecStep::kReplace:
        for (std::string& t : tokens) t = ReplaceAll(t, st.a, st.b);
        break;
      case DecStep::kByteFallback: {
        std::vector<std::string> next;
        std::string run;
        size_t run_len = 0;
        auto flush = [&]() {
          if (run_len == 0) return;
          if (unicode::IsValidUtf8(run)) {
            next.push_back(run);
          } else {
            for (size_t i = 0; i < run_len; ++i) next.push_back(CodePointUtf8(unicode::kReplacementChar));
          }
          run.clear();
          run_len = 0;
        };
        for (std::string& t : tokens) {
          if (std::optional<uint8_t> b = ByteFallbackValue(t)) {
            run.push_back(static_cast<char>(*b));
            ++run_len;
          } else {
            flush();
            next.push_back(std::move(t));
          }
        }
        if (run_len > 0) *clean = false;  // a following byte token could complete the run
        flush();
        tokens = std::move(next);
        break;
      }
      case DecStep::kFuse: {
        std::string all = absl::StrJoin(tokens, "");
        tokens.assign(1, std::move(all));
        fused = true;
        break;
      }
      case DecStep::kStrip:
        for (std::string& t : tokens) {
          std::vector<std::pair<size_t, uint32_t>> chars;  // (offset, cp)
          for (size_t pos = 0; pos < t.size();) {
            const unicode::DecodedChar c = unicode::DecodeAt(t, pos);
            chars.emplace_back(pos, c.cp);
            pos += c.len;
          }
          size_t lo = 0, hi = chars.size();
          if (at_start || !fused) {
            while (lo < chars.size() && lo < static_cast<size_t>(st.start) && chars[lo].second == st.ch) ++lo;
          }
          for (int64_t k = 0; k < st.stop && hi > lo && chars[hi - 1].second == st.ch; ++k) --hi;
          const size_t b = lo < chars.size() ? chars[lo].first : t.size();
          const size_t e = hi < chars.size() ? chars[hi].first : t.size();
          t = e > b ? t.substr(b, e - b) : std::string();
        }
        break;
      case DecStep::kMetaspace: {
        const std::string rep = CodePointUtf8(st.ch);
        for (size_t i = 0; i < tokens.size(); ++i) {
          const bool drop = i == 0 && at_start && !st.prepend_never;
          tokens[i] = ReplaceAll(tokens[i], rep, drop ? "" : " ");
        }
        break;
      }
    }
  }
  out = absl::StrJoin(tokens, "");
  if (at_start && out.empty()) *clean = false;  // start-of-text rules still pending
  return out;
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool add_special_tokens) const {
  const Impl& im = *impl_;
  std::string repaired;
  if (!im.byte_level && !unicode::IsValidUtf8(text)) {
    repaired = unicode::Utf8Lossy(text);
    text = repaired;
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (add_special_tokens) ids = im.prefix_ids;
  for (const Segment& seg : SplitOnAdded(text, im.raw_matcher)) {
    if (seg.token != nullptr) {
      ids.push_back(seg.token->id);
      continue;
    }
    const std::string_view raw = text.substr(seg.begin, seg.end - seg.begin);
    const bool at_origin = seg.begin == 0;
    std::string normalized = Normalize(im.normalizer, std::string(raw));
    for (const Segment& sub : SplitOnAdded(normalized, im.normalized_matcher)) {
      if (sub.token != nullptr) {
        ids.push_back(sub.token->id);
        continue;
      }
      im.EncodeText(std::string_view(normalized).substr(sub.begin, sub.end - sub.begin),
                    at_origin && sub.begin == 0, &ids);
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), im.suffix_ids.begin(), im.suffix_ids.end());
  return ids;
}

void Tokenizer::ClearEncodeCache() const { impl_->bpe.ClearCache(); }

std::string Tokenizer::Decode(absl::Span<const int32_t> ids, bool skip_special_tokens) const {
  bool clean;
  return impl_->Decode(ids, skip_special_tokens, /*at_start=*/true, &clean);
}

int Tokenizer::vocab_size() const { return impl_->vocab_size; }

bool Tokenizer::IsSpecial(int32_t id) const {
  auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && it->second->special;
}

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(A(token)); it != impl_->added_by_content.end()) {
    return it->second;
  }
  if (auto it = impl_->bpe.vocab.find(A(token)); it != impl_->bpe.vocab.end()) return it->second;
  return std::nullopt;
}

std::string Tokenizer::IdToToken(int32_t id) const {
  if (auto it = impl_->added_by_id.find(id); it != impl_->added_by_id.end()) {
    return it->second->content;
  }
  if (id >= 0 && static_cast<size_t>(id) < impl_->bpe.has_id.size() && impl_->bpe.has_id[id]) {
    return impl_->bpe.id_to_token[id];
  }
  return std::string();
}

std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos; }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos; }

// ---------------------------------------------------------------------------------------
// Loading.

namespace {

absl::Status ParseNormalizer(const Ctx& ctx, const json& j, const std::string& path,
                             std::vector<NormalizerStep>* out) {
  std::string type;
  SPECD_TOK_RETURN_IF_ERROR(ctx.Type(j, path, &type));
  if (type == "Sequence") {
    const json* list = ctx.Optional(j, "normalizers");
    if (list == nullptr || !list->is_array()) {
      return ctx.Error(path + ".normalizers", "must be an array");
    }
    for (size_t i = 0; i < list->size(); ++i) {
      SPECD_TOK_RETURN_IF_ERROR(
          ParseNormalizer(ctx, (*list)[i], absl::StrCat(path, ".normalizers[", i, "]"), out));
    }
    return absl::OkStatus();
  }
  NormalizerStep st;
  if (type == "Prepend") {
    st.kind = NormalizerStep::kPrepend;
    SPECD_TOK_RETURN_IF_ERROR(ctx.String(j, path, "prepend", &st.a));
  } else if (type == "Replace") {
    st.kind = NormalizerStep::kReplace;
    bool is_regex;
    SPECD_TOK_RETURN_IF_ERROR(ctx.Pattern(j, path, &st.a, &is_regex));
    if (is_regex && !IsLiteralRegex(st.a)) {
      return ctx.Error(path + ".pattern", absl::StrCat("unsupported regex \"", st.a, "\""));
    }
    SPECD_TOK_RETURN_IF_ERROR(ctx.String(j, path, "content", &st.b));
  } else if (type == "Strip") {
    st.kind = NormalizerStep::kStrip;
    SPECD_TOK_RETURN_IF_ERROR(ctx.Bool(j, path, "strip_left", &st.left, true));
    SPECD_TOK_RETURN_IF_ERROR(ctx.Bool(j, path, "strip_right", &st.right, true));
  } else if (type == "NFC") {
    st.kind = NormalizerStep::kNfc;
  } else if (type == "NFD") {
    st.kind = NormalizerStep::kNfd;
  } else {
    return ctx.Error(path + ".type", absl::StrCat("unsupported normalizer \"", type, "\""));
  }
  out->push_back(std::move(st));
  return absl::OkStatus();
}

absl::Status ParseBehavior(const Ctx& ctx, const json& j, const std::string& path,
                           Behavior* out) {
  std::string b;
  SPECD_TOK_RETURN_IF_ERROR(ctx.String(j, path, "behavior", &b));
  if (b == "Removed") {
    *out = Behavior::kRemoved;
  } else if (b == "Isolated") {
    *out = Behavior::kIsolated;
  } else if (b == "MergedWithPrevious") {
    *out = Behavior::kMergedWithPrevious;
  } else if (b == "MergedWithNext") {
    *out = Behavior::kMergedWithNext;
  } else if (b == "Contiguous") {
    *out = Behavior::kContiguous;
  } else {
    return ctx.Error(path + ".behavior", absl::StrCat("unknown behavior \"", b, "\""));
  }
  return absl::OkStatus();
}

absl::Status ParseMetaspaceChar(const Ctx& ctx, const json& j, const std::string& path,
                                uint32_t* out) {
  std::string rep = "\xE2\x96\x81";  // U+2581
  SPECD_TOK_RETURN_IF_ERROR(ctx.String(j, path, "replacement", &rep, /*required=*/false));
  std::optional<uint32_t> cp = SingleChar(rep);
  if (!cp) return ctx.Error(path + ".replacement", "must be a single character");
  *out = *cp;
  return absl::OkStatus();
}

// Metaspace's prepend_scheme, with the legacy add_prefix_space flag.
absl::Status ParsePrependScheme(const Ctx& ctx, const json& j, const std::string& path,
                                Prepend* out) {
  std::string scheme = "always";
  SPECD_TOK_RETURN_IF_ERROR(ctx.String(j, path, "prepend_scheme", &scheme, /*required=*/false));
  if (scheme == "always") {
    *out = Prepend::kAlways;
  } else if (scheme == "first") {
    *out = Prepend::kFirst;
  } else if (scheme == "never") {
    *out = Prepend::kNever;
  } else {
    return ctx.Error(path + ".prepend_scheme", absl::StrCat("unknown scheme \"", scheme, "\""));
  }
  if (const json* aps = ctx.Optional(j, "add_prefix_space"); aps != nullptr) {
    if (!aps->is_boolean()) return ctx.Error(path + ".add_prefix_space", "must be a boolean");
    if (!aps->get<bool>()) {
      if (*out != Prepend::kNever && ctx.Optional(j, "prepend_scheme") != nullptr) {
        return ctx.Error(path + ".add_prefix_space", "does not match prepend_scheme");
      }
      *out = Prepend::kNever;
    }
  }
  return absl::OkStatus();
}

absl::Status ParsePreTokenizer(const Ctx& ctx, const json& j, const std::string& path,
                               std::vector<PreStep>* out) {
  std::string type;
  SPECD_TOK_RETURN_IF_ERROR(ctx.Type(j, path, &type));
  if (type == "Sequence") {
    const json* list = ctx.Optional(j, "pretokenizers");
    if (list == nullptr || !list->is_array()) {
      return ctx.Error(path + ".pretokenizers", "must be an array");
    }
    for (size_t i = 0; i < list->size(); ++i) {
      SPECD_TOK_RETURN_IF_ERROR(ParsePreTokenizer(
          ctx, (*list)[i], absl::StrCat(path, ".pretokenizers[", i, "]"), out));
    }
    return absl::OkStatus();
  }
  PreStep st;
  if (type == "ByteLevel") {
    st.kind = PreStep::kByteLevel;
    SPECD_TOK_RETURN_IF_ERROR(ctx.Bool(j, path, "add_prefix_space", &st.add_prefix_space, true));
    SPECD_TOK_RETURN_IF_ERROR(ctx.Bool(j, path, "use_regex", &st.use_regex, true));
  } else if (type == "Split") {
    st.kind = PreStep::kSplit;
    std::string pattern;
    bool is_regex;
    SPECD_TOK_RETURN_IF_ERROR(ctx.Pattern(j, path, &pattern, &is_regex));
    if (is_regex) {
      st.regex = RecognizeSplitRegex(pattern);
      if (!st.regex) {
        if (!IsLiteralRegex(pattern)) {
          return ctx.Error(path + ".pattern",
                           absl::StrCat("unsupported split regex \"", pattern,
                                        "\" (supported: the GPT-2, Llama-3 and Qwen2 patterns)"));
        }
        st.literal = pattern;
      }
    } else {
      st.literal = pattern;
    }
    SPECD_TOK_RETURN_IF_ERROR(ParseBehavior(ctx, j, path, &st.behavior));
    SPECD_TOK_RETURN_IF_ERROR(ctx.Bool(j, path, "invert", &st.invert, false));
  } else if (type == "Metaspace") {
    st.kind = PreStep::kMetaspace;
    SPECD_TOK_RETURN_IF_ERROR(ParseMetaspaceChar(ctx, j, path, &st.replacement));
    SPECD_TOK_RETURN_IF_ERROR(ParsePrependScheme(ctx, j, path, &st.prepend));
    SPECD_TOK_RETURN_IF_ERROR(ctx.Bool(j, path, "split", &st.split, true));
  } else if (type == "Digits") {
    st.kind = PreStep::kDigits;
    SPECD_TOK_RETURN_IF_ERROR(ctx.Bool(j, path, "individual_digits", &st.individual_digits, false));
  } else if (type == "WhitespaceSplit") {
    st.kind = PreStep::kWhitespaceSplit;
  } else {
    return ctx.Error(path + ".type", absl::StrCat("unsupported pre-tokenizer \"", type, "\""));
  }
  out->push_back(std::move(st));
  return absl::OkStatus();
}

absl::Status ParseDecoder(const Ctx& ctx, const json& j, const std::string& path,
                          std::vector<DecStep>* out) {
  std::string type;
  SPECD_TOK_RETURN_IF_ERROR(ctx.Type(j, path, &type));
  if (type == "Sequence") {
    const json* list = ctx.Optional(j, "decoders");
    if (list == nullptr || !list->is_array()) return ctx.Error(path + ".decoders", "must be an array");
    for (size_t i = 0; i < list->size(); ++i) {
      SPECD_TOK_RETURN_IF_ERROR(
          ParseDecoder(ctx, (*list)[i], absl::StrCat(path, ".decoders[", i, "]"), out));
    }
    return absl::OkStatus();
  }
  DecStep st;
  if (type == "ByteLevel") {
    st.kind = DecStep::kByteLevel;
  } else if (type == "Replace") {
    st.kind = DecStep::kReplace;
    bool is_regex;
    SPECD_TOK_RETURN_IF_ERROR(ctx.Pattern(j, path, &st.a, &is_regex));
    if (is_regex && !IsLiteralRegex(st.a)) {
      return ctx.Error(path + ".pattern", absl::StrCat("unsupported regex \"", st.a, "\""));
    }
    SPECD_TOK_RETURN_IF_ERROR(ctx.String(j, path, "content", &st.b));
  } else if (type == "ByteFallback") {
    st.kind = DecStep::kByteFallback;
  } else if (type == "Fuse") {
    st.kind = DecStep::kFuse;
  } else if (type == "Strip") {
    st.kind = DecStep::kStrip;
    std::string content;
    SPECD_TOK_RETURN_IF_ERROR(ctx.String(j, path, "content", &content));
    std::optional<uint32_t> cp = SingleChar(content);
    if (!cp) return ctx.Error(path + ".content", "must be a single character");
    st.ch = *cp;
    SPECD_TOK_RETURN_IF_ERROR(ctx.Int(j, path, "start", &st.start, 0));
    SPECD_TOK_RETURN_IF_ERROR(ctx.Int(j, path, "stop", &st.stop, 0));
    if (st.start < 0 || st.stop < 0) return ctx.Error(path + ".start", "must be >= 0");
  } else if (type == "Metaspace") {
    st.kind = DecStep::kMetaspace;
    SPECD_TOK_RETURN_IF_ERROR(ParseMetaspaceChar(ctx, j, path, &st.ch));
    Prepend p;
    SPECD_TOK_RETURN_IF_ERROR(ParsePrependScheme(ctx, j, path, &p));
    st.prepend_never = p == Prepend::kNever;
  } else {
    return ctx.Error(path + ".type", absl::StrCat("unsupported decoder \"", type, "\""));
  }
  out->push_back(std::move(st));
  return absl::OkStatus();
}

// Ids of a special token named in a processor: ["<s>", 1] pairs or TemplateProcessing's
// special_tokens entries.
absl::Status ParsePostProcessor(const Ctx& ctx, const json& j, const std::string& path,
                                std::vector<int32_t>* prefix, std::vector<int32_t>* suffix) {
  std::string type;
  SPECD_TOK_RETURN_IF_ERROR(ctx.Type(j, path, &type));
  if (type == "Sequence") {
    const json* list = ctx.Optional(j, "processors");
    if (list == nullptr || !list->is_array()) {
      return ctx.Error(path + ".processors", "must be an array");
    }
    for (size_t i = 0; i < list->size(); ++i) {
      SPECD_TOK_RETURN_IF_ERROR(ParsePostProcessor(
          ctx, (*list)[i], absl::StrCat(path, ".processors[", i, "]"), prefix, suffix));
    }
    return absl::OkStatus();
  }
  if (type == "ByteLevel") return absl::OkStatus();  // offsets only
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    auto id_of = [&](const char* key, int32_t* id) -> absl::Status {
      const json* v = ctx.Optional(j, key);
      if (v == nullptr || !v->is_array() || v->size() != 2 || !(*v)[1].is_number_integer()) {
        return ctx.Error(absl::StrCat(A(path), ".", A(key)), "must be [token, id]");
      }
      *id = (*v)[1].get<int32_t>();
      return absl::OkStatus();
    };
    int32_t cls, sep;
    SPECD_TOK_RETURN_IF_ERROR(id_of("cls", &cls));
    SPECD_TOK_RETURN_IF_ERROR(id_of("sep", &sep));
    prefix->push_back(cls);
    suffix->insert(suffix->begin(), sep);
    return absl::OkStatus();
  }
  if (type == "TemplateProcessing") {
    const json* single = ctx.Optional(j, "single");
    if (single == nullptr || !single->is_array()) return ctx.Error(path + ".single", "must be an array");
    const json* specials = ctx.Optional(j, "special_tokens");
    std::vector<int32_t> pre, post;
    bool seen_sequence = false;
    for (size_t i = 0; i < single->size(); ++i) {
      const json& piece = (*single)[i];
      const std::string ppath = absl::StrCat(path, ".single[", i, "]");
      if (piece.is_object() && piece.contains("Sequence")) {
        if (seen_sequence) return ctx.Error(ppath, "more than one sequence in a single template");
        seen_sequence = true;
        continue;
      }
      const json* st = piece.is_object() ? ctx.Optional(piece, "SpecialToken") : nullptr;
      if (st == nullptr || !st->is_object()) {
        return ctx.Error(ppath, "must be {\"Sequence\": ...} or {\"SpecialToken\": ...}");
      }
      std::string name;
      SPECD_TOK_RETURN_IF_ERROR(ctx.String(*st, ppath + ".SpecialToken", "id", &name));
      const json* entry = specials != nullptr && specials->is_object() ? ctx.Optional(*specials, name)
                                                                       : nullptr;
      const json* ids = entry != nullptr && entry->is_object() ? ctx.Optional(*entry, "ids") : nullptr;
      if (ids == nullptr || !ids->is_array()) {
        return ctx.Error(absl::StrCat(path, ".special_tokens.", name, ".ids"),
                         "missing (the template names this token)");
      }
      for (const json& id : *ids) {
        if (!id.is_number_integer()) {
          return ctx.Error(absl::StrCat(path, ".special_tokens.", name, ".ids"),
                           "must hold integers");
        }
        (seen_sequence ? post : pre).push_back(id.get<int32_t>());
      }
    }
    prefix->insert(prefix->end(), pre.begin(), pre.end());
    suffix->insert(suffix->begin(), post.begin(), post.end());
    return absl::OkStatus();
  }
  return ctx.Error(path + ".type", absl::StrCat("unsupported post-processor \"", type, "\""));
}

absl::Status ParseModel(const Ctx& ctx, const json& j, Bpe* bpe) {
  if (!j.is_object()) return ctx.Error("model", "must be an object");
  std::string type = "BPE";
  SPECD_TOK_RETURN_IF_ERROR(ctx.String(j, "model", "type", &type, /*required=*/false));
  if (type != "BPE") {
    return ctx.Error("model.type", absl::StrCat("unsupported model \"", type, "\" (only BPE)"));
  }
  const json* vocab = ctx.Optional(j, "vocab");
  if (vocab == nullptr || !vocab->is_object()) return ctx.Error("model.vocab", "must be an object");
  int64_t max_id = -1;
  bpe->vocab.reserve(vocab->size());
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    if (!it.value().is_number_integer()) {
      return ctx.Error(absl::StrCat("model.vocab[\"", it.key(), "\"]"), "must be an integer id");
    }
    const int64_t id = it.value().get<int64_t>();
    if (id < 0 || id > kMaxTokenId) {
      return ctx.Error(absl::StrCat("model.vocab[\"", it.key(), "\"]"),
                       absl::StrCat("id ", id, " out of range [0, ", kMaxTokenId, "]"));
    }
    bpe->vocab[it.key()] = static_cast<int32_t>(id);
    max_id = std::max(max_id, id);
  }
  bpe->id_to_token.assign(max_id + 1, std::string());
  bpe->has_id.assign(max_id + 1, false);
  for (const auto& [token, id] : bpe->vocab) {
    bpe->id_to_token[id] = token;
    bpe->has_id[id] = true;
  }

  std::string unk;
  SPECD_TOK_RETURN_IF_ERROR(ctx.String(j, "model", "unk_token", &unk, /*required=*/false));
  if (!unk.empty()) {
    auto it = bpe->vocab.find(unk);
    if (it == bpe->vocab.end()) return ctx.Error("model.unk_token", "not in model.vocab");
    bpe->unk_id = it->second;
  }
  SPECD_TOK_RETURN_IF_ERROR(ctx.String(j, "model", "continuing_subword_prefix",
                                       &bpe->continuing_subword_prefix, /*required=*/false));
  SPECD_TOK_RETURN_IF_ERROR(
      ctx.String(j, "model", "end_of_word_suffix", &bpe->end_of_word_suffix, /*required=*/false));
  SPECD_TOK_RETURN_IF_ERROR(ctx.Bool(j, "model", "fuse_unk", &bpe->fuse_unk, false));
  SPECD_TOK_RETURN_IF_ERROR(ctx.Bool(j, "model", "byte_fallback", &bpe->byte_fallback, false));
  SPECD_TOK_RETURN_IF_ERROR(ctx.Bool(j, "model", "ignore_merges", &bpe->ignore_merges, false));
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    auto it = bpe->vocab.find(name);
    bpe->byte_ids[b] = it == bpe->vocab.end() ? -1 : it->second;
  }

  const json* merges = ctx.Optional(j, "merges");
  if (merges == nullptr) return ctx.Error("model.merges", "missing");
  if (!merges->is_array()) return ctx.Error("model.merges", "must be an array");
  bpe->merges.reserve(merges->size());
  const size_t prefix_len = bpe->continuing_subword_prefix.size();
  int32_t rank = 0;
  for (size_t i = 0; i < merges->size(); ++i) {
    const json& m = (*merges)[i];
    const std::string field = absl::StrCat("model.merges[", i, "]");
    std::string a, b;
    if (m.is_string()) {
      const std::string line = m.get<std::string>();
      if (StartsWith(line, "#version")) continue;
      const size_t sp = line.find(' ');
      if (sp == std::string::npos || line.find(' ', sp + 1) != std::string::npos) {
        return ctx.Error(field, absl::StrCat("\"", line, "\" is not two tokens separated by one space"));
      }
      a = line.substr(0, sp);
      b = line.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      return ctx.Error(field, "must be \"a b\" or [\"a\", \"b\"]");
    }
    auto ia = bpe->vocab.find(a), ib = bpe->vocab.find(b);
    if (ia == bpe->vocab.end()) return ctx.Error(field, absl::StrCat("token \"", a, "\" not in model.vocab"));
    if (ib == bpe->vocab.end()) return ctx.Error(field, absl::StrCat("token \"", b, "\" not in model.vocab"));
    if (b.size() < prefix_len) {
      return ctx.Error(field, "second token shorter than continuing_subword_prefix");
    }
    const std::string merged = a + b.substr(prefix_len);
    auto im = bpe->vocab.find(merged);
    if (im == bpe->vocab.end()) {
      return ctx.Error(field, absl::StrCat("merged token \"", merged, "\" not in model.vocab"));
    }
    bpe->merges[Bpe::Key(ia->second, ib->second)] = {rank, im->second};
    ++rank;
  }
  return absl::OkStatus();
}

// "bos_token": "<s>" or {"content": "<s>", ...}.
std::optional<std::string> ConfigToken(const json& cfg, const char* key) {
  auto it = cfg.find(key);
  if (it == cfg.end()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto c = it->find("content");
    if (c != it->end() && c->is_string()) return c->get<std::string>();
  }
  return std::nullopt;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read error"));
  return ss.str();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(std::string_view text,
                                                                std::string_view source,
                                                                std::string_view config_json,
                                                                std::string_view config_source) {
  const Ctx ctx{std::string(source)};
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(A(source), ": not valid JSON"));
  }
  if (!j.is_object()) return ctx.Error("(root)", "must be an object");
  auto impl = std::make_unique<Impl>();

  const json* model = ctx.Optional(j, "model");
  if (model == nullptr) return ctx.Error("model", "missing");
  SPECD_TOK_RETURN_IF_ERROR(ParseModel(ctx, *model, &impl->bpe));

  if (const json* n = ctx.Optional(j, "normalizer")) {
    SPECD_TOK_RETURN_IF_ERROR(ParseNormalizer(ctx, *n, "normalizer", &impl->normalizer));
  }
  if (const json* p = ctx.Optional(j, "pre_tokenizer")) {
    impl->has_pre_tokenizer = true;
    SPECD_TOK_RETURN_IF_ERROR(ParsePreTokenizer(ctx, *p, "pre_tokenizer", &impl->pre));
    for (const PreStep& st : impl->pre) impl->byte_level |= st.kind == PreStep::kByteLevel;
  }
  if (const json* d = ctx.Optional(j, "decoder")) {
    impl->has_decoder = true;
    SPECD_TOK_RETURN_IF_ERROR(ParseDecoder(ctx, *d, "decoder", &impl->decoder));
    bool fused = false;
    for (const DecStep& st : impl->decoder) {
      if (st.kind == DecStep::kFuse || st.kind == DecStep::kByteLevel) fused = true;
      if (fused && st.kind == DecStep::kMetaspace) impl->stream_splittable = false;
      if (fused && st.kind == DecStep::kStrip && st.stop > 0) impl->stream_splittable = false;
    }
  }
  if (const json* pp = ctx.Optional(j, "post_processor")) {
    SPECD_TOK_RETURN_IF_ERROR(
        ParsePostProcessor(ctx, *pp, "post_processor", &impl->prefix_ids, &impl->suffix_ids));
  }

  int64_t max_id = static_cast<int64_t>(impl->bpe.id_to_token.size()) - 1;
  if (const json* added = ctx.Optional(j, "added_tokens")) {
    if (!added->is_array()) return ctx.Error("added_tokens", "must be an array");
    for (size_t i = 0; i < added->size(); ++i) {
      const json& a = (*added)[i];
      const std::string path = absl::StrCat("added_tokens[", i, "]");
      if (!a.is_object()) return ctx.Error(path, "must be an object");
      AddedToken t;
      int64_t id;
      SPECD_TOK_RETURN_IF_ERROR(ctx.Int(a, path, "id", &id, -1));
      if (id < 0 || id > kMaxTokenId) {
        return ctx.Error(path + ".id", absl::StrCat("missing or out of range [0, ", kMaxTokenId, "]"));
      }
      t.id = static_cast<int32_t>(id);
      SPECD_TOK_RETURN_IF_ERROR(ctx.String(a, path, "content", &t.content));
      if (t.content.empty()) return ctx.Error(path + ".content", "must not be empty");
      SPECD_TOK_RETURN_IF_ERROR(ctx.Bool(a, path, "special", &t.special, false));
      SPECD_TOK_RETURN_IF_ERROR(ctx.Bool(a, path, "single_word", &t.single_word, false));
      SPECD_TOK_RETURN_IF_ERROR(ctx.Bool(a, path, "lstrip", &t.lstrip, false));
      SPECD_TOK_RETURN_IF_ERROR(ctx.Bool(a, path, "rstrip", &t.rstrip, false));
      SPECD_TOK_RETURN_IF_ERROR(ctx.Bool(a, path, "normalized", &t.normalized, !t.special));
      t.pattern = t.normalized ? Normalize(impl->normalizer, t.content) : t.content;
      max_id = std::max(max_id, id);
      impl->added.push_back(std::move(t));
    }
  }
  // Pointers into `added` are taken only now that it no longer grows.
  for (const AddedToken& t : impl->added) {
    impl->added_by_id[t.id] = &t;
    impl->added_by_content[t.content] = t.id;
  }
  impl->raw_matcher.Build(impl->added, /*normalized=*/false);
  impl->normalized_matcher.Build(impl->added, /*normalized=*/true);
  impl->vocab_size = static_cast<int>(max_id + 1);
  for (int32_t id : impl->prefix_ids) impl->vocab_size = std::max(impl->vocab_size, id + 1);
  for (int32_t id : impl->suffix_ids) impl->vocab_size = std::max(impl->vocab_size, id + 1);

  std::unique_ptr<Tokenizer> tok(new Tokenizer(std::move(impl)));
  if (!config_json.empty()) {
    const std::string cfg_source(config_source);
    json cfg = json::parse(config_json.begin(), config_json.end(), nullptr, false);
    if (cfg.is_discarded() || !cfg.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(cfg_source, ": not a valid JSON object"));
    }
    const Ctx cctx{cfg_source};
    Impl& im = *tok->impl_;
    if (auto bos = ConfigToken(cfg, "bos_token")) im.bos = tok->TokenToId(*bos);
    if (auto eos = ConfigToken(cfg, "eos_token")) im.eos = tok->TokenToId(*eos);
    const json* add_bos = cctx.Optional(cfg, "add_bos_token");
    const json* add_eos = cctx.Optional(cfg, "add_eos_token");
    if (add_bos != nullptr || add_eos != nullptr) {
      // As transformers' Llama tokenizers: explicit flags replace the template.
      bool b, e;
      SPECD_TOK_RETURN_IF_ERROR(cctx.Bool(cfg, "(root)", "add_bos_token", &b, false));
      SPECD_TOK_RETURN_IF_ERROR(cctx.Bool(cfg, "(root)", "add_eos_token", &e, false));
      if (b && !im.bos) return cctx.Error("bos_token", "add_bos_token is set but bos_token is not a known token");
      if (e && !im.eos) return cctx.Error("eos_token", "add_eos_token is set but eos_token is not a known token");
      im.prefix_ids.clear();
      im.suffix_ids.clear();
      if (b) im.prefix_ids.push_back(*im.bos);
      if (e) im.suffix_ids.push_back(*im.eos);
    }
  }
  return tok;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return text.status();
  std::string config;
  const std::filesystem::path cfg_path =
      std::filesystem::path(path).parent_path() / "tokenizer_config.json";
  std::error_code ec;
  if (std::filesystem::exists(cfg_path, ec)) {
    absl::StatusOr<std::string> c = ReadFile(cfg_path.string());
    if (!c.ok()) return c.status();
    config = std::move(*c);
    if (config.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(cfg_path.string(), ": empty file"));
    }
  }
  return FromJson(*text, path, config, cfg_path.string());
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromModelDir(const std::string& dir) {
  return FromFile((std::filesystem::path(dir) / "tokenizer.json").string());
}

// ---------------------------------------------------------------------------------------

DecodeStream::DecodeStream(const Tokenizer* tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

std::string DecodeStream::Push(absl::Span<const int32_t> ids) {
  const Tokenizer::Impl& im = *tokenizer_->impl_;
  std::string out;
  for (int32_t id : ids) {
    window_.push_back(id);
    if (!im.stream_splittable) continue;
    bool clean;
    std::string text = im.Decode(window_, skip_special_tokens_, at_start_, &clean);
    if (!clean) continue;
    out += text;
    window_.clear();
    at_start_ = false;
  }
  return out;
}

std::string DecodeStream::Flush() {
  bool clean;
  std::string text =
      tokenizer_->impl_->Decode(window_, skip_special_tokens_, at_start_, &clean);
  window_.clear();
  if (!text.empty()) at_start_ = false;
  return text;
}

#undef SPECD_TOK_RETURN_IF_ERROR

}  // namespace specd
