// The target's residual-stream taps (VerifyItem::tap_layers) and the EAGLE drafter that reads
// them, on tests/fixtures/eagle3 (a random 8-layer target and an EAGLE-3 head with taps 1, 4, 6;
// tools/oracle/make_eagle_fixtures.py). The taps of a prefill are checked against the PyTorch
// reference's (float64 math stored in fp32), the taps of a verify step bit for bit against those
// of a plain prefill of the same tokens, and the drafter's first tree level against the head's
// own top-k over the draft vocabulary.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "common/io/safetensors.h"
#include "engine/backend.h"
#include "engine/draft/eagle_drafter.h"
#include "engine/draft/eagle_head.h"
#include "engine/topk.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testutil/hf_fixtures.h"

namespace specd {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using testutil::ReadJson;
using testutil::RelError;
using testutil::RepoRoot;

constexpr int kHidden = 32;
const std::vector<int> kTaps = {1, 4, 6};

fs::path FixtureDir() { return RepoRoot() / "tests" / "fixtures" / "eagle3"; }

std::unique_ptr<Backend> LoadTarget() {
  BackendOptions options;
  options.num_threads = 1;
  absl::StatusOr<std::unique_ptr<Backend>> b =
      CreateBackend((FixtureDir() / "target").string(), options);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? *std::move(b) : nullptr;
}

std::vector<int32_t> Ids() {
  return ReadJson(FixtureDir() / "oracle.json")["ids"].get<std::vector<int32_t>>();
}

// The reference's taps, [16, 3 * 32].
std::vector<float> OracleTaps() {
  absl::StatusOr<std::unique_ptr<TensorStore>> store =
      TensorStore::OpenFolder(FixtureDir().string());
  EXPECT_TRUE(store.ok()) << store.status();
  if (!store.ok()) return {};
  std::vector<float> out(16 * 3 * kHidden);
  EXPECT_TRUE((*store)->ReadF32("taps", {16, 3 * kHidden}, out.data()).ok());
  return out;
}

absl::StatusOr<VerifyOutcome> Step(Backend* target, SeqId seq, std::vector<int32_t> pending,
                                   TokenTree tree, std::vector<int> taps) {
  VerifyItem item;
  item.seq = seq;
  item.pending = std::move(pending);
  item.tree = std::move(tree);
  item.tap_layers = std::move(taps);
  absl::StatusOr<std::vector<VerifyOutcome>> o = target->Verify({item});
  if (!o.ok()) return o.status();
  return (*o)[0];
}

TEST(EagleTapsTest, PrefillTapsMatchTheReference) {
  std::unique_ptr<Backend> target = LoadTarget();
  ASSERT_NE(target, nullptr);
  ASSERT_TRUE(target->verify_features().taps);
  const std::vector<int32_t> ids = Ids();
  const std::vector<float> want = OracleTaps();
  ASSERT_TRUE(target->AddSequence(1).ok());
  absl::StatusOr<VerifyOutcome> o = Step(target.get(), 1, ids, {}, kTaps);
  ASSERT_TRUE(o.ok()) << o.status();
  // Every prompt token's row; the bonus token is not committed yet.
  ASSERT_EQ(o->taps.size(), ids.size() * 3 * kHidden);
  for (size_t t = 0; t < ids.size(); ++t) {
    const absl::Span<const float> got =
        absl::MakeConstSpan(o->taps).subspan(t * 3 * kHidden, 3 * kHidden);
    const std::vector<double> ref(want.begin() + t * 3 * kHidden,
                                  want.begin() + (t + 1) * 3 * kHidden);
    EXPECT_LT(RelError(got, ref), 1e-5) << "token " << t;
  }
}

// Tap num_layers + 1 (FinalNormTap) is the final norm's output, the hidden state the LM head
// reads: EAGLE-1/2's feature, against the reference's final_hidden.
TEST(EagleTapsTest, TheFinalNormTapIsWhatTheLmHeadReads) {
  std::unique_ptr<Backend> target = LoadTarget();
  ASSERT_NE(target, nullptr);
  const int final_tap = FinalNormTap(target->config().num_layers);
  const std::vector<int32_t> ids = Ids();
  absl::StatusOr<std::unique_ptr<TensorStore>> store =
      TensorStore::OpenFolder(FixtureDir().string());
  ASSERT_TRUE(store.ok()) << store.status();
  std::vector<float> want(16 * kHidden);
  ASSERT_TRUE((*store)->ReadF32("final_hidden", {16, kHidden}, want.data()).ok());
  ASSERT_TRUE(target->AddSequence(1).ok());
  absl::StatusOr<VerifyOutcome> o = Step(target.get(), 1, ids, {}, {final_tap, kTaps[0]});
  ASSERT_TRUE(o.ok()) << o.status();
  ASSERT_EQ(o->taps.size(), ids.size() * 2 * kHidden);
  const std::vector<float> taps = OracleTaps();
  for (size_t t = 0; t < ids.size(); ++t) {
    const absl::Span<const float> row = absl::MakeConstSpan(o->taps).subspan(t * 2 * kHidden);
    EXPECT_LT(RelError(row.first(kHidden), std::vector<double>(want.begin() + t * kHidden,
                                                               want.begin() + (t + 1) * kHidden)),
              1e-5)
        << "token " << t;
    // Beside a residual tap, in the order asked.
    EXPECT_LT(RelError(row.subspan(kHidden, kHidden),
                       std::vector<double>(taps.begin() + t * 3 * kHidden,
                                           taps.begin() + t * 3 * kHidden + kHidden)),
              1e-5)
        << "token " << t;
  }
  // One past it is refused, naming the field.
  absl::StatusOr<VerifyOutcome> bad = Step(target.get(), 1, {ids[0]}, {}, {final_tap + 1});
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("tap_layers"));
}

