// Unit tests of the tokenizer with small hand-made tokenizer.json files whose results are
// worked out by hand in the comments. tokenizer_fixture_test.cc compares against the
// Hugging Face library itself.
#include "common/text/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "common/text/pretokenizer.h"
#include "common/text/unicode.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

using json = nlohmann::json;
using Ids = std::vector<int32_t>;

// ---------------------------------------------------------------------------------------
// Split patterns, character by character.

std::vector<std::string> Pieces(SplitRegex p, const std::string& text) {
  std::vector<std::string> out;
  size_t prev = 0;
  for (const auto& [b, e] : FindSplitMatches(p, text)) {
    EXPECT_EQ(b, prev) << "gap before a match in \"" << text << "\"";
    out.push_back(text.substr(b, e - b));
    prev = e;
  }
  EXPECT_EQ(prev, text.size()) << "text not covered: \"" << text << "\"";
  return out;
}

using V = std::vector<std::string>;

TEST(SplitRegexTest, RecognisesKnownPatternsOnly) {
  for (SplitRegex p : {SplitRegex::kGpt2, SplitRegex::kLlama3, SplitRegex::kQwen2}) {
    EXPECT_EQ(RecognizeSplitRegex(SplitRegexSource(p)), p);
  }
  EXPECT_FALSE(RecognizeSplitRegex(R"(\s+|\w+)").has_value());
}

TEST(SplitRegexTest, Gpt2) {
  const SplitRegex p = SplitRegex::kGpt2;
  EXPECT_EQ(Pieces(p, "Hello world"), (V{"Hello", " world"}));
  // A space run gives its last space to the following word: \s+(?!\S) backs off one.
  EXPECT_EQ(Pieces(p, "a   b"), (V{"a", "  ", " b"}));
  EXPECT_EQ(Pieces(p, "\n\n  x"), (V{"\n\n ", " x"}));
  EXPECT_EQ(Pieces(p, "x   "), (V{"x", "   "}));  // at the end the run stays whole
  // GPT-2's contractions are case-sensitive: "'M" is punctuation then a letter.
  EXPECT_EQ(Pieces(p, "I'M"), (V{"I", "'", "M"}));
  EXPECT_EQ(Pieces(p, "I'm don't"), (V{"I", "'m", " don", "'t"}));
  EXPECT_EQ(Pieces(p, "12345 67"), (V{"12345", " 67"}));
  EXPECT_EQ(Pieces(p, "中文 字"), (V{"中文", " 字"}));
  // Emoji are symbols (So), a combining mark is not a letter.
  EXPECT_EQ(Pieces(p, "😀😀 x"), (V{"😀😀", " x"}));
  EXPECT_EQ(Pieces(p, "e\u0301t"), (V{"e", "\u0301", "t"}));
  // U+00A0 is White_Space; one space before a letter is not taken by \s+(?!\S).
  EXPECT_EQ(Pieces(p, "a\u00a0b"), (V{"a", "\u00a0", "b"}));
  EXPECT_EQ(Pieces(p, " ?! x"), (V{" ?!", " x"}));
}

TEST(SplitRegexTest, Llama3) {
  const SplitRegex p = SplitRegex::kLlama3;
  EXPECT_EQ(Pieces(p, "I'M"), (V{"I", "'M"}));       // (?i:...) contractions
  EXPECT_EQ(Pieces(p, "'sup"), (V{"'s", "up"}));     // first alternative wins
  EXPECT_EQ(Pieces(p, "12345"), (V{"123", "45"}));   // \p{N}{1,3}
  // \s*[\r\n]+ takes the run up to its last line break; then \s+(?!\S) leaves one space.
  EXPECT_EQ(Pieces(p, "\n\n  x"), (V{"\n\n", " ", " x"}));
  EXPECT_EQ(Pieces(p, "hello  world"), (V{"hello", " ", " world"}));
  // [^\r\n\p{L}\p{N}]?\p{L}+ glues one leading non-letter (punctuation, tab) to a word.
  EXPECT_EQ(Pieces(p, "(hello)"), (V{"(hello", ")"}));
  EXPECT_EQ(Pieces(p, "\tx"), (V{"\tx"}));
  // Punctuation takes the line breaks that follow it.
  EXPECT_EQ(Pieces(p, "x,\n\ny"), (V{"x", ",\n\n", "y"}));
  EXPECT_EQ(Pieces(p, "trailing   "), (V{"trailing", "   "}));
  EXPECT_EQ(Pieces(p, "a \r\n b"), (V{"a", " \r\n", " b"}));
  // The long s folds to 's' under (?i).
  EXPECT_EQ(Pieces(p, "it'\u017F"), (V{"it", "'\u017F"}));
}

