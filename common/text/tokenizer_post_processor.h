// The post-processor stage of tokenizer.json for single sequences: the special tokens put
// before and after the ids (TemplateProcessing, RobertaProcessing, BertProcessing, ByteLevel,
// Sequence). Private to common/text/tokenizer*.cc.
#ifndef SPECD_COMMON_TEXT_TOKENIZER_POST_PROCESSOR_H_
#define SPECD_COMMON_TEXT_TOKENIZER_POST_PROCESSOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/text/tokenizer_util.h"

namespace specd::tokenizer_internal {

// Adds the ids the processor `j` (at JSON path `path`) puts before a sequence to the end of
// `prefix`, and those after it to the front of `suffix`.
absl::Status ParsePostProcessor(const Ctx& ctx, const json& j, const std::string& path,
                                std::vector<int32_t>* prefix, std::vector<int32_t>* suffix);

}  // namespace specd::tokenizer_internal

#endif  // SPECD_COMMON_TEXT_TOKENIZER_POST_PROCESSOR_H_
