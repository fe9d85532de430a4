// The goodput policy on synthetic costs and acceptance: none where verify cost grows steeply
// with tokens, short chains at large batch, a big tree at batch 1 with high acceptance, a
// sequence whose drafts keep failing stops costing the others, explicit shapes are kept, and
// hysteresis holds a decision against small changes but not against large ones.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "engine/spec/policy.h"
#include "gtest/gtest.h"
#include "tests/testutil/policy_fixtures.h"

namespace specd {
namespace {

using testutil::Acceptance;
using testutil::CpuLikeCosts;
using testutil::GpuLikeCosts;

std::vector<PolicySequence> Batch(size_t n, const AcceptanceEstimate* acceptance) {
  std::vector<PolicySequence> batch(n);
  for (PolicySequence& s : batch) {
    s.pending = 1;
    s.max_depth = 64;
    s.acceptance = acceptance;
  }
  return batch;
}

TEST(SpecPolicyTest, ExpectedAcceptedFollowsTheRates) {
  PolicyOptions o;
  const AcceptanceEstimate a = Acceptance(0.8, o);
  EXPECT_NEAR(a.ChainRate(1, o), 0.8, 0.05);
  EXPECT_NEAR(a.ChainRate(4, o), 0.8, 0.08);
  // A chain of 4 at 0.8: 0.8 + 0.64 + 0.512 + 0.41.
  EXPECT_NEAR(a.ExpectedAccepted(SpecShape{4, 1, 4}, o), 2.36, 0.25);
  // A tree of the same depth accepts more than the chain, a deeper chain more than a shorter.
  EXPECT_GT(a.ExpectedAccepted(SpecShape{4, 2, 8}, o), a.ExpectedAccepted(SpecShape{4, 1, 4}, o));
  EXPECT_GT(a.ExpectedAccepted(SpecShape{6, 1, 6}, o), a.ExpectedAccepted(SpecShape{4, 1, 4}, o));
  EXPECT_EQ(a.ExpectedAccepted(SpecShape(), o), 0.0);
}

TEST(SpecPolicyTest, ChainExpectationsInOnePassEqualEachChainsOwn) {
  // Decide prices chains from ExpectedAcceptedChains; its decisions stay those of
  // ExpectedAccepted only if every value is bit for bit the same.
  PolicyOptions o;
  for (double rate : {0.05, 0.5, 0.93}) {
    const AcceptanceEstimate a = Acceptance(rate, o);
    std::vector<double> chains(AcceptanceEstimate::kMaxDepth);
    a.ExpectedAcceptedChains(o, absl::MakeSpan(chains));
    for (int d = 1; d <= AcceptanceEstimate::kMaxDepth; ++d) {
      EXPECT_EQ(chains[d - 1], a.ExpectedAccepted(SpecShape{d, 1, d}, o)) << rate << " " << d;
    }
  }
  // Never sampled: the prior.
  const AcceptanceEstimate fresh;
  std::vector<double> chains(3);
  fresh.ExpectedAcceptedChains(o, absl::MakeSpan(chains));
  EXPECT_EQ(chains[2], fresh.ExpectedAccepted(SpecShape{3, 1, 3}, o));
}

TEST(SpecPolicyTest, PicksNoneWhenVerifyCostGrowsSteeplyWithTokens) {
  PolicyOptions o;
  GoodputPolicy policy(o);
  // Measured: every extra scored token costs as much as the whole one-token step (a tiny
  // target, compute-bound from the first token).
  for (int step = 0; step < 20; ++step) {
    for (int rows : {1, 2, 4, 8}) {
      for (int tokens = rows; tokens <= rows * 17; ++tokens) {
        policy.costs().ObserveVerify(rows, tokens, 1e-3 * tokens);
      }
    }
  }
  const AcceptanceEstimate a = Acceptance(0.7, o);
  for (size_t n : {1u, 4u}) {
    const PolicyDecision d = policy.Decide(Batch(n, &a));
    for (const SpecShape& s : d.shapes) EXPECT_TRUE(s.none()) << ShapeString(s) << " at " << n;
  }
}

TEST(SpecPolicyTest, BigTreeAtBatchOneWithHighAcceptance) {
  const PolicyOptions o = GpuLikeCosts();
  GoodputPolicy policy(o);
  const AcceptanceEstimate a = Acceptance(0.9, o);
  const PolicyDecision d = policy.Decide(Batch(1, &a));
  ASSERT_EQ(d.shapes.size(), 1u);
  EXPECT_GE(d.shapes[0].nodes(), 6) << ShapeString(d.shapes[0]);
  EXPECT_EQ(d.reasons[0], ShapeReason::kPolicy);
}

TEST(SpecPolicyTest, TreesShrinkTowardChainsAsTheBatchGrows) {
  PolicyOptions o = GpuLikeCosts();
  // Verify turns compute-bound: each token costs a fifth of the fixed cost.
  o.verify_per_token_s = 0.4e-3;
  o.verify_fixed_s = 2e-3;
  GoodputPolicy policy(o);
  const AcceptanceEstimate a = Acceptance(0.75, o);
  auto mean_nodes = [&](size_t n) {
    const PolicyDecision d = policy.Decide(Batch(n, &a));
    double total = 0;
    for (const SpecShape& s : d.shapes) total += s.nodes();
    return total / n;
  };
  const double at1 = mean_nodes(1), at8 = mean_nodes(8), at64 = mean_nodes(64);
  EXPECT_GE(at1, at8);
  EXPECT_GE(at8, at64);
  EXPECT_GT(at1, at64);
  // At 64 rows the step is chains (or nothing), never trees.
  const PolicyDecision d = policy.Decide(Batch(64, &a));
  for (const SpecShape& s : d.shapes) {
    EXPECT_LE(s.nodes(), s.depth) << ShapeString(s);
    EXPECT_LE(s.depth, 4) << ShapeString(s);
  }
}

TEST(SpecPolicyTest, ASequenceWhoseDraftsFailStopsCostingTheOthers) {
  PolicyOptions o = GpuLikeCosts();
  o.verify_fixed_s = 2e-3;
  o.verify_per_token_s = 0.4e-3;
  GoodputPolicy policy(o);
  const AcceptanceEstimate good = Acceptance(0.85, o), bad = Acceptance(0.02, o);
  std::vector<PolicySequence> batch = Batch(4, &good);
  batch[2].acceptance = &bad;
  const PolicyDecision d = policy.Decide(batch);
  EXPECT_TRUE(d.shapes[2].none()) << ShapeString(d.shapes[2]);
  EXPECT_EQ(ShapeReasonName(d.reasons[2], d.shapes[2].none()), std::string("policy_off"));
  for (size_t i : {0u, 1u, 3u}) EXPECT_FALSE(d.shapes[i].none()) << i;
}

TEST(SpecPolicyTest, ExplicitShapesOffAndBudgetAreKept) {
  const PolicyOptions o = GpuLikeCosts();
  GoodputPolicy policy(o);
  const AcceptanceEstimate a = Acceptance(0.9, o);
  std::vector<PolicySequence> batch = Batch(3, &a);
  batch[0].fixed = true;
  batch[0].fixed_shape = SpecShape{3, 2, 5};
  batch[1].fixed = true;  // speculation off
  batch[2].max_depth = 2;
  const PolicyDecision d = policy.Decide(batch);
  EXPECT_EQ(d.shapes[0], (SpecShape{3, 2, 5}));
  EXPECT_EQ(d.reasons[0], ShapeReason::kExplicit);
  EXPECT_TRUE(d.shapes[1].none());
  EXPECT_EQ(d.reasons[1], ShapeReason::kOff);
  EXPECT_LE(d.shapes[2].depth, 2);
  batch[2].max_depth = 0;
  EXPECT_EQ(policy.Decide(batch).reasons[2], ShapeReason::kNoBudget);
}

TEST(SpecPolicyTest, HysteresisHoldsAgainstSmallChangesNotLargeOnes) {
  PolicyOptions o = GpuLikeCosts();
  o.verify_per_token_s = 0.4e-3;
  o.verify_fixed_s = 2e-3;
  o.measure_costs = true;
  o.unmeasured_draft_scale = 1.0;  // drafting at the priors' cost from the start
  o.hysteresis = 0.1;
  GoodputPolicy policy(o);
  const CostModel priors(&o);
  // Steps at the priors' cost, so every bucket the batch can reach has samples.
  for (int i = 0; i < 20; ++i) {
    for (int tokens = 4; tokens <= 80; ++tokens) {
      policy.costs().ObserveVerify(4, tokens, priors.VerifySeconds(4, tokens));
    }
  }
  const AcceptanceEstimate a = Acceptance(0.85, o);
  std::vector<PolicySequence> batch = Batch(4, &a);
  const PolicyDecision first = policy.Decide(batch);
  ASSERT_FALSE(first.shapes[0].none());
  for (size_t i = 0; i < batch.size(); ++i) batch[i].previous = first.shapes[i];
  // Each previous shape held, the same inputs decide the same.
  const PolicyDecision same = policy.Decide(batch);
  for (size_t i = 0; i < batch.size(); ++i) EXPECT_EQ(same.shapes[i], first.shapes[i]) << i;
  // From any uniform previous assignment, the policy moves only for a gain above the margin
  // of one sequence, and some worse-than-best previous assignment is held.
  int held_below_best = 0;
  for (const SpecShape& c : o.candidates) {
    std::vector<PolicySequence> from = batch;
    for (PolicySequence& s : from) s.previous = c;
    const std::vector<SpecShape> prev(from.size(), c);
    const PolicyDecision d = policy.Decide(from);
    const double g_prev = policy.Goodput(from, prev);
    if (d.shapes != prev) {
      EXPECT_GT(policy.Goodput(from, d.shapes), g_prev * (1.0 + o.hysteresis / from.size()))
          << ShapeString(c);
    } else if (g_prev < first.predicted_goodput) {
      ++held_below_best;
    }
  }
  EXPECT_GT(held_below_best, 0);
  // One slow verify step (five times the usual) moves the estimate only a little: the
  // decision holds.
  int tokens = 4;
  for (const SpecShape& s : first.shapes) tokens += s.nodes();
  policy.costs().ObserveVerify(4, tokens, 5 * priors.VerifySeconds(4, tokens));
  const PolicyDecision after_slow = policy.Decide(batch);
  for (size_t i = 0; i < batch.size(); ++i) EXPECT_EQ(after_slow.shapes[i], first.shapes[i]);
  // Verify cost that really turned steep flips it to none within a few steps.
  for (int i = 0; i < 30; ++i) {
    for (int t = 4; t <= 80; ++t) policy.costs().ObserveVerify(4, t, 1e-3 * t * t);
  }
  const PolicyDecision steep = policy.Decide(batch);
  for (const SpecShape& s : steep.shapes) EXPECT_TRUE(s.none()) << ShapeString(s);
}

TEST(SpecPolicyTest, MeasuredCostsReplaceThePriors) {
  PolicyOptions o;
  // Before any draft call is measured, drafting is predicted cheap, so that it gets tried.
  EXPECT_NEAR(CostModel(&o).DraftSeconds(4, 3, 12),
              o.unmeasured_draft_scale *
                  (o.draft_fixed_s + 3 * (o.draft_level_fixed_s + 4 * o.draft_level_per_token_s)),
              1e-12);
  o.unmeasured_draft_scale = 1.0;
  o.padded_rows = true;  // a CUDA backend's graphs
  CostModel costs(&o);
  const double prior = costs.VerifySeconds(8, 40);
  // A bucket's first call (a CUDA graph capture, GEMM timing) is not a sample.
  costs.ObserveVerify(8, 40, 100 * prior);
  EXPECT_DOUBLE_EQ(costs.VerifySeconds(8, 40), prior);
  for (int i = 0; i < 30; ++i) costs.ObserveVerify(8, 40, 3 * prior);
  EXPECT_NEAR(costs.VerifySeconds(8, 40), 3 * prior, 0.05 * prior);
  // A bucket never run, with one measured bucket below it at the same batch size, is predicted
  // at that bucket's cost (flat, the optimistic guess a step then corrects); one of another
  // batch size follows the nearest measured bucket's ratio to the prior.
  EXPECT_NEAR(costs.VerifySeconds(8, 70), 3 * prior, 0.05 * prior);
  EXPECT_GT(costs.VerifySeconds(64, 70), 2 * CostModel(&o).VerifySeconds(64, 70));
  const double level = costs.DraftSeconds(4, 3, 12);
  for (int i = 0; i < 30; ++i) costs.ObserveDraft(4, 3, 12, /*fed_tokens=*/8, 2 * level);
  EXPECT_NEAR(costs.DraftSeconds(4, 3, 12), 2 * level, 0.25 * level);
  // Calls that prefilled prompts say nothing about a level's cost.
  for (int i = 0; i < 30; ++i) costs.ObserveDraft(4, 3, 12, /*fed_tokens=*/4 * 300, 50 * level);
  EXPECT_NEAR(costs.DraftSeconds(4, 3, 12), 2 * level, 0.25 * level);
}

// An ingest-only call (a prompt fed beside verify) prices the catch-up token and leaves the
// draft levels' price as the draft calls measured it; a handful of tokens a sequence prices
// nothing.
TEST(SpecPolicyTest, IngestCallsPriceTheCatchUpNotTheLevels) {
  PolicyOptions o;
  o.unmeasured_draft_scale = 1.0;
  CostModel costs(&o);
  const double level = costs.DraftSeconds(1, 4, 4);
  for (int i = 0; i < 10; ++i) costs.ObserveDraft(1, 4, 4, /*fed_tokens=*/2, level);
  const double drafts = costs.DraftSeconds(1, 4, 4);
  const double level_s = costs.DraftLevelSeconds();
  const double prior_token = costs.CatchUpTokenSeconds();
  costs.ObserveIngest(2, /*tokens=*/20, 1.0);  // 10 a sequence: too few to price a token
  EXPECT_DOUBLE_EQ(costs.CatchUpTokenSeconds(), prior_token);
  // Two prompts of 100 tokens at 150 us a token, in one call of the call's own fixed cost more.
  for (int i = 0; i < 10; ++i) costs.ObserveIngest(2, 200, o.draft_fixed_s + 200 * 150e-6);
  EXPECT_NEAR(costs.CatchUpTokenSeconds(), 150e-6, 1e-9);
  EXPECT_DOUBLE_EQ(costs.DraftSeconds(1, 4, 4), drafts);
  EXPECT_DOUBLE_EQ(costs.DraftLevelSeconds(), level_s);
}

// An unpadded backend (a CPU) has no graphs to capture, and every token a forward scores costs
// about as much as the first: a bucket's first call is a sample, and a bucket never run is not
// guessed as cheap as the measured one below it.
TEST(SpecPolicyTest, UnpaddedVerifyCostsGrowFromTheFirstMeasuredBucket) {
  PolicyOptions o;
  ASSERT_FALSE(o.padded_rows);
  CostModel costs(&o);
  const double prior = costs.VerifySeconds(8, 40);
  costs.ObserveVerify(8, 40, 3 * prior);
  EXPECT_NEAR(costs.VerifySeconds(8, 40), 3 * prior, 1e-12);
  // Beyond it, by the prior's slope scaled by the measured ratio: dearer, not flat.
  const double slope = 3 * (CostModel(&o).VerifySeconds(8, 70) - prior) / 30;
  EXPECT_NEAR(costs.VerifySeconds(8, 70), 3 * prior + 30 * slope, 0.01 * prior);
  // A padded backend's guess stays flat there.
  o.padded_rows = true;
  EXPECT_NEAR(costs.VerifySeconds(8, 70), 3 * prior, 1e-12);
}

TEST(SpecPolicyTest, UnmeasuredBucketsFollowTheMeasuredCurveNotThePriorsShape) {
  PolicyOptions o;  // CPU-shaped priors: every verify token costs
  CostModel costs(&o);
  auto observe = [&](int rows, int tokens, double seconds) {
    for (int i = 0; i < 10; ++i) costs.ObserveVerify(rows, tokens, seconds);
  };
  // A GPU: 16 rows cost 0.7 ms at 16 tokens and 0.75 ms at 18.
  observe(16, 16, 0.70e-3);
  observe(16, 18, 0.75e-3);
  // Beyond the largest measured bucket, extended by the measured slope (0.025 ms a token),
  // not by the prior's 0.4 ms a token.
  EXPECT_NEAR(costs.VerifySeconds(16, 80), 0.75e-3 + 62 * 0.025e-3, 0.1e-3);
  // Between measured buckets, interpolated.
  observe(16, 100, 1.0e-3);
  const double mid = costs.VerifySeconds(16, 50);
  EXPECT_GT(mid, 0.75e-3);
  EXPECT_LT(mid, 1.0e-3);
  // Below the smallest measured bucket of a row: at most that bucket's cost.
  CostModel fresh(&o);
  for (int i = 0; i < 10; ++i) fresh.ObserveVerify(4, 40, 1e-3);
  EXPECT_LE(fresh.VerifySeconds(4, 6), 1e-3 * (1 + 1e-9));
  // Draft levels likewise: one measured bucket of one token a level, a 16-token level is
  // predicted at its cost until measured, then measured.
  const double one = costs.DraftSeconds(1, 4, 4);
  for (int i = 0; i < 10; ++i) costs.ObserveDraft(1, 4, 4, 2, one / 2);
  EXPECT_NEAR(costs.DraftSeconds(16, 4, 64), costs.DraftSeconds(1, 4, 4), 1e-9);
  for (int i = 0; i < 30; ++i) costs.ObserveDraft(16, 4, 64, 32, 4 * one);
  EXPECT_NEAR(costs.DraftSeconds(16, 4, 64), 4 * one, 0.2 * one);
}

// The policy, on a GPU whose verify cost is nearly flat in tokens and whose draft levels are
// cheap, learns so from the steps it runs and drafts every sequence, at batch 1 and at batch 16,
// starting from CPU-shaped priors that say drafting cannot pay. A sequence's first draft call
// prefills its prompt, which is not a cost sample.
TEST(SpecPolicyTest, LearnsThatBiggerStepsAreCheapWhereTheyAre) {
  for (const int rows : {1, 16}) {
    PolicyOptions o;
    GoodputPolicy policy(o);
    const AcceptanceEstimate a = Acceptance(0.8, o);
    std::vector<PolicySequence> batch = Batch(rows, &a);
    std::vector<bool> drafted_before(rows, false);
    auto gpu_verify = [](int r, int tokens) { return 0.4e-3 + 2e-6 * r + 1e-6 * tokens; };
    auto gpu_draft = [](int levels, int fed) { return 0.3e-3 + levels * 0.12e-3 + fed * 1e-6; };
    int drafting_steps = 0;
    for (int step = 0; step < 60; ++step) {
      const PolicyDecision d = policy.Decide(batch);
      int tokens = 0, levels = 0, drafting = 0, nodes = 0, fed = 0;
      for (int i = 0; i < rows; ++i) {
        tokens += batch[i].pending + d.shapes[i].nodes();
        if (!d.shapes[i].none()) {
          ++drafting;
          nodes += d.shapes[i].nodes();
          levels = std::max(levels, d.shapes[i].depth);
          fed += drafted_before[i] ? 3 : 200;
          drafted_before[i] = true;
        }
        batch[i].previous = d.shapes[i];
        batch[i].never_drafted = !drafted_before[i];
        batch[i].steps_without_draft = d.shapes[i].none() ? batch[i].steps_without_draft + 1 : 0;
      }
      policy.costs().ObserveVerify(rows, tokens, gpu_verify(rows, tokens));
      if (drafting > 0) {
        policy.costs().ObserveDraft(drafting, levels, nodes, fed, gpu_draft(levels, fed));
      }
      if (step >= 40 && drafting == rows) ++drafting_steps;
    }
    EXPECT_EQ(drafting_steps, 20) << rows << " rows";
  }
}

TEST(SpecPolicyTest, PaddedRowsArePricedAtTheLongestRow) {
  EXPECT_EQ(VerifyStepTokens(false, 16, 92, 17), 92);
  EXPECT_EQ(VerifyStepTokens(true, 16, 92, 17), 16 * 17);
  EXPECT_EQ(VerifyStepTokens(true, 12, 60, 5), 16 * 5);
  EXPECT_EQ(VerifyStepTokens(true, 3, 3, 1), 4);
  EXPECT_EQ(VerifyStepTokens(true, 1, 6, 6), 9);
  // Beyond the graph limits a step runs unpadded.
  EXPECT_EQ(VerifyStepTokens(true, 16, 600, 500), 600);
  EXPECT_EQ(VerifyStepTokens(true, 100, 120, 3), 120);
  // A batch of 16 at a GPU-like cost that grows with the padded tokens: one sequence's deep
  // chain would make every row as long, so the padded policy keeps the batch's shapes alike (all
  // the rows at one token bucket), where priced by total tokens it would mix them.
  PolicyOptions o;
  o.measure_costs = false;
  o.verify_fixed_s = 5e-3;
  o.verify_per_row_s = 0;
  o.verify_per_token_s = 0.2e-3;
  o.draft_fixed_s = 0.1e-3;
  o.draft_level_fixed_s = 0.02e-3;
  o.draft_level_per_token_s = 0;
  o.padded_rows = true;
  GoodputPolicy policy(o);
  const AcceptanceEstimate strong = Acceptance(0.9, o), weak = Acceptance(0.5, o);
  std::vector<PolicySequence> batch = Batch(16, &weak);
  batch[0].acceptance = &strong;
  // The row's padded length alone: its token bucket.
  auto bucket = [](const SpecShape& s) { return VerifyStepTokens(true, 1, 1, 1 + s.nodes()); };
  const PolicyDecision d = policy.Decide(batch);
  for (size_t i = 1; i < batch.size(); ++i) {
    EXPECT_EQ(bucket(d.shapes[i]), bucket(d.shapes[0])) << i << " " << ShapeString(d.shapes[i]);
  }
  // Priced by total tokens, the strong sequence would get a deeper chain than the rest: a
  // mix that, padded, costs every row the strong one's length.
  PolicyOptions unpadded = o;
  unpadded.padded_rows = false;
  const PolicyDecision mixed = GoodputPolicy(unpadded).Decide(batch);
  EXPECT_GT(bucket(mixed.shapes[0]), bucket(mixed.shapes[1])) << ShapeString(mixed.shapes[0]);
  EXPECT_GT(d.predicted_goodput, policy.Goodput(batch, mixed.shapes));
}

// Fixed costs (no measuring) under which a chain pays at acceptance 0.9 and not at 0.3: 2 ms a
// verify step plus 0.5 ms a token, a probe every 8 steps without drafts.
PolicyOptions ProbeOptions() {
  PolicyOptions o;
  o.probe_interval = 8;
  o.measure_costs = false;
  o.verify_fixed_s = 2e-3;
  o.verify_per_row_s = 0;
  o.verify_per_token_s = 0.5e-3;
  return o;
}

TEST(SpecPolicyTest, ProbesASequenceLeftWithoutDraftsOnlyWhereAProbeCouldPay) {
  const PolicyOptions o = ProbeOptions();
  GoodputPolicy policy(o);
  // At acceptance 0.3 a chain does not pay here; at 0.9 it would.
  const AcceptanceEstimate a = Acceptance(0.3, o);
  std::vector<PolicySequence> batch = Batch(1, &a);
  EXPECT_TRUE(policy.Decide(batch).shapes[0].none());
  batch[0].steps_without_draft = 8;
  const PolicyDecision d = policy.Decide(batch);
  EXPECT_FALSE(d.shapes[0].none());
  EXPECT_EQ(d.reasons[0], ShapeReason::kProbe);

  // Verify cost that grows steeply with tokens: no acceptance could pay, so no probe.
  PolicyOptions steep = o;
  steep.verify_fixed_s = 0;
  steep.verify_per_token_s = 3e-3;
  GoodputPolicy never(steep);
  EXPECT_TRUE(never.Decide(batch).shapes[0].none());
  // A sequence never drafted is judged the same way: where nothing could pay, its acceptance
  // does not matter, and a probe would only stall the batch.
  batch[0].never_drafted = true;
  EXPECT_TRUE(never.Decide(batch).shapes[0].none());
  // Where a probe could pay, it is probed without waiting probe_interval steps.
  batch[0].steps_without_draft = 0;
  EXPECT_EQ(policy.Decide(batch).reasons[0], ShapeReason::kProbe);
  batch[0].never_drafted = false;
  EXPECT_TRUE(policy.Decide(batch).shapes[0].none());
  // At most max_probes_per_step probes a step, so that a burst of new sequences does not carry
  // all their catch-ups in one step.
  PolicyOptions cheap = o;
  cheap.verify_per_token_s = 0.3e-3;  // too dear for acceptance 0.3, not for 0.9
  cheap.draft_fixed_s = 0;
  cheap.draft_level_fixed_s = 0;
  cheap.draft_level_per_token_s = 0;
  cheap.max_probes_per_step = 3;
  GoodputPolicy few(cheap);
  std::vector<PolicySequence> fresh = Batch(10, &a);
  for (PolicySequence& s : fresh) s.never_drafted = true;
  const PolicyDecision burst = few.Decide(fresh);
  int probes = 0;
  for (ShapeReason r : burst.reasons) probes += r == ShapeReason::kProbe;
  EXPECT_EQ(probes, 3);
}

// A probe carries its sequence's whole catch-up in its own step: where drafting does not pay,
// the sequence drafts no further and no later step shares it. So a probe that pays with the
// drafter up to date is not sent when the drafter must first be fed a whole prompt.
TEST(SpecPolicyTest, AProbeIsJudgedWithItsWholeCatchUp) {
  const PolicyOptions o = ProbeOptions();
  GoodputPolicy policy(o);
  const AcceptanceEstimate a = Acceptance(0.3, o);
  std::vector<PolicySequence> batch = Batch(1, &a);
  batch[0].steps_without_draft = 8;
  batch[0].draft_backlog = 3;
  EXPECT_EQ(policy.Decide(batch).reasons[0], ShapeReason::kProbe);
  // 150 tokens at 20 us: 3 ms, more than the step itself. Spread over the ~24 steps the
  // sequence would draft, it would look like 0.1 ms and the probe would be sent.
  batch[0].draft_backlog = 150;
  const PolicyDecision d = policy.Decide(batch);
  EXPECT_TRUE(d.shapes[0].none()) << ShapeString(d.shapes[0]);
}

// A sequence the drafter has fallen behind on pays a share of its catch-up when it drafts
// again: where the catch-up is dear the policy leaves it off, where cheap it drafts, and the
// catch-up cost is learnt from the calls that carried one.
TEST(SpecPolicyTest, CatchUpIsChargedAndMeasured) {
  PolicyOptions o;
  o.measure_costs = false;
  o.verify_fixed_s = 1e-3;
  o.verify_per_row_s = 0;
  o.verify_per_token_s = 0.01e-3;
  o.draft_fixed_s = 0.1e-3;
  o.draft_level_fixed_s = 0.1e-3;
  o.draft_level_per_token_s = 0;
  GoodputPolicy cheap(o);
  const AcceptanceEstimate a = Acceptance(0.7, o);
  std::vector<PolicySequence> batch = Batch(1, &a);
  batch[0].draft_backlog = 3;
  ASSERT_FALSE(cheap.Decide(batch).shapes[0].none());
  // 2000 tokens at 20 us (40 ms) serve every step the sequence has left: worth paying with 1000
  // tokens to go, not with 8 (spread over the two or three steps left, each is charged over
  // 10 ms against a 1 ms step).
  batch[0].draft_backlog = 2000;
  batch[0].max_depth = 1000;
  EXPECT_FALSE(cheap.Decide(batch).shapes[0].none());
  batch[0].max_depth = 8;
  EXPECT_TRUE(cheap.Decide(batch).shapes[0].none());
  batch[0].max_depth = 64;

  // Measured at 1 us a token (what the call took beyond its levels, per token beyond a step's
  // worth), the same catch-up is cheap enough.
  PolicyOptions m = o;
  m.measure_costs = true;
  GoodputPolicy measured(m);
  for (int i = 0; i < 5; ++i) {
    const double levels = measured.costs().DraftSeconds(1, 2, 2);
    measured.costs().ObserveDraft(1, 2, 2, /*fed_tokens=*/1003, levels + 1000 * 1e-6);
  }
  EXPECT_NEAR(measured.costs().CatchUpTokenSeconds(), 1e-6, 1e-9);
  EXPECT_FALSE(measured.Decide(batch).shapes[0].none());
  // A call that fed no more than a step's worth is a level sample, not a catch-up one.
  measured.costs().ObserveDraft(1, 2, 2, /*fed_tokens=*/3, 5e-3);
  EXPECT_NEAR(measured.costs().CatchUpTokenSeconds(), 1e-6, 1e-9);
  // Nor is one whose sequences each fed a few tokens more (too few to price a token): it is a
  // level sample once they are priced at the estimate, so that a batch whose every call carries
  // a few (sequences drafted now and then) still corrects the levels' cost. 10 sequences, 2
  // levels, 5 tokens beyond a step's worth each, taking 10 times the predicted call.
  const double predicted = measured.costs().DraftSeconds(10, 2, 20);
  for (int i = 0; i < 20; ++i) {
    measured.costs().ObserveDraft(10, 2, 20, /*fed_tokens=*/10 * 3 + 50, 10 * predicted);
  }
  EXPECT_GT(measured.costs().DraftSeconds(10, 2, 20), 5 * predicted);
  EXPECT_NEAR(measured.costs().CatchUpTokenSeconds(), 1e-6, 1e-9);
}

// A catch-up is fed before a draft call's first level, so a sequence drafted with a whole
// prompt to feed stalls every row of the step. Where the caller can feed the drafter beside
// verify (the router on a CPU), such a sequence is planned plain this step with its catch-up
// fed there, as long as the feeds fit in the verify step, and it drafts from the next step with
// nothing to feed; at one row nobody else waits, and nothing is moved.
TEST(SpecPolicyTest, ALongCatchUpIsFedBesideVerifyNotBeforeTheBatchsDrafts) {
  const PolicyOptions o = CpuLikeCosts();
  const AcceptanceEstimate a = Acceptance(0.9, o);
  std::vector<PolicySequence> batch = Batch(16, &a);
  for (PolicySequence& s : batch) s.draft_backlog = 150;
  auto stalled = [](absl::Span<const PolicySequence> b, const PolicyDecision& d) {
    int tokens = 0;  // catch-up tokens fed before the step's draft levels
    for (size_t i = 0; i < b.size(); ++i) {
      if (!d.shapes[i].none()) tokens += std::max(0, b[i].draft_backlog - d.shapes[i].depth - 1);
    }
    return tokens;
  };
  // Without a feed beside verify, some are drafted at once, their prompts fed first.
  GoodputPolicy in_call(o);
  const PolicyDecision before = in_call.Decide(batch);
  EXPECT_GT(stalled(batch, before), 100);
  for (char ingest : before.ingest) EXPECT_EQ(ingest, 0);

  for (PolicySequence& s : batch) s.can_ingest = true;
  GoodputPolicy policy(o);
  const PolicyDecision d = policy.Decide(batch);
  EXPECT_EQ(stalled(batch, d), 0);
  int ingested = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!d.ingest[i]) continue;
    ++ingested;
    EXPECT_TRUE(d.shapes[i].none());
    EXPECT_EQ(d.reasons[i], ShapeReason::kCatchUp);
  }
  // The feeds fit in the verify step beside them (16 plain rows: 14.8 ms; 150 tokens: 12 ms).
  EXPECT_EQ(ingested, 1);
  // Fed, it drafts next step with nothing to feed.
  for (size_t i = 0; i < batch.size(); ++i) {
    if (d.ingest[i]) batch[i].draft_backlog = 1;
  }
  const PolicyDecision next = policy.Decide(batch);
  EXPECT_EQ(stalled(batch, next), 0);
  int drafted = 0;
  for (size_t i = 0; i < batch.size(); ++i) drafted += !next.shapes[i].none();
  EXPECT_GT(drafted, 0);

