// The normalizer stage of tokenizer.json: Sequence, Prepend, Replace (literal), Strip, NFC,
// NFD. Private to common/text/tokenizer*.cc.
#ifndef SPECD_COMMON_TEXT_TOKENIZER_NORMALIZER_H_
#define SPECD_COMMON_TEXT_TOKENIZER_NORMALIZER_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/text/tokenizer_util.h"

namespace specd::tokenizer_internal {

struct NormalizerStep {
  enum Kind { kPrepend, kReplace, kStrip, kNfc, kNfd } kind;
  std::string a, b;
  bool left = false, right = false;
};

// `s` after every step in order.
std::string Normalize(const std::vector<NormalizerStep>& steps, std::string s);

// Appends the steps of the normalizer `j` (at JSON path `path`) to `out`.
absl::Status ParseNormalizer(const Ctx& ctx, const json& j, const std::string& path,
                             std::vector<NormalizerStep>* out);

}  // namespace specd::tokenizer_internal

#endif  // SPECD_COMMON_TEXT_TOKENIZER_NORMALIZER_H_
