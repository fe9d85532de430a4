// engine/cuda/cuda_step_plan.h on the CPU: the CUDA-graph buckets, and the metadata a planned
// step hands the kernels, decoded from the packed buffer and checked against the KV model of
// engine/backend.h (each token sees the committed prefix and its own ancestors, sits at
// committed + depth and writes the slot its block table maps it to). tests/gpu runs the same
// plans on a GPU against the CPU backend.
#include "engine/cuda/cuda_step_plan.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "engine/cuda/tree_mask.h"
#include "gtest/gtest.h"
#include "specd/kernels/cuda/tree_attention_plan.h"

namespace specd {
namespace {

constexpr int64_t kBlock = 16;
constexpr int kWords = cuda::kTreeAttentionMaskWords;

template <typename T>
std::vector<T> Read(const StepPacker& pack, size_t offset, size_t n) {
  EXPECT_EQ(offset % 16, 0u);
  EXPECT_LE(offset + n * sizeof(T), pack.bytes().size());
  std::vector<T> out(n);
  if (n > 0) std::memcpy(out.data(), pack.bytes().data() + offset, n * sizeof(T));
  return out;
}

TEST(CudaStepPlanTest, TokenBucketsArePendingPlusAPowerOfTwo) {
  const std::vector<std::pair<int64_t, int64_t>> cases = {
      {1, 1}, {2, 2}, {3, 3}, {4, 5}, {5, 5}, {6, 9}, {65, 65}, {66, 129}, {257, 257}, {258, 513}};
  for (const auto& [n, bucket] : cases) EXPECT_EQ(TokenBucket(n), bucket) << n;
  EXPECT_EQ(NextPow2(0), 1);
  EXPECT_EQ(NextPow2(1), 1);
  EXPECT_EQ(NextPow2(33), 64);
}

TEST(CudaStepPlanTest, ChooseBucketsPadsBatchAndTokensOrRefuses) {
  CudaStep step;
  ASSERT_TRUE(ChooseBuckets({1, 5, 3}, &step));
  EXPECT_TRUE(step.padded);
  EXPECT_EQ(step.batch, 4);
  EXPECT_EQ(step.per_seq, 5);

  CudaStep decode;
  ASSERT_TRUE(ChooseBuckets(std::vector<int64_t>(kGraphMaxBatch, 1), &decode));
  EXPECT_EQ(decode.batch, kGraphMaxBatch);
  EXPECT_EQ(decode.per_seq, 1);

  CudaStep none;
  EXPECT_FALSE(ChooseBuckets({}, &none)) << "an empty step";
  EXPECT_FALSE(ChooseBuckets(std::vector<int64_t>(kGraphMaxBatch + 1, 1), &none)) << "too wide";
  EXPECT_FALSE(ChooseBuckets({kGraphMaxTreeTokens + 2}, &none)) << "too long a sequence";
  // 32 sequences of 257 token slots exceed kGraphMaxTokens: a prefill-sized step runs eagerly.
  EXPECT_FALSE(ChooseBuckets(std::vector<int64_t>(32, 257), &none));
  EXPECT_FALSE(none.padded);
}

// A sequence's scratch tree and block table, appended to as a backend's KV bookkeeping would.
struct Seq {
  int64_t committed = 0;
  std::vector<int32_t> parents, depth, blocks;
  // This step's nodes: depths and own spine ends.
  std::vector<int32_t> step_depth, step_spine;