  // One row: its catch-up stalls only itself, which the search has priced.
  std::vector<PolicySequence> one = Batch(1, &a);
  one[0].draft_backlog = 150;
  one[0].can_ingest = true;
  const PolicyDecision alone = policy.Decide(one);
  EXPECT_FALSE(alone.shapes[0].none());
  EXPECT_EQ(alone.ingest[0], 0);
}

// A new sequence's catch-up is its whole prompt. Fed first in the draft call, it sits on the
// first token's critical path even at one row, where nobody else waits: the draft call runs
// before verify's prefill. Where the caller can feed the drafter beside verify, the prompt goes
// there, beside the prefill the first token waits for anyway, and the sequence drafts from its
// second step with nothing left to feed.
TEST(SpecPolicyTest, ANewSequencesPromptIsFedBesideTheVerifyPrefill) {
  const PolicyOptions o = CpuLikeCosts();
  const AcceptanceEstimate a = Acceptance(0.9, o);
  for (size_t rows : {1, 4}) {
    SCOPED_TRACE(rows);
    std::vector<PolicySequence> batch = Batch(rows, &a);
    PolicySequence& fresh = batch[0];
    fresh.never_drafted = true;
    fresh.drafter_unfed = true;
    fresh.pending = 100;  // the prompt, prefilled by this verify step
    fresh.draft_backlog = 100;
    GoodputPolicy in_call(o);
    const PolicyDecision before = in_call.Decide(batch);
    EXPECT_FALSE(before.shapes[0].none());  // drafted, its prompt fed before verify starts
    EXPECT_EQ(before.ingest[0], 0);

    for (PolicySequence& s : batch) s.can_ingest = true;
    GoodputPolicy policy(o);
    const PolicyDecision d = policy.Decide(batch);
    EXPECT_TRUE(d.shapes[0].none());
    EXPECT_EQ(d.ingest[0], 1);
    EXPECT_EQ(d.reasons[0], ShapeReason::kCatchUp);
    EXPECT_FALSE(d.deferred[0].none());
    // Fed, it drafts the deferred shape from the next step, with only that step's tokens to
    // feed: the decision it keeps.
    fresh.pending = 1;
    fresh.draft_backlog = 1;
    fresh.deferred = d.deferred[0];
    const PolicyDecision next = GoodputPolicy(o).Decide(batch);
    EXPECT_EQ(ShapeString(next.shapes[0]), ShapeString(d.deferred[0]));
    EXPECT_EQ(next.ingest[0], 0);
    // But judged anew on this decode step: where every token verify scores costs 100 times as
    // much (no prefill beside the trees to make them look cheap), a shorter chain is drafted.
    PolicyOptions dear = o;
    dear.verify_per_token_s = 100 * o.verify_per_token_s;
    GoodputPolicy later(dear);
    const PolicyDecision anew = later.Decide(batch);
    EXPECT_LT(anew.shapes[0].nodes(), d.deferred[0].nodes()) << ShapeString(anew.shapes[0]);
    EXPECT_EQ(anew.reasons[0], ShapeReason::kPolicy);
    // Behind a padded backend it is drafted as chosen (a cold policy's first drafts at a large
    // batch measure the pair).
    dear.padded_rows = true;
    EXPECT_EQ(ShapeString(GoodputPolicy(dear).Decide(batch).shapes[0]), ShapeString(d.deferred[0]));
    // Not fed (the ingest failed or is late), it is decided as any other.
    fresh.draft_backlog = 100;
    EXPECT_TRUE(later.Decide(batch).shapes[0].none());
  }
  // So is an explicit request's: it drafts the shape it asked for from its second step.
  std::vector<PolicySequence> asked = Batch(1, &a);
  asked[0].never_drafted = true;
  asked[0].drafter_unfed = true;
  asked[0].can_ingest = true;
  asked[0].fixed = true;
  asked[0].fixed_shape = SpecShape{4, 1, 4};
  asked[0].pending = 100;
  asked[0].draft_backlog = 100;
  GoodputPolicy fixed(o);
  const PolicyDecision first = fixed.Decide(asked);
  EXPECT_TRUE(first.shapes[0].none());
  EXPECT_EQ(first.ingest[0], 1);
  asked[0].pending = 1;
  asked[0].draft_backlog = 1;
  const PolicyDecision second = fixed.Decide(asked);
  EXPECT_EQ(ShapeString(second.shapes[0]), ShapeString(SpecShape{4, 1, 4}));
  EXPECT_EQ(second.reasons[0], ShapeReason::kExplicit);
  // Its prompt fed late (the stream busy meanwhile, the steps plain), it has a backlog of the
  // tokens since: fed in its draft call, never beside verify again, or a feed that is late each
  // time would leave it undrafted for good.
  asked[0].drafter_unfed = false;
  asked[0].pending = 1;
  asked[0].draft_backlog = 20;
  const PolicyDecision caught_up = fixed.Decide(asked);
  EXPECT_EQ(ShapeString(caught_up.shapes[0]), ShapeString(SpecShape{4, 1, 4}));
  EXPECT_EQ(caught_up.ingest[0], 0);
  // A prompt that outlasts the prefill beside it stays in the draft call, as before.
  std::vector<PolicySequence> one = Batch(1, &a);
  one[0].never_drafted = true;
  one[0].drafter_unfed = true;
  one[0].can_ingest = true;
  one[0].pending = 10;
  one[0].draft_backlog = 1000;
  GoodputPolicy policy(o);
  EXPECT_EQ(policy.Decide(one).ingest[0], 0);
}

