// libFuzzer: tokenizer.json loading and encoding. The first input byte, modulo 6, picks the
// mode. 0: the rest is a tokenizer.json, optionally followed by a NUL and a text (a fixed one
// when absent); the tokenizer is loaded and, if accepted, encodes and decodes that text. 1 to 5:
// the rest is text, encoded and decoded by one reference tokenizer of tests/fixtures/tokenizers
// (byte-level GPT-2, Metaspace with byte fallback, the Llama 3 and Qwen2 patterns, SentencePiece
// Llama 2). The reference tokenizers are loaded once (LLVMFuzzerInitialize) and their encode
// caches emptied after each input.
//
// One tokenizer per text input rather than all five: the cost of an input is its length times
// the tokenizers that encode it, and libFuzzer's coverage feedback then credits a new path to
// the tokenizer (the selector byte) that took it. The seeds of tests/fuzz/corpus (written by
// tests/fuzz/make_seeds.py) hold each text for each reference tokenizer, and tokenizer.json
// files cut down to a few dozen tokens and merges, so that inputs stay short.
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
      // Every one or none: the selector byte of a saved input must keep naming the same one.
      // Run from the repository root or set SPECD_FUZZ_FIXTURES.
      if (!t.ok()) __builtin_trap();
      v->push_back(*std::move(t));
    }
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
  const int mode = data[0] % 6;
  if (mode == 0) {
    // A NUL cannot occur in JSON text (it would be a parse error anyway), so it ends the JSON.
    const size_t nul = rest.find('\0');
    const std::string_view json = rest.substr(0, nul);
    const std::string_view text = nul == std::string_view::npos
                                      ? "Hello w\xC3\xB6rld, 123 <s> \xF0\x9F\x98\x80 \xff end"
                                      : rest.substr(nul + 1);
    auto t = specd::Tokenizer::FromJson(json);
    if (t.ok()) RoundTrip(**t, text);
  } else {
    const auto& refs = *References();
    const specd::Tokenizer& t = *refs[(mode - 1) % refs.size()];
    RoundTrip(t, rest);
    // The second Encode of RoundTrip read this input's words from the cache; emptied, the next
    // input starts from the loaded state (libFuzzer re-ran every input that grew the cache under
    // LeakSanitizer, over a heap that grew with it: most of the harness's time).
    t.ClearEncodeCache();
  }
  return 0;
}