  void Append(const ForwardItem& item, int32_t* next_block) {
    step_depth.clear();
    step_spine.clear();
    for (int32_t p : item.parents) {
      parents.push_back(p);
      depth.push_back(p < 0 ? 0 : depth[p] + 1);
      step_depth.push_back(depth.back());
      step_spine.push_back(SpineEnd(parents, depth, static_cast<int32_t>(parents.size() - 1)));
    }
    const int64_t tokens = committed + static_cast<int64_t>(parents.size());
    while (static_cast<int64_t>(blocks.size()) * kBlock < tokens) blocks.push_back((*next_block)++);
  }
  PlanItem Plan() const { return {committed, parents, step_depth, step_spine, blocks}; }
  // The keys of scratch node i by the KV model: the committed prefix, then its ancestors.
  std::vector<int64_t> Keys(int32_t i) const {
    std::vector<int64_t> keys;
    for (int64_t k = 0; k < committed; ++k) keys.push_back(k);
    for (int32_t x = i; x >= 0; x = parents[x]) keys.push_back(committed + x);
    std::sort(keys.begin(), keys.end());
    return keys;
  }
};

StepPlanOptions Options() {
  StepPlanOptions o;
  o.block_tokens = kBlock;
  o.hidden = 64;
  o.head_dim = 64;
  o.heads = 8;
  o.kv_heads = 2;
  o.kv_group = 4;
  o.num_sms = 132;
  return o;
}

// The keys the kernel reads for token t: [0, mask_begin) in full, then mask bits up to kv_end.
std::vector<int64_t> DecodeKeys(int32_t kv_end, int32_t mask_begin, const uint32_t* words) {
  std::vector<int64_t> keys;
  for (int64_t k = 0; k < mask_begin; ++k) keys.push_back(k);
  for (int bit = 0; bit < kWords * 32 && mask_begin + bit < kv_end; ++bit) {
    if (words[bit / 32] >> (bit % 32) & 1u) keys.push_back(mask_begin + bit);
  }
  return keys;
}

// Three items: a prefill chain on an empty sequence, a verify step (pending token and a random
// tree) after a committed prefix, and a decode token; laid out unpadded and padded.
class LayoutTest : public ::testing::TestWithParam<bool> {};

TEST_P(LayoutTest, MetadataFollowsTheKvModel) {
  const bool padded = GetParam();
  std::mt19937 rng(7);
  std::vector<Seq> seqs(3);
  seqs[1].committed = 37;
  seqs[2].committed = 5;
  std::vector<ForwardItem> items(3);
  for (int j = 0; j < 20; ++j) {
    items[0].tokens.push_back(100 + j);
    items[0].parents.push_back(j - 1);
  }
  items[0].logit_rows = {19};
  items[1].tokens = {7};
  items[1].parents = {-1};
  for (int j = 1; j < 24; ++j) {
    items[1].tokens.push_back(200 + j);
    items[1].parents.push_back(static_cast<int32_t>(rng() % j));
  }
  for (int j = 0; j < 24; ++j) items[1].logit_rows.push_back(j);
  items[2].tokens = {9};
  items[2].parents = {-1};
  items[2].logit_rows = {0};
  int32_t next_block = 3;  // blocks 0-2 belong to someone else
  std::vector<PlanItem> plan;
  for (size_t b = 0; b < items.size(); ++b) seqs[b].Append(items[b], &next_block);
  for (const Seq& s : seqs) plan.push_back(s.Plan());

  CudaStep step;
  if (padded) {
    ASSERT_TRUE(ChooseBuckets({20, 24, 1}, &step));
    EXPECT_EQ(step.batch, 4);
    EXPECT_EQ(step.per_seq, 33);
  }
  StepPacker pack;
  StepPlanOptions options = Options();
  options.custom_allreduce_max_bytes = padded ? 0 : 1 << 20;
  LayoutForward(items, plan, options, &step, &pack);
  const int64_t T = step.T;
  ASSERT_EQ(T, padded ? 4 * 33 : 45);
  ASSERT_EQ(step.R, padded ? 4 * 33 : 26);
  EXPECT_EQ(step.custom_allreduce, !padded) << "[T, hidden] bf16 against the custom buffers";
  EXPECT_TRUE(step.tree_masks);
  const auto tokens = Read<int32_t>(pack, step.o_tokens, T);
  const auto positions = Read<int32_t>(pack, step.o_positions, T);
  const auto query_seq = Read<int32_t>(pack, step.o_query_seq, T);
  const auto kv_end = Read<int32_t>(pack, step.o_kv_end, T);
  const auto mask_begin = Read<int32_t>(pack, step.o_mask_begin, T);
  const auto mask = Read<uint32_t>(pack, step.o_mask, T * kWords);
  const auto slots = Read<int64_t>(pack, step.o_slots, T);
  const auto tables = Read<int32_t>(pack, step.o_tables, step.batch * step.max_blocks);
  const auto rows = Read<int32_t>(pack, step.o_rows, step.R);
  const auto kv_stable = Read<int32_t>(pack, step.o_kv_stable, step.batch);
  if (padded) EXPECT_EQ(step.max_blocks, 8) << "a power of two, at least 8";

  int64_t t = 0, r = 0;
  for (size_t b = 0; b < items.size(); ++b) {
    const Seq& s = seqs[b];
    const int64_t n = static_cast<int64_t>(items[b].tokens.size());
    if (padded) {
      t = static_cast<int64_t>(b) * step.per_seq;
      r = t;
    }
    EXPECT_EQ(step.item_row_begin[b], r);
    EXPECT_EQ(step.item_token_begin[b], t);
    EXPECT_EQ(kv_stable[b], s.committed);
    for (size_t k = 0; k < s.blocks.size(); ++k) {
      EXPECT_EQ(tables[b * step.max_blocks + k], s.blocks[k]);
    }
    const int32_t first = static_cast<int32_t>(s.parents.size() - n);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t q = t + j;
      const int32_t index = first + static_cast<int32_t>(j);
      SCOPED_TRACE(testing::Message() << "item " << b << " token " << j);
      EXPECT_EQ(tokens[q], items[b].tokens[j]);
      EXPECT_EQ(query_seq[q], static_cast<int32_t>(b));
      EXPECT_EQ(positions[q], s.committed + s.depth[index]);
      const int64_t logical = s.committed + index;
      EXPECT_EQ(slots[q], s.blocks[logical / kBlock] * kBlock + logical % kBlock);
      EXPECT_EQ(kv_end[q], logical + 1);
      EXPECT_EQ(DecodeKeys(kv_end[q], mask_begin[q], &mask[q * kWords]), s.Keys(index));
    }
    for (size_t j = 0; j < items[b].logit_rows.size(); ++j) {
      EXPECT_EQ(rows[r + j], t + items[b].logit_rows[j]);
    }
    if (padded) {
      // Padding slots repeat the last real query and write no KV.
      for (int64_t j = n; j < step.per_seq; ++j) {
        EXPECT_EQ(slots[t + j], -1);
        EXPECT_EQ(kv_end[t + j], kv_end[t + n - 1]);
        EXPECT_EQ(mask_begin[t + j], mask_begin[t + n - 1]);
        EXPECT_EQ(query_seq[t + j], static_cast<int32_t>(b));
      }
    } else {
      t += n;
      r += static_cast<int64_t>(items[b].logit_rows.size());
    }
  }
  if (padded) {
    // The padding sequence: its own (zero) block-table row, no KV writes, rows at its start.
    for (int64_t j = 0; j < step.per_seq; ++j) {
      EXPECT_EQ(query_seq[3 * step.per_seq + j], 3);
      EXPECT_EQ(slots[3 * step.per_seq + j], -1);
      EXPECT_EQ(rows[3 * step.per_seq + j], 3 * step.per_seq);
    }
    for (int64_t k = 0; k < step.max_blocks; ++k) EXPECT_EQ(tables[3 * step.max_blocks + k], 0);
  }
  // The attention tiles cover every launched query in order.
  const auto tile_begin = Read<int32_t>(pack, step.o_tile_begin, step.num_tiles);
  const auto tile_end = Read<int32_t>(pack, step.o_tile_end, step.num_tiles);
  ASSERT_GT(step.num_tiles, 0);
  EXPECT_EQ(tile_begin.front(), 0);
  EXPECT_EQ(tile_end.back(), T);
  for (int64_t i = 1; i < step.num_tiles; ++i) EXPECT_EQ(tile_begin[i], tile_end[i - 1]);
  EXPECT_GE(step.ws_floats, 1);
  EXPECT_EQ(step.ws_floats, NextPow2(step.ws_floats));
}

INSTANTIATE_TEST_SUITE_P(UnpaddedAndPadded, LayoutTest, ::testing::Bool());

TEST(CudaStepPlanTest, SharedSpineKeepsTheKeysAndGivesOneMaskBegin) {
  // A breadth-first tree under a pending token: with the shared spine end every masked token of
  // the sequence starts its mask at the same key; without it, their own ends alternate.
  ForwardItem item;
  item.tokens = {1, 2, 3, 4, 5, 6, 7};
  item.parents = {-1, 0, 0, 1, 1, 2, 2};
  item.logit_rows = {0};
  for (bool shared : {false, true}) {
    Seq s;
    s.committed = 10;
    int32_t next_block = 0;
    s.Append(item, &next_block);
    const std::vector<PlanItem> plan = {s.Plan()};
    StepPlanOptions options = Options();
    options.shared_spine = shared;
    CudaStep step;
    StepPacker pack;
    LayoutForward({item}, plan, options, &step, &pack);
    const auto kv_end = Read<int32_t>(pack, step.o_kv_end, step.T);
    const auto mask_begin = Read<int32_t>(pack, step.o_mask_begin, step.T);
    const auto mask = Read<uint32_t>(pack, step.o_mask, step.T * kWords);
    std::set<int32_t> begins;
    for (int64_t t = 0; t < step.T; ++t) {
      EXPECT_EQ(DecodeKeys(kv_end[t], mask_begin[t], &mask[t * kWords]),
                s.Keys(static_cast<int32_t>(t)));
      if (mask_begin[t] != kv_end[t]) begins.insert(mask_begin[t]);
    }
    EXPECT_EQ(begins.size(), shared ? 1u : 2u) << "shared " << shared;
  }
}

TEST(CudaStepPlanTest, VerifyLayoutPacksTreesRowsAndOutputs) {
  // Two verify items (pending chains of 2 and 1 tokens, trees of 3 and 0 nodes) in a padded
  // step of 2 x 5 slots.
  std::vector<VerifyItem> items(2);
  items[0].pending = {11, 12};
  items[0].tree.tokens = {21, 22, 23};
  items[0].tree.parents = {-1, 0, -1};
  items[1].pending = {31};
  const std::vector<int64_t> committed = {40, 3};
  CudaStep step;
  step.verify = true;
  ASSERT_TRUE(ChooseBuckets({5, 1}, &step));
  step.T = step.R = step.batch * step.per_seq;
  step.item_row_begin = {0, step.per_seq};

  const std::vector<VerifyRow> rows = VerifyRows(items, committed, step);
  ASSERT_EQ(rows.size(), static_cast<size_t>(step.R));
  // Item 0: the last pending token's row draws position 42, node 0 and node 2 (depth 0) 43,
  // node 1 (depth 1) 44.
  const std::vector<int64_t> want0 = {42, 43, 44, 43};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(rows[i].item, 0);
    EXPECT_EQ(rows[i].position, want0[i]);
  }
  EXPECT_EQ(rows[4].item, -1) << "a padding row";
  EXPECT_EQ(rows[step.per_seq].item, 1);
  EXPECT_EQ(rows[step.per_seq].position, 4);
  for (int64_t i = step.per_seq + 1; i < step.R; ++i) EXPECT_EQ(rows[i].item, -1);

