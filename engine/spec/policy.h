// The goodput policy: every step, for every sequence that may speculate, how much to speculate
// (a tree shape, down to none) so that the whole batch emits the most tokens per second.
//
// A step of a batch costs one verify call, whose time grows with the rows and the tokens it
// scores (pending tokens plus every tree node), and, when any sequence drafts, one draft call
// whose time grows with the deepest tree (one draft forward per level) and with the tokens per
// level. Sequence i then emits 1 + E_i[accepted] tokens, where the expected accepted length of a
// tree follows from that sequence's own acceptance rates, measured by sibling rank: its first
// children's at each depth, its later siblings' where the first missed, and how wide the trees
// it ran were along their accepted paths (each shrunk toward the rates pooled over the batch,
// which are also where a new sequence starts). The policy
// maximises
//   goodput = sum_i (1 + w_i E_i[accepted | shape_i]) / (verify(rows, tokens) + draft(...))
// over a small candidate set of shapes (none, chains 1..6, trees of 8 and 16 nodes), where w_i
// weighs what sequence i has left to generate against the batch's mean (0.75 to 1.5; what is left
// counted up to the depth budget's cap), where the batch is a cohort (what is left within about
// a tenth of the mean; 1 otherwise): requests that started together finish together only if
// drafted alike. Both costs are measured online from the
// steps that ran, in buckets, starting from priors (CostModel, cost_model.cc). A bucket is priced
// along the line through the measured buckets of the same batch size on the token axis
// (interpolated, extended by their slope, flat beyond a single one), so that the hardware's
// measured cost curve, not the prior's shape, decides whether more tokens are worth scoring.
//
// Because one sequence's deep tree costs the whole batch its draft levels and every node adds
// verify work, the best assignment couples sequences: at batch 1 with good acceptance a big tree
// wins, at large batch short chains or none. Hysteresis: a new assignment replaces the previous
// one only when it is predicted to be better by a margin, so one slow step or one prefill does
// not flip decisions every step.
//
// Under `auto` a sequence may also have a second drafter this step: n-gram lookup over its own
// history, whose proposal the caller computed (PolicySequence::ngram_depth). It costs verify
// time only, and is priced with the sequence's own n-gram acceptance, so per sequence and step
// the policy picks none, one of the model drafter's shapes or the proposal (cut to one of a few
// depths), whichever serves the batch best. The hysteresis keeps the previous step's drafter
// where it still can (a proposal exists).
//
// The policy only picks shapes; verification is unchanged, so any choice is lossless.
#ifndef SPECD_ENGINE_SPEC_POLICY_H_
#define SPECD_ENGINE_SPEC_POLICY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/types/span.h"

namespace specd {

// A draft tree shape as the drafters take it (DraftParams); depth 0 = no draft this step.
struct SpecShape {
  int depth = 0;
  int top_k = 1;
  int max_nodes = 0;

