// Target/draft pairs for speculative-decoding tests: a target written as a copy of a (draft)
// checkpoint with extra decoder layers appended whose output projections are small, so the
// target's next-token distributions stay close to the draft's and drafts get accepted often,
// as with a real small/large model pair of one family.
#ifndef SPECD_TESTS_TESTUTIL_EXTENDED_CHECKPOINT_H_
#define SPECD_TESTS_TESTUTIL_EXTENDED_CHECKPOINT_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace specd {

struct ExtendSpec {
  int extra_layers = 1;
  // Scale of the appended layers' o_proj and down_proj relative to init_std: each appended
  // layer adds a residual update of about this relative size.
  float output_scale = 0.1f;
  float init_std = 0.08f;
  uint64_t seed = 1;
};

// Writes `dst_dir` (created if needed) as `src_dir`'s checkpoint (config.json,
// generation_config.json, tokenizer.json, fp32 model.safetensors) with `spec.extra_layers`
// random decoder layers appended after the last one. The appended layers have the same tensor
// names and shapes as layer 0.
absl::Status WriteExtendedCheckpoint(const std::string& src_dir, const std::string& dst_dir,
                                     const ExtendSpec& spec);

}  // namespace specd

#endif  // SPECD_TESTS_TESTUTIL_EXTENDED_CHECKPOINT_H_
