// specd's tokenizer against outputs of the Hugging Face `tokenizers` library.
//
// Every folder under tests/fixtures/tokenizers/ holds a tokenizer.json and a cases.json:
//   {"encode": [{"text": ..., "ids": [...]}],          encode, add_special_tokens=False
//    "decode": [{"ids": [...], "text": ...}],          decode, skip_special_tokens=False
//    optional "encode_special": [...]                   encode, add_special_tokens=True
//    optional "decode_skip_special": [...]}             decode, skip_special_tokens=True
// Every case must match exactly, both ways; DecodeStream must reproduce every decode.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/text/tokenizer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace specd {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

fs::path FixtureRoot() {
  if (const char* src = std::getenv("SPECD_SOURCE_DIR"); src != nullptr && *src != '\0') {
    return fs::path(src) / "tests/fixtures/tokenizers";
  }
  return fs::current_path() / "tests/fixtures/tokenizers";
}

std::vector<fs::path> FixtureDirs() {
  std::vector<fs::path> dirs;
  std::error_code ec;
  const fs::path root = FixtureRoot();
  if (!fs::is_directory(root, ec)) return dirs;
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    if (e.is_directory() && fs::exists(e.path() / "tokenizer.json")) dirs.push_back(e.path());
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

std::string Escape(const std::string& s) {
  return json(s).dump(-1, ' ', /*ensure_ascii=*/true, json::error_handler_t::replace);
}

std::string Ids(const std::vector<int32_t>& ids) { return json(ids).dump(); }

// Decodes `ids` through a DecodeStream fed in chunks of `chunk` ids.
std::string Streamed(const Tokenizer& tok, const std::vector<int32_t>& ids, size_t chunk,
                     bool skip_special) {
  DecodeStream stream(&tok, skip_special);
  std::string out;
  for (size_t i = 0; i < ids.size(); i += chunk) {
    const size_t n = std::min(chunk, ids.size() - i);
    out += stream.Push(absl::MakeConstSpan(ids.data() + i, n));
  }
  return out + stream.Flush();
}

// Checks one case list; reports at most a few mismatches in detail.
void CheckCases(const Tokenizer& tok, const json& cases, const std::string& kind,
                const std::string& folder, int* checked) {
  const bool encode = kind == "encode" || kind == "encode_special";
  const bool special = kind == "encode_special" || kind == "decode_skip_special";
  int failures = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const json& c = cases[i];
    ASSERT_TRUE(c.contains("text") && c.contains("ids")) << folder << " " << kind << "[" << i << "]";
    const std::string text = c["text"].get<std::string>();
    const std::vector<int32_t> ids = c["ids"].get<std::vector<int32_t>>();
    ++*checked;
    if (encode) {
      const std::vector<int32_t> got = tok.Encode(text, special);
      if (got != ids && ++failures <= 5) {
        ADD_FAILURE() << folder << " " << kind << "[" << i << "] text " << Escape(text)
                      << "\n  want " << Ids(ids) << "\n  got  " << Ids(got);
      }
    } else {
      const std::string got = tok.Decode(ids, special);
      if (got != text && ++failures <= 5) {
        ADD_FAILURE() << folder << " " << kind << "[" << i << "] ids " << Ids(ids)
                      << "\n  want " << Escape(text) << "\n  got  " << Escape(got);
      }
      for (size_t chunk : {size_t{1}, size_t{3}}) {
        const std::string streamed = Streamed(tok, ids, chunk, special);
        if (streamed != text && ++failures <= 5) {
          ADD_FAILURE() << folder << " " << kind << "[" << i << "] DecodeStream (chunks of "
                        << chunk << ") ids " << Ids(ids) << "\n  want " << Escape(text)
                        << "\n  got  " << Escape(streamed);
        }
      }
    }
  }
  if (failures > 5) ADD_FAILURE() << folder << " " << kind << ": " << failures << " mismatches in all";
}

TEST(TokenizerFixtureTest, MatchesHuggingFaceTokenizers) {
  const std::vector<fs::path> dirs = FixtureDirs();
  if (dirs.empty()) {
    GTEST_SKIP() << "no tokenizer fixtures under " << FixtureRoot()
                 << " (made on the GPU host by the oracle fixture script)";
  }
  for (const fs::path& dir : dirs) {
    const std::string folder = dir.filename().string();
    SCOPED_TRACE(folder);
    absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromFile((dir / "tokenizer.json").string());
    ASSERT_TRUE(tok.ok()) << tok.status();
    std::ifstream in(dir / "cases.json");
    ASSERT_TRUE(in) << "missing " << (dir / "cases.json");
    std::stringstream ss;
    ss << in.rdbuf();
    const json cases = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
    ASSERT_FALSE(cases.is_discarded()) << dir / "cases.json" << " is not valid JSON";
    int checked = 0;
    for (const char* kind : {"encode", "decode", "encode_special", "decode_skip_special"}) {
      if (cases.contains(kind)) CheckCases(**tok, cases[kind], kind, folder, &checked);
    }
    EXPECT_GT(checked, 0) << folder << " has no cases";
  }
}

// The encode cases again after emptying the word cache: the first pass fills it (a second
// Encode of the same text reads it), the pass after ClearEncodeCache computes every word again;
// both must match Hugging Face.
TEST(TokenizerFixtureTest, EncodeMatchesAfterTheCacheIsEmptied) {
  const std::vector<fs::path> dirs = FixtureDirs();
  if (dirs.empty()) GTEST_SKIP() << "no tokenizer fixtures under " << FixtureRoot();
  for (const fs::path& dir : dirs) {
    const std::string folder = dir.filename().string();
    SCOPED_TRACE(folder);
    absl::StatusOr<std::unique_ptr<Tokenizer>> tok =
        Tokenizer::FromFile((dir / "tokenizer.json").string());
    ASSERT_TRUE(tok.ok()) << tok.status();
    std::ifstream in(dir / "cases.json");
    std::stringstream ss;
    ss << in.rdbuf();
    const json cases = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(cases.contains("encode")) << folder;
    int checked = 0;
    for (int pass = 0; pass < 3; ++pass) {
      CheckCases(**tok, cases["encode"], "encode", folder, &checked);
      if (pass == 1) (*tok)->ClearEncodeCache();
    }
    EXPECT_GT(checked, 0);
  }
}

}  // namespace
}  // namespace specd
