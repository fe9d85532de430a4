// libFuzzer: tokenizer.json loading and encoding. The first input byte picks the mode: even,
// the rest is a tokenizer.json (loaded, then used to encode and decode a fixed text); odd, the
// rest is text encoded and decoded by each reference tokenizer of tests/fixtures/tokenizers
// (byte-level, Metaspace with byte fallback, Llama 3 and Qwen2 patterns). The reference
// tokenizers are loaded once (LLVMFuzzerInitialize) and their encode caches emptied after each
// input.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/text/tokenizer.h"

namespace {

std::vector<std::unique_ptr<specd::Tokenizer>>* References() {
  static auto* refs = [] {
    auto* v = new std::vector<std::unique_ptr<specd::Tokenizer>>();
    const char* root = std::getenv("SPECD_FUZZ_FIXTURES");
    const std::string dir = root != nullptr ? root : "tests/fixtures/tokenizers";
    for (const char* name : {"gpt2_bytelevel", "metaspace_bytefallback", "llama3_pattern",
                             "qwen2_pattern", "hfnode_sp_llama2"}) {
      auto t = specd::Tokenizer::FromFile(dir + "/" + name + "/tokenizer.json");
      if (t.ok()) v->push_back(*std::move(t));
    }
    if (v->empty()) __builtin_trap();  // run from the repository root or set SPECD_FUZZ_FIXTURES
    return v;
  }();
  return refs;
}

void RoundTrip(const specd::Tokenizer& t, std::string_view text) {
  for (bool special : {false, true}) {
    const std::vector<int32_t> ids = t.Encode(text, special);
    for (int32_t id : ids) {
      if (id < 0 || id >= t.vocab_size()) __builtin_trap();
    }
    static volatile size_t sink;
    sink = t.Decode(ids, special).size();
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  References();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    auto t = specd::Tokenizer::FromJson(rest);
    if (t.ok()) RoundTrip(**t, "Hello wörld, 123 <s> \xF0\x9F\x98\x80 \xff end");
  } else {
    for (const auto& t : *References()) {
      RoundTrip(*t, rest);
      // The second Encode of RoundTrip read this input's words from the cache; emptied, the
      // next input starts from the loaded state (libFuzzer re-ran every input that grew the
      // cache under LeakSanitizer, over a heap that grew with it: most of the harness's time).
      t->ClearEncodeCache();
    }
  }
  return 0;
}