TEST(EagleTapsTest, VerifyStepTapsAreTheBitsOfAPrefillOfTheSamePath) {
  std::unique_ptr<Backend> target = LoadTarget();
  ASSERT_NE(target, nullptr);
  const std::vector<int32_t> ids = Ids();
  const std::vector<int32_t> prompt(ids.begin(), ids.begin() + 10);
  // The greedy continuation, decoded without taps.
  ASSERT_TRUE(target->AddSequence(9).ok());
  std::vector<int32_t> greedy;
  std::vector<int32_t> pending = prompt;
  for (int i = 0; i < 5; ++i) {
    absl::StatusOr<VerifyOutcome> o = Step(target.get(), 9, pending, {}, {});
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_TRUE(o->taps.empty());
    greedy.push_back(o->tokens[0]);
    pending = {o->tokens[0]};
  }
  // Sequence 1: prefill, then one step whose tree holds the greedy path (three nodes) beside a
  // wrong sibling, taps asked for in a non-increasing order.
  const std::vector<int> order = {6, 1, 8};
  ASSERT_TRUE(target->AddSequence(1).ok());
  ASSERT_TRUE(Step(target.get(), 1, prompt, {}, {}).ok());
  TokenTree tree;
  tree.tokens = {(greedy[1] + 1) % 256, greedy[1], greedy[2], greedy[3]};
  tree.parents = {-1, -1, 1, 2};
  absl::StatusOr<VerifyOutcome> step = Step(target.get(), 1, {greedy[0]}, tree, order);
  ASSERT_TRUE(step.ok()) << step.status();
  ASSERT_EQ(step->accepted_draft, 3);
  ASSERT_EQ(step->taps.size(), 4u * order.size() * kHidden);  // the root and three accepted

  // Sequence 2: the same tokens as one prefill chain.
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), greedy.begin(), greedy.begin() + 4);
  ASSERT_TRUE(target->AddSequence(2).ok());
  absl::StatusOr<VerifyOutcome> chain = Step(target.get(), 2, all, {}, order);
  ASSERT_TRUE(chain.ok()) << chain.status();
  ASSERT_EQ(chain->taps.size(), all.size() * order.size() * kHidden);
  const size_t row = order.size() * kHidden;
  EXPECT_EQ(std::memcmp(step->taps.data(), chain->taps.data() + prompt.size() * row,
                        4 * row * sizeof(float)),
            0);
  // Column blocks follow tap_layers' order: tap 1 (second block) matches the reference.
  const std::vector<float> want = OracleTaps();
  const std::vector<double> ref(want.begin(), want.begin() + kHidden);  // token 0, tap 1
  EXPECT_LT(RelError(absl::MakeConstSpan(chain->taps).subspan(kHidden, kHidden), ref), 1e-5);
}

