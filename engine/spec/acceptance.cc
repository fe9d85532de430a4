// AcceptanceEstimate (policy.h): per-sequence acceptance by depth and by sibling rank, and the
// expected accepted length of a candidate shape.
#include <algorithm>
#include <cmath>
#include <vector>

#include "engine/spec/policy.h"
#include "engine/spec/shape_math.h"

namespace specd {

using spec_internal::ClampRate;
using spec_internal::IsChain;
using spec_internal::Width;

namespace {

// One sample into an average that starts plain and then forgets at the EMA's rate.
void AddSample(double x, double ema, double* rate, int* n) {
  const double w = std::max(ema, 1.0 / (*n + 1));
  *rate = *n == 0 ? x : *rate + w * (x - *rate);
  ++*n;
}

// The prior of a rate indexed from 1 (a depth, a rank): its entry of `by_index`, the last one
// past its end, or `constant` when it is empty.
double PriorAt(const std::vector<double>& by_index, double constant, int i) {
  return ClampRate(by_index.empty() ? constant
                                    : by_index[std::min<size_t>(i - 1, by_index.size() - 1)]);
}

// A sequence's own rate shrunk toward the prior: the prior counts as three times
// acceptance_prior_samples while the sequence has no samples, falling to once that many.
double Shrunk(double prior, double own, double weight, const PolicyOptions& options) {
  const double base = options.acceptance_prior_samples;
  const double k = base * std::max(1.0, 3.0 - weight / (2.0 * std::max(base, 1e-9)));
  return ClampRate((k * prior + weight * own) / (k + weight));
}

// A rate averaged over `n` samples and the weight it carries: the samples counted up to 20
// (the average forgets at the EMA's rate, so older samples stop adding weight), 0 with none.
double OwnRate(double rate, int n, double* weight) {
  *weight = std::min(n, 20);
  return *weight > 0 ? ClampRate(rate) : 0.0;
}

}  // namespace

const AcceptanceEstimate::TreeRecord* AcceptanceEstimate::FindTree(const SpecShape& shape) const {
  for (int i = 0; i < tree_count_; ++i) {
    if (trees_[i].shape == shape) return &trees_[i];
  }
  return nullptr;
}

void AcceptanceEstimate::Observe(const SpecShape& shape, absl::Span<const LevelOutcome> levels,
                                 const PolicyOptions& options) {
  if (shape.none()) return;
  cache_.policy = 0;  // the expectations change with the rates
  TreeRecord* tree = nullptr;
  if (!IsChain(shape)) {
    tree = FindTree(shape);
    if (tree == nullptr && tree_count_ < kTreeShapes) {
      tree = &trees_[tree_count_++];
      tree->shape = shape;
    }
  }
  const int last = std::min({static_cast<int>(levels.size()), shape.depth, kMaxDepth});
  for (int d = 1; d <= last; ++d) {
    const LevelOutcome& level = levels[d - 1];
    if (level.accepted_rank >= level.siblings) break;
    if (tree != nullptr) {
      AddSample(level.siblings > 0 ? 1.0 : 0.0, options.acceptance_ema, &tree->open[d - 1],
                &tree->open_n[d - 1]);
      if (level.siblings > 0) {
        AddSample(level.siblings, options.acceptance_ema, &tree->width[d - 1],
                  &tree->width_n[d - 1]);
      }
    }
    if (level.siblings <= 0) break;
    AddSample(level.accepted_rank == 0 ? 1.0 : 0.0, options.acceptance_ema, &chain_[d - 1],
              &chain_n_[d - 1]);
    // Siblings tried in rank order: each one up to the accepted one (all of them where none
    // was) is a sample of its rank's rate; those behind the accepted one say nothing.
    const int tried = level.accepted_rank < 0 ? level.siblings - 1 : level.accepted_rank;
    for (int r = 1; r <= tried; ++r) {
      const int k = std::min(r, kMaxRank) - 1;
      AddSample(r == level.accepted_rank ? 1.0 : 0.0, options.acceptance_ema, &sibling_[k],
                &sibling_n_[k]);
    }
    if (level.accepted_rank < 0) break;
  }
}

void AcceptanceEstimate::Observe(const SpecShape& shape, int accepted,
                                 const PolicyOptions& options) {
  if (shape.none()) return;
  LevelOutcome levels[kMaxDepth];
  const int siblings = static_cast<int>(std::lround(Width(shape)));
  const int n = std::min({accepted + 1, shape.depth, kMaxDepth});
  for (int d = 1; d <= n; ++d) {
    levels[d - 1] = d <= accepted ? LevelOutcome{siblings, 0} : LevelOutcome{siblings, -1};
  }
  Observe(shape, absl::MakeConstSpan(levels, n), options);
}

double AcceptanceEstimate::OwnChainRate(int d, double* weight) const {
  d = std::clamp(d, 1, kMaxDepth);
  return OwnRate(chain_[d - 1], chain_n_[d - 1], weight);
}

double AcceptanceEstimate::ChainRate(int d, const PolicyOptions& options) const {
  d = std::clamp(d, 1, kMaxDepth);
  double weight;
  const double own = OwnChainRate(d, &weight);
  return Shrunk(PriorAt(options.acceptance_prior_by_depth, options.acceptance_prior, d), own,
                weight, options);
}

double AcceptanceEstimate::OwnSiblingRate(int r, double* weight) const {
  r = std::clamp(r, 1, kMaxRank);
  return OwnRate(sibling_[r - 1], sibling_n_[r - 1], weight);
}

double AcceptanceEstimate::SiblingRate(int r, const PolicyOptions& options) const {
  r = std::clamp(r, 1, kMaxRank);
  double weight;
  const double own = OwnSiblingRate(r, &weight);
  return Shrunk(PriorAt(options.sibling_prior_by_rank, options.sibling_acceptance_prior, r), own,
                weight, options);
}

double AcceptanceEstimate::SiblingMiss(double width, absl::Span<const double> rates) {
  double miss = 1.0;
  for (int r = 1; r <= static_cast<int>(rates.size()) && r < width; ++r) {
    // The sibling of rank r exists with the chance that the width reaches r + 1.
    miss *= 1.0 - std::min(1.0, width - r) * rates[r - 1];
  }
  return miss;
}

void AcceptanceEstimate::AddTreeLayout(const SpecShape& shape, double* open, double* open_weight,
                                       double* width, double* width_weight) const {
  const TreeRecord* t = FindTree(shape);
  if (t == nullptr) return;
  for (int d = 0; d < std::min(shape.depth, kMaxDepth); ++d) {
    const double wo = std::min(t->open_n[d], 20), ww = std::min(t->width_n[d], 20);
    open[d] += wo * t->open[d];
    open_weight[d] += wo;
    width[d] += ww * t->width[d];
    width_weight[d] += ww;
  }
}

double AcceptanceEstimate::TreeLevelRate(const SpecShape& shape, const TreeRecord* record, int d,
                                         absl::Span<const double> sibling_rates,
                                         const PolicyOptions& options) const {
  double open = 1.0, width = Width(shape);
  for (const PolicyOptions::TreePrior& prior : options.tree_priors) {
    if (prior.shape != shape) continue;
    if (d <= static_cast<int>(prior.open.size()) && prior.open[d - 1] >= 0) {
      open = prior.open[d - 1];
    }
    if (d <= static_cast<int>(prior.width.size()) && prior.width[d - 1] >= 1) {
      width = prior.width[d - 1];
    }
    break;
  }
  if (record != nullptr) {
    // Shrunk toward the priors as the first-child rates are.
    const double base = options.acceptance_prior_samples;
    auto shrink = [&](double prior, double own, int n) {
      const double w = std::min(n, 20);
      const double k = base * std::max(1.0, 3.0 - w / (2.0 * std::max(base, 1e-9)));
      return (k * prior + w * own) / (k + w);
    };
    open = shrink(open, record->open[d - 1], record->open_n[d - 1]);
    if (record->width_n[d - 1] > 0) {
      width = shrink(width, record->width[d - 1], record->width_n[d - 1]);
    }
  }
  const double p = ChainRate(d, options);
  return open * (1.0 - (1.0 - p) * SiblingMiss(width, sibling_rates));
}

double AcceptanceEstimate::ExpectedAccepted(const SpecShape& shape,
                                            const PolicyOptions& options) const {
  if (shape.none()) return 0.0;
  double reach = 1.0, expected = 0.0;
  if (Width(shape) <= 1.0) {
    for (int d = 1; d <= shape.depth; ++d) {
      reach *= ChainRate(d, options);
      expected += reach;
    }
    return expected;
  }
  double sibling_rates[kMaxRank];
  const int ranks = std::clamp(shape.top_k - 1, 0, kMaxRank);
  for (int r = 1; r <= ranks; ++r) sibling_rates[r - 1] = SiblingRate(r, options);
  const TreeRecord* record = FindTree(shape);
  for (int d = 1; d <= std::min(shape.depth, kMaxDepth); ++d) {
    reach *= TreeLevelRate(shape, record, d, absl::MakeConstSpan(sibling_rates, ranks), options);
    expected += reach;
  }
  return expected;
}

void AcceptanceEstimate::ExpectedAcceptedChains(const PolicyOptions& options,
                                                absl::Span<double> out) const {
  // The same products and sums as ExpectedAccepted of each chain, so each value is bit for bit
  // what it would return.
  double reach = 1.0, expected = 0.0;
  for (size_t d = 1; d <= out.size(); ++d) {
    reach *= ChainRate(static_cast<int>(d), options);
    expected += reach;
    out[d - 1] = expected;
  }
}

}  // namespace specd