  bool none() const { return depth <= 0 || max_nodes <= 0; }
  int nodes() const { return none() ? 0 : max_nodes; }
  bool operator==(const SpecShape& o) const {
    return (none() && o.none()) ||
           (depth == o.depth && top_k == o.top_k && max_nodes == o.max_nodes);
  }
  bool operator!=(const SpecShape& o) const { return !(*this == o); }
};

std::string ShapeString(const SpecShape& shape);  // "none", "chain4", "tree16x5"

// Bucket label of a tree size for metrics: "0", "1", "2", "3-4", "5-8", "9-16", "17+".
const char* TreeSizeBucket(int nodes);

// The token count that prices a verify step. A backend that pads (the CUDA backend, whose
// graphs need fixed shapes) runs every row at the longest row's token bucket (1 + a power of
// two at least tokens - 1) and the rows at a power of two, so one 17-token tree among 5-token
// chains makes every row of the step 17 tokens long; priced by its total, the mix would look
// several times cheaper than it runs. `max_row_tokens`: the longest row (pending + tree).
// Steps past the backend's graph limits run unpadded, priced by their total.
int VerifyStepTokens(bool padded_rows, int rows, int total_tokens, int max_row_tokens);
// The CUDA backend's graph limits (CudaBackend::ChooseBuckets).
inline constexpr int kPaddedMaxRows = 64;
inline constexpr int kPaddedMaxTokens = 4096;
inline constexpr int kPaddedMaxRowTokens = 257;

struct PolicyOptions {
  // Shapes the policy chooses from; "none" is always a candidate.
  std::vector<SpecShape> candidates = {{1, 1, 1}, {2, 1, 2}, {3, 1, 3}, {4, 1, 4},
                                       {5, 1, 5}, {6, 1, 6}, {4, 2, 8}, {5, 4, 16}};
  // A new assignment must beat the previous one's predicted goodput by this fraction.
  double hysteresis = 0.05;
  // A step with any tree is priced this much dearer than predicted: speculation has costs the
  // model leaves out (the router's work on trees, the longest draft call of a batch, graph
  // buckets not yet warm), so near break-even the policy keeps to no drafts, which cannot lose.
  double speculation_margin = 0.03;
  // Conditional acceptance at each depth before a sequence has samples, until the batch's
  // sequences have some: from then on a new sequence starts from theirs (the pooled rate), which
  // says more about this draft on this traffic than any constant.
  double acceptance_prior = 0.6;
  // The same by depth (index d - 1), where it is set: the policy fills it with the rates pooled
  // at each depth, so that a new sequence starts from the pair's measured acceptance at every
  // depth, not from its depth-1 rate at all of them (a draft's deeper levels are often accepted
  // less). Empty: acceptance_prior at every depth; past its end, its last value.
  std::vector<double> acceptance_prior_by_depth;
  // How many samples the prior counts as in a sequence's estimate: three times this many while
  // the sequence has none of its own, falling linearly to this many once it has four times as
  // many (at that depth, each kind counted up to 20). A young sequence's few outcomes say
  // little: at a constant two, one early miss of a pair that accepts 0.97 a level took its
  // estimate to about 0.6, the policy stopped drafting it, and in a batch that started together
  // it was the last to finish (drafting it again waits for a probe).
  double acceptance_prior_samples = 2;
  // Weight of a new sample in the acceptance and cost averages.
  double acceptance_ema = 0.15;
  double cost_ema = 0.1;
  // Chance that a level's sibling of rank r >= 1 (the drafter's (r+1)-th choice below the
  // accepted parent) is accepted given that the r better ones were not, before a sequence has
  // samples and until the batch's sequences have some (then theirs, pooled, as for
  // acceptance_prior). A tree's level is accepted with 1 - (1 - p) * prod_r (1 - s_r), where p
  // is the first child's rate (a chain's): siblings rescue a level only where the first choice
  // missed, and the drafter's later choices are accepted far less than its first.
  double sibling_acceptance_prior = 0.3;
  // The same by rank (index r - 1), where set (the policy fills it with the pooled rates).
  // Past its end, its last value.
  std::vector<double> sibling_prior_by_rank;
  // How a tree shape's levels are laid out along the accepted path, by depth (index d - 1),
  // pooled by the policy over the batch for its tree candidates: the chance that the path's
  // node at the level above has children at all (`open`: a branch below a sibling is thin,
  // often a leaf) and how many it has where it has any (`width`). The layout is the drafter's
  // (engine/draft/tree_builder.h keeps the best nodes: its best path wide, the rest narrow), so
  // a tree's levels are not all nodes / depth wide. Without them, every level counts as open
  // and that wide.
  struct TreePrior {
    SpecShape shape;
    std::vector<double> open, width;  // negative: none at that depth
  };
  std::vector<TreePrior> tree_priors;
  // Cost priors, in seconds: verify = fixed + per_row * rows + per_token * tokens; one draft
  // level = fixed + per_token * tokens at that level. Rough CPU figures of the reference pair;
  // the measured buckets replace them within a few steps.
  double verify_fixed_s = 2.5e-3;
  double verify_per_row_s = 2e-4;
  double verify_per_token_s = 4e-4;
  double draft_fixed_s = 4e-4;
  double draft_level_fixed_s = 3e-4;
  double draft_level_per_token_s = 5e-5;
  // false: the priors are the costs (deterministic decisions, for tests).
  bool measure_costs = true;
  // Whether the verify backend pads rows (VerifyStepTokens); the router learns it from the
  // verify service.
  bool padded_rows = false;
  // Until a draft call has been measured, draft costs are the priors times this. The priors are
  // a CPU's, several times a GPU's; taken as they are, drafting would look too dear to try, and
  // a policy that never drafts never measures what drafting costs. Optimistic instead, the
  // policy drafts, and the calls it makes correct the estimate within a few steps.
  double unmeasured_draft_scale = 0.1;
  // A sequence the drafter has fallen behind on (never drafted, or not drafted for a while)
  // must first feed the drafter what it missed. That catch-up is paid once and then serves
  // every step the sequence drafts until it finishes, so a step is charged it spread over those
  // steps, but at least this fraction of it: a catch-up also stalls the one step that carries it.
  double catch_up_share = 1.0 / 64;
  // Up to this many tokens a step, a verify bucket beyond the one measured bucket of its batch
  // size is guessed to cost what that one does (a forward of a few dozen tokens reads the same
  // weights as one of a single token: on an accelerator it costs about the same). Past it, and
  // past twice the measured bucket's tokens, the guess grows by the prior's slope. Padded
  // backends only: on an unpadded one (a CPU) every token costs, and the guess grows by the
  // prior's slope from the measured bucket on.
  double flat_tokens = 64;
  // A step's catch-ups may cost at most this many times a decode step's verify (the first one
  // is always let through).
  double catch_up_budget = 1.0;
  // Cost of one catch-up token in the drafter before any was measured, in seconds.
  double draft_prefill_token_s = 2e-5;
  // A sequence left without drafts this many steps (or never drafted yet) gets one short chain
  // to refresh its acceptance estimate (0: never).
  int probe_interval = 64;
  // At most this many probes a step.
  int max_probes_per_step = 4;
  // A sequence that can ingest (PolicySequence::can_ingest) and would draft with more catch-up
  // tokens than this, where the stall of feeding them first in the draft call would cost the
  // batch's other rows more tokens than drafting this sequence now gains, is fed them beside the
  // verify step instead (while they fit in it) and drafts from the next step. A few tokens cost
  // the draft call little; a prompt costs the batch a stall (16 prompts: ~220 ms on the CPU).
  int ingest_catch_up_tokens = 8;
  // Depths at which a sequence's n-gram proposal (PolicySequence::ngram_depth) is offered, each
  // cut to the proposal's length: a proposal is a chain whose deeper tokens are accepted less,
  // and where every scored token costs verify time (a CPU) its tail may not pay for itself.
  std::vector<int> ngram_depths = {1, 2, 3, 4, 6, 8};
};

// One level of a verified tree along its accepted path: how many children the path's node had
// there (the drafter's candidates for that position, best first, as the tree builders order
// siblings), and which of them the verifier accepted (-1: none; the path ends there).
struct LevelOutcome {
  int siblings = 1;
  int accepted_rank = -1;