TEST(EagleTapsTest, TensorParallelRanksSendTheWholeStream) {
  BackendOptions options;
  options.num_threads = 1;
  options.tensor_parallel = 2;
  absl::StatusOr<std::unique_ptr<Backend>> tp =
      CreateBackend((FixtureDir() / "target").string(), options);
  ASSERT_TRUE(tp.ok()) << tp.status();
  ASSERT_TRUE((*tp)->verify_features().taps);
  const std::vector<int32_t> ids = Ids();
  const std::vector<float> want = OracleTaps();
  ASSERT_TRUE((*tp)->AddSequence(1).ok());
  absl::StatusOr<VerifyOutcome> o = Step(tp->get(), 1, ids, {}, kTaps);
  ASSERT_TRUE(o.ok()) << o.status();
  ASSERT_EQ(o->taps.size(), want.size());
  for (size_t t = 0; t < ids.size(); ++t) {
    const std::vector<double> ref(want.begin() + t * 3 * kHidden,
                                  want.begin() + (t + 1) * 3 * kHidden);
    EXPECT_LT(RelError(absl::MakeConstSpan(o->taps).subspan(t * 3 * kHidden, 3 * kHidden), ref),
              1e-5)
        << "token " << t;
  }
}

TEST(EagleTapsTest, BadTapLayersAreInvalidArgument) {
  std::unique_ptr<Backend> target = LoadTarget();
  ASSERT_NE(target, nullptr);
  ASSERT_TRUE(target->AddSequence(1).ok());
  // 10: past the final-norm tap (9) of the 8-layer target.
  for (const std::vector<int>& bad : {std::vector<int>{10}, {-1}, {2, 2}}) {
    absl::StatusOr<VerifyOutcome> o = Step(target.get(), 1, {1, 2}, {}, bad);
    ASSERT_FALSE(o.ok());
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(o.status().message(), HasSubstr("tap_layers"));
  }
  EXPECT_EQ(target->CommittedLength(1).value_or(-1), 0);
}

