// engine/kv/paged_kv_table.h's options for owners of fixed pools (the CUDA backend): blocks
// sized up front and handed out lowest first, capacity errors as with geometric growth, and the
// mask fields of a layout only when asked for.
#include "engine/kv/paged_kv_table.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace specd {
namespace {

ForwardItem Chain(SeqId seq, int n) {
  ForwardItem f;
  f.seq = seq;
  for (int j = 0; j < n; ++j) {
    f.tokens.push_back(j);
    f.parents.push_back(j - 1);
  }
  return f;
}

TEST(PagedKvTableTest, UpFrontPoolsHandOutBlocksLowestFirst) {
  PagedKvTable grown(kKvBlockTokens, 10 * kKvBlockTokens, 1000, 1000);
  PagedKvTable up_front(kKvBlockTokens, 10 * kKvBlockTokens, 1000, 1000);
  up_front.AllocateUpFront();
  EXPECT_EQ(grown.allocated_blocks(), 0);
  EXPECT_EQ(up_front.allocated_blocks(), 10);
  EXPECT_EQ(up_front.capacity_blocks(), 10);
  // The same steps give the same block tables either way (blocks 0, 1, 2, ... in order, reused
  // last freed first), while only the growing table's pools grow.
  for (PagedKvTable* t : {&grown, &up_front}) {
    ASSERT_TRUE(t->AddSequence(1).ok());
    ASSERT_TRUE(t->AddSequence(2).ok());
  }
  std::vector<StepLayout> layouts(2);
  for (int i = 0; i < 2; ++i) {
    PagedKvTable& t = i == 0 ? grown : up_front;
    ASSERT_TRUE(t.PrepareForward({Chain(1, 40), Chain(2, 20)}, &layouts[i]).ok());
    std::vector<int64_t> src, dst;
    ASSERT_TRUE(t.PrepareCommit(1, {}, &src, &dst).ok());  // frees sequence 1's 3 blocks
    ASSERT_TRUE(t.PrepareForward({Chain(1, 17)}, &layouts[i]).ok());
  }
  EXPECT_EQ(layouts[0].block_tables, layouts[1].block_tables);
  EXPECT_EQ(layouts[1].block_tables, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(up_front.allocated_blocks(), 10);
  EXPECT_LT(grown.allocated_blocks(), 10);
  // Capacity errors read alike: 5 of 10 blocks are taken.
  StepLayout unused;
  const absl::Status a = grown.PrepareForward({Chain(2, 200)}, &unused);
  const absl::Status b = up_front.PrepareForward({Chain(2, 200)}, &unused);
  EXPECT_EQ(a.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(a, b);
}

TEST(PagedKvTableTest, MaskFieldsOnlyWhenAskedFor) {
  PagedKvTable plain(kKvBlockTokens, 1024, 100, 1000);
  PagedKvTable masked(kKvBlockTokens, 1024, 100, 1000);
  masked.SetMaskBits(256);
  StepLayout a, b;
  for (PagedKvTable* t : {&plain, &masked}) {
    ASSERT_TRUE(t->AddSequence(7).ok());
    std::vector<int64_t> src, dst;
    StepLayout l;
    ASSERT_TRUE(t->PrepareForward({Chain(7, 5)}, &l).ok());
    ASSERT_TRUE(t->PrepareCommit(7, {0, 1, 2}, &src, &dst).ok());
  }
  ForwardItem tree;
  tree.seq = 7;
  tree.tokens = {1, 2, 3, 4};
  tree.parents = {-1, 0, 0, 1};
  ASSERT_TRUE(plain.PrepareForward({tree}, &a).ok());
  ASSERT_TRUE(masked.PrepareForward({tree}, &b).ok());
  EXPECT_TRUE(a.committed.empty());
  EXPECT_TRUE(a.scratch_parents.empty());
  EXPECT_EQ(b.committed, (std::vector<int64_t>{3}));
  ASSERT_EQ(b.scratch_parents.size(), 1u);
  EXPECT_EQ(b.scratch_parents[0], (std::vector<int32_t>{-1, 0, 0, 1}));
  // The rest of the layout is the same.
  EXPECT_EQ(a.slots, b.slots);
  EXPECT_EQ(a.prefix_len, b.prefix_len);
  EXPECT_EQ(a.tree_keys, b.tree_keys);
}

}  // namespace
}  // namespace specd
