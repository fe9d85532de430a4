#include "common/text/tokenizer_pre_tokenizer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/text/unicode.h"

namespace specd::tokenizer_internal {

namespace {

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

void Emit(const Piece& parent, std::string_view text,
          const std::vector<std::pair<size_t, size_t>>& ranges, std::vector<Piece>* out) {
  for (const auto& [b, e] : ranges) {
    if (e > b) out->push_back({std::string(text.substr(b, e - b)), parent.at_origin && b == 0});
  }
}

}  // namespace

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

absl::Status ParseBehavior(const Ctx& ctx, const json& j, const std::string& path, Behavior* out) {
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
      SPECD_TOK_RETURN_IF_ERROR(
          ParsePreTokenizer(ctx, (*list)[i], absl::StrCat(path, ".pretokenizers[", i, "]"), out));
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

}  // namespace specd::tokenizer_internal