TEST(SplitRegexTest, Qwen2) {
  const SplitRegex p = SplitRegex::kQwen2;
  EXPECT_EQ(Pieces(p, "12345"), (V{"1", "2", "3", "4", "5"}));
  EXPECT_EQ(Pieces(p, "You'RE 42"), (V{"You", "'RE", " ", "4", "2"}));
}

TEST(SplitRegexTest, InvalidUtf8BytesAreSplitLikePunctuation) {
  EXPECT_EQ(Pieces(SplitRegex::kLlama3, "ab\xff\xfe cd"), (V{"ab", "\xff\xfe", " cd"}));
  EXPECT_EQ(Pieces(SplitRegex::kGpt2, "\xe4\xb8"), (V{"\xe4\xb8"}));
}

// ---------------------------------------------------------------------------------------
// Unicode helpers.

TEST(UnicodeTest, NfcComposesAndReorders) {
  EXPECT_EQ(unicode::Nfc("e\u0301"), "\u00e9");
  EXPECT_EQ(unicode::Nfc("\u212b"), "\u00c5");  // ANGSTROM SIGN is a singleton decomposition
  EXPECT_EQ(unicode::Nfc("a\u0308\u0323"), "\u1ea1\u0308");  // dot below (220) sorts first
  EXPECT_EQ(unicode::Nfc("\u1100\u1161\u11a8"), "\uac01");  // Hangul L V T
  EXPECT_EQ(unicode::Nfc("\u0301e"), "\u0301e");            // nothing to attach to
  EXPECT_EQ(unicode::Nfc("plain ascii"), "plain ascii");
  EXPECT_EQ(unicode::Nfd("\u00e9"), "e\u0301");
}

TEST(UnicodeTest, LossyMatchesRustFromUtf8Lossy) {
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(unicode::Utf8Lossy("a\xF0\x9F\x98"), "a" + r);      // one maximal subpart
  EXPECT_EQ(unicode::Utf8Lossy("\xE0\x80"), r + r);             // E0 80 is never valid
  EXPECT_EQ(unicode::Utf8Lossy("\xED\xA0\x80"), r + r + r);     // surrogates are invalid
  EXPECT_EQ(unicode::Utf8Lossy("\xC3\xA9"), "\xC3\xA9");
  EXPECT_EQ(unicode::IncompleteUtf8Suffix("x\xE4\xB8"), 2u);
  EXPECT_EQ(unicode::IncompleteUtf8Suffix("x\xE4\xB8\xAD"), 0u);
  EXPECT_EQ(unicode::IncompleteUtf8Suffix("x\x80"), 0u);
}

// ---------------------------------------------------------------------------------------
// Tokenizer files.

