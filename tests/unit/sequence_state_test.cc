// SequenceState: the stop and feeding logic the Generator and the router share, driven with
// hand-made verify outcomes.
#include "engine/spec/sequence_state.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// An outcome that accepted `tokens.size() - 1` draft nodes (their node indices do not matter
// here) and ended with a bonus token.
VerifyOutcome Outcome(std::vector<int32_t> tokens) {
  VerifyOutcome o;
  o.tokens = std::move(tokens);
  o.accepted_draft = static_cast<int>(o.tokens.size()) - 1;
  for (int i = 0; i < o.accepted_draft; ++i) o.accepted_nodes.push_back(i);
  return o;
}

SequenceState Make(std::vector<int32_t> prompt, StopConditions stop) {
  absl::StatusOr<SequenceState> s = SequenceState::Create(std::move(prompt), stop, 300);
  EXPECT_TRUE(s.ok()) << s.status();
  return *std::move(s);
}

TEST(SequenceStateTest, FeedsTargetAndDrafterWhatTheyHaveNotSeen) {
  StopConditions stop;
  stop.max_new_tokens = 100;
  SequenceState s = Make({1, 2, 3}, stop);
  EXPECT_THAT(s.TargetPending(), ElementsAre(1, 2, 3));
  EXPECT_THAT(s.DrafterPending(), ElementsAre(1, 2, 3));
  s.MarkDrafterFed();
  EXPECT_THAT(s.DrafterPending(), IsEmpty());

  EXPECT_THAT(s.Apply(Outcome({7, 8, 9}), 5), ElementsAre(7, 8, 9));
  // The target cached the prompt and the two accepted nodes; the bonus token is pending.
  EXPECT_THAT(s.TargetPending(), ElementsAre(9));
  EXPECT_THAT(s.DrafterPending(), ElementsAre(7, 8, 9));
  // A step without a draft (drafter down): the drafter catches up later with everything.
  EXPECT_THAT(s.Apply(Outcome({10}), 0), ElementsAre(10));
  EXPECT_THAT(s.TargetPending(), ElementsAre(10));
  EXPECT_THAT(s.DrafterPending(), ElementsAre(7, 8, 9, 10));
  EXPECT_THAT(s.output(), ElementsAre(7, 8, 9, 10));
  EXPECT_THAT(s.prompt(), ElementsAre(1, 2, 3));

  const SpecStats& st = s.stats();
  EXPECT_EQ(st.steps, 2);
  EXPECT_EQ(st.draft_steps, 1);
  EXPECT_EQ(st.target_only_steps, 1);
  EXPECT_EQ(st.draft_tokens, 5);
  EXPECT_EQ(st.accepted_tokens, 2);
  EXPECT_THAT(st.accepted_per_position, ElementsAre(1, 1));
}

TEST(SequenceStateTest, StopTokenInsideAStepDropsTheRest) {
  StopConditions stop;
  stop.max_new_tokens = 100;
  stop.eos_token_ids = {256};
  stop.stop_token_ids = {42};
  SequenceState s = Make({1}, stop);
  EXPECT_THAT(s.Apply(Outcome({5, 42, 6, 7}), 4), ElementsAre(5, 42));
  EXPECT_TRUE(s.finished());
  EXPECT_EQ(s.finish_reason(), FinishReason::kStop);
  EXPECT_THAT(s.output(), ElementsAre(5, 42));
  EXPECT_THAT(s.Apply(Outcome({9}), 0), IsEmpty());  // finished: nothing more is appended
  EXPECT_EQ(s.stats().steps, 1);

  SequenceState e = Make({1}, stop);
  EXPECT_THAT(e.Apply(Outcome({256, 6}), 1), ElementsAre(256));
  EXPECT_EQ(e.finish_reason(), FinishReason::kStop);

  stop.ignore_eos = true;
  SequenceState i = Make({1}, stop);
  EXPECT_THAT(i.Apply(Outcome({256, 6}), 1), ElementsAre(256, 6));
  EXPECT_FALSE(i.finished());
  EXPECT_THAT(i.Apply(Outcome({42, 1}), 1), ElementsAre(42));  // stop ids still stop
  EXPECT_EQ(i.finish_reason(), FinishReason::kStop);
}