  StepPacker pack;
  LayoutVerify(items, committed, &step, &pack);
  EXPECT_EQ(step.out_stride, step.per_seq);
  const auto node_offset = Read<int32_t>(pack, step.o_node_offset, step.batch);
  const auto num_nodes = Read<int32_t>(pack, step.o_num_nodes, step.batch);
  const auto base_slot = Read<int32_t>(pack, step.o_base_slot, step.batch);
  const auto sample_offset = Read<int32_t>(pack, step.o_sample_offset, step.batch);
  const auto tree_tokens = Read<int32_t>(pack, step.o_tree_tokens, step.batch * step.per_seq);
  const auto tree_parents = Read<int32_t>(pack, step.o_tree_parents, step.batch * step.per_seq);
  EXPECT_EQ(node_offset, (std::vector<int32_t>{0, static_cast<int32_t>(step.per_seq)}));
  EXPECT_EQ(num_nodes, (std::vector<int32_t>{3, 0}));
  EXPECT_EQ(base_slot, (std::vector<int32_t>{42, 4}));
  EXPECT_EQ(sample_offset, (std::vector<int32_t>{0, static_cast<int32_t>(step.per_seq)}));
  EXPECT_EQ(std::vector<int32_t>(tree_tokens.begin(), tree_tokens.begin() + 3),
            (std::vector<int32_t>{21, 22, 23}));
  EXPECT_EQ(std::vector<int32_t>(tree_parents.begin(), tree_parents.begin() + 3),
            (std::vector<int32_t>{-1, 0, -1}));
  EXPECT_EQ(VerifyOutCount(step), static_cast<size_t>(step.batch * (1 + 2 * step.per_seq)));
  const auto out = Read<int32_t>(pack, step.o_out, VerifyOutCount(step));
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](int32_t v) { return v == 0; }));
  EXPECT_EQ(pack.bytes().size(), step.o_out + VerifyOutCount(step) * sizeof(int32_t));
}