// GPT-2's byte-to-character map (tokenizers' bytes_char), written out independently.
std::string ByteChar(int b) {
  const auto printable = [](int x) {
    return (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE;
  };
  int cp = b;
  if (!printable(b)) {
    cp = 256;
    for (int x = 0; x < b; ++x) cp += printable(x) ? 0 : 1;
  }
  std::string s;
  unicode::AppendUtf8(cp, &s);
  return s;
}

// 256 byte tokens with id == byte value.
json ByteVocab() {
  json v = json::object();
  for (int b = 0; b < 256; ++b) v[ByteChar(b)] = b;
  return v;
}

json Added(int id, const std::string& content, bool special = true) {
  return {{"id", id},         {"content", content}, {"single_word", false}, {"lstrip", false},
          {"rstrip", false}, {"normalized", !special}, {"special", special}};
}

json BpeModel(json vocab, json merges) {
  return {{"type", "BPE"},        {"dropout", nullptr},  {"unk_token", nullptr},
          {"fuse_unk", false},    {"byte_fallback", false}, {"ignore_merges", false},
          {"vocab", std::move(vocab)}, {"merges", std::move(merges)}};
}

json ByteLevel(bool add_prefix_space = false, bool use_regex = true) {
  return {{"type", "ByteLevel"},
          {"add_prefix_space", add_prefix_space},
          {"trim_offsets", true},
          {"use_regex", use_regex}};
}

std::unique_ptr<Tokenizer> Load(const json& j, const std::string& config = {}) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::FromJson(j.dump(), "test.json", config);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

// GPT-2 style: merges h+e, Ġ+t, Ġt+he, l+l, ll+o.
json Gpt2Json() {
  json vocab = ByteVocab();
  vocab["he"] = 256;
  vocab["Ġt"] = 257;
  vocab["Ġthe"] = 258;
  vocab["ll"] = 259;
  vocab["llo"] = 260;
  json added = json::array({Added(261, "<|eot|>"), Added(262, "<mask>"), Added(263, "<sep>"),
                            Added(264, "cat", /*special=*/false)});
  added[1]["lstrip"] = true;
  added[2]["rstrip"] = true;
  added[3]["single_word"] = true;
  return {{"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", ByteLevel()},
          {"post_processor", ByteLevel()},
          {"decoder", ByteLevel()},
          {"model", BpeModel(vocab, json::array({"h e", "Ġ t", "Ġt he", "l l", "ll o"}))}};
}

TEST(TokenizerTest, ByteLevelBpeMergesByRank) {
  auto tok = Load(Gpt2Json());
  ASSERT_NE(tok, nullptr);
  // "hello": h+e (rank 0), then l+l (3), then ll+o (4).  " the": Ġthe via h+e, Ġ+t, Ġt+he.
  EXPECT_EQ(tok->Encode("hello the"), (Ids{256, 260, 258}));
  EXPECT_EQ(tok->Decode({256, 260, 258}), "hello the");
  EXPECT_EQ(tok->vocab_size(), 265);
  EXPECT_EQ(tok->TokenToId("Ġthe"), 258);
  EXPECT_EQ(tok->IdToToken(258), "Ġthe");
  EXPECT_EQ(tok->IdToToken(99999), "");
  EXPECT_FALSE(tok->TokenToId("nope").has_value());
}

TEST(TokenizerTest, MergeRankOrderDecides) {
  json vocab = ByteVocab();
  vocab["ab"] = 256;
  vocab["bc"] = 257;
  json j = Gpt2Json();
  j["added_tokens"] = json::array();
  j["model"] = BpeModel(vocab, json::array({"a b", "b c"}));
  EXPECT_EQ(Load(j)->Encode("abc"), (Ids{256, 'c'}));
  j["model"] = BpeModel(vocab, json::array({"b c", "a b"}));
  EXPECT_EQ(Load(j)->Encode("abc"), (Ids{'a', 257}));
  // The same merges written as pairs.
  j["model"] = BpeModel(vocab, json::array({{"b", "c"}, {"a", "b"}}));
  EXPECT_EQ(Load(j)->Encode("abc"), (Ids{'a', 257}));
}

TEST(TokenizerTest, IgnoreMergesTakesWholeWordsFromTheVocabulary) {
  json vocab = ByteVocab();
  vocab["ab"] = 256;
  vocab["abc"] = 257;  // no merge produces it
  json j = Gpt2Json();
  j["added_tokens"] = json::array();
  j["model"] = BpeModel(vocab, json::array({"a b"}));
  EXPECT_EQ(Load(j)->Encode("abc"), (Ids{256, 'c'}));
  j["model"]["ignore_merges"] = true;
  EXPECT_EQ(Load(j)->Encode("abc"), (Ids{257}));
  EXPECT_EQ(Load(j)->Encode("abcab"), (Ids{256, 'c', 256}));
}

TEST(TokenizerTest, SpecialTokensAreMatchedBeforePreTokenization) {
  auto tok = Load(Gpt2Json());
  // "hi" | <|eot|> | "there" (t, he, r, e).
  const Ids ids = tok->Encode("hi<|eot|>there");
  EXPECT_EQ(ids, (Ids{'h', 'i', 261, 't', 256, 'r', 'e'}));
  EXPECT_TRUE(tok->IsSpecial(261));
  EXPECT_FALSE(tok->IsSpecial(256));
  EXPECT_EQ(tok->Decode(ids), "hi<|eot|>there");
  EXPECT_EQ(tok->Decode(ids, /*skip_special_tokens=*/true), "hithere");
  // lstrip: <mask> swallows the space before it.  rstrip: <sep> the spaces after it.
  EXPECT_EQ(tok->Encode("a <mask> b"), (Ids{'a', 262, ' ', 'b'}));
  EXPECT_EQ(tok->Encode("a<sep>  b"), (Ids{'a', 263, 'b'}));
  // single_word: "cat" only between non-word characters.
  EXPECT_EQ(tok->Encode("a cat."), (Ids{'a', ' ', 264, '.'}));
  EXPECT_EQ(tok->Encode("concat"), (Ids{'c', 'o', 'n', 'c', 'a', 't'}));
  EXPECT_FALSE(tok->IsSpecial(264));
  EXPECT_EQ(tok->Decode({264}, /*skip_special_tokens=*/true), "cat");
}

TEST(TokenizerTest, ByteLevelKeepsInvalidUtf8Bytes) {
  auto tok = Load(Gpt2Json());
  EXPECT_EQ(tok->Encode("\xff\xfe"), (Ids{0xff, 0xfe}));
  EXPECT_EQ(tok->Decode({0xff, 0xfe}), "\xEF\xBF\xBD\xEF\xBF\xBD");
  // Ids outside the vocabulary are skipped, never a crash.
  EXPECT_EQ(tok->Decode({'a', -1, 1 << 30, 'b'}), "ab");
}

TEST(TokenizerTest, Llama3SplitThenByteLevelWithBosTemplate) {
  json vocab = ByteVocab();
  vocab["Ġ1"] = 256;  // would merge across " " | "123" if the split let it
  vocab["12"] = 257;
  json j = {
      {"added_tokens", json::array({Added(258, "<|begin_of_text|>")})},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         json::array({{{"type", "Split"},
                       {"pattern", {{"Regex", std::string(SplitRegexSource(SplitRegex::kLlama3))}}},
                       {"behavior", "Isolated"},
                       {"invert", false}},
                      ByteLevel(false, false)})}}},
      {"post_processor",
       {{"type", "Sequence"},
        {"processors",
         json::array({ByteLevel(),
                      {{"type", "TemplateProcessing"},
                       {"single", json::array({{{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}},
                                               {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
                       {"pair", json::array()},
                       {"special_tokens",
                        {{"<|begin_of_text|>",
                          {{"id", "<|begin_of_text|>"}, {"ids", {258}}, {"tokens", {"<|begin_of_text|>"}}}}}}}})}}},
      {"decoder", ByteLevel()},
      {"model", BpeModel(vocab, json::array({"Ġ 1", "1 2"}))}};
  auto tok = Load(j);
  ASSERT_NE(tok, nullptr);
  // Llama-3 pieces: "I", "'M", " ", "123", "45": no Ġ1 merge.
  EXPECT_EQ(tok->Encode("I'M 12345"), (Ids{'I', '\'', 'M', ' ', 257, '3', '4', '5'}));
  EXPECT_EQ(tok->Encode("I'M 12345", /*add_special_tokens=*/true),
            (Ids{258, 'I', '\'', 'M', ' ', 257, '3', '4', '5'}));
  // The same vocabulary under the GPT-2 ByteLevel regex keeps " 12345" together.
  j["pre_tokenizer"] = ByteLevel();
  EXPECT_EQ(Load(j)->Encode("I'M 12345"), (Ids{'I', '\'', 'M', 256, '2', '3', '4', '5'}));
}

TEST(TokenizerTest, UnknownSplitRegexIsRejected) {
  json j = Gpt2Json();
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers", json::array({{{"type", "Split"},
                                                        {"pattern", {{"Regex", "\\w+|\\s+"}}},
                                                        {"behavior", "Isolated"},
                                                        {"invert", false}}})}};
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::FromJson(j.dump(), "x/tokenizer.json");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("x/tokenizer.json"), std::string::npos) << t.status();
  EXPECT_NE(t.status().message().find("pre_tokenizer.pretokenizers[0].pattern"), std::string::npos)
      << t.status();
}