TEST(SequenceStateTest, LengthBudgetTruncatesAndBoundsDraftDepth) {
  StopConditions stop;
  stop.max_new_tokens = 5;
  SequenceState s = Make({1, 2}, stop);
  EXPECT_EQ(s.MaxUsefulDraftDepth(), 4);
  EXPECT_THAT(s.Apply(Outcome({3, 4, 5}), 3), ElementsAre(3, 4, 5));
  EXPECT_EQ(s.MaxUsefulDraftDepth(), 1);
  EXPECT_THAT(s.Apply(Outcome({6, 7, 8}), 2), ElementsAre(6, 7));
  EXPECT_EQ(s.finish_reason(), FinishReason::kLength);
  EXPECT_EQ(s.MaxUsefulDraftDepth(), 0);

  // The context limit counts the prompt too.
  stop.max_new_tokens = 100;
  stop.max_total_tokens = 6;
  SequenceState c = Make({1, 2, 3}, stop);
  EXPECT_EQ(c.MaxUsefulDraftDepth(), 2);
  EXPECT_THAT(c.Apply(Outcome({4, 5, 6, 7}), 3), ElementsAre(4, 5, 6));
  EXPECT_EQ(c.finish_reason(), FinishReason::kLength);
  // A stop token at the last allowed position reports kStop.
  stop.max_total_tokens = 0;
  stop.max_new_tokens = 2;
  stop.stop_token_ids = {9};
  SequenceState b = Make({1}, stop);
  EXPECT_THAT(b.Apply(Outcome({8, 9, 10}), 2), ElementsAre(8, 9));
  EXPECT_EQ(b.finish_reason(), FinishReason::kStop);
}

