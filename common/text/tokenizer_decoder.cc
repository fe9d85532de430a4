#include "common/text/tokenizer_decoder.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/text/tokenizer_pre_tokenizer.h"
#include "common/text/unicode.h"

namespace specd::tokenizer_internal {

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

std::string RunDecoder(const std::vector<DecStep>& decoder, std::vector<std::string> tokens,
                       bool at_start, bool* clean) {
  *clean = true;
  std::string out;
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
            for (size_t i = 0; i < run_len; ++i)
              next.push_back(CodePointUtf8(unicode::kReplacementChar));
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
            while (lo < chars.size() && lo < static_cast<size_t>(st.start) &&
                   chars[lo].second == st.ch)
              ++lo;
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

absl::Status ParseDecoder(const Ctx& ctx, const json& j, const std::string& path,
                          std::vector<DecStep>* out) {
  std::string type;
  SPECD_TOK_RETURN_IF_ERROR(ctx.Type(j, path, &type));
  if (type == "Sequence") {
    const json* list = ctx.Optional(j, "decoders");
    if (list == nullptr || !list->is_array())
      return ctx.Error(path + ".decoders", "must be an array");
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

}  // namespace specd::tokenizer_internal