// Overlap fan-out (pre-drafted outcome guesses per sequence): every guess the verify step has
// room for at one stream, one each from two sequences on, and each answer the largest F (up to
// that) whose pre-draft the cost model predicts to end inside verify.
TEST(SpecPolicyTest, PreDraftFanOutFillsTheVerifyStepAndShrinksWithTheBatch) {
  PolicyOptions o = GpuLikeCosts();
  o.draft_level_per_token_s = 0.05e-3;  // a level's cost grows with its tokens
  const GoodputPolicy policy(o);
  constexpr int kMax = 8, kLevels = 5, kNodesPerTree = 9;
  int previous = kMax;
  int smallest = kMax;
  for (int rows : {1, 2, 4, 8, 16, 32, 64, 128, 256}) {
    SCOPED_TRACE(rows);
    const int verify_tokens = rows * kNodesPerTree;
    const int f =
        policy.PreDraftFanOut(rows, kLevels, rows * kNodesPerTree, rows, verify_tokens, kMax);
    const double verify = policy.costs().VerifySeconds(rows, verify_tokens);
    auto pre = [&](int fan_out) {
      return policy.costs().PreDraftSeconds(rows * fan_out, kLevels,
                                            rows * kNodesPerTree * fan_out);
    };
    if (f > 0) EXPECT_LE(pre(f), verify);
    // One sequence gets every guess that fits; several, one each (the draft call is saved only
    // when all of them hit).
    if (f < (rows == 1 ? kMax : 1)) EXPECT_GT(pre(f + 1), verify);
    EXPECT_LE(f, previous);
    if (rows == 1) EXPECT_GE(f, 2);
    if (rows > 1) EXPECT_LE(f, 1);
    previous = f;
    smallest = std::min(smallest, f);
  }
  EXPECT_LE(smallest, 1);
}