// SentencePiece style: <unk> <s> </s>, 256 byte tokens (ids 3..258), ▁ H i ▁H ▁Hi.
json SentencePieceJson() {
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    vocab[name] = 3 + b;
  }
  vocab["▁"] = 259;
  vocab["H"] = 260;
  vocab["i"] = 261;
  vocab["▁H"] = 262;
  vocab["▁Hi"] = 263;
  json model = BpeModel(vocab, json::array({"▁ H", "▁H i"}));
  model["unk_token"] = "<unk>";
  model["fuse_unk"] = true;
  model["byte_fallback"] = true;
  return {
      {"added_tokens", json::array({Added(0, "<unk>"), Added(1, "<s>"), Added(2, "</s>")})},
      {"normalizer",
       {{"type", "Sequence"},
        {"normalizers", json::array({{{"type", "Prepend"}, {"prepend", "▁"}},
                                     {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "▁"}}})}}},
      {"pre_tokenizer", nullptr},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
        {"pair", json::array()},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders", json::array({{{"type", "Replace"}, {"pattern", {{"String", "▁"}}}, {"content", " "}},
                                  {{"type", "ByteFallback"}},
                                  {{"type", "Fuse"}},
                                  {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}}},
      {"model", model}};
}

TEST(TokenizerTest, SentencePieceBpeWithByteFallback) {
  auto tok = Load(SentencePieceJson());
  ASSERT_NE(tok, nullptr);
  // Normalized to "▁Hi▁Hi"; both ▁+H merges (rank 0) happen before the ▁H+i ones.
  EXPECT_EQ(tok->Encode("Hi Hi"), (Ids{263, 263}));
  EXPECT_EQ(tok->Encode("Hi", /*add_special_tokens=*/true), (Ids{1, 263}));
  // 中 is not in the vocabulary: its UTF-8 bytes E4 B8 AD become <0xE4><0xB8><0xAD>.
  EXPECT_EQ(tok->Encode("中"), (Ids{259, 3 + 0xE4, 3 + 0xB8, 3 + 0xAD}));
  // The leading "▁" decodes to a space that Strip removes.
  EXPECT_EQ(tok->Decode({259, 3 + 0xE4, 3 + 0xB8, 3 + 0xAD}), "中");
  EXPECT_EQ(tok->Decode({1, 263, 263}), "<s> Hi Hi");
  EXPECT_EQ(tok->Decode({1, 263, 263}, /*skip_special_tokens=*/true), "Hi Hi");
  // An incomplete byte run decodes to one U+FFFD per byte.
  EXPECT_EQ(tok->Decode({3 + 0xE4, 3 + 0xB8}), "\uFFFD\uFFFD");
  // Invalid UTF-8 input is repaired to U+FFFD (EF BF BD) first.
  EXPECT_EQ(tok->Encode("\xff"), (Ids{259, 3 + 0xEF, 3 + 0xBF, 3 + 0xBD}));
}

