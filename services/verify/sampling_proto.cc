#include "services/verify/sampling_proto.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"

namespace specd {

absl::Status SamplingFromProto(const v1::SamplingParams& proto,
                               absl::Span<const int32_t> eos_token_ids, int vocab_size,
                               SamplingParams* out) {
  SamplingParams p;
  p.temperature = proto.temperature();
  p.top_k = proto.top_k();
  p.top_p = proto.has_top_p() ? proto.top_p() : 1.0f;
  p.seed = proto.seed();
  p.min_p = proto.min_p();
  // A map's order is unspecified; sorted ids make the processing order reproducible.
  for (const auto& [id, bias] : proto.logit_bias()) p.logit_bias.emplace_back(id, bias);
  std::sort(p.logit_bias.begin(), p.logit_bias.end());
  p.repetition_penalty = proto.has_repetition_penalty() ? proto.repetition_penalty() : 1.0f;
  p.presence_penalty = proto.presence_penalty();
  p.frequency_penalty = proto.frequency_penalty();
  if (proto.min_tokens() > static_cast<uint32_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_tokens: ", proto.min_tokens(), " is too large"));
  }
  p.min_tokens = static_cast<int>(proto.min_tokens());
  for (int i = 0; i < proto.stop_token_ids_size(); ++i) {
    const int32_t id = proto.stop_token_ids(i);
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("stop_token_ids[", i, "]: token id ", id,
                                                     " is outside the vocabulary [0, ",
                                                     vocab_size, ")"));
    }
  }
  if (p.min_tokens > 0) {
    p.min_tokens_stop_ids.assign(eos_token_ids.begin(), eos_token_ids.end());
    for (int32_t id : proto.stop_token_ids()) {
      if (std::find(p.min_tokens_stop_ids.begin(), p.min_tokens_stop_ids.end(), id) ==
          p.min_tokens_stop_ids.end()) {
        p.min_tokens_stop_ids.push_back(id);
      }
    }
  }
  if (absl::Status s = ValidateSamplingParams(p, vocab_size); !s.ok()) return s;
  *out = std::move(p);
  return absl::OkStatus();
}

void SamplingToProto(const SamplingParams& params, absl::Span<const int32_t> stop_token_ids,
                     v1::SamplingParams* proto) {
  proto->Clear();
  proto->set_temperature(params.temperature);
  proto->set_top_k(params.top_k);
  proto->set_top_p(params.top_p);
  proto->set_seed(params.seed);
  proto->set_min_p(params.min_p);
  for (const auto& [id, bias] : params.logit_bias) (*proto->mutable_logit_bias())[id] = bias;
  if (params.repetition_penalty != 1.0f) proto->set_repetition_penalty(params.repetition_penalty);
  proto->set_presence_penalty(params.presence_penalty);
  proto->set_frequency_penalty(params.frequency_penalty);
  if (params.min_tokens > 0) {
    proto->set_min_tokens(static_cast<uint32_t>(params.min_tokens));
    proto->mutable_stop_token_ids()->Assign(stop_token_ids.begin(), stop_token_ids.end());
  }
}

void LogprobsToProto(const TokenLogprobs& logprobs, v1::TokenLogprobs* proto) {
  proto->set_logprob(logprobs.logprob);
  proto->set_rank(static_cast<uint32_t>(logprobs.rank));
  for (const TokenLogprob& t : logprobs.top) {
    proto->add_top_tokens(t.token);
    proto->add_top_logprobs(t.logprob);
  }
}

TokenLogprobs LogprobsFromProto(const v1::TokenLogprobs& proto) {
  TokenLogprobs out;
  out.logprob = proto.logprob();
  out.rank = static_cast<int32_t>(proto.rank());
  const int n = std::min(proto.top_tokens_size(), proto.top_logprobs_size());
  for (int i = 0; i < n; ++i) out.top.push_back({proto.top_tokens(i), proto.top_logprobs(i)});
  return out;
}

}  // namespace specd
