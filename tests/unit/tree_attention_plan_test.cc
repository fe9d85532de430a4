// PlanTreeAttention and its helpers (specd/kernels/cuda/tree_attention_plan.h): how a batch is cut
// into the MMA kernel's tiles and whether and how its key range is split over CTAs. Host code,
// so these run on every machine; tests/gpu/tree_attention_cuda_test.cc runs the plans on a GPU.
#include "specd/kernels/cuda/tree_attention_plan.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace specd {
namespace {

// Tiles must cover [0, num_queries) in order, each inside one sequence and at most `per_tile`
// queries long.
void ExpectTilesCover(const cuda::TreeAttentionPlan& plan, const std::vector<int32_t>& query_seq,
                      int per_tile) {
  ASSERT_EQ(plan.tile_begin.size(), plan.tile_end.size());
  ASSERT_FALSE(plan.tile_begin.empty());
  int32_t next = 0;
  for (size_t i = 0; i < plan.tile_begin.size(); ++i) {
    EXPECT_EQ(plan.tile_begin[i], next) << "tile " << i;
    EXPECT_GT(plan.tile_end[i], plan.tile_begin[i]) << "tile " << i;
    EXPECT_LE(plan.tile_end[i] - plan.tile_begin[i], per_tile) << "tile " << i;
    for (int32_t q = plan.tile_begin[i]; q < plan.tile_end[i]; ++q) {
      EXPECT_EQ(query_seq[q], query_seq[plan.tile_begin[i]]) << "tile " << i << " query " << q;
    }
    next = plan.tile_end[i];
  }
  EXPECT_EQ(next, static_cast<int32_t>(query_seq.size()));
}

TEST(TreeAttentionPlanTest, TilesFollowSequencesAndTheTileRows) {
  // Three sequences of 5, 40 and 3 queries; group 4 (32 heads over 8 KV heads): 64 / 4 = 16
  // queries a tile, and no tile spans two sequences.
  std::vector<int32_t> query_seq, kv_end;
  for (int s = 0; s < 3; ++s) {
    const int n = s == 0 ? 5 : (s == 1 ? 40 : 3);
    for (int i = 0; i < n; ++i) {
      query_seq.push_back(s);
      kv_end.push_back(100 + i);
    }
  }
  const int64_t nq = static_cast<int64_t>(query_seq.size());
  const cuda::TreeAttentionPlan plan =
      cuda::PlanTreeAttention(query_seq.data(), kv_end.data(), nq, 32, 8, 132);
  ExpectTilesCover(plan, query_seq, 16);
  EXPECT_EQ(plan.tile_begin, (std::vector<int32_t>{0, 5, 21, 37, 45}));
  // Group 1 (MHA): 64 queries a tile, so one per sequence. Group 64: one query a tile.
  ExpectTilesCover(cuda::PlanTreeAttention(query_seq.data(), kv_end.data(), nq, 8, 8, 132),
                   query_seq, cuda::kTreeAttentionTileRows);
  EXPECT_EQ(cuda::PlanTreeAttention(query_seq.data(), kv_end.data(), nq, 8, 8, 132).tile_begin,
            (std::vector<int32_t>{0, 5, 45}));
  EXPECT_EQ(
      cuda::PlanTreeAttention(query_seq.data(), kv_end.data(), nq, 64, 1, 132).tile_begin.size(),
      query_seq.size());
}

TEST(TreeAttentionPlanTest, EdgeCasesGiveAnEmptyOrTrivialPlan) {
  const std::vector<int32_t> query_seq(4, 0), kv_end(4, 10);
  EXPECT_TRUE(
      cuda::PlanTreeAttention(query_seq.data(), kv_end.data(), 0, 8, 2, 132).tile_begin.empty())
      << "no queries";
  EXPECT_TRUE(
      cuda::PlanTreeAttention(query_seq.data(), kv_end.data(), 4, 8, 0, 132).tile_begin.empty())
      << "no KV heads";
  EXPECT_TRUE(
      cuda::PlanTreeAttention(query_seq.data(), kv_end.data(), 4, 8, 3, 132).tile_begin.empty())
      << "3 KV heads do not divide 8";
  EXPECT_TRUE(
      cuda::PlanTreeAttention(query_seq.data(), kv_end.data(), 4, 8, 2, -1, 132).tile_begin.empty())
      << "negative kv_group";
  // One short query: one tile, one chunk, nothing to split.
  const cuda::TreeAttentionPlan one =
      cuda::PlanTreeAttention(query_seq.data(), kv_end.data(), 1, 8, 2, 132);
  EXPECT_EQ(one.tile_begin, (std::vector<int32_t>{0}));
  EXPECT_EQ(one.tile_end, (std::vector<int32_t>{1}));
  EXPECT_EQ(one.num_splits, 1);
  EXPECT_EQ(one.chunks_per_cta, 1);
  // Queries with no keys at all: no chunk, no split.
  const std::vector<int32_t> empty_keys(4, 0);
  EXPECT_EQ(cuda::PlanTreeAttention(query_seq.data(), empty_keys.data(), 4, 8, 2, 132).num_splits,
            1);
}

TEST(TreeAttentionPlanTest, ChunkCountsAndWorkspace) {
  static_assert(cuda::kTreeAttentionChunkKeys == 256, "the counts below");
  EXPECT_EQ(cuda::TreeAttentionChunks(-1), 0);
  EXPECT_EQ(cuda::TreeAttentionChunks(0), 0);
  EXPECT_EQ(cuda::TreeAttentionChunks(1), 1);
  EXPECT_EQ(cuda::TreeAttentionChunks(256), 1);
  EXPECT_EQ(cuda::TreeAttentionChunks(257), 2);
  EXPECT_EQ(cuda::TreeAttentionChunks(8192), 32);
  // Chunk states: head_dim partial outputs plus (m, l) per (split, query, head).
  EXPECT_EQ(cuda::TreeAttentionWorkspaceFloats(1, 5, 6, 128), 0) << "unsplit";
  EXPECT_EQ(cuda::TreeAttentionWorkspaceFloats(9, 5, 6, 128), int64_t{9} * 5 * 6 * 130);
  EXPECT_EQ(cuda::TreeAttentionWorkspaceFloats(9, 5, 6, 96), 0) << "the generic kernel";
}

TEST(TreeAttentionPlanTest, HeadSizes) {
  EXPECT_FALSE(cuda::TreeAttentionHeadDimSupported(0));
  EXPECT_FALSE(cuda::TreeAttentionHeadDimSupported(7));
  EXPECT_FALSE(cuda::TreeAttentionHeadDimSupported(cuda::kTreeAttentionMaxHeadDim + 2));
  int mma = 0;
  for (int hd = 2; hd <= cuda::kTreeAttentionMaxHeadDim; hd += 2) {
    EXPECT_TRUE(cuda::TreeAttentionHeadDimSupported(hd)) << hd;
    if (cuda::TreeAttentionUsesMmaKernel(hd)) ++mma;
  }
  EXPECT_EQ(mma, 4);  // 16, 32, 64, 128
  EXPECT_TRUE(cuda::TreeAttentionUsesMmaKernel(128));
  EXPECT_FALSE(cuda::TreeAttentionUsesMmaKernel(256));
}

// A single decode token at a long context leaves the SMs idle unsplit (8 CTAs), so it splits
// into every chunk; the same token with many sequences beside it fills the GPU and does not.
TEST(TreeAttentionPlanTest, DecodeSplitsWhenTheGpuWouldIdle) {
  const std::vector<int32_t> one_seq(1, 0), one_end(1, 4096);
  const cuda::TreeAttentionPlan plan =
      cuda::PlanTreeAttention(one_seq.data(), one_end.data(), 1, 32, 8, 132);
  EXPECT_EQ(plan.num_splits, 16);
  EXPECT_GE(plan.chunks_per_cta, 1);
  EXPECT_EQ(plan.chunks_per_cta, cuda::TreeAttentionChunksPerCta(1, 8, 16, 132));
  // With no multiprocessor count the cost model still answers (one resident slot pair).
  EXPECT_EQ(cuda::TreeAttentionChunksPerCta(1, 8, 16, 0), 1);
}

// The planner's chunks per CTA (host code: runs without a GPU too). One chunk a CTA while the
// split fits one wave (a decode step: 8 KV heads x 17 chunks = 136 CTAs on 132 SMs); 5 tiles x
// 8 KV heads x 17 chunks (680 CTAs, 2.6 waves) fold into one wave. With 256-key chunks a 64-node
// verify step at 2K keys has 9 chunks: 360 CTAs fold two chunks a CTA.
TEST(TreeAttentionPlanTest, ChunksPerCtaFoldsLongSplitsIntoFewerWaves) {
  EXPECT_EQ(cuda::TreeAttentionChunksPerCta(1, 8, 17, 132), 1);
  const int verify = cuda::TreeAttentionChunksPerCta(5, 8, 17, 132);
  EXPECT_EQ(verify, 3);
  EXPECT_LE(5 * 8 * ((17 + verify - 1) / verify), 2 * 132) << "one wave";
  EXPECT_EQ(cuda::TreeAttentionChunksPerCta(5, 8, 1, 132), 1) << "unsplit";
  EXPECT_EQ(cuda::TreeAttentionChunksPerCta(0, 8, 17, 132), 1) << "no tiles";
  for (int tiles : {1, 3, 9, 40}) {
    for (int splits : {2, 5, 17, 65}) {
      const int c = cuda::TreeAttentionChunksPerCta(tiles, 8, splits, 132);
      EXPECT_GE(c, 1);
      EXPECT_LE(c, splits);
    }
  }
  // PlanTreeAttention reports it for the split it picks.
  std::vector<int32_t> query_seq(65, 0), kv_end(65);
  for (int i = 0; i < 65; ++i) kv_end[i] = 2049 + i;
  const cuda::TreeAttentionPlan plan =
      cuda::PlanTreeAttention(query_seq.data(), kv_end.data(), 65, 32, 8, 132);
  ASSERT_EQ(plan.tile_begin.size(), 5u);
  static_assert(cuda::kTreeAttentionChunkKeys == 256, "the counts below");
  EXPECT_EQ(plan.num_splits, 9);  // keys up to 2049 + 64
  EXPECT_EQ(plan.chunks_per_cta, 2);
}

// Tiles that fill the SMs but not their resident slots still split when the waves of split CTAs
// take less than every CTA walking all chunks; enough tiles to fill the slots do not.
TEST(TreeAttentionPlanTest, SplitsWhenTheUnsplitLaunchLeavesSlotsIdle) {
  // A 256-node tree at context 2048 (queries: the pending token and the nodes), Llama-3.1-8B
  // heads: 17 tiles x 8 KV heads = 136 CTAs on 132 SMs, 10 chunks each unsplit.
  std::vector<int32_t> query_seq(257, 0), kv_end(257);
  for (int i = 0; i < 257; ++i) kv_end[i] = 2049 + i;
  cuda::TreeAttentionPlan plan =
      cuda::PlanTreeAttention(query_seq.data(), kv_end.data(), 257, 32, 8, 132);
  ASSERT_EQ(plan.tile_begin.size(), 17u);
  EXPECT_EQ(plan.num_splits, 10);     // keys up to 2049 + 256
  EXPECT_EQ(plan.chunks_per_cta, 2);  // 680 CTAs: 3 waves of 2 chunks instead of 1 of 10
  // 64 sequences decoding at context 2048: 512 CTAs, two waves of resident slots already.
  std::vector<int32_t> seqs(64), ends(64, 2048);
  for (int i = 0; i < 64; ++i) seqs[i] = i;
  plan = cuda::PlanTreeAttention(seqs.data(), ends.data(), 64, 32, 8, 132);
  ASSERT_EQ(plan.tile_begin.size(), 64u);
  EXPECT_EQ(plan.num_splits, 1);
  // 256 nodes at 8192 keys split (34 chunks: 36 M workspace floats); at 16384 keys the
  // workspace would pass its cap (66 chunks, 71 M floats), so the launch stays unsplit.
  for (int i = 0; i < 257; ++i) kv_end[i] = 8193 + i;
  plan = cuda::PlanTreeAttention(query_seq.data(), kv_end.data(), 257, 32, 8, 132);
  EXPECT_EQ(plan.num_splits, 34);
  for (int i = 0; i < 257; ++i) kv_end[i] = 16385 + i;
  plan = cuda::PlanTreeAttention(query_seq.data(), kv_end.data(), 257, 32, 8, 132);
  EXPECT_EQ(plan.num_splits, 1);
}

}  // namespace
}  // namespace specd
