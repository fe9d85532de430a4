// Reading the transformers oracle fixtures under tests/fixtures
// (tools/oracle/make_fixtures.py): shared by the CPU fixture test
// (tests/unit/hf_fixture_test.cc) and the CUDA model test
// (tests/gpu/cuda_model_test.cc).
#ifndef SPECD_TESTS_TESTUTIL_HF_FIXTURES_H_
#define SPECD_TESTS_TESTUTIL_HF_FIXTURES_H_

#include <cstdint>
#include <filesystem>
#include <vector>

#include "absl/types/span.h"
#include "engine/backend.h"
#include "nlohmann/json.hpp"

namespace specd {
namespace testutil {

// The repository root (the folder holding tests/fixtures/README.md), found from
// the current directory upwards: ctest runs tests from the source root, a
// binary started by hand from build/ or .device/ walks up. Empty when not
// found.
std::filesystem::path RepoRoot();

// Parses a JSON file; a missing or unreadable file fails the current test and
// returns null.
nlohmann::json ReadJson(const std::filesystem::path &path);

// max |got - want| / max |want| over one row; infinite when `got` holds a NaN
// or infinity, so such a row never passes.
double RelError(absl::Span<const float> got, const std::vector<double> &want);

// Index of the largest logit, the lowest on ties.
int32_t Argmax(absl::Span<const float> row);

// A chain of `tokens` appended to `seq`'s scratch region with logits wanted at
// `rows`.
ForwardItem Chain(SeqId seq, const std::vector<int32_t> &tokens,
                  std::vector<int32_t> rows);

// Greedy decoding with the KV cache, as a server runs it: the prompt as one
// chain, committed, then one token per step, `steps` tokens in all. Does not
// stop at EOS (neither do the fixtures). Failures fail the current test.
std::vector<int32_t> Greedy(Backend &b, SeqId seq,
                            const std::vector<int32_t> &prompt, int steps);

} // namespace testutil
} // namespace specd

#endif // SPECD_TESTS_TESTUTIL_HF_FIXTURES_H_