  bool operator==(const LevelOutcome& o) const {
    return siblings == o.siblings && accepted_rank == o.accepted_rank;
  }
};

// Per-sequence acceptance: the rate at which the first child (rank 0: the drafter's best guess,
// what a chain drafts) at depth d is accepted given that its parent was, and the rate at which a
// sibling of rank r is accepted given that its parent was and the r better ones were not (pooled
// over depths), each as an exponential moving average. A tree's outcome says which rank each
// accepted level took, so trees and chains feed the same first-child rates, and a tree's
// expectation is computed from measured sibling rates and from the widths its accepted paths
// had (per tree shape run), not from an assumed sibling law on a uniform width.
class AcceptanceEstimate {
 public:
  static constexpr int kMaxDepth = 16;
  static constexpr int kMaxRank = 8;  // sibling ranks tracked; deeper ones count as the last

  // One verify outcome of a step that ran `shape`: the levels its accepted path reached, the
  // first one at levels[0], ending with the level nothing was accepted at (unless the path
  // reached the tree's bottom).
  void Observe(const SpecShape& shape, absl::Span<const LevelOutcome> levels,
               const PolicyOptions& options);
  // The same knowing only how many drafts were accepted: each accepted level is taken as its
  // first child's, the missed one as a miss of every sibling of the shape's average width
  // (exact for a chain; a tree's outcome should come with its ranks, PathLevels).
  void Observe(const SpecShape& shape, int accepted, const PolicyOptions& options);
  // Expected accepted draft tokens of `shape`.
  double ExpectedAccepted(const SpecShape& shape, const PolicyOptions& options) const;
  // ExpectedAccepted of the chains of depth 1..out.size(), into out (the policy prices every
  // chain candidate of every sequence each step).
  void ExpectedAcceptedChains(const PolicyOptions& options, absl::Span<double> out) const;
  // Conditional acceptance of the first child at depth d (1-based), shrunk toward the prior at
  // that depth (PolicyOptions::acceptance_prior_samples).
  double ChainRate(int d, const PolicyOptions& options) const;
  // The same from this sequence's own samples alone, and the weight they carry (0: none).
  double OwnChainRate(int d, double* weight) const;
  // Conditional acceptance of the sibling of rank r (1-based), shrunk toward the prior of that
  // rank; and from own samples alone, with their weight.
  double SiblingRate(int r, const PolicyOptions& options) const;
  double OwnSiblingRate(int r, double* weight) const;
  // Verify outcomes observed (at depth 1).
  int samples() const { return chain_n_[0]; }
  // Whether a tree was observed (its layout is kept per shape).
  bool has_trees() const { return tree_count_ > 0; }
  // Adds this sequence's own layout samples of trees of `shape`, at each depth d (index d - 1
  // of arrays of kMaxDepth), weighted by their count (at most 20): the chance that the path's
  // node had children (`open`, its weight `open_weight`) and how many where it had any
  // (`width`, `width_weight`).
  void AddTreeLayout(const SpecShape& shape, double* open, double* open_weight, double* width,
                     double* width_weight) const;

