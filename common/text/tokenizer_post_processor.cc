#include "common/text/tokenizer_post_processor.h"

#include "absl/strings/str_cat.h"

namespace specd::tokenizer_internal {

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
    if (single == nullptr || !single->is_array())
      return ctx.Error(path + ".single", "must be an array");
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
      const json* entry =
          specials != nullptr && specials->is_object() ? ctx.Optional(*specials, name) : nullptr;
      const json* ids =
          entry != nullptr && entry->is_object() ? ctx.Optional(*entry, "ids") : nullptr;
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

}  // namespace specd::tokenizer_internal
