#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "specd/kernels/philox.h"

namespace specd {

namespace {

constexpr float kMaxLogitBias = 100.0f;  // OpenAI's range
constexpr float kMaxPenalty = 2.0f;      // presence / frequency, OpenAI's and vLLM's range

bool Finite(float x) { return std::isfinite(x); }

}  // namespace

absl::Status ValidateSamplingParams(const SamplingParams& p, int vocab_size) {
  if (!(p.temperature >= 0.0f) || std::isinf(p.temperature)) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature: ", p.temperature, " must be a finite number >= 0"));
  }
  if (p.top_k < 0) {
    return absl::InvalidArgumentError(absl::StrCat("top_k: ", p.top_k, " must be >= 0"));
  }
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p: ", p.top_p, " must be in (0, 1]"));
  }
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("min_p: ", p.min_p, " must be in [0, 1]"));
  }
  if (!(p.repetition_penalty > 0.0f) || !Finite(p.repetition_penalty)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "repetition_penalty: ", p.repetition_penalty, " must be a finite number > 0"));
  }
  if (!(std::fabs(p.presence_penalty) <= kMaxPenalty)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "presence_penalty: ", p.presence_penalty, " must be in [-2, 2]"));
  }
  if (!(std::fabs(p.frequency_penalty) <= kMaxPenalty)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "frequency_penalty: ", p.frequency_penalty, " must be in [-2, 2]"));
  }
  if (p.min_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_tokens: ", p.min_tokens, " must be >= 0"));
  }
  auto check_id = [&](int32_t id, const std::string& field) {
    if (id < 0 || (vocab_size > 0 && id >= vocab_size)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": token id ", id, " is outside the vocabulary",
                       vocab_size > 0 ? absl::StrCat(" [0, ", vocab_size, ")") : ""));
    }
    return absl::OkStatus();
  };
  absl::flat_hash_set<int32_t> biased;
  for (const auto& [id, bias] : p.logit_bias) {
    const std::string field = absl::StrCat("logit_bias[", id, "]");
    if (absl::Status s = check_id(id, field); !s.ok()) return s;
    if (!(std::fabs(bias) <= kMaxLogitBias)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": bias ", bias, " must be in [-100, 100]"));
    }
    if (!biased.insert(id).second) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": token id listed twice"));
    }
  }
  for (size_t i = 0; i < p.min_tokens_stop_ids.size(); ++i) {
    if (absl::Status s =
            check_id(p.min_tokens_stop_ids[i], absl::StrCat("min_tokens_stop_ids[", i, "]"));
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

double PhiloxUniform(uint64_t seed, uint64_t position, uint32_t index) {
  return PhiloxUniform01(seed, position, index);
}

// ---------------------------------------------------------------------------------------------
// History and logits processors.

void TokenHistory::AddPrompt(absl::Span<const int32_t> tokens) {
  for (int32_t t : tokens) tokens_[t].in_prompt = true;
}

void TokenHistory::AddOutput(absl::Span<const int32_t> tokens) {
  for (int32_t t : tokens) ++tokens_[t].output;
  output_length_ += static_cast<int64_t>(tokens.size());
}

void TokenHistory::RemoveOutput(absl::Span<const int32_t> tokens) {
  for (int32_t t : tokens) {
    auto it = tokens_.find(t);
    if (it == tokens_.end() || it->second.output == 0) continue;
    if (--it->second.output == 0 && !it->second.in_prompt) tokens_.erase(it);
  }
  output_length_ = std::max<int64_t>(0, output_length_ - static_cast<int64_t>(tokens.size()));
}

namespace {

// Step 3 for one token: `seen` (in the prompt or the output) and its output count. The same
// float expressions as vLLM's apply_penalties, so results match it, and each token is changed
// once from its final count, so the order in which tokens are visited does not matter.
float Penalize(float logit, bool seen, int32_t count, const SamplingParams& p) {
  if (seen && p.repetition_penalty != 1.0f) {
    logit = logit > 0.0f ? logit / p.repetition_penalty : logit * p.repetition_penalty;
  }
  if (count > 0) {
    logit -= p.frequency_penalty * static_cast<float>(count);
    logit -= p.presence_penalty;
  }
  return logit;
}

}  // namespace

void ProcessLogits(absl::Span<const float> logits, const SamplingParams& p,
                   const TokenHistory* history, absl::Span<const int32_t> path,
                   std::vector<float>* out) {
  out->assign(logits.begin(), logits.end());
  float* l = out->data();
  const int64_t output_length =
      (history != nullptr ? history->output_length() : 0) + static_cast<int64_t>(path.size());
  if (output_length < p.min_tokens) {
    for (int32_t id : p.min_tokens_stop_ids) l[id] = -std::numeric_limits<float>::infinity();
  }
  for (const auto& [id, bias] : p.logit_bias) l[id] += bias;
  if (!p.has_penalties()) return;
  // The path is short (a tree's depth): count it in a small map, then visit every token of the
  // history once with its count over history and path, then the path's tokens the history lacks.
  absl::flat_hash_map<int32_t, int32_t> on_path;
  for (int32_t t : path) ++on_path[t];
  if (history != nullptr) {
    for (const auto& [id, counts] : history->tokens()) {
      int32_t count = counts.output;
      if (auto it = on_path.find(id); it != on_path.end()) count += it->second;
      l[id] = Penalize(l[id], counts.in_prompt || count > 0, count, p);
    }
  }
  for (const auto& [id, count] : on_path) {
    if (history != nullptr && history->tokens().contains(id)) continue;
    l[id] = Penalize(l[id], true, count, p);
  }
}

// ---------------------------------------------------------------------------------------------
// Sampling.

namespace {

int32_t Argmax(absl::Span<const float> logits) {
  int32_t best = 0;
  for (int32_t i = 1; i < static_cast<int32_t>(logits.size()); ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return best;
}

// Tokens kept by min-p, top-k and top-p; `all` means no filter.
struct Kept {
  bool all = true;
  std::vector<int32_t> ids;
};

Kept Filter(absl::Span<const float> logits, const SamplingParams& p) {
  Kept kept;
  const int vocab = static_cast<int>(logits.size());
  const bool use_min_p = p.min_p > 0.0f;
  const bool use_k = p.top_k > 0 && p.top_k < vocab;
  const bool use_p = p.top_p < 1.0f;
  if (!use_min_p && !use_k && !use_p) return kept;
  kept.all = false;
  const double inv_t = 1.0 / p.temperature;
  std::vector<int32_t> order;
  if (use_min_p) {
    // p_i >= min_p * p_max, i.e. exp((l_i - l_max) / T) >= min_p: a prefix of the descending
    // order, never empty (the argmax passes).
    const double max_l = logits[Argmax(logits)];
    for (int32_t id = 0; id < vocab; ++id) {
      if (std::exp((logits[id] - max_l) * inv_t) >= p.min_p) order.push_back(id);
    }
  } else {
    order.resize(vocab);
    std::iota(order.begin(), order.end(), 0);
  }
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  const int n = static_cast<int>(order.size());
  const int k = use_k ? std::min(p.top_k, n) : n;
  std::partial_sort(order.begin(), order.begin() + k, order.end(), by_logit);
  order.resize(k);
  if (use_p) {
    const double max_l = logits[order[0]];
    std::vector<double> w(k);
    double total = 0;
    for (int i = 0; i < k; ++i) {
      w[i] = std::exp((logits[order[i]] - max_l) * inv_t);
      total += w[i];
    }
    double cum = 0;
    int keep = 0;
    while (keep < k) {
      cum += w[keep] / total;
      ++keep;
      if (cum >= p.top_p) break;
    }
    order.resize(keep);
  }
  kept.ids = std::move(order);
  return kept;
}

std::vector<int32_t> KeptIds(absl::Span<const float> logits, const SamplingParams& p) {
  Kept kept = Filter(logits, p);
  if (kept.all) {
    kept.ids.resize(logits.size());
    std::iota(kept.ids.begin(), kept.ids.end(), 0);
  }
  return std::move(kept.ids);
}

}  // namespace

int32_t SampleToken(absl::Span<const float> logits, const SamplingParams& p, int64_t position) {
  if (p.greedy()) return Argmax(logits);
  const Kept kept = Filter(logits, p);
  const double inv_t = 1.0 / p.temperature;
  int32_t best = -1;
  double best_score = -std::numeric_limits<double>::infinity();
  auto consider = [&](int32_t id) {
    const double u = PhiloxUniform01(p.seed, static_cast<uint64_t>(position),
                                     static_cast<uint32_t>(id));
    const double score = logits[id] * inv_t - std::log(-std::log(u));
    if (best < 0 || score > best_score) {
      best = id;
      best_score = score;
    }
  };
  if (kept.all) {
    for (int32_t id = 0; id < static_cast<int32_t>(logits.size()); ++id) consider(id);
  } else {
    for (int32_t id : kept.ids) consider(id);
  }
  return best;
}

std::vector<double> TargetDistribution(absl::Span<const float> logits, const SamplingParams& p) {
  std::vector<double> dist(logits.size(), 0.0);
  if (p.greedy()) {
    dist[Argmax(logits)] = 1.0;
    return dist;
  }
  const std::vector<int32_t> ids = KeptIds(logits, p);
  double max_l = -std::numeric_limits<double>::infinity();
  for (int32_t id : ids) max_l = std::max<double>(max_l, logits[id]);
  double total = 0;
  for (int32_t id : ids) {
    dist[id] = std::exp((logits[id] - max_l) / p.temperature);
    total += dist[id];
  }
  for (double& d : dist) d /= total;
  return dist;
}

// ---------------------------------------------------------------------------------------------
// Log-probabilities.

namespace {

// log_softmax(logits * scale) over `ids` (all tokens when empty) in double; -inf elsewhere.
std::vector<double> LogSoftmax(absl::Span<const float> logits, double scale,
                               const std::vector<int32_t>* ids) {
  const int vocab = static_cast<int>(logits.size());
  std::vector<double> lp(vocab, -std::numeric_limits<double>::infinity());
  double max_l = -std::numeric_limits<double>::infinity();
  auto each = [&](auto&& fn) {
    if (ids == nullptr) {
      for (int32_t id = 0; id < vocab; ++id) fn(id);
    } else {
      for (int32_t id : *ids) fn(id);
    }
  };
  each([&](int32_t id) { max_l = std::max<double>(max_l, logits[id]); });
  double total = 0;
  each([&](int32_t id) { total += std::exp((logits[id] - max_l) * scale); });
  const double log_total = std::log(total);
  each([&](int32_t id) { lp[id] = (logits[id] - max_l) * scale - log_total; });
  return lp;
}

}  // namespace

TokenLogprobs ComputeLogprobs(absl::Span<const float> raw, absl::Span<const float> processed,
                              const SamplingParams& params, LogprobsMode mode, int32_t token,
                              int n) {
  std::vector<double> lp;
  if (mode == LogprobsMode::kRaw || params.greedy()) {
    lp = LogSoftmax(mode == LogprobsMode::kRaw ? raw : processed, 1.0, nullptr);
  } else {
    const std::vector<int32_t> ids = KeptIds(processed, params);
    lp = LogSoftmax(processed, 1.0 / params.temperature, &ids);
  }
  TokenLogprobs out;
  const double mine = lp[token];
  out.logprob = static_cast<float>(mine);
  int32_t higher = 0;
  for (double v : lp) higher += v > mine;
  out.rank = higher + 1;
  if (n <= 0) return out;
  std::vector<int32_t> order(lp.size());
  std::iota(order.begin(), order.end(), 0);
  const int k = std::min<int>(n, static_cast<int>(order.size()));
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
    return lp[a] > lp[b] || (lp[a] == lp[b] && a < b);
  });
  for (int i = 0; i < k; ++i) {
    if (std::isinf(lp[order[i]])) break;  // probability 0: filtered out or masked
    out.top.push_back({order[i], static_cast<float>(lp[order[i]])});
  }
  return out;
}

}  // namespace specd