  // GoodputPolicy::Decide's expectations of its candidates for this estimate, and what they
  // were computed with (the policy, its acceptance prior, the depth budget as far as it cuts a
  // candidate); Observe clears them. A sequence left without drafts keeps its estimate for many
  // steps, and recomputing them (a pow per tree level) was a third of a decision. Decide's
  // scratch space: one decision at a time may read a given estimate.
  struct CandidateCache {
    uint64_t policy = 0;  // 0: none
    uint64_t prior = 0;   // GoodputPolicy's version of its pooled priors
    int depth = 0;
    std::vector<double> gains;  // one per candidate, "none" first
  };
  CandidateCache& candidate_cache() const { return cache_; }

 private:
  // Chance that none of a level's siblings is accepted where its first child was not, for
  // `width` children on average (a fractional last sibling counts in proportion), from the
  // sibling rates of ranks 1.. in `rates`.
  static double SiblingMiss(double width, absl::Span<const double> rates);

  // Per tree shape run (the first kTreeShapes of them), by depth.
  static constexpr int kTreeShapes = 4;
  struct TreeRecord {
    SpecShape shape;
    double open[kMaxDepth] = {};
    int open_n[kMaxDepth] = {};
    double width[kMaxDepth] = {};
    int width_n[kMaxDepth] = {};
  };
  const TreeRecord* FindTree(const SpecShape& shape) const;
  TreeRecord* FindTree(const SpecShape& shape) {
    return const_cast<TreeRecord*>(static_cast<const AcceptanceEstimate*>(this)->FindTree(shape));
  }
  // A level's chance of being accepted in a tree of `shape` (`record`: its samples, may be
  // null), `sibling_rates` being SiblingRate of ranks 1...
  double TreeLevelRate(const SpecShape& shape, const TreeRecord* record, int d,
                       absl::Span<const double> sibling_rates, const PolicyOptions& options) const;

