// `auto`'s second drafter in the goodput policy: the n-gram proposal of each sequence (free to
// draft, priced with its own acceptance estimate and verify time) against the model drafter's
// shapes and none. It is taken where its acceptance and a match make it pay, left where it
// accepts poorly, held against noise by the hysteresis, probed again after a low estimate, the
// only candidate beside none where the model drafter is unavailable; and SequenceState keeps
// the two drafters' outcomes apart.
#include <cmath>
#include <string>
#include <vector>

#include "engine/spec/policy.h"
#include "engine/spec/sequence_state.h"
#include "gtest/gtest.h"
#include "tests/testutil/policy_fixtures.h"

namespace specd {
namespace {

using testutil::Acceptance;
using testutil::GpuLikeCosts;

std::vector<PolicySequence> Batch(size_t n, const AcceptanceEstimate* model,
                                  const AcceptanceEstimate* ngram, int ngram_depth) {
  std::vector<PolicySequence> batch(n);
  for (PolicySequence& s : batch) {
    s.pending = 1;
    s.max_depth = 64;
    s.acceptance = model;
    s.ngram_acceptance = ngram;
    s.ngram_depth = ngram_depth;
    s.steps_without_draft = 0;  // no probes: the tests look at the policy's own choice
    s.steps_without_ngram = 0;
  }
  return batch;
}

// Whether sequence i's decision uses the model drafter (a tree that is not the proposal).
bool ByModel(const PolicyDecision& d, size_t i) { return !d.shapes[i].none() && !d.ngram[i]; }

TEST(SpecPolicyNgramTest, TheProposalIsChosenWhereItsAcceptanceAndAMatchMakeItPay) {
  const PolicyOptions o = GpuLikeCosts();
  const AcceptanceEstimate model = Acceptance(0.5, o), ngram = Acceptance(0.95, o);
  for (size_t n : {1u, 8u}) {
    GoodputPolicy policy(o);
    const PolicyDecision d = policy.Decide(Batch(n, &model, &ngram, 8));
    for (size_t i = 0; i < n; ++i) {
      SCOPED_TRACE(n);
      EXPECT_TRUE(d.ngram[i]) << ShapeString(d.shapes[i]);
      EXPECT_EQ(d.reasons[i], ShapeReason::kNgram);
      // A long match accepted nearly always is taken deep, never past the proposal.
      EXPECT_GE(d.shapes[i].depth, 4);
      EXPECT_LE(d.shapes[i].depth, 8);
      EXPECT_EQ(d.shapes[i].max_nodes, d.shapes[i].depth);  // a chain
    }
    EXPECT_NEAR(d.predicted_goodput, policy.Goodput(Batch(n, &model, &ngram, 8), d.shapes, d.ngram),
                1e-9 * d.predicted_goodput);
  }
  // A short match caps it: the proposal's 2 tokens at most.
  GoodputPolicy policy(o);
  const PolicyDecision short_match = policy.Decide(Batch(1, &model, &ngram, 2));
  if (short_match.ngram[0]) EXPECT_LE(short_match.shapes[0].depth, 2);
  // No match: not a candidate.
  const PolicyDecision no_match = policy.Decide(Batch(1, &model, &ngram, 0));
  EXPECT_FALSE(no_match.ngram[0]);
  EXPECT_TRUE(ByModel(no_match, 0)) << ShapeString(no_match.shapes[0]);
}

TEST(SpecPolicyNgramTest, TheModelDrafterIsChosenWhereNgramAcceptsPoorly) {
  const PolicyOptions o = GpuLikeCosts();
  const AcceptanceEstimate model = Acceptance(0.9, o), ngram = Acceptance(0.1, o);
  for (size_t n : {1u, 8u}) {
    GoodputPolicy policy(o);
    const PolicyDecision d = policy.Decide(Batch(n, &model, &ngram, 8));
    for (size_t i = 0; i < n; ++i) {
      EXPECT_TRUE(ByModel(d, i)) << ShapeString(d.shapes[i]) << " at " << n;
      EXPECT_EQ(d.reasons[i], ShapeReason::kPolicy);
    }
  }
}

TEST(SpecPolicyNgramTest, WhereNeitherPaysNoneIsChosen) {
  // A tiny target on a CPU: every scored token costs as much as the step.
  PolicyOptions o;
  o.measure_costs = false;
  o.verify_fixed_s = 1e-3;
  o.verify_per_row_s = 0;
  o.verify_per_token_s = 1e-3;
  GoodputPolicy policy(o);
  const AcceptanceEstimate model = Acceptance(0.4, o), ngram = Acceptance(0.4, o);
  const PolicyDecision d = policy.Decide(Batch(4, &model, &ngram, 8));
  for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(d.shapes[i].none()) << ShapeString(d.shapes[i]);
}

TEST(SpecPolicyNgramTest, OnlyNoneAndTheProposalWhereTheModelDrafterIsUnavailable) {
  const PolicyOptions o = GpuLikeCosts();
  const AcceptanceEstimate model = Acceptance(0.95, o), ngram = Acceptance(0.7, o);
  GoodputPolicy policy(o);
  std::vector<PolicySequence> batch = Batch(3, &model, &ngram, 6);
  for (PolicySequence& s : batch) s.model_available = false;
  batch[2].ngram_depth = 0;                // no match: nothing to draft
  batch[2].steps_without_draft = 1 << 20;  // and no model probe either
  const PolicyDecision d = policy.Decide(batch);
  EXPECT_TRUE(d.ngram[0]) << ShapeString(d.shapes[0]);
  EXPECT_TRUE(d.ngram[1]) << ShapeString(d.shapes[1]);
  EXPECT_TRUE(d.shapes[2].none()) << ShapeString(d.shapes[2]);
}

// Near the point where the two drafters pay alike, noise in the n-gram estimate must not flip
// the choice every step: each drafter, once chosen, is held while the other is not better by
// the hysteresis margin.
TEST(SpecPolicyNgramTest, NoiseDoesNotFlipFlopBetweenTheDrafters) {
  const PolicyOptions o = GpuLikeCosts();
  const AcceptanceEstimate model = Acceptance(0.8, o);
  // The crossover: the lowest n-gram rate that a fresh decision (no previous) gives n-gram.
  double crossover = -1;
  for (double p = 0.5; p < 0.99 && crossover < 0; p += 0.01) {
    GoodputPolicy policy(o);
    const AcceptanceEstimate ngram = Acceptance(p, o);
    if (policy.Decide(Batch(1, &model, &ngram, 8)).ngram[0]) crossover = p;
  }
  ASSERT_GT(crossover, 0) << "n-gram never pays";
  const AcceptanceEstimate below = Acceptance(crossover - 0.01, o);
  const AcceptanceEstimate above = Acceptance(crossover + 0.01, o);
  GoodputPolicy policy(o);
  PolicySequence seq = Batch(1, &model, &below, 8)[0];
  int switches = 0;
  bool was_ngram = false;
  for (int step = 0; step < 40; ++step) {
    // The estimate jitters across the crossover, and the match's length with it.
    seq.ngram_acceptance = step % 2 ? &above : &below;
    seq.ngram_depth = step % 3 ? 8 : 6;
    const PolicyDecision d = policy.Decide({seq});
    ASSERT_FALSE(d.shapes[0].none());
    if (step > 0 && (d.ngram[0] != 0) != was_ngram) ++switches;
    was_ngram = d.ngram[0] != 0;
    seq.previous = d.shapes[0];
    seq.previous_ngram = was_ngram;
  }
  EXPECT_LE(switches, 1);
  // Held from either side: the same jittering inputs keep the model drafter where it ran, and
  // n-gram where it ran.
  for (const bool from_ngram : {false, true}) {
    PolicySequence held = Batch(1, &model, &above, 8)[0];
    GoodputPolicy fresh(o);
    held.ngram_acceptance = from_ngram ? &below : &above;
    const PolicyDecision start = fresh.Decide({held});
    held.previous = from_ngram ? SpecShape{8, 1, 8} : start.shapes[0];
    held.previous_ngram = from_ngram;
    if (!from_ngram && start.ngram[0]) {
      // The fresh decision at `above` took n-gram: start the model side from its best shape.
      PolicySequence no_match = held;
      no_match.ngram_depth = 0;
      held.previous = fresh.Decide({no_match}).shapes[0];
    }
    for (int step = 0; step < 10; ++step) {
      held.ngram_acceptance = step % 2 ? &above : &below;
      const PolicyDecision d = fresh.Decide({held});
      EXPECT_EQ(d.ngram[0] != 0, from_ngram) << "step " << step << ": " << ShapeString(d.shapes[0]);
      held.previous = d.shapes[0];
    }
  }
}

TEST(SpecPolicyNgramTest, ALowNgramEstimateIsProbedAgain) {
  PolicyOptions o = GpuLikeCosts();
  o.verify_per_token_s = 1e-3;  // each scored token a tenth of the step
  // Neither drafter pays on its estimate; a good n-gram would.
  const AcceptanceEstimate model = Acceptance(0.05, o), ngram = Acceptance(0.05, o);
  GoodputPolicy policy(o);
  std::vector<PolicySequence> batch = Batch(1, &model, &ngram, 8);
  batch[0].steps_without_ngram = 0;
  const PolicyDecision recent = policy.Decide(batch);
  EXPECT_TRUE(recent.shapes[0].none()) << ShapeString(recent.shapes[0]);
  batch[0].steps_without_ngram = o.probe_interval;
  const PolicyDecision probe = policy.Decide(batch);
  EXPECT_TRUE(probe.ngram[0]);
  EXPECT_EQ(probe.reasons[0], ShapeReason::kProbe);
  EXPECT_EQ(probe.shapes[0], (SpecShape{2, 1, 2}));
}

TEST(SpecPolicyNgramTest, SequenceStateKeepsTheDraftersOutcomesApart) {
  StopConditions stop;
  stop.max_new_tokens = 64;
  absl::StatusOr<SequenceState> st = SequenceState::Create({1, 2, 3}, stop, 100);
  ASSERT_TRUE(st.ok());
  SequenceState& s = *st;
  // The prompt, target-only.
  s.Plan(SpecShape(), ShapeReason::kPolicy);
  s.Apply(VerifyOutcome{{4}, 0, {}}, TokenTree());
  // An n-gram step accepting 2 of 3.
  TokenTree chain;
  chain.tokens = {5, 6, 7};
  chain.parents = {-1, 0, 1};
  s.Plan(SpecShape{3, 1, 3}, ShapeReason::kNgram, /*ngram=*/true);
  EXPECT_TRUE(s.planned_ngram());
  s.Apply(VerifyOutcome{{5, 6, 9}, 2, {0, 1}}, chain);
  EXPECT_EQ(s.ngram_acceptance().samples(), 1);
  EXPECT_EQ(s.acceptance().samples(), 0);
  EXPECT_EQ(s.stats().ngram_steps, 1);
  EXPECT_EQ(s.stats().draft_steps, 1);
  PolicySequence p = s.PolicyInput(/*model_draft=*/true);
  EXPECT_TRUE(p.never_drafted);  // the model drafter has not drafted it
  EXPECT_TRUE(p.previous_ngram);
  EXPECT_EQ(p.steps_without_ngram, 0);
  EXPECT_GT(p.steps_without_draft, 0);
  EXPECT_EQ(p.ngram_acceptance, &s.ngram_acceptance());
  // Its tokens are still the drafter's to be fed: 4, 5, 6, 9 after the prompt.
  EXPECT_EQ(s.DrafterPending().size(), 7u);
  // A model step goes to the model drafter's estimate.
  s.Plan(SpecShape{3, 1, 3}, ShapeReason::kPolicy);
  chain.tokens = {10, 11, 12};
  s.Apply(VerifyOutcome{{10, 13}, 1, {0}}, chain);
  EXPECT_EQ(s.acceptance().samples(), 1);
  EXPECT_EQ(s.ngram_acceptance().samples(), 1);
  p = s.PolicyInput(/*model_draft=*/true);
  EXPECT_FALSE(p.never_drafted);
  EXPECT_FALSE(p.previous_ngram);
  EXPECT_EQ(p.steps_without_draft, 0);
  EXPECT_EQ(p.steps_without_ngram, 1);
  EXPECT_EQ(s.stats().ngram_steps, 1);
  EXPECT_EQ(s.stats().draft_steps, 2);
}

}  // namespace
}  // namespace specd