TEST(CudaStepPlanTest, GraphKeysTellBucketsApartNotContents) {
  // Two decode steps of one bucket with different tokens and contexts share a key; a wider
  // batch does not.
  auto plan_decode = [](int items, int64_t committed, int32_t token, std::vector<int> taps = {}) {
    std::vector<ForwardItem> batch(items);
    std::vector<Seq> seqs(items);
    std::vector<PlanItem> plan;
    std::vector<int64_t> tokens;
    int32_t next_block = 0;
    for (int b = 0; b < items; ++b) {
      batch[b].seq = b;
      batch[b].tokens = {token};
      batch[b].parents = {-1};
      batch[b].logit_rows = {0};
      seqs[b].committed = committed;
      seqs[b].blocks.assign((committed + kBlock - 1) / kBlock, 0);
      for (int32_t& blk : seqs[b].blocks) blk = next_block++;
      seqs[b].Append(batch[b], &next_block);
      tokens.push_back(1);
    }
    for (const Seq& s : seqs) plan.push_back(s.Plan());
    CudaStep step;
    step.tap_layers = taps;
    EXPECT_TRUE(ChooseBuckets(tokens, &step));
    StepPacker pack;
    LayoutForward(batch, plan, Options(), &step, &pack);
    // Padded: sequence b's token rows start at b * per_seq.
    for (int b = 0; b < items; ++b) EXPECT_EQ(step.item_token_begin[b], b * step.per_seq);
    return CudaGraphKey(step);
  };
  EXPECT_EQ(plan_decode(3, 20, 5), plan_decode(4, 33, 9));
  EXPECT_NE(plan_decode(3, 20, 5), plan_decode(5, 20, 5));
  // A step that copies residual-stream taps replays a graph of its own layers.
  EXPECT_EQ(plan_decode(3, 20, 5, {1, 4}), plan_decode(4, 33, 9, {1, 4}));
  EXPECT_NE(plan_decode(3, 20, 5), plan_decode(3, 20, 5, {1, 4}));
  EXPECT_NE(plan_decode(3, 20, 5, {1, 4}), plan_decode(3, 20, 5, {4, 1}));
  EXPECT_NE(plan_decode(3, 20, 5, {1, 4}), plan_decode(3, 20, 5, {1, 4, 6}));
}