// A pre-draft measured slower than the verify step it runs beside gives a fan-out of 0 (the step
// stays sequential), however cheap the cost model prices the drafting it stands for.
TEST(SpecPolicyTest, PreDraftsMeasuredSlowerThanVerifyAreNotSent) {
  PolicyOptions o;
  o.unmeasured_draft_scale = 1.0;
  GoodputPolicy policy(o);
  const double verify = policy.costs().VerifySeconds(1, 5);
  ASSERT_LT(policy.costs().DraftSeconds(1, 5, 9), verify);
  EXPECT_GE(policy.PreDraftFanOut(1, 5, 9, 1, 5, 1), 1);
  for (int i = 0; i < 20; ++i) policy.costs().ObservePreDraft(1, 5, 9, 3 * verify);
  EXPECT_NEAR(policy.costs().PreDraftSeconds(1, 5, 9), 3 * verify, 0.1 * verify);
  EXPECT_EQ(policy.PreDraftFanOut(1, 5, 9, 1, 5, 1), 0);
  // Measured faster again, they are sent again.
  for (int i = 0; i < 40; ++i) {
    policy.costs().ObservePreDraft(1, 5, 9, 0.5 * policy.costs().DraftSeconds(1, 5, 9));
  }
  EXPECT_EQ(policy.PreDraftFanOut(1, 5, 9, 1, 5, 1), 1);
}

