// The models and runner that the speculative-decoding tests share (tests/unit/speculative_test.cc,
// speculative_distribution_test.cc): a draft, a target that extends it, an unrelated draft of
// another family, n-gram lookup and a random EAGLE-3 head, written once per process into a
// temporary folder and loaded on the CPU backend.
#ifndef SPECD_TESTS_TESTUTIL_SPECULATION_MODELS_H_
#define SPECD_TESTS_TESTUTIL_SPECULATION_MODELS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/backend.h"
#include "engine/draft/draft_model_drafter.h"
#include "engine/draft/eagle_drafter.h"
#include "engine/draft/eagle_head.h"
#include "engine/draft/ngram_drafter.h"
#include "engine/spec/generator.h"

namespace specd::speculation_testing {

// The vocabulary every model here shares.
inline constexpr int kVocab = 300;

// The CPU backend of the checkpoint folder `dir` (nullptr, with a test failure, if it fails).
std::unique_ptr<Backend> Load(const std::string& dir);

// Writes a random EAGLE-3 head in the published layout for the two-layer, 32-wide target of
// Models into `dir`: taps 0, 1 and 2 (the three distinct layer inputs a two-layer target has),
// a draft vocabulary of the first 100 target ids shifted by 7 (d2t), so the map is exercised.
absl::Status WriteRandomEagleHead(const std::string& dir);

// The models every test shares: a draft; a target made of the draft plus one layer with small
// output projections, so drafts are often right as with a real small/large pair; and an
// unrelated random draft of another shape and family.
struct Models {
  std::string root, draft_dir, target_dir, other_dir;
  std::unique_ptr<Backend> target, draft, same, other;
  std::unique_ptr<DraftModelDrafter> related_drafter, same_drafter, other_drafter;
  std::unique_ptr<NgramDrafter> ngram;
  std::unique_ptr<EagleHead> eagle_head;
  std::unique_ptr<EagleDrafter> eagle_drafter;

  Models();
  ~Models();
};

// The process's Models, written and loaded on first use and never freed.
Models& M();

// kSame drafts with a copy of the target (its proposals are the target's favourites).
enum class DrafterKind { kNone, kRelated, kSame, kOther, kNgram, kEagle };

// The drafter of `kind` over M() (nullptr for kNone).
Drafter* GetDrafter(DrafterKind kind);
const char* DrafterName(DrafterKind kind);

// Runs `requests` over the shared target, `batch` requests per Generator::Generate() call (so
// `batch` sequences share every Draft and Verify call); `streamed`, if set, receives each
// request's streamed tokens.
std::vector<GenerationResult> GenerateAll(DrafterKind kind,
                                          const std::vector<GenerationRequest>& requests,
                                          size_t batch,
                                          std::vector<std::vector<int32_t>>* streamed = nullptr,
                                          const GeneratorOptions& options = GeneratorOptions());

// The speculation statistics of `results` added up.
SpecStats Total(const std::vector<GenerationResult>& results);

}  // namespace specd::speculation_testing

#endif  // SPECD_TESTS_TESTUTIL_SPECULATION_MODELS_H_
