// SplitForward's cuts (engine/chunked_forward.h) by hand, and ChunkedForward()/
// ChunkedForwardTopK() against one forward of the same batch on a real model.
#include "engine/chunked_forward.h"

#include <filesystem>
#include <numeric>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testutil/counting_backend.h"
#include "tests/testutil/random_checkpoint.h"

namespace specd {
namespace {

using ::testing::ElementsAre;

ForwardItem Chain(SeqId seq, int n, int first_parent, std::vector<int32_t> logit_rows) {
  ForwardItem item;
  item.seq = seq;
  for (int i = 0; i < n; ++i) {
    item.tokens.push_back(100 + i);
    item.parents.push_back(i == 0 ? first_parent : first_parent + i);
  }
  item.logit_rows = std::move(logit_rows);
  return item;
}

TEST(SplitForwardTest, PacksItemsAndCutsTheOnesThatDoNotFit) {
  // 5 + 2 + 6 tokens at 4 a forward: [a0-3] [a4 b0 b1 c0] [c1-4] [c5].
  const std::vector<ForwardItem> items = {Chain(1, 5, -1, {4, 1}), Chain(2, 2, 3, {0}),
                                          Chain(3, 6, -1, {5})};
  const std::vector<ForwardChunk> chunks = SplitForward(items, 4);
  ASSERT_EQ(chunks.size(), 4u);
  ASSERT_EQ(chunks[0].items.size(), 1u);
  EXPECT_THAT(chunks[0].items[0].tokens, ElementsAre(100, 101, 102, 103));
  EXPECT_THAT(chunks[0].items[0].parents, ElementsAre(-1, 0, 1, 2));
  // Row 1 of item a is the whole batch's row 1; row 4 is in the next piece.
  EXPECT_THAT(chunks[0].items[0].logit_rows, ElementsAre(1));
  EXPECT_THAT(chunks[0].out_rows, ElementsAre(1));
  ASSERT_EQ(chunks[1].items.size(), 3u);
  EXPECT_EQ(chunks[1].items[0].seq, 1);
  EXPECT_THAT(chunks[1].items[0].parents, ElementsAre(3));  // scratch indices stay absolute
  EXPECT_THAT(chunks[1].items[0].logit_rows, ElementsAre(0));
  EXPECT_THAT(chunks[1].items[1].parents, ElementsAre(3, 4));
  EXPECT_THAT(chunks[1].items[1].logit_rows, ElementsAre(0));
  // c's first piece holds none of its rows: it asks for its last, which is dropped.
  EXPECT_THAT(chunks[1].items[2].tokens, ElementsAre(100));
  EXPECT_THAT(chunks[1].items[2].logit_rows, ElementsAre(0));
  EXPECT_THAT(chunks[1].out_rows, ElementsAre(0, 2, -1));
  EXPECT_THAT(chunks[2].items[0].parents, ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(chunks[2].out_rows, ElementsAre(-1));
  EXPECT_THAT(chunks[3].items[0].tokens, ElementsAre(105));
  EXPECT_THAT(chunks[3].items[0].parents, ElementsAre(4));
  EXPECT_THAT(chunks[3].out_rows, ElementsAre(3));
  for (const ForwardChunk& chunk : chunks) {
    int64_t rows = 0;
    for (const ForwardItem& it : chunk.items) rows += static_cast<int64_t>(it.tokens.size());
    EXPECT_LE(rows, 4);
  }
}

TEST(SplitForwardTest, NoLimitOrFittingIsOneForward) {
  const std::vector<ForwardItem> items = {Chain(1, 5, -1, {4, 1}), Chain(2, 2, -1, {1})};
  for (int64_t max_rows : {int64_t{0}, int64_t{-1}, int64_t{7}, int64_t{1024}}) {
    const std::vector<ForwardChunk> chunks = SplitForward(items, max_rows);
    ASSERT_EQ(chunks.size(), 1u);
    EXPECT_EQ(chunks[0].items.size(), 2u);
    EXPECT_THAT(chunks[0].out_rows, ElementsAre(0, 1, 2));
  }
  EXPECT_TRUE(SplitForward({}, 4).empty());
}

class ChunkedForwardTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(MakeTempDir("specd_chunked_forward_"));
    RandomCheckpointSpec spec;
    spec.vocab_size = 300;
    spec.hidden_size = 32;
    spec.intermediate_size = 64;
    spec.num_layers = 2;
    spec.num_heads = 4;
    spec.num_kv_heads = 2;
    spec.init_std = 0.3f;
    spec.seed = 30;
    ASSERT_TRUE(WriteRandomCheckpoint(*dir_, spec).ok());
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    std::filesystem::remove_all(*dir_, ec);
    delete dir_;
  }
  static std::string* dir_;
};

std::string* ChunkedForwardTest::dir_ = nullptr;

// A batch of two chains and a tree hanging from a chain (rows asked out of order), fed whole and
// in pieces of 1, 2, 5 and 8 tokens: the same logits and top-k, bit for bit, and the same KV
// afterwards (the next forward's logits agree too).
TEST_F(ChunkedForwardTest, SameLogitsAsOneForward) {
  std::mt19937 rng(3);
  ForwardItem a = Chain(1, 11, -1, {10, 0, 4});
  ForwardItem b = Chain(2, 3, -1, {2});
  ForwardItem c = Chain(3, 6, -1, {});
  // A tree below c's chain: two children of node 5, one grandchild.
  c.tokens.insert(c.tokens.end(), {7, 8, 9});
  c.parents.insert(c.parents.end(), {5, 5, 6});
  c.logit_rows = {8, 6, 7};
  for (ForwardItem* it : {&a, &b, &c}) {
    for (int32_t& t : it->tokens) t = static_cast<int32_t>(rng() % 300);
  }
  const std::vector<ForwardItem> items = {a, b, c};
  std::vector<float> want_logits, want_next;
  TopKRows want_top;
  for (int64_t max_rows : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{5}, int64_t{8}}) {
    SCOPED_TRACE(max_rows);
    absl::StatusOr<std::unique_ptr<Backend>> model = CreateBackend(*dir_, BackendOptions());
    ASSERT_TRUE(model.ok()) << model.status();
    CountingBackend counter(model->get());
    for (SeqId s : {1, 2, 3}) ASSERT_TRUE(counter.AddSequence(s).ok());
    std::vector<float> logits, next;
    ASSERT_TRUE(ChunkedForward(counter, items, max_rows, &logits).ok());
    if (max_rows > 0) EXPECT_LE(counter.max_rows(), max_rows);
    // Keep a's chain and c's chain plus node 7; the next token sees exactly that KV.
    std::vector<int32_t> a_path(11), c_path(6);
    std::iota(a_path.begin(), a_path.end(), 0);
    std::iota(c_path.begin(), c_path.end(), 0);
    c_path.push_back(7);
    ASSERT_TRUE(counter.Commit(1, a_path).ok());
    ASSERT_TRUE(counter.Commit(3, c_path).ok());
    std::vector<ForwardItem> after = {Chain(1, 1, -1, {0}), Chain(3, 1, -1, {0})};
    for (ForwardItem& it : after) it.tokens = {5};
    ASSERT_TRUE(counter.Forward(after, &next).ok());
    // Top-k of the same batch on fresh sequences.
    for (SeqId s : {1, 2, 3}) ASSERT_TRUE(counter.RemoveSequence(s).ok());
    for (SeqId s : {1, 2, 3}) ASSERT_TRUE(counter.AddSequence(s).ok());
    TopKRows top;
    ASSERT_TRUE(ChunkedForwardTopK(counter, items, 5, max_rows, &top).ok());
    ASSERT_EQ(top.rows(), 7);
    if (max_rows == 0) {
      want_logits = logits;
      want_next = next;
      want_top = top;
      continue;
    }
    EXPECT_EQ(logits, want_logits);
    EXPECT_EQ(next, want_next);
    EXPECT_EQ(top.ids, want_top.ids);
    EXPECT_EQ(top.logprobs, want_top.logprobs);
  }
}

}  // namespace
}  // namespace specd