  TreeRecord trees_[kTreeShapes];
  int tree_count_ = 0;
  double chain_[kMaxDepth] = {};  // the first child's rate, by depth
  int chain_n_[kMaxDepth] = {};
  double sibling_[kMaxRank] = {};  // by rank - 1
  int sibling_n_[kMaxRank] = {};
  mutable CandidateCache cache_;
};

// Verify and draft step times: measured buckets on top of priors.
class CostModel {
 public:
  explicit CostModel(const PolicyOptions* options) : options_(options) {}

  double VerifySeconds(int rows, int tokens) const;
  // One draft call for `drafting` sequences, the deepest `levels` deep, `nodes` nodes in all,
  // which first feeds the drafter `catch_up` tokens beyond a step's worth.
  double DraftSeconds(int drafting, int levels, int nodes, double catch_up = 0) const;
  // Seconds per catch-up token in the drafter.
  double CatchUpTokenSeconds() const;

  void ObserveVerify(int rows, int tokens, double seconds);
  // `fed_tokens`: the history tokens the call fed before drafting (the accepted tokens of the
  // last step; a whole prompt for a sequence drafted for the first time or after target-only
  // steps). A call that fed more than a step's worth is a catch-up: what it took beyond the
  // levels' predicted cost is a sample of the catch-up token cost, not of a level's (counted as
  // a level, it would make drafting look expensive, so fewer sequences would be drafted, so
  // each one fed again would carry a longer backlog).
  void ObserveDraft(int drafting, int levels, int nodes, int fed_tokens, double seconds);
  // An ingest-only call (the router's feed beside verify: `tokens` history tokens of `sequences`
  // sequences, no draft levels) took `seconds`. It is a catch-up and nothing else, so it prices
  // the catch-up token, never a level: where every prompt goes there, no draft call carries a
  // catch-up to measure it by, and a whole prompt's feed counted as a step's levels would price
  // drafting many times too dear.
  void ObserveIngest(int sequences, int tokens, double seconds);

  // Overlap (pre-drafting while verify runs): a pre-draft call for work that DraftSeconds
  // prices as (drafting, levels, nodes) took `seconds`. A pre-draft costs more than that draft:
  // the guess takes a forward of its own, and where the draft shares a device (or cores) with
  // verify, the two slow each other. Its measured ratio to DraftSeconds scales PreDraftSeconds.
  void ObservePreDraft(int drafting, int levels, int nodes, double seconds);
  double PreDraftSeconds(int drafting, int levels, int nodes) const;

  // Current estimates for the gauges: verify time of one row scoring 1 and 5 tokens, and one
  // draft level of one sequence.
  double VerifyOneTokenSeconds() const { return VerifySeconds(1, 1); }
  double VerifyChain4Seconds() const { return VerifySeconds(1, 5); }
  double DraftLevelSeconds() const;
  // Whether a draft call has been measured (before, draft costs are the optimistic guess).
  bool draft_measured() const { return level_measured_; }

 private:
  static constexpr int kRowBuckets = 10;    // 1, 2, 3-4, ..., 257+
  static constexpr int kTokenBuckets = 14;  // 1, 2, 3-4, ..., 4097+
  static int Bucket(int n, int buckets);
  double VerifyPrior(int rows, int tokens) const;
  double LevelPrior(double tokens_per_level) const;
  // Measured / prior in a bucket, or the nearest measured bucket's, or 1.
  double VerifyRatio(int rb, int tb) const;
  double LevelRatio(int tb) const;
  void Update(double sample, bool first_of_all, double* ratio, int* n) const;