// Overlap depth and fan-out together: the deepest cap whose one-guess pre-draft fits inside the
// verify step, each tree cut to it as the depth budget cuts it; further guesses only at the
// planned depth; nothing when not even depth 1 fits.
TEST(SpecPolicyTest, PlanPreDraftPicksTheDeepestTreeThatFitsThenTheMostGuesses) {
  PolicyOptions o = GpuLikeCosts();
  const SpecShape chain6{6, 1, 6};
  auto fits = [](const GoodputPolicy& policy, const std::vector<SpecShape>& shapes, int depth,
                 int fan_out, int rows, int tokens) {
    std::vector<SpecShape> cut;
    for (const SpecShape& s : shapes) cut.push_back(GoodputPolicy::CutToDepth(s, depth));
    const GoodputPolicy::PreDraftWork w = GoodputPolicy::PreDraftWorkOf(cut, fan_out);
    return policy.costs().PreDraftSeconds(w.drafting, w.levels, w.nodes) <=
           policy.costs().VerifySeconds(rows, tokens);
  };
  {
    // A verify step of 2.85 ms beside draft levels of 0.5 ms: a chain of 6 (7 levels with the
    // guess's) does not fit, one of 4 does.
    o.verify_fixed_s = 2.5e-3;
    const GoodputPolicy policy(o);
    const GoodputPolicy::PreDraftPlan plan = policy.PlanPreDraft({chain6}, 1, 7, 4);
    EXPECT_EQ(plan.depth, 4);
    EXPECT_EQ(plan.fan_out, 1);
    EXPECT_TRUE(fits(policy, {chain6}, 4, 1, 1, 7));
    EXPECT_FALSE(fits(policy, {chain6}, 5, 1, 1, 7));
  }
  {
    // A long verify step: the whole chain, and as many guesses as PreDraftFanOut gives it.
    o.verify_fixed_s = 20e-3;
    const GoodputPolicy policy(o);
    const GoodputPolicy::PreDraftPlan plan = policy.PlanPreDraft({chain6}, 1, 7, 8);
    EXPECT_EQ(plan.depth, 6);
    EXPECT_GE(plan.fan_out, 2);
    const GoodputPolicy::PreDraftWork w = GoodputPolicy::PreDraftWorkOf({chain6}, 1);
    EXPECT_EQ(plan.fan_out, policy.PreDraftFanOut(w.drafting, w.levels, w.nodes, 1, 7, 8));
    EXPECT_EQ(policy.PlanPreDraft({chain6}, 1, 7, 1).fan_out, 1);
    EXPECT_EQ(policy.PlanPreDraft({chain6}, 1, 7, 0).fan_out, 0);
  }
  {
    // Shorter than one draft level plus the call: nothing.
    o.verify_fixed_s = 0.5e-3;
    const GoodputPolicy policy(o);
    const GoodputPolicy::PreDraftPlan plan = policy.PlanPreDraft({chain6}, 1, 7, 4);
    EXPECT_EQ(plan.depth, 0);
    EXPECT_EQ(plan.fan_out, 0);
    EXPECT_TRUE(policy.PlanPreDraft({}, 1, 1, 4).depth == 0);
  }
}

