// The goodput policy's cost model (policy.h, CostModel): verify and draft step times measured
// in buckets on top of priors, and what a bucket never run is guessed to cost.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <utility>

#include "engine/spec/policy.h"

namespace specd {

// ---- CostModel ----

int CostModel::Bucket(int n, int buckets) {
  // ceil(log2(n)) for n > 1, capped: the doublings of 1 that stay below n.
  if (n <= 1) return 0;
  return std::min(32 - __builtin_clz(static_cast<uint32_t>(n - 1)), buckets - 1);
}

double CostModel::VerifyPrior(int rows, int tokens) const {
  return options_->verify_fixed_s + options_->verify_per_row_s * rows +
         options_->verify_per_token_s * tokens;
}

double CostModel::LevelPrior(double tokens_per_level) const {
  return options_->draft_level_fixed_s + options_->draft_level_per_token_s * tokens_per_level;
}

double CostModel::VerifyRatio(int rb, int tb) const {
  if (verify_n_[rb][tb] > 0) return verify_ratio_[rb][tb];
  int best = std::numeric_limits<int>::max();
  double ratio = 1.0;
  for (int r = 0; r < kRowBuckets; ++r) {
    for (int t = 0; t < kTokenBuckets; ++t) {
      if (verify_n_[r][t] == 0) continue;
      const int dist = 2 * std::abs(t - tb) + std::abs(r - rb);
      if (dist < best) {
        best = dist;
        ratio = verify_ratio_[r][t];
      }
    }
  }
  return ratio;
}

double CostModel::LevelRatio(int tb) const {
  if (level_n_[tb] > 0) return level_ratio_[tb];
  int best = std::numeric_limits<int>::max();
  double ratio = 1.0;
  for (int t = 0; t < kTokenBuckets; ++t) {
    if (level_n_[t] > 0 && std::abs(t - tb) < best) {
      best = std::abs(t - tb);
      ratio = level_ratio_[t];
    }
  }
  return ratio;
}

// Verify and draft costs differ by hardware in shape, not only in scale: on a CPU a verify step
// grows with every token it scores, on a GPU it is nearly flat up to hundreds of tokens. The
// priors have a CPU's shape, so scaling them by the nearest measured bucket predicts a GPU's
// bigger trees several times too dear, and the policy would never run them to learn otherwise.
// So along the token axis the measured buckets themselves give the shape: interpolated between
// measured buckets, extended by the measured slope. Beyond a single measured bucket the cost is
// flat up to twice its tokens or flat_tokens, whichever is more (the optimistic guess, which a
// step acting on it then measures), and grows by the scaled prior's slope past that: the policy
// climbs the curve a bucket at a time. Flat all the way would send a saturated batch straight to
// its biggest trees, a step several times dearer than the one it knows, paid twice before it is
// measured (a bucket's first call is not a sample).
template <typename CostAt, typename PriorAt>
double CostModel::AlongTokens(int tb, double tokens, const int* n, const double* mean_tokens,
                              int buckets, double flat_tokens, CostAt cost_at, PriorAt prior_at) {
  int lo = -1, lo2 = -1, hi = -1;
  for (int t = tb - 1; t >= 0; --t) {
    if (n[t] == 0) continue;
    if (lo < 0) {
      lo = t;
    } else {
      lo2 = t;
      break;
    }
  }
  for (int t = tb + 1; t < buckets; ++t) {
    if (n[t] > 0) {
      hi = t;
      break;
    }
  }
  if (lo < 0 && hi < 0) return -1.0;
  if (lo < 0) {
    // Below the smallest measured bucket: that bucket's cost, less what the scaled prior says
    // the fewer tokens save. Its cost alone would price the step without drafts as dear as the
    // smallest tree that ran, and a policy that started by drafting would never learn that not
    // drafting is cheaper.
    const double c_hi = cost_at(hi);
    return std::clamp(c_hi - (prior_at(hi, mean_tokens[hi]) - prior_at(hi, tokens)), 0.1 * c_hi,
                      c_hi);
  }
  const double c_lo = cost_at(lo), x_lo = mean_tokens[lo];
  if (hi >= 0) {
    const double c_hi = cost_at(hi), x_hi = mean_tokens[hi];
    if (x_hi <= x_lo) return std::max(c_lo, c_hi);
    const double f = std::clamp((tokens - x_lo) / (x_hi - x_lo), 0.0, 1.0);
    return c_lo + f * (c_hi - c_lo);
  }
  const double x_lo2 = lo2 >= 0 ? mean_tokens[lo2] : 0.0;
  if (lo2 < 0 || x_lo <= x_lo2) {
    // flat_tokens 0: no flat stretch (the prior's slope from the measured bucket on).
    const double knee = flat_tokens > 0 ? std::max(2.0 * x_lo, flat_tokens) : x_lo;
    if (tokens <= knee) return c_lo;
    return c_lo + std::max(0.0, prior_at(lo, tokens) - prior_at(lo, knee));
  }
  const double slope = std::max(0.0, (c_lo - cost_at(lo2)) / (x_lo - x_lo2));
  return c_lo + slope * std::max(0.0, tokens - x_lo);
}

namespace {

// How far along the token axis a verify bucket never run is guessed to cost what the measured
// one below it does (AlongTokens). The flat guess is an accelerator's: a padded (CUDA) backend
// scores a few dozen tokens in about the time of one. An unpadded backend is a CPU's, where a
// forward is compute-bound from the first token and every token scored costs about as much as
// the first: guessed flat, a chain for every sequence of a 16-row batch looks free, and the
// step that corrects it costs several times a plain one, twice (a bucket's first call is not a
// sample). There the guess grows by the prior's slope from the measured bucket on.
double VerifyFlatTokens(const PolicyOptions& options) {
  return options.padded_rows ? options.flat_tokens : 0.0;
}

// Whether a verify bucket's first call is a warm-up rather than a sample: on a padded (CUDA)
// backend it captures the bucket's graph. An unpadded backend has nothing to warm up, and its
// first call is as good a sample as any; thrown away, a bucket that does not pay is run twice
// before the policy can tell.
bool FirstCallIsWarmUp(const PolicyOptions& options) { return options.padded_rows; }

}  // namespace

double CostModel::VerifySeconds(int rows, int tokens) const {
  rows = std::max(rows, 1);
  tokens = std::max(tokens, rows);
  const double prior = VerifyPrior(rows, tokens);
  if (!options_->measure_costs) return prior;
  const int rb = Bucket(rows, kRowBuckets), tb = Bucket(tokens, kTokenBuckets);
  // A measured bucket's cost at this step's row count and at the bucket's own mean tokens.
  auto cost_at = [&](int t) {
    return VerifyPrior(rows, static_cast<int>(std::lround(verify_tokens_[rb][t]))) *
           verify_ratio_[rb][t];
  };
  if (verify_n_[rb][tb] > 0) {
    // Between its mean tokens and a measured neighbour's, along the line through the two
    // measured costs: the prior's slope scaled by each bucket's ratio would price the last
    // tokens of one bucket dearer than the first of the next (the prior is a CPU's shape), and
    // on that step down the best assignment of a batch of alike sequences drafts only some of
    // them.
    const double x = verify_tokens_[rb][tb];
    const int step = tokens >= x ? 1 : -1;
    for (int t = tb + step; t >= 0 && t < kTokenBuckets; t += step) {
      if (verify_n_[rb][t] == 0) continue;
      const double x_t = verify_tokens_[rb][t];
      if ((x_t - x) * step <= 0) break;
      const double c = cost_at(tb);
      return c + (tokens - x) / (x_t - x) * (cost_at(t) - c);
    }
    return prior * verify_ratio_[rb][tb];
  }
  // The prior at `x` tokens, scaled by measured bucket t's ratio to it.
  auto prior_at = [&](int t, double x) {
    return VerifyPrior(rows, static_cast<int>(std::lround(x))) * verify_ratio_[rb][t];
  };
  const double along = AlongTokens(tb, tokens, verify_n_[rb], verify_tokens_[rb], kTokenBuckets,
                                   VerifyFlatTokens(*options_), cost_at, prior_at);
  if (along > 0) return along;
  return prior * VerifyRatio(rb, tb);
}

double CostModel::CatchUpTokenSeconds() const {
  if (!options_->measure_costs) return options_->draft_prefill_token_s;
  if (catch_up_n_ > 0) return catch_up_token_s_;
  // Not scaled down like an unmeasured level: a catch-up is a prefill of every sequence that
  // starts drafting, so an optimistic guess sends a whole batch of new sequences into one call
  // that stalls the step for their whole prompts.
  return options_->draft_prefill_token_s;
}

double CostModel::DraftSeconds(int drafting, int levels, int nodes, double catch_up) const {
  if (drafting <= 0 || levels <= 0) return 0.0;
  const double catch_up_s = std::max(catch_up, 0.0) * CatchUpTokenSeconds();
  const double per_level = std::max(static_cast<double>(nodes) / levels, 1.0 * drafting);
  double level = LevelPrior(per_level);
  if (options_->measure_costs) {
    const int tb = Bucket(static_cast<int>(std::lround(per_level)), kTokenBuckets);
    if (level_n_[tb] > 0) {
      level *= level_ratio_[tb];
    } else {
      auto cost_at = [&](int t) { return LevelPrior(level_tokens_[t]) * level_ratio_[t]; };
      auto prior_at = [&](int t, double x) { return LevelPrior(x) * level_ratio_[t]; };
      const double along = AlongTokens(tb, per_level, level_n_, level_tokens_, kTokenBuckets,
                                       options_->flat_tokens, cost_at, prior_at);
      level = along > 0 ? along : level * LevelRatio(tb);
    }
    if (!level_measured_) {
      return options_->unmeasured_draft_scale * (options_->draft_fixed_s + levels * level) +
             catch_up_s;
    }
  }
  return options_->draft_fixed_s + levels * level + catch_up_s;
}

void CostModel::ObserveIngest(int sequences, int tokens, double seconds) {
  // Few tokens a sequence say little of a token's price beside the call's own round trip.
  if (sequences <= 0 || tokens < 16 * sequences || !(seconds > 0)) return;
  ObserveCatchUpToken(std::max(seconds - options_->draft_fixed_s, 0.0) / tokens);
}

void CostModel::ObserveCatchUpToken(double sample) {
  const double w = std::max(options_->cost_ema, 1.0 / (catch_up_n_ + 1));
  catch_up_token_s_ =
      catch_up_n_ == 0 ? sample : catch_up_token_s_ + w * (sample - catch_up_token_s_);
  ++catch_up_n_;
}

void CostModel::ObservePreDraft(int drafting, int levels, int nodes, double seconds) {
  // Against the scaled-down draft prior the ratio would stick at that scale's inverse.
  const double predicted = DraftSeconds(drafting, levels, nodes);
  const bool scaled = !level_measured_ && options_->unmeasured_draft_scale != 1.0;
  if (!options_->measure_costs || scaled || predicted <= 0 || seconds <= 0) return;
  Update(seconds / predicted, pre_draft_n_ == 0, &pre_draft_ratio_, &pre_draft_n_);
}

double CostModel::PreDraftSeconds(int drafting, int levels, int nodes) const {
  return pre_draft_ratio_ * DraftSeconds(drafting, levels, nodes);
}

double CostModel::DraftLevelSeconds() const {
  return DraftSeconds(1, 1, 1) - options_->draft_fixed_s;
}

void CostModel::Update(double sample, bool first_of_all, double* ratio, int* n) const {
  // A bucket starts from its neighbours' ratio and averages its samples, each clipped to a
  // factor of its current value: one step slowed by a prefill, a page fault or a scheduler
  // hiccup moves the estimate by at most cost_ema, while a lasting change still gets through
  // within a few steps. The very first sample of all has no neighbour to be held against (the
  // priors can be off by 20x on other hardware) and is taken as it is.
  if (first_of_all) {
    *ratio = sample;
    ++*n;
    return;
  }
  const double clip = *n == 0 ? 4.0 : 1.5;
  sample = std::clamp(sample, *ratio / clip, *ratio * clip);
  const double w = std::max(options_->cost_ema, 1.0 / (*n + 2));
  *ratio += w * (sample - *ratio);
  ++*n;
}

void CostModel::ObserveVerify(int rows, int tokens, double seconds) {
  if (rows <= 0 || !(seconds > 0)) return;
  tokens = std::max(tokens, rows);
  const int rb = Bucket(rows, kRowBuckets), tb = Bucket(tokens, kTokenBuckets);
  if (!std::exchange(verify_warm_[rb][tb], true) && FirstCallIsWarmUp(*options_)) return;
  const double ratio = seconds / VerifyPrior(rows, tokens);
  bool first_of_all = true;
  for (int r = 0; r < kRowBuckets && first_of_all; ++r) {
    for (int t = 0; t < kTokenBuckets; ++t) first_of_all = first_of_all && verify_n_[r][t] == 0;
  }
  if (verify_n_[rb][tb] == 0) {
    // A bucket's first sample is its cost, within a factor of 4 of what the model priced it at
    // until then (along the token axis from the measured buckets; the very first sample of all
    // as it is, Update). Averaged with a guess, it
    // would leave the bucket half wrong: with a neighbour's ratio to the prior, carried
    // through the prior's shape (a CPU's, every token dear), a GPU's bigger trees stayed
    // priced at nearly twice their cost and were not run again to correct it; with the flat
    // guess, a padded step's longer rows stayed priced too cheap, and kept being run.
    const double guess = VerifySeconds(rows, tokens) / VerifyPrior(rows, tokens);
    verify_ratio_[rb][tb] = first_of_all ? ratio : std::clamp(ratio, guess / 4.0, guess * 4.0);
    verify_tokens_[rb][tb] = tokens;
    ++verify_n_[rb][tb];
    return;
  }
  verify_tokens_[rb][tb] += (tokens - verify_tokens_[rb][tb]) / (verify_n_[rb][tb] + 1);
  Update(ratio, first_of_all, &verify_ratio_[rb][tb], &verify_n_[rb][tb]);
}

void CostModel::ObserveDraft(int drafting, int levels, int nodes, int fed_tokens, double seconds) {
  if (drafting <= 0 || levels <= 0 || !(seconds > 0)) return;
  if (fed_tokens > drafting * (levels + 2)) {
    // A catch-up: what the call took beyond its levels' predicted cost, per token beyond a
    // step's worth. Few tokens say little of its price: priced at the estimate, the rest is a
    // level sample (dropped, calls that each carry a few would never correct the levels).
    const int extra = fed_tokens - drafting * (levels + 1);
    if (extra < 16 * drafting) {
      ObserveDraft(drafting, levels, nodes, 0,
                   seconds - std::min(extra * CatchUpTokenSeconds(), 0.5 * seconds));
      return;
    }
    ObserveCatchUpToken(std::max(seconds - DraftSeconds(drafting, levels, nodes), 0.0) / extra);
    return;
  }
  const double per_level = std::max(static_cast<double>(nodes) / levels, 1.0 * drafting);
  const double level = std::max(seconds - options_->draft_fixed_s, 0.1 * seconds) / levels;
  const int tb = Bucket(static_cast<int>(std::lround(per_level)), kTokenBuckets);
  if (!std::exchange(level_warm_[tb], true)) return;
  const double ratio = level / LevelPrior(per_level);
  const bool first_of_all =
      std::all_of(std::begin(level_n_), std::end(level_n_), [](int n) { return n == 0; });
  if (level_n_[tb] == 0) {
    level_ratio_[tb] = LevelRatio(tb);
    level_tokens_[tb] = per_level;
  }
  level_tokens_[tb] += (per_level - level_tokens_[tb]) / (level_n_[tb] + 1);
  Update(ratio, first_of_all, &level_ratio_[tb], &level_n_[tb]);
  level_measured_ = level_measured_ || level_n_[tb] > 0;
}

}  // namespace specd