// An EAGLE-1/2 head reads tap num_layers + 1: its drafter, fed the rows a verify step of the
// target returns for that tap, drafts, and its first level is the head's own top-k of its chain
// fed the reference's final_hidden (the same feature, computed by the oracle).
TEST(EagleTapsTest, AnEagleOneTwoDrafterDraftsFromTheFinalNormTap) {
  std::unique_ptr<Backend> target = LoadTarget();
  ASSERT_NE(target, nullptr);
  EagleHeadOptions options;
  options.num_threads = 1;
  std::unique_ptr<EagleHead> heads[2];
  for (std::unique_ptr<EagleHead>& h : heads) {
    absl::StatusOr<std::unique_ptr<EagleHead>> head = CreateEagleHead(
        (FixtureDir() / "eagle1_head").string(), (FixtureDir() / "target").string(), options);
    ASSERT_TRUE(head.ok()) << head.status();
    h = *std::move(head);
  }
  ASSERT_EQ(heads[0]->config().taps, std::vector<int>{FinalNormTap(8)});
  EagleDrafter drafter(heads[0].get());
  EXPECT_EQ(drafter.tap_layers(), std::vector<int>{FinalNormTap(8)});

  // The prefill of 12 prompt tokens: its tap rows and the bonus token.
  const std::vector<int32_t> ids = Ids();
  const std::vector<int32_t> prompt(ids.begin(), ids.begin() + 12);
  ASSERT_TRUE(target->AddSequence(1).ok());
  absl::StatusOr<VerifyOutcome> o = Step(target.get(), 1, prompt, {}, drafter.tap_layers());
  ASSERT_TRUE(o.ok()) << o.status();
  ASSERT_EQ(o->taps.size(), 12u * kHidden);
  std::vector<int32_t> tokens = prompt;
  tokens.push_back(o->tokens.back());
  ASSERT_TRUE(drafter.AddSequence(1).ok());
  DraftRequest r;
  r.seq = 1;
  r.new_tokens = tokens;
  r.params = DraftParams{2, 3, 6};
  r.taps = o->taps;
  absl::StatusOr<std::vector<TokenTree>> trees = drafter.Draft({r});
  ASSERT_TRUE(trees.ok()) << trees.status();
  const TokenTree& tree = (*trees)[0];
  ASSERT_FALSE(tree.empty());
  EXPECT_EQ(drafter.committed(1), 12);

  // The reference chain: pairs (final_hidden p, token p + 1), p < 12, on the second head.
  absl::StatusOr<std::unique_ptr<TensorStore>> store =
      TensorStore::OpenFolder(FixtureDir().string());
  ASSERT_TRUE(store.ok()) << store.status();
  std::vector<float> final_hidden(16 * kHidden);
  ASSERT_TRUE((*store)->ReadF32("final_hidden", {16, kHidden}, final_hidden.data()).ok());
  ASSERT_TRUE(heads[1]->AddSequence(1).ok());
  EagleHeadItem chain;
  chain.seq = 1;
  chain.tokens.assign(tokens.begin() + 1, tokens.end());
  chain.parents.resize(12);
  std::iota(chain.parents.begin(), chain.parents.end(), -1);
  chain.inputs = absl::MakeConstSpan(final_hidden).first(12 * kHidden);
  chain.output_rows = {11};
  EagleHeadOutputs out;
  ASSERT_TRUE(heads[1]->Forward({chain}, &out).ok());
  std::vector<int32_t> top(3);
  std::vector<float> lp(3);
  RowTopKLogprobs(out.logits, 3, top.data(), lp.data());
  std::vector<int32_t> level1;
  for (int i = 0; i < tree.size(); ++i) {
    if (tree.parents[i] == -1) level1.push_back(tree.tokens[i]);
  }
  EXPECT_EQ(level1, top);
}

class EagleDrafterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    EagleHeadOptions options;
    options.num_threads = 1;
    for (std::unique_ptr<EagleHead>* h : {&head_, &reference_}) {
      absl::StatusOr<std::unique_ptr<EagleHead>> head = CreateEagleHead(
          (FixtureDir() / "eagle3_head").string(), (FixtureDir() / "target").string(), options);
      ASSERT_TRUE(head.ok()) << head.status();
      *h = *std::move(head);
    }
    drafter_ = std::make_unique<EagleDrafter>(head_.get());
    ids_ = Ids();
    taps_ = OracleTaps();
  }

  DraftRequest Request(SeqId seq, std::vector<int32_t> tokens, int taps_from, int taps_to) {
    DraftRequest r;
    r.seq = seq;
    r.new_tokens = std::move(tokens);
    r.params = DraftParams{3, 3, 8};
    r.taps.assign(taps_.begin() + taps_from * 3 * kHidden, taps_.begin() + taps_to * 3 * kHidden);
    r.taps_first_position = taps_from;
    return r;
  }

  std::unique_ptr<EagleHead> head_, reference_;
  std::unique_ptr<EagleDrafter> drafter_;
  std::vector<int32_t> ids_;
  std::vector<float> taps_;
};

