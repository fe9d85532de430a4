#include "common/text/tokenizer_normalizer.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/text/unicode.h"

namespace specd::tokenizer_internal {

std::string Normalize(const std::vector<NormalizerStep>& steps, std::string s) {
  for (const NormalizerStep& st : steps) {
    if (s.empty()) break;  // every supported normalizer maps "" to ""
    switch (st.kind) {
      case NormalizerStep::kPrepend: s = st.a + s; break;
      case NormalizerStep::kReplace: s = ReplaceAll(s, st.a, st.b); break;
      case NormalizerStep::kStrip: {
        size_t b = st.left ? LeadingSpaceBytes(s) : 0;
        size_t e = st.right ? TrailingSpaceStart(s) : s.size();
        s = e > b ? s.substr(b, e - b) : std::string();
        break;
      }
      case NormalizerStep::kNfc: s = unicode::Nfc(s); break;
      case NormalizerStep::kNfd: s = unicode::Nfd(s); break;
    }
  }
  return s;
}

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

}  // namespace specd::tokenizer_internal
