// A generation request as the router's scheduler sees it: validated, tokenized, with every
// default resolved. Built by request_validation from the public GenerateRequest.
#ifndef SPECD_SERVICES_ROUTER_REQUEST_H_
#define SPECD_SERVICES_ROUTER_REQUEST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "engine/sampling.h"
#include "specd/v1/generation.pb.h"

namespace specd {

struct DraftShape {
  int depth = 4;
  int top_k = 4;
  int max_nodes = 16;
};

// What a request may ask for; from the router's flags and the target model.
struct RequestLimits {
  int vocab_size = 0;
  int max_context = 0;  // tokens of prompt + output the target holds
  std::vector<int32_t> eos_token_ids;
  int max_new_tokens_limit = 4096;
  int default_max_new_tokens = 256;
  DraftShape default_shape;
  v1::Speculation default_speculation = v1::SPECULATION_AUTO;
  // Bounds on the stop strings a request may carry (they are matched on every token).
  int max_stop_strings = 16;
  int max_stop_bytes = 256;
};

// The most samples one request may ask for (GenerateRequest.n).
inline constexpr int kMaxSamplesPerRequest = 16;

// request_id is only echoed in logs; a bound keeps one request from growing the log by
// megabytes.
inline constexpr size_t kMaxRequestIdBytes = 128;

struct RouterRequest {
  // The client's request_id C-escaped (a newline in it cannot forge a log line): it is only
  // ever logged.
  std::string request_id;
  std::vector<int32_t> prompt;
  int max_new_tokens = 0;
  // Seed already drawn for unseeded sampling requests. min_tokens_stop_ids stays empty: the
  // verify service completes it with its model's EOS ids and stop_token_ids.
  SamplingParams sampling;
  // Log-probabilities to return: -1 none, 0 the emitted tokens' own, n also the top n.
  int logprobs = -1;
  LogprobsMode logprobs_mode = LogprobsMode::kRaw;
  std::vector<int32_t> stop_token_ids;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  // AUTO only when the router's default is AUTO too: the draft model while the draft service
  // is up, else target-only.
  v1::Speculation speculation = v1::SPECULATION_AUTO;
  DraftShape shape;
  // The request named its tree shape (draft_depth, draft_top_k or draft_max_nodes): it gets
  // exactly that shape every step; otherwise the router's goodput policy chooses.
  bool shape_explicit = false;
  absl::Time arrival;
  absl::Time deadline = absl::InfiniteFuture();
};

}  // namespace specd

#endif  // SPECD_SERVICES_ROUTER_REQUEST_H_
