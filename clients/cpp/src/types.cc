#include "specd/types.h"

#include <optional>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "specd/client.h"

namespace specd {

const char* SpeculationName(Speculation speculation) {
  switch (speculation) {
    case Speculation::kOff:
      return "off";
    case Speculation::kDraftModel:
      return "draft_model";
    case Speculation::kNgram:
      return "ngram";
    case Speculation::kEagle3:
      return "eagle3";
    case Speculation::kAuto:
      break;
  }
  return "auto";
}

std::optional<Speculation> ParseSpeculation(std::string_view name) {
  if (name == "auto") return Speculation::kAuto;
  if (name == "off") return Speculation::kOff;
  if (name == "draft_model" || name == "draft-model") return Speculation::kDraftModel;
  if (name == "ngram") return Speculation::kNgram;
  if (name == "eagle3") return Speculation::kEagle3;
  return std::nullopt;
}

const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kStopToken:
      return "stop_token";
    case FinishReason::kStopString:
      return "stop_string";
    case FinishReason::kContext:
      return "context";
    case FinishReason::kUnspecified:
      break;
  }
  return "unspecified";
}

std::optional<double> SpeculationStats::acceptance_rate() const {
  if (draft_tokens == 0) return std::nullopt;
  return static_cast<double>(accepted_tokens) / static_cast<double>(draft_tokens);
}

std::optional<double> SpeculationStats::mean_accepted_length() const {
  if (steps == 0) return std::nullopt;
  return 1.0 + static_cast<double>(accepted_tokens) / static_cast<double>(steps);
}

void CompletionBuilder::Add(const Chunk& chunk) {
  completion_.text += chunk.text;
  completion_.token_ids.insert(completion_.token_ids.end(), chunk.token_ids.begin(),
                               chunk.token_ids.end());
  completion_.logprobs.insert(completion_.logprobs.end(), chunk.logprobs.begin(),
                              chunk.logprobs.end());
  if (chunk.last()) {
    completion_.finish_reason = chunk.finish_reason;
    completion_.usage = chunk.usage;
    completion_.speculation = chunk.speculation;
    completion_.matched_stop = chunk.matched_stop;
  }
}

absl::StatusOr<Completion> CompletionBuilder::Finish() && {
  if (completion_.finish_reason == FinishReason::kUnspecified) {
    return absl::InternalError("the stream ended without a finish reason");
  }
  return std::move(completion_);
}

}  // namespace specd
