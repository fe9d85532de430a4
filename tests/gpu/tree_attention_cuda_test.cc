// Tree attention on the GPU, its special cases: bit identity across splits of the key range
// (unsplit, the plan's, forced, several chunks a CTA), with kv_stable_end, without masks and (the
// generic kernel) without tiles; bit identity of every tree node with its own decode (batch
// invariance); tensor-parallel head ranges against the full model's heads; the params' checks.
// The results against the CPU reference (kernels/cpu/tree_attention.cc) on every shape and batch
// are op-table cases (ops_cuda_test.cc); the batches are tests/gpu/tree_attention_batch.h's.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/tp/tp_plan.h"
#include "specd/kernels/cuda/tree_attention.h"
#include "specd/kernels/tree_attention.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/tree_attention_batch.h"

namespace specd {
namespace {

using gpu_test::AllClose;
using gpu_test::Batch;
using gpu_test::bf16;
using gpu_test::BuildBatch;
using gpu_test::DecodeBatch;
using gpu_test::DeviceBuffer;
using gpu_test::HeadSlice;
using gpu_test::kGenericShapes;
using gpu_test::kShapes;
using gpu_test::LongTree;
using gpu_test::PrefillBatch;
using gpu_test::RandomNormal;
using gpu_test::RoundBf16;
using gpu_test::RunTreeAttentionCpu;
using gpu_test::SeqSpec;
using gpu_test::Shape;
using gpu_test::ToBf16;
using gpu_test::ToFloat;
using gpu_test::TreeParents;
using gpu_test::VerifyBatch;

class TreeAttentionCudaTest : public gpu_test::GpuTest {
 protected:
  // Runs one batch on the GPU once per entry of `splits` (0: the plan's choice, else forced),
  // then split with 2 and with 3 chunks a CTA, and expects the same bits from each (the op
  // table compares each of these runs with the CPU reference).
  void Check(const Shape& sh, const std::vector<SeqSpec>& seqs, std::vector<int> splits,
             uint64_t seed) {
    splits.push_back(-2);
    splits.push_back(-3);
    const Batch b = BuildBatch(sh, seqs, seed);
    const float scale = 1.0f / std::sqrt(static_cast<float>(sh.head_dim));
    // Every split gives the same bits (the kernel's batch invariance).
    std::vector<float> first;
    for (int force_splits : splits) {
      const std::vector<float> got =
          RunGpu(sh, force_splits, b.q, b.q_stride, b.k_cache, b.v_cache, b.tables, b.max_blocks,
                 b.query_seq, b.kv_end, b.mask_begin, b.mask, scale);
      if (first.empty()) {
        first = got;
      } else {
        EXPECT_EQ(0, std::memcmp(first.data(), got.data(), got.size() * sizeof(float)))
            << "forced splits " << force_splits << " changed bits";
      }
    }
    // kv_stable_end (each sequence's committed prefix, as the engine passes it; then all of a
    // sequence's keys, and none) lets the MMA kernel load its first job before the PDL wait: the
    // same bits, unsplit, split and several chunks a CTA.
    for (int which = 0; which < 3; ++which) {
      // Sequence i has block-table row size - 1 - i (BuildBatch).
      stable_end_.assign(seqs.size(), 0);
      for (size_t i = 0; i < seqs.size(); ++i) {
        const SeqSpec& q = seqs[i];
        const int all = q.committed + q.chain + static_cast<int>(q.tree_parents.size());
        stable_end_[seqs.size() - 1 - i] = which == 0 ? q.committed : which == 1 ? all : 0;
      }
      for (int force_splits : {1, 0, -2}) {
        const std::vector<float> got =
            RunGpu(sh, force_splits, b.q, b.q_stride, b.k_cache, b.v_cache, b.tables,
                   b.max_blocks, b.query_seq, b.kv_end, b.mask_begin, b.mask, scale);
        EXPECT_EQ(0, std::memcmp(first.data(), got.data(), got.size() * sizeof(float)))
            << "kv_stable_end case " << which << ", forced splits " << force_splits
            << ": bits differ (heads " << sh.num_heads << "/" << sh.num_kv_heads << " head_dim "
            << sh.head_dim << ")";
      }
    }
    stable_end_.clear();
    // The generic kernel reads no tiles, split fields or workspace: without them (null, 1), the
    // same bits.
    if (!cuda::TreeAttentionUsesMmaKernel(sh.head_dim)) {
      drop_tiles_ = true;
      const std::vector<float> got =
          RunGpu(sh, 0, b.q, b.q_stride, b.k_cache, b.v_cache, b.tables, b.max_blocks,
                 b.query_seq, b.kv_end, b.mask_begin, b.mask, scale);
      drop_tiles_ = false;
      EXPECT_EQ(0, std::memcmp(first.data(), got.data(), got.size() * sizeof(float)))
          << "generic kernel without tiles: bits differ (head_dim " << sh.head_dim << ")";
    }
    // Without trees the masks may be left out (null pointers), which selects the kernel built
    // without the window machinery: the same bits.
    if (b.tree_keys.empty()) {
      for (int force_splits : splits) {
        const std::vector<float> got =
            RunGpu(sh, force_splits, b.q, b.q_stride, b.k_cache, b.v_cache, b.tables, b.max_blocks,
                   b.query_seq, b.kv_end, {}, {}, scale);
        EXPECT_EQ(0, std::memcmp(first.data(), got.data(), got.size() * sizeof(float)))
            << "no masks, forced splits " << force_splits << ": bits differ from the run with "
            << "masks (heads " << sh.num_heads << "/" << sh.num_kv_heads << " head_dim "
            << sh.head_dim << ")";
      }
    }
  }