// A draft level's top-k runs inside the step's graph, so its k, its row count and where its row
// list sits are part of the key: a graph captured without the top-k (or with another k) must not
// replay a step that needs it.
TEST(CudaStepPlanTest, GraphKeysTellTopKLaunchesApart) {
  CudaStep plain;
  plain.padded = true;
  plain.batch = 4;
  plain.per_seq = 5;
  plain.T = plain.R = 20;
  CudaStep top = plain;
  top.topk_k = 4;
  top.topk_rows = 20;
  top.o_topk_rows = 512;
  EXPECT_NE(CudaGraphKey(plain), CudaGraphKey(top));
  for (auto change : {+[](CudaStep* s) { s->topk_k = 8; }, +[](CudaStep* s) { s->topk_rows = 16; },
                      +[](CudaStep* s) { s->o_topk_rows = 528; }}) {
    CudaStep other = top;
    change(&other);
    EXPECT_NE(CudaGraphKey(top), CudaGraphKey(other));
  }
  CudaStep same = top;
  EXPECT_EQ(CudaGraphKey(top), CudaGraphKey(same));
}

}  // namespace
}  // namespace specd

namespace specd {
namespace {

// The keys the CPU attention reads for token t of a PagedKvTable layout: the prefix run, then
// the listed ancestors.
std::vector<int64_t> CpuKeys(const StepLayout& l, int64_t t) {
  std::vector<int64_t> keys;
  for (int64_t k = 0; k < l.prefix_len[t]; ++k) keys.push_back(k);
  for (int32_t i = l.key_offsets[t]; i < l.key_offsets[t + 1]; ++i) keys.push_back(l.tree_keys[i]);
  return keys;
}

// PagedKvTable (as the CUDA backend configures it) and the planner together: a prefill, its
// commit, then a verify step with a random tree for two sequences; every token's mask decodes to
// exactly the keys the CPU backend's attention reads from the same layout, and its slot is the
// layout's.
TEST(CudaStepPlanTest, PlannedMasksReadTheKeysOfTheTableLayout) {
  for (bool padded : {false, true}) {
    SCOPED_TRACE(padded ? "padded" : "unpadded");
    PagedKvTable table(kKvBlockTokens, 64 * kKvBlockTokens, 1000, 4096);
    table.AllocateUpFront();
    table.SetMaskBits(cuda::kTreeAttentionMaskBits);
    std::mt19937 rng(11);
    std::vector<ForwardItem> step(2);
    for (int b = 0; b < 2; ++b) {
      ASSERT_TRUE(table.AddSequence(b).ok());
      step[b].seq = b;
      for (int j = 0; j < 21 + 17 * b; ++j) {
        step[b].tokens.push_back(j);
        step[b].parents.push_back(j - 1);
      }
    }
    StepLayout layout;
    ASSERT_TRUE(table.PrepareForward(step, &layout).ok());
    for (int b = 0; b < 2; ++b) {
      std::vector<int32_t> all(step[b].tokens.size());
      for (size_t j = 0; j < all.size(); ++j) all[j] = static_cast<int32_t>(j);
      std::vector<int64_t> src, dst;
      ASSERT_TRUE(table.PrepareCommit(b, all, &src, &dst).ok());
    }
    // Verify: a pending token, then a random tree of 40 nodes below it.
    for (int b = 0; b < 2; ++b) {
      ForwardItem& f = step[b];
      f.tokens = {5};
      f.parents = {-1};
      f.logit_rows = {0};
      for (int j = 1; j <= 40; ++j) {
        f.tokens.push_back(j);
        f.parents.push_back(static_cast<int32_t>(rng() % j));
        f.logit_rows.push_back(j);
      }
    }
    ASSERT_TRUE(table.PrepareForward(step, &layout).ok());
    ASSERT_EQ(layout.committed, (std::vector<int64_t>{21, 38}));
    PlanItems plan;
    PlanItemsFromLayout(layout, &plan);
    CudaStep cuda_step;
    if (padded) ASSERT_TRUE(ChooseBuckets({41, 41}, &cuda_step));
    StepPacker pack;
    LayoutForward(step, plan.items, Options(), &cuda_step, &pack);
    const int64_t T = cuda_step.T;
    const auto kv_end = Read<int32_t>(pack, cuda_step.o_kv_end, T);
    const auto mask_begin = Read<int32_t>(pack, cuda_step.o_mask_begin, T);
    const auto mask = Read<uint32_t>(pack, cuda_step.o_mask, T * kWords);
    const auto slots = Read<int64_t>(pack, cuda_step.o_slots, T);
    const auto positions = Read<int32_t>(pack, cuda_step.o_positions, T);
    for (int64_t t = 0; t < layout.num_tokens; ++t) {
      const int64_t q = padded ? layout.query_seq[t] * cuda_step.per_seq + t % 41 : t;
      SCOPED_TRACE(testing::Message() << "token " << t);
      EXPECT_EQ(DecodeKeys(kv_end[q], mask_begin[q], &mask[q * kWords]), CpuKeys(layout, t));
      EXPECT_EQ(slots[q], layout.slots[t]);
      EXPECT_EQ(positions[q], layout.positions[t]);
    }
  }
}

TEST(CudaStepPlanTest, TableRefusesNodesBeyondTheMaskAndChangesNothing) {
  PagedKvTable table(kKvBlockTokens, 64 * kKvBlockTokens, 1000, 4096);
  table.AllocateUpFront();
  table.SetMaskBits(cuda::kTreeAttentionMaskBits);
  ASSERT_TRUE(table.AddSequence(1).ok());
  // A pending token, then a star of 300 children: child j lies j nodes past the spine end 0.
  ForwardItem f;
  f.seq = 1;
  f.tokens.assign(301, 3);
  f.parents.assign(301, 0);
  f.parents[0] = -1;
  StepLayout layout;
  const absl::Status s = table.PrepareForward({f}, &layout);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_NE(s.message().find("items[0].parents[257]"), std::string::npos) << s;
  EXPECT_EQ(*table.ScratchLength(1), 0);
  EXPECT_EQ(table.Usage().used_tokens, 0);
  // 257 nodes fit the mask.
  f.tokens.resize(257);
  f.parents.resize(257);
  EXPECT_TRUE(table.PrepareForward({f}, &layout).ok());
  EXPECT_EQ(*table.ScratchLength(1), 257);
}

// The buffers sized at start (ReservedStepShape) hold what the forwards the drafter and the
// warm-up send lay out to, long contexts included: up to the reserved rows in one chain or
// several, and a padded decode step of the widest graph bucket.
TEST(CudaStepPlanTest, ReservedStepCoversTheWarmedForwards) {
  const ReservedStep reserved = ReservedStepShape(1024, /*head_dim=*/64, false);
  const int64_t widest_padded = kGraphMaxBatch * 9;  // the widest batch bucket, 8-node trees
  EXPECT_EQ(reserved.step.T, std::max<int64_t>(1024, widest_padded));
  EXPECT_EQ(reserved.step.R, std::max<int64_t>(1024, widest_padded));
  EXPECT_TRUE(reserved.step.verify);
  EXPECT_EQ(reserved.step.ws_floats, cuda::kTreeAttentionMaxWorkspaceFloats);
  EXPECT_EQ(ReservedStepShape(0, 64, false).step.T,
            std::max(kDefaultGemmInvariantRows, widest_padded));
  EXPECT_EQ(ReservedStepShape(-1, 64, true).step.R,
            std::max(kDefaultGemmInvariantRows, widest_padded));
  EXPECT_EQ(ReservedStepShape(4096, 64, true).step.R, 4096) << "more invariant rows, more rows";
  EXPECT_TRUE(ReservedStepShape(512, 64, true).step.gather_logits);
  EXPECT_EQ(ReservedStepShape(512, 80, false).step.ws_floats, 0) << "80 never splits";
  struct Case {
    int seqs;
    int tokens;  // a chain each, every row's logits asked
    int64_t committed;
    bool padded;
  };
  for (const Case& c : std::vector<Case>{{1, 1024, 0, false},
                                         {1, 1024, 3000, false},
                                         {4, 256, 4000, false},
                                         {16, 64, 20000, false},
                                         {kGraphMaxBatch, 1, 60000, true},
                                         {kGraphMaxBatch, 5, 20000, true},
                                         {kGraphMaxBatch, 9, 8000, true}}) {
    SCOPED_TRACE(testing::Message() << c.seqs << " x " << c.tokens << " after " << c.committed);
    std::vector<Seq> seqs(c.seqs);
    std::vector<ForwardItem> items(c.seqs);
    int32_t next_block = 0;
    std::vector<PlanItem> plan;
    for (int b = 0; b < c.seqs; ++b) {
      seqs[b].committed = c.committed;
      while (static_cast<int64_t>(seqs[b].blocks.size()) * kBlock < c.committed) {
        seqs[b].blocks.push_back(next_block++);
      }
      for (int j = 0; j < c.tokens; ++j) {
        items[b].tokens.push_back(j);
        items[b].parents.push_back(j - 1);
        items[b].logit_rows.push_back(j);
      }
      seqs[b].Append(items[b], &next_block);
    }
    for (const Seq& s : seqs) plan.push_back(s.Plan());
    CudaStep step;
    if (c.padded) {
      ASSERT_TRUE(ChooseBuckets(std::vector<int64_t>(c.seqs, c.tokens), &step));
    }
    StepPacker pack;
    LayoutForward(items, plan, Options(), &step, &pack);
    EXPECT_LE(step.T, reserved.step.T);
    EXPECT_LE(step.R, reserved.step.R);
    EXPECT_LE(step.ws_floats, reserved.step.ws_floats);
    EXPECT_LE(pack.bytes().size(), reserved.meta_bytes);
  }
}

}  // namespace
}  // namespace specd
