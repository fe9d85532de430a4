// The committed seed corpus of tests/fuzz/tokenizer_fuzzer.cc stays what the harness needs: a
// tokenizer.json seed the tokenizer rejects would leave the fuzzer mutating a parse error, and
// a reference tokenizer without a text seed would be reached only by chance. Input layout: the
// first byte modulo 6 is 0 for "tokenizer.json NUL text", 1 to 5 for a text for one reference
// tokenizer (tests/fuzz/make_seeds.py writes the seeds).
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/text/tokenizer.h"
#include "gtest/gtest.h"

namespace specd {
namespace {

namespace fs = std::filesystem;

fs::path CorpusDir() {
  const char* src = std::getenv("SPECD_SOURCE_DIR");
  const fs::path root = src != nullptr && *src != '\0' ? fs::path(src) : fs::current_path();
  return root / "tests/fuzz/corpus/tokenizer_fuzzer";
}

std::string ReadFile(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(TokenizerFuzzSeedTest, EveryTokenizerSeedLoadsAndMergesItsText) {
  int loaded = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(CorpusDir())) {
    const std::string data = ReadFile(e.path());
    ASSERT_FALSE(data.empty()) << e.path();
    if (static_cast<unsigned char>(data[0]) % 6 != 0) continue;
    SCOPED_TRACE(e.path().string());
    const size_t nul = data.find('\0', 1);
    ASSERT_NE(nul, std::string::npos) << "no text after the tokenizer.json";
    // A few KB at most: libFuzzer's length limit follows the largest seed.
    EXPECT_LE(data.size(), 4096u);
    auto tok = Tokenizer::FromJson(std::string_view(data).substr(1, nul - 1));
    ASSERT_TRUE(tok.ok()) << tok.status();
    const std::string text = data.substr(nul + 1);
    const std::vector<int32_t> ids = (*tok)->Encode(text);
    ASSERT_FALSE(ids.empty());
    // Fewer ids than bytes: the kept merges apply to the seed's own text.
    EXPECT_LT(ids.size(), text.size());
    for (int32_t id : ids) EXPECT_LT(id, (*tok)->vocab_size());
    ++loaded;
  }
  EXPECT_GE(loaded, 7);
}

TEST(TokenizerFuzzSeedTest, EveryReferenceTokenizerHasTextSeeds) {
  std::set<int> modes;
  for (const fs::directory_entry& e : fs::directory_iterator(CorpusDir())) {
    const std::string data = ReadFile(e.path());
    if (!data.empty()) modes.insert(static_cast<unsigned char>(data[0]) % 6);
  }
  EXPECT_EQ(modes, (std::set<int>{0, 1, 2, 3, 4, 5}));
}

}  // namespace
}  // namespace specd