  const PolicyOptions* options_;
  // Cost at `tokens` from the measured buckets of one row: interpolated between the measured
  // token buckets on either side; beyond the largest, extended by the slope of the two largest,
  // or, when only one is measured, flat up to twice its tokens or `flat_tokens` and by the
  // prior's slope past that. `cost_at(t)` is bucket t's measured cost at `tokens`' scale;
  // `prior_at(t, x)` the prior at x tokens scaled by bucket t's measured ratio. Returns a negative
  // value when the row has no measured bucket.
  template <typename CostAt, typename PriorAt>
  static double AlongTokens(int tb, double tokens, const int* n, const double* mean_tokens,
                            int buckets, double flat_tokens, CostAt cost_at, PriorAt prior_at);
  void ObserveCatchUpToken(double sample);  // seconds per catch-up token, one call's

  double verify_ratio_[kRowBuckets][kTokenBuckets] = {};
  int verify_n_[kRowBuckets][kTokenBuckets] = {};
  // Mean tokens of the samples in each bucket: where along the token axis a bucket's measured
  // cost sits, for interpolating to buckets not yet run.
  double verify_tokens_[kRowBuckets][kTokenBuckets] = {};
  double level_tokens_[kTokenBuckets] = {};
  double catch_up_token_s_ = 0;  // measured seconds per catch-up token (0: none yet)
  int catch_up_n_ = 0;
  // Whether a bucket's first call was seen. That call is not a sample: on a GPU it captures the
  // bucket's CUDA graph and times its GEMM algorithms, many times a step's cost, and a bucket
  // judged that dear would never be chosen again to correct it. Padded backends only (an
  // unpadded one has nothing to warm up).
  bool verify_warm_[kRowBuckets][kTokenBuckets] = {};
  bool level_warm_[kTokenBuckets] = {};
  double level_ratio_[kTokenBuckets] = {};
  int level_n_[kTokenBuckets] = {};
  bool level_measured_ = false;   // any level_n_ above 0
  double pre_draft_ratio_ = 1.0;  // measured pre-draft time / DraftSeconds of its work
  int pre_draft_n_ = 0;
};

// Why a sequence's step has the shape it has (metrics label).
enum class ShapeReason {
  kPolicy,     // the goodput policy chose it (possibly none: "policy_off")
  kProbe,      // a probe to refresh the acceptance estimate
  kExplicit,   // the request named its tree shape
  kOff,        // the request asked for no speculation
  kDraftDown,  // the drafter is unavailable
  kDraftBusy,  // the drafter is still answering an earlier request (a late pre-draft)
  kNoDrafter,  // no drafter serves the sequence
  kNoBudget,   // no room left: the bonus token covers what remains
  kCatchUp,    // the drafter is fed what it missed beside this verify step; drafts from the next
  kNgram,      // the goodput policy chose the n-gram proposal over the model drafter (auto)
};
const char* ShapeReasonName(ShapeReason reason, bool none);

// The per-sequence inputs of one decision.
struct PolicySequence {
  int pending = 1;          // tokens the verify step scores besides the tree
  int max_depth = 0;        // deepest useful draft (0: the sequence cannot draft this step)
  bool model_draft = true;  // drafted by the draft model (costs draft time) vs n-gram (free)
  bool fixed = false;       // `fixed_shape` is imposed (explicit request, or off)
  int draft_backlog = 0;    // tokens the drafter must be fed before this sequence's next draft
  SpecShape fixed_shape;
  const AcceptanceEstimate* acceptance = nullptr;  // required unless fixed
  SpecShape previous;                              // what it ran last step
  int steps_without_draft = 0;
  // Never drafted: its acceptance is unknown, so it is probed (where a probe could pay) without
  // waiting probe_interval steps.
  bool never_drafted = false;
  // Its drafter holds none of its tokens yet (a new sequence, or one whose draft service lost
  // it): its catch-up is its whole prompt, fed beside verify where it fits (PlanCatchUp). Not
  // never_drafted: a feed that came late leaves a sequence undrafted but fed, and one fed again
  // for that would be late again, each time, and never draft.
  bool drafter_unfed = false;
  // The caller can feed this sequence's drafter its backlog beside the verify step, where nobody
  // waits for it (the router's ingest-only draft step). Fed before the step's first draft level,
  // a catch-up (a whole prompt on a sequence's first step) stalls every row of the step, drafted
  // or not; so a long one is fed there instead (PolicyDecision::ingest,
  // PolicyOptions::ingest_catch_up_tokens) and the sequence drafts from the next step.
  bool can_ingest = false;
  // The shape chosen on the step whose catch-up was moved beside verify (PolicyDecision::
  // deferred), none if there was none. On the first step with no catch-up left it is drafted as
  // it is where it is a probe or the verify backend is padded: there the prefill step that chose
  // it is what lets a cold policy draft at a large batch, and a sequence that never drafts never
  // measures its own acceptance. Elsewhere it is the previous decision the hysteresis keeps,
  // judged anew on that decode step (chosen beside a prefill, any tree looks cheap on a CPU).
  SpecShape deferred;
  // `auto`'s second drafter: n-gram lookup over the sequence's own history, which costs no draft
  // time (microseconds in the caller). ngram_depth: the length of this step's proposal, a
  // chain (0: no match, so not a candidate). The policy prices it with `ngram_acceptance`, which
  // only n-gram steps update (the model drafter's estimate only model steps), and verify time
  // alone, against none and the model drafter's shapes, and picks the best for the batch.
  int ngram_depth = 0;
  const AcceptanceEstimate* ngram_acceptance = nullptr;  // required where ngram_depth > 0
  // Whether the model drafter can serve this step (false: its service is down or busy, or there
  // is none; the n-gram proposal and none are then the only candidates).
  bool model_available = true;
  bool previous_ngram = false;  // `previous` was the n-gram proposal
  // Steps since the n-gram proposal was last verified (or never): a sequence whose n-gram
  // estimate fell low is probed again, as the model drafter is, so that it can recover.
  int steps_without_ngram = 1 << 20;
};

struct PolicyDecision {
  std::vector<SpecShape> shapes;  // one per sequence
  std::vector<ShapeReason> reasons;
  // One per sequence: feed the drafter its backlog beside this verify step (kCatchUp; none).
  std::vector<char> ingest;
  // One per sequence: where `ingest` is set, the shape chosen before its catch-up was moved
  // (PolicySequence::deferred); none elsewhere.
  std::vector<SpecShape> deferred;
  // One per sequence: `shapes[i]` is the n-gram proposal cut to its depth (PolicySequence::
  // ngram_depth), not the model drafter's (ShapeReason::kNgram, or kProbe).
  std::vector<char> ngram;
  double predicted_goodput = 0;  // tokens/s of the batch
};

class GoodputPolicy {
 public:
  explicit GoodputPolicy(PolicyOptions options = PolicyOptions());

