// OverlapPlanner: --overlap=auto pre-drafts where the draft seconds its hits save beat what
// pre-drafting costs the step (verify slowed beside it, the wait past verify), and keeps the
// sequential step elsewhere, probing now and then.
#include "engine/spec/overlap_planner.h"

#include <vector>

#include "engine/spec/policy.h"
#include "gtest/gtest.h"

namespace specd {
namespace {

constexpr SpecShape kChain4{4, 1, 4};

// Deterministic costs: the priors (verify of one row and 5 tokens 4.7 ms; a depth-4 chain's
// draft 1.8 ms, its pre-draft 2.35 ms, which fits).
PolicyOptions Options() {
  PolicyOptions o;
  o.measure_costs = false;
  return o;
}

// A sequence whose depth-4 chains accepted `accepted` tokens every step, or every other step
// and `other` in between.
AcceptanceEstimate Accepting(int accepted, const PolicyOptions& o, int other = -1) {
  AcceptanceEstimate a;
  for (int i = 0; i < 50; ++i) a.Observe(kChain4, i % 2 == 0 || other < 0 ? accepted : other, o);
  return a;
}

OverlapPlanner::Plan JudgeOne(const OverlapPlanner& planner, const AcceptanceEstimate& a) {
  const std::vector<SpecShape> shapes = {kChain4};
  const std::vector<const AcceptanceEstimate*> acceptance = {&a};
  return planner.Judge(shapes, acceptance, 1, 5, 1);
}

TEST(OverlapPlannerTest, PreDraftsWhereHitsAreLikelyAndNotWhereTheyAreRare) {
  const PolicyOptions o = Options();
  GoodputPolicy policy(o);
  OverlapPlanner planner(&policy);
  const AcceptanceEstimate good = Accepting(4, o), bad = Accepting(0, o);
  // Four levels accepted every time; the bonus token's level at the prior.
  EXPECT_GT(OverlapPlanner::GuessRate(good, kChain4, o), 0.4);
  EXPECT_LT(OverlapPlanner::GuessRate(bad, kChain4, o), 0.05);
  const OverlapPlanner::Plan yes = JudgeOne(planner, good);
  EXPECT_EQ(yes.why, OverlapPlanner::Why::kPays);
  EXPECT_EQ(yes.pre.fan_out, 1);
  EXPECT_GT(yes.saving_s, 0.4 * policy.costs().DraftSeconds(1, 4, 4));
  const OverlapPlanner::Plan no = JudgeOne(planner, bad);
  EXPECT_EQ(no.why, OverlapPlanner::Why::kNoGain);
  EXPECT_EQ(no.pre.fan_out, 0);
  EXPECT_EQ(no.fit.fan_out, 1);  // it would have fitted
}

TEST(OverlapPlannerTest, ABatchSavesTheDraftCallOnlyWhenEverySequenceHits) {
  const PolicyOptions o = Options();
  GoodputPolicy policy(o);
  OverlapPlanner planner(&policy);
  const AcceptanceEstimate a = Accepting(4, o, 2);
  const std::vector<SpecShape> one = {kChain4};
  const std::vector<SpecShape> eight(8, kChain4);
  const std::vector<const AcceptanceEstimate*> e1 = {&a};
  const std::vector<const AcceptanceEstimate*> e8(8, &a);
  const double h = OverlapPlanner::GuessRate(a, kChain4, o);
  ASSERT_GT(h, 0.2);
  ASSERT_LT(h, 0.8);
  const double single = planner.Judge(one, e1, 1, 5, 1).saving_s;
  const double batch = planner.Judge(eight, e8, 8, 40, 1).saving_s;
  // One sequence saves its call h of the time; eight save the whole call only when all hit,
  // and otherwise the part of the call the hits leave out: less than h of it.
  EXPECT_NEAR(single, h * policy.costs().DraftSeconds(1, 4, 4), 1e-9);
  EXPECT_LT(batch, h * policy.costs().DraftSeconds(8, 4, 32));
}

TEST(OverlapPlannerTest, AVerifySlowedBesideThePreDraftKeepsTheSequentialStep) {
  const PolicyOptions o = Options();
  GoodputPolicy policy(o);
  OverlapPlanner planner(&policy);
  const AcceptanceEstimate good = Accepting(4, o);
  ASSERT_EQ(JudgeOne(planner, good).why, OverlapPlanner::Why::kPays);
  // Overlapped before any sequential sample of the bucket: nothing to learn from it yet.
  EXPECT_EQ(planner.ObserveVerify(1, 5, 8e-3, /*overlapped=*/true), 0.0);
  EXPECT_EQ(planner.ObserveVerify(1, 5, 4.7e-3, /*overlapped=*/false), 4.7e-3);
  for (int i = 0; i < 30; ++i) planner.ObserveVerify(1, 5, 8e-3, /*overlapped=*/true);
  EXPECT_NEAR(planner.verify_slowdown(1, 5), 8.0 / 4.7, 0.05);
  // The cost model learns verify alone from an overlapped step.
  EXPECT_NEAR(planner.ObserveVerify(1, 5, 8e-3, /*overlapped=*/true), 4.7e-3, 2e-4);
  const OverlapPlanner::Plan plan = JudgeOne(planner, good);
  EXPECT_EQ(plan.why, OverlapPlanner::Why::kNoGain);
  EXPECT_GT(plan.cost_s, 3e-3);
}

TEST(OverlapPlannerTest, WaitingPastVerifyKeepsTheSequentialStep) {
  const PolicyOptions o = Options();
  GoodputPolicy policy(o);
  OverlapPlanner planner(&policy);
  const AcceptanceEstimate good = Accepting(4, o);
  for (int i = 0; i < 30; ++i) planner.ObserveWait(4e-3);
  EXPECT_EQ(JudgeOne(planner, good).why, OverlapPlanner::Why::kNoGain);
  for (int i = 0; i < 60; ++i) planner.ObserveWait(0);
  EXPECT_EQ(JudgeOne(planner, good).why, OverlapPlanner::Why::kPays);
}

TEST(OverlapPlannerTest, MeasuredHitsCalibrateTheGuessRate) {
  const PolicyOptions o = Options();
  GoodputPolicy policy(o);
  OverlapPlanner planner(&policy);
  EXPECT_EQ(planner.hit_calibration(), 1.0);
  for (int i = 0; i < 40; ++i) planner.ObserveOutcome(i % 2 == 0, 0.1);
  EXPECT_GT(planner.hit_calibration(), 2.5);  // half hit where a tenth was expected
  const AcceptanceEstimate bad = Accepting(1, o);
  const OverlapPlanner::Plan plan = JudgeOne(planner, bad);
  EXPECT_GT(plan.saving_s, 2.5 * OverlapPlanner::GuessRate(bad, kChain4, o) *
                               policy.costs().DraftSeconds(1, 4, 4) * 0.99);
}

TEST(OverlapPlannerTest, ProbesWhileOffAndRefreshesWhileOn) {
  PolicyOptions o = Options();
  o.probe_interval = 8;
  GoodputPolicy policy(o);
  OverlapPlanner planner(&policy);
  const std::vector<SpecShape> shapes = {kChain4};
  const AcceptanceEstimate good = Accepting(4, o), bad = Accepting(0, o);
  const std::vector<const AcceptanceEstimate*> on = {&good}, off = {&bad};
  int sent = 0, refreshed = 0;
  for (int i = 0; i < 32; ++i) {
    const OverlapPlanner::Plan p = planner.Decide(shapes, off, 1, 5, 1);
    if (p.pre.fan_out > 0) {
      ++sent;
      EXPECT_EQ(p.why, OverlapPlanner::Why::kProbe);
    }
  }
  EXPECT_EQ(sent, 4);
  sent = 0;
  for (int i = 0; i < 32; ++i) {
    const OverlapPlanner::Plan p = planner.Decide(shapes, on, 1, 5, 1);
    sent += p.pre.fan_out > 0 ? 1 : 0;
    refreshed += p.why == OverlapPlanner::Why::kRefresh ? 1 : 0;
  }
  EXPECT_EQ(refreshed, 4);
  EXPECT_EQ(sent, 28);
}

}  // namespace
}  // namespace specd