TEST_F(EagleDrafterTest, DraftsFromTheTargetTapsOnceTheyCoverTheSequence) {
  ASSERT_TRUE(drafter_->AddSequence(1).ok());
  // First step: the prompt, no taps yet (no verify step has run): nothing to propose.
  const std::vector<int32_t> prompt(ids_.begin(), ids_.begin() + 12);
  absl::StatusOr<std::vector<TokenTree>> t = drafter_->Draft({Request(1, prompt, 0, 0)});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE((*t)[0].empty());
  EXPECT_EQ(drafter_->committed(1), 0);

  // The prefill's taps and its bonus token: pairs (taps p, token p + 1) for p < 12.
  t = drafter_->Draft({Request(1, {ids_[12]}, 0, 12)});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(drafter_->committed(1), 12);
  const TokenTree& tree = (*t)[0];
  ASSERT_FALSE(tree.empty());
  EXPECT_LE(tree.size(), 8);
  EXPECT_LE(TreeMaxDepth(tree), 3);

  // The first level is the head's top 3 over the draft vocabulary, mapped by d2t, best first.
  ASSERT_TRUE(reference_->AddSequence(1).ok());
  EagleHeadItem chain;
  chain.seq = 1;
  chain.tokens.assign(ids_.begin() + 1, ids_.begin() + 13);
  chain.parents.resize(12);
  std::iota(chain.parents.begin(), chain.parents.end(), -1);
  chain.inputs = absl::MakeConstSpan(taps_).first(12 * 3 * kHidden);
  chain.output_rows = {11};
  EagleHeadOutputs out;
  ASSERT_TRUE(reference_->Forward({chain}, &out).ok());
  const int dv = head_->config().draft_vocab_size;
  std::vector<int32_t> top(3);
  std::vector<float> lp(3);
  RowTopKLogprobs(out.logits, 3, top.data(), lp.data());
  std::vector<int32_t> level1;
  std::vector<float> level1_lp;
  for (int i = 0; i < tree.size(); ++i) {
    if (tree.parents[i] == -1) {
      level1.push_back(tree.tokens[i]);
      level1_lp.push_back(tree.draft_logprobs[i]);
    }
  }
  ASSERT_EQ(level1.size(), 3u);
  for (int j = 0; j < 3; ++j) {
    EXPECT_EQ(level1[j], head_->draft_to_target()[top[j]]);
    EXPECT_EQ(level1_lp[j], lp[j]);
  }
  EXPECT_EQ(static_cast<int>(out.logits.size()), dv);
  // Nothing but the target's pairs stays in the head's KV.
  EXPECT_EQ(head_->Usage().used_tokens, 12);

  // A verify step that accepted one token and sampled a bonus: taps of rows 12 and 13 (a resend
  // of row 11 is skipped).
  t = drafter_->Draft({Request(1, {ids_[13], ids_[14]}, 11, 14)});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(drafter_->committed(1), 14);
  EXPECT_FALSE((*t)[0].empty());
}

// Rows the verify service dropped (held past its bound) leave a gap after the head's pairs: the
// head restarts from the rows after it, drafting what a head fed only those rows drafts.
TEST_F(EagleDrafterTest, AGapInTheTapsRestartsTheHeadAfterItAndBadTapsAreRefused) {
  ASSERT_TRUE(drafter_->AddSequence(1).ok());
  const std::vector<int32_t> prompt(ids_.begin(), ids_.begin() + 13);
  absl::StatusOr<std::vector<TokenTree>> t = drafter_->Draft({Request(1, prompt, 0, 12)});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_FALSE((*t)[0].empty());
  EXPECT_EQ(drafter_->committed(1), 12);
  // Row 12 never arrives; rows 13 and 14 do.
  t = drafter_->Draft({Request(1, {ids_[13], ids_[14], ids_[15]}, 13, 15)});
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_FALSE((*t)[0].empty());
  EXPECT_EQ(drafter_->committed(1), 15);
  EXPECT_EQ(head_->CommittedLength(1).value_or(-1), 2);
  EagleDrafter fresh(reference_.get());
  ASSERT_TRUE(fresh.AddSequence(1).ok());
  const std::vector<int32_t> history(ids_.begin(), ids_.begin() + 16);
  absl::StatusOr<std::vector<TokenTree>> want = fresh.Draft({Request(1, history, 13, 15)});
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ((*t)[0].tokens, (*want)[0].tokens);
  EXPECT_EQ((*t)[0].parents, (*want)[0].parents);

  DraftRequest bad = Request(1, {ids_[13]}, 0, 1);
  bad.taps.pop_back();
  absl::Status s = drafter_->CheckRequest(bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("taps"));
  EXPECT_FALSE(drafter_->Draft({bad}).ok());
}