TEST(TokenizerTest, UnknownCharactersFuseIntoOneUnk) {
  json j = SentencePieceJson();
  j["model"]["byte_fallback"] = false;
  EXPECT_EQ(Load(j)->Encode("中中"), (Ids{259, 0}));
  j["model"]["fuse_unk"] = false;
  EXPECT_EQ(Load(j)->Encode("中中"), (Ids{259, 0, 0}));
}

TEST(TokenizerTest, MetaspacePrependSchemes) {
  json j = SentencePieceJson();
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", "first"},
                        {"split", false}};
  j["decoder"] = {{"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", "first"},
                  {"split", false}};
  auto first = Load(j);
  EXPECT_EQ(first->Encode("Hi"), (Ids{263}));
  // "first": only text at the very start of the input gets the ▁, not text after <s>.
  EXPECT_EQ(first->Encode("<s>Hi"), (Ids{1, 260, 261}));
  // The decoder drops the ▁ of the first token only.
  EXPECT_EQ(first->Decode({263, 263}), "Hi Hi");
  j["pre_tokenizer"]["prepend_scheme"] = "always";
  EXPECT_EQ(Load(j)->Encode("<s>Hi"), (Ids{1, 263}));
  j["pre_tokenizer"]["prepend_scheme"] = "never";
  EXPECT_EQ(Load(j)->Encode("Hi"), (Ids{260, 261}));
}

