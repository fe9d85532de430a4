#include "convert.h"

namespace specd {
namespace client_internal {
namespace {

v1::Speculation ToProto(Speculation s) {
  switch (s) {
    case Speculation::kOff: return v1::SPECULATION_OFF;
    case Speculation::kDraftModel: return v1::SPECULATION_DRAFT_MODEL;
    case Speculation::kNgram: return v1::SPECULATION_NGRAM;
    case Speculation::kEagle3: return v1::SPECULATION_EAGLE3;
    case Speculation::kAuto: break;
  }
  return v1::SPECULATION_AUTO;
}

// An unknown value from a newer router reads as the default rather than being cast blindly.
Speculation FromProto(v1::Speculation s) {
  switch (s) {
    case v1::SPECULATION_OFF: return Speculation::kOff;
    case v1::SPECULATION_DRAFT_MODEL: return Speculation::kDraftModel;
    case v1::SPECULATION_NGRAM: return Speculation::kNgram;
    case v1::SPECULATION_EAGLE3: return Speculation::kEagle3;
    default: return Speculation::kAuto;
  }
}

FinishReason FromProto(v1::FinishReason r) {
  switch (r) {
    case v1::FINISH_REASON_LENGTH: return FinishReason::kLength;
    case v1::FINISH_REASON_EOS: return FinishReason::kEos;
    case v1::FINISH_REASON_STOP_TOKEN: return FinishReason::kStopToken;
    case v1::FINISH_REASON_STOP_STRING: return FinishReason::kStopString;
    case v1::FINISH_REASON_CONTEXT: return FinishReason::kContext;
    default: return FinishReason::kUnspecified;
  }
}

}  // namespace

absl::StatusOr<v1::GenerateRequest> ToProto(const GenerateRequest& request) {
  v1::GenerateRequest out;
  if (!request.prompt_ids.empty()) {
    if (!request.prompt.empty()) {
      return absl::InvalidArgumentError(
          "prompt_ids: give either prompt (text) or prompt_ids (token ids), not both");
    }
    out.mutable_prompt_ids()->mutable_ids()->Assign(request.prompt_ids.begin(),
                                                    request.prompt_ids.end());
  } else {
    out.set_prompt(request.prompt);
  }
  out.set_max_new_tokens(request.max_new_tokens);
  if (request.temperature.has_value()) out.set_temperature(*request.temperature);
  if (request.top_p.has_value()) out.set_top_p(*request.top_p);
  if (request.top_k.has_value()) out.set_top_k(*request.top_k);
  if (request.seed.has_value()) out.set_seed(*request.seed);
  out.mutable_stop_token_ids()->Assign(request.stop_token_ids.begin(),
                                       request.stop_token_ids.end());
  for (const std::string& s : request.stop) out.add_stop(s);
  out.set_ignore_eos(request.ignore_eos);
  out.set_speculation(ToProto(request.speculation));
  out.set_draft_depth(request.draft_depth);
  out.set_draft_top_k(request.draft_top_k);
  out.set_draft_max_nodes(request.draft_max_nodes);
  out.set_request_id(request.request_id);
  out.set_min_p(request.min_p);
  for (const auto& [id, bias] : request.logit_bias) (*out.mutable_logit_bias())[id] = bias;
  if (request.repetition_penalty.has_value()) {
    out.set_repetition_penalty(*request.repetition_penalty);
  }
  out.set_presence_penalty(request.presence_penalty);
  out.set_frequency_penalty(request.frequency_penalty);
  out.set_min_tokens(request.min_tokens);
  if (request.logprobs.has_value()) out.set_logprobs(*request.logprobs);
  out.set_logprobs_source(request.processed_logprobs ? v1::LOGPROBS_SOURCE_PROCESSED
                                                     : v1::LOGPROBS_SOURCE_RAW);
  out.set_n(request.n);
  return out;
}

Chunk FromProto(const v1::GenerateResponse& response) {
  Chunk chunk;
  chunk.token_ids.assign(response.token_ids().begin(), response.token_ids().end());
  chunk.text = response.text();
  chunk.finish_reason = FromProto(response.finish_reason());
  chunk.index = response.index();
  for (const v1::TokenLogprob& lp : response.logprobs()) {
    TokenLogprob& out = chunk.logprobs.emplace_back();
    out.token_id = lp.token_id();
    out.token = lp.token();
    out.logprob = lp.logprob();
    out.rank = lp.rank();
    for (const v1::TopLogprob& t : lp.top_logprobs()) {
      out.top.push_back({t.token_id(), t.token(), t.logprob()});
    }
  }
  if (chunk.last()) {
    chunk.usage.prompt_tokens = response.usage().prompt_tokens();
    chunk.usage.completion_tokens = response.usage().completion_tokens();
    const v1::SpeculationStats& s = response.speculation();
    chunk.speculation.steps = s.steps();
    chunk.speculation.draft_tokens = s.draft_tokens();
    chunk.speculation.accepted_tokens = s.accepted_tokens();
    chunk.speculation.accepted_per_position.assign(s.accepted_per_position().begin(),
                                                   s.accepted_per_position().end());
    chunk.speculation.target_only_steps = s.target_only_steps();
    chunk.speculation.mode = FromProto(s.mode());
    chunk.speculation.shape_changes = s.shape_changes();
    chunk.matched_stop = response.matched_stop();
  }
  return chunk;
}

ModelInfo FromProto(const v1::ModelInfo& info) {
  ModelInfo out;
  out.target_model = info.target_model();
  out.draft_model = info.draft_model();
  out.vocab_size = info.vocab_size();
  out.max_context = info.max_context();
  out.eos_token_ids.assign(info.eos_token_ids().begin(), info.eos_token_ids().end());
  out.max_new_tokens_limit = info.max_new_tokens_limit();
  out.draft_available = info.draft_available();
  out.supports_logprobs = info.supports_logprobs();
  out.supports_logits_processors = info.supports_logits_processors();
  out.has_chat_template = info.has_chat_template();
  out.chat_template_source = info.chat_template_source();
  for (int mode : info.speculation_modes()) {
    // A mode newer than this SDK is left out rather than shown as another.
    if (v1::Speculation_IsValid(mode)) {
      out.speculation_modes.push_back(FromProto(static_cast<v1::Speculation>(mode)));
    }
  }
  return out;
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

}  // namespace client_internal
}  // namespace specd
