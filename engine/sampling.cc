#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "specd/kernels/philox.h"

namespace specd {

absl::Status ValidateSamplingParams(const SamplingParams& p) {
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
  return absl::OkStatus();
}

double PhiloxUniform(uint64_t seed, uint64_t position, uint32_t index) {
  return PhiloxUniform01(seed, position, index);
}

namespace {

int32_t Argmax(absl::Span<const float> logits) {
  int32_t best = 0;
  for (int32_t i = 1; i < static_cast<int32_t>(logits.size()); ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return best;
}

// Tokens kept by top-k and top-p, with their temperature-scaled logits; `all` means no filter.
struct Kept {
  bool all = true;
  std::vector<int32_t> ids;
};

Kept Filter(absl::Span<const float> logits, const SamplingParams& p) {
  Kept kept;
  const int vocab = static_cast<int>(logits.size());
  const bool use_k = p.top_k > 0 && p.top_k < vocab;
  const bool use_p = p.top_p < 1.0f;
  if (!use_k && !use_p) return kept;
  kept.all = false;
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  const int k = use_k ? p.top_k : vocab;
  std::partial_sort(order.begin(), order.begin() + k, order.end(), by_logit);
  order.resize(k);
  if (use_p) {
    const double inv_t = 1.0 / p.temperature;
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
  const Kept kept = Filter(logits, p);
  std::vector<int32_t> ids = kept.ids;
  if (kept.all) {
    ids.resize(logits.size());
    std::iota(ids.begin(), ids.end(), 0);
  }
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

}  // namespace specd