TEST(TokenizerTest, TokenizerConfigFlagsDecideSpecialTokens) {
  const std::string config =
      R"({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": false,
          "add_eos_token": true})";
  auto tok = Load(SentencePieceJson(), config);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_EQ(tok->Encode("Hi", /*add_special_tokens=*/true), (Ids{263, 2}));
}

// ---------------------------------------------------------------------------------------
// Streaming.

std::string StreamAll(const Tokenizer& tok, const Ids& ids, std::mt19937* rng,
                      bool skip_special = false) {
  DecodeStream s(&tok, skip_special);
  std::string out;
  for (size_t i = 0; i < ids.size();) {
    const size_t n = std::min<size_t>(1 + (*rng)() % 3, ids.size() - i);
    out += s.Push(absl::MakeConstSpan(ids.data() + i, n));
    i += n;
  }
  return out + s.Flush();
}

TEST(DecodeStreamTest, MultiByteCharacterIsEmittedWholeOnce) {
  auto tok = Load(Gpt2Json());
  DecodeStream s(tok.get());
  EXPECT_EQ(s.Push('a'), "a");
  EXPECT_EQ(s.Push(0xE4), "");  // 中 = E4 B8 AD, one byte token each
  EXPECT_EQ(s.Push(0xB8), "");
  EXPECT_EQ(s.Push(0xAD), "中");
  EXPECT_EQ(s.Push({0xF0, 0x9F}), "");  // half an emoji at the end of generation
  EXPECT_EQ(s.Flush(), "\uFFFD");     // as Decode renders it
  EXPECT_EQ(tok->Decode({'a', 0xE4, 0xB8, 0xAD, 0xF0, 0x9F}), "a中\uFFFD");
}

TEST(DecodeStreamTest, ByteFallbackAndLeadingSpaceRules) {
  auto tok = Load(SentencePieceJson());
  DecodeStream s(tok.get(), /*skip_special_tokens=*/true);
  EXPECT_EQ(s.Push(1), "");        // <s> skipped; start-of-text rules still pending
  EXPECT_EQ(s.Push(263), "Hi");    // Strip removed the leading space
  EXPECT_EQ(s.Push(263), " Hi");   // later spaces stay
  EXPECT_EQ(s.Push(259), " ");
  EXPECT_EQ(s.Push(3 + 0xE4), "");  // a byte-fallback run stays open
  EXPECT_EQ(s.Push(3 + 0xB8), "");
  EXPECT_EQ(s.Push(3 + 0xAD), "");  // complete, but another byte could still follow
  EXPECT_EQ(s.Push(263), "中 Hi");
  EXPECT_EQ(s.Flush(), "");
}