TEST(SequenceStateTest, CreateValidates) {
  StopConditions stop;
  EXPECT_THAT(SequenceState::Create({}, stop, 300).status().message(), HasSubstr("prompt"));
  EXPECT_THAT(SequenceState::Create({1, 300}, stop, 300).status().message(),
              HasSubstr("prompt[1]"));
  EXPECT_THAT(SequenceState::Create({1, -2}, stop, 300).status().message(), HasSubstr("prompt[1]"));
  stop.max_new_tokens = 0;
  EXPECT_THAT(SequenceState::Create({1}, stop, 300).status().message(),
              HasSubstr("max_new_tokens"));
  stop.max_new_tokens = 4;
  stop.max_total_tokens = 2;
  EXPECT_EQ(SequenceState::Create({1, 2}, stop, 300).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(SequenceState::Create({1}, stop, 300).ok());
  EXPECT_STREQ(FinishReasonName(FinishReason::kLength), "length");
}

TEST(SequenceStateTest, StatsAdd) {
  SpecStats a, b;
  a.steps = 2;
  a.accepted_per_position = {2, 1};
  b.steps = 3;
  b.accepted_tokens = 4;
  b.accepted_per_position = {1, 1, 1};
  a.Add(b);
  EXPECT_EQ(a.steps, 5);
  EXPECT_EQ(a.accepted_tokens, 4);
  EXPECT_THAT(a.accepted_per_position, ElementsAre(3, 2, 1));
}

// A chain tree of `tokens`, each node the child of the previous one.
TokenTree Chain(std::vector<int32_t> tokens) {
  TokenTree t;
  for (size_t i = 0; i < tokens.size(); ++i) {
    t.tokens.push_back(tokens[i]);
    t.parents.push_back(static_cast<int32_t>(i) - 1);
  }
  return t;
}

TEST(SequenceStateTest, PlannedStepsUpdateAcceptanceAndPolicyInput) {
  StopConditions stop;
  stop.max_new_tokens = 50;
  SequenceState s = Make({1, 2, 3}, stop);
  PolicySequence in = s.PolicyInput(/*model_draft=*/true);
  EXPECT_EQ(in.pending, 3);
  EXPECT_EQ(in.max_depth, 49);
  EXPECT_TRUE(in.previous.none());
  EXPECT_EQ(in.acceptance, &s.acceptance());
  // Never drafted: due for a probe, whatever the interval.
  EXPECT_GE(in.steps_without_draft, PolicyOptions().probe_interval);
  const PolicyOptions options;
  const double prior = s.acceptance().ChainRate(1, options);

  // Chains of 3 whose first two tokens are always accepted, the third never.
  const SpecShape chain3{3, 1, 3};
  for (int i = 0; i < 10; ++i) {
    s.Plan(chain3, ShapeReason::kPolicy);
    EXPECT_EQ(s.planned(), chain3);
    EXPECT_THAT(s.Apply(Outcome({7, 8, 9}), Chain({7, 8, 5})), ElementsAre(7, 8, 9));
  }
  EXPECT_GT(s.acceptance().ChainRate(1, options), prior);
  EXPECT_GT(s.acceptance().ChainRate(2, options), prior);
  EXPECT_LT(s.acceptance().ChainRate(3, options), prior);
  in = s.PolicyInput(true);
  EXPECT_EQ(in.previous, chain3);
  EXPECT_EQ(in.pending, 1);
  EXPECT_EQ(in.steps_without_draft, 0);
  EXPECT_EQ(s.stats().shape_changes, 0);
  // A step without a draft: counted, and the policy sees how long it has been.
  s.Plan(SpecShape(), ShapeReason::kPolicy);
  s.Apply(Outcome({4}), TokenTree());
  EXPECT_EQ(s.PolicyInput(true).steps_without_draft, 1);
  EXPECT_EQ(s.stats().shape_changes, 1);
  EXPECT_EQ(s.stats().target_only_steps, 1);
  EXPECT_EQ(s.stats().draft_steps, 10);
}

TEST(SequenceStateTest, ResetsFeedEverythingAgain) {
  StopConditions stop;
  stop.max_new_tokens = 50;
  SequenceState s = Make({1, 2}, stop);
  s.MarkDrafterFed();
  s.Apply(Outcome({3, 4}), Chain({3}));
  EXPECT_THAT(s.TargetPending(), ElementsAre(4));
  s.ResetTarget();
  s.ResetDrafter();
  EXPECT_THAT(s.TargetPending(), ElementsAre(1, 2, 3, 4));
  EXPECT_THAT(s.DrafterPending(), ElementsAre(1, 2, 3, 4));
}

TEST(SequenceStateTest, CheckOutcomeRejectsWhatCannotComeFromTheTree) {
  const TokenTree tree = Chain({5, 6});
  EXPECT_TRUE(SequenceState::CheckOutcome(Outcome({5, 6, 7}), tree, 300).ok());
  // Deeper than the tree, a count that does not match, a token outside the vocabulary, any
  // accepted draft without a tree.
  EXPECT_EQ(SequenceState::CheckOutcome(Outcome({5, 6, 7, 8}), tree, 300).code(),
            absl::StatusCode::kInternal);
  VerifyOutcome mismatch = Outcome({5, 6});
  mismatch.accepted_draft = 0;
  EXPECT_FALSE(SequenceState::CheckOutcome(mismatch, tree, 300).ok());
  EXPECT_FALSE(SequenceState::CheckOutcome(Outcome({5, 300}), tree, 300).ok());
  EXPECT_FALSE(SequenceState::CheckOutcome(Outcome({5, 6}), TokenTree(), 300).ok());
  EXPECT_TRUE(SequenceState::CheckOutcome(Outcome({9}), TokenTree(), 300).ok());
}

TEST(SequenceStateTest, OneEosRule) {
  StopConditions stop;
  stop.eos_token_ids = {256, 257};
  EXPECT_THAT(stop.ActiveEosIds(), ElementsAre(256, 257));
  stop.ignore_eos = true;
  EXPECT_THAT(stop.ActiveEosIds(), IsEmpty());
}

// A tree of two levels below the last token: nodes 0 and 1 its first and second choice, 0 with
// the children 2 and 3, 1 with the child 4 (siblings best first, as the drafters order them).
TokenTree TwoBranches() {
  TokenTree t;
  t.tokens = {10, 11, 12, 13, 14};
  t.parents = {-1, -1, 0, 0, 1};
  return t;
}

TEST(SequenceStateTest, PathLevelsGiveEachLevelsRankAndSiblings) {
  const TokenTree tree = TwoBranches();
  // Nothing accepted: the first level, its two candidates both missed.
  EXPECT_THAT(PathLevels(tree, {}), ElementsAre(LevelOutcome{2, -1}));
  // The first choice, then neither of its children.
  EXPECT_THAT(PathLevels(tree, {0}), ElementsAre(LevelOutcome{2, 0}, LevelOutcome{2, -1}));
  // The first choice's second child, a leaf: nothing below to miss, the level has no candidate.
  EXPECT_THAT(PathLevels(tree, {0, 3}),
              ElementsAre(LevelOutcome{2, 0}, LevelOutcome{2, 1}, LevelOutcome{0, -1}));
  // The second choice, whose branch has one child.
  EXPECT_THAT(PathLevels(tree, {1, 4}),
              ElementsAre(LevelOutcome{2, 1}, LevelOutcome{1, 0}, LevelOutcome{0, -1}));
  // Not a path of the tree (2 hangs below 0, not the top; 4 below 1, not 0): nothing.
  EXPECT_THAT(PathLevels(tree, {2}), IsEmpty());
  EXPECT_THAT(PathLevels(tree, {0, 4}), IsEmpty());
  EXPECT_THAT(PathLevels(TokenTree(), {}), IsEmpty());
}

// A tree's outcome feeds the first-child rates by the ranks its path took: a tree whose first
// choices always miss and whose second choices are accepted tells the policy that chains of
// this draft accept nothing, not that they accept what the tree did.
TEST(SequenceStateTest, TreeOutcomesTeachTheFirstChildAndSiblingRatesApart) {
  StopConditions stop;
  stop.max_new_tokens = 200;
  SequenceState s = Make({1, 2, 3}, stop);
  const PolicyOptions options;
  const SpecShape tree_shape{2, 2, 5};
  const double first_prior = s.acceptance().ChainRate(1, options);
  const double sibling_prior = s.acceptance().SiblingRate(1, options);
  for (int i = 0; i < 20; ++i) {
    s.Plan(tree_shape, ShapeReason::kPolicy);
    VerifyOutcome o = Outcome({11, 14, 9});
    o.accepted_nodes = {1, 4};  // the second choice, then its one child
    EXPECT_THAT(s.Apply(o, TwoBranches()), ElementsAre(11, 14, 9));
  }
  EXPECT_LT(s.acceptance().ChainRate(1, options), first_prior);
  EXPECT_LT(s.acceptance().ChainRate(1, options), 0.2);
  EXPECT_GT(s.acceptance().SiblingRate(1, options), sibling_prior);
  EXPECT_GT(s.acceptance().SiblingRate(1, options), 0.8);
  // Below the second choice the one child was always accepted (at depth 2 the first child).
  EXPECT_GT(s.acceptance().ChainRate(2, options), 0.8);
  // So a chain of 2 is expected to accept little, the tree nearly both levels.
  EXPECT_LT(s.acceptance().ExpectedAccepted(SpecShape{2, 1, 2}, options), 0.3);
  EXPECT_GT(s.acceptance().ExpectedAccepted(tree_shape, options), 1.4);
  // An outcome without its nodes (a verifier that sent none) counts as a chain's.
  SequenceState t = Make({1, 2, 3}, stop);
  for (int i = 0; i < 20; ++i) {
    t.Plan(tree_shape, ShapeReason::kPolicy);
    VerifyOutcome o = Outcome({11, 14, 9});
    o.accepted_nodes.clear();
    t.Apply(o, TwoBranches());
  }
  EXPECT_GT(t.acceptance().ChainRate(1, options), 0.8);
}

}  // namespace
}  // namespace specd
