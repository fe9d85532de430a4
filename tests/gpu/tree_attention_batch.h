// Tree attention test batches (tests/gpu): random sequences of decode tokens, prefill chains and
// verification trees over a random paged KV cache, in both descriptions (the GPU's masks and the
// CPU reference's ancestor lists), and the runs of the GPU kernel and the CPU reference on them.
// Shared by the op table (ops_cuda_test.cc, the results against the CPU reference) and
// tree_attention_cuda_test.cc (bit identity across splits, batches and tensor-parallel ranks).
#ifndef SPECD_TESTS_GPU_TREE_ATTENTION_BATCH_H_
#define SPECD_TESTS_GPU_TREE_ATTENTION_BATCH_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "specd/kernels/cuda/tree_attention.h"
#include "specd/kernels/tree_attention.h"
#include "tests/gpu/gpu_test_util.h"

namespace specd {
namespace gpu_test {

// One sequence of a batch: `committed` cached tokens, then the new queries: a chain of
// `chain` tokens (pending tokens, a prefill chunk, or a decode token), then a tree hanging
// below the chain's last token (parents index the tree; -1 is the chain's last token).
struct SeqSpec {
  int committed = 0;
  int chain = 1;
  std::vector<int32_t> tree_parents;
};

inline std::vector<int32_t> TreeParents(int nodes, int shape, std::mt19937_64& rng) {
  std::vector<int32_t> parents;
  for (int i = 0; i < nodes; ++i) {
    switch (shape) {
      case 0:
        parents.push_back(i - 1);  // chain
        break;
      case 1:
        parents.push_back(-1);  // star: every node a child of the root
        break;
      case 2:
        parents.push_back(i == 0 ? -1 : (i - 1) / 2);  // binary
        break;
      case 4:
        parents.push_back(i < 2 ? -1 : i - 2);  // two interleaved chains
        break;
      default: {
        std::uniform_int_distribution<int32_t> pick(-1, i - 1);
        parents.push_back(pick(rng));
      }
    }
  }
  return parents;
}

struct Shape {
  int num_heads, num_kv_heads, head_dim, block_size;
};

// Tensor-parallel head range of a rank (TreeAttentionParams' fields); all 0 for the full model.
struct HeadSlice {
  int64_t q_head_offset = 0;
  int64_t kv_head_offset = 0;
  int64_t kv_group = 0;
};

// A batch of sequences over a random paged KV cache, in both descriptions (the GPU's masks and
// the CPU reference's ancestor lists).
struct Batch {
  std::vector<int32_t> tables;
  int max_blocks = 1;
  std::vector<float> k_cache, v_cache;  // [num_slots, kv_dim], bf16-exact
  std::vector<int32_t> query_seq, kv_end, mask_begin, prefix_len, tree_key_offsets = {0}, tree_keys;
  std::vector<uint32_t> mask;
  std::vector<float> q;  // [num_queries, q_stride], bf16-exact
  int q_stride = 0;
  int num_queries() const { return static_cast<int>(query_seq.size()); }
};

inline Batch BuildBatch(const Shape& sh, const std::vector<SeqSpec>& seqs, uint64_t seed) {
  Batch b;
  std::mt19937_64 rng(seed);
  const int kv_dim = sh.num_kv_heads * sh.head_dim;
  const int q_dim = sh.num_heads * sh.head_dim;
  // Block tables: each sequence gets enough blocks for all its keys, drawn from a shuffled
  // pool with spare blocks, so logical and physical order differ.
  std::vector<int> need_blocks;
  int total_blocks = 0;
  for (const SeqSpec& s : seqs) {
    const int keys = s.committed + s.chain + static_cast<int>(s.tree_parents.size());
    need_blocks.push_back((keys + sh.block_size - 1) / sh.block_size);
    b.max_blocks = std::max(b.max_blocks, need_blocks.back());
    total_blocks += need_blocks.back();
  }
  const int pool_blocks = total_blocks + 5;
  std::vector<int32_t> pool(pool_blocks);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  const int num_seqs = static_cast<int>(seqs.size());
  // Sequence s uses block-table row num_seqs - 1 - s (rows need not follow batch order).
  b.tables.assign(static_cast<size_t>(num_seqs) * b.max_blocks, -1);
  int next = 0;
  for (int s = 0; s < num_seqs; ++s) {
    for (int k = 0; k < need_blocks[s]; ++k) {
      b.tables[static_cast<size_t>(num_seqs - 1 - s) * b.max_blocks + k] = pool[next++];
    }
  }
  const int64_t num_slots = int64_t{pool_blocks} * sh.block_size;
  b.k_cache = RoundBf16(RandomNormal(num_slots * kv_dim, rng));
  b.v_cache = RoundBf16(RandomNormal(num_slots * kv_dim, rng));

  for (int s = 0; s < num_seqs; ++s) {
    const SeqSpec& spec = seqs[s];
    const int row = num_seqs - 1 - s;
    for (int i = 0; i < spec.chain; ++i) {
      const int end = spec.committed + i + 1;
      b.query_seq.push_back(row);
      b.kv_end.push_back(end);
      b.mask_begin.push_back(end);
      b.mask.insert(b.mask.end(), cuda::kTreeAttentionMaskWords, 0u);
      b.prefix_len.push_back(end);
      b.tree_key_offsets.push_back(static_cast<int32_t>(b.tree_keys.size()));
    }
    const int tree_base = spec.committed + spec.chain;
    const int n = static_cast<int>(spec.tree_parents.size());
    std::vector<std::vector<int32_t>> ancestors(n);
    for (int j = 0; j < n; ++j) {
      const int32_t parent = spec.tree_parents[j];
      if (parent >= 0) ancestors[j] = ancestors[parent];
      ancestors[j].push_back(j);
      std::vector<uint32_t> bits(cuda::kTreeAttentionMaskWords, 0u);
      std::vector<int32_t> sorted = ancestors[j];
      std::sort(sorted.begin(), sorted.end());
      for (int32_t a : sorted) {
        bits[a / 32] |= 1u << (a % 32);
        b.tree_keys.push_back(tree_base + a);
      }
      b.query_seq.push_back(row);
      b.kv_end.push_back(tree_base + j + 1);
      b.mask_begin.push_back(tree_base);
      b.mask.insert(b.mask.end(), bits.begin(), bits.end());
      b.prefix_len.push_back(tree_base);
      b.tree_key_offsets.push_back(static_cast<int32_t>(b.tree_keys.size()));
    }
  }
  // q rows carry padding columns, as in a fused QKV output.
  b.q_stride = q_dim + 2 * kv_dim;
  // Scores with a spread of a few units make the softmax peaky, so that a wrongly masked or
  // dropped key changes the output visibly.
  b.q = RoundBf16(RandomNormal(static_cast<size_t>(b.num_queries()) * b.q_stride, rng, 2.5f));
  return b;
}

// The CPU reference's output [num_queries, num_heads * head_dim] for the full model.
inline std::vector<float> RunTreeAttentionCpu(const Shape& sh, const Batch& b, float scale) {
  const int num_queries = b.num_queries();
  const int q_dim = sh.num_heads * sh.head_dim;
  std::vector<float> q_packed(static_cast<size_t>(num_queries) * q_dim),
      want(static_cast<size_t>(num_queries) * q_dim);
  for (int t = 0; t < num_queries; ++t) {
    std::copy_n(&b.q[static_cast<size_t>(t) * b.q_stride], q_dim,
                &q_packed[static_cast<size_t>(t) * q_dim]);
  }
  TreeAttentionParams ref;
  ref.q = q_packed.data();
  ref.out = want.data();
  ref.kv.k_cache = b.k_cache.data();
  ref.kv.v_cache = b.v_cache.data();
  ref.kv.block_tables = b.tables.data();
  ref.query_seq = b.query_seq.data();
  ref.prefix_len = b.prefix_len.data();
  ref.tree_key_offsets = b.tree_key_offsets.data();
  ref.tree_keys = b.tree_keys.data();
  ref.num_queries = num_queries;
  ref.num_heads = sh.num_heads;
  ref.num_kv_heads = sh.num_kv_heads;
  ref.head_dim = sh.head_dim;
  ref.kv.block_size = sh.block_size;
  ref.kv.max_blocks_per_seq = b.max_blocks;
  ref.scale = scale;
  // The reference is plain loops; spread its (query, head) items over the host's cores.
  const int64_t items = int64_t{num_queries} * sh.num_heads;
  const int64_t workers = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> threads;
  for (int64_t w = 0; w < workers; ++w) {
    threads.emplace_back(
        [&, w] { TreeAttentionCpuItems(ref, items * w / workers, items * (w + 1) / workers); });
  }
  for (std::thread& t : threads) t.join();
  return want;
}

// GPU output [num_queries, num_heads * head_dim] (bf16 values as floats). force_splits: 0
// the plan's choice, 1 unsplit, more: one CTA per chunk (at least that many splits), -c:
// every chunk split, c chunks a CTA. With a slice, sh holds the rank's local head counts, q and the
// caches its heads only. With drop_tiles (generic kernel only), no tiles, split or workspace are
// passed. The output starts as NaN, so an element the kernel does not write never passes.
inline std::vector<float> RunTreeAttentionGpu(
    const Shape& sh, int force_splits, const std::vector<float>& q, int q_stride,
    const std::vector<float>& k_cache, const std::vector<float>& v_cache,
    const std::vector<int32_t>& tables, int max_blocks, const std::vector<int32_t>& query_seq,
    const std::vector<int32_t>& kv_end, const std::vector<int32_t>& mask_begin,
    const std::vector<uint32_t>& mask, float scale, cudaStream_t stream,
    const HeadSlice& slice = HeadSlice(), const std::vector<int32_t>& stable_end = {},
    bool drop_tiles = false) {
  const int num_queries = static_cast<int>(query_seq.size());
  const int q_dim = sh.num_heads * sh.head_dim;

  // GPU.
  int num_sms = 0;
  EXPECT_EQ(cudaSuccess, cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
  cuda::TreeAttentionPlan plan =
      slice.kv_group == 0
          ? cuda::PlanTreeAttention(query_seq.data(), kv_end.data(), num_queries, sh.num_heads,
                                    sh.num_kv_heads, num_sms)
          : cuda::PlanTreeAttention(query_seq.data(), kv_end.data(), num_queries, sh.num_heads,
                                    sh.num_kv_heads, slice.kv_group, num_sms);
  EXPECT_FALSE(plan.tile_begin.empty()) << "no plan";
  if (force_splits == 1) plan.num_splits = 1;
  if (force_splits > 1) {
    plan.num_splits = std::max(
        force_splits, cuda::TreeAttentionChunks(*std::max_element(kv_end.begin(), kv_end.end())));
    plan.chunks_per_cta = 1;
  }
  if (force_splits < 0) {  // every chunk split, -force_splits chunks a CTA
    plan.num_splits =
        std::max(2, cuda::TreeAttentionChunks(*std::max_element(kv_end.begin(), kv_end.end())));
    plan.chunks_per_cta = -force_splits;
  }
  DeviceBuffer<bf16> d_q(ToBf16(q)), d_k(ToBf16(k_cache)), d_v(ToBf16(v_cache));
  const int out_stride = q_dim + 6;
  DeviceBuffer<bf16> d_out(static_cast<size_t>(num_queries) * out_stride);
  EXPECT_EQ(cudaSuccess, cudaMemset(d_out.get(), 0xff, d_out.size() * sizeof(bf16)));  // NaN
  DeviceBuffer<int32_t> d_tables(tables), d_query_seq(query_seq), d_kv_end(kv_end),
      d_mask_begin(mask_begin), d_tile_begin(plan.tile_begin), d_tile_end(plan.tile_end);
  DeviceBuffer<uint32_t> d_mask(mask);
  DeviceBuffer<int32_t> d_stable(stable_end.empty() ? std::vector<int32_t>{0} : stable_end);
  DeviceBuffer<float> d_ws(std::max<int64_t>(
      1,
      cuda::TreeAttentionWorkspaceFloats(plan.num_splits, num_queries, sh.num_heads, sh.head_dim)));
  cuda::TreeAttentionParams p;
  p.q = d_q.get();
  p.q_stride = q_stride;
  p.out = d_out.get();
  p.out_stride = out_stride;
  p.kv.k_cache = d_k.get();
  p.kv.v_cache = d_v.get();
  p.kv.block_tables = d_tables.get();
  p.kv.max_blocks_per_seq = max_blocks;
  p.kv.block_size = sh.block_size;
  p.query_seq = d_query_seq.get();
  p.kv_end = d_kv_end.get();
  p.mask_begin = d_mask_begin.get();
  p.mask = d_mask.get();
  p.kv_stable_end = stable_end.empty() ? nullptr : d_stable.get();
  p.tile_begin = d_tile_begin.get();
  p.tile_end = d_tile_end.get();
  p.num_tiles = static_cast<int64_t>(plan.tile_begin.size());
  p.num_splits = plan.num_splits;
  p.chunks_per_cta = plan.chunks_per_cta;
  p.workspace = d_ws.get();
  // As the backend runs it: the combine drops the workspace from L2 after its merges.
  p.discard_workspace = true;
  p.num_queries = num_queries;
  p.num_heads = sh.num_heads;
  p.num_kv_heads = sh.num_kv_heads;
  p.head_dim = sh.head_dim;
  p.scale = scale;
  p.q_head_offset = slice.q_head_offset;
  p.kv_head_offset = slice.kv_head_offset;
  p.kv_group = slice.kv_group;
  if (drop_tiles) {
    p.tile_begin = p.tile_end = nullptr;
    p.num_tiles = 0;
    p.num_splits = p.chunks_per_cta = 1;
    p.workspace = nullptr;
  }
  EXPECT_EQ(cudaSuccess, cuda::TreeAttentionCuda(p, stream));
  EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(stream));
  const std::vector<float> out = ToFloat(d_out.Download());
  std::vector<float> got(static_cast<size_t>(num_queries) * q_dim);
  for (int t = 0; t < num_queries; ++t) {
    std::copy_n(&out[static_cast<size_t>(t) * out_stride], q_dim,
                &got[static_cast<size_t>(t) * q_dim]);
  }
  return got;
}

inline const Shape kShapes[] = {
    {7, 1, 64, 16},    // group of 7, one KV head
    {12, 4, 128, 16},  // group of 3
    {28, 4, 128, 32},  // group of 7 (Qwen2.5-7B-like)
    {5, 5, 64, 8},     // no grouping
    {32, 8, 128, 16},  // Llama-3-8B-like
    {4, 2, 32, 16},    // the reference draft model (models/pycoder-draft)
    {3, 1, 16, 16},    // the transformers fixtures (llama31, qwen2)
    {5, 1, 16, 8},     // group of 5 (the qwen3 fixture)
    {8, 2, 128, 12},   // a block size that is not a power of two (the loads divide)
};

// Head sizes of the generic kernel (no MMA build): one to four dim pairs a lane, lanes partly
// idle, sizes that are not multiples of 4 or 8.
inline const Shape kGenericShapes[] = {
    {5, 1, 8, 16},    // the mistral fixture: head_dim 8, group of 5
    {6, 2, 24, 16},   // group of 3
    {3, 3, 80, 8},    // no grouping (Phi-2-like head); two dim pairs a lane
    {12, 4, 96, 32},  // Phi-3-like head
    {7, 1, 2, 16},    // the smallest head, group of 7
    {4, 1, 6, 16},    // not a multiple of 4
    {9, 3, 200, 16},  // four dim pairs a lane, the last one partly used
    {4, 2, 256, 16},  // the largest (Gemma-like)
};

// The batches the tests below run, on the MMA kernel's shapes and on the generic kernel's.
// Decode: five sequences of different committed lengths, one new token each.
inline std::vector<SeqSpec> DecodeBatch() {
  std::vector<SeqSpec> seqs;
  for (int committed : {0, 16, 300, 1000, 5001}) {
    SeqSpec s;
    s.committed = committed;
    s.chain = 1;
    seqs.push_back(s);
  }
  return seqs;
}

// Prefill: chains from an empty cache, after a short prefix, and a single token.
inline std::vector<SeqSpec> PrefillBatch() {
  std::vector<SeqSpec> seqs(3);
  seqs[0].committed = 0;
  seqs[0].chain = 130;
  seqs[1].committed = 37;
  seqs[1].chain = 77;
  seqs[2].committed = 500;
  seqs[2].chain = 1;
  return seqs;
}

// Trees of 1, 7 and 256 nodes below 1-3 pending tokens; `*shape` counts the trees made so far
// (it picks the committed lengths, and the tree shape among `tree_shapes` of TreeParents').
inline std::vector<SeqSpec> VerifyBatch(int* shape, int tree_shapes, std::mt19937_64& rng) {
  std::vector<SeqSpec> seqs;
  const int committed[3][3] = {{0, 33, 2000}, {517, 0, 40}, {1, 1500, 7}};
  for (int i = 0; i < 3; ++i) {
    const int nodes = i == 0 ? 1 : i == 1 ? 7 : 256;
    SeqSpec s;
    s.committed = committed[*shape % 3][i];
    s.chain = 1 + static_cast<int>(rng() % 3);  // pending tokens before the tree
    s.tree_parents = TreeParents(nodes, (*shape)++ % tree_shapes, rng);
    seqs.push_back(s);
  }
  return seqs;
}

// A 256-node tree alone after 4095 committed keys.
inline SeqSpec LongTree(int shape, std::mt19937_64& rng) {
  SeqSpec s;
  s.committed = 4095;
  s.chain = 1;
  s.tree_parents = TreeParents(256, shape, rng);
  return s;
}

// The batch of VerifyTrees' i-th shape: VerifyBatch replayed from `seed` for shapes 0..i, as a
// loop over the shapes makes them.
inline std::vector<SeqSpec> VerifyBatchAt(int i, int tree_shapes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  int shape = 0;
  std::vector<SeqSpec> seqs;
  for (int j = 0; j <= i; ++j) seqs = VerifyBatch(&shape, tree_shapes, rng);
  return seqs;
}

// LargeTreesOverLongContext's i-th tree: LongTree replayed from `seed` as its loop makes them,
// shapes 2 and 3 for each head shape in turn (tree i has shape 2 + i % 2).
inline SeqSpec LongTreeAt(int i, uint64_t seed) {
  std::mt19937_64 rng(seed);
  SeqSpec s;
  for (int j = 0; j <= i; ++j) s = LongTree(2 + j % 2, rng);
  return s;
}

}  // namespace gpu_test
}  // namespace specd

#endif  // SPECD_TESTS_GPU_TREE_ATTENTION_BATCH_H_