// A sequence the router stopped drafting for a few steps (the verify service held their taps)
// and drafts again: all the held rows and tokens at once give the tree that feeding them every
// step gives.
TEST_F(EagleDrafterTest, HeldTapsFedAtOnceDraftWhatTapsFedEveryStepDraft) {
  EagleDrafter every(reference_.get());
  const std::vector<int32_t> prompt(ids_.begin(), ids_.begin() + 9);
  for (EagleDrafter* d : {drafter_.get(), &every}) {
    ASSERT_TRUE(d->AddSequence(1).ok());
    ASSERT_TRUE(d->Draft({Request(1, prompt, 0, 0)}).ok());
    ASSERT_TRUE(d->Draft({Request(1, {ids_[9]}, 0, 9)}).ok());
  }
  absl::StatusOr<std::vector<TokenTree>> step;
  for (int p = 10; p <= 15; ++p) {
    step = every.Draft({Request(1, {ids_[p]}, p - 1, p)});
    ASSERT_TRUE(step.ok()) << step.status();
  }
  const std::vector<int32_t> held(ids_.begin() + 10, ids_.begin() + 16);
  absl::StatusOr<std::vector<TokenTree>> resumed = drafter_->Draft({Request(1, held, 9, 15)});
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(drafter_->committed(1), 15);
  EXPECT_EQ(every.committed(1), 15);
  ASSERT_FALSE((*resumed)[0].empty());
  EXPECT_EQ((*resumed)[0].tokens, (*step)[0].tokens);
  EXPECT_EQ((*resumed)[0].parents, (*step)[0].parents);
  ASSERT_EQ((*resumed)[0].draft_logprobs.size(), (*step)[0].draft_logprobs.size());
  for (size_t i = 0; i < (*step)[0].draft_logprobs.size(); ++i) {
    EXPECT_NEAR((*resumed)[0].draft_logprobs[i], (*step)[0].draft_logprobs[i], 1e-4) << i;
  }
}

// A draft service that takes a running sequence over (it was restarted): the whole history, and
// taps only from where the verify service started sending them again. The head starts there.
TEST_F(EagleDrafterTest, TakesARunningSequenceOverFromWhereItsTapsBegin) {
  ASSERT_TRUE(drafter_->AddSequence(1).ok());
  const std::vector<int32_t> history(ids_.begin(), ids_.begin() + 15);
  absl::StatusOr<std::vector<TokenTree>> t = drafter_->Draft({Request(1, history, 12, 15)});
  ASSERT_TRUE(t.ok()) << t.status();
  // The pairs (taps 12, token 13) and (taps 13, token 14), at the head's positions 0 and 1.
  EXPECT_EQ(drafter_->committed(1), 14);
  EXPECT_EQ(head_->CommittedLength(1).value_or(-1), 2);
  const TokenTree& tree = (*t)[0];
  ASSERT_FALSE(tree.empty());
  // The first level is the head's top 3 after just those two pairs.
  ASSERT_TRUE(reference_->AddSequence(1).ok());
  EagleHeadItem chain;
  chain.seq = 1;
  chain.tokens = {ids_[13], ids_[14]};
  chain.parents = {-1, 0};
  chain.inputs = absl::MakeConstSpan(taps_).subspan(12 * 3 * kHidden, 2 * 3 * kHidden);
  chain.output_rows = {1};
  EagleHeadOutputs out;
  ASSERT_TRUE(reference_->Forward({chain}, &out).ok());
  std::vector<int32_t> top(3);
  std::vector<float> lp(3);
  RowTopKLogprobs(out.logits, 3, top.data(), lp.data());
  std::vector<int32_t> level1;
  for (int i = 0; i < tree.size(); ++i) {
    if (tree.parents[i] == -1) level1.push_back(tree.tokens[i]);
  }
  ASSERT_EQ(level1.size(), 3u);
  for (int j = 0; j < 3; ++j) EXPECT_EQ(level1[j], head_->draft_to_target()[top[j]]);
  // It goes on from there: the bonus token with the row already sent.
  t = drafter_->Draft({Request(1, {ids_[15]}, 14, 15)});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_FALSE((*t)[0].empty());
  EXPECT_EQ(drafter_->committed(1), 15);
  EXPECT_EQ(head_->CommittedLength(1).value_or(-1), 3);
}

}  // namespace
}  // namespace specd
