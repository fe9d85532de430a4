#include "common/text/tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/text/tokenizer_added.h"
#include "common/text/tokenizer_bpe.h"
#include "common/text/tokenizer_decoder.h"
#include "common/text/tokenizer_normalizer.h"
#include "common/text/tokenizer_post_processor.h"
#include "common/text/tokenizer_pre_tokenizer.h"
#include "common/text/tokenizer_util.h"
#include "common/text/unicode.h"

namespace specd {

// The pipeline's stages live in tokenizer_{normalizer,pre_tokenizer,bpe,post_processor,
// decoder,added}.cc; this file assembles them and loads tokenizer.json.
using tokenizer_internal::A;
using tokenizer_internal::AddedMatcher;
using tokenizer_internal::AddedToken;
using tokenizer_internal::Bpe;
using tokenizer_internal::Ctx;
using tokenizer_internal::DecStep;
using tokenizer_internal::json;
using tokenizer_internal::kMaxTokenId;
using tokenizer_internal::Normalize;
using tokenizer_internal::NormalizerStep;
using tokenizer_internal::ParseDecoder;
using tokenizer_internal::ParseModel;
using tokenizer_internal::ParseNormalizer;
using tokenizer_internal::ParsePostProcessor;
using tokenizer_internal::ParsePreTokenizer;
using tokenizer_internal::Piece;
using tokenizer_internal::PreStep;
using tokenizer_internal::RunDecoder;
using tokenizer_internal::RunPreStep;
using tokenizer_internal::Segment;
using tokenizer_internal::SplitOnAdded;

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

std::string Tokenizer::Impl::Decode(absl::Span<const int32_t> ids, bool skip_special, bool at_start,
                                    bool* clean) const {
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
  return RunDecoder(decoder, std::move(tokens), at_start, clean);
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
        return ctx.Error(path + ".id",
                         absl::StrCat("missing or out of range [0, ", kMaxTokenId, "]"));
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
      if (b && !im.bos)
        return cctx.Error("bos_token", "add_bos_token is set but bos_token is not a known token");
      if (e && !im.eos)
        return cctx.Error("eos_token", "add_eos_token is set but eos_token is not a known token");
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
  std::string text = tokenizer_->impl_->Decode(window_, skip_special_tokens_, at_start_, &clean);
  window_.clear();
  if (!text.empty()) at_start_ = false;
  return text;
}

}  // namespace specd