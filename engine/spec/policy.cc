#include "engine/spec/policy.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "engine/spec/shape_math.h"

namespace specd {
namespace {

using spec_internal::ClampRate;
using spec_internal::IsChain;
using spec_internal::ShapeNodes;
using spec_internal::Width;

}  // namespace

std::string ShapeString(const SpecShape& s) {
  if (s.none()) return "none";
  if (IsChain(s)) return absl::StrCat("chain", s.depth);
  return absl::StrCat("tree", ShapeNodes(s), "x", s.depth);
}

const char* TreeSizeBucket(int nodes) {
  if (nodes <= 0) return "0";
  if (nodes == 1) return "1";
  if (nodes == 2) return "2";
  if (nodes <= 4) return "3-4";
  if (nodes <= 8) return "5-8";
  if (nodes <= 16) return "9-16";
  return "17+";
}

const char* ShapeReasonName(ShapeReason reason, bool none) {
  switch (reason) {
    case ShapeReason::kPolicy: return none ? "policy_off" : "policy";
    case ShapeReason::kProbe: return "probe";
    case ShapeReason::kExplicit: return "explicit";
    case ShapeReason::kOff: return "off";
    case ShapeReason::kDraftDown: return "draft_down";
    case ShapeReason::kDraftBusy: return "draft_busy";
    case ShapeReason::kNoDrafter: return "no_drafter";
    case ShapeReason::kNoBudget: return "no_budget";
    case ShapeReason::kCatchUp: return "catch_up";
    case ShapeReason::kNgram: return "policy_ngram";
  }
  return "policy";
}

namespace {

int64_t NextPow2(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

// Index of a row's token bucket: 0 for one token, else 1 + ceil(log2(tokens - 1)).
int RowTokenBucket(int tokens) {
  if (tokens <= 1) return 0;
  int b = 1;
  for (int64_t p = 1; p < tokens - 1; p *= 2) ++b;
  return b;
}

int RowTokenBucketSize(int bucket) { return bucket == 0 ? 1 : 1 + (1 << (bucket - 1)); }

constexpr int kRowTokenBuckets = 32;

}  // namespace

int VerifyStepTokens(bool padded_rows, int rows, int total_tokens, int max_row_tokens) {
  if (!padded_rows || rows <= 0) return total_tokens;
  if (rows > kPaddedMaxRows || max_row_tokens > kPaddedMaxRowTokens) return total_tokens;
  const int64_t padded =
      NextPow2(rows) * static_cast<int64_t>(RowTokenBucketSize(RowTokenBucket(max_row_tokens)));
  if (padded > kPaddedMaxTokens) return total_tokens;
  return static_cast<int>(std::max<int64_t>(padded, total_tokens));
}

// ---- GoodputPolicy ----

GoodputPolicy::GoodputPolicy(PolicyOptions options)
    : options_(std::move(options)), costs_(&options_) {
  std::fill(std::begin(pooled_by_depth_), std::end(pooled_by_depth_), -1.0);
  std::fill(std::begin(pooled_by_rank_), std::end(pooled_by_rank_), -1.0);
  std::fill(std::begin(pooled_ngram_by_depth_), std::end(pooled_ngram_by_depth_), -1.0);
  for (const SpecShape& c : options_.candidates) {
    if (c.none() || IsChain(c)) continue;
    const int depth = std::min(c.depth, AcceptanceEstimate::kMaxDepth);
    pooled_trees_.push_back(
        {c, std::vector<double>(depth, -1.0), std::vector<double>(depth, -1.0)});
  }
  static std::atomic<uint64_t> next_id{1};
  id_ = next_id.fetch_add(1, std::memory_order_relaxed);
}

SpecShape GoodputPolicy::Clamp(const SpecShape& shape, int max_depth) {
  if (shape.none() || max_depth <= 0) return SpecShape();
  SpecShape s = shape;
  s.depth = std::min(s.depth, max_depth);
  s.max_nodes = ShapeNodes(s);
  return s;
}

namespace {

// Tokens a sequence's drafter must be fed beyond a step's worth (the accepted tokens and the
// bonus token of the last step) before it can draft `s`.
int CatchUpTokens(const PolicySequence& seq, const SpecShape& s) {
  return std::max(0, seq.draft_backlog - (s.depth + 1));
}

// CatchUpTokens() as the share a step is charged: the catch-up is paid once and then serves
// every step the sequence drafts until it finishes, so it is spread over those steps (its
// remaining tokens over what a step of `s` emits, `gain` being the expected accepted drafts),
// and never less than catch_up_share of it is charged.
double CatchUp(const PolicySequence& seq, const SpecShape& s, double gain,
               const PolicyOptions& options) {
  const int tokens = CatchUpTokens(seq, s);
  if (tokens == 0) return 0.0;
  const double steps_left = std::max(1.0, (seq.max_depth + 1) / (1.0 + std::max(gain, 0.0)));
  return tokens * std::max(options.catch_up_share, 1.0 / steps_left);
}

// The part of a probe's catch-up that CatchUp() spreads over later steps. A probe goes to a
// sequence the policy is not drafting: whether it will draft on, and so share its catch-up with
// later steps, is what the probe is to find out, and where drafting does not pay (a CPU beyond
// a stream or two) it will not, and the whole catch-up, a prompt fed to the drafter, lands on
// the one step that carries the probe, every probe_interval steps. So a probe is judged with
// all of it.
double ProbeUnsharedCatchUp(const PolicySequence& seq, const SpecShape& probe, double gain,
                            const PolicyOptions& options) {
  return std::max(0.0, CatchUpTokens(seq, probe) - CatchUp(seq, probe, gain, options));
}

// Where `seq` drafting `s` (expected to accept `gain` drafts) is better fed its catch-up
// beside the verify step and drafted from the next step (PolicySequence::can_ingest): fed first
// in the draft call, the catch-up (`token_s` a token) stalls the other rows of the batch, which
// emit `others_goodput` tokens a second; fed beside verify, it costs this step the drafts of
// this one sequence. A few tokens are never moved. A new sequence's catch-up is its prompt,
// and fed in the draft call it also holds back its own first token (its TTFT then 1.6-1.9x
// off's on the CPU, bench/CURRENT.md): beside verify's prefill, which the first token waits
// for anyway, it costs only the drafts of that one step, so it goes there whenever it fits.
// kLater: moving pays but the feed would outlast the verify step beside it (`room`), holding the
// stream: not drafted this step.
enum class CatchUpPlan { kInCall, kIngest, kLater };
CatchUpPlan PlanCatchUp(const PolicySequence& seq, const SpecShape& s, double gain, double token_s,
                        double others_goodput, double room, const PolicyOptions& options) {
  if (!seq.can_ingest || !seq.model_draft || s.none()) return CatchUpPlan::kInCall;
  const int tokens = CatchUpTokens(seq, s);
  if (tokens <= options.ingest_catch_up_tokens) return CatchUpPlan::kInCall;
  if (seq.drafter_unfed && tokens * token_s <= room) return CatchUpPlan::kIngest;
  if (tokens * token_s * others_goodput <= gain) return CatchUpPlan::kInCall;
  return tokens * token_s <= room ? CatchUpPlan::kIngest : CatchUpPlan::kLater;
}

// Tokens a step emits per second, its predicted time priced speculation_margin dearer when it
// carries any tree (`tree_nodes` > 0).
double PricedGoodput(double emitted, double seconds, int tree_nodes, const PolicyOptions& options) {
  return emitted / (seconds * (tree_nodes > 0 ? 1.0 + options.speculation_margin : 1.0));
}

// Pools, at each depth, the first-child rates of the batch's estimates (`estimate` of a
// sequence; null: none) that have enough samples to speak for themselves, from their own samples
// (each weighted by them), into `pooled` (negative: not pooled yet), averaged over steps so that
// one batch's mix does not swing it, and shrunk toward the constant `prior` as one sequence's
// estimate is. Returns whether `pooled` changed.
template <typename Estimate>
bool PoolChainRates(absl::Span<const PolicySequence> batch, Estimate estimate, double prior,
                    double* pooled) {
  constexpr int kDepths = AcceptanceEstimate::kMaxDepth;
  double sum[kDepths] = {}, weight[kDepths] = {};
  for (const PolicySequence& s : batch) {
    const AcceptanceEstimate* e = estimate(s);
    if (e == nullptr || e->samples() < 4) continue;
    for (int d = 1; d <= kDepths; ++d) {
      double w;
      const double r = e->OwnChainRate(d, &w);
      if (w <= 0) break;  // no samples this deep, nor deeper
      sum[d - 1] += w * r;
      weight[d - 1] += w;
    }
  }
  if (weight[0] <= 0) return false;
  // A deeper depth is pooled once the batch has a few dozen samples there; until then it takes
  // the depth above's rate (AcceptanceOptions). Pooled from a handful (the first steps' trees),
  // it would hold a deep level at a chance figure, and shapes that never reach that deep would
  // never correct it.
  constexpr double kDeepWeight = 24;
  bool changed = false;
  for (int d = 0; d < kDepths && (d == 0 || weight[d] >= kDeepWeight); ++d) {
    // Shrunk toward the constant as one sequence's estimate is: a batch of one young sequence
    // says little, a full batch of them what the pair accepts.
    const double mean = (2.0 * prior + sum[d]) / (2.0 + weight[d]);
    double& p = pooled[d];
    const double before = p;
    p = p < 0 ? mean : p + 0.2 * (mean - p);
    changed = changed || p != before;
  }
  return changed;
}

// Running totals of one assignment, so that changing one sequence's shape re-scores in O(depth).
struct Totals {
  int rows = 0;
  int tokens = 0;
  int tree_nodes = 0;   // of every tree in the step (draft model and n-gram)
  int drafting = 0;     // sequences the draft model drafts
  int draft_nodes = 0;  // their nodes
  double catch_up = 0;  // their catch-up tokens, as charged to this step (CatchUp)
  double emitted = 0;
  int row_buckets[kRowTokenBuckets] = {};  // rows by RowTokenBucket(pending + nodes)
  int depth_count[AcceptanceEstimate::kMaxDepth + 2] = {};  // drafted trees by depth
  // Bit b set while row_buckets[b] (depth_count[b]) is not zero: the search reads the longest
  // row and the deepest tree on every score, so they are kept, not scanned for.
  uint32_t row_mask = 0;
  uint32_t depth_mask = 0;