TEST(DecodeStreamTest, ChunkedStreamEqualsFullDecodeOnRandomIds) {
  std::mt19937 rng(7);
  for (const json& j : {Gpt2Json(), SentencePieceJson()}) {
    auto tok = Load(j);
    const int n = tok->vocab_size();
    for (int trial = 0; trial < 300; ++trial) {
      Ids ids(1 + rng() % 16);
      for (int32_t& id : ids) id = rng() % n;
      for (bool skip : {false, true}) {
        EXPECT_EQ(StreamAll(*tok, ids, &rng, skip), tok->Decode(ids, skip));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Errors.

absl::Status LoadError(const std::string& text) {
  return Tokenizer::FromJson(text, "bad/tokenizer.json").status();
}

void ExpectError(const absl::Status& st, const std::string& field) {
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("bad/tokenizer.json"), std::string::npos) << st;
  EXPECT_NE(st.message().find(field), std::string::npos) << st;
}

TEST(TokenizerErrorTest, MalformedFilesNameTheFileAndField) {
  ExpectError(LoadError("{\"model\": "), "not valid JSON");
  ExpectError(LoadError("[]"), "(root)");
  ExpectError(LoadError("{}"), "model");
  json j = Gpt2Json();
  j["model"]["vocab"]["x"] = "seven";
  ExpectError(LoadError(j.dump()), "model.vocab[\"x\"]");
  j = Gpt2Json();
  j["model"]["merges"] = json::array({"h e", "q zz"});
  ExpectError(LoadError(j.dump()), "model.merges[1]");
  j["model"]["merges"] = json::array({"h e f"});
  ExpectError(LoadError(j.dump()), "model.merges[0]");
  j = Gpt2Json();
  j["model"]["type"] = "WordPiece";
  ExpectError(LoadError(j.dump()), "model.type");
  j = Gpt2Json();
  j["pre_tokenizer"] = {{"type", "Whitespace"}};
  ExpectError(LoadError(j.dump()), "pre_tokenizer.type");
  j = Gpt2Json();
  j["added_tokens"][0].erase("id");
  ExpectError(LoadError(j.dump()), "added_tokens[0].id");
  j = Gpt2Json();
  j["decoder"] = {{"type", "Strip"}, {"content", "ab"}};
  ExpectError(LoadError(j.dump()), "decoder.content");
  j = Gpt2Json();
  j["model"]["vocab"]["big"] = int64_t{1} << 40;
  ExpectError(LoadError(j.dump()), "out of range");
}

TEST(TokenizerErrorTest, FilesOnDisk) {
  const std::string dir = MakeTempDir("tok_err");
  EXPECT_EQ(Tokenizer::FromModelDir(dir).status().code(), absl::StatusCode::kNotFound);
  const std::string full = Gpt2Json().dump();
  {
    std::ofstream out(dir + "/tokenizer.json");
    out << full.substr(0, full.size() / 2);  // truncated
  }
  absl::Status st = Tokenizer::FromModelDir(dir).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find(dir + "/tokenizer.json"), std::string::npos) << st;
  {
    std::ofstream out(dir + "/tokenizer.json");
    out << full;
    std::ofstream cfg(dir + "/tokenizer_config.json");
    cfg << "{\"add_bos_token\": true}";  // no bos_token to add
  }
  st = Tokenizer::FromModelDir(dir).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("tokenizer_config.json"), std::string::npos) << st;
  std::filesystem::remove_all(dir);
}

// ---------------------------------------------------------------------------------------
// The random test models' tokenizer (tests/testutil/random_checkpoint.cc).

TEST(TokenizerTest, RandomCheckpointTokenizerRoundTripsBytes) {
  const std::string dir = MakeTempDir("tok_ckpt");
  RandomCheckpointSpec spec;
  ASSERT_TRUE(WriteRandomCheckpoint(dir, spec).ok());
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromModelDir(dir);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), spec.vocab_size);
  std::mt19937 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    std::string bytes(rng() % 40, '\0');
    for (char& c : bytes) c = static_cast<char>(rng() % 256);
    const Ids ids = (*tok)->Encode(bytes);
    // Without merges every byte is its own token, id == byte value.
    ASSERT_EQ(ids.size(), bytes.size());
    for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(ids[i], static_cast<uint8_t>(bytes[i]));
    EXPECT_EQ((*tok)->Decode(ids), unicode::Utf8Lossy(bytes));
    // Valid UTF-8 comes back exactly, streamed or not.
    const std::string text = unicode::Utf8Lossy(bytes);
    EXPECT_EQ((*tok)->Decode((*tok)->Encode(text)), text);
    EXPECT_EQ(StreamAll(**tok, (*tok)->Encode(text), &rng), text);
  }
  EXPECT_EQ((*tok)->Encode("a<|eos|>"), (Ids{'a', 256}));
  EXPECT_TRUE((*tok)->IsSpecial(256));
  EXPECT_EQ((*tok)->Decode({'a', 256, 257}, /*skip_special_tokens=*/true), "a");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace specd
