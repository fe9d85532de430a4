#include "services/router/request_validation.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/token_tree.h"

namespace specd {
namespace {

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

}  // namespace

absl::Status ValidateGenerateRequest(const v1::GenerateRequest& r, const RequestLimits& limits) {
  switch (r.input_case()) {
    case v1::GenerateRequest::kPrompt:
      if (r.prompt().empty()) return Invalid("prompt: must not be empty");
      break;
    case v1::GenerateRequest::kPromptIds:
      if (absl::Status s = ValidatePrompt(r.prompt_ids().ids(), "prompt_ids.ids", limits);
          !s.ok()) {
        return s;
      }
      break;
    default:
      return Invalid("prompt: set prompt or prompt_ids");
  }
  if (r.max_new_tokens() > static_cast<uint32_t>(limits.max_new_tokens_limit)) {
    return Invalid(absl::StrCat("max_new_tokens: ", r.max_new_tokens(), " exceeds the limit ",
                                limits.max_new_tokens_limit));
  }
  if (r.has_temperature() && !(std::isfinite(r.temperature()) && r.temperature() >= 0.0f)) {
    return Invalid(
        absl::StrCat("temperature: must be a finite number >= 0, got ", r.temperature()));
  }
  if (r.has_top_p() && !(r.top_p() > 0.0f && r.top_p() <= 1.0f)) {
    return Invalid(absl::StrCat("top_p: must be in (0, 1], got ", r.top_p()));
  }
  if (r.has_top_k() && r.top_k() < 0) {
    return Invalid(absl::StrCat("top_k: must be >= 0 (0 = no limit), got ", r.top_k()));
  }
  if (absl::Status s = CheckTokenIds(r.stop_token_ids(), limits.vocab_size, "stop_token_ids"); !s.ok()) {
    return s;
  }
  if (r.stop_size() > limits.max_stop_strings) {
    return Invalid(absl::StrCat("stop: at most ", limits.max_stop_strings, " stop strings, got ",
                                r.stop_size()));
  }
  for (int i = 0; i < r.stop_size(); ++i) {
    if (r.stop(i).empty()) return Invalid(absl::StrCat("stop[", i, "]: must not be empty"));
    if (r.stop(i).size() > static_cast<size_t>(limits.max_stop_bytes)) {
      return Invalid(absl::StrCat("stop[", i, "]: longer than ", limits.max_stop_bytes, " bytes"));
    }
  }
  if (r.request_id().size() > kMaxRequestIdBytes) {
    return Invalid(absl::StrCat("request_id: ", r.request_id().size(), " bytes; at most ",
                                kMaxRequestIdBytes));
  }
  if (!v1::Speculation_IsValid(r.speculation())) {
    return Invalid(absl::StrCat("speculation: unknown value ", r.speculation()));
  }
  // The logits processors: the engine's own checks, whose messages name these same fields.
  SamplingParams processors;
  processors.min_p = r.min_p();
  processors.logit_bias.assign(r.logit_bias().begin(), r.logit_bias().end());
  processors.repetition_penalty = r.has_repetition_penalty() ? r.repetition_penalty() : 1.0f;
  processors.presence_penalty = r.presence_penalty();
  processors.frequency_penalty = r.frequency_penalty();
  if (absl::Status s = ValidateSamplingParams(processors, limits.vocab_size); !s.ok()) return s;
  if (r.min_tokens() > static_cast<uint32_t>(limits.max_new_tokens_limit)) {
    return Invalid(absl::StrCat("min_tokens: ", r.min_tokens(), " exceeds the limit ",
                                limits.max_new_tokens_limit));
  }
  if (r.max_new_tokens() > 0 && r.min_tokens() > r.max_new_tokens()) {
    return Invalid(absl::StrCat("min_tokens: ", r.min_tokens(), " exceeds max_new_tokens ",
                                r.max_new_tokens()));
  }
  if (r.has_logprobs() && r.logprobs() > static_cast<uint32_t>(kMaxLogprobs)) {
    return Invalid(absl::StrCat("logprobs: ", r.logprobs(), " exceeds ", kMaxLogprobs,
                                " (the most top alternatives returned per token)"));
  }
  if (!v1::LogprobsSource_IsValid(r.logprobs_source())) {
    return Invalid(absl::StrCat("logprobs_source: unknown value ", r.logprobs_source()));
  }
  if (r.n() > static_cast<uint32_t>(kMaxSamplesPerRequest)) {
    return Invalid(
        absl::StrCat("n: ", r.n(), " exceeds ", kMaxSamplesPerRequest, " samples per request"));
  }
  if (r.draft_max_nodes() > static_cast<uint32_t>(kMaxTreeNodes)) {
    return Invalid(absl::StrCat("draft_max_nodes: ", r.draft_max_nodes(), " exceeds ",
                                kMaxTreeNodes, " (the largest tree a verifier accepts)"));
  }
  if (r.draft_depth() > static_cast<uint32_t>(kMaxTreeNodes)) {
    return Invalid(absl::StrCat("draft_depth: ", r.draft_depth(), " exceeds ", kMaxTreeNodes));
  }
  if (r.draft_top_k() > static_cast<uint32_t>(kMaxTreeNodes)) {
    return Invalid(absl::StrCat("draft_top_k: ", r.draft_top_k(), " exceeds ", kMaxTreeNodes));
  }
  return absl::OkStatus();
}

absl::Status ValidatePrompt(absl::Span<const int32_t> prompt, const char* field,
                            const RequestLimits& limits) {
  if (prompt.empty()) return Invalid(absl::StrCat(field, ": must not be empty"));
  if (absl::Status s = CheckTokenIds(prompt, limits.vocab_size, field); !s.ok()) return s;
  if (static_cast<int64_t>(prompt.size()) >= limits.max_context) {
    return Invalid(absl::StrCat(field, ": the prompt is ", prompt.size(),
                                " tokens; the model's context holds ", limits.max_context,
                                " and at least one must be left to generate"));
  }
  return absl::OkStatus();
}

RouterRequest ResolveRequest(const v1::GenerateRequest& r, const RequestLimits& limits,
                             uint64_t random_seed) {
  RouterRequest out;
  out.request_id = absl::CHexEscape(r.request_id());
  out.max_new_tokens =
      r.max_new_tokens() > 0 ? static_cast<int>(r.max_new_tokens()) : limits.default_max_new_tokens;
  out.sampling.temperature = r.has_temperature() ? r.temperature() : 0.0f;
  out.sampling.top_p = r.has_top_p() ? r.top_p() : 1.0f;
  out.sampling.top_k = r.has_top_k() ? r.top_k() : 0;
  // Every sampled request gets a seed, so its tokens depend only on (prefix, seed, position)
  // and stay the same whatever is batched with it or however much is speculated.
  out.sampling.seed = r.has_seed() ? r.seed() : random_seed;
  out.sampling.min_p = r.min_p();
  // Sorted, so the wire form (and anything logged) does not depend on the map's order.
  out.sampling.logit_bias.assign(r.logit_bias().begin(), r.logit_bias().end());
  std::sort(out.sampling.logit_bias.begin(), out.sampling.logit_bias.end());
  out.sampling.repetition_penalty = r.has_repetition_penalty() ? r.repetition_penalty() : 1.0f;
  out.sampling.presence_penalty = r.presence_penalty();
  out.sampling.frequency_penalty = r.frequency_penalty();
  out.sampling.min_tokens = static_cast<int>(r.min_tokens());
  out.logprobs = r.has_logprobs() ? static_cast<int>(r.logprobs()) : -1;
  out.logprobs_mode = r.logprobs_source() == v1::LOGPROBS_SOURCE_PROCESSED
                          ? LogprobsMode::kProcessed
                          : LogprobsMode::kRaw;
  out.stop_token_ids.assign(r.stop_token_ids().begin(), r.stop_token_ids().end());
  out.stop.assign(r.stop().begin(), r.stop().end());
  out.ignore_eos = r.ignore_eos();
  out.speculation =
      r.speculation() == v1::SPECULATION_AUTO ? limits.default_speculation : r.speculation();
  out.shape.depth =
      r.draft_depth() > 0 ? static_cast<int>(r.draft_depth()) : limits.default_shape.depth;
  out.shape.top_k =
      r.draft_top_k() > 0 ? static_cast<int>(r.draft_top_k()) : limits.default_shape.top_k;
  out.shape.max_nodes = r.draft_max_nodes() > 0 ? static_cast<int>(r.draft_max_nodes())
                                                : limits.default_shape.max_nodes;
  out.shape_explicit = r.draft_depth() > 0 || r.draft_top_k() > 0 || r.draft_max_nodes() > 0;
  return out;
}

}  // namespace specd
