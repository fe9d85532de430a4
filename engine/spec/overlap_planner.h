// Whether a step pre-drafts beside verify (`--overlap=auto`), and how much.
//
// GoodputPolicy::PlanPreDraft says what fits: the deepest trees, then the most outcome guesses,
// whose pre-draft the cost model predicts ends inside the verify step. Fitting is not paying. A
// pre-draft saves only the draft round trips of the sequences whose guess comes true, and at a
// batch of n the sequential draft call still runs whenever any one of them misses, for the
// misses alone (a draft call's levels cost the same for one row as for several), so its saving
// shrinks like the chance that all n hit. Against it stand costs the fit leaves out: verify runs
// slower while the pre-draft runs beside it (a GPU or memory bus the two share), and the router
// waits past verify's answer for pre-drafts that overran (on a miss, pure loss; a late one also
// leaves its sequences a plain step). This planner measures those costs and the hit rate from
// the overlapped steps that ran and pre-drafts only where the expected saving beats them; else
// the step is today's sequential one (fan-out 0), at the sequential step's cost.
//
// Measuring needs both kinds of step: verify's slowdown is an overlapped step's time against
// the same verify bucket run sequentially, so the sequential buckets learn only from sequential
// steps (the router passes overlapped ones here), and while pre-drafting, one step in
// `probe_interval` is left sequential to keep them current; while not pre-drafting, one in
// `probe_interval` pre-drafts, so that a hit rate or a wait measured in a bad patch (another
// job on the draft's core, a burst of new sequences) is measured again.
#ifndef SPECD_ENGINE_SPEC_OVERLAP_PLANNER_H_
#define SPECD_ENGINE_SPEC_OVERLAP_PLANNER_H_

#include <vector>

#include "absl/types/span.h"
#include "engine/spec/policy.h"

namespace specd {

class OverlapPlanner {
 public:
  // `policy` (its costs and options) must outlive the planner; one scheduler thread.
  explicit OverlapPlanner(const GoodputPolicy* policy) : policy_(policy) {}

  // Why Plan chose what it did (for tests and logs).
  enum class Why {
    kPays,     // the expected saving beats the measured costs
    kNoFit,    // not even a depth-1 pre-draft fits inside the verify step
    kNoGain,   // it fits, but hits are too rare (or the costs too high) to pay
    kProbe,    // would not pay, pre-drafted anyway to measure again
    kRefresh,  // would pay, left sequential to re-measure the sequential verify
    kNothing,  // no shapes to pre-draft
  };
  struct Plan {
    GoodputPolicy::PreDraftPlan pre;  // fan_out 0: the sequential step
    GoodputPolicy::PreDraftPlan fit;  // kNoGain: what fits (PlanPreDraft), left out
    Why why = Why::kNothing;
    double saving_s = 0;  // expected draft seconds the pre-draft saves the step
    // Expected seconds it adds: verify slowed, waits past verify, and where the trees below the
    // guesses are cut to fit, the tokens a hit's shallower tree is expected to lose, at the
    // step's seconds a token.
    double cost_s = 0;
    std::vector<double> guess_rates;  // per shape: GuessRate (for ObserveOutcome)
  };
  // One draft service's step: `shapes` the planned shape of each sequence whose tree is being
  // verified (the tree a hit verifies next grows to it), `acceptance` each one's estimate (may
  // be null: no hit expected), beside a verify step of `verify_rows` rows scoring
  // `verify_tokens` tokens (VerifyStepTokens). Counts the step for the probes.
  Plan Decide(absl::Span<const SpecShape> shapes,
              absl::Span<const AcceptanceEstimate* const> acceptance, int verify_rows,
              int verify_tokens, int max_fan_out);
  // The same judgement without counting (what Decide would say before probes and refreshes).
  Plan Judge(absl::Span<const SpecShape> shapes,
             absl::Span<const AcceptanceEstimate* const> acceptance, int verify_rows,
             int verify_tokens, int max_fan_out) const;

  // The chance, by a sequence's acceptance estimate, that a greedy target's outcome of a tree of
  // `shape` is the draft's guess: its greedy path accepted whole, then its bonus token the
  // draft's best (each at the chain's conditional rate of its depth). Known from the sequence's
  // first drafted steps on, so the judgement needs no pre-drafts to start; the measured hits
  // calibrate it (hit_calibration).
  static double GuessRate(const AcceptanceEstimate& acceptance, const SpecShape& shape,
                          const PolicyOptions& options);

  // Every verify step (`verify_tokens` as for Decide), `overlapped` when a pre-draft ran beside
  // it. Returns the seconds the cost model's buckets are to learn: an overlapped step's divided
  // by the measured slowdown, so that the policy's shapes are priced by verify alone whether or
  // not steps overlap, and the slowdown is not counted twice; 0 (learn nothing) for an
  // overlapped step whose bucket has no sequential sample yet.
  double ObserveVerify(int verify_rows, int verify_tokens, double seconds, bool overlapped);
  // A step that pre-drafted: how long the router waited past verify's answer for the pre-draft
  // (the whole bound for a late one).
  void ObserveWait(double seconds);
  // One pre-drafted sequence step's outcome: whether a guess came true (a late one is a miss),
  // and the GuessRate it was judged with.
  void ObserveOutcome(bool hit, double guess_rate);

  // Measured estimates (the priors until measured). Hits over the GuessRates of the same steps,
  // both decayed alike: the acceptance estimates leave out how the levels' outcomes correlate
  // (easy spans are accepted whole), and fan-out adds guesses.
  double hit_calibration() const { return (hits_ + kPseudo) / (guessed_ + kPseudo); }
  // Overlapped against sequential verify of `verify_rows` rows scoring `verify_tokens` tokens:
  // the ratio of the two kinds' measured times in that step's bucket (rows and tokens, each by
  // powers of two) once it has a few samples of both, or else the ratio pooled over the buckets
  // (1 before any).
  double verify_slowdown(int verify_rows, int verify_tokens) const;
  double wait_seconds() const { return wait_s_; }

 private:
  const GoodputPolicy* policy_;
  // Priors of no cost: a planner that never pre-drafts never measures what pre-drafting
  // costs; one that does corrects them within a few steps.
  static constexpr double kPseudo = 2.0;  // calibration 1 until a few hits say otherwise
  double hits_ = 0;
  double guessed_ = 0;
  static constexpr int kBuckets = 12;  // rows or tokens: 1, 2, 3-4, ..., 1025+
  static int Bucket(int n);
  // Per bucket: each kind's (sequential, overlapped) measured verify time over the policy's
  // verify prior (a fixed price: only the two kinds' samples of one bucket are compared).
  double ratio_[2][kBuckets][kBuckets] = {};
  int ratio_n_[2][kBuckets][kBuckets] = {};
  // A bucket's own slowdown once it has this many samples of each kind; before, the pooled one.
  static constexpr int kBucketSamples = 3;
  double slowdown_ = 1.0;  // pooled over the buckets
  int pooled_n_ = 0;
  double wait_s_ = 0;
  int wait_n_ = 0;
  int since_probe_ = 0;    // steps judged not to pay since the last pre-drafted one
  int since_refresh_ = 0;  // pre-drafted steps since the last one left sequential
};

const char* OverlapWhyName(OverlapPlanner::Why why);

}  // namespace specd

#endif  // SPECD_ENGINE_SPEC_OVERLAP_PLANNER_H_
