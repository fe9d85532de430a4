// Hugging Face `tokenizer.json` in C++: BPE models with the pipelines that real checkpoints
// use, reproducing the `tokenizers` library (0.2x) token for token.
//
// Supported (anything else is rejected at load time with INVALID_ARGUMENT):
//   normalizer:     Sequence, Prepend, Replace (literal patterns), Strip, NFC, NFD
//   pre_tokenizer:  Sequence, ByteLevel, Split (literal patterns and the GPT-2, Llama-3 and
//                   Qwen2 regexes, matched by hand: common/text/pretokenizer.h), Metaspace,
//                   Digits, WhitespaceSplit
//   model:          BPE (merges as "a b" strings or [a, b] pairs; byte_fallback, unk_token,
//                   fuse_unk, ignore_merges, continuing_subword_prefix, end_of_word_suffix;
//                   dropout is ignored: inference is deterministic)
//   post_processor: TemplateProcessing, ByteLevel, RobertaProcessing, BertProcessing, Sequence
//   decoder:        ByteLevel, Metaspace, Replace (literal), ByteFallback, Fuse, Strip, Sequence
// Added tokens are matched in the raw text (normalized=false) or in the normalized text
// (normalized=true) before pre-tokenization, honouring lstrip, rstrip and single_word.
#ifndef SPECD_COMMON_TEXT_TOKENIZER_H_
#define SPECD_COMMON_TEXT_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace specd {

class Tokenizer {
 public:
  // Loads a tokenizer.json; a tokenizer_config.json in the same folder, if present,
  // supplies bos/eos tokens and add_bos_token/add_eos_token (see add_special_tokens below).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromFile(
      const std::string& tokenizer_json_path);
  // Loads dir/tokenizer.json (and dir/tokenizer_config.json if present).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromModelDir(const std::string& dir);
  // Parses tokenizer.json text; `source` names it in errors. `config_json` is the text of a
  // tokenizer_config.json (named `config_source` in errors), or empty.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(
      std::string_view json, std::string_view source = "tokenizer.json",
      std::string_view config_json = {}, std::string_view config_source = "tokenizer_config.json");

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Token ids of `text`. Never fails: text that is not valid UTF-8 is tokenized byte for
  // byte by byte-level tokenizers and with U+FFFD replacements by the others.
  // add_special_tokens applies the post-processor template (for example a BOS token). When
  // tokenizer_config.json sets add_bos_token or add_eos_token, those flags decide instead,
  // as transformers' Llama tokenizers do.
  std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens = false) const;

  // Forgets the words Encode memoized (a bounded cache that grows with the distinct words
  // seen), so that the next call starts from the state after loading. For the fuzzer: its
  // leak check takes memory kept across inputs for a leak, and an input's run must not depend
  // on the inputs before it.
  void ClearEncodeCache() const;

  // Text of `ids`, as Hugging Face decodes it (invalid UTF-8 from byte tokens becomes
  // U+FFFD). Ids outside the vocabulary are skipped.
  std::string Decode(absl::Span<const int32_t> ids, bool skip_special_tokens = false) const;

  // Largest id of the model vocabulary and the added tokens, plus one.
  int vocab_size() const;
  // True for added tokens marked special (skipped by skip_special_tokens).
  bool IsSpecial(int32_t id) const;
  std::optional<int32_t> TokenToId(std::string_view token) const;
  // The vocabulary string of `id` (e.g. "Ġthe", "<0x0A>"); empty if there is none.
  std::string IdToToken(int32_t id) const;

  // From tokenizer_config.json (bos_token / eos_token), when present and in the vocabulary.
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;

 private:
  friend class DecodeStream;
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);

  std::unique_ptr<Impl> impl_;
};

// Incremental detokenizer for streaming. Push() returns only newly completed text: a
// multi-byte UTF-8 character split across tokens is emitted whole, exactly once, and
// leading-space rules (Metaspace, Strip) are applied as the full Decode applies them.
// Invariant: the concatenation of every Push() result and a final Flush() equals
// Decode(all ids) with the same skip_special_tokens.
//
// How: ids are held in a window until the window ends at a "clean" point (no incomplete
// UTF-8 sequence, no open run of <0xNN> byte-fallback tokens, start-of-text rules
// resolved); decoding then splits exactly there, so the window's text is final and the
// window restarts. Cost per token is O(window), normally one token.
class DecodeStream {
 public:
  explicit DecodeStream(const Tokenizer* tokenizer, bool skip_special_tokens = false);

  std::string Push(absl::Span<const int32_t> ids);
  std::string Push(int32_t id) { return Push(absl::MakeConstSpan(&id, 1)); }
  // Emits whatever is held back (e.g. an incomplete character at the end of generation, as
  // U+FFFD, exactly as Decode would) and resets the window.
  std::string Flush();

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  bool at_start_ = true;
  std::vector<int32_t> window_;
};

}  // namespace specd

#endif  // SPECD_COMMON_TEXT_TOKENIZER_H_
