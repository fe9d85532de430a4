// WarmUpBackend on the CPU backend: the row counts that reach every GEMM row class, one
// forward each at those shapes, and a backend left as it was (no sequence, no KV, the same
// outputs afterwards); WarmUpDraftLevels likewise at the draft levels' shapes.
#include "engine/warmup.h"

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "engine/topk.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testutil/counting_backend.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

TEST(GemmClassWarmUpRowsTest, ReachesEveryClassOfBothSchemes) {
  // Classes ending at 2^j + 1: [1], [2, 17], [18, 33], ..., [514, 1024]; ending at 2^j: [1],
  // [2, 16], [17, 32], ..., [513, 1024]. Each list entry falls in a distinct class of each.
  EXPECT_THAT(GemmClassWarmUpRows(1024), ElementsAre(1, 2, 17, 33, 65, 129, 257, 513, 1024));
  EXPECT_THAT(GemmClassWarmUpRows(100), ElementsAre(1, 2, 17, 33, 65, 100));
  EXPECT_THAT(GemmClassWarmUpRows(16), ElementsAre(1, 2, 16));
  EXPECT_THAT(GemmClassWarmUpRows(1), ElementsAre(1));
  EXPECT_THAT(GemmClassWarmUpRows(0), IsEmpty());
}

class WarmUpBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("warmup_");
    RandomCheckpointSpec spec;
    spec.max_position_embeddings = 64;
    ASSERT_TRUE(WriteRandomCheckpoint(dir_, spec).ok());
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::unique_ptr<Backend> Load(int64_t capacity) {
    BackendOptions options;
    options.kv_capacity_tokens = capacity;
    options.num_threads = 1;
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(dir_, options);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? std::move(*b) : nullptr;
  }

  std::string dir_;
};

// Logits of a fixed prompt, every row.
std::vector<float> PromptLogits(Backend& b) {
  ForwardItem item;
  item.seq = 7;
  item.tokens = {5, 40, 300, 2, 17};
  item.parents = {-1, 0, 1, 2, 3};
  item.logit_rows = {0, 1, 2, 3, 4};
  std::vector<float> logits;
  EXPECT_TRUE(b.AddSequence(item.seq).ok());
  EXPECT_TRUE(b.Forward({item}, &logits).ok());
  EXPECT_TRUE(b.RemoveSequence(item.seq).ok());
  return logits;
}

TEST_F(WarmUpBackendTest, OneForwardPerRowCountWithinPositionsAndCapacity) {
  std::unique_ptr<Backend> model = Load(1 << 12);
  ASSERT_NE(model, nullptr);
  CountingBackend counted(model.get());
  // 100 and 1024 exceed the model's 64 positions and are left out.
  absl::StatusOr<WarmUpReport> report = WarmUpBackend(counted, {1, 17, 64, 100, 1024});
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_THAT(report->rows, ElementsAre(1, 17, 64));
  EXPECT_EQ(counted.calls(), 3);
  EXPECT_EQ(counted.tokens(), 1 + 17 + 64);
  EXPECT_GE(report->seconds, 0);
  const KvUsage usage = model->Usage();
  EXPECT_EQ(usage.sequences, 0);
  EXPECT_EQ(usage.used_tokens, 0);
}

TEST_F(WarmUpBackendTest, CapacityBoundsTheRowCounts) {
  std::unique_ptr<Backend> model = Load(20);
  ASSERT_NE(model, nullptr);
  absl::StatusOr<WarmUpReport> report = WarmUpBackend(*model, GemmClassWarmUpRows(1024));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_THAT(report->rows, ElementsAre(1, 2, 17));
}

TEST_F(WarmUpBackendTest, LeavesOutputsUnchanged) {
  std::unique_ptr<Backend> cold = Load(1 << 12);
  std::unique_ptr<Backend> warm = Load(1 << 12);
  ASSERT_NE(cold, nullptr);
  ASSERT_NE(warm, nullptr);
  ASSERT_TRUE(WarmUpBackend(*warm, GemmClassWarmUpRows(64)).ok());
  EXPECT_EQ(PromptLogits(*cold), PromptLogits(*warm));
}

TEST(DraftLevelWarmUpBatchesTest, PowersOfTwoThenTheLargest) {
  EXPECT_THAT(DraftLevelWarmUpBatches(64), ElementsAre(1, 2, 4, 8, 16, 32, 64));
  EXPECT_THAT(DraftLevelWarmUpBatches(20), ElementsAre(1, 2, 4, 8, 16, 20));
  EXPECT_THAT(DraftLevelWarmUpBatches(1), ElementsAre(1));
  EXPECT_THAT(DraftLevelWarmUpBatches(0), IsEmpty());
}

// The drafter's level shapes: per batch, `passes` trees of `depth` ForwardTopK calls (one chain
// token a sequence, then top_k children a sequence); batches whose trees do not fit the free KV
// are left out; the backend keeps no sequence and no KV, and its outputs are unchanged.
TEST_F(WarmUpBackendTest, DraftLevelsRunTheDrafterShapesAndLeaveNothing) {
  std::unique_ptr<Backend> model = Load(100);
  ASSERT_NE(model, nullptr);
  std::unique_ptr<Backend> cold = Load(100);
  ASSERT_NE(cold, nullptr);
  CountingBackend counted(model.get());
  DraftLevelWarmUp shape;
  // A tree is 1 + 3 * 4 = 13 tokens, a 16-token KV block a sequence: 8 of them do not fit 100.
  shape.batches = {1, 2, 4, 8};
  absl::StatusOr<WarmUpReport> report = WarmUpDraftLevels(counted, shape);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_THAT(report->rows, ElementsAre(1, 2, 4));
  // Passes x levels x the batches run, every token's row asked for; then the batch of 8's
  // first level, refused for want of KV.
  EXPECT_EQ(counted.calls(), 2 * 4 * 3 + 1);
  EXPECT_EQ(counted.tokens(), 2 * 13 * (1 + 2 + 4) + 8);
  const KvUsage usage = model->Usage();
  EXPECT_EQ(usage.sequences, 0);
  EXPECT_EQ(usage.used_tokens, 0);
  EXPECT_EQ(PromptLogits(*cold), PromptLogits(*model));

  shape.top_k = kMaxForwardTopK + 1;
  EXPECT_EQ(WarmUpDraftLevels(*model, shape).status().code(), absl::StatusCode::kInvalidArgument);
  shape.top_k = 4;
  shape.asked_k = kMaxForwardTopK + 1;
  EXPECT_EQ(WarmUpDraftLevels(*model, shape).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace specd
