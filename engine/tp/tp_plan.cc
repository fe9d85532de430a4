#include "engine/tp/tp_plan.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "specd/kernels/philox.h"

namespace specd {

std::vector<TpRange> SplitEvenly(int64_t total, int n, int64_t align) {
  const int64_t units = total / align;
  const int64_t rest = total % align;
  std::vector<TpRange> out(n);
  int64_t at = 0;
  for (int r = 0; r < n; ++r) {
    const int64_t my_units = units / n + (r < units % n ? 1 : 0);
    out[r].begin = at;
    at += my_units * align;
    if (r == n - 1) at += rest;
    out[r].end = at;
  }
  return out;
}

TpRankPlan FullModelSlice(const ModelConfig& config) {
  TpRankPlan slice;
  slice.q_heads = {0, config.num_heads};
  slice.kv_heads = {0, config.num_kv_heads};
  slice.ffn = {0, config.intermediate_size};
  slice.vocab = {0, config.vocab_size};
  return slice;
}

absl::StatusOr<TpPlan> MakeTpPlan(const ModelConfig& config, int world_size,
                                  const TpPlanOptions& options) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor_parallel: ", world_size, " must be >= 1"));
  }
  if (options.ffn_align < 1 || options.vocab_align < 1) {
    return absl::InvalidArgumentError(absl::StrCat("ffn_align (", options.ffn_align,
                                                   ") and vocab_align (", options.vocab_align,
                                                   ") must be >= 1"));
  }
  if (config.num_heads < 1 || config.num_kv_heads < 1 ||
      config.num_heads % config.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_key_value_heads: ", config.num_kv_heads,
                                                   " must be >= 1 and divide num_attention_heads (",
                                                   config.num_heads, ")"));
  }
  TpPlan plan;
  plan.world_size = world_size;
  plan.kv_group = config.num_heads / config.num_kv_heads;
  plan.ranks.resize(world_size);
  plan.kv_replicas.assign(config.num_kv_heads, 0);
  const std::vector<TpRange> heads = SplitEvenly(config.num_heads, world_size);
  const std::vector<TpRange> ffn =
      SplitEvenly(config.intermediate_size, world_size, options.ffn_align);
  const std::vector<TpRange> vocab =
      SplitEvenly(config.vocab_size, world_size, options.vocab_align);
  for (int r = 0; r < world_size; ++r) {
    TpRankPlan& rp = plan.ranks[r];
    rp.q_heads = heads[r];
    if (!rp.q_heads.empty()) {
      rp.kv_heads.begin = rp.q_heads.begin / plan.kv_group;
      rp.kv_heads.end = (rp.q_heads.end - 1) / plan.kv_group + 1;
      for (int64_t k = rp.kv_heads.begin; k < rp.kv_heads.end; ++k) ++plan.kv_replicas[k];
    }
    rp.ffn = ffn[r];
    rp.vocab = vocab[r];
  }
  return plan;
}

bool VocabParallelSamplingSupported(const SamplingParams& params) {
  if (params.has_processors()) return false;
  return params.greedy() || (params.top_k == 0 && params.top_p >= 1.0f && params.min_p <= 0.0f);
}

VocabCandidate ShardCandidate(absl::Span<const float> shard, TpRange vocab,
                              const SamplingParams& params, int64_t position) {
  VocabCandidate best;
  const double inv_t = params.greedy() ? 1.0 : 1.0 / params.temperature;
  for (int64_t i = 0; i < vocab.size(); ++i) {
    const int32_t id = static_cast<int32_t>(vocab.begin + i);
    // The same expression as SampleToken() so scores match it bit for bit.
    double score = shard[i];
    if (!params.greedy()) {
      const double u =
          PhiloxUniform01(params.seed, static_cast<uint64_t>(position), static_cast<uint32_t>(id));
      score = shard[i] * inv_t - std::log(-std::log(u));
    }
    if (best.token < 0 || score > best.score) {
      best.score = score;
      best.token = id;
      best.logit = shard[i];
    }
  }
  return best;
}

VocabCandidate ReduceCandidates(absl::Span<const VocabCandidate> candidates) {
  VocabCandidate best;
  for (const VocabCandidate& c : candidates) {
    if (c.token < 0) continue;
    if (best.token < 0 || c.score > best.score || (c.score == best.score && c.token < best.token)) {
      best = c;
    }
  }
  return best;
}

double LogprobScale(const SamplingParams& params, LogprobsMode mode) {
  if (mode == LogprobsMode::kRaw || params.greedy()) return 1.0;
  return 1.0 / params.temperature;
}

namespace {

// Highest logit first, lowest id first on ties: ComputeLogprobs' order of the top list.
bool Before(const ShardLogprobStats::Entry& a, const ShardLogprobStats::Entry& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.token < b.token);
}

}  // namespace

ShardLogprobStats ComputeShardLogprobStats(absl::Span<const float> shard, TpRange vocab,
                                           double scale, float emitted_logit, int top_n) {
  ShardLogprobStats out;
  const int64_t v = std::min<int64_t>(vocab.size(), static_cast<int64_t>(shard.size()));
  if (v <= 0) return out;
  double max_l = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < v; ++i) {
    max_l = std::max<double>(max_l, shard[i]);
    out.above += shard[i] > emitted_logit;
  }
  out.max_logit = max_l;
  for (int64_t i = 0; i < v; ++i) out.sum_exp += std::exp((shard[i] - max_l) * scale);
  const int64_t k = std::min<int64_t>(std::max(top_n, 0), v);
  if (k == 0) return out;
  std::vector<ShardLogprobStats::Entry> all(v);
  for (int64_t i = 0; i < v; ++i) all[i] = {static_cast<int32_t>(vocab.begin + i), shard[i]};
  std::partial_sort(all.begin(), all.begin() + k, all.end(), Before);
  out.top.assign(all.begin(), all.begin() + k);
  return out;
}

TokenLogprobs MergeShardLogprobStats(absl::Span<const ShardLogprobStats> shards, double scale,
                                     float emitted_logit, int n) {
  double max_l = -std::numeric_limits<double>::infinity();
  for (const ShardLogprobStats& s : shards) max_l = std::max(max_l, s.max_logit);
  double total = 0.0;
  int64_t above = 0;
  std::vector<ShardLogprobStats::Entry> top;
  for (const ShardLogprobStats& s : shards) {
    above += s.above;
    top.insert(top.end(), s.top.begin(), s.top.end());
    if (s.sum_exp > 0.0) total += s.sum_exp * std::exp((s.max_logit - max_l) * scale);
  }
  const double log_total = std::log(total);
  auto logprob = [&](float logit) { return (logit - max_l) * scale - log_total; };
  TokenLogprobs out;
  out.logprob = static_cast<float>(logprob(emitted_logit));
  out.rank = static_cast<int32_t>(above + 1);
  if (n <= 0) return out;
  const size_t k = std::min<size_t>(static_cast<size_t>(n), top.size());
  std::partial_sort(top.begin(), top.begin() + k, top.end(), Before);
  for (size_t i = 0; i < k; ++i) {
    const double lp = logprob(top[i].logit);
    if (std::isinf(lp)) break;  // probability 0, as ComputeLogprobs
    out.top.push_back({top[i].token, static_cast<float>(lp)});
  }
  return out;
}

}  // namespace specd