// Trees keep their width when cut; as the batch grows (a level's tokens grow with it) the plan
// goes from several guesses at full depth to one, then to shallower trees, then to none, and
// every answer is the deepest that fits.
TEST(SpecPolicyTest, PlanPreDraftShrinksDepthWithTheBatch) {
  const SpecShape tree{5, 4, 16};
  EXPECT_EQ(GoodputPolicy::CutToDepth(tree, 2), (SpecShape{2, 4, 16}));
  EXPECT_EQ(GoodputPolicy::CutToDepth(tree, 1), (SpecShape{1, 4, 4}));
  EXPECT_EQ(GoodputPolicy::CutToDepth(SpecShape{6, 1, 6}, 3), (SpecShape{3, 1, 3}));
  EXPECT_EQ(GoodputPolicy::CutToDepth(tree, 9), tree);
  PolicyOptions o = GpuLikeCosts();
  // The draft's levels grow with the batch faster than the verify step does.
  o.verify_per_token_s = 0.005e-3;
  o.draft_level_per_token_s = 0.02e-3;
  const GoodputPolicy policy(o);
  GoodputPolicy::PreDraftPlan previous{8, 5};
  bool cut = false, none = false;
  for (int rows : {1, 2, 4, 8, 16, 32, 64, 128, 256}) {
    SCOPED_TRACE(rows);
    const std::vector<SpecShape> shapes(rows, tree);
    const int tokens = rows * 17;
    const GoodputPolicy::PreDraftPlan plan = policy.PlanPreDraft(shapes, rows, tokens, 8);
    const double verify = policy.costs().VerifySeconds(rows, tokens);
    auto pre = [&](int depth, int fan_out) {
      std::vector<SpecShape> c;
      for (const SpecShape& s : shapes) c.push_back(GoodputPolicy::CutToDepth(s, depth));
      const GoodputPolicy::PreDraftWork w = GoodputPolicy::PreDraftWorkOf(c, fan_out);
      return policy.costs().PreDraftSeconds(w.drafting, w.levels, w.nodes);
    };
    EXPECT_LE(plan.depth, previous.depth);
    if (plan.depth == previous.depth) EXPECT_LE(plan.fan_out, previous.fan_out);
    if (plan.depth > 0) {
      EXPECT_LE(pre(plan.depth, plan.fan_out), verify);
      EXPECT_GE(plan.fan_out, 1);
    } else {
      EXPECT_EQ(plan.fan_out, 0);
      EXPECT_GT(pre(1, 1), verify);
      none = true;
    }
    if (plan.depth < 5) EXPECT_GT(pre(plan.depth + 1, 1), verify);
    if (plan.depth > 0 && plan.depth < 5) {
      EXPECT_EQ(plan.fan_out, 1);
      cut = true;
    }
    if (rows == 1) {
      EXPECT_EQ(plan.depth, 5);
      EXPECT_GE(plan.fan_out, 2);
    }
    previous = plan;
  }
  EXPECT_TRUE(cut) << "no batch size had a shallower pre-draft";
  EXPECT_TRUE(none) << "no batch size was left sequential";
}

}  // namespace
}  // namespace specd

