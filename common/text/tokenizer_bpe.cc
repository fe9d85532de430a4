#include "common/text/tokenizer_bpe.h"

#include <algorithm>
#include <cstdio>
#include <queue>

#include "absl/strings/str_cat.h"
#include "common/text/unicode.h"

namespace specd::tokenizer_internal {

void Bpe::Tokenize(std::string_view word, std::vector<int32_t>* out) const {
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

std::vector<int32_t> Bpe::MergeWord(std::string_view w) const {
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
        return ctx.Error(field,
                         absl::StrCat("\"", line, "\" is not two tokens separated by one space"));
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
    if (ia == bpe->vocab.end())
      return ctx.Error(field, absl::StrCat("token \"", a, "\" not in model.vocab"));
    if (ib == bpe->vocab.end())
      return ctx.Error(field, absl::StrCat("token \"", b, "\" not in model.vocab"));
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

}  // namespace specd::tokenizer_internal
