// Plain request and result types of the specd C++ SDK: what specd::Client takes and returns
// instead of protobuf messages, so that including the SDK does not pull in generated code.
// The fields mirror specd.v1.GenerateRequest / GenerateResponse / ModelInfo
// (proto/specd/v1/generation.proto); range checks are the router's, which answers a bad value
// with INVALID_ARGUMENT and a message that starts with the field's name.
#ifndef SPECD_CLIENTS_CPP_INCLUDE_SPECD_TYPES_H_
#define SPECD_CLIENTS_CPP_INCLUDE_SPECD_TYPES_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace specd {

// How the router drafts for a request.
enum class Speculation {
  kAuto = 0,        // the router's default drafter; target-only when none answers
  kOff = 1,         // target-only decoding
  kDraftModel = 2,  // the draft service's draft model
  kNgram = 3,       // n-gram prompt lookup
  kEagle3 = 4,      // the draft service's EAGLE-3 head, fed with the target's hidden states
};

// "auto", "off", "draft_model", "ngram", "eagle3".
const char* SpeculationName(Speculation speculation);
// The inverse of SpeculationName ("draft-model" is accepted too); nullopt for anything else.
std::optional<Speculation> ParseSpeculation(std::string_view name);

enum class FinishReason {
  kUnspecified = 0,  // not the last chunk
  kLength = 1,       // max_new_tokens reached
  kEos = 2,          // the model's end-of-sequence token
  kStopToken = 3,    // one of stop_token_ids
  kStopString = 4,   // one of stop
  kContext = 5,      // the model's context is full
};

// "unspecified", "length", "eos", "stop_token", "stop_string", "context" (the Python SDK's
// names).
const char* FinishReasonName(FinishReason reason);

struct GenerateRequest {
  // The prompt: text (tokenized by the router) or, when prompt_ids is not empty, token ids.
  // Giving both is INVALID_ARGUMENT.
  std::string prompt;
  std::vector<int32_t> prompt_ids;
  uint32_t max_new_tokens = 0;  // 0: the router's default
  // Unset: the router's defaults (greedy, no top-p/top-k cut, a random seed).
  std::optional<float> temperature;
  std::optional<float> top_p;
  std::optional<int32_t> top_k;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;  // stop strings, never part of the output
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  Speculation speculation = Speculation::kAuto;
  // Draft tree shape; 0: the router's default.
  uint32_t draft_depth = 0;
  uint32_t draft_top_k = 0;
  uint32_t draft_max_nodes = 0;
  std::string request_id;  // echoed in the router's logs

  // Logits processors (docs/sampling.md); lossless under speculation.
  float min_p = 0.0f;                                 // [0, 1]; 0 = off
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token id, bias in [-100, 100])
  std::optional<float> repetition_penalty;            // > 0; unset = 1 (off)
  float presence_penalty = 0.0f;                      // [-2, 2]
  float frequency_penalty = 0.0f;                     // [-2, 2]
  uint32_t min_tokens = 0;  // EOS and stop_token_ids held back until this many tokens
  // Log-probabilities of the emitted tokens: unset = none; 0 = each token's own; n in [1, 20]
  // = also the n most likely alternatives. Raw (the model's log_softmax) unless
  // processed_logprobs (the distribution the token was drawn from).
  std::optional<uint32_t> logprobs;
  bool processed_logprobs = false;
  // Independent samples (sample i uses seed + i). Generate() returns one completion and so
  // takes n <= 1; Stream() gives every sample's chunks, told apart by Chunk::index.
  uint32_t n = 0;
};

// One alternative at a position (TokenLogprob::top).
struct TopLogprob {
  int32_t token_id = 0;
  std::string token;  // its text alone
  float logprob = 0.0f;
};

// One emitted token's log-probability under the target.
struct TokenLogprob {
  int32_t token_id = 0;
  std::string token;
  float logprob = 0.0f;
  uint32_t rank = 0;            // 1 + the number of tokens with a strictly higher log-probability
  std::vector<TopLogprob> top;  // most likely first
};

struct Usage {
  uint32_t prompt_tokens = 0;
  uint32_t completion_tokens = 0;  // every token generated, stop tokens included
};

// Speculation counters of one request (docs/metrics.md has the definitions).
struct SpeculationStats {
  uint64_t steps = 0;            // verify steps that carried a draft tree
  uint64_t draft_tokens = 0;     // draft nodes sent to verify
  uint64_t accepted_tokens = 0;  // draft tokens accepted (bonus tokens not counted)
  std::vector<uint64_t> accepted_per_position;
  uint64_t target_only_steps = 0;         // verify steps without a draft
  Speculation mode = Speculation::kAuto;  // what was used in the end
  uint64_t shape_changes = 0;  // steps whose tree shape differed from the previous step's

  // accepted / draft tokens; nullopt when no draft token was sent.
  std::optional<double> acceptance_rate() const;
  // Tokens emitted per speculative step, bonus included: 1 + accepted / steps; nullopt
  // without speculative steps.
  std::optional<double> mean_accepted_length() const;
};

// One streamed piece of a completion. finish_reason, usage, speculation and matched_stop are
// set on the last chunk only.
struct Chunk {
  std::vector<int32_t> token_ids;
  std::string text;  // whole UTF-8 characters only
  FinishReason finish_reason = FinishReason::kUnspecified;
  Usage usage;
  SpeculationStats speculation;
  std::string matched_stop;            // the stop string that ended generation (kStopString)
  std::vector<TokenLogprob> logprobs;  // one per token id, when the request asked
  uint32_t index = 0;                  // which of the request's n samples

  bool last() const { return finish_reason != FinishReason::kUnspecified; }
};

// A whole completion: the chunks joined.
struct Completion {
  std::string text;
  std::vector<int32_t> token_ids;
  FinishReason finish_reason = FinishReason::kUnspecified;
  Usage usage;
  SpeculationStats speculation;
  std::string matched_stop;
  std::vector<TokenLogprob> logprobs;  // one per token id, when the request asked
};

struct ModelInfo {
  std::string target_model;
  std::string draft_model;
  uint32_t vocab_size = 0;
  uint32_t max_context = 0;
  std::vector<int32_t> eos_token_ids;
  uint32_t max_new_tokens_limit = 0;
  bool draft_available = false;
  // Whether the verify service's backend serves logprobs, and min_p, logit_bias, min_tokens and
  // the penalties; a request for one it lacks fails with UNIMPLEMENTED naming the field.
  bool supports_logprobs = false;
  bool supports_logits_processors = false;
  // Whether the router's model folder has a chat template, and where: "chat_template.jinja" or
  // "tokenizer_config.json" (empty without one). The router does not render it.
  bool has_chat_template = false;
  std::string chat_template_source;
  // The speculation modes a request can get now (kAuto, kOff and kNgram always; kDraftModel
  // and kEagle3 while a draft service that has them is up). An unavailable mode is not refused:
  // the request runs target-only, with the same output.
  std::vector<Speculation> speculation_modes;
};

}  // namespace specd

#endif  // SPECD_CLIENTS_CPP_INCLUDE_SPECD_TYPES_H_