  // Not const: it also pools the acceptance of the batch's sequences, the prior of new ones.
  PolicyDecision Decide(absl::Span<const PolicySequence> batch);

  // The accepted drafts the policy expects of `shape` for `seq` (with the pooled priors).
  double ExpectedAccepted(const PolicySequence& seq, const SpecShape& shape) const;

  // Predicted tokens/s of `batch` under `shapes` (the objective; also for tests); `ngram`
  // (empty, or one per sequence) marks the shapes that are n-gram proposals.
  double Goodput(absl::Span<const PolicySequence> batch, absl::Span<const SpecShape> shapes,
                 absl::Span<const char> ngram = {}) const;

  // Overlap fan-out: how many outcome guesses per sequence to pre-draft beside a verify step of
  // `verify_rows` rows scoring `verify_tokens` tokens, for `drafting` sequences whose next trees
  // are `levels` deep and `nodes` nodes in all. A pre-draft that ends inside the verify step
  // costs the step nothing and each further guess raises the chance of a hit, so: the most
  // guesses, up to `max_fan_out`, whose pre-draft (drafting x F trees) is predicted to end
  // inside the verify step, and only one for `drafting` above one (a batch's draft call is
  // saved only when all of it hits, which further guesses barely change, while their rows slow
  // the verify beside them). Where the draft has slack (one stream) that is several; 0 where
  // even one guess would outlast verify (the step is then the sequential one, never worse).
  int PreDraftFanOut(int drafting, int levels, int nodes, int verify_rows, int verify_tokens,
                     int max_fan_out) const;

