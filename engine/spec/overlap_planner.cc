#include "engine/spec/overlap_planner.h"

#include <algorithm>
#include <cmath>

namespace specd {
namespace {

// An exponential average that takes its first samples in full (1 / (n + 2)) and then moves by
// at least `ema` a sample.
void Average(double sample, double ema, double* value, int* n) {
  const double w = std::max(ema, 1.0 / (*n + 2));
  *value = *n == 0 ? sample : *value + w * (sample - *value);
  ++*n;
}

}  // namespace

const char* OverlapWhyName(OverlapPlanner::Why why) {
  switch (why) {
    case OverlapPlanner::Why::kPays: return "pays";
    case OverlapPlanner::Why::kNoFit: return "no_fit";
    case OverlapPlanner::Why::kNoGain: return "no_gain";
    case OverlapPlanner::Why::kProbe: return "probe";
    case OverlapPlanner::Why::kRefresh: return "refresh";
    case OverlapPlanner::Why::kNothing: return "nothing";
  }
  return "nothing";
}

double OverlapPlanner::GuessRate(const AcceptanceEstimate& acceptance, const SpecShape& shape,
                                 const PolicyOptions& options) {
  if (shape.none()) return 0.0;
  double rate = 1.0;
  for (int d = 1; d <= std::min(shape.depth + 1, AcceptanceEstimate::kMaxDepth); ++d) {
    rate *= acceptance.ChainRate(d, options);
  }
  return rate;
}

OverlapPlanner::Plan OverlapPlanner::Judge(absl::Span<const SpecShape> shapes,
                                           absl::Span<const AcceptanceEstimate* const> acceptance,
                                           int verify_rows, int verify_tokens,
                                           int max_fan_out) const {
  Plan plan;
  const PolicyOptions& options = policy_->options();
  int drafting = 0, levels = 0, nodes = 0;
  double all_hit = 1.0, misses = 0;
  const double calibration = hit_calibration();
  plan.guess_rates.assign(shapes.size(), 0.0);
  for (size_t i = 0; i < shapes.size(); ++i) {
    const SpecShape& s = shapes[i];
    if (s.none()) continue;
    ++drafting;
    levels = std::max(levels, s.depth);
    nodes += s.nodes();
    const AcceptanceEstimate* a = i < acceptance.size() ? acceptance[i] : nullptr;
    plan.guess_rates[i] = a == nullptr ? 0.0 : GuessRate(*a, s, options);
    const double h = std::clamp(plan.guess_rates[i] * calibration, 0.0, 1.0);
    all_hit *= h;
    misses += 1 - h;
  }
  if (drafting == 0 || max_fan_out < 1) return plan;
  plan.pre = policy_->PlanPreDraft(shapes, verify_rows, verify_tokens, max_fan_out);
  const CostModel& costs = policy_->costs();
  // The sequential draft call of m of the sequences (what their misses draft after the
  // outcome): its levels whatever m, its nodes in proportion.
  auto draft_of = [&](double m) {
    const int rows = std::clamp(static_cast<int>(std::lround(m)), 1, drafting);
    return costs.DraftSeconds(rows, levels, std::max(rows, nodes * rows / drafting));
  };
  // The call is saved when every sequence hits, and otherwise shrinks to the expected misses
  // given that there is one.
  const double full = draft_of(drafting);
  plan.saving_s = full - (all_hit < 1 ? (1 - all_hit) * draft_of(misses / (1 - all_hit)) : 0.0);
  const double verify = costs.VerifySeconds(verify_rows, verify_tokens);
  plan.cost_s = std::max(verify_slowdown(verify_rows, verify_tokens) - 1, 0.0) * verify + wait_s_;
  if (plan.pre.fan_out == 0) {
    plan.why = Why::kNoFit;
    return plan;
  }
  if (plan.pre.depth > 0) {
    // A hit verifies the cut tree next, which accepts less than the planned one would.
    double emitted = 0, lost = 0;
    for (size_t i = 0; i < shapes.size(); ++i) {
      const AcceptanceEstimate* a = i < acceptance.size() ? acceptance[i] : nullptr;
      if (shapes[i].none() || a == nullptr) {
        emitted += 1;
        continue;
      }
      const double planned = a->ExpectedAccepted(shapes[i], options);
      const double cut =
          a->ExpectedAccepted(GoodputPolicy::CutToDepth(shapes[i], plan.pre.depth), options);
      emitted += 1 + planned;
      lost +=
          std::clamp(plan.guess_rates[i] * calibration, 0.0, 1.0) * std::max(planned - cut, 0.0);
    }
    plan.cost_s += lost * (verify + full) / emitted;
  }
  // Near break-even the sequential step, which cannot lose to itself, is kept.
  const double margin = options.speculation_margin * verify;
  if (plan.saving_s <= plan.cost_s + margin) {
    plan.fit = plan.pre;
    plan.pre = GoodputPolicy::PreDraftPlan();
    plan.why = Why::kNoGain;
    return plan;
  }
  plan.why = Why::kPays;
  return plan;
}

OverlapPlanner::Plan OverlapPlanner::Decide(absl::Span<const SpecShape> shapes,
                                            absl::Span<const AcceptanceEstimate* const> acceptance,
                                            int verify_rows, int verify_tokens, int max_fan_out) {
  Plan plan = Judge(shapes, acceptance, verify_rows, verify_tokens, max_fan_out);
  const int interval = std::max(policy_->options().probe_interval, 1);
  if (plan.why == Why::kPays) {
    since_probe_ = 0;
    if (++since_refresh_ >= interval) {
      since_refresh_ = 0;
      plan.pre = GoodputPolicy::PreDraftPlan();
      plan.why = Why::kRefresh;
    }
  } else if (plan.why == Why::kNoFit || plan.why == Why::kNoGain) {
    if (++since_probe_ >= interval) {
      since_probe_ = 0;
      // What fits, or where nothing does, at the planned depth (uncut): a pre-draft measured
      // slow while the draft device was busy is measured again at what a hit would want.
      plan.pre = plan.why == Why::kNoGain ? plan.fit : GoodputPolicy::PreDraftPlan{1, 0};
      plan.why = Why::kProbe;
    }
  }
  return plan;
}

int OverlapPlanner::Bucket(int n) {
  int b = 0;
  while (b + 1 < kBuckets && (1 << b) < n) ++b;
  return b;
}

double OverlapPlanner::verify_slowdown(int verify_rows, int verify_tokens) const {
  const int r = Bucket(verify_rows), t = Bucket(std::max(verify_tokens, verify_rows));
  if (ratio_n_[0][r][t] < kBucketSamples || ratio_n_[1][r][t] < kBucketSamples ||
      !(ratio_[0][r][t] > 0)) {
    return slowdown_;
  }
  return ratio_[1][r][t] / ratio_[0][r][t];
}

double OverlapPlanner::ObserveVerify(int verify_rows, int verify_tokens, double seconds,
                                     bool overlapped) {
  const double slowdown = verify_slowdown(verify_rows, verify_tokens);
  const int before = Bucket(verify_rows);
  const int before_t = Bucket(std::max(verify_tokens, verify_rows));
  const bool known = ratio_n_[0][before][before_t] > 0 && ratio_n_[1][before][before_t] > 0;
  if (seconds > 0 && verify_rows > 0) {
    // Against a fixed price (the policy's verify prior), not the cost model's learned one: that
    // one moves as it learns, so samples of the two kinds taken at different times would not
    // compare. Within one bucket the prior only evens out the tokens' spread.
    const PolicyOptions& o = policy_->options();
    const int tokens = std::max(verify_tokens, verify_rows);
    const double price =
        o.verify_fixed_s + o.verify_per_row_s * verify_rows + o.verify_per_token_s * tokens;
    const int r = Bucket(verify_rows), t = Bucket(tokens);
    const int k = overlapped ? 1 : 0;
    double& ratio = ratio_[k][r][t];
    int& n = ratio_n_[k][r][t];
    // One step slowed by something else (a prefill, a page fault) moves it little.
    double sample = seconds / price;
    if (n > 0) sample = std::clamp(sample, ratio / 1.5, ratio * 1.5);
    Average(sample, o.cost_ema, &ratio, &n);
    if (overlapped && ratio_n_[0][r][t] > 0 && ratio_[0][r][t] > 0) {
      // The pooled slowdown, for buckets without enough samples of their own: every bucket's
      // overlapped sample against that bucket's sequential average.
      double pooled = sample / ratio_[0][r][t];
      if (pooled_n_ > 0) pooled = std::clamp(pooled, slowdown_ / 1.5, slowdown_ * 1.5);
      Average(pooled, o.cost_ema, &slowdown_, &pooled_n_);
    }
  }
  // Until the bucket has both kinds, an overlapped step says nothing of verify alone: taken
  // as it is it would price that bucket's shapes at the contended cost from then on (a
  // bucket's first sample is taken whole).
  if (!overlapped) return seconds;
  return known ? seconds / std::max(slowdown, 1e-3) : 0.0;
}

void OverlapPlanner::ObserveWait(double seconds) {
  Average(std::max(seconds, 0.0), policy_->options().cost_ema, &wait_s_, &wait_n_);
}

void OverlapPlanner::ObserveOutcome(bool hit, double guess_rate) {
  // Decayed sums (about the last 1 / acceptance_ema outcomes' worth).
  const double keep = 1 - policy_->options().acceptance_ema / 4;
  hits_ = keep * hits_ + (hit ? 1.0 : 0.0);
  guessed_ = keep * guessed_ + std::clamp(guess_rate, 0.0, 1.0);
}

}  // namespace specd