  void AddRows(int bucket, int delta) {
    row_buckets[bucket] += delta;
    row_mask = row_buckets[bucket] > 0 ? row_mask | (1u << bucket) : row_mask & ~(1u << bucket);
  }
  void AddDepth(int depth, int delta) {
    depth_count[depth] += delta;
    depth_mask = depth_count[depth] > 0 ? depth_mask | (1u << depth) : depth_mask & ~(1u << depth);
  }
  // The longest row's token bucket size (1 when every row is one token or there are none).
  int longest_row() const {
    const uint32_t above_one = row_mask & ~1u;
    return above_one == 0 ? 1 : RowTokenBucketSize(31 - __builtin_clz(above_one));
  }
  // The deepest drafted tree (0: none).
  int levels() const {
    const uint32_t above_zero = depth_mask & ~1u;
    return above_zero == 0 ? 0 : 31 - __builtin_clz(above_zero);
  }
};
static_assert(kRowTokenBuckets <= 32 && AcceptanceEstimate::kMaxDepth + 2 <= 32);

}  // namespace

PolicyOptions GoodputPolicy::AcceptanceOptions() const {
  PolicyOptions o = options_;
  if (pooled_rate_ >= 0) {
    o.acceptance_prior = pooled_rate_;
    // Depths never pooled take the deepest pooled one's rate.
    o.acceptance_prior_by_depth.clear();
    for (const double p : pooled_by_depth_) {
      o.acceptance_prior_by_depth.push_back(p >= 0 ? p : o.acceptance_prior_by_depth.back());
    }
  }
  o.tree_priors = pooled_trees_;
  if (pooled_by_rank_[0] >= 0) {
    o.sibling_prior_by_rank.clear();
    for (const double p : pooled_by_rank_) {
      o.sibling_prior_by_rank.push_back(p >= 0 ? p : o.sibling_prior_by_rank.back());
    }
  }
  return o;
}

PolicyOptions GoodputPolicy::NgramAcceptanceOptions() const {
  PolicyOptions o = options_;
  if (pooled_ngram_by_depth_[0] >= 0) {
    o.acceptance_prior = pooled_ngram_by_depth_[0];
    o.acceptance_prior_by_depth.clear();
    for (const double p : pooled_ngram_by_depth_) {
      o.acceptance_prior_by_depth.push_back(p >= 0 ? p : o.acceptance_prior_by_depth.back());
    }
  }
  return o;
}

double GoodputPolicy::ExpectedAccepted(const PolicySequence& seq, const SpecShape& shape) const {
  if (seq.acceptance == nullptr) return 0.0;
  return seq.acceptance->ExpectedAccepted(Clamp(shape, seq.max_depth), AcceptanceOptions());
}

double GoodputPolicy::Goodput(absl::Span<const PolicySequence> batch,
                              absl::Span<const SpecShape> shapes,
                              absl::Span<const char> ngram) const {
  const PolicyOptions acceptance_options = AcceptanceOptions();
  const PolicyOptions ngram_options = NgramAcceptanceOptions();
  double emitted = 0;
  int rows = 0, tokens = 0, drafting = 0, nodes = 0, levels = 0, longest = 0, tree_nodes = 0;
  double catch_up = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const SpecShape s = Clamp(shapes[i], batch[i].max_depth);
    ++rows;
    tokens += batch[i].pending + s.nodes();
    tree_nodes += s.nodes();
    longest = std::max(longest, batch[i].pending + s.nodes());
    emitted += 1.0;
    const bool by_ngram = i < ngram.size() && ngram[i] && batch[i].ngram_acceptance != nullptr;
    const AcceptanceEstimate* estimate = by_ngram ? batch[i].ngram_acceptance : batch[i].acceptance;
    double gain = 0;
    if (!s.none() && estimate != nullptr) {
      gain = estimate->ExpectedAccepted(s, by_ngram ? ngram_options : acceptance_options);
      emitted += gain;
    }
    if (!s.none() && batch[i].model_draft && !by_ngram) {
      ++drafting;
      nodes += s.nodes();
      levels = std::max(levels, s.depth);
      catch_up += CatchUp(batch[i], s, gain, options_);
    }
  }
  if (rows == 0) return 0.0;
  const double t =
      costs_.VerifySeconds(rows, VerifyStepTokens(options_.padded_rows, rows, tokens, longest)) +
      costs_.DraftSeconds(drafting, levels, nodes, catch_up);
  return PricedGoodput(emitted, t, tree_nodes, options_);
}

PolicyDecision GoodputPolicy::Decide(absl::Span<const PolicySequence> batch) {
  const size_t n = batch.size();
  // The chain a probe drafts, within a depth budget.
  auto probe_shape = [](int max_depth) { return Clamp(SpecShape{2, 1, 2}, max_depth); };
  // The pooled prior: at each depth, the rate of the sequences that have enough samples to
  // speak for themselves, from their own samples (each weighted by them), averaged over steps so
  // that one batch's mix does not swing it. Their own samples, not their estimates: those are
  // shrunk toward the prior, and a prior pooled from them would stay between the constant and
  // the pair's rate, the more so the more sequences are young (a burst of new requests), and
  // new sequences would be judged on it.
  {
    constexpr int kDepths = AcceptanceEstimate::kMaxDepth;
    constexpr int kRanks = AcceptanceEstimate::kMaxRank;
    double rank_sum[kRanks] = {}, rank_weight[kRanks] = {};
    for (const PolicySequence& s : batch) {
      if (s.acceptance == nullptr || s.acceptance->samples() < 4) continue;
      for (int r = 1; r <= kRanks; ++r) {
        double w;
        const double rate = s.acceptance->OwnSiblingRate(r, &w);
        if (w <= 0) break;  // no sibling this far back was tried, nor further
        rank_sum[r - 1] += w * rate;
        rank_weight[r - 1] += w;
      }
    }
    // Trees' layouts (open levels, path widths), for each tree candidate and depth, the same
    // way but not shrunk: they are the drafter's, alike for every sequence. Sums by candidate
    // and depth: open, its weight, width, its weight.
    std::vector<double> layout;
    for (const PolicySequence& s : batch) {
      if (s.acceptance == nullptr || !s.acceptance->has_trees()) continue;
      if (layout.empty()) layout.assign(pooled_trees_.size() * 4 * kDepths, 0.0);
      for (size_t j = 0; j < pooled_trees_.size(); ++j) {
        double* sums = layout.data() + j * 4 * kDepths;
        s.acceptance->AddTreeLayout(pooled_trees_[j].shape, sums, sums + kDepths,
                                    sums + 2 * kDepths, sums + 3 * kDepths);
      }
    }
    for (size_t j = 0; j < pooled_trees_.size() && !layout.empty(); ++j) {
      PolicyOptions::TreePrior& tree = pooled_trees_[j];
      const double* sums = layout.data() + j * 4 * kDepths;
      auto pool = [&](double sum, double weight, double* p) {
        if (weight < 4) return;
        const double mean = sum / weight;
        const double before = *p;
        *p = *p < 0 ? mean : *p + 0.2 * (mean - *p);
        if (*p != before) ++prior_version_;
      };
      for (int d = 1; d <= std::min(tree.shape.depth, kDepths); ++d) {
        pool(sums[d - 1], sums[kDepths + d - 1], &tree.open[d - 1]);
        pool(sums[2 * kDepths + d - 1], sums[3 * kDepths + d - 1], &tree.width[d - 1]);
      }
    }
    // Sibling rates pool as the depths do, shrunk toward their constant prior; a rank with too
    // few samples across the batch takes the rank above's.
    for (int r = 0; r < kRanks && rank_weight[r] > 0 && (r == 0 || rank_weight[r] >= 24); ++r) {
      const double mean =
          (2.0 * options_.sibling_acceptance_prior + rank_sum[r]) / (2.0 + rank_weight[r]);
      double& p = pooled_by_rank_[r];
      const double before = p;
      p = p < 0 ? mean : p + 0.2 * (mean - p);
      if (p != before) ++prior_version_;
    }
    if (PoolChainRates(
            batch, [](const PolicySequence& s) { return s.acceptance; }, options_.acceptance_prior,
            pooled_by_depth_)) {
      // The candidate caches hold while the priors do (a batch whose estimates stand still).
      ++prior_version_;
    }
    pooled_rate_ = pooled_by_depth_[0];
    // The n-gram estimates (auto's second drafter) pool apart: another drafter, other rates.
    PoolChainRates(
        batch, [](const PolicySequence& s) { return s.ngram_acceptance; },
        options_.acceptance_prior, pooled_ngram_by_depth_);
  }
  const PolicyOptions acceptance_options = AcceptanceOptions();
  PolicyDecision out;
  out.shapes.assign(n, SpecShape());
  out.reasons.assign(n, ShapeReason::kPolicy);
  out.ingest.assign(n, 0);
  out.deferred.assign(n, SpecShape());
  out.ngram.assign(n, 0);
  std::vector<char> free(n, 0);
  // Its deferred shape's catch-up has been fed: the shape is drafted now, or kept as the
  // previous decision (below).
  std::vector<char> deferred_due(n, 0);
  std::vector<SpecShape> candidates = {SpecShape()};
  candidates.insert(candidates.end(), options_.candidates.begin(), options_.candidates.end());
  // The model drafter's candidates are [0, model_nc); past them, where some sequence has an
  // n-gram proposal, the proposal cut to each of ngram_depths (per sequence: cut to its
  // proposal's length, none without one). A batch without proposals pays nothing for them.
  const size_t model_nc = candidates.size();
  const bool any_ngram = std::any_of(batch.begin(), batch.end(), [](const PolicySequence& s) {
    return !s.fixed && s.ngram_depth > 0 && s.ngram_acceptance != nullptr;
  });
  int deepest_ngram = 0;
  for (const int d : any_ngram ? options_.ngram_depths : std::vector<int>()) {
    if (d < 1) continue;
    candidates.push_back(SpecShape{d, 1, d});
    deepest_ngram = std::max(deepest_ngram, d);
  }
  const size_t nc = candidates.size();
  // Whether candidate c of sequence i is drafted by the model drafter (costs draft time).
  auto model_drafted = [&](size_t i, size_t c) { return batch[i].model_draft && c < model_nc; };
  std::vector<double> ngram_gain(std::min(deepest_ngram, AcceptanceEstimate::kMaxDepth));
  const PolicyOptions ngram_options = any_ngram ? NgramAcceptanceOptions() : PolicyOptions();
  // Each candidate as clamped to each free sequence, and its expected accepted length, computed
  // once: row i of an n x candidates table (one allocation each, not one per sequence).
  std::vector<SpecShape> clamped_table(n * nc);
  std::vector<double> gain_table(n * nc);
  auto clamped = [&](size_t i) { return clamped_table.data() + i * nc; };
  auto gain = [&](size_t i) { return gain_table.data() + i * nc; };
  size_t free_count = 0;
  int deepest_chain = 0, deepest_candidate = 0;  // of the model drafter's candidates
  for (size_t c = 0; c < model_nc; ++c) {
    const SpecShape& shape = candidates[c];
    if (!shape.none() && IsChain(shape)) deepest_chain = std::max(deepest_chain, shape.depth);
    deepest_candidate = std::max(deepest_candidate, shape.depth);
  }
  std::vector<double> chain_gain(deepest_chain);
  // The model drafter's candidates clamped to each depth budget (up to the deepest candidate),
  // as needed.
  std::vector<SpecShape> clamped_by_depth((deepest_candidate + 1) * model_nc);
  std::vector<char> clamped_done(deepest_candidate + 1, 0);
  std::vector<char> unclamped(n, 0);  // the sequence's budget clamps no candidate
  for (size_t i = 0; i < n; ++i) {
    const PolicySequence& s = batch[i];
    if (s.fixed) {
      out.shapes[i] = Clamp(s.fixed_shape, s.max_depth);
      out.reasons[i] = s.fixed_shape.none() ? ShapeReason::kOff
                       : s.max_depth <= 0   ? ShapeReason::kNoBudget
                                            : ShapeReason::kExplicit;
      continue;
    }
    if (s.max_depth <= 0 || s.acceptance == nullptr) {
      out.reasons[i] = ShapeReason::kNoBudget;
      continue;
    }
    // A deferred shape (PolicySequence::deferred) that is a probe, or behind a padded backend,
    // is drafted as planned; elsewhere it is the previous decision (below), judged anew: kept
    // blindly on a CPU, new sequences drafted 16-node trees where drafting cannot pay.
    deferred_due[i] =
        !s.deferred.none() && CatchUpTokens(s, s.deferred) <= options_.ingest_catch_up_tokens;
    const bool probe = s.deferred == probe_shape(s.max_depth);
    if (deferred_due[i] && (probe || options_.padded_rows)) {
      out.shapes[i] = Clamp(s.deferred, s.max_depth);
      if (probe) out.reasons[i] = ShapeReason::kProbe;
      continue;
    }
    free[i] = 1;
    ++free_count;
    // Budgets at or past the deepest candidate clamp nothing: they share their clamped shapes
    // and expectations.
    // The n-gram proposal's candidates: cut to its length, none without one.
    const int ngram_depth =
        s.ngram_acceptance != nullptr ? std::min(s.ngram_depth, s.max_depth) : 0;
    if (nc > model_nc && ngram_depth > 0) {
      s.ngram_acceptance->ExpectedAcceptedChains(
          ngram_options,
          absl::MakeSpan(ngram_gain.data(), std::min<size_t>(ngram_depth, ngram_gain.size())));
    }
    for (size_t c = model_nc; c < nc; ++c) {
      clamped(i)[c] = Clamp(candidates[c], ngram_depth);
      const int d = clamped(i)[c].depth;
      gain(i)[c] = d > 0 && d <= static_cast<int>(ngram_gain.size()) ? ngram_gain[d - 1] : 0.0;
    }
    if (!s.model_available) {
      // Only none and the proposal.
      std::fill_n(clamped(i), model_nc, SpecShape());
      std::fill_n(gain(i), model_nc, 0.0);
      continue;
    }
    const int depth_key = std::min(s.max_depth, deepest_candidate);
    if (!clamped_done[depth_key]) {
      for (size_t c = 0; c < model_nc; ++c) {
        clamped_by_depth[depth_key * model_nc + c] = Clamp(candidates[c], s.max_depth);
      }
      clamped_done[depth_key] = 1;
    }
    std::copy_n(clamped_by_depth.begin() + depth_key * model_nc, model_nc, clamped(i));
    unclamped[i] = depth_key == deepest_candidate;
    // The expectations change only with the estimate (Observe clears them) and the prior, so a
    // sequence not drafted since the last decision keeps them.
    AcceptanceEstimate::CandidateCache& cache = s.acceptance->candidate_cache();
    if (cache.policy == id_ && cache.prior == prior_version_ && cache.depth == depth_key &&
        cache.gains.size() == model_nc) {
      std::copy(cache.gains.begin(), cache.gains.end(), gain(i));
      continue;
    }
    // Every chain candidate's expectation from one pass over the depths.
    s.acceptance->ExpectedAcceptedChains(
        acceptance_options,
        absl::MakeSpan(chain_gain.data(), std::min(deepest_chain, s.max_depth)));
    for (size_t c = 0; c < model_nc; ++c) {
      const SpecShape& shape = clamped(i)[c];
      gain(i)[c] = !shape.none() && IsChain(shape) && Width(shape) <= 1.0 &&
                           shape.depth <= std::min(deepest_chain, s.max_depth)
                       ? chain_gain[shape.depth - 1]
                       : s.acceptance->ExpectedAccepted(shape, acceptance_options);
    }
    cache.policy = id_;
    cache.prior = prior_version_;
    cache.depth = depth_key;
    cache.gains.assign(gain(i), gain(i) + model_nc);
  }
  // Requests that started together (a burst, a benchmark's wave) finish together only if they
  // are drafted alike: one left without drafts while the rest draft is left alone at the end,
  // running steps of a few rows that cost nearly what the full batch's did, and the batch is
  // done only when it is (bench/CURRENT.md: 0.86x off at 128 streams on the H200, where the
  // policy drafted part of the batch). So a sequence's expected gain is weighted by what it has
  // left to generate against the batch's mean: a sequence that falls behind is drafted before
  // the margin tips, one near its end gives way. Sequences with more left than a draft budget
  // can see (kMaxTreeNodes) weigh the same, so long generations are priced as before. The weight
  // is held to 0.75-1.5: near break-even a nudge is all a laggard needs.
  std::vector<double> emit_weight(n, 1.0);
  bool cohort = false;
  {
    double left = 0;
    for (size_t i = 0; i < n; ++i) left += free[i] ? batch[i].max_depth + 1.0 : 0.0;
    double mean = free_count > 0 ? left / free_count : 0.0, spread = 0;
    for (size_t i = 0; i < n; ++i) {
      if (free[i]) spread += std::abs(batch[i].max_depth + 1.0 - mean);
    }
    // Only a cohort (what is left within about a tenth of the mean on average) is weighted. In
    // open traffic, requests of every length at once, the weight would only bend the per-step
    // objective: long requests drafted where drafting loses (0.89x off at 128 streams on the
    // H200 model, p 0.85, in the replay).
    if (free_count == 0 || spread > 0.1 * mean * free_count) mean = 0;
    cohort = mean > 0;
    for (size_t i = 0; i < n && mean > 0; ++i) {
      if (!free[i]) continue;
      emit_weight[i] = std::clamp((batch[i].max_depth + 1.0) / mean, 0.75, 1.5);
      for (size_t c = 0; c < nc; ++c) gain(i)[c] *= emit_weight[i];
    }
  }

  // A row's shape moves it between token buckets: from its pending tokens alone to pending
  // plus the tree's nodes (sign +1), or back (sign -1).
  auto row_bucket = [](int tokens) {
    return std::min(RowTokenBucket(tokens), kRowTokenBuckets - 1);
  };
  // `model`: drafted by the model drafter (its levels cost draft time).
  auto add_as = [&](Totals& t, size_t i, const SpecShape& s, double g, int sign, bool model) {
    t.tokens += sign * s.nodes();
    t.tree_nodes += sign * s.nodes();
    t.emitted += sign * g;
    if (s.nodes() > 0) {
      t.AddRows(row_bucket(batch[i].pending), -sign);
      t.AddRows(row_bucket(batch[i].pending + s.nodes()), sign);
    }
    if (!s.none() && model) {
      t.drafting += sign;
      t.draft_nodes += sign * s.nodes();
      t.catch_up += sign * CatchUp(batch[i], s, g / emit_weight[i], options_);
      t.AddDepth(std::min(s.depth, AcceptanceEstimate::kMaxDepth + 1), sign);
    }
  };
  auto add = [&](Totals& t, size_t i, const SpecShape& s, double g, int sign) {
    add_as(t, i, s, g, sign, batch[i].model_draft);
  };
  // Candidate c of sequence i.
  auto add_c = [&](Totals& t, size_t i, size_t c, int sign) {
    add_as(t, i, clamped(i)[c], gain(i)[c], sign, model_drafted(i, c));
  };
  // The search below prices thousands of candidate totals a step at 128 sequences, and the
  // router pays for it on every step; most share their verify token count and draft call, so
  // each cost is computed once per decision (the costs do not change during one).
  // Every assignment has one row per sequence, so a verify cost is a function of the step's
  // tokens alone: looked up by them (negative: not computed yet).
  absl::flat_hash_map<int64_t, double> draft_memo;
  std::vector<double> verify_memo;
  const double catch_up_token_s = costs_.CatchUpTokenSeconds();
  auto verify_seconds = [&](int rows, int step_tokens) {
    if (static_cast<size_t>(step_tokens) >= verify_memo.size()) {
      verify_memo.resize(std::max<size_t>(step_tokens + 1, 2 * verify_memo.size()), -1.0);
    }
    double& v = verify_memo[step_tokens];
    if (v < 0) v = costs_.VerifySeconds(rows, step_tokens);
    return v;
  };
  // A step's predicted seconds; without its catch-ups (`with_catch_up` false) a lower bound of
  // them, the same sums with a term no smaller than zero left out.
  // `memo`: look the draft call up (or add it); the starting points' sweeps below price each
  // draft call once (every step of a sweep drafts one more sequence), where a memo only costs.
  auto seconds_of = [&](const Totals& t, bool with_catch_up, bool memo = true) {
    const int step_tokens =
        VerifyStepTokens(options_.padded_rows, t.rows, t.tokens, t.longest_row());
    const double verify = verify_seconds(t.rows, step_tokens);
    double draft = 0;
    const int levels = t.levels();
    if (t.drafting > 0 && levels > 0) {
      // DraftSeconds is its call's cost plus catch-up tokens at a per-token price.
      double call;
      if (memo) {
        const int64_t draft_key = (static_cast<int64_t>(t.drafting) << 40) |
                                  (static_cast<int64_t>(levels) << 32) | t.draft_nodes;
        auto d = draft_memo.try_emplace(draft_key, 0.0);
        if (d.second) d.first->second = costs_.DraftSeconds(t.drafting, levels, t.draft_nodes);
        call = d.first->second;
      } else {
        call = costs_.DraftSeconds(t.drafting, levels, t.draft_nodes);
      }
      draft = with_catch_up ? call + std::max(t.catch_up, 0.0) * catch_up_token_s : call;
    }
    return verify + draft;
  };
  auto score = [&](const Totals& t, bool memo = true) {
    return PricedGoodput(t.emitted, seconds_of(t, true, memo), t.tree_nodes, options_);
  };
  // choice[i]: index into candidates; -1 for sequences that are not free.
  auto totals_of = [&](const std::vector<int>& choice) {
    Totals t;
    for (size_t i = 0; i < n; ++i) {
      ++t.rows;
      t.tokens += batch[i].pending;
      t.AddRows(row_bucket(batch[i].pending), 1);
      t.emitted += 1.0;
      if (free[i]) {
        add_c(t, i, choice[i], +1);
      } else if (!out.shapes[i].none()) {
        const double g = batch[i].acceptance != nullptr ? batch[i].acceptance->ExpectedAccepted(
                                                              out.shapes[i], acceptance_options)
                                                        : 0.0;
        add(t, i, out.shapes[i], g, +1);
      }
    }
    return t;
  };

  // The previous assignment, as candidates (a previous shape not among them counts as none).
  std::vector<int> previous(n, -1);
  for (size_t i = 0; i < n; ++i) {
    if (!free[i]) continue;
    previous[i] = 0;
    // A deferred shape whose catch-up has been fed is the decision the hysteresis keeps.
    const SpecShape prev =
        Clamp(deferred_due[i] ? batch[i].deferred : batch[i].previous, batch[i].max_depth);
    if (batch[i].previous_ngram && !deferred_due[i]) {
      // An n-gram proposal's length changes every step: the previous drafter is kept as the
      // deepest cut of this step's proposal no deeper than the previous one.
      for (size_t c = model_nc; c < nc; ++c) {
        const SpecShape& shape = clamped(i)[c];
        if (!shape.none() && shape.depth <= prev.depth &&
            (previous[i] == 0 || shape.depth > clamped(i)[previous[i]].depth)) {
          previous[i] = static_cast<int>(c);
        }
      }
      continue;
    }
    for (size_t c = 0; c < model_nc; ++c) {
      if (clamped(i)[c] == prev) {
        previous[i] = static_cast<int>(c);
        break;
      }
    }
  }
  const double previous_score = score(totals_of(previous));

  // Starting points: for each candidate shape, the k sequences that gain most from it get it
  // (the best k). Taken when clearly better than the previous assignment; the draft call's
  // levels are shared, so single-sequence moves alone would not leave "all none".
  std::vector<int> choice = previous;
  if (free_count > 0) {
    std::vector<int> none_all(n, -1);
    for (size_t i = 0; i < n; ++i) {
      if (free[i]) none_all[i] = 0;
    }
    const Totals base = totals_of(none_all);
    std::vector<int> start = none_all;
    double start_score = score(base);
    std::vector<size_t> order;
    // The model drafter's candidates only: the n-gram proposal shares no draft call among the
    // sequences that take it, so the single-sequence moves below find it.
    for (size_t c = 1; c < model_nc; ++c) {
      order.clear();
      for (size_t i = 0; i < n; ++i) {
        if (free[i]) order.push_back(i);
      }
      // By gain, ties in batch order (a stable sort's order, without its buffer).
      std::sort(order.begin(), order.end(), [&](size_t x, size_t y) {
        const double gx = gain(x)[c], gy = gain(y)[c];
        return gx > gy || (gx == gy && x < y);
      });
      Totals t = base;
      size_t best_k = 0;
      double best_k_score = score(t);
      for (size_t k = 0; k < order.size(); ++k) {
        add_c(t, order[k], c, +1);
        const double s = score(t, /*memo=*/false);
        if (s > best_k_score) {
          best_k_score = s;
          best_k = k + 1;
        }
      }
      if (best_k_score > start_score) {
        start_score = best_k_score;
        start = none_all;
        for (size_t k = 0; k < best_k; ++k) start[order[k]] = static_cast<int>(c);
      }
    }
    // Once drafting's costs are measured, the margin is the hysteresis's share of the sequences
    // that have a decision to keep: sequences never drafted yet (new requests) have none, and
    // held to it, a batch of them near break-even stays undrafted, while the catch-up each must
    // first be fed weighs more every step (fewer steps left to spread it over), so that it never
    // starts. Before, the draft's cost is an optimistic guess, which the margin tempers.
    size_t settled = 0;
    for (size_t i = 0; i < n; ++i) {
      settled += free[i] && (!batch[i].never_drafted || !costs_.draft_measured()) ? 1 : 0;
    }
    const double margin = options_.hysteresis * static_cast<double>(settled) / free_count;
    if (start_score > previous_score * (1.0 + margin)) choice = start;
  }
  // Then single-sequence moves; a sequence leaves its previous shape only for a gain worth
  // its share of the hysteresis margin.
  //
  // Most tries lose, most of all where the step stays without drafts, and each costs two
  // updates of the totals and a score. So a try from "none" is first bounded: with the totals'
  // counts as they are, a shape on a row of given pending tokens (drafted by the model or not)
  // gives the step a time no shorter than its time without catch-ups, computed once per shape
  // and row kind until a move changes the counts; the sequence's gain over that time bounds the
  // try's score from above (the same sums in the same order, with a term >= 0 left out of the
  // time: IEEE rounding keeps the order). A try that cannot beat the best so far is skipped,
  // but its rounding of the totals' sums (add, then subtract) is kept, so that every later score
  // and so every decision is bit for bit what the full tries give.
  absl::flat_hash_map<std::tuple<int, int, int, int, bool>, double> seconds_floor;
  // The same for the common rows (one pending token, no candidate clamped), by candidate and
  // drafter kind (negative: not computed).
  std::vector<double> seconds_floor_common(2 * nc, -1.0);
  Totals t = totals_of(choice);
  double current = score(t);
  for (int pass = 0; pass < 2 && free_count > 0; ++pass) {
    bool moved = false;
    for (size_t i = 0; i < n; ++i) {
      if (!free[i]) continue;
      const int from = choice[i];
      add_c(t, i, from, -1);
      int best = from;
      double best_s = current;
      for (size_t c = 0; c < candidates.size(); ++c) {
        if (static_cast<int>(c) == from) continue;
        const SpecShape& shape = clamped(i)[c];
        // A candidate cut to none (no n-gram proposal, no model drafter) is candidate 0.
        if (c != 0 && shape.none()) continue;
        const double g = gain(i)[c];
        const bool model = model_drafted(i, c);
        if (from == 0) {
          double* floor;
          if (unclamped[i] && batch[i].pending == 1 && c < model_nc) {
            floor = &seconds_floor_common[2 * c + (model ? 1 : 0)];
          } else {
            floor = &seconds_floor
                         .try_emplace(std::make_tuple(shape.depth, shape.top_k, shape.max_nodes,
                                                      batch[i].pending, model),
                                      -1.0)
                         .first->second;
          }
          if (*floor < 0) {
            Totals with = t;
            add_as(with, i, shape, g, +1, model);
            *floor = seconds_of(with, false);
          }
          if (PricedGoodput(t.emitted + g, *floor, t.tree_nodes + shape.nodes(), options_) <=
              best_s) {
            // The try's add and subtract without its score: the totals' sums keep the rounding
            // the full try gives them.
            add_as(t, i, shape, g, +1, model);
            add_as(t, i, shape, g, -1, model);
            continue;
          }
        }
        add_as(t, i, shape, g, +1, model);
        const double s = score(t);
        add_as(t, i, shape, g, -1, model);
        const double margin =
            from == previous[i] ? options_.hysteresis / static_cast<double>(free_count) : 0.0;
        if (s > best_s * (1.0 + margin) + 1e-12 && s > best_s) {
          best = static_cast<int>(c);
          best_s = s;
        }
      }
      add_c(t, i, best, +1);
      if (best != from) {
        choice[i] = best;
        current = best_s;
        moved = true;
        seconds_floor.clear();  // the counts changed
        std::fill(seconds_floor_common.begin(), seconds_floor_common.end(), -1.0);
      }
    }
    if (!moved) break;
  }

  int probes = 0;
  // A probe's chain is judged as if it accepted nearly everything.
  constexpr double kProbeGain = 0.9 + 0.81;
  // Tokens a second a stall costs the other rows (PlanCatchUp): it delays every later token, so
  // at their plain-step rate, not this step's (a prefill step emits few tokens for its time).
  const double others =
      static_cast<double>(n - 1) / costs_.VerifySeconds(static_cast<int>(n), static_cast<int>(n));
  // What catch-ups fed beside verify may take: the step's verify without trees, less the ingest
  // call's own round trip (a one-token draft call's).
  int pending_tokens = 0;
  for (const PolicySequence& s : batch) pending_tokens += s.pending;
  double ingest_room =
      costs_.VerifySeconds(static_cast<int>(n), pending_tokens) - costs_.DraftSeconds(1, 1, 1);
  for (size_t i = 0; i < n; ++i) {
    if (!free[i]) continue;
    out.shapes[i] = clamped(i)[choice[i]];
    if (static_cast<size_t>(choice[i]) >= model_nc && !out.shapes[i].none()) {
      out.ngram[i] = 1;
      out.reasons[i] = ShapeReason::kNgram;
    }
    // A sequence left without drafts on a handful of outcomes (an early miss or two) is probed
    // sooner, in proportion to them: so little evidence is soon outweighed, and a sequence held
    // back on it while the rest of its batch drafts is left the last to finish.
    const int interval =
        std::max(4, std::min(options_.probe_interval,
                             options_.probe_interval * batch[i].acceptance->samples() / 16));
    if (out.shapes[i].none() && options_.probe_interval > 0 && batch[i].model_available &&
        (batch[i].steps_without_draft >= interval || batch[i].never_drafted) &&
        probes < options_.max_probes_per_step) {
      // Probe only where a probe could be worth it: the short chain would pay if this sequence
      // accepted nearly everything. Elsewhere (a saturated batch, a tiny target, a padded batch
      // whose every row a probe would lengthen) no acceptance could make it pay, and the probe,
      // which also feeds the drafter the tokens it missed, would only stall the batch. A
      // sequence never drafted is judged the same way: where nothing could pay, its acceptance
      // does not matter. Probes taken are kept in the totals, so each next one is judged with
      // the cost of those before it, and at most max_probes_per_step are taken at once, so that
      // a burst of new sequences does not stall one step with all their catch-ups.
      const SpecShape probe = probe_shape(batch[i].max_depth);
      constexpr double kOptimistic = kProbeGain;
      add_c(t, i, choice[i], -1);
      add(t, i, probe, kOptimistic, +1);
      // Judged with its whole catch-up even where it would be fed beside verify (judged free,
      // probes went out nearly every step where drafting cannot pay); one worth it is then fed
      // there where PlanCatchUp says so, and drafts on a later step.
      const CatchUpPlan plan = PlanCatchUp(batch[i], probe, kOptimistic, catch_up_token_s, others,
                                           ingest_room, options_);
      const double unshared = ProbeUnsharedCatchUp(batch[i], probe, kOptimistic, options_);
      t.catch_up += unshared;
      const double s = score(t);
      t.catch_up -= unshared;
      if (s > current && plan != CatchUpPlan::kInCall) {
        add(t, i, probe, kOptimistic, -1);
        add_c(t, i, choice[i], +1);
        if (plan == CatchUpPlan::kIngest) {
          ingest_room -= catch_up_token_s * CatchUpTokens(batch[i], probe);
          out.reasons[i] = ShapeReason::kCatchUp;
          out.ingest[i] = 1;
          out.deferred[i] = probe;
          ++probes;
        }
      } else if (s > current) {
        t.catch_up += unshared;
        out.shapes[i] = probe;
        out.reasons[i] = ShapeReason::kProbe;
        current = s;
        ++probes;
      } else {
        add(t, i, probe, kOptimistic, -1);
        add_c(t, i, choice[i], +1);
      }
    }
    // The n-gram proposal is probed the same way (its first two tokens), so that a sequence
    // whose n-gram estimate fell low on a few misses can recover: the proposal's quality moves
    // with the text (a function body repeats what a docstring said, the next one does not).
    size_t ngram_probe = 0;  // the candidate: the proposal cut to 2 tokens, or to 1
    for (size_t c = model_nc; c < nc; ++c) {
      const SpecShape& shape = clamped(i)[c];
      if (!shape.none() && shape.depth <= 2 &&
          (ngram_probe == 0 || shape.depth > clamped(i)[ngram_probe].depth)) {
        ngram_probe = c;
      }
    }
    const int ngram_interval =
        batch[i].ngram_acceptance == nullptr
            ? 0
            : std::max(
                  4, std::min(options_.probe_interval,
                              options_.probe_interval * batch[i].ngram_acceptance->samples() / 16));
    if (out.shapes[i].none() && !out.ingest[i] && ngram_probe > 0 && options_.probe_interval > 0 &&
        batch[i].steps_without_ngram >= ngram_interval && probes < options_.max_probes_per_step) {
      const SpecShape& probe = clamped(i)[ngram_probe];
      add_c(t, i, choice[i], -1);
      add_as(t, i, probe, kProbeGain, +1, /*model=*/false);
      const double s = score(t);
      if (s > current) {
        out.shapes[i] = probe;
        out.ngram[i] = 1;
        out.reasons[i] = ShapeReason::kProbe;
        current = s;
        ++probes;
      } else {
        add_as(t, i, probe, kProbeGain, -1, /*model=*/false);
        add_c(t, i, choice[i], +1);
      }
    }
  }
  // Catch-ups are fed before the step's first draft level, so their cost stalls the whole batch
  // for this one step, however well it is amortised. Bounded like a prefill budget: beyond the
  // first, a sequence starts drafting only while the step's catch-ups cost no more than the
  // step's verify; the rest start on later steps. Unless that staggering is itself the loss: a
  // batch of new sequences (a burst of requests) whose drafting pays only all together, because
  // a draft call and verify's bigger trees cost the whole batch while the few let through gain
  // little, would run partly drafted for many steps, each dearer than a plain one, and a
  // sequence that starts drafting late finishes late (bench/CURRENT.md: 0.86x off at 128
  // streams on the H200). Where the budget's cut is predicted worse than no drafts at all, or
  // the batch is a cohort (requests that started together: the sequences the cut holds back are
  // the wave's tail, which the per-step prediction does not see; 0.93x the best fixed shape at
  // 16 streams in the H200 replay), and the whole choice is better than no drafts by the
  // hysteresis margin, every catch-up is fed in this one step,
  // once the pair's acceptance has been measured (the pooled rate): before, the few let through
  // are what measures it, and the whole batch's catch-ups are not staked on the prior.
  // Where the caller can, a long catch-up is fed beside verify instead (PlanCatchUp).
  const double token_s = costs_.CatchUpTokenSeconds();
  // An imposed shape (an explicit request) gets the tree it asked for, but a new sequence's
  // prompt is fed beside verify's prefill all the same, and it drafts from its second step: the
  // first token is not the drafter's to hold back.
  for (size_t i = 0; i < n; ++i) {
    const PolicySequence& s = batch[i];
    if (!s.fixed || out.shapes[i].none() || !s.drafter_unfed || !s.can_ingest || !s.model_draft) {
      continue;
    }
    const int tokens = CatchUpTokens(s, out.shapes[i]);
    if (tokens <= options_.ingest_catch_up_tokens || tokens * token_s > ingest_room) continue;
    ingest_room -= tokens * token_s;
    out.shapes[i] = SpecShape();
    out.reasons[i] = ShapeReason::kCatchUp;
    out.ingest[i] = 1;
  }
  double budget =
      options_.catch_up_budget * costs_.VerifySeconds(static_cast<int>(n), static_cast<int>(n));
  std::vector<std::pair<size_t, SpecShape>> cut;  // sequences the budget cut, and their shapes
  bool first = true;
  for (size_t i = 0; i < n; ++i) {
    if (!free[i] || out.shapes[i].none() || !batch[i].model_draft || out.ngram[i]) continue;
    const double g =
        out.reasons[i] == ShapeReason::kProbe ? kProbeGain : gain(i)[choice[i]] / emit_weight[i];
    const CatchUpPlan plan =
        PlanCatchUp(batch[i], out.shapes[i], g, token_s, others, ingest_room, options_);
    if (plan == CatchUpPlan::kIngest)
      ingest_room -= token_s * CatchUpTokens(batch[i], out.shapes[i]);
    if (plan != CatchUpPlan::kInCall) {
      if (plan == CatchUpPlan::kIngest) out.deferred[i] = out.shapes[i];
      out.shapes[i] = SpecShape();
      out.reasons[i] = plan == CatchUpPlan::kIngest ? ShapeReason::kCatchUp : ShapeReason::kPolicy;
      out.ingest[i] = plan == CatchUpPlan::kIngest ? 1 : 0;
      continue;
    }
    const double cost = token_s * CatchUpTokens(batch[i], out.shapes[i]);
    if (cost <= 0) continue;
    if (!first && cost > budget) {
      cut.emplace_back(i, out.shapes[i]);
      out.shapes[i] = SpecShape();
      out.reasons[i] = ShapeReason::kPolicy;
      continue;
    }
    budget -= cost;
    first = false;
  }
  out.predicted_goodput = Goodput(batch, out.shapes, out.ngram);
  if (!cut.empty() && pooled_rate_ >= 0) {
    std::vector<SpecShape> whole = out.shapes, plain = out.shapes;
    for (const auto& [i, shape] : cut) whole[i] = shape;
    for (size_t i = 0; i < n; ++i) {
      if (free[i]) plain[i] = SpecShape();
    }
    const double whole_goodput = Goodput(batch, whole, out.ngram),
                 plain_goodput = Goodput(batch, plain, out.ngram);
    if ((cohort || out.predicted_goodput < plain_goodput) &&
        whole_goodput > plain_goodput * (1.0 + options_.hysteresis)) {
      out.shapes = std::move(whole);
      out.predicted_goodput = whole_goodput;
    }
  }
  return out;
}

}  // namespace specd