  // RunTreeAttentionGpu on the fixture's stream, with its kv_stable_end and tile switches.
  std::vector<float> RunGpu(const Shape& sh, int force_splits, const std::vector<float>& q,
                            int q_stride, const std::vector<float>& k_cache,
                            const std::vector<float>& v_cache, const std::vector<int32_t>& tables,
                            int max_blocks, const std::vector<int32_t>& query_seq,
                            const std::vector<int32_t>& kv_end,
                            const std::vector<int32_t>& mask_begin,
                            const std::vector<uint32_t>& mask, float scale,
                            const HeadSlice& slice = HeadSlice()) {
    return gpu_test::RunTreeAttentionGpu(sh, force_splits, q, q_stride, k_cache, v_cache, tables,
                                         max_blocks, query_seq, kv_end, mask_begin, mask, scale,
                                         stream_, slice, stable_end_, drop_tiles_);
  }

  bool drop_tiles_ = false;
  // Per sequence (block-table row), passed as kv_stable_end when not empty.
  std::vector<int32_t> stable_end_;
};


TEST_F(TreeAttentionCudaTest, DecodeSplitsAgree) {
  for (const Shape& sh : kShapes) Check(sh, DecodeBatch(), {0, 1, 3}, 100);
}

TEST_F(TreeAttentionCudaTest, PrefillChainsSplitsAgree) {
  for (const Shape& sh : {kShapes[0], kShapes[1], kShapes[4], kShapes[5], kShapes[6]}) {
    Check(sh, PrefillBatch(), {0, 2}, 200);
  }
}

TEST_F(TreeAttentionCudaTest, VerifyTreesSplitsAgree) {
  std::mt19937_64 rng(7);
  int shape = 0;
  for (const Shape& sh : kShapes) Check(sh, VerifyBatch(&shape, 4, rng), {0, 1, 4}, 300);
}

// A 256-node tree alone over a long context: one sequence, few tiles, so the plan splits the
// key range.
TEST_F(TreeAttentionCudaTest, LargeTreesOverLongContextSplitsAgree) {
  std::mt19937_64 rng(8);
  for (const Shape& sh : {kShapes[1], kShapes[5], kShapes[6]}) {
    for (int shape : {2, 3}) Check(sh, {LongTree(shape, rng)}, {0}, 400 + shape);
  }
}

// The generic kernel (head sizes without an MMA build) on the same batches as the tests above;
// Check also runs it without tiles.
TEST_F(TreeAttentionCudaTest, GenericKernelDecodeSplitsAgree) {
  for (const Shape& sh : kGenericShapes) {
    ASSERT_TRUE(cuda::TreeAttentionHeadDimSupported(sh.head_dim)) << sh.head_dim;
    ASSERT_FALSE(cuda::TreeAttentionUsesMmaKernel(sh.head_dim)) << sh.head_dim;
    Check(sh, DecodeBatch(), {0, 1, 3}, 600);
  }
}

TEST_F(TreeAttentionCudaTest, GenericKernelPrefillChainsSplitsAgree) {
  for (const Shape& sh : kGenericShapes) Check(sh, PrefillBatch(), {0, 2}, 700);
}

TEST_F(TreeAttentionCudaTest, GenericKernelVerifyTreesSplitsAgree) {
  std::mt19937_64 rng(12);
  int shape = 0;
  for (const Shape& sh : kGenericShapes) Check(sh, VerifyBatch(&shape, 5, rng), {0, 1, 4}, 800);
}

TEST_F(TreeAttentionCudaTest, GenericKernelLargeTreesOverLongContextSplitsAgree) {
  std::mt19937_64 rng(13);
  for (const Shape& sh : {kGenericShapes[0], kGenericShapes[3], kGenericShapes[7]}) {
    for (int shape : {2, 3}) Check(sh, {LongTree(shape, rng)}, {0}, 900 + shape);
  }
}

// Batch invariance, bit for bit: a tree node's output equals that of the same token decoded
// alone after its path was committed (its ancestors moved to consecutive slots, as after
// acceptance), and that of the decode batched with other sequences, for every split choice.
// Before keys were taken by rank in fixed chunks, the split count followed the batch and tree
// keys sat at their slot's column, so these differed in the last bits.
TEST_F(TreeAttentionCudaTest, TreeNodeBitIdenticalToDecode) {
  std::mt19937_64 rng(9);
  for (const Shape& sh : {kShapes[0], kShapes[4], kShapes[5], kShapes[6], kGenericShapes[0],
                          kGenericShapes[2], kGenericShapes[6]}) {
    const int kv_dim = sh.num_kv_heads * sh.head_dim;
    const int q_dim = sh.num_heads * sh.head_dim;
    for (int ctx : {100, 700, 3000}) {
      for (int nodes : {1, 16, 64, 256}) {
        const std::vector<int32_t> parents = TreeParents(nodes, 3, rng);
        std::vector<std::vector<int32_t>> anc(nodes);
        int x = 0;  // the deepest node
        for (int j = 0; j < nodes; ++j) {
          if (parents[j] >= 0) anc[j] = anc[parents[j]];
          anc[j].push_back(j);
          if (anc[j].size() > anc[x].size()) x = j;
        }
        const int tree_base = ctx + 1;  // one pending chain token, then the tree
        // Block-table rows: 0 the tree's sequence, 1 the linearised path, 2 and 3 others.
        const int other_end[2] = {38, 2001};
        const int lens[4] = {tree_base + nodes, tree_base + static_cast<int>(anc[x].size()),
                             other_end[0], other_end[1]};
        int max_blocks = 1;
        for (int len : lens) max_blocks = std::max(max_blocks, (len + sh.block_size - 1) / sh.block_size);
        std::vector<int32_t> tables(4 * max_blocks);
        std::iota(tables.begin(), tables.end(), 0);
        std::shuffle(tables.begin(), tables.end(), rng);
        const int64_t num_slots = int64_t{4} * max_blocks * sh.block_size;
        std::vector<float> k = RoundBf16(RandomNormal(num_slots * kv_dim, rng));
        std::vector<float> v = RoundBf16(RandomNormal(num_slots * kv_dim, rng));
        auto phys = [&](int row, int slot) {
          return int64_t{tables[row * max_blocks + slot / sh.block_size]} * sh.block_size +
                 slot % sh.block_size;
        };
        for (int r = 0; r < lens[1]; ++r) {
          const int src = r < tree_base ? r : tree_base + anc[x][r - tree_base];
          std::copy_n(&k[phys(0, src) * kv_dim], kv_dim, &k[phys(1, r) * kv_dim]);
          std::copy_n(&v[phys(0, src) * kv_dim], kv_dim, &v[phys(1, r) * kv_dim]);
        }
        const std::vector<float> qx = RoundBf16(RandomNormal(q_dim, rng, 2.5f));
        struct Batch {
          std::vector<int32_t> query_seq, kv_end, mask_begin;
          std::vector<uint32_t> mask;
          std::vector<float> q;
          int row_of_x = -1;
        };
        auto add = [&](Batch& b, int seq, int end, int mb, const std::vector<uint32_t>& bits,
                       bool is_x) {
          if (is_x) b.row_of_x = static_cast<int>(b.query_seq.size());
          b.query_seq.push_back(seq);
          b.kv_end.push_back(end);
          b.mask_begin.push_back(mb);
          b.mask.insert(b.mask.end(), bits.begin(), bits.end());
          const std::vector<float> q = is_x ? qx : RoundBf16(RandomNormal(q_dim, rng, 2.5f));
          b.q.insert(b.q.end(), q.begin(), q.end());
        };
        const std::vector<uint32_t> none(cuda::kTreeAttentionMaskWords, 0u);
        Batch tree, alone, mixed;
        add(tree, 0, tree_base, tree_base, none, false);
        for (int j = 0; j < nodes; ++j) {
          std::vector<uint32_t> bits(cuda::kTreeAttentionMaskWords, 0u);
          for (int32_t a : anc[j]) bits[a / 32] |= 1u << (a % 32);
          add(tree, 0, tree_base + j + 1, tree_base, bits, j == x);
        }
        add(tree, 2, other_end[0], other_end[0], none, false);
        add(tree, 3, other_end[1], other_end[1], none, false);
        add(alone, 1, lens[1], lens[1], none, true);
        add(mixed, 3, other_end[1], other_end[1], none, false);
        add(mixed, 1, lens[1], lens[1], none, true);
        add(mixed, 2, other_end[0], other_end[0], none, false);
        const float scale = 1.0f / std::sqrt(static_cast<float>(sh.head_dim));
        std::vector<float> want;
        for (const Batch* b : {&tree, &alone, &mixed}) {
          for (int force : {0, 1, 2}) {
            const std::vector<float> out = RunGpu(sh, force, b->q, q_dim, k, v, tables, max_blocks,
                                                  b->query_seq, b->kv_end, b->mask_begin, b->mask,
                                                  scale);
            const std::vector<float> got(out.begin() + int64_t{b->row_of_x} * q_dim,
                                         out.begin() + int64_t{b->row_of_x + 1} * q_dim);
            if (want.empty()) {
              want = got;
            } else {
              ASSERT_EQ(0, std::memcmp(want.data(), got.data(), q_dim * sizeof(float)))
                  << "head_dim " << sh.head_dim << " context " << ctx << " tree " << nodes
                  << " node " << x << " (depth " << anc[x].size() << ") batch "
                  << (b == &tree ? "tree" : b == &alone ? "alone" : "mixed") << " forced splits "
                  << force;
            }
          }
        }
      }
    }
  }
}

// Batch invariance for every node of a tree at once: each node's output equals, bit for bit, that
// of its own decode after its path was committed (a batch of such decodes, one sequence each,
// whose block tables share the tree's prefix blocks), for every split choice. The shapes make
// the kernel's window jobs (a tree node's keys past its plain prefix, gathered from the union of
// the tile's ancestors) take every path: one window for a tile; several groups when the union
// does not fit (two interleaved chains, 64 queries per tile); mask_begin differing within a tile
// (some prefix keys given as leading mask bits instead, the same key set); ancestries spanning
// several sub-chunks; and contexts whose prefix ends mid-sub-chunk or right at its start.
TEST_F(TreeAttentionCudaTest, EveryTreeNodeBitIdenticalToItsDecode) {
  std::mt19937_64 rng(11);
  for (const Shape& sh : {kShapes[3], kShapes[4], kShapes[6], kShapes[0], kGenericShapes[0],
                          kGenericShapes[1]}) {
    const int kv_dim = sh.num_kv_heads * sh.head_dim;
    const int q_dim = sh.num_heads * sh.head_dim;
    for (int ctx : {37, 2000}) {
      for (int variant = 0; variant < 5; ++variant) {
        // Tree shapes: star, random, two interleaved chains; then random and interleaved with
        // shifted mask_begin.
        const int shape = variant == 0 ? 1 : variant == 1 || variant == 3 ? 3 : 4;
        const bool shifted = variant >= 3;
        const int nodes = 256;
        const std::vector<int32_t> parents = TreeParents(nodes, shape, rng);
        std::vector<std::vector<int32_t>> anc(nodes);
        for (int j = 0; j < nodes; ++j) {
          if (parents[j] >= 0) anc[j] = anc[parents[j]];
          anc[j].push_back(j);
        }
        const int tree_base = ctx + 1;  // one pending chain token, then the tree
        // Block tables: row 0 the tree's sequence; row 1 + j node j's committed path, sharing
        // row 0's blocks below tree_base / block_size and owning the rest.
        const int bs = sh.block_size;
        const int shared_blocks = tree_base / bs;
        const int tree_blocks = (tree_base + nodes + bs - 1) / bs;
        int max_blocks = tree_blocks, total_blocks = tree_blocks;
        std::vector<int> path_len(nodes);
        for (int j = 0; j < nodes; ++j) {
          path_len[j] = tree_base + static_cast<int>(anc[j].size());
          const int blocks = (path_len[j] + bs - 1) / bs;
          max_blocks = std::max(max_blocks, blocks);
          total_blocks += blocks - shared_blocks;
        }
        std::vector<int32_t> pool(total_blocks);
        std::iota(pool.begin(), pool.end(), 0);
        std::shuffle(pool.begin(), pool.end(), rng);
        std::vector<int32_t> tables(static_cast<size_t>(1 + nodes) * max_blocks, 0);
        int next_block = 0;
        for (int b = 0; b < tree_blocks; ++b) tables[b] = pool[next_block++];
        for (int j = 0; j < nodes; ++j) {
          const int blocks = (path_len[j] + bs - 1) / bs;
          for (int b = 0; b < blocks; ++b) {
            tables[static_cast<size_t>(1 + j) * max_blocks + b] =
                b < shared_blocks ? tables[b] : pool[next_block++];
          }
        }
        const int64_t num_slots = int64_t{total_blocks} * bs;
        std::vector<float> k = RoundBf16(RandomNormal(num_slots * kv_dim, rng));
        std::vector<float> v = RoundBf16(RandomNormal(num_slots * kv_dim, rng));
        auto phys = [&](int row, int slot) {
          return int64_t{tables[static_cast<size_t>(row) * max_blocks + slot / bs]} * bs +
                 slot % bs;
        };
        for (int j = 0; j < nodes; ++j) {
          for (int r = shared_blocks * bs; r < path_len[j]; ++r) {
            const int src = r < tree_base ? r : tree_base + anc[j][r - tree_base];
            std::copy_n(&k[phys(0, src) * kv_dim], kv_dim, &k[phys(1 + j, r) * kv_dim]);
            std::copy_n(&v[phys(0, src) * kv_dim], kv_dim, &v[phys(1 + j, r) * kv_dim]);
          }
        }
        // The tree batch: the pending token, then the nodes; the decode batch: node j's path.
        const std::vector<uint32_t> none(cuda::kTreeAttentionMaskWords, 0u);
        std::vector<int32_t> t_seq = {0}, t_end = {tree_base}, t_mb = {tree_base};
        std::vector<uint32_t> t_mask = none;
        std::vector<int32_t> d_seq, d_end, d_mb;
        std::vector<uint32_t> d_mask;
        std::vector<float> t_q = RoundBf16(RandomNormal(q_dim, rng, 2.5f)), d_q;
        for (int j = 0; j < nodes; ++j) {
          // Shifted: the last d prefix keys are leading mask bits (kv_end - mask_begin <= 256).
          const int d = shifted ? std::min<int>(static_cast<int>(rng() % 3), nodes - 1 - j) : 0;
          std::vector<uint32_t> bits(cuda::kTreeAttentionMaskWords, 0u);
          for (int b = 0; b < d; ++b) bits[b / 32] |= 1u << (b % 32);
          for (int32_t a : anc[j]) bits[(a + d) / 32] |= 1u << ((a + d) % 32);
          t_seq.push_back(0);
          t_end.push_back(tree_base + j + 1);
          t_mb.push_back(tree_base - d);
          t_mask.insert(t_mask.end(), bits.begin(), bits.end());
          d_seq.push_back(1 + j);
          d_end.push_back(path_len[j]);
          d_mb.push_back(path_len[j]);
          d_mask.insert(d_mask.end(), none.begin(), none.end());
          const std::vector<float> qj = RoundBf16(RandomNormal(q_dim, rng, 2.5f));
          t_q.insert(t_q.end(), qj.begin(), qj.end());
          d_q.insert(d_q.end(), qj.begin(), qj.end());
        }
        const float scale = 1.0f / std::sqrt(static_cast<float>(sh.head_dim));
        const std::vector<float> want =
            RunGpu(sh, 0, d_q, q_dim, k, v, tables, max_blocks, d_seq, d_end, d_mb, d_mask, scale);
        auto compare = [&](const std::vector<float>& got, int row_offset, const std::string& what) {
          int bad_nodes = 0, first = -1, first_dim = -1;
          for (int j = 0; j < nodes; ++j) {
            const float* a = &got[static_cast<size_t>(row_offset + j) * q_dim];
            const float* b = &want[static_cast<size_t>(j) * q_dim];
            if (std::memcmp(a, b, q_dim * sizeof(float)) != 0) {
              if (first < 0) {
                first = j;
                for (int i = 0; i < q_dim && first_dim < 0; ++i) {
                  if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) first_dim = i;
                }
              }
              ++bad_nodes;
            }
          }
          EXPECT_EQ(bad_nodes, 0)
              << what << ", head_dim " << sh.head_dim << " heads " << sh.num_heads << "/"
              << sh.num_kv_heads << " context " << ctx << " tree shape " << shape
              << (shifted ? " (shifted mask_begin)" : "") << ": " << bad_nodes
              << " nodes differ from their decodes; first node " << first << " (depth "
              << (first >= 0 ? anc[first].size() : 0) << "), head " << first_dim / sh.head_dim
              << " dim " << first_dim % sh.head_dim << ": "
              << (first >= 0 ? got[static_cast<size_t>(row_offset + first) * q_dim + first_dim] : 0)
              << " vs " << (first >= 0 ? want[static_cast<size_t>(first) * q_dim + first_dim] : 0);
        };
        for (int force : {0, 1, 2}) {
          compare(RunGpu(sh, force, t_q, q_dim, k, v, tables, max_blocks, t_seq, t_end, t_mb,
                         t_mask, scale),
                  1, "tree batch, forced splits " + std::to_string(force));
        }
        compare(
            RunGpu(sh, 1, d_q, q_dim, k, v, tables, max_blocks, d_seq, d_end, d_mb, d_mask, scale),
            0, "decode batch unsplit");
        // The decodes without masks (the kernel then has no window machinery).
        compare(RunGpu(sh, 0, d_q, q_dim, k, v, tables, max_blocks, d_seq, d_end, {}, {}, scale), 0,
                "decode batch without masks");
      }
    }
  }
}

// Tensor parallelism: each rank runs the kernel on its contiguous range of query heads (split as
// engine/tp/tp_plan.h does, so ranges need not align with the KV-head groups) and on the KV heads
// those read (a KV head whose group spans two ranks is on both), with the global offsets. Its
// output must be bit-identical to the full model's output for those heads, whatever the split
// choice (the same arithmetic per (query, head)), and close to the CPU reference.
TEST_F(TreeAttentionCudaTest, TensorParallelHeadRangesMatchTheFullModel) {
  struct TpCase {
    Shape sh;
    int world;
  };
  // Llama-3.1-70B on 7 ranks (10,9,9,9,9,9,9 heads over groups of 8), 4 heads per rank over
  // groups of 3, aligned halves, one KV head on both ranks (4 + 3 heads), 10,9,9 over groups of 7.
  const TpCase cases[] = {
      {{64, 8, 128, 16}, 7}, {{64, 8, 64, 16}, 7}, {{12, 4, 128, 16}, 3}, {{12, 4, 64, 8}, 3},
      {{64, 8, 128, 16}, 2}, {{12, 4, 64, 16}, 2}, {{7, 1, 64, 16}, 2},   {{28, 4, 128, 32}, 3},
      // The generic kernel: the mistral fixture's heads (4,3,3 heads over a group of 5), groups
      // of 3 cut mid-group, and Llama-3.1-70B's head counts with head_dim 96 on 7 ranks.
      {{5, 1, 8, 16}, 2},    {{10, 2, 8, 16}, 3},  {{12, 4, 24, 16}, 5},  {{64, 8, 96, 16}, 7},
  };
  std::mt19937_64 rng(10);
  uint64_t seed = 500;
  for (const TpCase& c : cases) {
    const Shape& sh = c.sh;
    std::vector<SeqSpec> seqs(5);
    seqs[0].committed = 1000;  // decode
    seqs[1].committed = 37;    // a prefill chunk
    seqs[1].chain = 77;
    seqs[2].committed = 500;  // trees below pending chains
    seqs[2].chain = 2;
    seqs[2].tree_parents = TreeParents(7, 2, rng);
    seqs[3].committed = 33;
    seqs[3].tree_parents = TreeParents(64, 3, rng);
    seqs[4].committed = 2100;  // a long decode
    const Batch b = BuildBatch(sh, seqs, seed++);
    const float scale = 1.0f / std::sqrt(static_cast<float>(sh.head_dim));
    const std::vector<float> want = RunTreeAttentionCpu(sh, b, scale);
    const std::vector<float> full =
        RunGpu(sh, 0, b.q, b.q_stride, b.k_cache, b.v_cache, b.tables, b.max_blocks, b.query_seq,
               b.kv_end, b.mask_begin, b.mask, scale);
    ASSERT_TRUE(AllClose(full, want, 4e-3f, 2e-2f))
        << "full model, heads " << sh.num_heads << "/" << sh.num_kv_heads << " head_dim "
        << sh.head_dim;

    const int hd = sh.head_dim, nq = b.num_queries();
    const int q_dim = sh.num_heads * hd, kv_dim = sh.num_kv_heads * hd;
    const int64_t num_slots = static_cast<int64_t>(b.k_cache.size()) / kv_dim;
    const int group = sh.num_heads / sh.num_kv_heads;
    const std::vector<TpRange> heads = SplitEvenly(sh.num_heads, c.world);
    for (int r = 0; r < c.world; ++r) {
      const TpRange qr = heads[r];
      const TpRange kvr{qr.begin / group, (qr.end - 1) / group + 1};
      const Shape local{static_cast<int>(qr.size()), static_cast<int>(kvr.size()), hd,
                        sh.block_size};
      HeadSlice slice;
      slice.q_head_offset = qr.begin;
      slice.kv_head_offset = kvr.begin;
      slice.kv_group = group;
      // The rank's q (its heads, in a fused-QKV-like padded row) and cache (its KV heads).
      const int lq_dim = local.num_heads * hd, lkv_dim = local.num_kv_heads * hd;
      const int lq_stride = lq_dim + 2 * lkv_dim;
      std::vector<float> lq(static_cast<size_t>(nq) * lq_stride, 0.0f);
      for (int t = 0; t < nq; ++t) {
        std::copy_n(&b.q[static_cast<size_t>(t) * b.q_stride + qr.begin * hd], lq_dim,
                    &lq[static_cast<size_t>(t) * lq_stride]);
      }
      std::vector<float> lk(static_cast<size_t>(num_slots) * lkv_dim),
          lv(static_cast<size_t>(num_slots) * lkv_dim);
      for (int64_t slot = 0; slot < num_slots; ++slot) {
        std::copy_n(&b.k_cache[slot * kv_dim + kvr.begin * hd], lkv_dim, &lk[slot * lkv_dim]);
        std::copy_n(&b.v_cache[slot * kv_dim + kvr.begin * hd], lkv_dim, &lv[slot * lkv_dim]);
      }
      // The full model's results for the rank's heads.
      std::vector<float> full_part(static_cast<size_t>(nq) * lq_dim),
          want_part(static_cast<size_t>(nq) * lq_dim);
      for (int t = 0; t < nq; ++t) {
        std::copy_n(&full[static_cast<size_t>(t) * q_dim + qr.begin * hd], lq_dim,
                    &full_part[static_cast<size_t>(t) * lq_dim]);
        std::copy_n(&want[static_cast<size_t>(t) * q_dim + qr.begin * hd], lq_dim,
                    &want_part[static_cast<size_t>(t) * lq_dim]);
      }
      for (int force : {0, 1, 3}) {
        const std::vector<float> got =
            RunGpu(local, force, lq, lq_stride, lk, lv, b.tables, b.max_blocks, b.query_seq,
                   b.kv_end, b.mask_begin, b.mask, scale, slice);
        const std::string what =
            "heads " + std::to_string(sh.num_heads) + "/" + std::to_string(sh.num_kv_heads) +
            " head_dim " + std::to_string(hd) + " world " + std::to_string(c.world) + " rank " +
            std::to_string(r) + " (global q heads [" + std::to_string(qr.begin) + ", " +
            std::to_string(qr.end) + "), KV heads [" + std::to_string(kvr.begin) + ", " +
            std::to_string(kvr.end) + ")) forced splits " + std::to_string(force);
        EXPECT_TRUE(AllClose(got, want_part, 4e-3f, 2e-2f)) << what << ": vs the CPU reference";
        ASSERT_EQ(got.size(), full_part.size());
        int64_t first_diff = -1, diffs = 0;
        for (size_t i = 0; i < got.size(); ++i) {
          if (std::memcmp(&got[i], &full_part[i], sizeof(float)) != 0) {
            if (first_diff < 0) first_diff = static_cast<int64_t>(i);
            ++diffs;
          }
        }
        EXPECT_EQ(diffs, 0) << what << ": bits differ from the full model in " << diffs
                            << " elements; first at query " << first_diff / lq_dim
                            << ", local head " << first_diff % lq_dim / hd << ", dim "
                            << first_diff % hd << ": " << (first_diff >= 0 ? got[first_diff] : 0)
                            << " vs " << (first_diff >= 0 ? full_part[first_diff] : 0);
      }
    }
  }
}

// The head-range checks, on launches with no queries (validated, then nothing to do).
TEST_F(TreeAttentionCudaTest, HeadRangeParamsAreValidated) {
  // Rank 1 of Llama-3.1-70B on 7 ranks: global q heads [10, 19), KV heads [1, 3).
  cuda::TreeAttentionParams ok;
  ok.num_queries = 0;
  ok.num_heads = 9;
  ok.num_kv_heads = 2;
  ok.head_dim = 128;
  ok.kv.block_size = 16;
  ok.kv.max_blocks_per_seq = 1;
  ok.q_stride = ok.out_stride = 9 * 128;
  ok.q_head_offset = 10;
  ok.kv_head_offset = 1;
  ok.kv_group = 8;
  EXPECT_EQ(cuda::TreeAttentionCuda(ok, stream_), cudaSuccess);
  auto bad = [&](const char* what, auto change) {
    cuda::TreeAttentionParams p = ok;
    change(p);
    EXPECT_EQ(cuda::TreeAttentionCuda(p, stream_), cudaErrorInvalidValue) << what;
  };
  bad("kv_group 0 with 9 heads over 2", [](cuda::TreeAttentionParams& p) { p.kv_group = 0; });
  bad("KV offset not the first head's", [](cuda::TreeAttentionParams& p) { p.kv_head_offset = 0; });
  bad("a KV head serving no local head", [](cuda::TreeAttentionParams& p) { p.num_kv_heads = 3; });
  bad("a local head without its KV head", [](cuda::TreeAttentionParams& p) { p.num_kv_heads = 1; });
  bad("negative q offset", [](cuda::TreeAttentionParams& p) { p.q_head_offset = -1; });
  bad("negative KV offset", [](cuda::TreeAttentionParams& p) { p.kv_head_offset = -1; });
  bad("negative kv_group", [](cuda::TreeAttentionParams& p) { p.kv_group = -8; });
  bad("kv_group over 64", [](cuda::TreeAttentionParams& p) {
    p.q_head_offset = p.kv_head_offset = 0;
    p.num_kv_heads = 1;
    p.kv_group = 65;
  });
  {
    cuda::TreeAttentionParams p = ok;  // the same with a group of 64 is fine
    p.q_head_offset = p.kv_head_offset = 0;
    p.num_kv_heads = 1;
    p.kv_group = 64;
    EXPECT_EQ(cuda::TreeAttentionCuda(p, stream_), cudaSuccess);
  }
  {
    cuda::TreeAttentionParams p = ok;  // no tensor parallelism
    p.num_heads = 8;
    p.num_kv_heads = 2;
    p.q_head_offset = p.kv_head_offset = p.kv_group = 0;
    EXPECT_EQ(cuda::TreeAttentionCuda(p, stream_), cudaSuccess);
  }
  // The plan sizes tiles for kv_group heads per KV head: 64 / 8 = 8 queries.
  const std::vector<int32_t> query_seq(20, 0), kv_end(20, 100);
  const cuda::TreeAttentionPlan plan =
      cuda::PlanTreeAttention(query_seq.data(), kv_end.data(), 20, 9, 2, 8, 132);
  ASSERT_EQ(plan.tile_begin.size(), 3u);
  for (size_t i = 0; i < plan.tile_begin.size(); ++i) {
    EXPECT_LE(plan.tile_end[i] - plan.tile_begin[i], 8) << "tile " << i;
  }
  EXPECT_TRUE(
      cuda::PlanTreeAttention(query_seq.data(), kv_end.data(), 20, 9, 2, 132).tile_begin.empty())
      << "without kv_group, 9 heads over 2 KV heads is no plan";
}

TEST_F(TreeAttentionCudaTest, BadParamsAreRejected) {
  cuda::TreeAttentionParams p;
  p.num_queries = 1;
  p.num_heads = 6;
  p.num_kv_heads = 4;  // does not divide
  p.head_dim = 128;
  EXPECT_EQ(cuda::TreeAttentionCuda(p, stream_), cudaErrorInvalidValue);
  p.num_kv_heads = 3;
  p.kv.block_size = 16;
  p.kv.max_blocks_per_seq = 1;
  for (int head_dim : {-2, 0, 1, 7, 9, 131, 258, 512}) {  // odd, or out of range
    p.head_dim = head_dim;
    p.q_stride = p.out_stride = 6 * std::max(head_dim, 2) + 2;
    EXPECT_FALSE(cuda::TreeAttentionHeadDimSupported(head_dim)) << head_dim;
    EXPECT_EQ(cuda::TreeAttentionCuda(p, stream_), cudaErrorInvalidValue) << head_dim;
  }
  EXPECT_EQ(cuda::kTreeAttentionMaxHeadDim, 256);
  for (int head_dim = 2; head_dim <= cuda::kTreeAttentionMaxHeadDim; head_dim += 2) {
    EXPECT_TRUE(cuda::TreeAttentionHeadDimSupported(head_dim)) << head_dim;
    const bool mma = head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128;
    EXPECT_EQ(cuda::TreeAttentionUsesMmaKernel(head_dim), mma) << head_dim;
    // The generic kernel never splits, so it needs no workspace whatever the split asked.
    EXPECT_EQ(cuda::TreeAttentionWorkspaceFloats(17, 5, 6, head_dim),
              mma ? int64_t{17} * 5 * 6 * (head_dim + 2) : 0)
        << head_dim;
  }
  // Supported sizes pass the head-dim check; then the null buffers are refused (the generic
  // kernel does not stop at num_tiles == 0, having no tiles to read).
  for (int head_dim : {8, 24, 96, 256}) {
    p.head_dim = head_dim;
    p.q_stride = p.out_stride = 6 * head_dim;
    EXPECT_EQ(cuda::TreeAttentionCuda(p, stream_), cudaErrorInvalidValue) << head_dim;
    p.num_queries = 0;
    EXPECT_EQ(cuda::TreeAttentionCuda(p, stream_), cudaSuccess) << head_dim << ", no queries";
    p.num_queries = 1;
  }
  // The kernel takes the max of the raw scores as the max of the scaled ones, which needs a
  // positive scale; and a key's offset within its block must fit 32 bits. With no queries a
  // launch that passes its checks does nothing, so each refusal here is a check's.
  p.num_queries = 0;
  p.head_dim = 128;
  p.q_stride = p.out_stride = 6 * 128;
  for (float scale : {0.0f, -0.088f, std::numeric_limits<float>::quiet_NaN(),
                      std::numeric_limits<float>::infinity()}) {
    p.scale = scale;
    EXPECT_EQ(cuda::TreeAttentionCuda(p, stream_), cudaErrorInvalidValue) << "scale " << scale;
  }
  p.scale = 0.088f;
  EXPECT_EQ(cuda::TreeAttentionCuda(p, stream_), cudaSuccess);
  p.kv.block_size = int64_t{1} << 23;  // 2^23 slots of 3 heads of 128: past 2^31 elements
  EXPECT_EQ(cuda::TreeAttentionCuda(p, stream_), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace specd