namespace specd {
namespace {

// Decide keeps each estimate's candidate expectations between decisions (a sequence not drafted
// keeps them for many steps); they must follow the estimate, the prior and the policy.
TEST(SpecPolicyTest, KeptExpectationsFollowTheEstimateThePriorAndThePolicy) {
  PolicyOptions o = GpuLikeCosts();
  o.verify_per_token_s = 0.5e-3;  // a tree pays only with good acceptance
  o.acceptance_prior = 0.1;
  o.sibling_acceptance_prior = 0.05;
  GoodputPolicy policy(o);
  // No sample yet: the constant priors, too low for a tree.
  AcceptanceEstimate a;
  std::vector<PolicySequence> batch = Batch(1, &a);
  const PolicyDecision unknown = policy.Decide(batch);
  EXPECT_EQ(policy.Decide(batch).predicted_goodput, unknown.predicted_goodput);
  // Three chains accepted whole (fewer samples than the four that put an estimate into the
  // pooled prior, so the prior stays as it was): the next decision must see the estimate rise.
  for (int s = 0; s < 3; ++s) a.Observe(SpecShape{8, 1, 8}, 8, o);
  const PolicyDecision risen = policy.Decide(batch);
  EXPECT_GT(risen.shapes[0].nodes(), unknown.shapes[0].nodes())
      << ShapeString(risen.shapes[0]) << " after " << ShapeString(unknown.shapes[0]);
  // The same estimate built afresh, decided by a fresh policy: bit for bit the same decision.
  AcceptanceEstimate fresh;
  for (int s = 0; s < 3; ++s) fresh.Observe(SpecShape{8, 1, 8}, 8, o);
  GoodputPolicy other(o);
  const PolicyDecision fresh_d = other.Decide(Batch(1, &fresh));
  EXPECT_EQ(fresh_d.shapes[0], risen.shapes[0]) << ShapeString(fresh_d.shapes[0]);
  EXPECT_EQ(fresh_d.predicted_goodput, risen.predicted_goodput);
  // A pooled prior (a second sequence with samples) changes the expectations of the first.
  const AcceptanceEstimate good = Acceptance(0.95, o);
  std::vector<PolicySequence> two = Batch(2, &a);
  two[1].acceptance = &good;
  const PolicyDecision pooled = policy.Decide(two);
  std::vector<PolicySequence> two_fresh = Batch(2, &fresh);
  two_fresh[1].acceptance = &good;
  GoodputPolicy third(o);
  const PolicyDecision pooled_fresh = third.Decide(two_fresh);
  EXPECT_EQ(pooled.shapes[0], pooled_fresh.shapes[0]) << ShapeString(pooled.shapes[0]);
  EXPECT_EQ(pooled.predicted_goodput, pooled_fresh.predicted_goodput);
  // A policy with other candidates never takes the first one's expectations.
  PolicyOptions chains_only = o;
  chains_only.candidates = {{2, 1, 2}};
  GoodputPolicy narrow(chains_only);
  for (const SpecShape& s : narrow.Decide(Batch(1, &good)).shapes) {
    EXPECT_EQ(s, (SpecShape{2, 1, 2})) << ShapeString(s);
  }
}

}  // namespace
}  // namespace specd