  // Overlap fan-out and depth together. `shapes`: the planned shape of each sequence to
  // pre-draft (its tree below each guess); the verify step beside it has `verify_rows` rows
  // scoring `verify_tokens` tokens. A hit's tree is the next step's, so its depth is worth more
  // than a further guess: the deepest cap D (each shape cut to D as the depth budget cuts it)
  // whose one-guess pre-draft is predicted to end inside the verify step, then, only when
  // nothing was cut, as many guesses as fit (PreDraftFanOut). {0, 0} when not even depth 1
  // fits (the step stays sequential).
  struct PreDraftPlan {
    int fan_out = 0;  // guesses per sequence
    int depth = 0;    // the cap on every pre-drafted tree's depth
  };
  PreDraftPlan PlanPreDraft(absl::Span<const SpecShape> shapes, int verify_rows, int verify_tokens,
                            int max_fan_out) const;
  // `shape` cut to `max_depth` as a sequence's depth budget cuts it: chains shorten, trees keep
  // their width and lose their deepest levels.
  static SpecShape CutToDepth(const SpecShape& shape, int max_depth) {
    return Clamp(shape, max_depth);
  }
  // What a pre-draft of `shapes` (each its own sequence) at `fan_out` guesses asks of the
  // draft, in PreDraftSeconds' terms: sequence-trees, levels (the guess's own forward and the
  // deepest tree's), nodes (each tree's nodes plus its guessed path's).
  struct PreDraftWork {
    int drafting = 0;
    int levels = 0;
    int nodes = 0;
  };
  static PreDraftWork PreDraftWorkOf(absl::Span<const SpecShape> shapes, int fan_out);

  const PolicyOptions& options() const { return options_; }
  void set_padded_rows(bool padded) { options_.padded_rows = padded; }
  CostModel& costs() { return costs_; }
  const CostModel& costs() const { return costs_; }

 private:
  // The options the acceptance estimates are read with: the pooled prior in place of the
  // constant one once there is one.
  PolicyOptions AcceptanceOptions() const;
  // The same for the n-gram estimates (PolicySequence::ngram_acceptance): their own pooled prior.
  PolicyOptions NgramAcceptanceOptions() const;
  // `shape` cut to a sequence's depth budget (chains shorten; trees keep their width).
  static SpecShape Clamp(const SpecShape& shape, int max_depth);

  PolicyOptions options_;
  CostModel costs_;
  // Tells this policy's AcceptanceEstimate::CandidateCache entries from another's (its
  // candidates and options differ).
  uint64_t id_ = 0;
  // Conditional acceptance pooled over the sequences with samples, at depth 1 and by depth
  // (negative: none yet), and a version that changes with them (for the candidate caches).
  double pooled_rate_ = -1.0;
  double pooled_by_depth_[AcceptanceEstimate::kMaxDepth];
  // Sibling acceptance pooled the same way, by rank (negative: none yet).
  double pooled_by_rank_[AcceptanceEstimate::kMaxRank];
  // PolicyOptions::tree_priors of the tree candidates, pooled the same way.
  std::vector<PolicyOptions::TreePrior> pooled_trees_;
  uint64_t prior_version_ = 0;
  // The n-gram estimates' conditional acceptance pooled the same way, by depth (negative: none).
  double pooled_ngram_by_depth_[AcceptanceEstimate::kMaxDepth];
};

}  // namespace specd

#endif  // SPECD_ENGINE_SPEC_POLICY_H_
